"""A round that runs whole on the device: chain decoders (AR and SJD) under keyed noise, every row on its own.

A chain decoder feeds, per row, its newest committed code and ``L`` drafts for the positions after it (``L = 0``:
AR), and commits the longest prefix of drafts that equal the target's own keyed samples, plus the sample after it.
Under keyed noise (`keyed_sample`) that rule needs no random draw, so the whole round is a function of device
tensors with fixed shapes (`ChainLoop.round`):

1. feed every row ``[last code, drafts]`` at its own positions (``(B, L + 1)``; a finished row feeds them too and
   keeps nothing), the CFG rows the same;
2. one target pass, each cache row writing at its own filled slots (`StaticKVCache.track_rows_on_device`);
3. CFG mix, then each slot's keyed sample ``s`` (slot ``k`` predicts grid index ``n + k``);
4. accepted count ``a = 1 + cumprod(draft == s).sum()`` per row (``0`` once the row is finished, never past the grid);
5. commit ``s[:a]`` to the grid and the acceptance map (slots past ``a`` write a spare column: no duplicate index);
6. the next drafts: the samples this pass made for the positions after the commit (SJD's redraw), then the code one
   row above each new position (``init="above"``; the newest code where the row above is not decoded yet);
7. each cache row keeps its first ``a`` fed slots (a prefix: nothing moves), and its start moves by ``a``.

Nothing in a round reads the device or branches on a device value, and no tensor is built from Python values, so
the round compiles with ``fullgraph=True`` and its buffers keep their addresses (CUDA graphs replay it). The host
reads the device once per *sync*: the fewest rounds the slowest row still needs (``ceil(remaining / (L + 1))``) run
without a read, so no round runs after the last row is done and a generation of ``R`` rounds reads the device about
``log R`` times, plus once per round at the very end.

The rows never wait for each other: a batch takes as many passes as its slowest row alone, and each row commits
exactly what it commits alone (its noise is keyed by its own seed).
"""

import math
import types
from dataclasses import dataclass, fields, replace
from typing import Callable, List, Optional

import torch

from ..core.kv_cache import StaticKVCache
from ..core.sampling import SamplingConfig, cfg_mix, keyed_sample
from .backbone import PromptEmbeddings, SpatialBackbone
from .static_shapes import eager_target, mark_static_cache, uses_cuda_graphs

#: At most this many rounds run between two reads of the device. Between reads the host bounds every row's cache
#: length by ``L + 1`` slots a round, and each pass attends to that bound, so a long stretch attends to slots no row
#: has filled yet; 8 keeps the excess to a few dozen slots.
MAX_ROUNDS_PER_SYNC = 8


@dataclass
class ChainState:
    """Every row's progress, as device tensors that keep their addresses for the whole generation.

    Args:
        tokens (`torch.LongTensor` `(B, N + 1)`): the grids in raster order (``-1``: not decoded); column ``N`` is a
            spare that writes past a row's accepted run land in.
        acceptance_map (`torch.LongTensor` `(B, N + 1)`): the accepted length of the pass that committed each code.
        committed (`torch.LongTensor` `(B,)`): codes committed per row.
        last (`torch.LongTensor` `(B,)`): each row's newest committed code.
        drafts (`torch.LongTensor` `(B, L)`): each row's drafts for the ``L`` positions after its newest code.
        accepted (`torch.LongTensor` `(P, B)`): codes each pass committed per row (row 0: the prompt pass).
        rounds (`torch.LongTensor` `()`): rounds run (the next row of ``accepted``).
        seeds (`torch.LongTensor` `(B,)`): the rows' noise seeds.
    """

    tokens: torch.Tensor
    acceptance_map: torch.Tensor
    committed: torch.Tensor
    last: torch.Tensor
    drafts: torch.Tensor
    accepted: torch.Tensor
    rounds: torch.Tensor
    seeds: torch.Tensor


class ChainLoop:
    """Prefill, rounds and syncs of one generation by a chain decoder (`SpatialDecoderMixin.chain_window`).

    Args:
        backbone (`SpatialBackbone`): the family adapter.
        window (`int`): drafts per row per round (``0``: AR).
        sampling (`SamplingConfig`): keyed noise (or greedy).
        seeds (`torch.LongTensor` `(B,)`): one noise seed per image.
        prefix (`PromptEmbeddings`): the prompt rows ``(R, P, D)``.
        cache (`StaticKVCache`): a cache for the ``R`` rows, empty.
        round_fn (`Callable`, *optional*): what runs a round: `chain_round` (the default), or `compile_round`'s graph.
    """

    def __init__(self, backbone: SpatialBackbone, window: int, sampling: SamplingConfig, seeds: torch.Tensor,
                 prefix: PromptEmbeddings, cache: StaticKVCache, round_fn: Optional[Callable] = None):
        layout, guidance_scale = backbone.layout, sampling.guidance_scale
        # the round sees the CFG scale as a tensor only, so its graph does not depend on the scale's value
        sampling = replace(sampling, guidance_scale=0.0, cfg=sampling.do_cfg) if sampling.do_cfg else sampling
        self.backbone, self.layout, self.window, self.sampling, self.cache = backbone, layout, window, sampling, cache
        self.prefix_length = prefix.embeds.shape[1]
        device = prefix.embeds.device
        b, n = seeds.shape[0], layout.num_tokens
        fed = fed_slots(layout, window)
        self.batch_size, self.fed = b, fed
        # every round commits at least one code per unfinished row: N rounds at most, and the prompt pass
        self.state = ChainState(
            tokens=torch.full((b, n + 1), -1, dtype=torch.long, device=device),
            acceptance_map=torch.zeros(b, n + 1, dtype=torch.long, device=device),
            committed=torch.zeros(b, dtype=torch.long, device=device),
            last=torch.zeros(b, dtype=torch.long, device=device),
            drafts=torch.zeros(b, window, dtype=torch.long, device=device),
            accepted=torch.zeros(n + 1, b, dtype=torch.long, device=device),
            rounds=torch.zeros((), dtype=torch.long, device=device),
            seeds=seeds.to(device),
        )
        # constants of every round, built once: nothing is made from Python values inside a round
        self.slots = torch.arange(fed, device=device)  # (T,)
        # the prompt's length and the CFG scale as data: a new prompt length or scale is not a new graph
        self.first_position = torch.tensor(self.prefix_length, device=device)
        self.guidance_scale = torch.tensor(float(guidance_scale), device=device)
        self.code_offsets = torch.arange(window + 1, device=device)  # (L + 1,) code slot k predicts grid index n + k
        self.draft_offsets = torch.arange(window, device=device)  # (L,)
        self.mask = torch.ones(fed, fed, dtype=torch.bool, device=device).tril()  # (T, T) causal chain
        self.round_fn = round_fn or chain_round
        self.num_rounds = 0
        self.bound = 0  # host-side: no cache row holds more than this many filled slots
        self.last_start = self.prefix_length + layout.sequence_offset(n - 1)  # a row's filled slots when it is done
        self.max_rounds_per_sync = MAX_ROUNDS_PER_SYNC

    # -- the loop's steps ------------------------------------------------------------------------------------
    def prefill(self, prefix: PromptEmbeddings) -> None:
        """The prompt pass fills the cache; its last output's keyed sample is each row's first code. The cache rows
        then keep their own lengths on the device."""
        s, backbone = self.state, self.backbone
        positions = torch.arange(self.prefix_length, device=prefix.embeds.device)
        with eager_target(backbone.target_module):  # the prompt's length varies: never a graph per length
            hidden = backbone.forward(prefix.embeds, positions, None, prefix.valid, self.cache)  # (R, P, D)
        logits = backbone.image_logits(hidden[:, -1:])  # (R, 1, V)
        logits = cfg_mix(logits, self.guidance_scale) if self.sampling.do_cfg else logits  # (B, 1, V)
        first = keyed_sample(logits[:, 0], self.sampling, s.seeds, 0)  # (B,)
        s.tokens[:, 0] = first
        s.acceptance_map[:, 0] = 1
        s.committed.fill_(1)
        s.last.copy_(first)
        s.drafts.copy_(first[:, None].expand_as(s.drafts))  # the first row has nothing above: the newest code
        s.accepted[0] = 1
        self.cache.track_rows_on_device(self.fed)
        self.bound = self.prefix_length
        if uses_cuda_graphs(backbone.target_module, self.cache.storage.device):  # replayed graphs write them in place
            mark_static_cache(self.cache, True)
            for tensor in state_tensors(s) + [self.cache.row_starts]:
                torch._dynamo.mark_static_address(tensor)

    def run(self, on_sync: Optional[Callable[[int], None]] = None) -> int:
        """Rounds until every grid is full; returns how many. Between two reads of the device run the fewest rounds
        the slowest row still needs, at most ``max_rounds_per_sync``; ``on_sync(codes committed over the batch)`` is
        called after each read (the progress bar)."""
        n, committed = self.layout.num_tokens, self.state.committed
        while True:
            slowest, fastest, total = torch.stack([committed.min(), committed.max(), committed.sum()]).tolist()  # the sync
            self.bound = self.prefix_length + self.layout.sequence_offset(fastest - 1)  # the longest cache row, exactly
            if on_sync is not None:
                on_sync(total)
            if slowest >= n:
                return self.num_rounds
            needed = math.ceil((n - slowest) / (self.window + 1))  # rounds the slowest row needs at least
            for _ in range(min(needed, self.max_rounds_per_sync)):
                self.step()

    def step(self) -> None:
        """One round (`chain_round`), after telling the cache the host's bound on its rows' filled slots."""
        end = min(self.bound, self.last_start) + self.fed
        self.cache.set_bound(end)
        self.round_fn(self)
        self.bound = end
        self.num_rounds += 1

    def grid_tokens(self) -> torch.Tensor:
        """``(B, N)``: the grids in raster order."""
        return self.state.tokens[:, :-1]

    def accepted_lengths(self) -> torch.Tensor:
        """``(passes, B)``: what each pass committed per row, the prompt pass first."""
        return self.state.accepted[: self.num_rounds + 1]


def fed_slots(layout, window: int) -> int:
    """Slots a chain round feeds per row: the newest code, ``window`` drafts, and the end-of-row tokens that may
    fall among them."""
    return window + 1 + (-(-(window + 1) // layout.width) if layout.has_eol else 0)


def chain_round(loop: ChainLoop) -> None:
    """One round of a chain decoder, steps 1-7 of the module docstring, on device tensors only."""
    s, backbone, sampling, layout, cache = loop.state, loop.backbone, loop.sampling, loop.layout, loop.cache
    n, width, window = layout.num_tokens, layout.width, loop.window
    active = s.committed < n  # (B,)
    codes = s.committed[:, None] + loop.code_offsets  # (B, L + 1) the grid index each code slot predicts
    # 1. feed the newest code and the drafts at each row's own positions (with end-of-row tokens: every sequence
    #    position from the newest code's on, an EOL where a row ends; past the grid, positions are clamped)
    start = layout.sequence_offset(s.committed - 1)  # (B,) sequence offset of the newest code
    offset = start[:, None] + loop.slots  # (B, T) sequence offset of every fed slot
    position_ids = loop.first_position + offset.clamp_max(layout.sequence_length - 1)  # (B, T)
    if layout.has_eol:
        row, column = offset // layout.row_stride, offset % layout.row_stride
        is_eol = column == width  # (B, T)
        draft = row * width + column.clamp_max(width - 1) - s.committed[:, None]  # (B, T) which draft a slot feeds
        fed = torch.cat([s.last[:, None], s.drafts, s.last[:, None]], 1).gather(1, (draft + 1).clamp(0, window + 1))
        predicting = (layout.sequence_offset(codes.clamp_max(n - 1)) - 1 - start[:, None]).clamp(0, loop.fed - 1)
    else:
        fed = torch.cat([s.last[:, None], s.drafts], 1)  # (B, T)
    embeds = backbone.embed_image_tokens(fed.repeat(2, 1) if sampling.do_cfg else fed)  # (R, T, D)
    if layout.has_eol:
        eol = is_eol.repeat(2, 1) if sampling.do_cfg else is_eol
        embeds = torch.where(eol[..., None], backbone.eol_embedding.to(embeds.dtype), embeds)
    # 2. one target pass, each cache row writing after its own filled slots (the CFG rows verify the same drafts)
    position_ids = position_ids.repeat(2, 1) if sampling.do_cfg else position_ids  # (R, T)
    hidden = backbone.forward(embeds, position_ids, loop.mask, None, cache)  # (R, T, D)
    if layout.has_eol:  # the slot before each code predicts it (after a row's end: the EOL's slot)
        rows = predicting.repeat(2, 1) if sampling.do_cfg else predicting  # (R, L + 1)
        hidden = hidden.gather(1, rows[..., None].expand(-1, -1, hidden.shape[-1]))  # (R, L + 1, D)
    logits = backbone.image_logits(hidden)  # (R, L + 1, V) fp32
    # 3. CFG mix and every code slot's keyed sample
    logits = cfg_mix(logits, loop.guidance_scale) if sampling.do_cfg else logits  # (B, L + 1, V)
    samples = keyed_sample(logits, sampling, s.seeds, codes.clamp_max(n - 1))  # (B, L + 1)
    # 4. the accepted count: the first sample, then one more per leading draft equal to the sample at its position
    matches = (s.drafts == samples[:, :window]).long().cumprod(1).sum(1)  # (B,)
    accepted = torch.minimum(1 + matches, n - s.committed) * active  # (B,) 0 once finished
    # 5. commit the run; the slots past it write the spare column N
    taken = loop.code_offsets < accepted[:, None]  # (B, L + 1)
    target = torch.where(taken, codes, n)  # (B, L + 1)
    s.tokens.scatter_(1, target, torch.where(taken, samples, -1))
    s.acceptance_map.scatter_(1, target, torch.where(taken, accepted[:, None], 0))
    s.rounds.add_(1)
    s.accepted.index_copy_(0, s.rounds.clamp_max(n)[None], accepted[None])
    committed = s.committed + accepted  # (B,)
    s.last.copy_(torch.where(active, samples.gather(1, (accepted - 1).clamp_min(0)[:, None])[:, 0], s.last))
    # 6. the next drafts: this pass's samples after the run, then the code one row above (the newest where none)
    if window:
        source = accepted[:, None] + loop.draft_offsets  # (B, L) code slot whose sample is the draft's
        redrawn = samples.gather(1, source.clamp_max(window))  # (B, L)
        above = committed[:, None] + loop.draft_offsets - width  # (B, L) grid index one row above each new draft
        known = (above >= 0) & (above < committed[:, None])
        copied = torch.where(known, s.tokens.gather(1, above.clamp(0, n)), s.last[:, None])  # (B, L)
        s.drafts.copy_(torch.where(source <= window, redrawn, copied))
    # 7. each cache row keeps the fed slots up to its newest code (a prefix), its CFG twin the same
    kept = (layout.sequence_offset(committed - 1) - start) * active  # (B,) = accepted without EOLs
    s.committed.copy_(committed)
    cache.keep_prefixes(kept.repeat(2) if sampling.do_cfg else kept)


def compile_round(fullgraph: bool = True, **options) -> Callable[[ChainLoop], None]:
    """`chain_round` compiled whole (``torch.compile(fullgraph=True)``): one graph per batch, window and attended
    length. Under CUDA graphs (``mode="reduce-overhead"``) each round is a new graph step."""
    # a copy of `chain_round` with its own code object: dynamo keeps graphs, and counts them against its recompile
    # limit, per code object, so each compiled pipeline gets its own rather than sharing one with every other
    own = types.FunctionType(chain_round.__code__.replace(), chain_round.__globals__, chain_round.__name__)
    compiled = torch.compile(own, fullgraph=fullgraph, **options)
    graphs = options.get("mode") in ("reduce-overhead", "max-autotune")

    def run(loop: ChainLoop) -> None:
        if graphs and loop.cache.storage.device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()
        with eager_target(loop.backbone.target_module):  # the module is traced inside this graph, not called compiled
            compiled(loop)

    return run


def state_tensors(state: ChainState) -> List[torch.Tensor]:
    """The state's tensors (their ``data_ptr`` must not change from round to round)."""
    return [getattr(state, f.name) for f in fields(state)]
