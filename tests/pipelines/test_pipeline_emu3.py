"""The Emu3 family on a tiny random `Emu3ForConditionalGeneration`: the shared pipeline contract, plus what is
particular to Emu3 — visual tokens mapped by name, the end-of-row layout, the reference comparison with the
transformers model's own `generate`, loading the plain transformers repo layout (folder and Hub cache), offload."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from transformers.models.emu3.modeling_emu3 import Emu3ImageVocabularyMapping

from spatial_pipelines import AutoregressiveDecoder, Emu3Pipeline, JacobiDecoder, MedusaDecoder, SSDDecoder
from spatial_pipelines.core import SamplingConfig
from spatial_pipelines.pipelines.pipeline_emu3 import EMU3_NEGATIVE_PROMPT
from spatial_pipelines.pipelines.transformers_utils import GROUPED_SDPA
from spatial_pipelines.testing import dummy_pipeline

from helpers import (
    DISTRIBUTION_SAMPLES,
    OracleHeads,
    PipelineTesterMixin,
    chi_square_pvalue,
    exact_joint_distribution,
    expected_passes,
    gen,
    grid_index,
    lay_out_hub_cache,
    naive_greedy,
    transformers_sdpa,
)


class TestEmu3Pipeline(PipelineTesterMixin):
    family = "emu3"
    pipeline_class = Emu3Pipeline
    prompts = ["a red fox", "blue sky", "x"]
    bad_prompts = [([1, 2], "prompt"), (["ok", 3], "prompt")]

    failing_component = "processor"  # its VQ model is inside the transformer component

    def test_layout_has_eol(self):
        backbone = self.get_pipeline(grid=(4, 5)).backbone
        layout = backbone.layout
        vocab = backbone.transformer.config.vocabulary_map
        assert layout.eol_token_id == vocab["<|extra_200|>"]
        assert layout.row_stride == 6 and layout.sequence_length == 24
        torch.testing.assert_close(backbone.eol_embedding, backbone.text_model.embed_tokens.weight[vocab["<|extra_200|>"]])

    def test_defaults_travel_with_the_transformer(self, tmp_path):
        pipe = self.get_pipeline(grid=(3, 5))
        again = Emu3Pipeline(**pipe.components)
        pipe.save_pretrained(tmp_path / "pipe")
        loaded = Emu3Pipeline.from_pretrained(tmp_path / "pipe")
        for p in (again, loaded):
            b = p.backbone
            assert (b.layout.height, b.layout.width) == (3, 5)
            assert b.default_guidance_scale == 3.0 and b.default_top_k is None
            assert b.default_negative_prompt == "lowres, blurry"
        assert json.loads((tmp_path / "pipe" / "model_index.json").read_text())["transformer"] == [
            "transformers", "Emu3ForConditionalGeneration"]

    def test_eol_is_never_in_the_tokens(self):
        pipe = self.get_pipeline()
        tokens = pipe(self.prompts, generator=gen(0), output_type="latent").tokens
        assert tokens.max() < pipe.backbone.num_image_codes


# -- visual tokens are mapped by name ---------------------------------------------------------------------------
def test_mapping_without_visual_tokens_is_refused():
    pipe = dummy_pipeline("emu3")
    vocab = {k: v for k, v in pipe.transformer.config.vocabulary_map.items() if "visual token 000003" not in k}
    pipe.transformer.config.vocabulary_map = vocab
    pipe.transformer.model.vocabulary_mapping = Emu3ImageVocabularyMapping(vocab)
    with pytest.raises(ValueError, match="visual token"):
        pipe("a fox")


# -- the reference: Emu3's own generate --------------------------------------------------------------------------
def processor_inputs(pipe, prompts):
    """What Emu3's processor gives for image generation at this grid (its ``ratio``/``image_area`` knobs)."""
    h, w = pipe.backbone.image_grid
    return pipe.processor(text=prompts, return_for_image_generation=True, ratio=f"{w}:{h}", image_area=h * w * 64,
                          padding=True, return_tensors="pt")


def transformers_generate(pipe, prompts, guidance_scale, negative_prompts=None, eol=True):
    """Emu3's generation as its documentation runs it: `generate` with a ``prefix_allowed_tokens_fn`` that allows the
    visual tokens, forces an EOL after every row (the last one included), then EOF, EOI, EOS; CFG through the
    negative prompt. Returns the code grids ``(B, h, w)`` and the generated ids."""
    model, tokenizer = pipe.transformer, pipe.processor.tokenizer
    h, w = pipe.backbone.image_grid
    inputs = processor_inputs(pipe, prompts)
    assert inputs.pop("image_sizes") == [[h, w]] * len(prompts)
    visual = model.vocabulary_mapping.image_tokens
    eol_id = model.vocabulary_mapping.eol_token_id
    stride = w + 1 if eol else w
    tail = [tokenizer.eof_token_id, tokenizer.eoi_token_id, tokenizer.eos_token_id]

    def allowed(batch_id, input_ids):
        start = torch.nonzero(input_ids == tokenizer.image_wrapper_token_id, as_tuple=True)[0][0]
        offset = input_ids.shape[0] - start
        if offset > stride * h:
            return [tail[min(offset - stride * h - 1, 2)]]
        return [eol_id] if eol and offset % stride == 0 else visual

    kwargs = {}
    if guidance_scale != 1.0:
        negatives = processor_inputs(pipe, negative_prompts or [pipe.backbone.default_negative_prompt] * len(prompts))
        kwargs = dict(negative_prompt_ids=negatives.input_ids, negative_prompt_attention_mask=negatives.attention_mask)
    with transformers_sdpa(model):
        out = model.generate(**inputs, prefix_allowed_tokens_fn=allowed, do_sample=False, guidance_scale=guidance_scale,
                             max_new_tokens=stride * h + 3, **kwargs)
    generated = out[:, inputs.input_ids.shape[1]:]
    if not eol:
        return model.vocabulary_mapping.bpe2img_mapping_tensor[generated[:, : h * w]].reshape(-1, h, w).long(), generated
    assert (generated[:, -3:] == torch.tensor(tail)).all()
    assert (generated[:, :-3].reshape(-1, h, w + 1)[..., -1] == eol_id).all()  # an EOL after every row, the last too
    return model.vocabulary_mapping.convert_bpe2img(generated[:, :-3].reshape(-1, h, w + 1)).long(), generated


def test_prompt_ids_are_the_processors():
    pipe = dummy_pipeline("emu3", grid=(4, 5))
    prompts = ["a red fox", "x"]
    ids, valid = pipe.backbone.prompt_ids(prompts, torch.device("cpu"))
    inputs = processor_inputs(pipe, prompts)
    assert torch.equal(ids[valid], inputs.input_ids[inputs.attention_mask.bool()])
    assert torch.equal(valid, inputs.attention_mask.bool())


@pytest.mark.parametrize("prompts,guidance_scale,negative", [
    (["a red fox"], 3.0, None),  # the default unconditional prompt (generation config)
    (["a red fox", "x"], 3.0, ["blue sky", "lowres"]),  # batch, left padding, negative prompts
    (["blue sky"], 1.0, None),  # no CFG
], ids=["cfg", "cfg-batch-negative", "no-cfg"])
def test_greedy_equals_transformers_generate(prompts, guidance_scale, negative):
    """Invariant 1 against the model's own generation: token for token the code grid transformers' `generate`
    writes (with its forced EOLs), for our AR decoder and a speculative one."""
    pipe = dummy_pipeline("emu3", grid=(4, 5))
    ref, generated = transformers_generate(pipe, prompts, guidance_scale, negative)
    assert ref.unique().numel() > 1
    for decoder in (AutoregressiveDecoder(), JacobiDecoder(window_size=4)):
        pipe.decoder = decoder
        out = pipe(prompts, negative_prompt=negative, guidance_scale=guidance_scale, temperature=0, output_type="latent")
        assert torch.equal(out.tokens, ref), type(decoder).__name__
    # decoding: the same pixels as the model's own `decode_image_tokens` on the generated ids (trailing EOL/EOF/EOI/EOS)
    h, w = pipe.backbone.image_grid
    theirs = pipe.transformer.decode_image_tokens(image_tokens=generated, height=h, width=w)
    torch.testing.assert_close(pipe.backbone.decode_image(out.tokens), theirs.float().clamp(-1, 1))


def test_reference_sees_a_missing_eol():
    """Control: the same model generating without the EOLs gives another grid, so the comparison above fails for a
    loop that skips them."""
    pipe = dummy_pipeline("emu3", grid=(4, 5))
    with_eol, _ = transformers_generate(pipe, ["a red fox"], 3.0)
    without, _ = transformers_generate(pipe, ["a red fox"], 3.0, eol=False)
    assert not torch.equal(with_eol, without)
    assert torch.equal(naive_greedy(pipe, ["a red fox"], 3.0), with_eol)


# -- sampling ----------------------------------------------------------------------------------------------------
def test_sampling_distribution_equals_model():
    """Invariant 2 on Emu3 for an exact speculative decoder (SJD; 2x2 grid, 4 codes, CFG with the default
    unconditional prompt, EOL layout): Pearson chi-square of ``DISTRIBUTION_SAMPLES`` samples against the enumerated joint (sequences
    with the EOLs written in); fails at p < 1e-4. The other exact decoders run it on LlamaGen's EOL layout."""
    pipe = dummy_pipeline("emu3", JacobiDecoder(window_size=3), grid=(2, 2), num_codes=4)  # drafts cross the row end
    sampling = SamplingConfig(2.0, 1.0)
    exact = exact_joint_distribution(pipe, "a fox", sampling)
    assert torch.isclose(exact.sum(), torch.tensor(1.0), atol=1e-5)
    out = pipe("a fox", guidance_scale=2.0, temperature=1.0, num_images_per_prompt=DISTRIBUTION_SAMPLES, generator=gen(1), output_type="latent")
    counts = torch.bincount(grid_index(out.tokens, 4), minlength=4**4)
    assert chi_square_pvalue(counts, exact) > 1e-4


@pytest.mark.parametrize("kwargs", [dict(num_horizontal=2, vertical_rounds=2), dict(num_horizontal=2, num_vertical_rows=2,
                                     staged_base_rounds=2, staged_incremental_rounds=1)], ids=["r2", "staged"])
def test_ssd_pass_count_on_emu3(kwargs):
    """SSD (lossy) on Emu3's end-of-row layout: the forced EOLs ride along, so the schedule is the paper's."""
    grid = (5, 6)
    pipe = dummy_pipeline("emu3", SSDDecoder(**kwargs), "random", grid=grid)
    out = pipe(["a fox", "x"], generator=gen(0), output_type="latent")
    stats = out.stats
    assert stats.num_forward_passes == expected_passes(grid, **kwargs)
    assert stats.accepted_lengths.shape == (stats.num_forward_passes, 2)
    assert (stats.accepted_lengths.sum(0) == grid[0] * grid[1]).all() and (out.tokens >= 0).all()


def test_ssd_oracle_drafts_give_the_autoregressive_grid_on_emu3():
    """Drafts that are the AR grid itself are all accepted and give it back: SSD's drafts land on the right
    positions of Emu3's EOL layout (CFG, batch 2)."""
    pipe = dummy_pipeline("emu3", grid=(4, 5))
    prompts = ["a red fox", "x"]
    ref = pipe(prompts, guidance_scale=3.0, temperature=0, output_type="latent").tokens
    decoder = SSDDecoder(num_horizontal=2, vertical_rounds=0, horizontal_rounds=0)
    heads = OracleHeads.for_backbone(pipe.backbone, decoder, random_init=False)
    heads.set_grid(ref)
    pipe.decoder = decoder
    pipe.set_draft_heads(heads)
    out = pipe(prompts, guidance_scale=3.0, temperature=0, output_type="latent")
    assert torch.equal(out.tokens, ref)


# -- loading the transformers repo layout -----------------------------------------------------------------------
def write_transformers_repo(pipe, folder):
    """The layout of ``BAAI/Emu3-Gen-hf``: config.json, safetensors, generation_config.json (do_sample, top_k 2048;
    no grid, CFG scale or negative prompt of ours), tokenizer and processor files."""
    pipe.transformer.save_pretrained(folder)
    pipe.processor.save_pretrained(folder)
    config = json.loads((folder / "generation_config.json").read_text())
    for key in ("image_grid", "default_negative_prompt", "guidance_scale"):
        config.pop(key)
    config["top_k"] = 2048
    (folder / "generation_config.json").write_text(json.dumps(config))
    assert not (folder / "model_index.json").exists()


REPO_OPTIONS = dict(image_grid=(4, 5), default_negative_prompt="lowres, blurry", default_guidance_scale=3.0, default_top_k=0)


def test_from_backbone_folder(tmp_path):
    pipe = dummy_pipeline("emu3", grid=(4, 5))
    write_transformers_repo(pipe, tmp_path / "repo")
    plain = Emu3Pipeline.from_backbone(tmp_path / "repo")
    b = plain.backbone  # Emu3's own defaults where the checkpoint has none
    assert (b.layout.height, b.layout.width) == (90, 90) and b.vae_scale_factor == 2
    assert b.default_guidance_scale == 3.0 and b.default_top_k == 2048 and b.default_negative_prompt == EMU3_NEGATIVE_PROMPT
    assert isinstance(plain.decoder, AutoregressiveDecoder) and plain.config._name_or_path == str(tmp_path / "repo")

    heads = dummy_pipeline("emu3", MedusaDecoder(num_heads=2), "random", grid=(4, 5)).draft_heads
    loaded = Emu3Pipeline.from_backbone(tmp_path / "repo", decoder=MedusaDecoder(num_heads=2), draft_heads=heads, **REPO_OPTIONS)
    assert loaded.transformer.config.text_config._attn_implementation == GROUPED_SDPA and loaded.draft_heads is heads
    loaded.set_progress_bar_config(disable=True)
    ref = pipe(["a red fox", "x"], temperature=0, output_type="latent").tokens
    assert torch.equal(loaded(["a red fox", "x"], temperature=0, output_type="latent").tokens, ref)

    half = Emu3Pipeline.from_backbone(tmp_path / "repo", torch_dtype=torch.bfloat16)
    assert {p.dtype for p in half.transformer.parameters()} == {torch.bfloat16}
    with pytest.raises(ValueError, match="attn_implementation"):
        Emu3Pipeline.from_backbone(tmp_path / "repo", attn_implementation="flash_attention_2")
    with pytest.raises(ValueError, match="image_grid"):
        Emu3Pipeline.from_backbone(tmp_path / "repo", image_grid=(4, 0))


OFFLINE_SCRIPT = r"""
import json, torch
from spatial_pipelines import Emu3Pipeline
pipe = Emu3Pipeline.from_backbone("org/emu3-tiny", image_grid=(4, 5), default_negative_prompt="lowres, blurry",
                                  default_guidance_scale=3.0, default_top_k=0)
pipe.set_progress_bar_config(disable=True)
tokens = pipe(["a red fox", "x"], temperature=0, output_type="latent").tokens
try:
    Emu3Pipeline.from_backbone("org/missing")
    missing = "loaded"
except Exception as err:
    missing = type(err).__name__
print(json.dumps({"tokens": tokens.tolist(), "missing": missing}))
"""


def test_from_backbone_repo_id_from_the_hub_cache_offline(tmp_path):
    pipe = dummy_pipeline("emu3", grid=(4, 5))
    write_transformers_repo(pipe, tmp_path / "repo")
    lay_out_hub_cache(tmp_path / "home" / "hub", "org/emu3-tiny", tmp_path / "repo", "e" * 40)
    env = {**os.environ, "HF_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
    env.pop("HF_HUB_CACHE", None)
    done = subprocess.run([sys.executable, "-c", OFFLINE_SCRIPT], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["tokens"] == pipe(["a red fox", "x"], temperature=0, output_type="latent").tokens.tolist()
    assert got["missing"] != "loaded"


def test_model_cpu_offload_onloads_the_submodules_the_loop_calls(monkeypatch):
    """diffusers' hooks fire on the component's top-level forward, which the loop never calls: the backbone onloads
    explicitly (checked here on the CPU, where the model is always "there": pretending it is not makes the backbone
    ask the hook before the trunk, head and VQ model run)."""
    from spatial_pipelines.pipelines import transformers_utils

    pipe = dummy_pipeline("emu3")
    ref = pipe("a red fox", generator=gen(0), output_type="np").images
    pipe.enable_model_cpu_offload(device="cpu")
    hook = pipe.transformer._hf_hook
    calls = []
    original = hook.pre_forward
    hook.pre_forward = lambda module, *a, **k: (calls.append(module), original(module, *a, **k))[1]
    monkeypatch.setattr(transformers_utils, "same_device", lambda a, b: False)
    out = pipe("a red fox", generator=gen(0), output_type="np").images
    np.testing.assert_array_equal(out, ref)
    assert calls and all(m is pipe.transformer for m in calls)


def test_an_odd_non_square_grid_says_what_it_makes():
    """Any positive grid is taken: the prompt states it as ``{h}*{w}`` and the image is ``f*h x f*w`` pixels."""
    pipe = dummy_pipeline("emu3", grid=(3, 5))
    pipe.set_progress_bar_config(disable=True)
    assert "3*5" in pipe.backbone.image_prompt("a fox")
    f = pipe.backbone.vae_scale_factor
    out = pipe("a fox", generator=torch.Generator().manual_seed(0), output_type="np")
    assert out.images.shape == (1, 3 * f, 5 * f, 3) and out.tokens.shape == (1, 3, 5)
