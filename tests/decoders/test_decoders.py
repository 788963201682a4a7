"""Invariants every decoder must keep (docs/design.md, "Invariants"). A new decoder adds a row to `DECODER_CASES`."""

import dataclasses

import pytest
import torch

import spatial_pipelines
from spatial_pipelines import ADTTreeDecoder, AutoregressiveDecoder, EagleDecoder, HawkDecoder, JacobiDecoder, MedusaDecoder, SSDDecoder
from spatial_pipelines.core import OFFSET_LOGITS, HeadsNeed, SamplingConfig
from spatial_pipelines.decoders import DECODERS, SpatialDecoderMixin
from spatial_pipelines.testing import FAMILIES, dummy_pipeline

from helpers import (
    DECODER_CASES,
    DISTRIBUTION_SAMPLES,
    EXACT_CASES,
    FAMILY_CASES,
    chi_square_pvalue,
    exact_joint_distribution,
    gen,
    grid_index,
    make,
)


def test_every_exported_decoder_and_family_has_rows():
    """The tables are the coverage: a decoder the package exports without a `DECODER_CASES` row, or a family without
    a `FAMILY_CASES` row, would skip every invariant below."""
    exported = {obj for name in spatial_pipelines.__all__ for obj in [getattr(spatial_pipelines, name)]
                if isinstance(obj, type) and issubclass(obj, SpatialDecoderMixin) and obj is not SpatialDecoderMixin}
    own = lambda classes: {c for c in classes if c.__module__.startswith("spatial_pipelines.")}  # noqa: E731 (a test module's too, once loaded)
    assert exported and exported == own(DECODERS.values())  # the short names cover the package too
    assert exported - {case.values[0] for case in DECODER_CASES} == set()
    assert {f for f, cls in FAMILIES.items() if cls in own(FAMILIES.values())} - {case.values[0] for case in FAMILY_CASES} == set()


@pytest.mark.parametrize("family,dummy,prompts", FAMILY_CASES)
@pytest.mark.parametrize("decoder_cls,kwargs,heads", EXACT_CASES)
@pytest.mark.parametrize("guidance_scale", [1.0, 4.0])
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_equals_autoregressive(decoder_cls, kwargs, heads, family, dummy, prompts, guidance_scale, batch):
    """Invariant 1: token for token the grid of `AutoregressiveDecoder`."""
    pipe = make(decoder_cls, kwargs, heads, family, grid=(4, 5), **dummy)
    out = pipe(prompts[:batch], guidance_scale=guidance_scale, temperature=0, output_type="latent")
    pipe.decoder = AutoregressiveDecoder()
    ref = pipe(prompts[:batch], guidance_scale=guidance_scale, temperature=0, output_type="latent")
    assert torch.equal(out.tokens, ref.tokens)
    assert out.stats.num_forward_passes <= ref.stats.num_forward_passes


def _empirical_counts(pipe, prompt, sampling: SamplingConfig, seed: int) -> torch.Tensor:
    out = pipe(
        prompt, guidance_scale=sampling.guidance_scale, temperature=sampling.temperature, top_k=sampling.top_k,
        num_images_per_prompt=DISTRIBUTION_SAMPLES, generator=gen(seed), output_type="latent",
        sampling_noise=sampling.noise,
    )
    v = pipe.backbone.num_image_codes
    return torch.bincount(grid_index(out.tokens, v), minlength=v ** pipe.backbone.layout.num_tokens)


DISTRIBUTION_SETTINGS = [pytest.param(SamplingConfig(2.0, 1.0), False, id="cfg"),
                         pytest.param(SamplingConfig(1.0, 0.8, top_k=3), False, id="topk"),
                         pytest.param(SamplingConfig(2.0, 1.0), True, id="cfg-eol")]
#: every exact decoder row in every setting, but `adt-random` under CFG only: its tree shapes are host draws from each
#: image's own numbers, so each of the 8,000 images steps in a state of its own (about 50 s a setting on 2 cores); its
#: verification is ADT-Tree's, which the other ADT rows run in all three settings
DISTRIBUTION_CASES = [pytest.param(*setting.values, *case.values, id=f"{setting.id}-{case.id}")
                      for setting in DISTRIBUTION_SETTINGS for case in EXACT_CASES
                      if case.id != "adt-random" or setting.id == "cfg"]


@pytest.mark.parametrize("sampling,end_of_row,decoder_cls,kwargs,heads", DISTRIBUTION_CASES)
def test_sampling_distribution_equals_model(decoder_cls, kwargs, heads, sampling, end_of_row):
    """Invariant 2: samples follow the model's own joint distribution over all 4**4 grids (with an end-of-row
    token after each row for ``cfg-eol``: the reference enumerates sequences with the EOL written in).

    Pearson chi-square against the enumerated joint (bins with expected count < 5 pooled),
    ``DISTRIBUTION_SAMPLES`` samples, fixed seed; the test fails when p < 1e-4 (a correct decoder fails it with probability 1e-4).
    """
    pipe = make(decoder_cls, kwargs, heads, grid=(2, 2), num_codes=4, end_of_row=end_of_row)
    exact = exact_joint_distribution(pipe, "a fox", sampling)
    assert torch.isclose(exact.sum(), torch.tensor(1.0), atol=1e-5)
    counts = _empirical_counts(pipe, "a fox", sampling, seed=1)
    assert chi_square_pvalue(counts, exact) > 1e-4


OTHER_FAMILY_DISTRIBUTION_CASES = [  # (family, decoder case id): one static tree and the dynamic trees per family
    (family, case) for family in ("janus", "emu3", "anole", "lumina_mgpt") for case in EXACT_CASES if case.id in ("medusa", "eagle", "adt")
]


@pytest.mark.parametrize("family,case", OTHER_FAMILY_DISTRIBUTION_CASES,
                         ids=[f"{f}-{c.id}" for f, c in OTHER_FAMILY_DISTRIBUTION_CASES])
def test_sampling_distribution_equals_model_on_transformers_families(family, case):
    """Invariant 2 on the transformers families (Janus-Pro: its own image head, embeddings and CFG rows; Emu3: the
    visual columns of its text head and its forced end-of-row tokens): the same chi-square test as above, CFG 2, over
    all 4**4 grids of a 2x2 grid with 4 codes. Anole and Lumina-mGPT (the image columns of Chameleon's head; Lumina's
    resolution tokens and EOLs) run Medusa only, to keep time. (SJD on Emu3: ``test_pipeline_emu3.py``.)"""
    decoder_cls, kwargs, heads = case.values
    pipe = make(decoder_cls, kwargs, heads, family, grid=(2, 2), num_codes=4)
    sampling = SamplingConfig(2.0, 1.0)
    exact = exact_joint_distribution(pipe, "a fox", sampling)
    assert torch.isclose(exact.sum(), torch.tensor(1.0), atol=1e-5)
    counts = _empirical_counts(pipe, "a fox", sampling, seed=1)
    assert chi_square_pvalue(counts, exact) > 1e-4


def test_distribution_test_detects_a_wrong_sampler():
    """The statistical test has power at ``DISTRIBUTION_SAMPLES``: AR samples at temperature 1.1 are rejected
    against the T=1 joint (measured p ~ 1e-41 for three seeds)."""
    pipe = dummy_pipeline("llamagen", grid=(2, 2), num_codes=4)
    exact = exact_joint_distribution(pipe, "a fox", SamplingConfig(2.0, 1.0))
    counts = _empirical_counts(pipe, "a fox", SamplingConfig(2.0, 1.1), seed=1)
    assert chi_square_pvalue(counts, exact) < 1e-4


@pytest.mark.parametrize("decoder_cls,kwargs,heads", DECODER_CASES)
def test_same_seed_same_output(decoder_cls, kwargs, heads):
    pipe = make(decoder_cls, kwargs, heads)
    a = pipe("a fox", generator=gen(5), output_type="latent").tokens
    b = pipe("a fox", generator=gen(5), output_type="latent").tokens
    assert torch.equal(a, b)


@pytest.mark.parametrize("decoder_cls,kwargs,heads", DECODER_CASES)
def test_config_roundtrip_and_swap(decoder_cls, kwargs, heads, tmp_path):
    decoder = decoder_cls(**kwargs)
    decoder.save_pretrained(tmp_path)
    loaded = decoder_cls.from_pretrained(tmp_path)
    public = lambda c: {k: v for k, v in dict(c).items() if not k.startswith("_")}  # noqa: E731
    assert public(loaded.config) == public(decoder.config)
    for other in DECODERS.values():  # every decoder builds from every other decoder's config
        assert isinstance(other.from_config(decoder.config), other)
    assert isinstance(decoder, SpatialDecoderMixin)


def test_decoder_short_names_are_decoders():
    assert DECODERS["ar"] is AutoregressiveDecoder
    assert all(issubclass(c, SpatialDecoderMixin) for c in DECODERS.values())


def test_decoder_that_needs_heads_refuses_to_run_without_them():
    class NeedsHeads(AutoregressiveDecoder):
        def heads_needed(self):
            return HeadsNeed((OFFSET_LOGITS,), (1,), who="NeedsHeads")

    pipe = dummy_pipeline("llamagen", NeedsHeads())
    with pytest.raises(ValueError, match=r"NeedsHeads needs token-logit heads .*; found none\. .*pipe\.load_draft_heads"):
        pipe("a fox")


def test_distribution_test_detects_a_biased_acceptance_rule(monkeypatch):
    """A tree decoder whose acceptance over-accepts (a node also accepted on a coin flip) is rejected by the same
    chi-square test the exact decoders pass."""
    from spatial_pipelines.pipelines import device_tree

    exact_match = device_tree.deepest_match
    monkeypatch.setattr(device_tree, "deepest_match", lambda tables, matches: exact_match(
        tables, matches | ((torch.rand(matches.shape) < 0.5) & tables.valid)))
    pipe = make(MedusaDecoder, {}, "random", grid=(2, 2), num_codes=4)
    sampling = SamplingConfig(2.0, 1.0)
    exact = exact_joint_distribution(pipe, "a fox", sampling)
    assert chi_square_pvalue(_empirical_counts(pipe, "a fox", sampling, seed=1), exact) < 1e-4


BAD_CONFIGS = [
    (MedusaDecoder, {"num_heads": 0}, "num_heads"),
    (MedusaDecoder, {"top_k": 0}, "top_k"),
    (MedusaDecoder, {"num_heads": 2, "tree_paths": [[0, 0, 0]]}, "tree_paths"),
    (HawkDecoder, {"vertical_speculation_depth": -1}, "vertical_speculation_depth"),
    (HawkDecoder, {"num_draft_tokens": -1}, "num_draft_tokens"),
    (EagleDecoder, {"num_draft_tokens": 1.5}, "num_draft_tokens"),
    (JacobiDecoder, {"window_size": -1}, "window_size"),
    (JacobiDecoder, {"window_size": 0, "proactive_width": 2}, "proactive_width"),  # nothing drafted to widen
    (JacobiDecoder, {"init": "middle"}, "init"),
    (JacobiDecoder, {"acceptance": "greedy"}, "acceptance"),
    (JacobiDecoder, {"coupling": "gauss"}, "coupling"),
    (JacobiDecoder, {"coupling": "maximal"}, "coupling"),
    (JacobiDecoder, {"continuation": 1}, "continuation"),
    (JacobiDecoder, {"proactive_width": 0}, "proactive_width"),
    (JacobiDecoder, {"proactive_depth": 1.0}, "proactive_depth"),
    (SSDDecoder, {"num_horizontal": 0}, "num_horizontal"),
    (SSDDecoder, {"vertical_rounds": -1}, "vertical_rounds"),
    (SSDDecoder, {"horizontal_rounds": 1.5}, "horizontal_rounds"),
    (SSDDecoder, {"num_vertical_rows": 0}, "num_vertical_rows"),
    (SSDDecoder, {"staged_base_rounds": -2}, "staged_base_rounds"),
    (SSDDecoder, {"staged_incremental_rounds": -1}, "staged_incremental_rounds"),
    (SSDDecoder, {"draft": "top1"}, "draft"),
]


@pytest.mark.parametrize("decoder_cls,kwargs,name", BAD_CONFIGS, ids=[f"{c.__name__}-{n}" for c, _, n in BAD_CONFIGS])
def test_bad_decoder_config_raises(decoder_cls, kwargs, name):
    with pytest.raises(ValueError, match=name):
        decoder_cls(**kwargs)


def test_heads_without_the_offsets_a_decoder_needs_are_refused():
    pipe = dummy_pipeline("llamagen", MedusaDecoder(num_heads=2), "random")
    pipe.decoder = HawkDecoder(num_horizontal_heads=2, vertical_speculation_depth=1)
    with pytest.raises(ValueError, match="vertical"):
        pipe("a fox")
    pipe.decoder = MedusaDecoder(num_heads=3)
    with pytest.raises(ValueError, match="horizontal"):
        pipe("a fox")


def test_swapping_decoders_starts_from_the_new_decoders_defaults(tmp_path):
    """`from_config` of another decoder's config carries none of its settings (``top_k``, ``num_draft_tokens`` and
    ``acceptance`` mean other things there); keyword arguments apply; the same class keeps every setting."""
    public = lambda config: {k: v for k, v in config.items() if not k.startswith("_")}  # noqa: E731
    medusa = MedusaDecoder(top_k=2, num_draft_tokens=5, acceptance="lantern")
    for cls in (EagleDecoder, ADTTreeDecoder, HawkDecoder, JacobiDecoder, SSDDecoder, AutoregressiveDecoder):
        swapped = cls.from_config(medusa.config)
        assert public(swapped.config) == public(cls().config) and swapped.is_exact == cls().is_exact
    assert EagleDecoder.from_config(medusa.config, top_k=3).config.top_k == 3
    kept = MedusaDecoder.from_config(medusa.config)
    assert public(kept.config) == public(medusa.config) and not kept.is_exact
    medusa.save_config(tmp_path)  # a saved config file swaps the same way
    assert public(EagleDecoder.from_pretrained(tmp_path).config) == public(EagleDecoder().config)



def test_decoders_report_their_own_statistics():
    """A decoder's loop reports what is particular to it (its drafter's ``report``) into `DecodingStats.decoder_stats`,
    the one place such statistics live (no field of `DecodingStats` repeats them)."""
    eagle = make(EagleDecoder, {"depth": 3, "top_k": 2, "num_draft_tokens": 5}, "random")("a fox", generator=gen(0), output_type="latent").stats
    assert set(eagle.decoder_stats) == {"mean_tree_depth", "mean_tree_width"}
    assert eagle.decoder_stats["mean_tree_depth"] > 0 and eagle.decoder_stats["mean_tree_width"] == 2
    ar = make(AutoregressiveDecoder, {}, None)("a fox", generator=gen(0), output_type="latent").stats
    assert ar.decoder_stats == {}
    assert not {f.name for f in dataclasses.fields(ar)} & set(eagle.decoder_stats)


def test_a_decoder_that_drafts_through_the_model_needs_the_backbone():
    """A drafter that goes through the model's own head, called without the backbone, says which argument is
    missing (`draft_through`)."""
    from spatial_pipelines.decoders.decoding_utils import draft_through

    decoder = MedusaDecoder()
    with pytest.raises(ValueError, match="pass `backbone=`"):
        draft_through(None, decoder)
    assert draft_through("the adapter", decoder) == "the adapter"
