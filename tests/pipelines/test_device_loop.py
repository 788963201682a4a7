"""The one engine (`device_loop.DeviceLoop` and its loops): every decoder's rounds give AR's codes under keyed noise
(the oracle), every row as alone, one graph per round with nothing around it, and the device read once per sync."""

import math

import pytest
import torch

from spatial_pipelines import (ADTTreeDecoder, AutoregressiveDecoder, EagleDecoder, HawkDecoder, JacobiDecoder, MedusaDecoder,
                               SSDDecoder)
from spatial_pipelines.pipelines import device_chain, device_tree
from spatial_pipelines.pipelines.device_chain import ChainLoop, chain_round
from spatial_pipelines.pipelines.device_loop import MAX_ROUNDS_PER_SYNC, DeviceLoop, state_tensors
from spatial_pipelines.pipelines.device_proactive import ProactiveLoop
from spatial_pipelines.pipelines.device_ssd import SSDLoop
from spatial_pipelines.pipelines.device_tree import DynamicTreeLoop, HeadTreeLoop
from spatial_pipelines.pipelines.round_counts import count_rounds
from spatial_pipelines.testing import dummy_pipeline, random_draft_heads

from helpers import record_device_loops

PROMPTS = ["a red fox", "blue sky", "x"]
FAMILIES = [("llamagen", False), ("llamagen", True), ("janus", False)]
FAMILY_IDS = ["llamagen", "llamagen-eol", "janus"]
DECODERS = [(AutoregressiveDecoder, {}), (JacobiDecoder, {"window_size": 1}), (JacobiDecoder, {"window_size": 3}),
            (JacobiDecoder, {"window_size": 8}), (MedusaDecoder, {"num_draft_tokens": 0}),
            (HawkDecoder, {"num_draft_tokens": 0}), (EagleDecoder, {"num_draft_tokens": 0})]
DECODER_IDS = ["ar", "sjd-1", "sjd-3", "sjd-8", "medusa-0", "hawk-0", "eagle-0"]  # a tree of no drafts: AR's round
#: head trees: Medusa's default caterpillar tree, a small one and a tree of its own paths; Hawk's pools with and
#: without vertical heads
TREES = [(MedusaDecoder, {}), (MedusaDecoder, {"num_draft_tokens": 4}),
         (MedusaDecoder, {"num_heads": 2, "tree_paths": [[0], [1], [2], [0, 0], [0, 1], [1, 0]]}),
         (HawkDecoder, {}), (HawkDecoder, {"num_draft_tokens": 6, "vertical_speculation_depth": 0, "top_k": 3})]
TREE_IDS = ["medusa-16", "medusa-4", "medusa-paths", "hawk-32", "hawk-6-no-vertical"]
#: EAGLE-2's trees, grown per row every round: the family's size, and a deeper, wider one
EAGLE_TREES = [(EagleDecoder, {}), (EagleDecoder, {"num_draft_tokens": 8, "depth": 4, "top_k": 3}),
               (ADTTreeDecoder, {"num_draft_tokens": 8, "depth": 2, "top_k": 3, "depth_step": 1, "width_step": 1,
                                 "depth_range": (1, 4), "width_range": (2, 4)}),
               (ADTTreeDecoder, {"num_draft_tokens": 6, "tree_init": "vertical", "beta": 0.5, "depth_range": (2, 3),
                                 "width_range": (1, 3), "width_step": 1})]
EAGLE_IDS = ["eagle", "eagle-8", "adt", "adt-vertical"]


def _pipe(family, end_of_row, decoder, grid=(4, 5)):
    pipe = dummy_pipeline(family, decoder, grid=grid, end_of_row=end_of_row)
    pipe.set_progress_bar_config(disable=True)
    if decoder.heads_needed() is not None:
        torch.manual_seed(0)
        pipe.draft_heads = random_draft_heads(pipe, decoder)
    return pipe


def _generators(n, offset=0):
    return [torch.Generator().manual_seed(offset + i) for i in range(n)]


def _check_against_ar(pipe, family, end_of_row, monkeypatch):
    """The oracle. Keyed noise, CFG, three prompts in one call: the rounds give AR's codes for the same seeds, and each
    row gives what its prompt gives alone, in the passes it takes alone (the batch's: their maximum)."""
    reference = _pipe(family, end_of_row, AutoregressiveDecoder())
    ar = reference(PROMPTS, guidance_scale=2.0, generator=_generators(3), output_type="latent")
    assert ar.stats.num_forward_passes == reference.backbone.layout.num_tokens  # AR: one code per pass
    loops = record_device_loops(monkeypatch, pipe)
    out = pipe(PROMPTS, guidance_scale=2.0, generator=_generators(3), output_type="latent")
    assert len(loops) == 1
    assert torch.equal(out.tokens, ar.tokens)
    alone = [pipe([p], guidance_scale=2.0, generator=_generators(1, i), output_type="latent") for i, p in enumerate(PROMPTS)]
    for i, single in enumerate(alone):
        assert torch.equal(single.tokens[0], out.tokens[i])
        assert single.stats.num_forward_passes == out.stats.row_forward_passes[i]
    assert out.stats.num_forward_passes == max(s.stats.num_forward_passes for s in alone)
    stats = out.stats
    assert stats.accepted_lengths.shape == (stats.num_forward_passes, 3)
    assert stats.accepted_lengths.sum() == stats.num_tokens == 3 * pipe.backbone.layout.num_tokens
    assert torch.equal(stats.acceptance_map.flatten(1).sum(1) > 0, torch.ones(3, dtype=torch.bool))
    return loops[0], out


@pytest.mark.parametrize("decoder_cls,kwargs", DECODERS, ids=DECODER_IDS)
@pytest.mark.parametrize("family,end_of_row", FAMILIES, ids=FAMILY_IDS)
def test_chain_rounds_commit_what_ar_commits(family, end_of_row, decoder_cls, kwargs, monkeypatch):
    pipe = _pipe(family, end_of_row, decoder_cls(**kwargs))
    loop, out = _check_against_ar(pipe, family, end_of_row, monkeypatch)
    window = pipe.decoder.plan(None, loop.layout, 3, "cpu").window if decoder_cls in (AutoregressiveDecoder, JacobiDecoder) else 0
    assert isinstance(loop, ChainLoop) and loop.window == window
    if window == 0:
        assert out.stats.num_forward_passes == pipe.backbone.layout.num_tokens


#: SJD-PAC's proactive candidates: the default drafting (above, anchored), and random drafts with three candidates at one
#: position
PROACTIVE = [(JacobiDecoder, {"window_size": 3, "proactive_width": 2}),
             (JacobiDecoder, {"window_size": 4, "init": "random", "proactive_width": 3, "proactive_depth": 1, "anchor": "none"})]


@pytest.mark.parametrize("decoder_cls,kwargs", PROACTIVE, ids=["proactive-2", "proactive-3-random"])
@pytest.mark.parametrize("family,end_of_row", FAMILIES, ids=FAMILY_IDS)
def test_proactive_rounds_commit_what_ar_commits(family, end_of_row, decoder_cls, kwargs, monkeypatch):
    """SJD's window of proactive candidates as a static tree, with end-of-row tokens too: AR's codes, every row as
    alone."""
    pipe = _pipe(family, end_of_row, decoder_cls(**kwargs))
    loop, _ = _check_against_ar(pipe, family, end_of_row, monkeypatch)
    assert isinstance(loop, ProactiveLoop) and loop.num_nodes == pipe.decoder.tree.num_nodes
    assert loop.fed == loop.num_nodes + loop.eol_slots and (loop.eol_slots > 0) == end_of_row


@pytest.mark.parametrize("decoder_cls,kwargs", TREES + EAGLE_TREES, ids=TREE_IDS + EAGLE_IDS)
@pytest.mark.parametrize("family,end_of_row", FAMILIES, ids=FAMILY_IDS)
def test_tree_rounds_commit_what_ar_commits(family, end_of_row, decoder_cls, kwargs, monkeypatch):
    """Medusa's and Hawk's static trees and EAGLE-2's and ADT-Tree's per-row trees, with end-of-row tokens too: AR's
    codes, every row as alone (ADT-Tree: in the shapes it grows alone), and the drafting passes each round runs."""
    pipe = _pipe(family, end_of_row, decoder_cls(**kwargs))
    loop, out = _check_against_ar(pipe, family, end_of_row, monkeypatch)
    grown = issubclass(decoder_cls, EagleDecoder)
    assert isinstance(loop, DynamicTreeLoop if grown else HeadTreeLoop)
    assert loop.num_nodes == (loop.drafter.num_nodes + 1 if grown else pipe.decoder.tree.num_nodes)
    assert loop.fed == loop.num_nodes + loop.eol_slots and (loop.eol_slots > 0) == end_of_row
    if decoder_cls is ADTTreeDecoder:
        assert out.stats.decoder_stats["mean_tree_width"] != kwargs.get("top_k", 8)  # the shapes moved
    per_round = loop.drafter.max_depth if grown else 1
    assert out.stats.num_draft_passes == (out.stats.num_forward_passes - 1) * per_round
    assert out.stats.accepted_lengths[1:].max() > 1  # some drafts accepted: the tree walk is exercised


@pytest.mark.parametrize("decoder_cls,kwargs", [DECODERS[2], TREES[0], TREES[3], EAGLE_TREES[1]],
                         ids=["sjd-3", "medusa-16", "hawk-32", "eagle-8"])
def test_the_temperature_is_data_and_gives_ar_codes(decoder_cls, kwargs, monkeypatch):
    """The round divides the logits by a temperature tensor (no graph per value): at 0.7 and 1.6 the device rounds
    still commit what AR commits at that temperature."""
    pipe = _pipe("llamagen", False, decoder_cls(**kwargs))
    reference = _pipe("llamagen", False, AutoregressiveDecoder())
    loops = record_device_loops(monkeypatch, pipe)
    for temperature in (0.7, 1.6):
        call = dict(guidance_scale=2.0, temperature=temperature, output_type="latent")
        expected = reference(PROMPTS, generator=_generators(3), **call).tokens
        assert torch.equal(pipe(PROMPTS, generator=_generators(3), **call).tokens, expected)
    assert len(loops) == 2 and float(loops[0].temperature) == pytest.approx(0.7) and loops[0].sampling.temperature == 1.0


@pytest.mark.parametrize("family,end_of_row", FAMILIES, ids=FAMILY_IDS)
def test_greedy_device_rounds_are_ar(family, end_of_row):
    pipe = _pipe(family, end_of_row, JacobiDecoder(window_size=4))
    ar = _pipe(family, end_of_row, AutoregressiveDecoder())
    expected = ar(PROMPTS[:2], temperature=0.0, output_type="latent").tokens
    assert torch.equal(pipe(PROMPTS[:2], temperature=0.0, output_type="latent").tokens, expected)


#: trees as deep as a row or deeper, on an end-of-row grid 2-3 codes wide: a round's tree crosses 2-3 row ends (the
#: tiny LlamaGen with EOLs; Emu3 and Lumina-mGPT feed them on their own)
DEEP_TREES = [
    pytest.param("llamagen", MedusaDecoder, {"num_heads": 5, "tree_paths": [[0] * d for d in range(1, 6)] + [[1], [0, 1]]},
                 (5, 2), id="medusa-chain-5-width-2"),
    pytest.param("llamagen", HawkDecoder, {"num_horizontal_heads": 4, "num_draft_tokens": 10}, (4, 2), id="hawk-4-width-2"),
    pytest.param("llamagen", EagleDecoder, {"depth": 5, "top_k": 2, "num_draft_tokens": 8}, (4, 2), id="eagle-5-width-2"),
    pytest.param("llamagen", ADTTreeDecoder, {"num_draft_tokens": 8, "depth": 4, "top_k": 2, "depth_step": 1,
                                              "width_step": 1, "depth_range": (3, 6), "width_range": (1, 3)},
                 (4, 3), id="adt-width-3"),
    pytest.param("emu3", EagleDecoder, {"depth": 5, "top_k": 2, "num_draft_tokens": 8}, (4, 3), id="emu3-eagle-5-width-3")]


def _oracle_drafts(monkeypatch, loop_class, reference: dict):
    """Every drafted node offers the reference grid's code at its grid index (``reference["tokens"]`` ``(B, H, W)``, set
    per call), so a round accepts its whole tree's depth and the kept path crosses every row end the tree reaches."""
    round_fn = device_tree.head_tree_round if loop_class is HeadTreeLoop else device_tree.dynamic_tree_round

    def oracle_round(loop):
        real = loop.drafter
        if loop_class is HeadTreeLoop:
            depths = real.tree.depths[1:].expand(loop.batch_size, -1)  # (B, T - 1)
            drafts = lambda backbone, hidden, committed: _reference_codes(reference, committed, depths)
        else:
            def drafts(loop):
                nodes, tree = real(loop)
                codes = _reference_codes(reference, loop.state.committed, tree.depths[:, 1:])
                return torch.where(nodes >= 0, codes, nodes), tree
        loop.drafter = _Drafts(real, drafts)
        try:
            return round_fn(loop)
        finally:
            loop.drafter = real

    monkeypatch.setattr(loop_class, "default_round", classmethod(lambda cls: oracle_round))


class _Drafts:
    """A drafter whose drafts are ``drafts``'s, and everything else the real one's."""

    def __init__(self, real, drafts):
        self.real, self.drafts = real, drafts

    def __call__(self, *args):
        return self.drafts(*args)

    def __getattr__(self, name):
        return getattr(self.real, name)


def _reference_codes(reference: dict, committed: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
    grid = reference["tokens"].flatten(1)  # (B, N)
    return grid.gather(1, (committed[:, None] - 1 + depths).clamp_max(grid.shape[1] - 1))  # (B, T - 1)


@pytest.mark.parametrize("oracle", [False, True], ids=["own-drafts", "oracle-drafts"])
@pytest.mark.parametrize("family,decoder_cls,kwargs,grid", DEEP_TREES)
def test_a_tree_crossing_several_row_ends_runs_on_the_device_and_gives_ar_codes(family, decoder_cls, kwargs, grid,
                                                                                 oracle, monkeypatch):
    """A tree as deep as a row or deeper, with end-of-row tokens, takes the device rounds: an EOL slot after every node
    at a depth that ends a row, each one the accepted path crosses kept. Keyed noise (CFG, three prompts) and greedy
    give AR's codes token for token, and each row gives what its prompt gives alone, in its passes. With drafts that
    are AR's own codes every round accepts its whole depth, so the kept paths cross 2-3 row ends a round."""
    end_of_row = family == "llamagen"  # a flag of the tiny LlamaGen's (the others' layouts have their EOLs)
    pipe = _pipe(family, end_of_row, decoder_cls(**kwargs), grid=grid)
    reference = _pipe(family, end_of_row, AutoregressiveDecoder(), grid=grid)
    assert reference.backbone.layout.has_eol
    loops = record_device_loops(monkeypatch, pipe)
    grown = issubclass(decoder_cls, EagleDecoder)
    loop_class = DynamicTreeLoop if grown else HeadTreeLoop
    oracle_grid, crossed = {}, []
    if oracle:
        _oracle_drafts(monkeypatch, loop_class, oracle_grid)
        keep = device_tree.path_with_end_of_row

        def recorded(loop, eol, path, accepted):  # the row ends each kept path crossed (a read: eager rounds only)
            slots, count = keep(loop, eol, path, accepted)
            crossed.append(int((count - accepted).max()))
            return slots, count

        monkeypatch.setattr(device_tree, "path_with_end_of_row", recorded)
    width = grid[1]
    for greedy in (False, True):  # keyed noise: each image's seed from its generator (a fresh one per call)
        call = dict(guidance_scale=2.0, output_type="latent", **({"temperature": 0.0} if greedy else {}))
        expected = reference(PROMPTS, generator=_generators(3), **call).tokens
        oracle_grid["tokens"] = expected
        out = pipe(PROMPTS, generator=_generators(3), **call)
        assert torch.equal(out.tokens, expected)
        for i, prompt in enumerate(PROMPTS):
            oracle_grid["tokens"] = expected[i : i + 1]
            alone = pipe([prompt], generator=_generators(1, i), **call)
            assert torch.equal(alone.tokens[0], out.tokens[i])
            assert alone.stats.num_forward_passes == out.stats.row_forward_passes[i]
    if oracle:  # rounds commit their tree's depth, and kept paths cross two row ends or more
        assert max(crossed) >= 2
    loop = loops[0]
    assert isinstance(loop, loop_class) and loop.max_codes - 1 >= width and loop.eol_slots >= 2
    assert loop.path_slots == loop.max_codes + math.ceil(loop.max_codes / width)


#: relaxed rules on the device: every loop, LANTERN and LANTERN++ (the trees' claims shared among siblings)
RELAXED_DECODERS = {"medusa": (MedusaDecoder, {"num_draft_tokens": 6}), "hawk": (HawkDecoder, {"num_draft_tokens": 6}),
                    "eagle": (EagleDecoder, {"num_draft_tokens": 8, "depth": 3, "top_k": 3}),
                    "sjd": (JacobiDecoder, {"window_size": 4}), "sjd-proactive": (JacobiDecoder, {"window_size": 4, "proactive_width": 2})}
#: every loop on the tiny LlamaGen, with and without end-of-row tokens; a static tree and the chain on a transformers family
RELAXED = [pytest.param(*FAMILIES[f], *RELAXED_DECODERS[d], id=f"{FAMILY_IDS[f]}-{d}") for f in (0, 1) for d in RELAXED_DECODERS]
RELAXED += [pytest.param(*FAMILIES[2], *RELAXED_DECODERS[d], id=f"janus-{d}") for d in ("medusa", "sjd")]


@pytest.mark.parametrize("family,end_of_row,decoder_cls,kwargs", RELAXED)
def test_relaxed_rules_run_on_the_device_every_row_as_alone(family, end_of_row, decoder_cls, kwargs, monkeypatch):
    """LANTERN and LANTERN++ take the device rounds (their noise keyed by a seed each image draws from its generator):
    a batch of different prompts gives each row what its prompt gives alone, in its passes; with nothing to move
    (``delta = 0``) a tree's rule is the exact one, so it commits AR's codes for those seeds; greedy is AR's."""
    prompts, call = PROMPTS, dict(guidance_scale=2.0, output_type="latent")
    # LANTERN++ (a bound per candidate) with end-of-row tokens, LANTERN (a TVD budget its siblings share) without
    acceptance = {"name": "lantern++", "k": 4, "lambda": 3.0} if end_of_row else {"name": "lantern", "k": 4, "delta": 0.4}
    pipe = _pipe(family, end_of_row, decoder_cls(acceptance=acceptance, **kwargs))
    loops = record_device_loops(monkeypatch, pipe)
    out = pipe(prompts, generator=_generators(3), **call)
    assert len(loops) == 1 and loops[0].rule == pipe.decoder.acceptance_rule and not pipe.decoder.is_exact
    for i, p in enumerate(prompts):
        alone = pipe([p], generator=_generators(1, i), **call)
        assert torch.equal(alone.tokens[0], out.tokens[i])
        assert alone.stats.num_forward_passes == out.stats.row_forward_passes[i]
    reference = _pipe(family, end_of_row, AutoregressiveDecoder())
    greedy = pipe(prompts, temperature=0.0, **call).tokens
    assert torch.equal(greedy, reference(prompts, temperature=0.0, **call).tokens)
    if decoder_cls is not JacobiDecoder:  # the chain tests its drafts against their proposals: AR's law, not its codes
        pipe.decoder = decoder_cls(acceptance={"name": "lantern", "k": 4, "delta": 0.0}, **kwargs)
        assert torch.equal(pipe(prompts, generator=_generators(3), **call).tokens,
                           reference(prompts, generator=_generators(3), sampling_noise="keyed", **call).tokens)


def _sync_reads_allowed(rounds: int, max_codes: int) -> int:
    """Reads a generation may make: one per sync, a sync every `MAX_ROUNDS_PER_SYNC` rounds while the slowest row
    needs that many, then the shorter stretches, and the last read that finds every row done. A short stretch starts
    with ``r < K * C`` codes left (``C``: codes a round commits at most) and runs ``ceil(r / C)`` rounds of at least one
    code each, so it leaves at most ``r (1 - 1 / C)``: at most ``log(K C) / log(C / (C - 1))`` of them (one for AR)."""
    k = MAX_ROUNDS_PER_SYNC
    short = 1 if max_codes == 1 else math.ceil(math.log(k * max_codes) / math.log(max_codes / (max_codes - 1))) + 1
    return math.ceil(rounds / k) + short + 1


COUNTED_DECODERS = {"ar": DECODERS[0], "sjd-3": DECODERS[2], "medusa-4": TREES[1], "hawk": TREES[3], "eagle-8": EAGLE_TREES[1],
                    "adt": EAGLE_TREES[2]}
#: every loop on the tiny LlamaGen, each kind of round on a transformers family and with end-of-row tokens (the suite's
#: time: a compiled case takes 20-40 s on 2 cores)
COUNTED = [pytest.param(*FAMILIES[0], *decoder, id=f"llamagen-{decoder_id}") for decoder_id, decoder in COUNTED_DECODERS.items()]
# (a transformers family's grown tree: `janus-eagle-8-drawn` below; an end-of-row grown tree: the deeper-than-a-row case)
COUNTED += [pytest.param(*FAMILIES[2], *COUNTED_DECODERS[d], id=f"janus-{d}") for d in ("ar", "sjd-3", "medusa-4")]
COUNTED += [pytest.param(*FAMILIES[1], *COUNTED_DECODERS[d], id=f"llamagen-eol-{d}") for d in ("medusa-4",)]
#: SJD's drafting options: the head's guesses made in the round, drawn noise (proposals, the anchor, continuation)
COUNTED += [pytest.param(*FAMILIES[1], JacobiDecoder, {"window_size": 3, "init": "heads"}, id="llamagen-eol-sjd-3-heads"),
            pytest.param(*FAMILIES[0], JacobiDecoder, {"window_size": 3, "init": "random", "continuation": True,
                                                       "sampling_noise": "drawn"}, id="llamagen-sjd-3-random-continuation-drawn"),
            pytest.param(*FAMILIES[2], EagleDecoder, {"num_draft_tokens": 8, "depth": 4, "top_k": 3, "sampling_noise": "drawn"},
                         id="janus-eagle-8-drawn")]
#: SJD-PAC's proactive candidates (a static tree): under keyed noise (the target's samples) and under drawn noise
#: (their proposals, the sibling-by-sibling speculative sampling, the candidates' own keyed stream)
COUNTED += [pytest.param(*FAMILIES[0], JacobiDecoder, {"window_size": 3, "proactive_width": 2}, id="llamagen-sjd-3-proactive"),
            pytest.param(*FAMILIES[1], JacobiDecoder, {"window_size": 3, "init": "random", "proactive_width": 3, "continuation": True,
                                                       "sampling_noise": "drawn"}, id="llamagen-eol-sjd-3-proactive-drawn")]
#: the relaxed rules' rounds: a chain's (its proposals and keyed streams) and a tree's (the sibling-by-sibling claims)
COUNTED += [pytest.param(*FAMILIES[0], JacobiDecoder, {"window_size": 3, "acceptance": "lantern"}, id="llamagen-sjd-3-lantern"),
            pytest.param(*FAMILIES[1], MedusaDecoder, {"num_draft_tokens": 4, "acceptance": "lantern++"}, id="llamagen-eol-medusa-4-lantern++")]
#: trees deeper than a row on a 3-wide end-of-row grid (a round's tree crosses two row ends): a static and a grown one
COUNTED += [pytest.param(*FAMILIES[1], MedusaDecoder, {"num_heads": 5, "tree_paths": [[0] * d for d in range(1, 6)] + [[1], [0, 1]],
                                                       "grid": (8, 3)}, id="llamagen-eol-medusa-deeper-than-a-row"),
            pytest.param(*FAMILIES[1], EagleDecoder, {"num_draft_tokens": 8, "depth": 4, "top_k": 3, "grid": (8, 3)},
                         id="llamagen-eol-eagle-deeper-than-a-row")]
#: SSD's passes (a graph per pass shape): the default schedule, and a staged one with end-of-row tokens and sampled drafts
COUNTED += [pytest.param(*FAMILIES[0], SSDDecoder, {}, id="llamagen-ssd"),
            pytest.param(*FAMILIES[1], SSDDecoder, {"num_vertical_rows": 2, "draft": "sample"}, id="llamagen-eol-ssd-staged")]


@pytest.mark.parametrize("family,end_of_row,decoder_cls,kwargs", COUNTED)
def test_a_compiled_round_is_one_graph_with_nothing_around_it(family, end_of_row, decoder_cls, kwargs, monkeypatch):
    """The counted test of a second compiled generation (other prompts, another CFG scale): no recompile (dynamo
    raises on one), one compiled region per round, at most 10 aten ops per round outside it (the sync's), and the device read once per sync; the state and
    the cache keep their addresses from round to round; the round has no graph break (`torch._dynamo.explain`; SSD:
    the first pass of every shape, each its own graph). A case's ``sampling_noise`` goes to every call, its ``grid``
    (6 x 6 where it names none) to the pipeline."""
    kwargs = dict(kwargs)
    noise = {"sampling_noise": kwargs.pop("sampling_noise")} if "sampling_noise" in kwargs else {}
    grid = kwargs.pop("grid", (6, 6))
    pipe = _pipe(family, end_of_row, decoder_cls(**kwargs), grid=grid)
    pipe.enable_compile(backend="eager", keep_if_slower=True, measure=False)  # dynamo's graphs, no inductor time
    pipe(PROMPTS[:2], guidance_scale=2.0, output_type="latent", **noise)  # the first generation compiles
    addresses = []
    step = DeviceLoop.step

    max_codes = []

    def recorded_step(loop):
        max_codes[:] = [loop.max_codes]
        addresses.append(tuple(t.data_ptr() for t in state_tensors(loop.state)) + (loop.cache.storage.data_ptr(),
                                                                                   loop.cache.row_starts.data_ptr()))
        return step(loop)

    monkeypatch.setattr(DeviceLoop, "step", recorded_step)
    with torch._dynamo.config.patch(error_on_recompile=True), count_rounds(pipe) as counts:  # another scale, prompts
        out = pipe(["a quiet sea under a pale blue sky", "x"], guidance_scale=3.5, temperature=0.8, generator=_generators(2), **noise,
                   output_type="latent")
    assert counts.rounds == out.stats.num_forward_passes - 1 > 0
    assert counts.recompiles == 0
    assert counts.compiled_calls == counts.rounds
    assert counts.eager_ops_per_round <= 10, counts.as_dict()
    assert 0 < counts.host_reads <= _sync_reads_allowed(counts.rounds, max_codes[0])
    assert len(set(addresses)) == 1
    explained, loops = {}, []

    def explain_new_shapes(loop):
        loops[:] = [loop]
        shape = id(loop.plan[loop.num_rounds][1]) if isinstance(loop, SSDLoop) else None  # SSD: the pass's phase
        if shape in explained:
            return step(loop)
        end = loop.write_bound()  # `step`, with explain running the round
        loop.cache.set_bound(end)
        explained[shape] = torch._dynamo.explain(loop.default_round())(loop)
        loop.bound = end
        loop.num_rounds += 1

    monkeypatch.setattr(DeviceLoop, "step", explain_new_shapes)
    again = pipe(["a quiet sea under a pale blue sky", "x"], guidance_scale=3.5, temperature=0.8, generator=_generators(2), **noise,
                 output_type="latent")
    assert torch.equal(again.tokens, out.tokens)
    assert all(e.graph_break_count == 0 and e.graph_count == 1 for e in explained.values())
    if decoder_cls is SSDDecoder:
        assert len(explained) == len(loops[0].phases) > 3  # every shape of pass explained


def test_reads_are_counted_where_the_round_reads(monkeypatch):
    """The counter sees a read: a round that reads its state once more is caught."""
    pipe = _pipe("llamagen", False, AutoregressiveDecoder(), grid=(8, 8))
    with count_rounds(pipe) as counts:
        pipe("a fox", output_type="latent")
    baseline = counts.host_reads
    assert 0 < baseline <= _sync_reads_allowed(counts.rounds, 1)

    def reading_round(loop):
        loop.state.committed.sum().item()
        return chain_round(loop)

    monkeypatch.setattr(device_chain, "chain_round", reading_round)
    with count_rounds(pipe) as counts:
        pipe("a fox", output_type="latent")
    assert counts.host_reads == baseline + counts.rounds


def test_the_state_is_typed_and_the_cache_rows_advance_on_the_device():
    pipe = _pipe("llamagen", False, JacobiDecoder(window_size=3))
    loops = []
    pipe.loop._run_device = lambda loop, on_sync: (loops.append(loop), ChainLoop.run(loop, on_sync))[1]
    pipe(PROMPTS[:2], guidance_scale=2.0, output_type="latent")
    loop = loops[0]
    assert loop.cache.row_starts.shape == (4,)  # CFG: 2 rows per image
    n = pipe.backbone.layout.num_tokens
    assert torch.equal(loop.state.committed, torch.full((2,), n))
    # every row's cache holds its prompt and the inputs of its codes but the last
    prefix = loop.prefix_length
    assert torch.equal(loop.cache.row_starts, torch.full((4,), prefix + n - 1))
    assert torch.equal(loop.cache.key_valid[:, prefix: prefix + n - 1], torch.ones(4, n - 1, dtype=torch.bool))
    assert not loop.cache.key_valid[:, prefix + n - 1:].any()


#: a chain, a static tree, a grown tree and SSD's schedule, with and without end-of-row tokens
CALLBACK_CASES = [pytest.param("llamagen", False, *DECODERS[2], id="sjd-3"),
                  pytest.param("llamagen", True, *TREES[1], id="eol-medusa-4"),
                  pytest.param("janus", False, *EAGLE_TREES[1], id="janus-eagle-8"),
                  pytest.param("llamagen", True, SSDDecoder, {"num_horizontal": 2, "vertical_rounds": 1}, id="eol-ssd")]


def _grids_after_each_round(out):
    """``(rounds, B, H, W)``: the output's grids as they stood after each round (``-1``: not yet committed), from its
    per-pass accepted lengths."""
    tokens, accepted = out.tokens.flatten(1), out.stats.accepted_lengths  # (B, N), (passes, B)
    committed = accepted.cumsum(0)[1:]  # (rounds, B) after each round
    index = torch.arange(tokens.shape[1])
    return torch.where(index < committed[..., None], tokens, -1).unflatten(-1, out.tokens.shape[1:])


@pytest.mark.parametrize("family,end_of_row,decoder_cls,kwargs", CALLBACK_CASES)
def test_a_step_callback_runs_on_the_device_and_sees_every_round(family, end_of_row, decoder_cls, kwargs, monkeypatch):
    """diffusers' ``callback_on_step_end`` on the device rounds: the host reads after every round, the callback sees
    each round's grids, counts and ``num_timesteps`` and changes nothing it does not return, a guidance scale it sets
    is used from the next round, and ``pipe._interrupt`` stops the call after its round."""
    pipe = _pipe(family, end_of_row, decoder_cls(**kwargs))
    loops = record_device_loops(monkeypatch, pipe)
    common = dict(guidance_scale=2.0, output_type="latent")
    plain = pipe(PROMPTS[:2], generator=_generators(2), **common)
    seen = []

    def callback(p, i, n, kwargs):
        seen.append((i, n, p.num_timesteps, kwargs["tokens"].clone()))
        kwargs["tokens"].fill_(0)  # a copy: changes nothing
        return None

    out = pipe(PROMPTS[:2], generator=_generators(2), callback_on_step_end=callback,
               callback_on_step_end_tensor_inputs=["tokens"], **common)
    assert len(loops) == 2 and torch.equal(out.tokens, plain.tokens)
    assert torch.equal(out.stats.accepted_lengths, plain.stats.accepted_lengths)
    rounds = out.stats.num_forward_passes - 1
    grids = _grids_after_each_round(out)
    assert [s[0] for s in seen] == list(range(rounds)) and rounds > 3
    assert [s[2] for s in seen] == [i + 2 for i in range(rounds - 1)] + [rounds]  # `num_timesteps`: run, and one more
    for i, (_, n, _, tokens) in enumerate(seen):
        assert torch.equal(tokens, grids[i]) and n == int((grids[i] >= 0).flatten(1).sum(1).min())

    def rescale(p, i, n, kwargs):
        if i == 1:
            p._guidance_scale = 6.0
        return kwargs

    rescaled = pipe(PROMPTS[:2], generator=_generators(2), callback_on_step_end=rescale, **common)
    before = _grids_after_each_round(plain)[1]  # what the first two rounds committed: the same
    assert torch.equal(torch.where(before >= 0, rescaled.tokens, -1), before)
    assert not torch.equal(rescaled.tokens, plain.tokens)

    def stop(p, i, n, kwargs):
        p._interrupt = i == 2
        return kwargs

    stopped = pipe(PROMPTS[:2], generator=_generators(2), callback_on_step_end=stop, **common)
    assert stopped.stats.num_forward_passes == 4 and torch.equal(stopped.tokens, _grids_after_each_round(plain)[2])
    assert len(loops) == 4


def test_profile_rounds_times_the_parts_of_an_eager_device_round_and_every_round_of_a_compiled_one():
    pipe = _pipe("llamagen", True, MedusaDecoder(num_draft_tokens=4))
    loops = []
    run = pipe.loop._run_device
    pipe.loop._run_device = lambda loop, *a: (loops.append(loop), run(loop, *a))[1]
    with pipe.profile_rounds() as timer:
        out = pipe("a fox", generator=torch.Generator().manual_seed(0), output_type="latent")
    assert len(loops) == 1 and timer.rounds == out.stats.num_forward_passes - 1
    assert {"draft", "eol", "forward", "accept", "kv", "round", "sync"} <= set(timer.seconds)
    assert 0 < sum(timer.seconds[k] for k in ("draft", "eol", "forward", "accept", "kv")) <= timer.seconds["round"]
    pipe.enable_compile(backend="eager", keep_if_slower=True, measure=False)
    with pipe.profile_rounds() as timer:
        again = pipe("a fox", generator=torch.Generator().manual_seed(0), output_type="latent")
    assert torch.equal(again.tokens, out.tokens) and len(loops) == 2
    assert set(timer.seconds) == {"round", "sync"} and timer.rounds == again.stats.num_forward_passes - 1


def test_a_compiled_round_with_a_step_callback_stays_one_graph():
    """With a step callback the host reads the device after every round; the round is still one graph, and the read
    and the callback's copies are all that runs around it."""
    pipe = _pipe("llamagen", False, JacobiDecoder(window_size=3), grid=(8, 8))
    pipe.enable_compile(backend="eager", keep_if_slower=True, measure=False)
    callback = lambda p, i, n, kwargs: kwargs  # noqa: E731
    pipe(PROMPTS[:2], guidance_scale=2.0, output_type="latent", callback_on_step_end=callback)  # compiles
    with torch._dynamo.config.patch(error_on_recompile=True), count_rounds(pipe) as counts:
        out = pipe(PROMPTS[1:], guidance_scale=3.0, generator=_generators(2), output_type="latent", callback_on_step_end=callback)
    assert counts.rounds == out.stats.num_forward_passes - 1 > 0
    assert counts.recompiles == 0 and counts.compiled_calls == counts.rounds
    assert counts.eager_ops_per_round <= 10, counts.as_dict()


def test_token_logit_heads_without_their_own_frozen_function_run_on_the_device(monkeypatch):
    """Any token-logit heads run in the device round: `DraftHeadsMixin.frozen` calls the heads as a decoder does, and
    gives the codes the stacked weights of `SpatialDraftHeads.frozen` give (AR's, under keyed noise)."""
    from spatial_pipelines.heads import SpatialDraftHeads
    from spatial_pipelines.heads.heads_utils import DraftHeadsMixin

    pipe = _pipe("llamagen", False, HawkDecoder(num_draft_tokens=6))
    stacked = pipe(PROMPTS[:2], guidance_scale=2.0, generator=_generators(2), output_type="latent").tokens
    monkeypatch.setattr(SpatialDraftHeads, "frozen", DraftHeadsMixin.frozen)
    loops = record_device_loops(monkeypatch, pipe)
    plain = pipe(PROMPTS[:2], guidance_scale=2.0, generator=_generators(2), output_type="latent").tokens
    assert len(loops) == 1 and torch.equal(plain, stacked)


@pytest.mark.parametrize("family,end_of_row", FAMILIES[:2], ids=FAMILY_IDS[:2])
@pytest.mark.parametrize("heads_kind", ["spatial", "latent"])
def test_sjd_with_head_guesses_runs_on_the_device(family, end_of_row, heads_kind, monkeypatch):
    """``init="heads"`` on the device: the vertical head guesses the code one row below every committed code inside
    the round (token-logit and latent heads), the fresh drafts read the guesses, and the codes are AR's, every row as
    alone."""
    from spatial_pipelines import LatentDraftHeads

    decoder = JacobiDecoder(window_size=3, init="heads")
    pipe = _pipe(family, end_of_row, decoder)
    if heads_kind == "latent":
        torch.manual_seed(0)
        pipe.draft_heads = LatentDraftHeads.for_backbone(pipe.backbone, decoder)
    loop, out = _check_against_ar(pipe, family, end_of_row, monkeypatch)
    assert loop.draft_passes_per_round == 1 and loop.state.above is not None and loop.state.q is None
    guessed = loop.state.above[:, :-1]  # (B, N) what the head guessed for each position below the first row
    width = pipe.backbone.layout.width
    assert (guessed[:, width:] >= 0).all() and (guessed[:, :width] < 0).all()
