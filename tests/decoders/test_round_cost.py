"""The round's cost rules (issue: a round that costs little more than its forward pass): at most one host read per
round, "auto" draft sizes chosen from the measured pass cost, the vectorised tree walk equal in distribution to
the sequential one, and the round timer's sections."""

import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from spatial_pipelines import (ADTTreeDecoder, AutoregressiveDecoder, EagleDecoder, HawkDecoder, JacobiDecoder, LlamaGenPipeline,
                               MedusaDecoder)

from spatial_pipelines.core.tree import tree_from_paths
from helpers.walks import RandomSource, verify_tree_sequential
from spatial_pipelines.decoders.decoding_tree import AUTO_RATE_TOLERANCE, NO_DRAFT_MARGIN, best_subtree, node_priors
from spatial_pipelines.pipelines.device_loop import DeviceLoop
from spatial_pipelines.pipelines.pass_cost import RoundCost, fit_pass_cost, fit_round_cost
from spatial_pipelines.testing import dummy_pipeline

from helpers import DECODER_CASES, make

#: Python-level reads that do not reach the dispatcher on a CPU tensor (each is a device read on a GPU)
PYTHON_HOST_READS = ("tolist",)
#: dispatcher-level reads: ``item``, ``int()``, ``bool()`` and the checks inside ops (`F.one_hot` reads the codes'
#: min and max, for one) all end in one of these, which on a GPU wait for the device
DISPATCH_HOST_READS = ("aten._local_scalar_dense", "aten.nonzero", "aten.is_nonzero", "aten.equal", "aten.masked_select")


class _DispatchReads(TorchDispatchMode):
    def __init__(self, counts):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts["reads"] += str(func.overloadpacket) in DISPATCH_HOST_READS
        return func(*args, **(kwargs or {}))


def _count_host_reads(monkeypatch):
    """Count device-to-host reads (tensor -> Python value, in Python or inside an op) made inside rounds only
    (`DeviceLoop.step`; the syncs between rounds are not rounds)."""
    counts = {"reads": 0, "rounds": 0, "inside": False}
    for name in PYTHON_HOST_READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            if counts["inside"]:
                counts["reads"] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    step = DeviceLoop.step

    def counted_step(loop):
        counts["inside"], counts["rounds"] = True, counts["rounds"] + 1
        try:
            with _DispatchReads(counts):
                return step(loop)
        finally:
            counts["inside"] = False

    monkeypatch.setattr(DeviceLoop, "step", counted_step)
    return counts


@pytest.mark.parametrize("decoder_cls,kwargs,heads", DECODER_CASES)
@pytest.mark.parametrize("end_of_row", [False, True], ids=["no-eol", "eol"])
def test_rounds_read_nothing_from_the_device(decoder_cls, kwargs, heads, end_of_row, monkeypatch):
    """Every decoder's rounds, eager, at three images (rows that accept different runs), end-of-row layouts
    included, make no host read: the host reads the device only at the syncs between rounds (`DeviceLoop.run`)."""
    batch = 3
    pipe = make(decoder_cls, kwargs, heads, grid=(4, 5), end_of_row=end_of_row)
    pipe("warm", generator=torch.Generator().manual_seed(0), output_type="latent")  # "auto" sizes resolved here
    counts = _count_host_reads(monkeypatch)
    out = pipe(["a red fox", "blue sky", "x"][:batch], guidance_scale=2.0, generator=torch.Generator().manual_seed(1), output_type="latent")
    assert counts["rounds"] == out.stats.num_forward_passes - 1 > 0
    assert counts["reads"] == 0, f"{counts['reads']} host reads in {counts['rounds']} rounds"


@pytest.mark.parametrize("reader", ["item", "one_hot"])
def test_host_read_counter_can_fail(reader, monkeypatch):
    """The counter sees a read in a round: an ``.item()``, and a read no Python call shows (`F.one_hot` checks its
    codes' range on the host)."""
    from spatial_pipelines.pipelines import device_tree

    pipe = make(MedusaDecoder, {}, "random", grid=(4, 5))
    counts = _count_host_reads(monkeypatch)
    head_tree_round = device_tree.head_tree_round

    def reading(loop):
        if reader == "item":
            loop.state.committed.sum().item()
        else:
            torch.nn.functional.one_hot(loop.state.last, 64)
        return head_tree_round(loop)

    monkeypatch.setattr(device_tree, "head_tree_round", reading)  # `HeadTreeLoop.default_round` looks it up
    pipe("a fox", generator=torch.Generator().manual_seed(0), output_type="latent")
    assert counts["reads"] >= counts["rounds"] > 0


@pytest.mark.parametrize("decoder_cls,size_arg", [(MedusaDecoder, "num_draft_tokens"), (HawkDecoder, "num_draft_tokens"), (JacobiDecoder, "window_size")])
def test_auto_size_follows_the_round_cost(decoder_cls, size_arg):
    """Flat cost: the smallest tree within `AUTO_RATE_TOLERANCE` of the largest (every node is worth its price);
    cost growing with every fed token: no draft pays (size 0: AR's rounds)."""
    flat = decoder_cls(**{size_arg: "auto"})
    flat.resolve_draft_size(lambda tree: 1.0)
    sizes = flat._draft_sizes()
    expected = {n: 1 + flat._sized_tree(n)[1] for n in sizes}  # codes per pass (= per second: the cost is 1)
    chosen = flat.tree.num_nodes - 1
    assert expected[chosen] >= (1 - AUTO_RATE_TOLERANCE) * max(expected.values()) > expected[sizes[sizes.index(chosen) - 1]]
    assert chosen > 8  # flat: a large draft
    steep = decoder_cls(**{size_arg: "auto"})
    steep.resolve_draft_size(lambda tree: float(tree.num_nodes))
    assert steep.tree.num_nodes == 1 and steep.fixed_sizes() == {size_arg: 0}
    fixed = decoder_cls(**{size_arg: 3})
    assert fixed.tree.num_nodes == 4 and not fixed.sizes_from_pass_cost


@pytest.mark.parametrize("decoder_cls", [EagleDecoder, ADTTreeDecoder])
def test_auto_tree_size_weighs_the_drafter_passes(decoder_cls):
    """EAGLE-2 drafts with one drafter pass per depth, which its whole round's cost holds: with a flat cost the largest
    tree pays, and a smaller one when every depth costs a drafter pass as dear as a target pass."""
    free = decoder_cls(depth=4, top_k=3, num_draft_tokens="auto")
    free.resolve_draft_size(lambda tree: 1.0)
    expected = {n: 1 + free._sized_tree(n)[1] for n in free._draft_sizes()}  # codes per pass, all at the same cost
    assert 1 + free._sized_tree(free.tree.num_nodes - 1)[1] >= (1 - AUTO_RATE_TOLERANCE) * max(expected.values())
    assert free.tree.num_nodes > 4
    dear = decoder_cls(depth=4, top_k=3, num_draft_tokens="auto")
    dear.resolve_draft_size(lambda tree: 1.0 + tree.max_depth)
    assert dear.tree.num_nodes < free.tree.num_nodes


def test_pipeline_times_eagle_rounds_with_their_drafter_passes(monkeypatch):
    """EAGLE-2's "auto" size is timed on whole rounds too: the drafter's passes are part of what is timed."""
    pipe = dummy_pipeline("llamagen", EagleDecoder(depth=3, top_k=2, num_draft_tokens="auto"), "random", grid=(4, 5))
    passes = []
    forward = pipe.draft_heads.forward
    pipe.draft_heads.forward = lambda *a, **k: passes.append(1) or forward(*a, **k)
    pipe("a fox", generator=torch.Generator().manual_seed(0), output_type="latent")
    round_cost, _ = pipe.decoder._resolved_for
    assert isinstance(round_cost, RoundCost) and round_cost.seconds and all(s > 0 for s in round_cost.seconds.values())
    assert len(passes) > len(round_cost.seconds) * (round_cost.warmup + round_cost.repeats)  # drafter passes ran in the timed rounds


def test_auto_size_is_resolved_once_per_pipeline_and_serves_the_invariants():
    pipe = dummy_pipeline("llamagen", JacobiDecoder(window_size="auto"), None, grid=(4, 5))
    assert pipe.decoder.sizes_from_pass_cost
    greedy = pipe(["a fox", "x"], guidance_scale=2.0, temperature=0, output_type="latent")
    chosen = pipe.decoder.tree.num_nodes
    round_cost = pipe.decoder._resolved_for[0]
    costs = dict(round_cost.seconds)  # two images: the rounds timed at the call's batch
    assert round_cost.batch_size == 2 and len(costs) > 3 and all(s > 0 for s in costs.values())
    assert pipe(["a fox", "x"], guidance_scale=2.0, temperature=0, output_type="latent").tokens.equal(greedy.tokens)
    assert pipe.decoder.tree.num_nodes == chosen and round_cost.seconds == costs  # measured once


def test_fitted_pass_cost_recovers_the_curve_and_never_falls():
    """A flat-then-rising (weight-bound, then compute-bound) curve and a straight one are recovered from their
    points, and the fit never falls as ``T`` grows."""
    sizes = [2, 3, 4, 5, 6, 7, 9, 11, 13, 17, 21, 25, 33, 49, 65]
    gpu = fit_pass_cost({t: 1.0 + 0.05 * max(0, t - 17) for t in sizes})
    assert gpu.knee == 17 and abs(gpu.base - 1.0) < 1e-9 and abs(gpu.slope) < 1e-9 and abs(gpu.extra_slope - 0.05) < 1e-9
    cpu = fit_pass_cost({t: 7.0 + 0.2 * t for t in sizes})
    assert all(abs(cpu(t) - (7.0 + 0.2 * t)) < 1e-9 for t in sizes)
    noisy = fit_pass_cost({t: (9.0 if t == 2 else 7.0 + 0.2 * t) for t in sizes})  # T = 2 read 1.6 ms (21%) slow
    assert all(noisy(a) <= noisy(b) for a, b in zip(sizes, sizes[1:]))
    with pytest.raises(ValueError, match="seconds"):
        fit_pass_cost({})


def test_a_round_without_drafts_is_read_as_timed_off_the_drafted_curve():
    """janus-25m's shape: a one-token round costs 1.0, a drafted one 1.2 + 0.05 per node. The round without drafts is
    read as timed (one line through every point puts it near 1.1), so a window whose drafts add 0.25 codes a round
    loses to no window (1.25 / 1.3 codes per unit), and one whose drafts add 0.4 wins."""
    timing = lambda n: 1.0 if n == 1 else 1.2 + 0.05 * n  # noqa: E731
    sizes = [1, 2, 3, 4, 5, 6, 7, 9, 11, 13, 17]
    curve = fit_round_cost({n: timing(n) for n in sizes})
    assert curve(1) == 1.0 and all(abs(curve(n) - timing(n)) < 1e-9 for n in sizes[1:])
    assert fit_pass_cost({n: timing(n) for n in sizes})(1) > 1.05  # what one line through all the points gives
    assert fit_round_cost({1: 2.0})(1) == 2.0
    for extra, window in ((0.25, 0), (0.40, 1)):
        decoder = JacobiDecoder(window_size="auto")
        decoder.resolve_draft_size(_Timings(timing), accepted={n: extra if n else 0.0 for n in decoder._draft_sizes()})
        assert decoder.fixed_sizes() == {"window_size": window}


@pytest.mark.parametrize("decoder_cls,size_arg", [(JacobiDecoder, "window_size"), (MedusaDecoder, "num_draft_tokens"),
                                                   (HawkDecoder, "num_draft_tokens"), (EagleDecoder, "num_draft_tokens")])
@pytest.mark.parametrize("extra,window", [(0.04, 0), (NO_DRAFT_MARGIN - 0.005, 0), (NO_DRAFT_MARGIN + 0.005, 1), (0.2, 1)])
def test_drafting_must_beat_rounds_without_drafts_by_the_margin(decoder_cls, size_arg, extra, window):
    """At equal round costs a draft whose nodes add ``extra`` codes a round is chosen only past `NO_DRAFT_MARGIN`
    (the best of many noisy estimates sits above its true rate); then the smallest within the tolerance. Every
    decoder weighs rounds without drafts (size 0: heads or a drafter that this checkpoint defeats draft nothing)."""
    decoder = decoder_cls(**{size_arg: "auto"})
    assert decoder._draft_sizes()[0] == 0
    decoder.resolve_draft_size(lambda tree: 1.0, accepted={n: extra if n else 0.0 for n in decoder._draft_sizes()})
    assert decoder.fixed_sizes() == {size_arg: window}
    assert type(decoder).from_config(decoder.config, **decoder.fixed_sizes()).tree.num_nodes == 1 + window


class _Timings:
    """A `RoundCost` stand-in: "measures" ``seconds(nodes)`` per candidate tree and fits like `RoundCost.fitted`."""

    def __init__(self, seconds):
        self.timing, self.seconds = seconds, {}

    def fitted(self, trees):
        self.seconds.update({t.num_nodes: self.timing(t.num_nodes) for t in trees})
        curve = fit_round_cost(self.seconds)
        return lambda tree: curve(tree.num_nodes)


@pytest.mark.parametrize("decoder_cls,size_arg", [(MedusaDecoder, "num_draft_tokens"), (HawkDecoder, "num_draft_tokens"), (JacobiDecoder, "window_size")])
def test_auto_size_from_the_fitted_curve_holds_under_timing_noise(decoder_cls, size_arg):
    """Timings with 2% noise per size (seeded, 30 draws) on this VM's curve shape (7 ms + 0.2 ms per fed token):
    sizes chosen from the fitted curve agree far more often than sizes read off each noisy point."""
    rng = random.Random(0)
    fitted, raw = [], []
    for _ in range(30):
        noise = {t: 1 + rng.gauss(0, 0.02) for t in range(1, 70)}
        timing = lambda t, noise=noise: (7.0 + 0.2 * t) * noise[t]  # noqa: E731
        for chosen, cost in ((fitted, _Timings(timing)), (raw, lambda tree, timing=timing: timing(tree.num_nodes))):
            decoder = decoder_cls(**{size_arg: "auto"})
            decoder.resolve_draft_size(cost)
            chosen.append(decoder.tree.num_nodes)
    share = lambda sizes: max(sizes.count(n) for n in sizes) / len(sizes)  # noqa: E731
    assert share(fitted) >= 0.85 and share(fitted) > share(raw) and len(set(fitted)) < len(set(raw))


@pytest.mark.parametrize("decoder_cls,size_arg", [(MedusaDecoder, "num_draft_tokens"), (HawkDecoder, "num_draft_tokens"), (JacobiDecoder, "window_size")])
def test_auto_size_counts_the_whole_round(decoder_cls, size_arg):
    """A round cost that adds work per node to the pass makes "auto" choose a smaller draft than the pass alone; a
    fixed cost per round (amortised over more accepted codes) a larger one, never smaller."""
    pass_cost = lambda tree: 1.0 + 0.04 * tree.num_nodes  # noqa: E731
    alone = decoder_cls(**{size_arg: "auto"})
    alone.resolve_draft_size(pass_cost)
    per_node = decoder_cls(**{size_arg: "auto"})
    per_node.resolve_draft_size(lambda tree: pass_cost(tree) + 0.2 * tree.num_nodes)
    per_round = decoder_cls(**{size_arg: "auto"})
    per_round.resolve_draft_size(lambda tree: pass_cost(tree) + 1.0)
    assert per_node.tree.num_nodes < alone.tree.num_nodes <= per_round.tree.num_nodes


@pytest.mark.parametrize("decoder_cls,kwargs", [(MedusaDecoder, {"num_draft_tokens": "auto"}), (JacobiDecoder, {"window_size": "auto"})])
def test_pipeline_times_whole_rounds_on_the_engine(decoder_cls, kwargs, monkeypatch):
    """A call with an "auto" size times every candidate's whole round on real rounds of the engine (`DeviceLoop.step`,
    nothing of the row-group loop), once per pipeline; the decoder keeps the tree it chose, and greedy output is unchanged
    by the choice."""
    from spatial_pipelines.pipelines.device_loop import DeviceLoop

    steps = []
    step = DeviceLoop.step
    monkeypatch.setattr(DeviceLoop, "step", lambda loop: (steps.append(type(loop).__name__), step(loop))[1])
    heads = "random" if decoder_cls is MedusaDecoder else None
    pipe = dummy_pipeline("llamagen", decoder_cls(**kwargs), heads, grid=(4, 5))
    out = pipe("a fox", temperature=0, output_type="latent")
    round_cost, _ = pipe.decoder._resolved_for
    assert isinstance(round_cost, RoundCost) and round_cost.decoder is pipe.decoder
    candidates = {pipe.decoder._sized_tree(n)[0].num_nodes for n in pipe.decoder._draft_sizes()}
    assert set(round_cost.seconds) == candidates and all(s > 0 for s in round_cost.seconds.values())
    timed_rounds = (round_cost.warmup + round_cost.repeats) * len(candidates) * (1 + round_cost.rounds)
    assert len(steps) >= timed_rounds  # the timed rounds ran on the engine, then the call's own
    chosen, timed = pipe.decoder.tree, dict(round_cost.seconds)
    assert pipe("a fox", temperature=0, output_type="latent").tokens.equal(out.tokens)
    assert pipe.decoder.tree is chosen and round_cost.seconds == timed  # timed once
    other = pipe.decoder
    pipe.decoder = decoder_cls(**kwargs)  # a benchmark swaps decoders prompt by prompt: each is timed once
    pipe("a fox", temperature=0, output_type="latent")
    pipe.decoder = other
    pipe("a fox", temperature=0, output_type="latent")
    assert pipe.decoder._resolved_for[0] is round_cost and round_cost.seconds == timed
    size = {"num_draft_tokens": chosen.num_nodes - 1} if decoder_cls is MedusaDecoder else {"window_size": chosen.num_nodes - 1}
    fixed = dummy_pipeline("llamagen", decoder_cls(**size), heads, grid=(4, 5))
    assert fixed("a fox", temperature=0, output_type="latent").tokens.equal(out.tokens)  # same seed, same weights


@pytest.mark.parametrize("bad", [0, -2, "big", 1.5, True])
@pytest.mark.parametrize("decoder_cls,size_arg", [(MedusaDecoder, "num_draft_tokens"), (HawkDecoder, "num_draft_tokens"), (JacobiDecoder, "window_size")])
def test_bad_draft_size_is_refused(decoder_cls, size_arg, bad):
    if bad == 0:
        assert decoder_cls(**{size_arg: bad}).tree.num_nodes == 1  # no drafts: AR's rounds (test_device_loop.py)
        return
    with pytest.raises(ValueError, match=size_arg):
        decoder_cls(**{size_arg: bad})


@pytest.mark.parametrize("temperature,noise", [(0, None), (1.0, "keyed"), (1.0, "drawn")])
def test_sjd_window_zero_gives_ar_codes_and_rounds(temperature, noise):
    """`window_size=0` drafts nothing: AR's passes, and under greedy or keyed noise AR's codes, for every init."""
    pipe = dummy_pipeline("llamagen", AutoregressiveDecoder(), None, grid=(3, 4))
    pipe.set_progress_bar_config(disable=True)
    kwargs = dict(guidance_scale=2.0, temperature=temperature, output_type="latent", num_images_per_prompt=2)
    if noise is not None:
        kwargs["sampling_noise"] = noise
    ref = pipe(["a fox", "x"], generator=torch.Generator().manual_seed(3), **kwargs)
    for init in ("above", "random", "left"):
        pipe.decoder = JacobiDecoder(window_size=0, init=init)
        out = pipe(["a fox", "x"], generator=torch.Generator().manual_seed(3), **kwargs)
        assert out.stats.num_forward_passes == ref.stats.num_forward_passes
        assert noise == "drawn" or out.tokens.equal(ref.tokens)


def test_tune_decoder_says_when_no_window_beats_rounds_without_drafts(monkeypatch, caplog):
    """Where every drafted slot costs a full pass and nothing is accepted, `tune_decoder` returns window 0 and says
    so."""
    pipe = make(JacobiDecoder, {"window_size": 4}, None, grid=(4, 5))
    resolve = JacobiDecoder.resolve_draft_size
    monkeypatch.setattr(JacobiDecoder, "resolve_draft_size",
                        lambda self, cost, batch_size=1, accepted=None: resolve(self, lambda tree: float(tree.num_nodes), batch_size,
                                                                                 {n: 0.0 for n in self._draft_sizes()}))
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.enable_propagation()
    try:
        with caplog.at_level("WARNING"):
            tuned = pipe.tune_decoder(batch_size=1)
    finally:
        diffusers_logging.disable_propagation()
    assert tuned.config.window_size == 0 and tuned.tree.num_nodes == 1
    assert "window_size=0" in caplog.text and "AutoregressiveDecoder" in caplog.text


def test_best_subtree_keeps_the_likeliest_nodes_prefix_closed():
    tree = tree_from_paths([(0, 0, 0), (0, 1), (1,), (1, 0), (2,)])
    prior = node_priors(tree, 0.5, 0.5)
    assert prior[0] == 1.0 and all(0 < p < 1 for p in prior[1:])
    small, accepted = best_subtree(tree, 3, 0.5, 0.5)
    assert small.num_nodes == 4 and small.parents.tolist() == [-1, 0, 0, 1]  # (0,), (1,), (0, 0)
    assert accepted == pytest.approx(sum(sorted(prior[1:], reverse=True)[:3]))


N = 30000


def _same_law(fast: torch.Tensor, slow: torch.Tensor) -> float:
    """Two-sample chi-square p-value of two outcome histograms (bins rare in both pooled into one)."""
    from scipy.stats import chi2_contingency

    big = (fast + slow) >= 20
    table = torch.stack([torch.cat([fast[big], fast[~big].sum()[None]]), torch.cat([slow[big], slow[~big].sum()[None]])])
    table = table[:, table.sum(0) > 0]
    assert table.shape[1] > 5
    return chi2_contingency(table.numpy()).pvalue


@pytest.mark.parametrize("proposals", [False, True], ids=["point-masses", "with-q"])
def test_sequential_walk_takes_a_chain_tail_in_one_step_with_the_same_law(proposals):
    """An SJD-PAC window (two candidates on the first two positions, then a chain after the first ones): walking the
    chain below its head in one vectorised step gives the same joint law of (accepted path, bonus) as walking it
    level by level (two-sample chi-square, fails at p < 1e-4)."""
    import dataclasses

    from spatial_pipelines.decoders.decoding_jacobi import proactive_tree

    v = 4
    tree = proactive_tree(4, 2, 2)  # 2 + 4 candidate nodes, then positions 3-4 below (0, 0): a chain from depth 2
    assert tree.chain_from == 2 and tree.chain_index.tolist() == [3, 7, 8]
    walked = dataclasses.replace(tree, chain_from=tree.max_depth)  # the same tree, walked level by level
    g = torch.Generator().manual_seed(3)
    probs = torch.randn(tree.num_nodes, v, generator=g).mul(1.5).softmax(-1).expand(N, -1, -1).clone()
    codes = torch.tensor([0, 1, 2, 1, 0, 3, 2, 1, 1])  # siblings distinct
    tokens = codes.expand(N, -1).clone()
    q = None
    if proposals:  # each node's code is likely under its own proposal, as when it was drawn from it
        q = 0.5 * torch.nn.functional.one_hot(codes, v) + 0.5 * torch.randn(tree.num_nodes, v, generator=g).softmax(-1)
        q = q.expand(N, -1, -1).clone()

    def outcomes(t, seed):
        acc = verify_tree_sequential(t, tokens, probs, RandomSource(torch.Generator().manual_seed(seed), N, "cpu"), q)
        return torch.bincount(acc.last_node * v + acc.bonus, minlength=tree.num_nodes * v)

    fast, slow = outcomes(tree, 1), outcomes(walked, 2)
    assert (fast.view(-1, v).sum(1)[[3, 7, 8]] > 0).all()  # the walk stops at the chain's head and at each node below
    assert _same_law(fast, slow) > 1e-4


def test_batched_heads_equal_head_by_head():
    pipe = dummy_pipeline("llamagen", HawkDecoder(), "random", grid=(4, 5))
    heads = pipe.draft_heads
    for p in heads.parameters():  # ResBlocks start at zero: give them weights to compare
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(3, heads.config.hidden_size)
    heads.train()
    ref = heads(x, [1, 0], [0])
    heads.eval()
    out = heads(x, [1, 0], [0])
    torch.testing.assert_close(out[0], ref[0])
    torch.testing.assert_close(out[1], ref[1])
    with torch.no_grad():
        heads.horizontal[0][0].linear.weight.add_(1.0)  # a changed weight is seen (the stack is rebuilt)
    changed = heads(x, [1, 0], [0])[0]
    assert not torch.allclose(changed[:, 1], out[0][:, 1]) and torch.allclose(changed[:, 0], out[0][:, 0])


@pytest.mark.slow
def test_compiled_forward_keeps_the_exact_decoders_exact():
    """`enable_compile`: the compiled target forward (inductor) gives the greedy AR grid token for token, and an
    exact decoder run on it does too; `disable_compile` restores eager."""
    from spatial_pipelines import AutoregressiveDecoder

    pipe = dummy_pipeline("llamagen", AutoregressiveDecoder(), None, grid=(3, 4))
    ref = pipe(["a fox", "x"], guidance_scale=2.0, temperature=0, output_type="latent").tokens
    info = pipe.enable_compile(keep_if_slower=True)  # kept even if slower: the test is about exactness
    assert pipe.is_compiled and info["enabled"] and set(info["compiled_ms"]) == {1, 8}
    assert pipe(["a fox", "x"], guidance_scale=2.0, temperature=0, output_type="latent").tokens.equal(ref)
    pipe.decoder = JacobiDecoder(window_size=3, init="left")
    assert pipe(["a fox", "x"], guidance_scale=2.0, temperature=0, output_type="latent").tokens.equal(ref)
    pipe.disable_compile()
    assert not pipe.is_compiled


class _UncappedEagle(EagleDecoder):
    """EAGLE-2 that grows the whole ``depth`` x ``top_k`` tree whatever it keeps (the behaviour before the cap)."""

    def _grown_shape(self, depth, k):
        return depth, k


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sample"])
def test_eagle_tree_grown_only_to_the_kept_size_drafts_the_same_codes(temperature):
    """Growing the tree no deeper and no wider than the nodes it keeps changes no draft, only the drafter's work
    (`EagleDrafter` grows at `_grown_shape`)."""
    kwargs = dict(depth=5, top_k=6, num_draft_tokens=3)
    outs = []
    for cls in (EagleDecoder, _UncappedEagle):
        pipe = dummy_pipeline("llamagen", cls(**kwargs), "random", grid=(4, 5), num_codes=16)
        fed = []
        forward = pipe.draft_heads.forward
        pipe.draft_heads.forward = lambda features, *a, **k: fed.append(features.shape[1]) or forward(features, *a, **k)
        outs.append((pipe(["a red fox", "x"], temperature=temperature, generator=[torch.Generator().manual_seed(s) for s in (0, 1)],
                          output_type="latent"), fed))
    (capped, capped_fed), (full, full_fed) = outs
    assert torch.equal(capped.tokens, full.tokens)
    assert capped.stats.num_forward_passes == full.stats.num_forward_passes
    assert capped.stats.num_draft_passes < full.stats.num_draft_passes


@pytest.mark.parametrize("decoder", [MedusaDecoder(num_heads=4, top_k=2, num_draft_tokens=2),
                                     HawkDecoder(num_horizontal_heads=4, top_k=1, num_draft_tokens=2)], ids=["medusa", "hawk"])
def test_tree_decoders_run_only_the_horizontal_heads_their_tree_drafts_from(decoder):
    pipe = dummy_pipeline("llamagen", decoder, "random", grid=(4, 5), num_codes=16)
    asked = []
    forward = pipe.draft_heads.forward
    pipe.draft_heads.forward = lambda hidden, horizontal=None, vertical=None: asked.append(list(horizontal)) or forward(hidden, horizontal, vertical)
    out = pipe("a red fox", temperature=0.0, output_type="latent")
    depth = decoder.tree.max_depth
    assert depth < 4 and asked and all(h == list(range(depth)) for h in asked)
    reference = dummy_pipeline("llamagen", "ar", grid=(4, 5), num_codes=16)("a red fox", temperature=0.0, output_type="latent")
    assert torch.equal(out.tokens, reference.tokens)  # still exact


@pytest.mark.parametrize("decoder_cls,kwargs,heads,name", [
    pytest.param(MedusaDecoder, {}, "random", "num_draft_tokens", id="medusa"),
    pytest.param(JacobiDecoder, {}, None, "window_size", id="sjd"),
    pytest.param(EagleDecoder, {"depth": 3, "top_k": 2}, "random", "num_draft_tokens", id="eagle"),
])
@pytest.mark.parametrize("size", [None, "auto", 2], ids=["family", "auto", "fixed"])
def test_tune_decoder_returns_the_chosen_sizes_as_config(decoder_cls, kwargs, heads, name, size, tmp_path):
    """`tune_decoder(batch_size=...)` measures the device for that batch and returns a decoder whose config fixes the
    size "auto" chooses there, whatever size the pipeline's decoder has: it decodes with no measurement of its own,
    and saves and loads like any config. The pipeline's decoder keeps its size; a bad batch size is refused before
    any measurement."""
    pipe = make(decoder_cls, {**kwargs, name: size}, heads, grid=(4, 5))
    with pytest.raises(ValueError, match="batch_size"):
        pipe.tune_decoder(batch_size=0)
    tuned = pipe.tune_decoder(batch_size=2)
    assert pipe.decoder.config[name] == size and pipe.decoder.sizes_from_pass_cost == (size == "auto")
    assert pipe.__dict__.get("_round_costs"), "tune_decoder measured nothing"  # whole rounds, per candidate size
    chosen = tuned.config[name]
    assert isinstance(chosen, int) and chosen >= 0 and not tuned.sizes_from_pass_cost  # 0: no draft pays here and not tuned.sizes_from_family
    tuned.save_config(tmp_path)
    loaded = decoder_cls.from_config(decoder_cls.load_config(tmp_path))
    assert loaded.config[name] == chosen and loaded.tree.num_nodes == tuned.tree.num_nodes


@pytest.mark.parametrize("decoder_cls,size_arg", [(MedusaDecoder, "num_draft_tokens"), (JacobiDecoder, "window_size")])
def test_measured_acceptance_replaces_the_prior(decoder_cls, size_arg):
    """Under a flat cost the prior makes a large draft pay; measured acceptance that stops growing after two drafts
    makes two the choice, and only the measured sizes are weighed. Sizes named nowhere are refused."""
    prior = decoder_cls(**{size_arg: "auto"})
    prior.resolve_draft_size(lambda tree: 1.0)
    assert prior.tree.num_nodes - 1 > 8
    sizes = prior._draft_sizes()
    measured = decoder_cls(**{size_arg: "auto"})
    measured.resolve_draft_size(lambda tree: 1.0, accepted={n: min(n, 2) * 0.4 for n in sizes})
    assert measured.tree.num_nodes - 1 == 2 and measured.fixed_sizes() == {size_arg: 2}
    some = decoder_cls(**{size_arg: "auto"})
    some.resolve_draft_size(lambda tree: 1.0, accepted={3: 0.5, 5: 0.6})  # 1.5 codes per pass is not within 3% of 1.6
    assert some.tree.num_nodes - 1 == 5
    with pytest.raises(ValueError, match="accepted"):
        decoder_cls(**{size_arg: "auto"}).resolve_draft_size(lambda tree: 1.0, accepted={10_000: 1.0})


def test_tune_decoder_measures_acceptance_on_the_prompt(monkeypatch):
    """`tune_decoder(prompt=...)` runs one eager generation per candidate size and weighs each size by the codes per
    pass it gave there (the same as a call at that fixed size gives), keeps the pipeline's decoder and progress bar,
    and refuses a bad seed before any work."""
    pipe = make(JacobiDecoder, {"window_size": 4}, None, grid=(4, 5))
    pipe.set_progress_bar_config(leave=False)
    with pytest.raises(ValueError, match="seed"):
        pipe.tune_decoder(prompt="a red fox", seed=-1)
    assert not pipe.__dict__.get("_round_costs")
    seen = {}
    resolve = JacobiDecoder.resolve_draft_size
    monkeypatch.setattr(JacobiDecoder, "resolve_draft_size",
                        lambda self, cost, batch_size=1, accepted=None: seen.update(accepted=accepted) or resolve(self, cost, batch_size, accepted))
    kept = pipe.decoder
    tuned = pipe.tune_decoder(batch_size=1, prompt="a red fox", seed=3)
    assert pipe.decoder is kept and pipe._progress_bar_config == {"leave": False}
    accepted = seen["accepted"]
    assert sorted(accepted) == JacobiDecoder(window_size="auto")._draft_sizes()
    assert tuned.config.window_size in accepted
    pipe.decoder = JacobiDecoder(window_size=2)
    alone = pipe("a red fox", generator=torch.Generator().manual_seed(3), output_type="latent")
    assert accepted[2] == pytest.approx(alone.stats.mean_accepted_length - 1.0)
    assert len(set(accepted.values())) > 1  # the sizes accept differently: measured, not one number


class _TwoFamily(LlamaGenPipeline):
    """A family whose table names SJD's window and EAGLE-2's size (ADT-Tree inherits EAGLE-2's entry)."""

    default_draft_sizes = {"JacobiDecoder": 3, "EagleDecoder": 2}


class _NoTable(LlamaGenPipeline):
    """A family that names no size: every decoder drafts with its class's default."""

    default_draft_sizes = {}


@pytest.mark.parametrize("decoder,family,expected", [
    pytest.param(JacobiDecoder(), "none", JacobiDecoder.default_draft_size, id="sjd-class-default"),
    pytest.param(JacobiDecoder(), "two", 3, id="sjd-family"),
    pytest.param(EagleDecoder(depth=3, top_k=2), "two", 2, id="eagle-family"),
    pytest.param(ADTTreeDecoder(depth=3, top_k=2), "two", 2, id="adt-inherits-eagle"),
    pytest.param(MedusaDecoder(num_heads=2, top_k=2), "two", MedusaDecoder.default_draft_size, id="medusa-class-default"),
])
def test_a_size_left_at_none_is_the_familys_fixed_default(decoder, family, expected, monkeypatch):
    """A decoder whose size is ``None`` drafts with its family's fixed size (or its class's), chosen before the first
    round with nothing measured, the same tree a config naming that size builds; its own config keeps ``None``."""
    heads = None if isinstance(decoder, JacobiDecoder) else "random"
    pipe = dummy_pipeline("llamagen", decoder, heads, grid=(4, 5))
    pipe = {"two": _TwoFamily, "none": _NoTable}[family](**pipe.components)
    assert pipe.decoder.sizes_from_family and not pipe.decoder.sizes_from_pass_cost
    monkeypatch.setattr(type(pipe), "pass_cost", lambda self, rows: pytest.fail("a fixed size measured the device"))
    out = pipe("a fox", temperature=0, output_type="latent", generator=torch.Generator().manual_seed(0))
    name = decoder.draft_size_name
    assert pipe.decoder.config[name] is None and pipe.decoder.fixed_sizes() == {name: expected}
    same = type(decoder).from_config(decoder.config, **{name: expected})
    assert pipe.decoder.tree.num_nodes == same.tree.num_nodes and torch.equal(pipe.decoder.tree.parents, same.tree.parents)
    pipe.decoder = same
    assert torch.equal(pipe("a fox", temperature=0, output_type="latent", generator=torch.Generator().manual_seed(0)).tokens, out.tokens)


def test_a_decoder_that_forgets_its_size_name_fails_loudly():
    class NoName(JacobiDecoder):
        draft_size_name = None

    with pytest.raises(KeyError):
        NoName().sizes_from_family


@pytest.mark.parametrize("family", ["LlamaGenPipeline", "JanusProPipeline", "Emu3Pipeline", "ChameleonARPipeline"])
def test_every_family_names_its_fixed_draft_sizes(family):
    """Each family says its own sizes (in its class body, with where they come from) for every decoder that has one;
    Anole and Lumina-mGPT take Chameleon's."""
    import spatial_pipelines.pipelines
    from spatial_pipelines.decoders import DECODERS
    from spatial_pipelines.decoders.decoding_utils import check_draft_size

    cls = getattr(spatial_pipelines.pipelines, family)
    assert "default_draft_sizes" in vars(cls)
    sized = [d for d in set(DECODERS.values()) if d.draft_size_name is not None]
    assert sized, "no decoder has a draft size"
    pipe = cls.__new__(cls)
    for device in ("cuda", "cpu"):
        table = pipe.draft_size_table(torch.device(device))
        for decoder_cls in sized:
            size = pipe.default_draft_size(decoder_cls.__new__(decoder_cls), torch.device(device))
            assert any(c.__name__ in table for c in decoder_cls.__mro__), (family, device, decoder_cls.__name__)
            check_draft_size(decoder_cls.draft_size_name, size)


@pytest.mark.parametrize("family, name", [("JanusProPipeline", "janus"), ("Emu3Pipeline", "emu3"), ("ChameleonARPipeline", "anole")])
def test_the_gpu_families_draft_smaller_on_a_cpu(family, name):
    """The transformers families draft with `GPU_DRAFT_SIZES` on an accelerator and `CPU_DRAFT_SIZES` on a CPU, where
    a fed token past about 8 costs; a pipeline reads the table of its own execution device."""
    import spatial_pipelines.pipelines
    from spatial_pipelines.pipelines import CPU_DRAFT_SIZES, GPU_DRAFT_SIZES

    cls = getattr(spatial_pipelines.pipelines, family)
    bare = cls.__new__(cls)
    assert bare.draft_size_table(torch.device("cuda")) is GPU_DRAFT_SIZES
    assert bare.draft_size_table(torch.device("cpu")) is CPU_DRAFT_SIZES
    pipe = dummy_pipeline(name, JacobiDecoder())
    assert pipe.default_draft_size(pipe.decoder) == CPU_DRAFT_SIZES["JacobiDecoder"] != GPU_DRAFT_SIZES["JacobiDecoder"]
    pipe("a fox", output_type="latent", generator=torch.Generator().manual_seed(0))
    assert pipe.decoder.fixed_sizes() == {"window_size": CPU_DRAFT_SIZES["JacobiDecoder"]}
