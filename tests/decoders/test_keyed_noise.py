"""Keyed noise (``sampling_noise="keyed"``): an image's noise at grid position ``j`` is a hash of its seed and ``j``,
so every exact decoder, at any draft size and in any batch, commits `AutoregressiveDecoder`'s codes for a seed."""

import math

import pytest
import torch

from helpers import DISTRIBUTION_SAMPLES, chi_square_pvalue, exact_joint_distribution, gen, grid_index
from helpers.tables import EXACT_CASES, make
from spatial_pipelines import AutoregressiveDecoder, JacobiDecoder, MedusaDecoder
from spatial_pipelines.core.sampling import SamplingConfig, draw_seeds, keyed_gumbel, keyed_sample
from spatial_pipelines.testing import dummy_pipeline

#: Every exact decoder: keyed noise applies to all of them (`supports_keyed_noise`).
KEYED_CASES = [c for c in EXACT_CASES if c.values[0](**c.values[1]).supports_keyed_noise]
PROMPTS = ["a red fox", "blue sky", "x"]
SAMPLED = dict(guidance_scale=2.0, temperature=1.0, output_type="latent")


def test_keyed_noise_applies_to_every_exact_decoder_and_no_relaxed_one():
    assert KEYED_CASES == EXACT_CASES and any("proactive" in c.id for c in KEYED_CASES)
    assert not MedusaDecoder(acceptance="lantern").supports_keyed_noise


def _reference_gumbel(seed: int, index: int, code: int, num_codes: int) -> float:
    """SplitMix64's finaliser on Python integers (unbounded, masked to 64 bits): what the int64 tensor arithmetic must
    reproduce bit for bit."""
    mask = (1 << 64) - 1
    z = (seed + (index * num_codes + code + 1) * 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    z ^= z >> 31
    return -math.log(-math.log(((z >> 41) + 0.5) * 2.0**-23))


def test_keyed_gumbel_matches_the_reference_hash():
    seeds = torch.tensor([0, 12345, (1 << 62) - 7])
    codes = torch.tensor([[0, 5, 511], [3, 4, 100], [511, 0, 17]])
    for index in (0, 7, 575):
        noise = keyed_gumbel(seeds, index, codes, 512)
        for b in range(3):
            for j in range(3):
                assert noise[b, j].item() == pytest.approx(_reference_gumbel(int(seeds[b]), index, int(codes[b, j]), 512), abs=1e-5)


def test_keyed_gumbel_is_finite_and_distinct_per_position_and_code():
    noise = keyed_gumbel(torch.tensor([3]), torch.arange(64)[:, None], torch.arange(512).expand(1, 64, 512), 512)
    assert torch.isfinite(noise).all()
    n = noise.numel()
    birthday = n * n / 2 / 2**23  # expected repeats among n independent 23-bit uniforms: 64 here
    assert n - noise.unique().numel() < 2 * birthday


@pytest.mark.parametrize("config,p", [
    (SamplingConfig(), [0.5, 0.3, 0.15, 0.05]),
    (SamplingConfig(top_k=2), [0.625, 0.375, 0.0, 0.0]),
    (SamplingConfig(temperature=0.5), [0.5**2, 0.3**2, 0.15**2, 0.05**2]),
    (SamplingConfig(top_p=0.7), [0.625, 0.375, 0.0, 0.0]),
])
def test_keyed_sample_follows_p_over_seeds_and_over_positions(config, p):
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    expected = torch.tensor(p) / sum(p)
    logits = probs.log()
    over_seeds = keyed_sample(logits.expand(20000, 4), config, draw_seeds(gen(0), 20000), 3)  # (20000,)
    over_positions = keyed_sample(logits.expand(1, 20000, 4), config, draw_seeds(gen(1), 1), torch.arange(20000))[0]
    for codes in (over_seeds, over_positions):
        counts = torch.bincount(codes, minlength=4)
        assert chi_square_pvalue(counts, expected) > 1e-4
    same_next = (over_positions[1:] == over_positions[:-1]).float().mean().item()  # neighbours are independent
    assert same_next == pytest.approx((expected**2).sum().item(), abs=0.02)


@pytest.mark.parametrize("top_p", [None, 0.8])
def test_keyed_top_k_is_the_race_of_every_code_with_the_rest_masked(top_p):
    """Top-k's race runs over the k kept codes only (one top-k over the logits without top-p): the same codes as the
    race of all V codes, each with its own keyed noise, where top-k and top-p put the rest at -inf."""
    from spatial_pipelines.core.sampling import filtered_logits

    logits, config = torch.randn(4, 6, 50, generator=gen(2)), SamplingConfig(temperature=0.7, top_k=7, top_p=top_p)
    seeds, index = draw_seeds(gen(3), 4), torch.arange(6)
    every = torch.arange(50).expand(4, 6, 50)
    race = (filtered_logits(logits, config) + keyed_gumbel(seeds, index[:, None], every, 50)).argmax(-1)
    assert torch.equal(keyed_sample(logits, config, seeds, index), race)


def test_keyed_sample_is_the_argmax_when_greedy():
    logits = torch.randn(3, 5, 7)
    assert torch.equal(keyed_sample(logits, SamplingConfig(temperature=0), torch.zeros(3, dtype=torch.long), 0),
                       logits.argmax(-1))


def _tokens(pipe, decoder, prompts, num_images_per_prompt=1, **call):
    pipe.decoder = decoder
    generators = [gen(10 + i) for i in range(len(prompts) * num_images_per_prompt)]
    out = pipe(prompts, num_images_per_prompt=num_images_per_prompt, generator=generators, **{**SAMPLED, **call})
    return out


@pytest.mark.parametrize("family,dummy", [("llamagen", {}), ("llamagen", {"end_of_row": True})], ids=["llamagen", "llamagen-eol"])
@pytest.mark.parametrize("decoder_cls,kwargs,heads", KEYED_CASES)
def test_every_exact_decoder_samples_the_autoregressive_image(decoder_cls, kwargs, heads, family, dummy):
    """Sampled (CFG, temperature 1), a batch of prompts with one generator per image: the decoder's codes are AR's
    for the same generators, in no more target passes."""
    pipe = make(decoder_cls, kwargs, heads, family, grid=(4, 5), **dummy)
    decoder = pipe.decoder
    ref = _tokens(pipe, AutoregressiveDecoder(), PROMPTS, 2)
    out = _tokens(pipe, decoder, PROMPTS, 2)
    assert torch.equal(out.tokens, ref.tokens)
    assert out.stats.num_forward_passes <= ref.stats.num_forward_passes


@pytest.mark.parametrize("decoder_cls,kwargs,heads", [c for c in KEYED_CASES if c.id in ("medusa-paths", "sjd", "eagle", "adt-vertical")])
def test_every_exact_decoder_samples_the_autoregressive_image_on_janus(decoder_cls, kwargs, heads):
    pipe = make(decoder_cls, kwargs, heads, "janus", grid=(4, 5))
    decoder = pipe.decoder
    ref = _tokens(pipe, AutoregressiveDecoder(), PROMPTS, top_k=5)
    out = _tokens(pipe, decoder, PROMPTS, top_k=5)
    assert torch.equal(out.tokens, ref.tokens)


def test_the_same_seed_gives_the_same_pixels_whatever_the_window_or_batch():
    """One prompt's image under SJD with three window sizes and Medusa is AR's, pixel for pixel, alone and in a batch
    (against AR's batch: the VQ decoder's batched convolutions round differently from a single image's, by ~3e-7);
    in the batch it has the codes it has alone."""
    pipe = dummy_pipeline("llamagen", MedusaDecoder(), "random", grid=(4, 5))
    pipe.decoder = AutoregressiveDecoder()
    call = dict(guidance_scale=2.0, output_type="np")
    ref = pipe("a red fox", generator=gen(4), **call)
    ref_batch = pipe(["blue sky", "a red fox"], generator=[gen(9), gen(4)], **call)
    assert torch.equal(ref_batch.tokens[1], ref.tokens[0])
    for decoder in (JacobiDecoder(window_size=2), JacobiDecoder(window_size=6), JacobiDecoder(), MedusaDecoder()):
        pipe.decoder = decoder
        alone = pipe("a red fox", generator=gen(4), **call)
        batch = pipe(["blue sky", "a red fox"], generator=[gen(9), gen(4)], **call)
        assert (alone.images == ref.images).all() and (batch.images == ref_batch.images).all(), type(decoder).__name__


@pytest.mark.parametrize("sampling", [SamplingConfig(2.0, 1.0, noise="keyed"), SamplingConfig(1.0, 0.8, top_k=3, noise="keyed")],
                         ids=["cfg", "topk"])
def test_keyed_autoregressive_samples_follow_the_model(sampling):
    """The reference every keyed decoder equals: AR under keyed noise follows the model's joint distribution."""
    pipe = dummy_pipeline("llamagen", AutoregressiveDecoder(), None, grid=(2, 2), num_codes=4)
    exact = exact_joint_distribution(pipe, "a fox", sampling)
    out = pipe("a fox", guidance_scale=sampling.guidance_scale, temperature=sampling.temperature, top_k=sampling.top_k,
               num_images_per_prompt=DISTRIBUTION_SAMPLES, generator=gen(1), output_type="latent", sampling_noise="keyed")
    assert chi_square_pvalue(torch.bincount(grid_index(out.tokens, 4), minlength=4**4), exact) > 1e-4


def test_drawn_noise_still_depends_on_the_decoder():
    """The setting is real: with ``"drawn"`` a speculative decoder runs its own acceptance test (SJD: a keyed uniform
    against each draft's proposal), so its image differs from AR's, while AR, which tests no draft, samples the
    target as under keyed noise."""
    pipe = dummy_pipeline("llamagen", AutoregressiveDecoder(), None, grid=(4, 5))
    ref = _tokens(pipe, AutoregressiveDecoder(), PROMPTS, sampling_noise="drawn").tokens
    assert torch.equal(ref, _tokens(pipe, AutoregressiveDecoder(), PROMPTS, sampling_noise="keyed").tokens)
    out = _tokens(pipe, JacobiDecoder(window_size=4), PROMPTS, sampling_noise="drawn").tokens
    assert not torch.equal(out, ref)


def test_default_noise_is_keyed_where_the_decoder_supports_it():
    pipe = dummy_pipeline("llamagen", JacobiDecoder(window_size=3), None, grid=(4, 5))
    keyed = _tokens(pipe, JacobiDecoder(window_size=3), PROMPTS, sampling_noise="keyed").tokens
    assert torch.equal(_tokens(pipe, JacobiDecoder(window_size=3), PROMPTS).tokens, keyed)
    lantern = MedusaDecoder(acceptance="lantern")
    assert not lantern.supports_keyed_noise and JacobiDecoder(proactive_width=2).supports_keyed_noise
    pipe = dummy_pipeline("llamagen", lantern, "random", grid=(4, 5))
    out = pipe("a fox", generator=gen(0), output_type="latent")  # None: drawn for a relaxed rule
    assert out.tokens.shape == (1, 4, 5)


@pytest.mark.parametrize("value,match", [
    ("gumbel", r"`sampling_noise` must be one of \('keyed', 'drawn'\)"),
    (1, r"`sampling_noise` must be one of"),
])
def test_bad_sampling_noise_is_refused(value, match):
    pipe = dummy_pipeline("llamagen", AutoregressiveDecoder(), None, grid=(2, 2))
    with pytest.raises(ValueError, match=match):
        pipe("a fox", sampling_noise=value)


def test_keyed_noise_with_a_relaxed_rule_is_refused():
    pipe = dummy_pipeline("llamagen", MedusaDecoder(acceptance="lantern"), "random", grid=(2, 2))
    with pytest.raises(ValueError, match=r"`sampling_noise='keyed'` needs an exact decoder.*MedusaDecoder"):
        pipe("a fox", sampling_noise="keyed")
