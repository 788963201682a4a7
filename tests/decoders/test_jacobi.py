"""`JacobiDecoder` options beyond the invariant tables of `test_decoders.py`: the spatial first draft from either
kind of heads, the left anchor, proactive candidates, and the errors a wrong setup raises."""

from types import SimpleNamespace

import torch

from spatial_pipelines import AutoregressiveDecoder, JacobiDecoder, LatentDraftHeads, SpatialDraftHeads
from spatial_pipelines.core import SamplingConfig
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
    `init="heads"` drafts exactly what `init="above"` drafts below the first row: under drawn noise (the drafts'
    proposals kept and tested) the same tokens and passes for the same seed, once the first row is done."""
    pipe = dummy_pipeline("llamagen", JacobiDecoder(window_size=4, init="above"), None, grid=(4, 4))
    call = dict(output_type="latent", sampling_noise="drawn")
    ref = pipe("a fox", generator=gen(3), **call)

    class CopyAbove(JacobiDecoder):  # the heads' prediction for a position = the committed code one row above
        def vertical_logits(self, draft_heads, backbone, hidden, codes):
            return torch.nn.functional.one_hot(codes.clamp_min(0), backbone.num_image_codes).float() * 1e4  # (B, n, V)

    decoder = CopyAbove(window_size=4, init="heads")
    pipe.set_draft_heads(SpatialDraftHeads.for_backbone(pipe.backbone, decoder))
    pipe.decoder = decoder
    out = pipe("a fox", generator=gen(3), **call)
    assert torch.equal(out.tokens, ref.tokens)
    assert out.stats.num_forward_passes == ref.stats.num_forward_passes


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


def _first_draft_state(rows, q, left):
    """A chain state's first window position: drafts drawn from ``q`` ``(V,)`` after the committed code ``left``."""
    v = q.shape[0]
    return SimpleNamespace(last=torch.full((rows,), left), q=q.expand(rows, 3, v).clone(),
                           drafts=torch.multinomial(q, rows, replacement=True, generator=gen(1))[:, None].repeat(1, 2),
                           raced=None)


def test_left_anchor_draft_follows_its_adjusted_proposal():
    """``anchor="left"`` (`device_chain.anchor_left`) turns a draft ``x ~ q`` into the committed code ``c`` where
    ``q(x) <= q(c)``; the drafts then follow ``q'`` (``q`` above ``q(c)``, the rest of the mass on ``c``), the proposal
    the next verification uses."""
    from spatial_pipelines.pipelines.device_chain import anchor_left

    q = torch.tensor([0.05, 0.30, 0.10, 0.20, 0.25, 0.10])
    state = _first_draft_state(40000, q, left=3)
    anchor_left(state)
    expected = torch.tensor([0.0, 0.30, 0.0, 0.45, 0.25, 0.0])  # 0.05 + 0.10 + 0.10 moved onto code 3 (q = 0.20)
    assert torch.allclose(state.q[:, 0], expected.expand(40000, 6))
    assert chi_square_pvalue(torch.bincount(state.drafts[:, 0], minlength=6), expected) > 1e-3
    state = _first_draft_state(8, q, left=1)  # the likeliest code: every draft becomes the copy
    anchor_left(state)
    assert (state.drafts[:, 0] == 1).all() and torch.allclose(state.q[:, 0, 1], torch.ones(8))


def test_left_anchor_needs_its_adjusted_proposal(monkeypatch):
    """The distribution test has power here: anchoring the draft but verifying it against the unchanged ``q`` is
    caught (drawn noise: speculative sampling against the kept proposals)."""
    from spatial_pipelines.pipelines import device_chain

    def wrong_on_device(s):
        left, q, x = s.last[:, None], s.q[:, 0], s.drafts[:, :1]
        s.drafts[:, :1] = torch.where(q.gather(-1, x) > q.gather(-1, left), x, left)  # q left as it was

    monkeypatch.setattr(device_chain, "anchor_left", wrong_on_device)
    pipe = dummy_pipeline("llamagen", JacobiDecoder(window_size=3, init="random", coupling="none", anchor="left"), None,
                          grid=(2, 2), num_codes=4)
    loops = []
    run = pipe.loop._run_device
    pipe.loop._run_device = lambda loop, *a: (loops.append(loop), run(loop, *a))[1]
    sampling = SamplingConfig(2.0, 1.0)
    exact = exact_joint_distribution(pipe, "a fox", sampling)
    out = pipe("a fox", guidance_scale=2.0, num_images_per_prompt=DISTRIBUTION_SAMPLES, generator=gen(1), output_type="latent",
               sampling_noise="drawn")
    assert chi_square_pvalue(torch.bincount(grid_index(out.tokens, 4), minlength=4**4), exact) < 1e-4
    assert len(loops) == 1 and loops[0].anchor


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
