"""Chameleon's VQGAN (Anole, Lumina-mGPT): tiny checkpoints written in both public layouts -- Meta's original
``vqgan.ckpt`` (``{"state_dict": ...}``) + ``vqgan.yaml``, and a transformers-format folder (``config.json`` with
model_type ``chameleon_vqgan`` + safetensors) -- with key names and shapes listed here from the original definition
(not taken from the module under test), converted, and checked against an independent functional re-implementation
of the original encoder and decoder written with ``torch.nn.functional`` on the original state dict."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from safetensors.torch import save_file

from spatial_pipelines import ChameleonVQModel
from spatial_pipelines.models import (
    chameleon_vq_from_hf,
    chameleon_vq_from_original,
    load_chameleon_vq,
    tiny_chameleon_vq,
)

from helpers import load_script

# tiny, but with the original's hard-coded GroupNorm(32): level widths 32 and 64
CH, CH_MULT, NRB, Z, EMBED, V, RES, GROUPS = 32, (1, 2), 1, 8, 4, 16, 16, 32


def taming_shapes(attn_resolutions=()):
    """Key -> shape of taming-transformers' ``VQModel`` (Chameleon's ``vqgan.py``) for the tiny config."""
    shapes = {}

    def conv(name, cin, cout, k):
        shapes[name + ".weight"], shapes[name + ".bias"] = (cout, cin, k, k), (cout,)

    def norm(name, c):
        shapes[name + ".weight"], shapes[name + ".bias"] = (c,), (c,)

    def res(name, cin, cout):
        norm(name + ".norm1", cin)
        conv(name + ".conv1", cin, cout, 3)
        norm(name + ".norm2", cout)
        conv(name + ".conv2", cout, cout, 3)
        if cin != cout:
            conv(name + ".nin_shortcut", cin, cout, 1)

    def attn(name, c):
        norm(name + ".norm", c)
        for m in ("q", "k", "v", "proj_out"):
            conv(f"{name}.{m}", c, c, 1)

    def mid(prefix, c):
        res(prefix + ".mid.block_1", c, c)
        attn(prefix + ".mid.attn_1", c)
        res(prefix + ".mid.block_2", c, c)

    levels = len(CH_MULT)
    conv("encoder.conv_in", 3, CH, 3)
    curr, in_mult = RES, (1,) + CH_MULT
    for i in range(levels):
        block_in, block_out = CH * in_mult[i], CH * CH_MULT[i]
        for j in range(NRB):
            res(f"encoder.down.{i}.block.{j}", block_in, block_out)
            block_in = block_out
            if curr in attn_resolutions:
                attn(f"encoder.down.{i}.attn.{j}", block_out)
        if i != levels - 1:
            conv(f"encoder.down.{i}.downsample.conv", block_out, block_out, 3)
            curr //= 2
    mid("encoder", block_in)
    norm("encoder.norm_out", block_in)
    conv("encoder.conv_out", block_in, Z, 3)

    block_in, curr = CH * CH_MULT[-1], RES // 2 ** (levels - 1)
    conv("decoder.conv_in", Z, block_in, 3)
    mid("decoder", block_in)
    for i in reversed(range(levels)):
        block_out = CH * CH_MULT[i]
        for j in range(NRB + 1):
            res(f"decoder.up.{i}.block.{j}", block_in, block_out)
            block_in = block_out
            if curr in attn_resolutions:
                attn(f"decoder.up.{i}.attn.{j}", block_out)
        if i != 0:
            conv(f"decoder.up.{i}.upsample.conv", block_out, block_out, 3)
            curr *= 2
    norm("decoder.norm_out", block_in)
    conv("decoder.conv_out", block_in, 3, 3)
    shapes["quantize.embedding.weight"] = (V, EMBED)
    conv("quant_conv", Z, EMBED, 1)
    conv("post_quant_conv", EMBED, Z, 1)
    return shapes


def random_state_dict(attn_resolutions=(), seed=0):
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, shape in taming_shapes(attn_resolutions).items():
        x = torch.randn(*shape, generator=g)
        if name.endswith(".bias"):
            x = 0.1 * x
        elif len(shape) == 4:  # conv weight: unit-ish gain
            x = x / (shape[1] * shape[2] * shape[3]) ** 0.5
        elif name != "quantize.embedding.weight":  # GroupNorm scale
            x = 1 + 0.1 * x
        sd[name] = x
    return sd


# --- the original computation, written out on the state dict -------------------------------------------------------


def _conv(sd, h, name, pad=0, stride=1):
    return F.conv2d(h, sd[name + ".weight"], sd[name + ".bias"], stride=stride, padding=pad)


def _swish(h):
    return h * torch.sigmoid(h)


def _norm(sd, h, name):
    return F.group_norm(h, GROUPS, sd[name + ".weight"], sd[name + ".bias"], eps=1e-6)


def _res(sd, h, name):
    y = _conv(sd, _swish(_norm(sd, h, name + ".norm1")), name + ".conv1", 1)
    y = _conv(sd, _swish(_norm(sd, y, name + ".norm2")), name + ".conv2", 1)
    return (_conv(sd, h, name + ".nin_shortcut") if name + ".nin_shortcut.weight" in sd else h) + y


def _attn(sd, h, name):
    b, c, hh, ww = h.shape
    n = _norm(sd, h, name + ".norm")
    q, k, v = (_conv(sd, n, f"{name}.{m}").reshape(b, c, hh * ww) for m in "qkv")
    w = torch.bmm(q.permute(0, 2, 1), k).mul(c**-0.5).softmax(dim=2)  # (B, HW_q, HW_k)
    out = torch.bmm(v, w.permute(0, 2, 1)).reshape(b, c, hh, ww)
    return h + _conv(sd, out, name + ".proj_out")


def _mid(sd, h, prefix):
    return _res(sd, _attn(sd, _res(sd, h, prefix + ".mid.block_1"), prefix + ".mid.attn_1"), prefix + ".mid.block_2")


def reference_encode_indices(sd, pixels):
    h = _conv(sd, pixels, "encoder.conv_in", 1)
    for i in range(len(CH_MULT)):
        for j in range(NRB):
            h = _res(sd, h, f"encoder.down.{i}.block.{j}")
            if f"encoder.down.{i}.attn.{j}.q.weight" in sd:
                h = _attn(sd, h, f"encoder.down.{i}.attn.{j}")
        if i != len(CH_MULT) - 1:
            h = _conv(sd, F.pad(h, (0, 1, 0, 1)), f"encoder.down.{i}.downsample.conv", stride=2)
    h = _mid(sd, h, "encoder")
    z = _conv(sd, _conv(sd, _swish(_norm(sd, h, "encoder.norm_out")), "encoder.conv_out", 1), "quant_conv")
    z = z.permute(0, 2, 3, 1)  # (B, H, W, d)
    e = sd["quantize.embedding.weight"]
    return ((z[..., None, :] - e) ** 2).sum(-1).argmin(-1)  # plain Euclidean, no normalisation


def reference_decode(sd, codes):
    """``embedding[codes] -> post_quant_conv -> decoder`` (unclamped)."""
    h = sd["quantize.embedding.weight"][codes].permute(0, 3, 1, 2)
    h = _conv(sd, _conv(sd, h, "post_quant_conv"), "decoder.conv_in", 1)
    h = _mid(sd, h, "decoder")
    for i in reversed(range(len(CH_MULT))):
        for j in range(NRB + 1):
            h = _res(sd, h, f"decoder.up.{i}.block.{j}")
            if f"decoder.up.{i}.attn.{j}.q.weight" in sd:
                h = _attn(sd, h, f"decoder.up.{i}.attn.{j}")
        if i != 0:
            h = _conv(sd, F.interpolate(h, scale_factor=2.0, mode="nearest"), f"decoder.up.{i}.upsample.conv", 1)
    return _conv(sd, _swish(_norm(sd, h, "decoder.norm_out")), "decoder.conv_out", 1)


# --- checkpoint writers -------------------------------------------------------------------------------------------


def vqgan_yaml(attn_resolutions=()):
    """Chameleon's ``vqgan.yaml`` structure at the tiny size."""
    return {
        "model": {
            "target": "taming.models.vqgan.VQModel",
            "params": {
                "embed_dim": EMBED,
                "n_embed": V,
                "ddconfig": {
                    "double_z": False, "z_channels": Z, "resolution": RES, "in_channels": 3, "out_ch": 3, "ch": CH,
                    "ch_mult": list(CH_MULT), "num_res_blocks": NRB, "attn_resolutions": list(attn_resolutions),
                    "dropout": 0.0,
                },
                "lossconfig": {"target": "taming.modules.losses.vqperceptual.VQLPIPSWithDiscriminator", "params": {}},
            },
        }
    }


def hf_config(attn_resolutions=()):
    """A transformers ``ChameleonVQVAEConfig`` dict (model_type ``chameleon_vqgan``) at the tiny size."""
    return {
        "model_type": "chameleon_vqgan", "architectures": ["ChameleonVQVAE"], "embed_dim": EMBED, "num_embeddings": V,
        "double_latent": False, "latent_channels": Z, "resolution": RES, "in_channels": 3, "out_channels": 3,
        "base_channels": CH, "channel_multiplier": list(CH_MULT), "num_res_blocks": NRB,
        "attn_resolutions": list(attn_resolutions), "dropout": 0.0, "attn_type": "vanilla", "initializer_range": 0.02,
    }


def write_original(folder: Path, attn_resolutions=(), seed=0):
    sd = random_state_dict(attn_resolutions, seed)
    folder.mkdir(parents=True, exist_ok=True)
    extra = {"loss.discriminator.main.0.weight": torch.zeros(2, 3, 4, 4)}  # training-only entries: dropped
    torch.save({"state_dict": {**sd, **extra}, "global_step": 7}, folder / "vqgan.ckpt")
    (folder / "vqgan.yaml").write_text(yaml.safe_dump(vqgan_yaml(attn_resolutions)))
    return sd


def write_hf(folder: Path, attn_resolutions=(8,), seed=1):
    sd = random_state_dict(attn_resolutions, seed)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf_config(attn_resolutions)))
    save_file(sd, str(folder / "model.safetensors"))
    return sd


def run_converter(*args):
    load_script("convert_chameleon_vqgan.py").main([str(a) for a in args])


def pixels(b=2, seed=3, size=RES):
    return torch.rand(b, 3, size, size, generator=torch.Generator().manual_seed(seed)) * 2 - 1


# --- tests ----------------------------------------------------------------------------------------------------------


@torch.no_grad()
def test_original_checkpoint_converts_to_the_original_computation(tmp_path, capsys):
    sd = write_original(tmp_path / "tokenizer")
    run_converter(tmp_path, "--out", tmp_path / "out")  # Chameleon's download root: tokenizer/vqgan.{ckpt,yaml}
    assert "16 codes x 4, downsample 2" in capsys.readouterr().out
    assert (tmp_path / "out" / "diffusion_pytorch_model.safetensors").is_file()
    vq = ChameleonVQModel.from_pretrained(tmp_path / "out")
    assert not vq.training and vq.downsample_factor == 2 and vq.config.attn_resolutions == []
    torch.testing.assert_close(vq.codebook, sd["quantize.embedding.weight"], rtol=0, atol=0)  # no normalisation

    codes = torch.randint(0, V, (2, 3, 5), generator=torch.Generator().manual_seed(0))  # non-square grids decode too
    want = reference_decode(sd, codes)
    assert want.abs().max() > 1  # the clamp below is exercised
    torch.testing.assert_close(vq.decode(vq.codebook[codes].permute(0, 3, 1, 2)), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(vq.decode_code(codes), want.clamp(-1, 1), rtol=1e-4, atol=1e-4)

    x = pixels()
    enc = vq.encode(x)
    assert torch.equal(enc.indices, reference_encode_indices(sd, x))
    torch.testing.assert_close(enc.quant, vq.codebook[enc.indices].permute(0, 3, 1, 2))
    image, enc2 = vq(x)  # forward = encode + decode
    assert torch.equal(enc2.indices, enc.indices)
    torch.testing.assert_close(image, vq.decode_code(enc.indices))


@torch.no_grad()
def test_hf_folder_converts_with_level_attention_and_matches_transformers_encoder(tmp_path):
    from transformers import ChameleonVQVAEConfig
    from transformers.models.chameleon.modeling_chameleon import ChameleonVQVAE

    sd = write_hf(tmp_path / "vq-hf", attn_resolutions=(8,))
    assert "decoder.up.1.attn.0.q.weight" in sd and "encoder.down.1.attn.0.q.weight" in sd  # attention at 8x8
    run_converter(tmp_path / "vq-hf", "--out", tmp_path / "out", "--dtype", "float32")
    vq = ChameleonVQModel.from_pretrained(tmp_path / "out")
    assert tuple(vq.config.attn_resolutions) == (8,)
    codes = torch.randint(0, V, (2, 8, 8), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(vq.decode_code(codes), reference_decode(sd, codes).clamp(-1, 1), rtol=1e-4, atol=1e-4)
    x = pixels(seed=4)
    assert torch.equal(vq.encode(x).indices, reference_encode_indices(sd, x))

    # transformers' (encoder-only) ChameleonVQVAE takes the same names for everything but the decoder, strictly
    ref = ChameleonVQVAE(ChameleonVQVAEConfig(**{k: v for k, v in hf_config((8,)).items() if k not in ("model_type", "architectures")}))
    ref.load_state_dict({k: v for k, v in sd.items() if not k.startswith("decoder.")}, strict=True)
    tokens = ref.encode(x).image_tokens.reshape(2, RES // 2, RES // 2)
    assert torch.equal(vq.encode(x).indices, tokens)

    # a whole Chameleon/Anole model's weights: the VQ lives under model.vqmodel., other weights are ignored
    full = {f"model.vqmodel.{k}": v for k, v in sd.items()} | {"model.embed_tokens.weight": torch.zeros(3, 2)}
    vq2 = chameleon_vq_from_hf(full, {"model_type": "chameleon", "vq_config": hf_config((8,))})
    torch.testing.assert_close(vq2.decode_code(codes), vq.decode_code(codes))


def test_bad_checkpoints_raise_naming_the_keys(tmp_path):
    sd = random_state_dict()
    cfg = vqgan_yaml()
    missing = dict(sd)
    del missing["decoder.up.1.block.0.conv2.bias"]
    with pytest.raises(ValueError, match=r"missing keys: decoder\.up\.1\.block\.0\.conv2\.bias"):
        chameleon_vq_from_original(missing, cfg)
    with pytest.raises(ValueError, match=r"unexpected keys: decoder\.extra\.weight"):
        chameleon_vq_from_original({**sd, "decoder.extra.weight": torch.zeros(1)}, cfg)
    wrong = {**sd, "quantize.embedding.weight": torch.zeros(V + 1, EMBED)}
    with pytest.raises(ValueError, match=r"quantize\.embedding\.weight \(checkpoint \(17, 4\), model \(16, 4\)\)"):
        chameleon_vq_from_original(wrong, cfg)
    # transformers' own Chameleon conversion drops the decoder: the error says so
    encoder_only = {k: v for k, v in sd.items() if not k.startswith("decoder.")}
    with pytest.raises(ValueError, match="no VQ decoder"):
        chameleon_vq_from_hf(encoder_only, hf_config())
    bad_yaml = vqgan_yaml()
    bad_yaml["model"]["params"]["ddconfig"]["double_z"] = True
    with pytest.raises(ValueError, match="double_z"):
        chameleon_vq_from_original(sd, bad_yaml)
    with pytest.raises(ValueError, match="does not exist"):
        load_chameleon_vq(tmp_path / "nothing")
    torch.save({"state_dict": sd}, tmp_path / "lonely.ckpt")
    with pytest.raises(ValueError, match="config"):
        load_chameleon_vq(tmp_path / "lonely.ckpt")  # no vqgan.yaml beside it


def test_real_config_matches_transformers_encoder_layout():
    """The default config is the released tokenizer's: 16x, 8192 x 256 codes, and transformers' encoder key set."""
    from transformers import ChameleonVQVAEConfig
    from transformers.models.chameleon.modeling_chameleon import ChameleonVQVAE

    with torch.device("meta"):
        ours = ChameleonVQModel()
        theirs = ChameleonVQVAE(ChameleonVQVAEConfig())
    assert ours.downsample_factor == 16 and tuple(ours.codebook.shape) == (8192, 256)
    mine = {k: tuple(v.shape) for k, v in ours.state_dict().items() if not k.startswith("decoder.")}
    assert mine == {k: tuple(v.shape) for k, v in theirs.state_dict().items()}
    assert "decoder.up.4.block.2.conv2.weight" in ours.state_dict() and "decoder.up.1.upsample.conv.weight" in ours.state_dict()


@torch.no_grad()
def test_tiny_model_api(tmp_path):
    state = torch.random.get_rng_state()
    vq = tiny_chameleon_vq(num_codes=12, seed=5)
    assert torch.equal(torch.random.get_rng_state(), state)  # global RNG untouched
    assert torch.equal(vq.codebook, tiny_chameleon_vq(num_codes=12, seed=5).codebook)
    assert not torch.equal(vq.codebook, tiny_chameleon_vq(num_codes=12, seed=6).codebook)
    assert vq.downsample_factor == 2 and tuple(vq.codebook.shape) == (12, 4) and not vq.training

    x = torch.rand(3, 3, 8, 12) * 2 - 1
    enc = vq.encode(x)
    assert enc.indices.shape == (3, 4, 6) and enc.indices.dtype == torch.long
    assert 0 <= int(enc.indices.min()) and int(enc.indices.max()) < 12
    image = vq.decode_code(enc.indices)
    assert image.shape == (3, 3, 8, 12) and image.abs().max() <= 1
    z = vq.quant_conv(vq.encoder(x)).permute(0, 2, 3, 1)  # nearest code in plain Euclidean distance
    assert torch.equal(enc.indices, torch.cdist(z.reshape(-1, 4), vq.codebook).argmin(1).view(3, 4, 6))

    vq.save_pretrained(tmp_path / "tiny")
    again = ChameleonVQModel.from_pretrained(tmp_path / "tiny")
    torch.testing.assert_close(again.decode_code(enc.indices), image, rtol=0, atol=0)
    assert torch.equal(load_chameleon_vq(tmp_path / "tiny").codebook, vq.codebook)

    for dtype in (torch.bfloat16, torch.float64):
        out = ChameleonVQModel.from_pretrained(tmp_path / "tiny", torch_dtype=dtype).decode_code(enc.indices)
        assert out.dtype == dtype
        torch.testing.assert_close(out.float(), image, rtol=0.05, atol=0.05)
        assert ChameleonVQModel.from_pretrained(tmp_path / "tiny", torch_dtype=dtype).encode(x.to(dtype)).indices.shape == (3, 4, 6)

    with pytest.raises(ValueError, match="codes"):
        vq.decode_code(torch.tensor([[[0, 12]]]))
    with pytest.raises(ValueError, match="codes"):
        vq.decode_code(torch.zeros(2, 4))
    with pytest.raises(ValueError, match="pixels"):
        vq.encode(torch.zeros(1, 3, 7, 8))
    with pytest.raises(ValueError, match="norm_num_groups"):
        ChameleonVQModel(base_channels=8, channel_multiplier=(1, 2), norm_num_groups=3)
