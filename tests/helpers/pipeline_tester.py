"""Tests every pipeline family must pass. A family test file subclasses `PipelineTesterMixin` and sets the
class attributes; it adds tests only for what is particular to that family."""

import io
import json
import logging
import os
from contextlib import redirect_stderr

import numpy as np
import PIL.Image
import pytest
import torch
from diffusers.utils import logging as diffusers_logging

from spatial_pipelines import AutoregressiveDecoder, DecodingStats, SpatialPipelineOutput
from spatial_pipelines.testing import dummy_pipeline

from .diffusers_checks import DiffusersPipelineChecks
from .reference import naive_greedy


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class PipelineTesterMixin(DiffusersPipelineChecks):
    """A family's tester sets every attribute in ``REQUIRED`` (non-empty); one it forgets is a `TypeError` when the
    test module is collected, never a test that passes while checking nothing. diffusers' own generic checks come with
    it (`DiffusersPipelineChecks`)."""

    REQUIRED = ("family", "pipeline_class", "prompts", "bad_prompts")
    family: str = None
    pipeline_class: type = None
    dummy_kwargs: dict = {}
    prompts: list = None  # what `prompt` looks like for this family (at least two)
    bad_prompts: list = None  # (prompt value, substring of the error) pairs particular to the family

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        missing = [name for name in cls.REQUIRED if not getattr(cls, name, None)]
        if missing:
            raise TypeError(f"{cls.__name__} must set {missing} (see PipelineTesterMixin): left empty, the tests that "
                            "read them would pass while checking nothing.")
    failing_component: str = "vqvae"  # a component saved after the transformer: its save fails in the atomic-save test

    def get_pipeline(self, **kwargs):
        return dummy_pipeline(self.family, **{**self.dummy_kwargs, **kwargs})

    # -- outputs -------------------------------------------------------------------------------------------
    def test_output_types(self):
        pipe = self.get_pipeline()
        h, w = pipe.backbone.layout.height, pipe.backbone.layout.width
        f = pipe.backbone.vae_scale_factor
        out = pipe(self.prompts[0], generator=gen(0))
        assert isinstance(out, SpatialPipelineOutput) and isinstance(out.stats, DecodingStats)
        assert isinstance(out.images[0], PIL.Image.Image) and out.images[0].size == (w * f, h * f)
        assert out.tokens.shape == (1, h, w) and out.tokens.dtype == torch.long
        assert 0 <= out.tokens.min() and out.tokens.max() < pipe.backbone.num_image_codes
        np_out = pipe(self.prompts[0], generator=gen(0), output_type="np").images
        assert isinstance(np_out, np.ndarray) and np_out.shape == (1, h * f, w * f, 3)
        assert 0.0 <= np_out.min() and np_out.max() <= 1.0
        pt_out = pipe(self.prompts[0], generator=gen(0), output_type="pt").images
        assert isinstance(pt_out, torch.Tensor) and pt_out.shape == (1, 3, h * f, w * f)
        latent = pipe(self.prompts[0], generator=gen(0), output_type="latent")
        assert torch.equal(latent.images, out.tokens) and torch.equal(latent.tokens, out.tokens)
        images, tokens, stats = pipe(self.prompts[0], generator=gen(0), return_dict=False, output_type="latent")
        assert torch.equal(tokens, out.tokens) and isinstance(stats, DecodingStats)

    def test_ar_stats(self):
        pipe = self.get_pipeline()
        h, w = pipe.backbone.layout.height, pipe.backbone.layout.width
        out = pipe(self.prompts[:2], generator=gen(0), output_type="latent")
        s = out.stats
        assert s.num_forward_passes == h * w  # prefill included
        assert s.num_draft_passes == 0
        assert s.num_tokens == 2 * h * w
        assert s.mean_accepted_length == 1.0
        assert s.accepted_lengths.shape == (h * w, 2) and bool((s.accepted_lengths == 1).all())
        assert s.acceptance_map.shape == (2, h, w) and bool((s.acceptance_map == 1).all())
        assert s.wall_time_s > 0

    # -- correctness ---------------------------------------------------------------------------------------
    @pytest.mark.parametrize("guidance_scale", [1.0, 3.0])
    @pytest.mark.parametrize("batch", [1, 3])
    def test_greedy_matches_naive_reference(self, guidance_scale, batch):
        pipe = self.get_pipeline()
        prompts = self.prompts[:batch]
        out = pipe(prompts, guidance_scale=guidance_scale, temperature=0, output_type="latent")
        ref = naive_greedy(pipe, prompts, guidance_scale)
        assert torch.equal(out.tokens, ref)

    def test_greedy_output_is_not_trivial(self):
        # guards the reference test: a model whose greedy grid is constant would prove little
        pipe = self.get_pipeline()
        tokens = pipe(self.prompts, guidance_scale=3.0, temperature=0, output_type="latent").tokens
        assert tokens.unique().numel() > 1

    def test_same_seed_same_image(self):
        pipe = self.get_pipeline()
        a = pipe(self.prompts[0], generator=gen(7), output_type="np").images
        b = pipe(self.prompts[0], generator=gen(7), output_type="np").images
        c = pipe(self.prompts[0], generator=gen(8), output_type="latent").tokens
        np.testing.assert_array_equal(a, b)
        assert not torch.equal(pipe(self.prompts[0], generator=gen(7), output_type="latent").tokens, c)

    def test_batch_equals_single_runs(self):
        pipe = self.get_pipeline()
        prompts = self.prompts[:2]
        seeds = [11, 12, 13, 14]  # 2 prompts x 2 images
        batch = pipe(prompts, num_images_per_prompt=2, generator=[gen(s) for s in seeds], output_type="latent").tokens
        singles = [
            pipe(prompts[i // 2], generator=gen(s), output_type="latent").tokens[0] for i, s in enumerate(seeds)
        ]
        assert torch.equal(batch, torch.stack(singles))

    def test_negative_prompt_changes_output(self):
        pipe = self.get_pipeline()
        a = pipe(self.prompts[0], guidance_scale=3.0, temperature=0, output_type="latent").tokens
        b = pipe(self.prompts[0], negative_prompt=self.prompts[1], guidance_scale=3.0, temperature=0, output_type="latent").tokens
        assert not torch.equal(a, b)

    # -- saving, loading, swapping -------------------------------------------------------------------------
    def test_save_load_roundtrip(self, tmp_path):
        pipe = self.get_pipeline()
        pipe.save_pretrained(tmp_path / "pipe")
        index = json.loads((tmp_path / "pipe" / "model_index.json").read_text())
        assert index["decoder"] == ["spatial_pipelines", "AutoregressiveDecoder"]
        weight_files = [f for _, _, fs in os.walk(tmp_path / "pipe") for f in fs if f.endswith((".bin", ".pt", ".pth", ".pkl"))]
        assert weight_files == []  # safetensors only
        loaded = self.pipeline_class.from_pretrained(tmp_path / "pipe")
        loaded.set_progress_bar_config(disable=True)
        a = pipe(self.prompts[0], generator=gen(3), output_type="np").images
        b = loaded(self.prompts[0], generator=gen(3), output_type="np").images
        np.testing.assert_array_equal(a, b)

    def test_variant_save_and_load(self, tmp_path):
        """``save_pretrained(variant="fp16")`` names every weight file ``*.fp16.safetensors`` and
        ``from_pretrained(variant="fp16")`` loads the same pipeline (diffusers' variants)."""
        pipe = self.get_pipeline()
        pipe.save_pretrained(tmp_path / "pipe", variant="fp16")
        weights = [f for _, _, fs in os.walk(tmp_path / "pipe") for f in fs if f.endswith(".safetensors")]
        assert weights and all(".fp16." in f for f in weights), weights
        loaded = self.pipeline_class.from_pretrained(tmp_path / "pipe", variant="fp16")
        loaded.set_progress_bar_config(disable=True)
        a = pipe(self.prompts[0], generator=gen(3), output_type="latent").images
        b = loaded(self.prompts[0], generator=gen(3), output_type="latent").images
        assert torch.equal(a, b)

    def test_decoder_swap_without_warnings(self, caplog):
        pipe = self.get_pipeline()
        diffusers_logging.enable_propagation()
        try:
            with caplog.at_level(logging.WARNING):
                pipe.decoder = AutoregressiveDecoder.from_config(pipe.decoder.config)
        finally:
            diffusers_logging.disable_propagation()
        assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
        assert pipe.config.decoder == ("spatial_pipelines", "AutoregressiveDecoder")
        assert pipe(self.prompts[0], generator=gen(0), output_type="latent").stats.num_forward_passes > 0

    def test_save_into_previous_save_replaces_it(self, tmp_path):
        target = tmp_path / "pipe"
        self.get_pipeline(seed=1).save_pretrained(target)
        (target / "transformer" / "stale.safetensors").write_bytes(b"old")
        pipe = self.get_pipeline(seed=2)
        pipe.save_pretrained(target)
        assert not (target / "transformer" / "stale.safetensors").exists()
        loaded = self.pipeline_class.from_pretrained(target)
        saved, read = pipe.transformer.state_dict(), loaded.transformer.state_dict()
        assert saved and list(read) == list(saved)
        for n, p in saved.items():
            assert torch.equal(p, read[n]), n

    def test_failed_save_leaves_old_folder(self, tmp_path, monkeypatch):
        target = tmp_path / "pipe"
        old = self.get_pipeline(seed=1)
        old.save_pretrained(target)
        before = sorted(str(p.relative_to(target)) for p in target.rglob("*"))
        new = self.get_pipeline(seed=2)

        def boom(*args, **kwargs):
            raise OSError("disk full")

        monkeypatch.setattr(type(getattr(new, self.failing_component)), "save_pretrained", boom)
        with pytest.raises(OSError, match="disk full"):
            new.save_pretrained(target)
        assert sorted(str(p.relative_to(target)) for p in target.rglob("*")) == before
        assert [p.name for p in tmp_path.iterdir()] == ["pipe"]  # no temporary folder left behind
        loaded = self.pipeline_class.from_pretrained(target)
        assert torch.equal(loaded.backbone.codebook, old.backbone.codebook)

    def test_save_refuses_unrelated_nonempty_folder(self, tmp_path):
        (tmp_path / "notes.txt").write_text("mine")
        with pytest.raises(ValueError, match="save_directory"):
            self.get_pipeline().save_pretrained(tmp_path)
        assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]

    # -- inputs --------------------------------------------------------------------------------------------
    BAD_INPUTS = [
        (dict(prompt=[]), "prompt"),
        (dict(guidance_scale=-1.0), "guidance_scale"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_k=-1), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(num_images_per_prompt=0), "num_images_per_prompt"),
        (dict(generator=[torch.Generator(), torch.Generator()]), "generator"),
        (dict(output_type="jpeg"), "output_type"),
        (dict(callback_on_step_end_tensor_inputs=["logits"]), "callback_on_step_end_tensor_inputs"),
    ]

    @pytest.mark.parametrize("kwargs,name", BAD_INPUTS, ids=[n + str(i) for i, (_, n) in enumerate(BAD_INPUTS)])
    def test_bad_inputs_raise(self, kwargs, name):
        pipe = self.get_pipeline()
        kwargs = {"prompt": self.prompts[0], **kwargs}
        with pytest.raises(ValueError, match=name):
            pipe(**kwargs)

    def test_a_prompt_longer_than_the_model_reads(self, monkeypatch):
        """A prompt past the model's context is refused before the prompt pass (naming ``prompt`` and the limit); a
        family with a fixed caption length (LlamaGen) truncates it with diffusers' warning, saying what was cut."""
        pipe = self.get_pipeline()
        backbone = pipe.backbone
        if not isinstance(self.prompts[0], str):
            pytest.skip("class-conditional: a prompt is one label, it has no length")
        limit = backbone.max_sequence_length
        words = " ".join(["fox"] * (limit or 200) + ["tail"])
        if limit is not None:
            monkeypatch.setattr(type(backbone), "forward", lambda *a, **k: pytest.fail("the prompt pass ran"))
            with pytest.raises(ValueError, match=f"`prompt` takes .* more than the {limit}"):
                pipe(words, output_type="latent")
            return
        diffusers_logging.enable_propagation()
        logger = logging.getLogger("spatial_pipelines")
        records = []
        handler = logging.Handler()
        handler.emit = records.append
        logger.addHandler(handler)
        try:
            pipe(words, output_type="latent", generator=gen(0))
        finally:
            logger.removeHandler(handler)
            diffusers_logging.disable_propagation()
        assert any("truncated" in r.getMessage() and "tokens cut" in r.getMessage() for r in records)

    def test_bad_family_prompts_raise(self):
        pipe = self.get_pipeline()
        for prompt, name in self.bad_prompts:
            with pytest.raises(ValueError, match=name):
                pipe(prompt)

    # -- diffusers conventions -----------------------------------------------------------------------------
    def test_progress_bar(self):
        pipe = self.get_pipeline()
        pipe.set_progress_bar_config(disable=False, desc="decoding")
        err = io.StringIO()
        with redirect_stderr(err):
            pipe(self.prompts[0], generator=gen(0), output_type="latent")
        n = pipe.backbone.layout.num_tokens
        assert "decoding" in err.getvalue() and f"{n}/{n}" in err.getvalue()
        pipe.set_progress_bar_config(disable=True)
        err = io.StringIO()
        with redirect_stderr(err):
            pipe(self.prompts[0], generator=gen(0), output_type="latent")
        assert err.getvalue() == ""

    def test_callback_on_step_end(self):
        pipe = self.get_pipeline()
        seen = []

        def callback(p, step, num_committed, kwargs):
            assert p is pipe
            seen.append((step, num_committed, kwargs["tokens"].clone(), kwargs["acceptance_map"].clone()))
            return {}

        out = pipe(
            self.prompts[0], generator=gen(0), output_type="latent", callback_on_step_end=callback,
            callback_on_step_end_tensor_inputs=["tokens", "acceptance_map"],
        )
        n = pipe.backbone.layout.num_tokens
        assert [s[0] for s in seen] == list(range(n - 1)) and [s[1] for s in seen] == list(range(2, n + 1))
        assert torch.equal(seen[-1][2], out.tokens)
        assert (seen[0][2].flatten()[2:] == -1).all()  # not yet decoded codes are -1

    def test_callback_latents_is_the_code_grid(self):
        """diffusers' name for the state a callback reads, ``latents``, is the code grid so far (``tokens``)."""
        pipe = self.get_pipeline()
        seen = []

        def callback(p, step, num_committed, kwargs):
            assert torch.equal(kwargs["latents"], kwargs["tokens"])
            seen.append(step)
            return kwargs  # unchanged: accepted

        pipe(self.prompts[0], generator=gen(0), output_type="latent", callback_on_step_end=callback,
             callback_on_step_end_tensor_inputs=["tokens", "latents"])
        assert seen == list(range(pipe.backbone.layout.num_tokens - 1))  # step_index from 0, as diffusers' i

    def test_callback_reads_the_call_attributes_and_changes_guidance(self):
        """As in diffusers: a callback reads ``guidance_scale``, ``do_classifier_free_guidance`` and ``num_timesteps``
        (rounds so far), and a ``pipe._guidance_scale`` it sets is the scale of the next rounds (AR, greedy)."""
        pipe = self.get_pipeline()
        k = 2

        def run(scale, switch_to=None):
            seen = []

            def callback(p, step, num_committed, kwargs):
                seen.append((p.guidance_scale, p.do_classifier_free_guidance, p.num_timesteps))
                if switch_to is not None and step == k - 1:
                    p._guidance_scale = switch_to
                return kwargs

            out = pipe(self.prompts[0], guidance_scale=scale, temperature=0, generator=gen(0), output_type="latent",
                       callback_on_step_end=callback)
            return out.tokens.flatten(), seen

        base, seen = run(2.0)
        # rounds run plus one while the grid is not full: the last round's callback sees exactly the rounds run
        assert seen == [(2.0, True, i + 1) for i in range(1, len(seen))] + [(2.0, True, len(seen))]
        assert pipe.num_timesteps == len(seen)
        same, _ = run(2.0, switch_to=2.0)
        assert torch.equal(same, base)
        switched, seen = run(2.0, switch_to=0.0)  # from round k + 1 on: the unconditional model
        assert [s[0] for s in seen] == [2.0] * k + [0.0] * (len(seen) - k)
        assert torch.equal(switched[: k + 1], base[: k + 1]) and not torch.equal(switched, base)
        unguided, _ = run(1.0)
        assert not pipe.do_classifier_free_guidance
        for bad, match in ((2.0, "started with guidance_scale=1"), (float("nan"), "guidance_scale")):
            with pytest.raises(ValueError, match=match):
                run(1.0, switch_to=bad)

    def test_layerwise_casting_computes_in_the_compute_dtype(self):
        """diffusers' layerwise casting on the target (weights stored in fp8, computed in fp32): the pipeline works in
        the compute dtype (prompt embeddings and draft heads are cast to it, never to fp8) and generates."""
        from diffusers.hooks import apply_layerwise_casting

        pipe = self.get_pipeline()
        apply_layerwise_casting(pipe.backbone.target_module, storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
        assert any(p.dtype == torch.float8_e4m3fn for p in pipe.backbone.target_module.parameters())
        assert pipe.backbone.dtype == torch.float32
        out = pipe(self.prompts[0], generator=gen(0), output_type="latent")
        assert (out.tokens >= 0).all()

    def test_interrupt_stops_the_call_after_its_round(self):
        """A callback that sets ``pipe._interrupt`` is not called again; the codes not decoded stay -1 and their pixels
        are mid-grey; the next call starts afresh."""
        pipe = self.get_pipeline()
        calls = []

        def callback(p, step, num_committed, kwargs):
            calls.append(step)
            if step == 1:
                p._interrupt = True
            return kwargs

        out = pipe(self.prompts[0], generator=gen(0), output_type="np", callback_on_step_end=callback)
        assert calls == [0, 1] and pipe.interrupt and pipe.num_timesteps == 2 and out.stats.num_forward_passes == 3
        codes = out.tokens.flatten()
        assert (codes[:3] >= 0).all() and (codes[3:] == -1).all()
        f = pipe.backbone.vae_scale_factor
        assert np.allclose(out.images[0, -f:, -f:], 0.5)  # the last code's pixels
        assert not np.allclose(out.images[0, :f, :f], 0.5)  # the first code's
        again = pipe(self.prompts[0], generator=gen(0), output_type="latent")
        assert not pipe.interrupt and (again.tokens >= 0).all()
