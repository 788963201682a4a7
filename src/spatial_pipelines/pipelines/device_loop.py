"""Rounds that run whole on the device, every row on its own, under keyed noise (or greedy): what every such
generation shares (`DeviceLoop`: its state, the prompt pass, the rounds and the host's reads between them). Chain
decoders (AR, SJD) run `device_chain.ChainLoop`, SJD's proactive candidates `device_proactive.ProactiveLoop`, head
trees (Medusa, Hawk) `device_tree.HeadTreeLoop`, trees grown per row (EAGLE-2, ADT-Tree) `device_tree.DynamicTreeLoop`.

A round commits, per row, the drafts that equal the target's keyed samples (`keyed_sample`), plus the sample after
them (a relaxed rule tests them on keyed streams of their own). Nothing in a round reads the device, branches on a
device value or builds a tensor from Python values, so it compiles with ``fullgraph=True`` (`compile_round`) and its
buffers keep their addresses (CUDA graphs replay it). The host reads the device once per *sync*, after the fewest
rounds the slowest row still needs. Each row commits exactly what it commits alone (its noise is keyed by its seed)."""

import math
import types
from dataclasses import dataclass, fields, replace
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ..core.acceptance import EXACT, AcceptanceRule
from ..core.kv_cache import StaticKVCache
from ..core.sampling import TINY_TEMPERATURE, SamplingConfig, cfg_mix, keyed_sample
from ..utils import NULL_TIMER
from .backbone import PromptEmbeddings, SpatialBackbone
from .compiled import eager_target, mark_static_cache, uses_cuda_graphs

#: At most this many rounds run between two reads of the device. Between reads the host bounds every row's cache
#: length by the slots a round feeds, and each pass attends to that bound, so a long stretch attends to slots no row
#: has filled yet; 8 keeps the excess to a few dozen slots.
MAX_ROUNDS_PER_SYNC = 8


@dataclass
class DeviceState:
    """Every row's progress, as device tensors that keep their addresses for the whole generation.

    Args:
        tokens (`torch.LongTensor` `(B, N + 1)`): the grids in raster order (``-1``: not decoded); column ``N`` is a
            spare that writes past a row's accepted run land in.
        acceptance_map (`torch.LongTensor` `(B, N + 1)`): the accepted length of the pass that committed each code.
        committed (`torch.LongTensor` `(B,)`), last (`torch.LongTensor` `(B,)`): codes committed per row, the newest.
        accepted (`torch.LongTensor` `(P, B)`): codes each pass committed per row (row 0: the prompt pass).
        rounds (`torch.LongTensor` `()`): rounds run (the next row of ``accepted``).
        seeds (`torch.LongTensor` `(B,)`): the rows' noise seeds.
        progress (`torch.LongTensor` `(3,)`): the fewest, the most and the total codes committed over the rows
            (`record_progress`): what a sync reads.
    """

    tokens: torch.Tensor
    acceptance_map: torch.Tensor
    committed: torch.Tensor
    last: torch.Tensor
    accepted: torch.Tensor
    rounds: torch.Tensor
    seeds: torch.Tensor
    progress: torch.Tensor


class DeviceLoop:
    """Prefill, rounds and syncs of one generation whose rounds run whole on the device. A subclass says what a round
    feeds (`fed`), commits at most (`max_codes`), what its state holds (`new_state`) and what runs a round
    (`default_round`).

    Args:
        backbone (`SpatialBackbone`): the family adapter.
        sampling (`SamplingConfig`): keyed noise (or greedy).
        seeds (`torch.LongTensor` `(B,)`): one noise seed per image.
        prefix (`PromptEmbeddings`): the prompt rows ``(R, P, D)``.
        cache (`StaticKVCache`): a cache for the ``R`` rows, empty.
        round_fn (`Callable`, *optional*): what runs a round: `default_round` or `compile_round`'s graph of it.
        rule (`AcceptanceRule`): exact (the default: a draft is accepted when it equals the target's keyed sample), or
            relaxed (LANTERN, LANTERN++).
        neighbours (`torch.Tensor` `(V, k)`, *optional*): a relaxed rule's codebook neighbour table
            (`SpatialBackbone.code_neighbours`).
    """

    fed: int  # slots a round feeds per row
    max_codes: int  # codes a round commits per row at most
    draft_passes_per_round: int = 0  # drafting passes (the heads') a round runs besides the target's

    def __init__(self, backbone: SpatialBackbone, sampling: SamplingConfig, seeds: torch.Tensor, prefix: PromptEmbeddings,
                 cache: StaticKVCache, round_fn: Optional[Callable] = None, rule: AcceptanceRule = EXACT,
                 neighbours: Optional[torch.Tensor] = None):
        if rule.relaxes and rule.num_neighbours and neighbours is None:
            raise ValueError(f"{rule!r} needs the codebook neighbour table: pass `neighbours` "
                             "(`SpatialBackbone.code_neighbours`).")
        self.rule, self.neighbours = rule, neighbours
        self.user_sampling = sampling  # what the call asked for (a step callback reads it and changes its guidance scale)
        layout, guidance_scale, temperature = backbone.layout, sampling.guidance_scale, sampling.temperature
        # the round sees the CFG scale and the temperature as tensors only, so its graph does not depend on their
        # values (the logits are divided by the temperature before sampling at 1: the same floats)
        sampling = replace(sampling, guidance_scale=0.0, cfg=sampling.do_cfg) if sampling.do_cfg else sampling
        scaled = not sampling.greedy and temperature >= TINY_TEMPERATURE  # else a constant of the graph (rare)
        sampling = replace(sampling, temperature=1.0) if scaled else sampling
        self.backbone, self.layout, self.sampling, self.cache = backbone, layout, sampling, cache
        self.prefix_length = prefix.embeds.shape[1]
        device = prefix.embeds.device
        self.batch_size = b = seeds.shape[0]
        n = layout.num_tokens
        long = {"dtype": torch.long, "device": device}
        # every round commits at least one code per unfinished row: N rounds at most, and the prompt pass
        self.state = self.new_state(
            tokens=torch.full((b, n + 1), -1, **long), acceptance_map=torch.zeros(b, n + 1, **long),
            committed=torch.zeros(b, **long), last=torch.zeros(b, **long), accepted=torch.zeros(n + 1, b, **long),
            rounds=torch.zeros((), **long), seeds=seeds.to(device), progress=torch.zeros(3, **long))
        # constants of every round, built once: nothing is made from Python values inside a round
        self.slots = torch.arange(self.fed, device=device)  # (T,)
        # the prompt's length and the CFG scale as data: a new prompt length or scale is not a new graph
        self.first_position = torch.tensor(self.prefix_length, device=device)
        self.guidance_scale = torch.tensor(float(guidance_scale), device=device)
        self.temperature = torch.tensor(float(temperature), device=device) if scaled else None
        self.code_offsets = torch.arange(self.max_codes, device=device)  # (C,) the codes a round may commit
        self.round_fn = round_fn or self.default_round()
        self.num_rounds = 0
        self.bound = 0  # host-side: no cache row holds more than this many filled slots
        self.last_start = self.prefix_length + layout.sequence_offset(n - 1)  # a row's filled slots when it is done
        self.max_rounds_per_sync = MAX_ROUNDS_PER_SYNC
        # `profile_rounds`: ``timer`` times the parts of an eager round (a compiled round is one graph: it keeps
        # `NULL_TIMER`, whose sections trace to nothing), ``host_timer`` each whole round and each read of the device
        self.timer = self.host_timer = NULL_TIMER

    def new_state(self, **common) -> DeviceState:
        raise NotImplementedError(f"{type(self).__name__} must define `new_state`.")

    @classmethod
    def default_round(cls) -> Callable:
        """The round function (looked up when called: a test may swap the module's)."""
        raise NotImplementedError(f"{cls.__name__} must define `default_round`.")

    def guided(self, logits: torch.Tensor) -> torch.Tensor:
        """``(R, ..., V)`` fp32 logits -> ``(B, ..., V)``: CFG mix at the scale tensor, over the temperature tensor."""
        logits = cfg_mix(logits, self.guidance_scale) if self.sampling.do_cfg else logits
        return logits / self.temperature if self.temperature is not None else logits

    def start_rows(self, first: torch.Tensor, hidden: torch.Tensor) -> None:
        """After the prompt pass: the subclass's state for the first codes ``first`` ``(B,)``, ``hidden`` ``(R, D)``."""

    # -- the loop's steps ------------------------------------------------------------------------------------
    def prefill(self, prefix: PromptEmbeddings) -> None:
        """The prompt pass fills the cache; its last output's keyed sample is each row's first code."""
        s, backbone = self.state, self.backbone
        positions = torch.arange(self.prefix_length, device=prefix.embeds.device)
        with eager_target(backbone.target_module):  # the prompt's length varies: never a graph per length
            hidden = backbone.forward(prefix.embeds, positions, None, prefix.valid, self.cache)  # (R, P, D)
        logits = self.guided(backbone.image_logits(hidden[:, -1:]))  # (R, 1, V) -> (B, 1, V)
        first = keyed_sample(logits[:, 0], self.sampling, s.seeds, 0)  # (B,)
        s.tokens[:, 0] = first
        s.acceptance_map[:, 0] = 1
        s.committed.fill_(1)
        s.last.copy_(first)
        s.accepted[0] = 1
        record_progress(s)
        self.start_rows(first, hidden[:, -1])
        self.cache.track_rows_on_device(self.fed)
        self.bound = self.prefix_length
        if uses_cuda_graphs(backbone.target_module, self.cache.storage.device):  # replayed graphs write them in place
            mark_static_cache(self.cache, True)
            for tensor in self.static_tensors():
                torch._dynamo.mark_static_address(tensor)

    def run(self, on_sync: Optional[Callable[[int], None]] = None, on_round: Optional[Callable[[int, int], None]] = None,
            interrupted: Optional[Callable[[], bool]] = None) -> int:
        """Rounds until every grid is full; returns how many. Between two reads of the device run the fewest rounds the
        slowest row still needs, at most ``max_rounds_per_sync``, then call ``on_sync(codes committed over the batch)``.
        With ``on_round`` (a step callback) the host reads after every round and calls ``on_round(round index, the
        slowest row's committed codes)``; ``interrupted()`` true after a read stops the generation."""
        n = self.layout.num_tokens
        while True:
            slowest, total = self.sync()
            if on_sync is not None:
                on_sync(total)
            if on_round is not None and self.num_rounds:  # the callback sees the round just run
                on_round(self.num_rounds - 1, slowest)
            if slowest >= n or (interrupted is not None and interrupted()):
                return self.num_rounds
            needed = self.rounds_needed(slowest)
            for _ in range(1 if on_round is not None else min(needed, self.max_rounds_per_sync)):
                self.step()

    def sync(self) -> Tuple[int, int]:
        """The host's read: the slowest row's committed codes and the batch's total; the cache bound becomes exact."""
        with self.host_timer.section("sync"):
            slowest, fastest, total = self.state.progress.tolist()
        self.bound = self.prefix_length + self.layout.sequence_offset(fastest - 1)  # the longest cache row, exactly
        return slowest, total

    def rounds_needed(self, slowest: int) -> int:
        """The fewest rounds left while the slowest row has ``slowest`` codes (host-side)."""
        return math.ceil((self.layout.num_tokens - slowest) / self.max_codes)

    def write_bound(self) -> int:
        """Before a round: the host's bound on the slots its pass writes up to (`StaticKVCache.set_bound`)."""
        return min(self.bound, self.last_start) + self.fed

    def step(self) -> None:
        """One round, after telling the cache the host's bound on its rows' filled slots."""
        end = self.write_bound()
        self.cache.set_bound(end)
        with self.host_timer.section("round"):
            self.round_fn(self)
        self.bound = end
        self.num_rounds += 1

    def static_tensors(self) -> List[torch.Tensor]:
        """What a round reads and writes in place besides the cache storage (their addresses stay put)."""
        return state_tensors(self.state) + [self.cache.row_starts] + self.extra_buffers()

    def extra_buffers(self) -> List[torch.Tensor]:
        return []

    def grid_tokens(self) -> torch.Tensor:
        """``(B, N)``: the grids in raster order."""
        return self.state.tokens[:, :-1]

    def accepted_lengths(self) -> torch.Tensor:
        """``(passes, B)``: what each pass committed per row, the prompt pass first."""
        return self.state.accepted[: self.num_rounds + 1]

    def row_passes(self, accepted: torch.Tensor) -> List[int]:
        """Target passes each row took (those that committed a code), from `accepted_lengths` ``(passes, B)``."""
        return (accepted > 0).sum(0).tolist()

    def draft_passes(self, rounds: int) -> int:
        """Drafting passes (the heads') over ``rounds`` rounds."""
        return rounds * self.draft_passes_per_round

    def report(self) -> Dict[str, float]:
        """What the decoder reports about its rounds (`DecodingStats.decoder_stats`), read after the last round."""
        return {}


class RoundView:
    """What a step callback sees of a generation (`CallbackStateMixin._run_callback`): every row's grid and acceptance
    record (views of the device state), the slowest row's count, and the call's sampling, whose guidance scale a
    callback may change (a tensor to the rounds: no new graph).

    Args:
        loop (`DeviceLoop`): the generation.
        num_committed (`int`): the slowest row's committed codes (read by the host after the round).
    """

    def __init__(self, loop: DeviceLoop, num_committed: int):
        self.loop, self.num_committed, self.layout = loop, num_committed, loop.layout
        self.finished = num_committed >= loop.layout.num_tokens

    @property
    def tokens(self) -> torch.Tensor:
        return self.loop.state.tokens[:, :-1]  # (B, N) without the spare column

    @property
    def acceptance_map(self) -> torch.Tensor:
        return self.loop.state.acceptance_map[:, :-1]  # (B, N)

    @property
    def sampling(self) -> SamplingConfig:
        return self.loop.user_sampling

    @sampling.setter
    def sampling(self, value: SamplingConfig) -> None:
        self.loop.user_sampling = value
        self.loop.guidance_scale.fill_(float(value.guidance_scale))


class CompiledRound:
    """A round function compiled whole (`compile_round`); ``weights_seen`` are the weights `GenerationLoop` saw it run
    on (`GenerationLoop.weights_changed`), where its graphs may hold them frozen."""

    def __init__(self, round_fn: Callable, fullgraph: bool = True, **options):
        # a copy of the function with its own code object: dynamo keeps graphs, and counts them against its recompile
        # limit, per code object, so each compiled pipeline gets its own rather than sharing one with every other
        own = types.FunctionType(round_fn.__code__.replace(), round_fn.__globals__, round_fn.__name__)
        self.compiled = torch.compile(own, fullgraph=fullgraph, **options)
        self.graphs = options.get("mode") in ("reduce-overhead", "max-autotune")
        self.weights_seen = {}  # {id: (weakref, version counter)}

    def __call__(self, loop: DeviceLoop) -> None:
        if self.graphs and loop.cache.storage.device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()
        with eager_target(loop.backbone.target_module):  # the module is traced inside this graph, not called compiled
            self.compiled(loop)


def compile_round(round_fn: Callable, fullgraph: bool = True, **options) -> CompiledRound:
    """A round function (`DeviceLoop.default_round`) compiled whole (``torch.compile(fullgraph=True)``): one graph per
    batch, draft shape and attended length; under CUDA graphs (``mode="reduce-overhead"``) each round is a new step."""
    return CompiledRound(round_fn, fullgraph=fullgraph, **options)


def commit_run(loop: DeviceLoop, codes: torch.Tensor, run: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """Commit each active row's ``run + 1`` codes ``codes`` ``(B, C)`` (never past the grid; the slots past them write
    the spare column ``N``), record the round and the newest code. Returns the counts ``(B,)`` (``0`` once finished)."""
    s, n = loop.state, loop.layout.num_tokens
    accepted = torch.minimum(run + 1, n - s.committed) * active  # (B,)
    taken = loop.code_offsets < accepted[:, None]  # (B, C)
    target = torch.where(taken, s.committed[:, None] + loop.code_offsets, n)  # (B, C)
    s.tokens.scatter_(1, target, torch.where(taken, codes, -1))
    s.acceptance_map.scatter_(1, target, torch.where(taken, accepted[:, None], 0))
    s.rounds.add_(1)
    s.accepted.index_copy_(0, s.rounds.clamp_max(n)[None], accepted[None])
    s.last.copy_(torch.where(active, codes.gather(1, (accepted - 1).clamp_min(0)[:, None])[:, 0], s.last))
    return accepted


def record_progress(state: DeviceState) -> None:
    """End of a round or the prompt pass: the fewest, most and total committed codes, read by a sync."""
    committed = state.committed
    state.progress.copy_(torch.stack([committed.min(), committed.max(), committed.sum()]))


def state_tensors(state: DeviceState) -> List[torch.Tensor]:
    """The state's tensors (their ``data_ptr`` stays put), less the fields a loop's options leave ``None``."""
    return [t for t in (getattr(state, f.name) for f in fields(state)) if t is not None]
