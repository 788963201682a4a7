"""`JacobiDecoder` options beyond the invariant tables of `test_decoders.py`: the spatial first draft from either
kind of heads, coupled redraws, and the errors a wrong setup raises."""

import pytest
import torch

from spatial_pipelines import AutoregressiveDecoder, JacobiDecoder, LatentDraftHeads, SpatialDraftHeads
from spatial_pipelines.core import RandomSource, SamplingConfig
from spatial_pipelines.testing import dummy_pipeline

from helpers import DISTRIBUTION_SAMPLES, chi_square_pvalue, exact_joint_distribution, gen, grid_index


def _latent_pipe(decoder, **dummy):
    pipe = dummy_pipeline("llamagen", decoder, None, **dummy)
    heads = LatentDraftHeads.for_backbone(pipe.backbone, decoder)
    pipe.set_draft_heads(heads)
    return pipe


def test_heads_init_reads_latent_heads_greedy_exact():
    decoder = JacobiDecoder(window_size=4, init="heads")
    pipe = _latent_pipe(decoder, grid=(4, 5))
    out = pipe(["a fox", "b"], temperature=0, output_type="latent")
    assert out.stats.num_draft_passes > 0  # the heads ran
    pipe.decoder = AutoregressiveDecoder()
    assert torch.equal(out.tokens, pipe(["a fox", "b"], temperature=0, output_type="latent").tokens)


def test_heads_init_with_latent_heads_keeps_the_distribution():
    pipe = _latent_pipe(JacobiDecoder(window_size=3, init="heads", coupling="gumbel"), grid=(2, 2), num_codes=4)
    sampling = SamplingConfig(2.0, 1.0)
    exact = exact_joint_distribution(pipe, "a fox", sampling)
    out = pipe("a fox", guidance_scale=2.0, num_images_per_prompt=DISTRIBUTION_SAMPLES, generator=gen(2), output_type="latent",
               sampling_noise="drawn")
    assert chi_square_pvalue(torch.bincount(grid_index(out.tokens, 4), minlength=4**4), exact) > 1e-4


def test_heads_init_uses_the_prediction_for_the_position():
    """With heads whose vertical guess is the code above (what a copy would give on a vertically uniform image),
    `init="heads"` drafts exactly what `init="above"` drafts: same tokens, same passes, for the same seed."""
    pipe = dummy_pipeline("llamagen", JacobiDecoder(window_size=4, init="above"), None, grid=(4, 4))
    pipe.device_rounds = False  # both inits in the decoder's own rounds (the device round drafts row 0 otherwise)
    ref = pipe("a fox", generator=gen(3), output_type="latent")

    class CopyAbove(JacobiDecoder):  # the heads' prediction for a position = the committed code one row above
        def _predict_above(self, state, hidden, first, draft_heads, backbone):
            n, w = hidden.shape[1], state.layout.width
            end = min(first + n + w, state.layout.num_tokens)
            if first + w < end:
                state.above[:, first + w : end] = state.tokens[:, first : end - w]

    decoder = CopyAbove(window_size=4, init="heads")
    pipe.set_draft_heads(SpatialDraftHeads.for_backbone(pipe.backbone, decoder))
    pipe.decoder = decoder
    out = pipe("a fox", generator=gen(3), output_type="latent")
    assert torch.equal(out.tokens, ref.tokens)
    assert out.stats.num_forward_passes == ref.stats.num_forward_passes


def test_heads_init_refuses_missing_or_wrong_heads():
    decoder = JacobiDecoder(window_size=4, init="heads")
    pipe = dummy_pipeline("llamagen", decoder, None)
    with pytest.raises(ValueError, match=r"JacobiDecoder\(init='heads'\) needs .* with vertical offsets \[1\]; found none"):
        pipe("a fox")
    heads = SpatialDraftHeads(**pipe.backbone.facts(), horizontal_offsets=[1], vertical_offsets=[2])
    pipe.set_draft_heads(heads)
    with pytest.raises(ValueError, match=r"lack the vertical offsets \[1\]"):
        pipe("a fox")
    need = JacobiDecoder(init="heads").heads_needed()
    assert (need.kinds, need.horizontal_offsets, need.vertical_offsets) == (("offset_logits", "latent"), (), (1,))
    assert JacobiDecoder().heads_needed() is None


@pytest.mark.parametrize(
    "options,low,high",
    [({"coupling": "gumbel"}, 0.95, 1.0), ({"coupling": "none", "continuation": True}, 0.95, 1.0),
     ({"coupling": "gumbel", "continuation": True}, 0.95, 1.0), ({"coupling": "none"}, 0.0, 0.1)],
    ids=["gumbel", "continuation", "both", "none"],
)
def test_coupling_keeps_drafts_whose_distribution_did_not_move(options, low, high):
    """A redraw from an unchanged distribution keeps its code under either coupling; with fresh randomness it
    changes most of the time on a flat distribution of 64 codes."""
    pipe = dummy_pipeline("llamagen", JacobiDecoder(window_size=4, init="random", anchor="none", **options), None, grid=(2, 2), num_codes=64)
    decoder = pipe.decoder
    state = decoder.init_state(pipe.backbone.layout, SamplingConfig(1.0, 1.0), RandomSource(gen(0), 64, "cpu"), 64, 1,
                               torch.device("cpu"), pipe.backbone)
    state.tokens[:, 0] = 0
    state.num_committed = 1
    draft = decoder.propose(state)
    v = pipe.backbone.num_image_codes
    flat = torch.zeros(64, 5, v)  # logits: uniform p at every slot; q of the random drafts is uniform too
    before = state.drafts.clone()
    # reject the first draft for sure: p(x) = 0 at slot 0 for the first draft's code
    flat[:, 0].scatter_(-1, before[:, :1], -float("inf"))
    decoder.step(flat, torch.zeros(64, 5, pipe.backbone.hidden_size), draft, state)
    kept = (state.drafts[:, :3] == before[:, 1:4]).float().mean().item()
    assert low <= kept <= high, kept  # p did not move: a coupled redraw is the same code


def test_proactive_window_is_a_product_tree_then_a_chain():
    from spatial_pipelines.decoders.decoding_jacobi import descent_table, proactive_tree

    tree = proactive_tree(5, 2, 2)  # 2 + 4 candidate nodes on positions 1-2, then positions 3-5 after the first ones
    assert tree.parents.tolist() == [-1, 0, 0, 1, 1, 2, 2, 3, 7, 8]
    assert tree.depths.tolist() == [0, 1, 1, 2, 2, 2, 2, 3, 4, 5]
    table = descent_table(tree)
    assert table[2].tolist() == [0, 2, 5, 7, 8, 9]  # second candidate, its first child, then the main chain
    assert table[4].tolist() == [0, 1, 4, 7, 8, 9]
    assert torch.equal(proactive_tree(4, 1, 2).parents, torch.tensor([-1, 0, 1, 2, 3]))  # width 1: the chain
    assert JacobiDecoder(window_size=5, proactive_width=2).window == 5


def test_proactive_verification_needs_the_without_replacement_proposal(monkeypatch):
    """The distribution test has power here: verifying the extra candidates against their position's ``q`` as it
    is (as if drawn with replacement) instead of ``q`` less the earlier candidates is caught, where the decoder as
    written passes. Three codes and two candidates per position make the exclusion matter (measured: p ~ 0.35 for
    the decoder, p < 1e-300 for the mutation, 8,000 images each, seed 1). The generation runs on the device rounds
    (`ProactiveLoop`): the mutation empties its table of earlier candidates."""
    from spatial_pipelines.pipelines import device_proactive

    def p_value():
        decoder = JacobiDecoder(window_size=3, init="random", coupling="none", anchor="none", proactive_width=2, proactive_depth=3)
        pipe = dummy_pipeline("llamagen", decoder, None, grid=(2, 2), num_codes=3)
        exact = exact_joint_distribution(pipe, "a fox", SamplingConfig(2.0, 1.0))
        out = pipe("a fox", guidance_scale=2.0, num_images_per_prompt=8000, generator=gen(1), output_type="latent",
                   sampling_noise="drawn")
        return chi_square_pvalue(torch.bincount(grid_index(out.tokens, 3), minlength=3**4), exact)

    assert p_value() > 1e-4
    original = device_proactive.ProactiveLoop.__init__

    def wrong(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.earlier = torch.zeros_like(self.earlier)  # nothing excluded

    monkeypatch.setattr(device_proactive.ProactiveLoop, "__init__", wrong)
    assert p_value() < 1e-4


def test_proactive_rounds_with_end_of_row_tokens_keep_the_distribution(monkeypatch):
    """The device rounds' proactive tree where rows end inside the window (its end-of-row slots, their outputs as the
    next row's proposals), with continuation and the left anchor under drawn noise: the joint over all 3**6 grids."""
    from spatial_pipelines.pipelines import device_proactive

    runs = []
    run = device_proactive.ProactiveLoop.run
    monkeypatch.setattr(device_proactive.ProactiveLoop, "run", lambda loop, *a, **k: runs.append(loop) or run(loop, *a, **k))
    decoder = JacobiDecoder(window_size=2, init="left", continuation=True, anchor="left", proactive_width=2)
    pipe = dummy_pipeline("llamagen", decoder, None, grid=(2, 3), num_codes=3, end_of_row=True)
    exact = exact_joint_distribution(pipe, "a fox", SamplingConfig(2.0, 1.0))
    out = pipe("a fox", guidance_scale=2.0, num_images_per_prompt=DISTRIBUTION_SAMPLES, generator=gen(1),
               output_type="latent", sampling_noise="drawn")
    assert len(runs) == 1 and runs[0].proposals and runs[0].eol_slots > 0
    assert chi_square_pvalue(torch.bincount(grid_index(out.tokens, 3), minlength=3**6), exact) > 1e-4


def _first_draft_state(decoder, pipe, rows, q, left):
    """A state whose first window position holds drafts drawn from ``q`` ``(V,)`` after the committed code ``left``."""
    state = decoder.init_state(pipe.backbone.layout, SamplingConfig(1.0, 1.0), RandomSource(gen(0), rows, "cpu"), rows, 1,
                               torch.device("cpu"), pipe.backbone)
    state.tokens[:, 0] = left
    state.num_committed = 1
    state.q[:, 1] = q
    state.drafts[:, 0] = torch.multinomial(q, rows, replacement=True, generator=gen(1))
    return state


def test_left_anchor_draft_follows_its_adjusted_proposal():
    """``anchor="left"`` turns a draft ``x ~ q`` into the committed code ``c`` where ``q(x) <= q(c)``; the drafts then
    follow ``q'`` (``q`` above ``q(c)``, the rest of the mass on ``c``), the proposal the next verification uses."""
    decoder = JacobiDecoder(window_size=3, init="random", coupling="none", anchor="left")
    pipe = dummy_pipeline("llamagen", decoder, None, grid=(2, 2), num_codes=6)
    q = torch.tensor([0.05, 0.30, 0.10, 0.20, 0.25, 0.10])
    state = _first_draft_state(decoder, pipe, 40000, q, left=3)
    decoder._anchor_left(state)
    expected = torch.tensor([0.0, 0.30, 0.0, 0.45, 0.25, 0.0])  # 0.05 + 0.10 + 0.10 moved onto code 3 (q = 0.20)
    assert torch.allclose(state.q[:, 1], expected.expand(40000, 6))
    assert chi_square_pvalue(torch.bincount(state.drafts[:, 0], minlength=6), expected) > 1e-3
    state = _first_draft_state(decoder, pipe, 8, q, left=1)  # the likeliest code: every draft becomes the copy
    decoder._anchor_left(state)
    assert (state.drafts[:, 0] == 1).all() and torch.allclose(state.q[:, 1, 1], torch.ones(8))


@pytest.mark.parametrize("engine", ["device", "row-groups"])
def test_left_anchor_needs_its_adjusted_proposal(engine, monkeypatch):
    """The distribution test has power here: anchoring the draft but verifying it against the unchanged ``q`` is
    caught, on the device (drawn noise: speculative sampling against the kept proposals) and in row groups (four times
    the samples of the other distribution tests: in a batch, rows that accepted more than the shortest row carry their
    codes into the next window untested, so fewer drafts pass through the anchor)."""
    from spatial_pipelines.pipelines import device_chain

    def wrong(state):
        left, q, x = state.last_token[:, None], state.q[:, 1], state.drafts[:, :1]
        state.drafts[:, :1] = torch.where(q.gather(-1, x) > q.gather(-1, left), x, left)  # q left as it was

    def wrong_on_device(s):
        left, q, x = s.last[:, None], s.q[:, 0], s.drafts[:, :1]
        s.drafts[:, :1] = torch.where(q.gather(-1, x) > q.gather(-1, left), x, left)  # q left as it was

    monkeypatch.setattr(JacobiDecoder, "_anchor_left", staticmethod(wrong))
    monkeypatch.setattr(device_chain, "anchor_left", wrong_on_device)
    pipe = dummy_pipeline("llamagen", JacobiDecoder(window_size=3, init="random", coupling="none", anchor="left"), None,
                          grid=(2, 2), num_codes=4)
    loops = []
    run = pipe.loop._run_device
    pipe.loop._run_device = lambda loop, *a: (loops.append(loop), run(loop, *a))[1]
    pipe.device_rounds = False if engine == "row-groups" else None
    sampling = SamplingConfig(2.0, 1.0)
    exact = exact_joint_distribution(pipe, "a fox", sampling)
    out = pipe("a fox", guidance_scale=2.0, num_images_per_prompt=4 * DISTRIBUTION_SAMPLES, generator=gen(1), output_type="latent",
               sampling_noise="drawn")
    assert chi_square_pvalue(torch.bincount(grid_index(out.tokens, 4), minlength=4**4), exact) < 1e-4
    assert len(loops) == (engine == "device")


def test_continuation_on_the_device_needs_its_test(monkeypatch):
    """The distribution test has power over SJD-PAC's continuation on the device (drawn noise): keeping every old
    draft while recording this pass's ``p`` as its proposal, the test against ``p(x) / q(x)`` skipped, is caught where
    the decoder as written passes."""
    from spatial_pipelines.pipelines import device_chain

    def p_value():
        decoder = JacobiDecoder(window_size=3, init="left", coupling="none", anchor="none", continuation=True)
        pipe = dummy_pipeline("llamagen", decoder, None, grid=(2, 2), num_codes=4)
        loops = []
        run = pipe.loop._run_device
        pipe.loop._run_device = lambda loop, *a: (loops.append(loop), run(loop, *a))[1]
        exact = exact_joint_distribution(pipe, "a fox", SamplingConfig(2.0, 1.0))
        out = pipe("a fox", guidance_scale=2.0, num_images_per_prompt=DISTRIBUTION_SAMPLES, generator=gen(1),
                   output_type="latent", sampling_noise="drawn")
        assert len(loops) == 1 and loops[0].continuation
        return chi_square_pvalue(torch.bincount(grid_index(out.tokens, 4), minlength=4**4), exact)

    assert p_value() > 1e-4

    def untested(loop, redrawn, p, source, index):
        s, window = loop.state, loop.window
        old = source.clamp_max(window - 1)
        tested = (source < window) & ~s.raced.gather(1, old)
        s.raced.copy_((source <= window) & ~tested)
        return torch.where(tested, s.drafts.gather(1, old), redrawn)  # the old draft kept, untested

    monkeypatch.setattr(device_chain, "continue_drafts", untested)
    assert p_value() < 1e-4
