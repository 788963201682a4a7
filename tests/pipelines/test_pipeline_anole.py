"""Anole (transformers `ChameleonForConditionalGeneration` + our `ChameleonVQModel`): the shared pipeline contract, image
tokens mapped by name, Chameleon's prompt and CFG rows, token-for-token agreement with a plain reference loop over
the transformers model (full recompute, no cache, ``lm_head`` restricted to the image columns), the transformers
checkpoint layout plus a VQ checkpoint (folders, and repo ids in an offline Hub cache), VQ decoding, CPU offload.

`chameleon_reference_greedy` serves `test_pipeline_lumina_mgpt.py` too."""

import json

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import save_file
from transformers.models.chameleon.modeling_chameleon import ChameleonImageVocabularyMapping

from spatial_pipelines import AnolePipeline, AutoregressiveDecoder, ChameleonVQModel, JacobiDecoder, MedusaDecoder
from spatial_pipelines.pipelines.transformers_utils import GROUPED_SDPA
from spatial_pipelines.testing import dummy_pipeline

from helpers import (
    PipelineTesterMixin,
    chameleon_reference_greedy,
    code_ids_from_names,
    gen,
    lay_out_hub_cache,
    write_transformers_repo,
)

PROMPTS = ["a red fox", "blue sky", "x"]  # different lengths: left padding


class TestAnolePipeline(PipelineTesterMixin):
    family = "anole"
    pipeline_class = AnolePipeline
    prompts = PROMPTS
    bad_prompts = [([1, 2], "prompt"), (["ok", 3], "prompt")]
    failing_component = "vqgan"

    def test_defaults_travel_with_the_transformer(self, tmp_path):
        pipe = self.get_pipeline(grid=(3, 5))
        pipe.save_pretrained(tmp_path / "pipe")
        for p in (AnolePipeline(**pipe.components), AnolePipeline.from_pretrained(tmp_path / "pipe")):
            b = p.backbone
            assert (b.layout.height, b.layout.width, b.layout.has_eol) == (3, 5, False)
            assert b.default_guidance_scale == 3.0 and b.default_top_k is None
        index = json.loads((tmp_path / "pipe" / "model_index.json").read_text())
        assert index["transformer"] == ["transformers", "ChameleonForConditionalGeneration"]
        assert index["processor"] == ["transformers", "ChameleonProcessor"]
        assert index["vqgan"] == ["spatial_pipelines", "ChameleonVQModel"]


# -- image tokens are mapped by name; the model's own forward masks them -----------------------------------------------
def test_transformers_forward_masks_image_logits():
    """Why the adapter applies ``lm_head`` itself: transformers' forward sets every image-token logit to finfo.min."""
    pipe = dummy_pipeline("anole")
    model = pipe.transformer
    ids = code_ids_from_names(model.config.vocabulary_map)
    logits = model(input_ids=torch.tensor([[0, 30, 31]])).logits
    assert (logits[..., ids] == torch.finfo(logits.dtype).min).all()


def test_mapping_with_a_missing_image_token_is_refused():
    pipe = dummy_pipeline("anole")
    vocab = {k: v for k, v in pipe.transformer.config.vocabulary_map.items() if k != "IMGIMGDZ"}  # code 3
    pipe.transformer.config.vocabulary_map = vocab
    pipe.transformer.model.vocabulary_mapping = ChameleonImageVocabularyMapping(vocab)
    with pytest.raises(ValueError, match="IMGIMG"):
        pipe("a fox")


# -- the prompt and the CFG rows ------------------------------------------------------------------------------------
def test_prompt_is_chameleons_text_turn_then_begin_image():
    """``BOS text <reserved08706> <racm3:break>`` (what ChameleonProcessor gives for text, then the image start); the
    unconditional row ``BOS <racm3:break>``; a negative prompt in the prompt's format; left padding."""
    pipe = dummy_pipeline("anole")
    vocab = pipe.transformer.config.vocabulary_map
    backbone = pipe.backbone
    ids, valid = backbone.prompt_ids(["a red fox", "x"], None, True, torch.device("cpu"))
    for row, text in enumerate(["a red fox", "x"]):
        processor_ids = pipe.processor(text=text).input_ids[0].tolist()
        assert processor_ids[0] == vocab["<s>"] and processor_ids[-1] == vocab["<reserved08706>"]
        assert ids[row][valid[row]].tolist() == processor_ids + [vocab["<racm3:break>"]]
    for row in (2, 3):
        assert ids[row][valid[row]].tolist() == [vocab["<s>"], vocab["<racm3:break>"]]
        assert not valid[row, :-2].any()
    neg, neg_valid = backbone.prompt_ids(["a red fox"], ["blue sky"], True, torch.device("cpu"))
    assert neg[1][neg_valid[1]].tolist() == backbone.condition_ids("blue sky")
    emb = backbone.encode_prompt(["a red fox", "x"], None, True, torch.device("cpu"))
    torch.testing.assert_close(emb.embeds, pipe.transformer.get_input_embeddings()(ids))


@pytest.mark.parametrize("prompts,guidance_scale,negative", [
    (["a red fox", "x"], 3.0, None),  # Chameleon's unconditional row, batch with left padding
    (["a red fox"], 3.0, ["blue sky"]),  # a negative prompt
    (["blue sky"], 1.0, None),  # no CFG
], ids=["cfg-batch", "cfg-negative", "no-cfg"])
def test_greedy_equals_the_reference_loop(prompts, guidance_scale, negative):
    """Invariant 1 against the plain transformers loop: token for token, for the AR decoder and a speculative one."""
    pipe = dummy_pipeline("anole", grid=(4, 5))
    ref = chameleon_reference_greedy(pipe, prompts, guidance_scale, negative)
    assert ref.unique().numel() > 1
    for decoder in (AutoregressiveDecoder(), JacobiDecoder(window_size=4)):
        pipe.decoder = decoder
        out = pipe(prompts, negative_prompt=negative, guidance_scale=guidance_scale, temperature=0, output_type="latent")
        assert torch.equal(out.tokens, ref), type(decoder).__name__


# -- pixels ------------------------------------------------------------------------------------------------------------
def test_decode_image_is_the_vq_decoder_and_encode_gives_codes():
    pipe = dummy_pipeline("anole", grid=(4, 5))
    tokens = pipe("a fox", generator=gen(0), output_type="latent").tokens  # (1, 4, 5)
    pixels = pipe.backbone.decode_image(tokens)
    torch.testing.assert_close(pixels, pipe.vqgan.decode_code(tokens))
    assert pixels.shape == (1, 3, 8, 10) and pixels.min() >= -1 and pixels.max() <= 1
    images = pipe("a fox", generator=gen(0), output_type="pt").images
    torch.testing.assert_close(images, (pixels.clamp(-1, 1) + 1) / 2)
    codes = pipe.backbone.encode_image(pixels)
    assert codes.shape == (1, 20) and torch.equal(codes, pipe.vqgan.encode(pixels).indices.flatten(1))


def test_model_cpu_offload_onloads_the_modules_the_loop_calls(monkeypatch):
    """Offload hooks fire on a component's top-level forward, which the loop never calls: the backbone runs the
    transformer's and the VQGAN's hooks itself (checked on the CPU, where the modules are always "there": pretending
    they are not makes the backbone ask the hooks; the output is unchanged)."""
    from spatial_pipelines.pipelines import transformers_utils

    pipe = dummy_pipeline("anole")
    ref = pipe("a red fox", generator=gen(0), output_type="np").images
    pipe.enable_model_cpu_offload(device="cpu")
    calls = []
    for module in (pipe.transformer, pipe.vqgan):
        hook = module._hf_hook
        original = hook.pre_forward
        hook.pre_forward = lambda m, *a, _o=original, **k: (calls.append(m), _o(m, *a, **k))[1]
    monkeypatch.setattr(transformers_utils, "same_device", lambda a, b: False)
    out = pipe("a red fox", generator=gen(0), output_type="np").images
    np.testing.assert_array_equal(out, ref)
    assert pipe.transformer in calls and pipe.vqgan in calls


def test_attention_that_cannot_take_tree_masks_is_switched_to_sdpa():
    from spatial_pipelines.testing import dummy_chameleon_components

    components = dummy_chameleon_components()
    components["transformer"].config._attn_implementation = "flex_attention"
    pipe = AnolePipeline(**components, decoder=JacobiDecoder(window_size=3))
    assert pipe.transformer.config._attn_implementation == GROUPED_SDPA  # sdpa, its GQA trunk grouped
    with pytest.raises(ValueError, match="vqgan"):
        AnolePipeline(**{**components, "vqgan": torch.nn.Linear(2, 2)}, decoder=AutoregressiveDecoder())


# -- loading the transformers repo layout + a VQ checkpoint -------------------------------------------------------------
def tiny_vq_with_32_groups(num_codes=16, seed=0):
    """A tiny VQGAN with the original's hard-coded GroupNorm(32) (level widths 32, 64): what the original and the
    transformers-format VQ layouts can describe."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return ChameleonVQModel(codebook_size=num_codes, embed_dim=4, z_channels=8, base_channels=32,
                                channel_multiplier=(1, 2), num_res_blocks=1, resolution=8).eval()


def write_hf_vq_repo(vq, folder):
    """A transformers-format VQ repo (``config.json`` model_type ``chameleon_vqgan`` + safetensors, unprefixed keys)."""
    folder.mkdir(parents=True)
    c = vq.config
    (folder / "config.json").write_text(json.dumps({
        "model_type": "chameleon_vqgan", "embed_dim": c.embed_dim, "num_embeddings": c.codebook_size,
        "latent_channels": c.z_channels, "base_channels": c.base_channels, "channel_multiplier": list(c.channel_multiplier),
        "num_res_blocks": c.num_res_blocks, "attn_resolutions": [], "resolution": c.resolution, "double_latent": False}))
    save_file({k: v.contiguous() for k, v in vq.state_dict().items()}, str(folder / "model.safetensors"))
    return folder


def write_original_vqgan(vq, folder):
    """Meta's layout: ``vqgan.ckpt`` (``{"state_dict": ...}``) + ``vqgan.yaml`` (taming config)."""
    folder.mkdir(parents=True)
    c = vq.config
    torch.save({"state_dict": vq.state_dict()}, folder / "vqgan.ckpt")
    dd = dict(double_z=False, z_channels=c.z_channels, resolution=c.resolution, in_channels=3, out_ch=3, ch=c.base_channels,
              ch_mult=list(c.channel_multiplier), num_res_blocks=c.num_res_blocks, attn_resolutions=[], dropout=0.0)
    (folder / "vqgan.yaml").write_text(yaml.safe_dump({"model": {"params": {"embed_dim": c.embed_dim, "n_embed": c.codebook_size,
                                                                             "ddconfig": dd}}}))
    return folder / "vqgan.ckpt"


def test_from_backbone_folders(tmp_path):
    pipe = dummy_pipeline("anole", grid=(4, 5))
    repo = write_transformers_repo(pipe, tmp_path / "anole")
    pipe.vqgan.save_pretrained(tmp_path / "vq")  # a converted folder (scripts/convert_chameleon_vqgan.py)
    plain = AnolePipeline.from_backbone(repo, vq=tmp_path / "vq")
    b = plain.backbone  # Anole's own defaults where the checkpoint has none
    assert (b.layout.height, b.layout.width, b.layout.has_eol) == (32, 32, False) and b.default_guidance_scale == 3.0
    assert isinstance(plain.decoder, AutoregressiveDecoder) and plain.config._name_or_path == str(repo)
    assert torch.equal(plain.vqgan.codebook, pipe.vqgan.codebook)

    heads = dummy_pipeline("anole", MedusaDecoder(num_heads=2), "random", grid=(4, 5)).draft_heads
    loaded = AnolePipeline.from_backbone(repo, vq=tmp_path / "vq", image_grid=(4, 5), decoder=MedusaDecoder(num_heads=2),
                                         draft_heads=heads)
    assert loaded.transformer.config._attn_implementation == GROUPED_SDPA and loaded.draft_heads is heads
    loaded.set_progress_bar_config(disable=True)
    ref = pipe(PROMPTS, temperature=0, output_type="latent").tokens
    assert torch.equal(loaded(PROMPTS, temperature=0, output_type="latent").tokens, ref)

    original = write_original_vqgan(tiny_vq_with_32_groups(), tmp_path / "meta" / "tokenizer")
    half = AnolePipeline.from_backbone(repo, vq=original, torch_dtype=torch.bfloat16, image_grid=(4, 5))
    assert {p.dtype for p in half.transformer.parameters()} == {p.dtype for p in half.vqgan.parameters()} == {torch.bfloat16}
    assert half.backbone.make_cache(2, 8).storage.dtype == torch.bfloat16
    half.set_progress_bar_config(disable=True)
    assert half("a fox", generator=gen(0), output_type="np").images.shape == (1, 8, 10, 3)
    with pytest.raises(ValueError, match="attn_implementation"):
        AnolePipeline.from_backbone(repo, vq=tmp_path / "vq", attn_implementation="flash_attention_2")
    with pytest.raises(ValueError, match="image_grid"):
        AnolePipeline.from_backbone(repo, vq=tmp_path / "vq", image_grid=(4, 0))
    with pytest.raises(ValueError, match="vq"):
        AnolePipeline.from_backbone(repo, vq=tmp_path / "missing")


def test_from_backbone_repo_ids_from_the_hub_cache_offline(tmp_path):
    """Repo ids read from a Hub cache with the Hub offline (conftest sets ``HF_HUB_OFFLINE=1``; in process, the cache
    given as ``cache_dir``, which reaches both the transformers loads and the VQ snapshot): the checkpoint by its id and
    the VQGAN from the default VQ repo id, in the transformers VQ layout."""
    from huggingface_hub import constants

    from spatial_pipelines.pipelines.pipeline_chameleon import ANOLE_VQ_REPO

    assert constants.HF_HUB_OFFLINE
    pipe = dummy_pipeline("anole", grid=(4, 5))
    vq = tiny_vq_with_32_groups()
    hub = tmp_path / "hub"
    lay_out_hub_cache(hub, "org/anole-tiny", write_transformers_repo(pipe, tmp_path / "repo"), "a" * 40)
    lay_out_hub_cache(hub, ANOLE_VQ_REPO, write_hf_vq_repo(vq, tmp_path / "vq"), "b" * 40)
    loaded = AnolePipeline.from_backbone("org/anole-tiny", image_grid=(4, 5), cache_dir=hub)
    loaded.set_progress_bar_config(disable=True)
    assert loaded.config._name_or_path == "org/anole-tiny" and torch.equal(loaded.vqgan.codebook, vq.codebook)
    ref = pipe(["a red fox", "x"], temperature=0, output_type="latent").tokens
    assert torch.equal(loaded(["a red fox", "x"], temperature=0, output_type="latent").tokens, ref)
    with pytest.raises(OSError):
        AnolePipeline.from_backbone("org/missing", vq=vq, cache_dir=hub)
