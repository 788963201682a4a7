"""SSDDecoder (lossy by design): the pass schedule, oracle drafts, the fixed point of auto-correction, and
LatentDraftHeads. The invariants SSD shares with every decoder (same seed, config round trip) run from
`test_decoders.DECODER_CASES`."""

import pytest
import torch

from spatial_pipelines import AutoregressiveDecoder, LatentDraftHeads, SSDDecoder
from spatial_pipelines.decoders import SSD_PRESETS
from spatial_pipelines.testing import dummy_pipeline

from helpers import OracleHeads, expected_passes, gen, record_device_loops


def ssd_pipeline(grid=(5, 7), heads="random", end_of_row=False, **kwargs):
    pipe = dummy_pipeline("llamagen", SSDDecoder(**kwargs), heads, grid=grid, end_of_row=end_of_row)
    pipe.set_progress_bar_config(disable=True)
    return pipe


SCHEDULES = [
    pytest.param((5, 7), dict(num_horizontal=2, horizontal_rounds=1, vertical_rounds=0), id="r0"),
    pytest.param((5, 7), dict(num_horizontal=2, horizontal_rounds=1, vertical_rounds=1), id="r1"),
    pytest.param((5, 7), dict(num_horizontal=2, horizontal_rounds=0, vertical_rounds=3), id="r3"),
    pytest.param((6, 7), dict(num_horizontal=2, num_vertical_rows=2, staged_base_rounds=2, staged_incremental_rounds=1), id="staged-kv2"),
    pytest.param((6, 4), dict(num_horizontal=1, num_vertical_rows=3, staged_base_rounds=1, staged_incremental_rounds=2), id="staged-kv3"),
]


@pytest.mark.parametrize("grid,kwargs", SCHEDULES)
@pytest.mark.parametrize("temperature,end_of_row", [(0.0, False), (1.0, False), (1.0, True)], ids=["greedy", "sample", "sample-eol"])
def test_pass_count_follows_the_schedule(grid, kwargs, temperature, end_of_row):
    """The forced end-of-row tokens ride along with the passes that feed a row's last code: no extra pass."""
    pipe = ssd_pipeline(grid, end_of_row=end_of_row, **kwargs)
    out = pipe("a fox", temperature=temperature, generator=gen(0), output_type="latent")
    stats = out.stats
    assert stats.num_forward_passes == expected_passes(grid, **kwargs)
    assert stats.accepted_lengths.shape == (stats.num_forward_passes, 1)  # one entry per target pass
    assert stats.accepted_lengths.sum().item() == grid[0] * grid[1]
    assert stats.mean_accepted_length == pytest.approx(grid[0] * grid[1] / stats.num_forward_passes)
    assert (out.tokens >= 0).all()
    if grid[0] > 1:  # every later row is committed whole by one pass
        assert (stats.acceptance_map[0, 1:] == grid[1]).all()


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sample"])
def test_pass_count_follows_the_schedule_on_janus(temperature):
    """The same schedule on Janus-Pro (transformers trunk, its own image head and embeddings), batch 2 with CFG."""
    grid, kwargs = (4, 5), dict(num_horizontal=2, vertical_rounds=2)
    pipe = dummy_pipeline("janus", SSDDecoder(**kwargs), "random", grid=grid)
    out = pipe(["a red fox", "x"], temperature=temperature, generator=gen(0), output_type="latent")
    stats = out.stats
    assert stats.num_forward_passes == expected_passes(grid, **kwargs)
    assert stats.accepted_lengths.shape == (stats.num_forward_passes, 2)
    assert (stats.accepted_lengths.sum(0) == grid[0] * grid[1]).all()
    assert (stats.acceptance_map[:, 1:] == grid[1]).all() and (out.tokens >= 0).all()


@pytest.mark.parametrize("family", ["anole", "lumina_mgpt"])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sample"])
def test_pass_count_follows_the_schedule_on_chameleon_families(family, temperature):
    """The same schedule on Anole and Lumina-mGPT (Chameleon trunk, image columns of its head; Lumina's EOLs ride
    along with the passes that feed a row's last code), batch 2 with CFG."""
    grid, kwargs = (4, 5), dict(num_horizontal=2, vertical_rounds=2)
    pipe = dummy_pipeline(family, SSDDecoder(**kwargs), "random", grid=grid)
    out = pipe(["a red fox", "x"], temperature=temperature, generator=gen(0), output_type="latent")
    stats = out.stats
    assert stats.num_forward_passes == expected_passes(grid, **kwargs)
    assert stats.accepted_lengths.shape == (stats.num_forward_passes, 2)
    assert (stats.accepted_lengths.sum(0) == grid[0] * grid[1]).all()
    assert (stats.acceptance_map[:, 1:] == grid[1]).all() and (out.tokens >= 0).all()


def test_paper_schedule_on_a_24x24_grid():
    """SSD paper, Table 5 (Janus-Pro, 24x24): 23 later rows at r + 1 passes each; our first row takes 9."""
    assert [expected_passes((24, 24), vertical_rounds=r) for r in range(3)] == [32, 55, 78]


@pytest.mark.parametrize("guidance_scale", [1.0, 3.0])
@pytest.mark.parametrize("kwargs", [dict(vertical_rounds=0, horizontal_rounds=0), dict(vertical_rounds=1),
                                    dict(num_vertical_rows=2, staged_base_rounds=0, staged_incremental_rounds=0)],
                         ids=["r0", "r1", "staged"])
@pytest.mark.parametrize("end_of_row", [False, True], ids=["", "eol"])
def test_oracle_drafts_give_the_autoregressive_grid(guidance_scale, kwargs, end_of_row):
    """Greedy SSD whose heads draft the AR greedy grid returns exactly that grid, in H + first-row passes.

    Fails if drafts land on the wrong positions (offsets/strides), the rows are committed out of order, or a
    verification round changes codes that are already the target's argmax (with EOLs: if a row is judged
    without the end-of-row token that precedes it)."""
    pipe = ssd_pipeline((5, 7), heads=None, end_of_row=end_of_row, num_horizontal=2)
    prompts = ["a red fox", "blue sky"]
    pipe.decoder = AutoregressiveDecoder()
    ref = pipe(prompts, guidance_scale=guidance_scale, temperature=0, output_type="latent").tokens
    decoder = SSDDecoder(num_horizontal=2, **kwargs)
    heads = OracleHeads.for_backbone(pipe.backbone, decoder, random_init=False)
    heads.set_grid(ref)
    pipe.decoder = decoder
    pipe.set_draft_heads(heads)
    out = pipe(prompts, guidance_scale=guidance_scale, temperature=0, output_type="latent")
    assert torch.equal(out.tokens, ref)


def test_oracle_drafts_give_the_autoregressive_grid_on_janus():
    """The oracle check on Janus-Pro with CFG: drafts land where SSD puts them on a transformers backbone too."""
    pipe = dummy_pipeline("janus", grid=(4, 5))
    prompts = ["a red fox", "x"]
    ref = pipe(prompts, guidance_scale=5.0, temperature=0, output_type="latent").tokens
    decoder = SSDDecoder(num_horizontal=2, vertical_rounds=0, horizontal_rounds=0)
    heads = OracleHeads.for_backbone(pipe.backbone, decoder, random_init=False)
    heads.set_grid(ref)
    pipe.decoder = decoder
    pipe.set_draft_heads(heads)
    out = pipe(prompts, guidance_scale=5.0, temperature=0, output_type="latent")
    assert torch.equal(out.tokens, ref)


def test_random_heads_without_rounds_do_not_reproduce_the_grid():
    """The control of the oracle test: the same check fails with random drafts and no verification."""
    pipe = ssd_pipeline((5, 7), num_horizontal=2, horizontal_rounds=0, vertical_rounds=0)
    out = pipe(["a red fox", "blue sky"], temperature=0, output_type="latent").tokens
    pipe.decoder = AutoregressiveDecoder()
    ref = pipe(["a red fox", "blue sky"], temperature=0, output_type="latent").tokens
    assert not torch.equal(out, ref)


@pytest.mark.parametrize("guidance_scale", [1.0, 3.0])
@pytest.mark.parametrize("kwargs", [dict(num_horizontal=3, horizontal_rounds=3, vertical_rounds=7),
                                    dict(num_horizontal=3, horizontal_rounds=5, vertical_rounds=9),
                                    dict(num_horizontal=2, horizontal_rounds=2, num_vertical_rows=2,
                                         staged_base_rounds=7, staged_incremental_rounds=7)],
                         ids=["r=W", "r>W", "staged"])
@pytest.mark.parametrize("end_of_row", [False, True], ids=["", "eol"])
def test_enough_greedy_rounds_reach_the_autoregressive_fixed_point(guidance_scale, kwargs, end_of_row):
    """With greedy sampling a verification round replaces every drafted code by the target's argmax given the
    codes before it: a Jacobi iteration. Its fixed point is the greedy AR row, and position ``j`` of a block is
    final after ``j + 1`` rounds, so with rounds >= block length (W = 7 for rows, k_h for chunks) greedy SSD
    must return the AR grid from random heads. It fails if a round does not re-feed the corrected codes, if
    the rolled-back KV leaks into the next round, or if positions/hidden states are misaligned."""
    prompts = ["a red fox", "blue sky"]
    pipe = ssd_pipeline((4, 7), end_of_row=end_of_row, **kwargs)
    out = pipe(prompts, guidance_scale=guidance_scale, temperature=0, output_type="latent").tokens
    pipe.decoder = AutoregressiveDecoder()
    ref = pipe(prompts, guidance_scale=guidance_scale, temperature=0, output_type="latent").tokens
    assert torch.equal(out, ref)


def test_batch_rows_follow_their_own_generators():
    pipe = ssd_pipeline((4, 5), num_horizontal=2, vertical_rounds=1, draft="sample")
    both = pipe(["a fox", "a cat"], generator=[gen(1), gen(2)], output_type="latent").tokens
    one = pipe("a cat", generator=gen(2), output_type="latent").tokens
    assert torch.equal(both[1], one[0])


def test_presets_are_the_papers_table_9():
    lumina = SSDDecoder.from_preset("lumina_mgpt")
    assert (lumina.config.num_vertical_rows, lumina.base_rounds, lumina.incremental_rounds) == (2, 5, 4)
    assert SSDDecoder.from_preset("janus_pro").config.vertical_rounds == 2
    assert SSDDecoder.from_preset("emu3", vertical_rounds=3).config.vertical_rounds == 3
    assert set(SSD_PRESETS) == {"janus_pro", "lumina_mgpt", "emu3"}
    with pytest.raises(ValueError, match="name"):
        SSDDecoder.from_preset("llava")


def test_heads_without_enough_vertical_offsets_are_refused():
    pipe = ssd_pipeline((4, 5), num_vertical_rows=2)
    pipe.decoder = SSDDecoder(num_vertical_rows=3)
    with pytest.raises(ValueError, match=r"SSDDecoder\(num_horizontal=5, num_vertical_rows=3\) needs latent heads.*lack the vertical offsets \[3\]"):
        pipe("a fox")
    pipe.decoder = SSDDecoder(num_horizontal=6)
    with pytest.raises(ValueError, match=r"lack the horizontal offsets \[6\].*--kind ssd --num-horizontal 6"):
        pipe("a fox")


def test_untrained_latent_predictor_copies_its_source_hidden_state():
    """``W0 = [I, 0]`` and ``W2 = 0``: f([h; e]) = h, so untrained heads draft what the source predicted."""
    heads = LatentDraftHeads(hidden_size=8, num_image_codes=16, grid_height=2, grid_width=2, intermediate_size=4)
    h, e = torch.randn(3, 8), torch.randn(3, 8)
    out = heads(h, e, "vertical")  # (3, 2, 8)
    assert out.shape == (3, 2, 8)
    assert torch.allclose(out, h[:, None].expand(3, 2, 8))


def test_latent_heads_roundtrip_through_the_pipeline(tmp_path):
    pipe = ssd_pipeline((4, 5))
    pipe.draft_heads.save_pretrained(tmp_path / "heads")
    fresh = dummy_pipeline("llamagen", SSDDecoder(), grid=(4, 5))
    heads = fresh.load_draft_heads(tmp_path / "heads")
    assert isinstance(heads, LatentDraftHeads)
    for a, b in zip(heads.state_dict().values(), pipe.draft_heads.state_dict().values()):
        assert torch.equal(a, b)
    fresh.set_progress_bar_config(disable=True)
    a = fresh("a fox", generator=gen(3), output_type="latent").tokens
    b = pipe("a fox", generator=gen(3), output_type="latent").tokens
    assert torch.equal(a, b)


@pytest.mark.parametrize("kwargs,match", [
    (dict(horizontal_offsets=(0, 1)), "horizontal_offsets"),
    (dict(vertical_offsets=(1, 1)), "vertical_offsets"),
    (dict(intermediate_size=0), "intermediate_size"),
])
def test_bad_latent_heads_config_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LatentDraftHeads(hidden_size=8, num_image_codes=16, grid_height=2, grid_width=2, **kwargs)


# -- the passes on the device (`device_ssd.SSDLoop`) -----------------------------------------------------------------
DEVICE_SCHEDULES = [
    pytest.param(dict(num_horizontal=2, vertical_rounds=2), id="r2"),
    pytest.param(dict(num_horizontal=3, horizontal_rounds=0, vertical_rounds=0), id="r0"),
    pytest.param(dict(num_horizontal=2, num_vertical_rows=2, staged_base_rounds=2, staged_incremental_rounds=1), id="staged"),
]


@pytest.mark.parametrize("kwargs", DEVICE_SCHEDULES)
@pytest.mark.parametrize("draft", ["argmax", "sample"])
@pytest.mark.parametrize("end_of_row", [False, True], ids=["", "eol"])
def test_a_batch_gives_each_image_what_it_gives_alone(kwargs, draft, end_of_row, monkeypatch):
    """Every draw on the device comes from keyed streams of the image's seed (the target's samples, sampled drafts,
    the verification's uniforms and residual draws): three prompts in one call give each what it gives alone with the
    same generator, in the same passes."""
    pipe = ssd_pipeline((4, 5), end_of_row=end_of_row, draft=draft, **kwargs)
    loops = record_device_loops(monkeypatch, pipe)
    prompts, call = ["a red fox", "blue sky", "x"], dict(guidance_scale=2.0, output_type="latent")
    out = pipe(prompts, generator=[gen(i) for i in range(3)], **call)
    for i, prompt in enumerate(prompts):
        alone = pipe([prompt], generator=[gen(i)], **call)
        assert torch.equal(alone.tokens[0], out.tokens[i])
        assert torch.equal(alone.stats.acceptance_map[0], out.stats.acceptance_map[i])
    assert len(loops) == 4 and out.stats.row_forward_passes == [expected_passes((4, 5), **kwargs)] * 3
    again = pipe(prompts, generator=[gen(i) for i in range(3)], **call)
    assert torch.equal(again.tokens, out.tokens)


def test_sampled_drafts_are_keyed_draws_from_the_heads(monkeypatch):
    """``draft="sample"`` draws each draft from the heads' distribution on a keyed stream of its own: without
    verification rounds the image differs from the argmax drafts' (random heads are far from one-hot), and a
    temperature tending to 0 brings the argmax drafts back (the draws concentrate on the heads' argmax)."""
    kwargs = dict(num_horizontal=2, horizontal_rounds=0, vertical_rounds=0)
    sampled = ssd_pipeline((4, 5), draft="sample", **kwargs)
    argmax = ssd_pipeline((4, 5), draft="argmax", **kwargs)
    argmax.draft_heads = sampled.draft_heads
    loops = record_device_loops(monkeypatch, sampled)
    call = dict(generator=gen(5), output_type="latent")
    assert not torch.equal(sampled("a fox", **call).tokens, argmax("a fox", **call).tokens)
    cold = dict(temperature=1e-4, generator=gen(5), output_type="latent")
    assert torch.equal(sampled("a fox", **cold).tokens, argmax("a fox", **cold).tokens)
    assert len(loops) == 2


def test_profile_rounds_times_the_parts_of_a_device_pass():
    pipe = ssd_pipeline((4, 5), num_horizontal=2, vertical_rounds=1)
    with pipe.profile_rounds() as timer:
        out = pipe("a fox", generator=gen(0), output_type="latent")
    assert timer.rounds == out.stats.num_forward_passes - 1
    assert {"draft", "forward", "accept", "kv", "round", "sync"} <= set(timer.seconds)
