"""The converter on tiny checkpoints written in the original LlamaGen format (a ``{"model": state_dict}`` pickle
with the original key names, training-only buffers included), checked against an independent functional
re-implementation of the original forward passes."""


import pytest
import torch
import torch.nn.functional as F

from spatial_pipelines import LlamaGenPipeline, LlamaGenVQModel

from helpers import run_script

D, LAYERS, HEADS, KV_HEADS, FFN, V, GRID = 64, 2, 4, 2, 96, 16, 4


def original_gpt_state_dict(condition: str, seed: int = 0):
    """Random weights under the original GPT key names and shapes (LlamaGen ``gpt.py``)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) * 0.2  # noqa: E731
    hd = D // HEADS
    sd = {"tok_embeddings.weight": r(V, D), "norm.weight": 1 + r(D), "output.weight": r(V, D) * 5}
    if condition == "class":
        sd["cls_embedding.embedding_table.weight"] = r(10 + 1, D)  # 10 classes + the CFG null class
    else:
        sd["cls_embedding.cap_proj.fc1.weight"] = r(D, 24)
        sd["cls_embedding.cap_proj.fc2.weight"] = r(D, D)
        sd["cls_embedding.uncond_embedding"] = r(6, 24)  # 6 caption tokens of width 24
    for i in range(LAYERS):
        p = f"layers.{i}."
        sd[p + "attention.wqkv.weight"] = r((HEADS + 2 * KV_HEADS) * hd, D)
        sd[p + "attention.wo.weight"] = r(D, D)
        sd[p + "feed_forward.w1.weight"] = r(FFN, D)
        sd[p + "feed_forward.w3.weight"] = r(FFN, D)
        sd[p + "feed_forward.w2.weight"] = r(D, FFN)
        sd[p + "attention_norm.weight"] = 1 + r(D)
        sd[p + "ffn_norm.weight"] = 1 + r(D)
    sd["freqs_cis"] = torch.zeros(1)  # some original checkpoints carry buffers the converter must drop
    return sd


def reference_gpt_logits(sd, prefix: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The original LlamaGen GPT forward, written out from its definition: full causal sequence, no cache."""
    hd = D // HEADS
    x = torch.cat([prefix, sd["tok_embeddings.weight"][ids]], 1)
    b, t, _ = x.shape
    p = prefix.shape[1]
    quarter = torch.arange(0, hd // 2, 2)[: hd // 4].float() / (hd // 2)
    freqs = 1.0 / 10000.0**quarter
    rows = torch.arange(GRID)[:, None].float() * freqs
    ang = torch.cat([rows[:, None].expand(-1, GRID, -1), rows[None].expand(GRID, -1, -1)], -1).reshape(GRID * GRID, -1)
    table = torch.cat([torch.zeros(p, hd // 2, 2), torch.stack([ang.cos(), ang.sin()], -1)])[:t]  # prefix: cos=sin=0

    def rope(z):  # (B, T, H, hd)
        zs = z.reshape(*z.shape[:-1], -1, 2)
        c, s = table[None, :, None, :, 0], table[None, :, None, :, 1]
        return torch.stack([zs[..., 0] * c - zs[..., 1] * s, zs[..., 1] * c + zs[..., 0] * s], -1).flatten(3)

    def rms(z, w):
        return z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + 1e-5) * w

    causal = torch.ones(t, t, dtype=torch.bool).tril()
    for i in range(LAYERS):
        pre = f"layers.{i}."
        h = rms(x, sd[pre + "attention_norm.weight"])
        q, k, v = (h @ sd[pre + "attention.wqkv.weight"].T).split([D, KV_HEADS * hd, KV_HEADS * hd], -1)
        q = rope(q.view(b, t, HEADS, hd)).transpose(1, 2)
        k = rope(k.view(b, t, KV_HEADS, hd)).transpose(1, 2).repeat_interleave(HEADS // KV_HEADS, 1)
        v = v.view(b, t, KV_HEADS, hd).transpose(1, 2).repeat_interleave(HEADS // KV_HEADS, 1)
        att = (q @ k.transpose(-1, -2) / hd**0.5).masked_fill(~causal, float("-inf")).softmax(-1)
        x = x + (att @ v).transpose(1, 2).reshape(b, t, D) @ sd[pre + "attention.wo.weight"].T
        h = rms(x, sd[pre + "ffn_norm.weight"])
        x = x + (F.silu(h @ sd[pre + "feed_forward.w1.weight"].T) * (h @ sd[pre + "feed_forward.w3.weight"].T)) @ sd[pre + "feed_forward.w2.weight"].T
    return rms(x, sd["norm.weight"]) @ sd["output.weight"].T


def original_vq_state_dict(seed: int = 0):
    """VQ weights under the original key names (VQ-16 structure at tiny width, GroupNorm(32) as the original)."""
    torch.manual_seed(seed)
    model = LlamaGenVQModel(
        codebook_size=V, codebook_embed_dim=4, encoder_ch_mult=(1, 2), decoder_ch_mult=(1, 2), z_channels=32,
        base_channels=32, num_res_blocks=1,
    )
    sd = {k: v + 0.05 * torch.randn_like(v) for k, v in model.state_dict().items()}
    sd["quantize.embedding.weight"] = torch.randn(V, 4)  # not normalised: the original normalises on use
    sd["quantize.codebook_used"] = torch.zeros(65536)  # training-only buffer of the original
    return sd


def reference_vq_decode(sd, codes: torch.Tensor) -> torch.Tensor:
    """The original VQ decode (``decode_code``) written out: normalised codes -> post-quant conv -> decoder."""

    def conv(h, name, pad=0):
        return F.conv2d(h, sd[name + ".weight"], sd[name + ".bias"], padding=pad)

    def norm(h, name):
        return F.group_norm(h, 32, sd[name + ".weight"], sd[name + ".bias"], eps=1e-6)

    def res(h, name):
        y = conv(F.silu(norm(h, name + ".norm1")), name + ".conv1", 1)
        y = conv(F.silu(norm(y, name + ".norm2")), name + ".conv2", 1)
        return (conv(h, name + ".nin_shortcut") if name + ".nin_shortcut.weight" in sd else h) + y

    def attn(h, name):
        b, c, hh, ww = h.shape
        n = norm(h, name + ".norm")
        q, k, v = (conv(n, f"{name}.{m}").reshape(b, c, hh * ww) for m in "qkv")
        w = (q.transpose(1, 2) @ k * c**-0.5).softmax(-1)  # (B, HW_q, HW_k)
        return h + conv((v @ w.transpose(1, 2)).reshape(b, c, hh, ww), name + ".proj_out")

    z = F.normalize(sd["quantize.embedding.weight"], dim=-1)[codes].permute(0, 3, 1, 2)
    h = conv(conv(z, "post_quant_conv"), "decoder.conv_in", 1)
    h = res(attn(res(h, "decoder.mid.0"), "decoder.mid.1"), "decoder.mid.2")
    for level in range(2):  # conv_blocks[0] is the coarsest level, with attention
        for j in range(2):
            h = res(h, f"decoder.conv_blocks.{level}.res.{j}")
            if level == 0:
                h = attn(h, f"decoder.conv_blocks.{level}.attn.{j}")
        if level == 0:
            h = conv(F.interpolate(h, scale_factor=2.0, mode="nearest"), f"decoder.conv_blocks.{level}.upsample.conv", 1)
    return conv(F.silu(norm(h, "decoder.norm_out")), "decoder.conv_out", 1)


@pytest.fixture
def checkpoints(tmp_path):
    def write(condition):
        gpt, vq = original_gpt_state_dict(condition), original_vq_state_dict()
        torch.save({"model": gpt, "steps": 10}, tmp_path / f"{condition}_gpt.pt")
        torch.save({"model": vq}, tmp_path / "vq.pt")
        return gpt, vq, tmp_path / f"{condition}_gpt.pt", tmp_path / "vq.pt"

    return write


def run_converter(*args):
    return run_script("convert_llamagen.py", *args)


@torch.no_grad()
def test_convert_class_checkpoint_reproduces_original(checkpoints, tmp_path):
    gpt, vq, gpt_path, vq_path = checkpoints("class")
    out = run_converter("--gpt-ckpt", gpt_path, "--vq-ckpt", vq_path, "--num-heads", HEADS,
                        "--image-size", 2 * GRID, "--downsample-size", 2, "--out", tmp_path / "pipe")
    assert "class-conditional" in out.stdout
    pipe = LlamaGenPipeline.from_pretrained(tmp_path / "pipe")
    cfg = pipe.transformer.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_key_value_heads, cfg.intermediate_size, cfg.num_classes) == (LAYERS, D, KV_HEADS, FFN, 10)
    labels = torch.tensor([3, 10])  # a class and the CFG null class
    ids = torch.randint(0, V, (2, GRID * GRID - 1))
    prefix = gpt["cls_embedding.embedding_table.weight"][labels][:, None]
    want = reference_gpt_logits(gpt, prefix, ids)
    emb = torch.cat([pipe.transformer.embed_condition(labels), pipe.transformer.embed_image_tokens(ids)], 1)
    got = pipe.transformer.compute_logits(pipe.transformer(emb, torch.arange(emb.shape[1])).hidden_states)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    codes = torch.randint(0, V, (2, GRID, GRID))
    torch.testing.assert_close(pipe.vqvae.decode_code(codes), reference_vq_decode(vq, codes), rtol=1e-4, atol=1e-4)
    # the converted pipeline generates: greedy with the original's CFG equals a greedy loop over the reference
    tokens = pipe(3, guidance_scale=4.0, temperature=0, output_type="latent").tokens.reshape(1, -1)
    seq = torch.zeros(1, 0, dtype=torch.long)
    for _ in range(GRID * GRID):
        logits = reference_gpt_logits(gpt, gpt["cls_embedding.embedding_table.weight"][labels][:, None], seq.repeat(2, 1))[:, -1]
        seq = torch.cat([seq, (logits[1] + 4.0 * (logits[0] - logits[1])).argmax()[None, None]], 1)
    assert torch.equal(tokens, seq)


@torch.no_grad()
def test_convert_text_checkpoint_reproduces_original(checkpoints, tmp_path):
    gpt, _, gpt_path, vq_path = checkpoints("text")
    pipe = LlamaGenPipeline.from_backbone(gpt_path, vq_checkpoint=vq_path, num_attention_heads=HEADS, image_size=2 * GRID, downsample_size=2)
    assert pipe.transformer.config.condition_type == "text" and pipe.transformer.config.num_condition_tokens == 6
    caption = torch.randn(1, 6, 24)
    fc1, fc2 = gpt["cls_embedding.cap_proj.fc1.weight"], gpt["cls_embedding.cap_proj.fc2.weight"]
    prefix = F.gelu(caption @ fc1.T, approximate="tanh") @ fc2.T
    ids = torch.randint(0, V, (1, 5))
    want = reference_gpt_logits(gpt, prefix, ids)
    emb = torch.cat([pipe.transformer.embed_condition(caption), pipe.transformer.embed_image_tokens(ids)], 1)
    got = pipe.transformer.compute_logits(pipe.transformer(emb, torch.arange(11)).hidden_states)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(pipe.transformer.cls_embedding.uncond_embedding, gpt["cls_embedding.uncond_embedding"])


def test_converter_rejects_bad_arguments(checkpoints, tmp_path):
    _, _, gpt_path, vq_path = checkpoints("class")
    with pytest.raises(ValueError, match="vq_checkpoint"):
        LlamaGenPipeline.from_backbone(gpt_path, num_attention_heads=HEADS)
    with pytest.raises(ValueError, match="head count"):
        LlamaGenPipeline.from_backbone(gpt_path, vq_checkpoint=vq_path, image_size=8, downsample_size=2)
    with pytest.raises(ValueError, match="gpt_model"):
        LlamaGenPipeline.from_backbone(gpt_path, vq_checkpoint=vq_path, gpt_model="GPT-XL", image_size=8, downsample_size=2)
    with pytest.raises(ValueError, match="downsample_size"):
        LlamaGenPipeline.from_backbone(gpt_path, vq_checkpoint=vq_path, num_attention_heads=HEADS, image_size=8, downsample_size=4)
    with pytest.raises(ValueError, match="does not exist"):
        LlamaGenPipeline.from_backbone(tmp_path / "missing.pt", vq_checkpoint=vq_path)
