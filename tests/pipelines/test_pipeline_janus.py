"""Janus-Pro (transformers `JanusForConditionalGeneration`): the shared pipeline contract, token-for-token agreement
with transformers' own ``generate(..., generation_mode="image")``, the transformers checkpoint layout (a folder and a
repo id in an offline Hub cache), VQ decoding and pixel range, and model CPU offload."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from spatial_pipelines import AutoregressiveDecoder, JacobiDecoder, JanusProPipeline
from spatial_pipelines.pipelines.transformers_utils import GROUPED_SDPA
from spatial_pipelines.testing import dummy_pipeline

from helpers import PipelineTesterMixin, gen, lay_out_hub_cache, transformers_sdpa

PROMPTS = ["a red fox", "blue sky", "x"]  # different lengths: left padding


class TestJanusProPipeline(PipelineTesterMixin):
    family = "janus"
    pipeline_class = JanusProPipeline
    prompts = PROMPTS
    bad_prompts = [([1, 2], "prompt"), (["ok", 3], "prompt")]

    failing_component = "processor"  # its VQ model is inside the transformer component

    def test_default_guidance_is_janus_and_travels_with_the_model(self, tmp_path):
        pipe = self.get_pipeline()
        assert pipe.backbone.default_guidance_scale == 5.0 and pipe.backbone.default_top_k is None
        pipe.transformer.generation_config.guidance_scale = 3.0
        pipe.transformer.generation_config.top_k = 4
        pipe.transformer.generation_config.do_sample = True  # transformers refuses to save a top_k without it
        pipe.save_pretrained(tmp_path / "pipe")
        loaded = JanusProPipeline.from_pretrained(tmp_path / "pipe")
        assert (loaded.backbone.default_guidance_scale, loaded.backbone.default_top_k) == (3.0, 4)
        index = json.loads((tmp_path / "pipe" / "model_index.json").read_text())
        assert index["transformer"] == ["transformers", "JanusForConditionalGeneration"]
        assert index["processor"] == ["transformers", "JanusProcessor"]


def transformers_image_generate(pipe, prompts, guidance_scale):
    """Greedy codes ``(B, N)`` from transformers' own Janus image generation on the pipeline's model and processor."""
    backbone = pipe.backbone
    inputs = pipe.processor(text=[backbone.prompt_text(p) for p in prompts], generation_mode="image", padding=True,
                            return_tensors="pt")
    with transformers_sdpa(pipe.transformer):
        return pipe.transformer.generate(**inputs, generation_mode="image", do_sample=False, guidance_scale=guidance_scale)


@pytest.mark.parametrize("guidance_scale", [5.0, 2.0])
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_equals_transformers_generate(guidance_scale, batch):
    """With CFG (Janus' own generate always runs the [cond; uncond] rows, the uncond prompt being BOS, pads and
    BOI) the pipeline's AR loop emits token for token what ``generate(generation_mode="image")`` emits."""
    pipe = dummy_pipeline("janus", grid=(4, 5))
    prompts = PROMPTS[:batch]
    out = pipe(prompts, guidance_scale=guidance_scale, temperature=0, output_type="latent")
    ref = transformers_image_generate(pipe, prompts, guidance_scale)
    assert ref.shape == (batch, 20)
    assert torch.equal(out.tokens.flatten(1), ref)
    assert ref.unique().numel() > 2  # not a constant grid


def test_a_speculative_decoder_equals_transformers_generate():
    pipe = dummy_pipeline("janus", JacobiDecoder(window_size=4), grid=(4, 5))
    out = pipe(PROMPTS, guidance_scale=5.0, temperature=0, output_type="latent")
    assert torch.equal(out.tokens.flatten(1), transformers_image_generate(pipe, PROMPTS, 5.0))
    assert out.stats.num_forward_passes <= 20


def test_prompt_is_the_chat_template_then_begin_of_image():
    pipe = dummy_pipeline("janus")
    backbone = pipe.backbone
    assert backbone.prompt_text("a fox") == "<|User|>: a fox\n\n<|Assistant|>:"
    ids, valid = backbone.tokenize(["a fox", "x"], torch.device("cpu"))
    tok = pipe.processor.tokenizer
    bos, boi, pad = tok.bos_token_id, tok.convert_tokens_to_ids("<begin_of_image>"), tok.pad_token_id
    assert (ids[:, -1] == boi).all() and ids[0, 0] == bos
    n_pad = int((~valid[1]).sum())  # left padding: pads first, then BOS
    assert n_pad == 3 and not valid[1, :n_pad].any() and valid[1, n_pad:].all() and ids[1, n_pad] == bos
    emb = backbone.encode_prompt(["a fox", "x"], None, True, torch.device("cpu"))
    uncond = backbone.unconditional_ids(ids)
    assert uncond[0].tolist() == [bos] + [pad] * (ids.shape[1] - 2) + [boi]
    assert torch.equal(emb.valid, valid.repeat(2, 1))
    assert torch.equal(emb.embeds[2:], pipe.transformer.get_input_embeddings()(uncond))


def test_left_padding_matches_unpadded_prompt():
    pipe = dummy_pipeline("janus")
    backbone = pipe.backbone
    emb = backbone.encode_prompt(["a red fox", "x"], None, False, torch.device("cpu"))
    n_pad = int((~emb.valid[1]).sum())
    p = emb.embeds.shape[1]
    full = backbone.forward(emb.embeds[1:], torch.arange(p), None, emb.valid[1:], None)[:, -1]
    trimmed = backbone.forward(emb.embeds[1:, n_pad:], torch.arange(p - n_pad), None, None, None)[:, -1]
    torch.testing.assert_close(full, trimmed, rtol=1e-5, atol=1e-5)


def test_decode_image_is_the_vq_decode_and_the_processor_pixel_range():
    pipe = dummy_pipeline("janus")  # 4 x 4: the VQ config's own grid
    tokens = pipe(PROMPTS[:2], generator=gen(0), output_type="latent").tokens  # (2, 4, 4)
    ours = pipe.backbone.decode_image(tokens)  # [-1, 1]
    official = pipe.transformer.model.vqmodel.decode(tokens.flatten(1))  # the processor's normalised pixels
    torch.testing.assert_close(ours, (official * 0.5 + 0.5) * 2 - 1)  # unnormalise (mean = std = 0.5) -> [-1, 1]
    images = pipe.image_processor.postprocess(ours, output_type="np")  # what the pipeline returns
    reference = pipe.processor.postprocess(list(official.float()), return_tensors="np")["pixel_values"]
    reference = np.stack([np.asarray(r) for r in reference]).transpose(0, 2, 3, 1) / 255.0  # uint8 CHW -> HWC
    assert np.abs(images - reference).max() <= 1.0 / 255 + 1e-6  # rounding vs truncation: one level at most


def test_non_square_grid_decodes_as_the_vq_decoder_would():
    pipe = dummy_pipeline("janus", grid=(4, 5))
    tokens = pipe("a fox", generator=gen(0), output_type="latent").tokens
    ours = pipe.backbone.decode_image(tokens)
    assert ours.shape == (1, 3, 8, 10)
    vq = pipe.transformer.model.vqmodel
    vq.quantize.quant_state_dims = [4, 5]  # the official decode reading a 4 x 5 grid
    torch.testing.assert_close(ours, (vq.decode(tokens.flatten(1)) * 0.5 + 0.5) * 2 - 1)


def test_encode_image_gives_codes_of_the_grid():
    pipe = dummy_pipeline("janus")
    pixels = pipe("a fox", generator=gen(0), output_type="pt").images * 2 - 1  # (1, 3, 8, 8) in [-1, 1]
    codes = pipe.backbone.encode_image(pixels)
    assert codes.shape == (1, 16) and 0 <= codes.min() and codes.max() < 16


def test_model_cpu_offload_onloads_for_submodule_calls(monkeypatch):
    """Janus generation never calls the model's top-level forward, so the offload hook would never move it: the
    backbone runs the hook itself. On a CPU the model is always "there"; pretending it is not makes every backbone
    call run the hook, which must find it and leave the output unchanged."""
    from spatial_pipelines.pipelines import transformers_utils

    pipe = dummy_pipeline("janus", JacobiDecoder(window_size=3))
    ref = pipe(PROMPTS[:2], guidance_scale=5.0, temperature=0, output_type="latent").tokens
    pipe.enable_model_cpu_offload(device="cpu")
    assert pipe._execution_device.type == "cpu"
    hook = pipe.transformer._hf_hook
    calls = []
    original = hook.pre_forward
    monkeypatch.setattr(hook, "pre_forward", lambda module, *a, **k: calls.append(module) or original(module, *a, **k))
    monkeypatch.setattr(transformers_utils, "same_device", lambda a, b: False)
    out = pipe(PROMPTS[:2], guidance_scale=5.0, temperature=0, output_type="latent").tokens
    assert torch.equal(out, ref)
    assert calls and all(m is pipe.transformer for m in calls)


def test_attention_that_cannot_take_tree_masks_is_switched_to_sdpa():
    from spatial_pipelines.testing import dummy_janus_components

    components = dummy_janus_components()
    model = components["transformer"]
    model.set_attn_implementation("eager")
    JanusProPipeline(**components, decoder=AutoregressiveDecoder())
    assert model.model.language_model.config._attn_implementation == "eager"  # eager takes 4-D masks: kept
    model.config._attn_implementation = "flex_attention"
    pipe = JanusProPipeline(**components, decoder=JacobiDecoder(window_size=3))
    assert model.model.language_model.config._attn_implementation == GROUPED_SDPA  # sdpa, its GQA trunk grouped
    pipe.set_progress_bar_config(disable=True)
    assert pipe("a fox", temperature=0, output_type="latent").tokens.shape == (1, 4, 4)


def write_transformers_checkpoint(pipe, folder):
    """The layout of ``deepseek-community/Janus-Pro-*``: config.json + safetensors + generation_config.json +
    tokenizer and processor files, all in one folder."""
    pipe.transformer.save_pretrained(folder)
    pipe.processor.save_pretrained(folder)
    return folder


def test_from_backbone_reads_the_transformers_layout(tmp_path):
    pipe = dummy_pipeline("janus", grid=(4, 5))
    folder = write_transformers_checkpoint(pipe, tmp_path / "janus")
    assert (folder / "config.json").is_file() and list(folder.glob("*.safetensors"))
    loaded = JanusProPipeline.from_backbone(folder)
    loaded.set_progress_bar_config(disable=True)
    assert isinstance(loaded.decoder, AutoregressiveDecoder) and loaded.backbone.layout == pipe.backbone.layout
    a = pipe(PROMPTS, guidance_scale=5.0, temperature=0, output_type="latent").tokens
    b = loaded(PROMPTS, guidance_scale=5.0, temperature=0, output_type="latent").tokens
    assert torch.equal(a, b) and loaded.backbone.default_guidance_scale == 5.0
    half = JanusProPipeline.from_backbone(folder, torch_dtype=torch.bfloat16, decoder=JacobiDecoder())
    assert half.transformer.dtype == torch.bfloat16 and isinstance(half.decoder, JacobiDecoder)
    assert half.backbone.make_cache(2, 8).storage.dtype == torch.bfloat16
    assert JanusProPipeline.from_backbone(folder, dtype=torch.bfloat16).transformer.dtype == torch.bfloat16
    half.set_progress_bar_config(disable=True)
    assert half("a fox", generator=gen(0), output_type="latent").tokens.shape == (1, 4, 5)


def test_from_backbone_refuses_other_checkpoints(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="repo_or_path"):
        JanusProPipeline.from_backbone(tmp_path)
    with pytest.raises(ValueError, match="attn_implementation"):
        JanusProPipeline.from_backbone(tmp_path, attn_implementation="flash_attention_2")


HUB_SCRIPT = r"""
import json, torch
from spatial_pipelines import JanusProPipeline
pipe = JanusProPipeline.from_backbone("org/janus-tiny", torch_dtype=torch.float32)
pipe.set_progress_bar_config(disable=True)
tokens = pipe(["a red fox", "x"], guidance_scale=5.0, temperature=0, output_type="latent").tokens
print(json.dumps({"tokens": tokens.tolist(), "name": pipe.config._name_or_path}))
"""


def test_from_backbone_by_repo_id_from_the_hub_cache_offline(tmp_path):
    pipe = dummy_pipeline("janus", grid=(4, 5))
    folder = write_transformers_checkpoint(pipe, tmp_path / "janus")
    home = tmp_path / "hf_home"
    lay_out_hub_cache(home / "hub", "org/janus-tiny", folder, "c" * 40)
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
    env.pop("HF_HUB_CACHE", None)
    done = subprocess.run([sys.executable, "-c", HUB_SCRIPT], capture_output=True, text=True, env=env,
                          cwd=os.path.dirname(__file__))
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    ref = pipe(["a red fox", "x"], guidance_scale=5.0, temperature=0, output_type="latent").tokens
    assert got == {"tokens": ref.tolist(), "name": "org/janus-tiny"}
    shutil.rmtree(home)


@pytest.mark.parametrize("device_map", [{"": "cpu"}, "auto"])
def test_from_backbone_passes_a_device_map_to_transformers(tmp_path, device_map, monkeypatch):
    """``from_backbone(..., device_map=...)`` reaches transformers' ``from_pretrained`` for the model (not the
    processor), and the pipeline decodes as without it."""
    from transformers import JanusForConditionalGeneration

    pipe = dummy_pipeline("janus", grid=(4, 5))
    folder = write_transformers_checkpoint(pipe, tmp_path / "janus")
    seen, original = [], JanusForConditionalGeneration.from_pretrained.__func__
    monkeypatch.setattr(JanusForConditionalGeneration, "from_pretrained",
                        classmethod(lambda cls, *a, **k: seen.append(k.get("device_map")) or original(cls, *a, **k)))
    mapped = JanusProPipeline.from_backbone(folder, device_map=device_map, torch_dtype=torch.float32)
    assert seen == [device_map] and mapped.transformer.device.type == "cpu"
    mapped.set_progress_bar_config(disable=True)
    a = pipe(PROMPTS, guidance_scale=5.0, temperature=0, output_type="latent").tokens
    assert torch.equal(mapped(PROMPTS, guidance_scale=5.0, temperature=0, output_type="latent").tokens, a)


def test_a_device_map_over_several_accelerators_is_refused():
    from spatial_pipelines.pipelines.transformers_utils import check_device_map

    model = torch.nn.Linear(2, 2)
    model.hf_device_map = {"model.layers.0": 0, "model.layers.1": "cpu"}
    check_device_map(model)  # one GPU and CPU offload: fine
    model.hf_device_map = {"model.layers.0": 0, "model.layers.1": 1}
    with pytest.raises(ValueError, match="placed the model on 2 devices"):
        check_device_map(model)
