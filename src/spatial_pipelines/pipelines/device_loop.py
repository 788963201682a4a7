"""Rounds that run whole on the device, every row on its own, under keyed noise (or greedy): chain decoders (AR and
SJD, `ChainLoop`), static head trees (Medusa, Hawk: `HeadTreeLoop`) and trees a drafter grows per row (EAGLE-2,
ADT-Tree: `DynamicTreeLoop`).

A chain decoder feeds, per row, its newest committed code and ``L`` drafts for the positions after it (``L = 0``:
AR), and commits the longest prefix of drafts that equal the target's own keyed samples, plus the sample after it.
Under keyed noise (`keyed_sample`) that rule needs no random draw, so the whole round is a function of device
tensors with fixed shapes (`chain_round`):

1. feed every row ``[last code, drafts]`` at its own positions (``(B, L + 1)``; a finished row feeds them too and
   keeps nothing), the CFG rows the same;
2. one target pass, each cache row writing at its own filled slots (`StaticKVCache.track_rows_on_device`);
3. CFG mix, then each slot's keyed sample ``s`` (slot ``k`` predicts grid index ``n + k``);
4. accepted count ``a = 1 + cumprod(draft == s).sum()`` per row (``0`` once the row is finished, never past the grid);
5. commit ``s[:a]`` to the grid and the acceptance map (slots past ``a`` write a spare column: no duplicate index);
6. the next drafts: the samples this pass made for the positions after the commit (SJD's redraw), then the code one
   row above each new position (``init="above"``; the newest code where the row above is not decoded yet);
7. each cache row keeps its first ``a`` fed slots (a prefix: nothing moves), and its start moves by ``a``.

A head tree (`head_tree_round`) drafts a static tree of the draft heads' candidates (Medusa's top-k, Hawk's pools)
from the hidden state that predicted each row's newest code (the decoder's `HeadDrafter`), feeds it with the tree
mask, and accepts the deepest node whose path matches the keyed samples node by node (a sibling is accepted exactly
when it equals its parent's sample, as `verify_tree` does with a point mass); the codes are the samples along that
path, and the cache moves the path's slots to the row's first ones (`StaticKVCache.keep_paths`). A grown tree
(`dynamic_tree_round`) comes from a drafter with its own cache (`EagleDrafter`): it reads the codes the last round
committed with the target features that predicted them, grows one tree per row (`RowTrees`), and the same
verification (`verify_tree_round`) reads that tree's per-row tables. With end-of-row tokens a tree round also feeds
one EOL slot per node at the depth whose code ends a row (`end_of_row_slots`): the node's children see it, its output
predicts the next row's first code, and the cache keeps it where the accepted path crossed the row end.

Nothing in a round reads the device or branches on a device value, and no tensor is built from Python values, so
the round compiles with ``fullgraph=True`` and its buffers keep their addresses (CUDA graphs replay it). The host
reads the device once per *sync*: the fewest rounds the slowest row still needs (``ceil(remaining / codes a round
commits at most)``) run without a read, so no round runs after the last row is done and a generation of ``R``
rounds reads the device about ``log R`` times, plus once per round at the very end.

The rows never wait for each other: a batch takes as many passes as its slowest row alone, and each row commits
exactly what it commits alone (its noise is keyed by its own seed).

A relaxed acceptance rule (LANTERN, LANTERN++; lossy) runs the same rounds: a tree node is accepted when its parent's
keyed sample lies in the node's claim (`relaxed_matches`), and a chain's draft when a keyed uniform of its own stream
is below ``p~(x) / q(x)``, its proposal ``q`` kept in the state (`relaxed_chain`, step 4 above).
"""

import math
import types
from dataclasses import dataclass, fields, replace
from typing import Callable, Dict, List, Optional

import torch

from ..core.acceptance import EXACT, AcceptanceRule
from ..core.kv_cache import StaticKVCache
from ..core.sampling import (ACCEPT_STREAM, RESIDUAL_STREAM, TINY_TEMPERATURE, SamplingConfig, cfg_mix, keyed_sample,
                             keyed_uniform, logits_to_probs, one_hot)
from .backbone import PromptEmbeddings, SpatialBackbone
from .compiled import eager_target, mark_static_cache, uses_cuda_graphs

#: At most this many rounds run between two reads of the device. Between reads the host bounds every row's cache
#: length by the slots a round feeds, and each pass attends to that bound, so a long stretch attends to slots no row
#: has filled yet; 8 keeps the excess to a few dozen slots.
MAX_ROUNDS_PER_SYNC = 8

#: What a draw from an already-filtered distribution samples with: its log as the logits, at temperature 1
UNIT_SAMPLING = SamplingConfig()


@dataclass
class DeviceState:
    """Every row's progress, as device tensors that keep their addresses for the whole generation.

    Args:
        tokens (`torch.LongTensor` `(B, N + 1)`): the grids in raster order (``-1``: not decoded); column ``N`` is a
            spare that writes past a row's accepted run land in.
        acceptance_map (`torch.LongTensor` `(B, N + 1)`): the accepted length of the pass that committed each code.
        committed (`torch.LongTensor` `(B,)`): codes committed per row.
        last (`torch.LongTensor` `(B,)`): each row's newest committed code.
        accepted (`torch.LongTensor` `(P, B)`): codes each pass committed per row (row 0: the prompt pass).
        rounds (`torch.LongTensor` `()`): rounds run (the next row of ``accepted``).
        seeds (`torch.LongTensor` `(B,)`): the rows' noise seeds.
    """

    tokens: torch.Tensor
    acceptance_map: torch.Tensor
    committed: torch.Tensor
    last: torch.Tensor
    accepted: torch.Tensor
    rounds: torch.Tensor
    seeds: torch.Tensor


@dataclass
class ChainState(DeviceState):
    """`DeviceState` plus each row's drafts.

    Args:
        drafts (`torch.LongTensor` `(B, L)`): each row's drafts for the ``L`` positions after its newest code.
    """

    drafts: torch.Tensor


@dataclass
class RelaxedChainState(ChainState):
    """`ChainState` plus each draft's proposal, which a relaxed rule tests it against (`relaxed_chain`).

    Args:
        q (`torch.Tensor` `(B, L, V)`): the distribution each draft was drawn from (a point mass for a copied one).
    """

    q: torch.Tensor


@dataclass
class HeadTreeState(DeviceState):
    """`DeviceState` plus the hidden state the heads draft from.

    Args:
        hidden (`torch.Tensor` `(B, D)`): per row, the pre-norm hidden state that predicted its newest code.
        path (`torch.LongTensor` `(R, D + 1)`), kept (`torch.LongTensor` `(R,)`): per cache row, the fed slots of the
            last round's accepted path and how many of them it keeps: the next round moves them first
            (`StaticKVCache.keep_paths`).
    """

    hidden: torch.Tensor
    path: torch.Tensor
    kept: torch.Tensor


@dataclass
class DynamicTreeState(DeviceState):
    """`DeviceState` plus what a drafter that grows per-row trees reads (`DynamicTreeLoop`).

    Args:
        path (`torch.LongTensor` `(R, D + 1)`), kept (`torch.LongTensor` `(R,)`): as `HeadTreeState`'s.
        features (`torch.Tensor` `(R, D + 1, D)`): per cache row (CFG rows too), the pre-norm hidden states of the
            last round's accepted path: the ones that predicted the codes it committed (after the prompt pass: the
            prompt's last, in slot 0).
        fresh (`torch.LongTensor` `(B,)`): codes the last round committed per row (the drafter has not read them yet).
        tree_shapes (`torch.LongTensor` `(N + 1, B, 2)`): per round (as ``accepted``), each row's kept tree depth and
            the ``k`` it was grown with.
    """

    path: torch.Tensor
    kept: torch.Tensor
    features: torch.Tensor
    fresh: torch.Tensor
    tree_shapes: torch.Tensor


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
        round_fn (`Callable`, *optional*): what runs a round: the subclass's round function (the default), or
            `compile_round`'s graph of it.
        rule (`AcceptanceRule`): exact (the default: a draft is accepted when it equals the target's keyed sample),
            or relaxed (LANTERN, LANTERN++: `relaxed_matches` for a tree's point-mass candidates, `relaxed_chain` for
            a chain's drafts and their proposals).
        neighbours (`torch.Tensor` `(V, k)`, *optional*): the codebook neighbour table of a relaxed rule
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
        # every round commits at least one code per unfinished row: N rounds at most, and the prompt pass
        self.state = self.new_state(
            tokens=torch.full((b, n + 1), -1, dtype=torch.long, device=device),
            acceptance_map=torch.zeros(b, n + 1, dtype=torch.long, device=device),
            committed=torch.zeros(b, dtype=torch.long, device=device),
            last=torch.zeros(b, dtype=torch.long, device=device),
            accepted=torch.zeros(n + 1, b, dtype=torch.long, device=device),
            rounds=torch.zeros((), dtype=torch.long, device=device),
            seeds=seeds.to(device),
        )
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

    def new_state(self, **common) -> DeviceState:
        raise NotImplementedError(f"{type(self).__name__} must define `new_state`.")

    @classmethod
    def default_round(cls) -> Callable:
        """The round function (looked up when called: a test may swap the module's)."""
        raise NotImplementedError(f"{cls.__name__} must define `default_round`.")

    def guided(self, logits: torch.Tensor) -> torch.Tensor:
        """``(R, ..., V)`` fp32 logits -> ``(B, ..., V)``: the CFG mix at the scale tensor, divided by the temperature
        tensor (the sampling config then says 1)."""
        logits = cfg_mix(logits, self.guidance_scale) if self.sampling.do_cfg else logits
        return logits / self.temperature if self.temperature is not None else logits

    def start_rows(self, first: torch.Tensor, hidden: torch.Tensor) -> None:
        """After the prompt pass: what the subclass's state needs besides the first code ``first`` ``(B,)`` (``hidden``:
        the pass's last pre-norm outputs ``(R, D)``)."""

    # -- the loop's steps ------------------------------------------------------------------------------------
    def prefill(self, prefix: PromptEmbeddings) -> None:
        """The prompt pass fills the cache; its last output's keyed sample is each row's first code. The cache rows
        then keep their own lengths on the device."""
        s, backbone = self.state, self.backbone
        positions = torch.arange(self.prefix_length, device=prefix.embeds.device)
        with eager_target(backbone.target_module):  # the prompt's length varies: never a graph per length
            hidden = backbone.forward(prefix.embeds, positions, None, prefix.valid, self.cache)  # (R, P, D)
        logits = backbone.image_logits(hidden[:, -1:])  # (R, 1, V)
        logits = self.guided(logits)  # (B, 1, V)
        first = keyed_sample(logits[:, 0], self.sampling, s.seeds, 0)  # (B,)
        s.tokens[:, 0] = first
        s.acceptance_map[:, 0] = 1
        s.committed.fill_(1)
        s.last.copy_(first)
        s.accepted[0] = 1
        self.start_rows(first, hidden[:, -1])
        self.cache.track_rows_on_device(self.fed)
        self.bound = self.prefix_length
        if uses_cuda_graphs(backbone.target_module, self.cache.storage.device):  # replayed graphs write them in place
            mark_static_cache(self.cache, True)
            for tensor in self.static_tensors():
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
            needed = math.ceil((n - slowest) / self.max_codes)  # rounds the slowest row needs at least
            for _ in range(min(needed, self.max_rounds_per_sync)):
                self.step()

    def step(self) -> None:
        """One round, after telling the cache the host's bound on its rows' filled slots."""
        end = min(self.bound, self.last_start) + self.fed
        self.cache.set_bound(end)
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

    def report(self) -> Dict[str, float]:
        """What the decoder reports about its rounds (`DecodingStats.decoder_stats`), read after the last round."""
        return {}


class ChainLoop(DeviceLoop):
    """A chain decoder's generation (`SpatialDecoderMixin.chain_window`): `chain_round`, steps 1-7 of the module
    docstring.

    Args:
        window (`int`): drafts per row per round (``0``: AR); the other arguments are `DeviceLoop`'s.
    """

    def __init__(self, backbone: SpatialBackbone, window: int, sampling: SamplingConfig, seeds: torch.Tensor,
                 prefix: PromptEmbeddings, cache: StaticKVCache, round_fn: Optional[Callable] = None,
                 rule: AcceptanceRule = EXACT, neighbours: Optional[torch.Tensor] = None):
        self.window, self.fed, self.max_codes = window, fed_slots(backbone.layout, window), window + 1
        self.num_codes = backbone.num_image_codes
        super().__init__(backbone, sampling, seeds, prefix, cache, round_fn, rule, neighbours)
        device = prefix.embeds.device
        self.draft_offsets = torch.arange(window, device=device)  # (L,)
        self.mask = torch.ones(self.fed, self.fed, dtype=torch.bool, device=device).tril()  # (T, T) causal chain

    @staticmethod
    def fed_slots(layout, window: int, **_) -> int:
        """Slots a round feeds per row, before the loop is made (the cache's size)."""
        return fed_slots(layout, window)

    def new_state(self, **common) -> ChainState:
        device = common["tokens"].device
        drafts = torch.zeros(self.batch_size, self.window, dtype=torch.long, device=device)
        if self.rule.relaxes:
            q = torch.zeros(self.batch_size, self.window, self.num_codes, device=device)
            return RelaxedChainState(drafts=drafts, q=q, **common)
        return ChainState(drafts=drafts, **common)

    @classmethod
    def default_round(cls) -> Callable:
        return chain_round

    def start_rows(self, first: torch.Tensor, hidden: torch.Tensor) -> None:
        self.state.drafts.copy_(first[:, None].expand_as(self.state.drafts))  # the first row has nothing above
        if self.rule.relaxes:  # copies: point masses
            self.state.q.copy_(one_hot(self.state.drafts, self.num_codes))


class TreeLoop(DeviceLoop):
    """What the tree loops share: ``T`` tree nodes per row, then (with end-of-row tokens) ``E`` EOL slots, one for each
    node at the depth whose code ends a row (`end_of_row_slots`; at most one such depth, the tree being shallower than
    a row); the accepted path's cache slots (an EOL slot among them where it crossed a row end) moved by the next
    round. A subclass sets ``drafter``, ``num_nodes`` (``T``), ``max_codes`` and ``eol_slots`` before
    `DeviceLoop.__init__`.

    Under a relaxed rule a node is accepted when its parent's keyed sample lies in the set the node claims
    (`relaxed_matches`): LANTERN's own verification of point-mass candidates, with the sample as its only
    randomness."""

    def __init__(self, backbone: SpatialBackbone, sampling: SamplingConfig, seeds: torch.Tensor, prefix: PromptEmbeddings,
                 cache: StaticKVCache, round_fn: Optional[Callable] = None, rule: AcceptanceRule = EXACT,
                 neighbours: Optional[torch.Tensor] = None):
        layout = backbone.layout
        if not self.fits(layout, self.max_codes - 1):
            raise ValueError(f"A tree of depth {self.max_codes - 1} crosses two row ends of a {layout.width}-wide grid "
                             "in one round: such a tree takes the row-group loop.")
        self.fed = self.num_nodes + self.eol_slots
        self.path_slots = self.max_codes + int(layout.has_eol)  # a crossed row end keeps its EOL slot too
        self.hidden_size, self.hidden_dtype = prefix.embeds.shape[-1], prefix.embeds.dtype
        super().__init__(backbone, sampling, seeds, prefix, cache, round_fn, rule, neighbours)
        device = prefix.embeds.device
        self.node_slots = self.slots[: self.num_nodes]  # (T,)
        self.eol_offsets = torch.arange(self.eol_slots, device=device)  # (E,)
        self.eol_eye = torch.eye(self.eol_slots, dtype=torch.bool, device=device)  # (E, E) an EOL slot sees itself
        self.path_offsets = torch.arange(self.path_slots, device=device)  # (D + 1 (+ 1),)

    @staticmethod
    def fits(layout, tree_depth: int) -> bool:
        """Whether a tree of that depth crosses at most one row end per round (with EOLs: shallower than a row)."""
        return not layout.has_eol or tree_depth < layout.width

    @staticmethod
    def eol_slot_count(layout, nodes_per_depth: int) -> int:
        """EOL slots a round feeds: as many as the most nodes at one depth, where the layout has EOLs."""
        return nodes_per_depth if layout.has_eol else 0

    def extra_buffers(self) -> List[torch.Tensor]:
        return self.drafter.buffers()


class HeadTreeLoop(TreeLoop):
    """A static tree of draft-head candidates (Medusa, Hawk: `SpatialDecoderMixin.device_drafter`), verified exactly
    under keyed noise: `head_tree_round`.

    Args:
        drafter (`HeadDrafter`): drafts the tree's nodes from each row's hidden state; the other arguments are
            `DeviceLoop`'s.
    """

    def __init__(self, backbone: SpatialBackbone, drafter, sampling: SamplingConfig, seeds: torch.Tensor,
                 prefix: PromptEmbeddings, cache: StaticKVCache, round_fn: Optional[Callable] = None,
                 rule: AcceptanceRule = EXACT, neighbours: Optional[torch.Tensor] = None):
        tree = drafter.tree
        self.drafter, self.num_nodes, self.max_codes = drafter, tree.num_nodes, tree.max_depth + 1
        self.eol_slots = self.eol_slot_count(backbone.layout, drafter.nodes_per_depth)
        super().__init__(backbone, sampling, seeds, prefix, cache, round_fn, rule, neighbours)
        self.tree_tables = tree_tables(tree, self.node_slots)  # the static tree's, built once

    @staticmethod
    def fed_slots(layout, drafter, **_) -> int:
        """Slots a round feeds per row, before the loop is made (the cache's size)."""
        return drafter.tree.num_nodes + TreeLoop.eol_slot_count(layout, drafter.nodes_per_depth)

    def new_state(self, **common) -> HeadTreeState:
        device = common["tokens"].device
        hidden = torch.zeros(self.batch_size, self.hidden_size, dtype=self.hidden_dtype, device=device)
        rows = self.cache.num_rows
        path = torch.zeros(rows, self.path_slots, dtype=torch.long, device=device)
        kept = torch.zeros(rows, dtype=torch.long, device=device)  # the prompt pass left nothing to move
        return HeadTreeState(hidden=hidden, path=path, kept=kept, **common)

    draft_passes_per_round = 1  # the heads

    @classmethod
    def default_round(cls) -> Callable:
        return head_tree_round

    def start_rows(self, first: torch.Tensor, hidden: torch.Tensor) -> None:
        self.state.hidden.copy_(hidden[: self.batch_size])  # the conditional rows' (the heads read no CFG twin)


class DynamicTreeLoop(TreeLoop):
    """A drafter that grows each row's own tree every round (EAGLE-2: `SpatialDecoderMixin.device_drafter` returns one
    with ``per_row_trees``), verified exactly under keyed noise: `dynamic_tree_round`.

    Args:
        drafter: grows the trees (`EagleDrafter`): ``drafter(loop)`` gives each row's node codes ``(B, T - 1)`` and its
            `RowTrees`; it has ``num_nodes`` (``T - 1``), ``tree_depth`` (the trees' at most), ``nodes_per_depth`` (at
            most), ``draft_passes`` per round, ``start(loop)`` (after the prompt pass), ``report(shapes)``,
            ``buffers()`` and ``set_bound(committed)`` (a host bound on any row's committed codes before a round).
            The other arguments are `DeviceLoop`'s.
    """

    def __init__(self, backbone: SpatialBackbone, drafter, sampling: SamplingConfig, seeds: torch.Tensor,
                 prefix: PromptEmbeddings, cache: StaticKVCache, round_fn: Optional[Callable] = None,
                 rule: AcceptanceRule = EXACT, neighbours: Optional[torch.Tensor] = None):
        self.drafter, self.num_nodes, self.max_codes = drafter, drafter.num_nodes + 1, drafter.tree_depth + 1
        self.eol_slots = self.eol_slot_count(backbone.layout, drafter.nodes_per_depth)
        self.draft_passes_per_round = drafter.draft_passes
        super().__init__(backbone, sampling, seeds, prefix, cache, round_fn, rule, neighbours)

    @staticmethod
    def fed_slots(layout, drafter, **_) -> int:
        """Slots a round feeds per row, before the loop is made (the cache's size)."""
        return drafter.num_nodes + 1 + TreeLoop.eol_slot_count(layout, drafter.nodes_per_depth)

    def new_state(self, **common) -> "DynamicTreeState":
        device, rows = common["tokens"].device, self.cache.num_rows
        return DynamicTreeState(
            path=torch.zeros(rows, self.path_slots, dtype=torch.long, device=device),
            kept=torch.zeros(rows, dtype=torch.long, device=device),  # the prompt pass left nothing to move
            features=torch.zeros(rows, self.max_codes, self.hidden_size, dtype=self.hidden_dtype, device=device),
            fresh=torch.zeros(self.batch_size, dtype=torch.long, device=device),
            tree_shapes=torch.zeros(*common["accepted"].shape, 2, dtype=torch.long, device=device), **common)

    @classmethod
    def default_round(cls) -> Callable:
        return dynamic_tree_round

    def start_rows(self, first: torch.Tensor, hidden: torch.Tensor) -> None:
        self.state.features[:, 0].copy_(hidden)  # the prompt's last features predicted the first code (every row)
        self.state.fresh.fill_(1)
        self.drafter.start(self)

    def report(self) -> Dict[str, float]:
        rounds = self.state.accepted[1 : self.num_rounds + 1] > 0  # (rounds, B) the rows' active rounds
        return self.drafter.report(self.state.tree_shapes[1 : self.num_rounds + 1][rounds])  # (M, 2)

    def step(self) -> None:
        # the newest code of the fastest row is at most this far along (the target cache's bound, less the prompt)
        self.drafter.set_bound(min(self.bound - self.prefix_length + 1, self.layout.num_tokens))
        super().step()


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
    logits = loop.guided(logits)  # (B, L + 1, V)
    samples = keyed_sample(logits, sampling, s.seeds, codes.clamp_max(n - 1))  # (B, L + 1)
    # 4. the accepted count: the first sample, then one more per leading draft equal to the sample at its position (a
    #    relaxed rule: LANTERN's test of each draft against its proposal, `relaxed_chain`)
    probs = logits_to_probs(logits, sampling) if loop.rule.relaxes else None  # (B, L + 1, V)
    if probs is not None:
        commit, matches = relaxed_chain(loop, probs, codes.clamp_max(n - 1))  # (B, L + 1), (B,)
    else:
        commit, matches = samples, (s.drafts == samples[:, :window]).long().cumprod(1).sum(1)  # (B,)
    accepted = torch.minimum(1 + matches, n - s.committed) * active  # (B,) 0 once finished
    # 5. commit the run; the slots past it write the spare column N
    taken = loop.code_offsets < accepted[:, None]  # (B, L + 1)
    target = torch.where(taken, codes, n)  # (B, L + 1)
    s.tokens.scatter_(1, target, torch.where(taken, commit, -1))
    s.acceptance_map.scatter_(1, target, torch.where(taken, accepted[:, None], 0))
    s.rounds.add_(1)
    s.accepted.index_copy_(0, s.rounds.clamp_max(n)[None], accepted[None])
    committed = s.committed + accepted  # (B,)
    s.last.copy_(torch.where(active, commit.gather(1, (accepted - 1).clamp_min(0)[:, None])[:, 0], s.last))
    # 6. the next drafts: this pass's samples after the run, then the code one row above (the newest where none)
    if window:
        next_drafts(loop, samples, accepted, committed, probs)
    # 7. each cache row keeps the fed slots up to its newest code (a prefix), its CFG twin the same
    kept = (layout.sequence_offset(committed - 1) - start) * active  # (B,) = accepted without EOLs
    s.committed.copy_(committed)
    cache.keep_prefixes(kept.repeat(2) if sampling.do_cfg else kept)


def next_drafts(loop: ChainLoop, samples: torch.Tensor, accepted: torch.Tensor, committed: torch.Tensor,
                probs: Optional[torch.Tensor]) -> None:
    """Step 6 of a chain round: each row's next drafts are this pass's samples ``(B, L + 1)`` for the positions after
    its ``accepted`` codes, then the code one row above each later position (the newest code where none is decoded);
    with ``probs`` ``(B, L + 1, V)`` (a relaxed rule) each draft's proposal too: the ``p`` it was drawn from, a point
    mass for a copy."""
    s, window, n = loop.state, loop.window, loop.layout.num_tokens
    source = accepted[:, None] + loop.draft_offsets  # (B, L) code slot whose sample is the draft's
    redrawn = samples.gather(1, source.clamp_max(window))  # (B, L)
    above = committed[:, None] + loop.draft_offsets - loop.layout.width  # (B, L) grid index one row above each draft
    known = (above >= 0) & (above < committed[:, None])
    copied = torch.where(known, s.tokens.gather(1, above.clamp(0, n)), s.last[:, None])  # (B, L)
    s.drafts.copy_(torch.where(source <= window, redrawn, copied))
    if probs is not None:
        drawn_from = probs.gather(1, source.clamp_max(window)[..., None].expand(-1, -1, probs.shape[-1]))  # (B, L, V)
        s.q.copy_(torch.where((source <= window)[..., None], drawn_from, one_hot(copied, probs.shape[-1])))


def relaxed_chain(loop: ChainLoop, probs: torch.Tensor, index: torch.Tensor):
    """Step 4 of a chain round under a relaxed rule (LANTERN, LANTERN++): draft ``k`` (code ``x``, drawn from its
    proposal ``q``) is accepted when a keyed uniform ``u < p~_x(x) / q(x)``; the position of the first rejected draft
    takes a keyed draw from ``norm(max(p~_x - q, 0))``, and a row that accepts every draft a draw from the next
    position's ``p``: speculative sampling of the relaxed target ``p~``.

    Why keyed streams of their own (`ACCEPT_STREAM`, `RESIDUAL_STREAM`): a draft is the keyed sample of its proposal,
    drawn with the target's noise for that position; testing it against that same noise would couple the two and move
    more than the rule allows. A position is tested once (it is committed then), and nothing tested before it read
    its noise, so given what came before, ``x ~ q`` and the uniform and the draw are fresh.

    Args:
        probs (`torch.Tensor` `(B, L + 1, V)`): the pass's ``p`` at every code slot.
        index (`torch.LongTensor` `(B, L + 1)`): the grid index each slot predicts (clamped to the grid).

    Returns the codes each slot commits ``(B, L + 1)`` (the drafts, then the draw; read up to the accepted count) and
    the accepted drafts per row ``(B,)``.
    """
    s, rule, window = loop.state, loop.rule, loop.window
    relaxed = rule.relax(probs[:, :window], s.drafts, loop.neighbours)  # (B, L) the drafts' claims
    qx = s.q.gather(2, s.drafts[..., None])[..., 0]  # (B, L)
    u = keyed_uniform(s.seeds ^ ACCEPT_STREAM, index[:, :window])  # (B, L)
    matches = (u * qx < relaxed.mass).long().cumprod(1).sum(1)  # (B,) u < min(1, p~/q) without dividing
    rest = (relaxed.target(probs[:, :window], s.drafts) - s.q).clamp_min(0)  # (B, L, V)
    rest = torch.where(rest.sum(-1, keepdim=True) > 0, rest, probs[:, :window])  # p~ == q: never rejected anyway
    rest = torch.cat([rest, probs[:, window:]], 1)  # (B, L + 1, V) past the window: the next position's p
    left = rest.gather(1, matches[:, None, None].expand(-1, 1, rest.shape[-1]))  # (B, 1, V)
    drawn = keyed_sample(left.log(), UNIT_SAMPLING, s.seeds ^ RESIDUAL_STREAM, index.gather(1, matches[:, None]))  # (B, 1)
    commit = torch.cat([s.drafts, drawn], 1)  # (B, L + 1)
    return torch.where(loop.code_offsets < matches[:, None], commit, drawn), matches


def head_tree_round(loop: HeadTreeLoop) -> None:
    """One round of a head tree (`HeadTreeLoop`) on device tensors only: draft, one target pass, keyed samples, the
    deepest node whose path matches them, commit, and the path's cache slots moved to the row's first ones."""
    s, backbone = loop.state, loop.backbone
    active = s.committed < loop.layout.num_tokens  # (B,)
    # 0. the last round's accepted path moves to its rows' first slots, before this pass writes or reads the cache
    loop.cache.keep_paths(s.path, s.kept)
    # 1. draft the tree's nodes from the hidden state that predicted each row's newest code (-1: none offered)
    fed = torch.cat([s.last[:, None], loop.drafter(backbone, s.hidden, s.committed)], 1)  # (B, T) the root first
    # 2-5. verify and commit (`verify_tree_round`)
    hidden, path, accepted = verify_tree_round(loop, fed, loop.tree_tables, active)  # (R, T, D), (B, D + 1), (B,)
    # 6. the heads' next input: the hidden state of the node that predicted the newest code (conditional rows)
    node = path.gather(1, (accepted - 1).clamp_min(0)[:, None])  # (B, 1)
    picked = hidden[: loop.batch_size].gather(1, node[..., None].expand(-1, -1, hidden.shape[-1]))[:, 0]  # (B, D)
    s.hidden.copy_(torch.where(active[:, None], picked, s.hidden))


def dynamic_tree_round(loop: "DynamicTreeLoop") -> None:
    """One round of a drafter that grows each row's own tree (`DynamicTreeLoop`, EAGLE-2) on device tensors only:
    the drafter reads the codes the last round committed with the features that predicted them and grows the trees,
    then one target pass, keyed samples, the deepest matching node, commit, and the features of the accepted path
    kept for the drafter's next round."""
    s = loop.state
    active = s.committed < loop.layout.num_tokens  # (B,)
    # 0. the last round's accepted path moves to its rows' first slots, before this pass writes or reads the cache
    loop.cache.keep_paths(s.path, s.kept)
    # 1. the drafter grows one tree per row (its own cache keeps each row's accepted prefix)
    nodes, tree = loop.drafter(loop)  # (B, T - 1) codes (-1: not offered), `RowTrees`
    fed = torch.cat([s.last[:, None], nodes], 1)  # (B, T) the root first
    # 2-5. verify and commit (`verify_tree_round`)
    tables = tree_tables(tree, loop.node_slots)  # per row
    hidden, path, accepted = verify_tree_round(loop, fed, tables, active)  # (R, T, D), (B, D + 1), (B,)
    # 6. the drafter's next input: every row's (CFG rows too) features of the accepted path, and how many it committed
    path_r = path.repeat(2, 1) if loop.sampling.do_cfg else path  # (R, D + 1)
    s.features.copy_(hidden.gather(1, path_r[..., None].expand(-1, -1, hidden.shape[-1])))  # (R, D + 1, D)
    s.fresh.copy_(accepted)
    s.tree_shapes.index_copy_(0, s.rounds.clamp_max(loop.layout.num_tokens)[None], loop.drafter.shape[None])


def verify_tree_round(loop: TreeLoop, fed: torch.Tensor, tables: "TreeTables", active: torch.Tensor):
    """Steps 2-5 and 7 of a tree round: one target pass over the tree ``fed`` ``(B, T)`` (root first, ``-1``: a node
    not offered) with the tree mask, node ``i`` at the position of grid index (newest + depth; clamped past the grid,
    where nothing is committed), and the EOL slots where the layout has them (`end_of_row_slots`); every node's keyed
    sample; the deepest node whose path matches the samples node by node (a sibling is accepted exactly when it equals
    its parent's sample: `verify_tree` with a point mass); the samples along it committed; the path's cache slots and
    their count left for the next round's move. Returns the hidden states each node's output stands for ``(R, T, D)``
    (a node that ends a row: its EOL slot's), the accepted path ``(B, D + 1)`` (padded with its last node) and the
    codes each row committed ``(B,)``."""
    s, backbone, sampling, cache, layout = loop.state, loop.backbone, loop.sampling, loop.cache, loop.layout
    n = layout.num_tokens
    newest = s.committed[:, None] - 1 + tables.depths  # (B, T) the grid index each node drafts (the root: the newest)
    offsets = layout.sequence_offset(newest.clamp_max(n - 1))  # (B, T)
    predicts = newest + 1  # (B, T) the grid index each fed slot's output predicts
    codes = fed.clamp_min(0)  # (B, T) a slot with no candidate is fed as code 0 and never accepted
    embeds = backbone.embed_image_tokens(codes.repeat(2, 1) if sampling.do_cfg else codes)  # (R, T, D)
    mask = tables.mask  # (T, T) or (B, T, T)
    if layout.has_eol:  # the EOL slots after the nodes that end a row
        eol = end_of_row_slots(loop, tables, s.committed)
        offsets, predicts = torch.cat([offsets, eol.offsets], 1), torch.cat([predicts, eol.predicts], 1)  # (B, T + E)
        eol_embeds = backbone.eol_embedding.to(embeds.dtype).expand(embeds.shape[0], loop.eol_slots, -1)
        embeds, mask = torch.cat([embeds, eol_embeds], 1), eol.mask  # (R, T + E, D), (B, T + E, T + E)
    position_ids = loop.first_position + offsets.clamp_max(layout.sequence_length - 1)  # (B, T (+ E))
    position_ids = position_ids.repeat(2, 1) if sampling.do_cfg else position_ids  # (R, T (+ E))
    mask = mask.repeat(2, 1, 1) if sampling.do_cfg and mask.dim() == 3 else mask
    hidden = backbone.forward(embeds, position_ids, mask, None, cache)  # (R, T (+ E), D)
    logits = backbone.image_logits(hidden)  # (R, T (+ E), V) fp32
    # 3. CFG mix and every slot's keyed sample, then the sample each node's output stands for (a row end: its EOL's)
    logits = loop.guided(logits)  # (B, T (+ E), V)
    samples = keyed_sample(logits, sampling, s.seeds, predicts.clamp_max(n - 1))  # (B, T (+ E))
    if layout.has_eol:
        samples = samples.gather(1, eol.predictor)  # (B, T)
        predictor = eol.predictor.repeat(2, 1) if sampling.do_cfg else eol.predictor  # (R, T)
        hidden = hidden.gather(1, predictor[..., None].expand(-1, -1, hidden.shape[-1]))  # (R, T, D)
    # 4. a node matches when it equals its parent's sample (a relaxed rule: when the sample lies in the node's claim);
    #    the accepted node is the deepest whose path all matches
    if loop.rule.relaxes:
        predictor = eol.predictor if layout.has_eol else None
        matches = relaxed_matches(loop.rule, loop.neighbours, node_probs(logits, sampling, predictor), fed, samples, tables)
    else:
        matches = (fed == samples.gather(1, tables.parents.expand_as(fed))) | tables.is_root  # (B, T)
    path, depth = deepest_match(tables, matches)  # (B, D + 1), (B,)
    accepted = torch.minimum(depth + 1, n - s.committed) * active  # (B,) 0 once finished
    below = torch.cat([path[:, 1:], path[:, -1:]], 1)  # (B, D + 1) each code: an accepted node, then the last one's sample
    codes = torch.where(loop.code_offsets < depth[:, None], fed.gather(1, below), samples.gather(1, path))  # (B, D + 1)
    # 5. commit the run; the slots past it write the spare column N
    taken = loop.code_offsets < accepted[:, None]  # (B, D + 1)
    target = torch.where(taken, s.committed[:, None] + loop.code_offsets, n)  # (B, D + 1)
    s.tokens.scatter_(1, target, torch.where(taken, codes, -1))
    s.acceptance_map.scatter_(1, target, torch.where(taken, accepted[:, None], 0))
    s.rounds.add_(1)
    s.accepted.index_copy_(0, s.rounds.clamp_max(n)[None], accepted[None])
    last = (accepted - 1).clamp_min(0)[:, None]  # (B, 1)
    s.last.copy_(torch.where(active, codes.gather(1, last)[:, 0], s.last))
    # 7. each cache row keeps the path's slots (and a crossed row end's EOL slot), moved by the next round (step 0)
    kept_path, kept = (path_with_end_of_row(loop, eol, path, accepted) if layout.has_eol else (path, accepted))
    s.committed.add_(accepted)
    s.path.copy_(kept_path.repeat(2, 1) if sampling.do_cfg else kept_path)
    s.kept.copy_(kept.repeat(2) if sampling.do_cfg else kept)
    return hidden, path, accepted


def deepest_match(tables: "TreeTables", matches: torch.Tensor):
    """The deepest node whose every ancestor matches, per row (``matches`` ``(B, T)``): its root-to-node slots
    ``(B, D + 1)`` (padded with the node) and its depth ``(B,)``. One matmul counts the misses on each node's path."""
    misses = (~matches).float()[:, None] @ tables.ancestors.transpose(-1, -2)  # (B, 1, T) misses on each node's path
    best = ((misses[:, 0] == 0) * tables.score).argmax(1)  # (B,)
    paths = tables.paths.expand(matches.shape[0], -1, -1)  # (B, T, D + 1)
    path = paths.gather(1, best[:, None, None].expand(-1, 1, paths.shape[-1]))[:, 0]  # (B, D + 1)
    return path, tables.depths.expand_as(matches).gather(1, best[:, None])[:, 0]


def node_probs(logits: torch.Tensor, sampling: SamplingConfig, predictor: Optional[torch.Tensor]) -> torch.Tensor:
    """``p`` of every tree node's output ``(B, T, V)`` from the mixed logits of every fed slot ``(B, T (+ E), V)``: with
    end-of-row slots, a node that ends a row stands for its EOL slot's output (``predictor`` ``(B, T)``)."""
    if predictor is not None:
        logits = logits.gather(1, predictor[..., None].expand(-1, -1, logits.shape[-1]))  # (B, T, V)
    return logits_to_probs(logits, sampling)


def relaxed_matches(rule: AcceptanceRule, neighbours: Optional[torch.Tensor], probs: torch.Tensor, fed: torch.Tensor,
                    samples: torch.Tensor, tables: "TreeTables") -> torch.Tensor:
    """Which nodes a relaxed rule (LANTERN, LANTERN++) accepts, for point-mass candidates: node ``i`` (code ``x``)
    matches when its parent's keyed sample ``y`` lies in ``x``'s claim, ``{x}`` and the neighbours it keeps, reckoned
    on the parent's ``p`` less the claims of the siblings tried before it (whose TVD budget it shares).

    Why this is LANTERN: ``y ~ p``, so sibling ``i`` is accepted, given its earlier siblings were not, with its claim
    on the residual, and a row that accepts none keeps ``y``, distributed as the residual left after every sibling:
    `verify_tree_sequential`'s walk, with ``y`` the only randomness. Siblings never both match: an earlier claim's codes
    have no mass left, so ``y`` among them fails the later ones. Returns ``(B, T)`` bool (the root always matches).

    Args:
        probs (`torch.Tensor` `(B, T, V)`): the distribution each node's output gives its children.
        fed (`torch.LongTensor` `(B, T)`): the nodes' codes (``-1``: none offered), root first.
        samples (`torch.LongTensor` `(B, T)`): each node's keyed sample from ``probs``.
    """
    b, t, v = probs.shape
    parents = tables.parents.expand(b, t)  # (B, T)
    x, y = fed.clamp_min(0), samples.gather(1, parents)  # (B, T) each node's code and its parent's sample
    offered = (fed >= 0) & tables.valid & ~tables.is_root  # (B, T)
    rank, spare = tables.rank.expand(b, t), torch.full_like(parents, t)
    # per parent (row T: a spare the untried nodes write to): p less its tried children's claims, the TVD they used
    # (in units of p) and the mass of p the residual stands for
    residual = torch.cat([probs, probs.new_zeros(b, 1, v)], 1)  # (B, T + 1, V)
    spent, scale = probs.new_zeros(b, t + 1), probs.new_ones(b, t + 1)  # (B, T + 1)
    matches = tables.is_root.expand(b, t)
    for r in range(tables.max_siblings):  # the r-th child of every parent at once (at most one per parent)
        tried = offered & (rank == r)  # (B, T)
        p = residual.gather(1, parents[..., None].expand(b, t, v))  # (B, T, V) the parent's residual
        spent_p, scale_p = spent.gather(1, parents), scale.gather(1, parents)  # (B, T)
        relaxed = rule.relax(p, x, neighbours, rule.budget_left(spent_p, scale_p))
        claimed = y == x
        if relaxed.kept is not None:
            claimed = claimed | ((relaxed.neighbours == y[..., None]) & relaxed.kept).any(-1)
        live = p.gather(2, y[..., None])[..., 0] > 0  # y lies in no earlier sibling's claim
        matches = matches | (tried & claimed & live)
        rest = relaxed.removed(p, x)  # (B, T, V) what the next sibling is tried against, unnormalised
        total, spent_next, scale_next = relaxed.rejected(rest, spent_p, scale_p)  # (B, T) each
        dest = torch.where(tried, parents, spare)[..., None]  # (B, T, 1)
        nxt = rest / total.clamp_min(1e-30)[..., None]  # all zero once a claim took the rest: no later sibling lives
        residual = residual.scatter(1, dest.expand(b, t, v), nxt)
        spent, scale = spent.scatter(1, dest[..., 0], spent_next), scale.scatter(1, dest[..., 0], scale_next)
    return matches


@dataclass
class EndOfRowSlots:
    """A round's EOL slots (`end_of_row_slots`), per row.

    Args:
        depth (`torch.LongTensor` `(B,)`): the depth whose code ends a row (meaningful where ``ends``).
        ends (`torch.BoolTensor` `(B,)`): a row end (not the grid's last) falls within the tree.
        predictor (`torch.LongTensor` `(B, T)`): the fed slot whose output predicts the code after each node: the
            node itself, or its EOL slot ``T + j``.
        offsets (`torch.LongTensor` `(B, E)`), predicts (`torch.LongTensor` `(B, E)`): each EOL slot's sequence offset
            and the grid index its output predicts.
        mask (`torch.BoolTensor` `(B, T + E, T + E)`): the tree mask with the EOL slots.
    """

    depth: torch.Tensor
    ends: torch.Tensor
    predictor: torch.Tensor
    offsets: torch.Tensor
    predicts: torch.Tensor
    mask: torch.Tensor


def end_of_row_slots(loop: TreeLoop, tables: "TreeTables", committed: torch.Tensor) -> EndOfRowSlots:
    """Per row, the EOL slots of a tree round: the nodes at the depth whose code ends a row take EOL slot ``j`` each
    (in node order; the tree is shallower than a row, so at most one depth does). An EOL slot sits one sequence
    position after its node's code, sees that node and its ancestors, and is seen by the node's descendants; its
    output predicts the next row's first code. Unused slots see only themselves and no node sees them."""
    layout, t, e = loop.layout, loop.num_nodes, loop.eol_slots
    b, n = committed.shape[0], layout.num_tokens
    newest = committed - 1  # (B,)
    depth = layout.width - 1 - newest % layout.width  # (B,) the depth whose code ends the newest code's row
    ends = (newest // layout.width < layout.height - 1) & (depth < loop.max_codes)  # (B,)
    depths = tables.depths.expand(b, t)  # (B, T)
    at_end = (depths == depth[:, None]) & ends[:, None] & tables.valid  # (B, T)
    rank = at_end.long().cumsum(1) - 1  # (B, T) the node's EOL slot
    at_end = at_end & (rank < e)
    node = loop.node_slots.expand(b, t)  # (B, T)
    owner = torch.full((b, e + 1), -1, dtype=torch.long, device=committed.device)  # (B, E + 1) a spare column
    owner = owner.scatter(1, torch.where(at_end, rank, e), torch.where(at_end, node, -1))[:, :e]  # (B, E) -1: unused
    used, owner0 = owner >= 0, owner.clamp_min(0)
    ancestors = tables.mask.expand(b, t, t)  # (B, T, T) [i, j]: j is i or an ancestor of i
    # node i sees EOL slot j when the slot's node is a strict ancestor of i; the slot sees its node's ancestors
    sees = ancestors.gather(2, owner0[:, None, :].expand(b, t, e)) & (node[:, :, None] != owner0[:, None, :]) & used[:, None, :]
    seen = ancestors.gather(1, owner0[:, :, None].expand(b, e, t)) & used[:, :, None]  # (B, E, T)
    mask = torch.cat([torch.cat([ancestors, sees], 2), torch.cat([seen, loop.eol_eye.expand(b, e, e)], 2)], 1)
    end_code = (newest + depth).clamp_max(n - 1)  # (B,) the code that ends the row
    offsets = (layout.sequence_offset(end_code) + 1)[:, None].expand(b, e)  # (B, E) the EOL's own position
    return EndOfRowSlots(depth=depth, ends=ends, predictor=torch.where(at_end, t + rank, node),
                         offsets=offsets, predicts=(end_code + 1)[:, None].expand(b, e), mask=mask)


def path_with_end_of_row(loop: TreeLoop, eol: EndOfRowSlots, path: torch.Tensor, accepted: torch.Tensor):
    """The cache slots a row keeps: its accepted path's ``accepted`` nodes, with the EOL slot after the node that
    ends a row when the path reaches it (the sequence has the EOL there). Returns ``(slots (B, D + 2), count (B,))``."""
    offsets, d = loop.path_offsets, eol.depth[:, None]  # (D + 2,), (B, 1)
    crossed = eol.ends & (eol.depth < accepted)  # (B,) the kept nodes include the row's last code
    source = torch.where(offsets <= d, offsets, offsets - 1).clamp_max(path.shape[1] - 1)  # (B, D + 2)
    shifted = path.gather(1, source)  # the path, one later after the row end
    end_node = path.gather(1, d.clamp_max(path.shape[1] - 1))  # (B, 1)
    shifted = torch.where(offsets == d + 1, eol.predictor.gather(1, end_node), shifted)  # its EOL slot
    padded = torch.cat([path, path[:, -1:]], 1)  # (B, D + 2)
    return torch.where(crossed[:, None], shifted, padded), accepted + crossed.long()


@dataclass
class TreeTables:
    """What verifying a tree reads, for one tree ``(T, ...)`` shared by every row (`HeadTreeLoop`) or one per row
    ``(B, T, ...)`` (`DynamicTreeLoop`).

    Args:
        depths (`torch.LongTensor` `(T,)` or `(B, T)`): node depths (root 0).
        mask (`torch.BoolTensor` `(T, T)` or `(B, T, T)`): each node sees itself and its ancestors.
        parents (`torch.LongTensor`): each node's parent (the root and padding: itself's slot 0, never read as a
            match: ``is_root`` or a missing candidate).
        is_root (`torch.BoolTensor` `(T,)`): the root, always accepted.
        ancestors (`torch.Tensor` float): ``[.., i, j]`` is 1 when ``j`` is ``i`` or an ancestor (a matmul counts misses).
        paths (`torch.LongTensor` `(T, D + 1)` or `(B, T, D + 1)`): root-to-node slots, padded with the node itself.
        score (`torch.LongTensor`): > 0 for a node that may be accepted, deeper first; 0 for padding.
        valid (`torch.BoolTensor` `(T,)` or `(B, T)`): real nodes (padding is not).
        rank (`torch.LongTensor` `(T,)` or `(B, T)`): a node's place among its siblings (tried in that order).
        max_siblings (`int`): a bound on any node's children (host int).
    """

    depths: torch.Tensor
    mask: torch.Tensor
    parents: torch.Tensor
    is_root: torch.Tensor
    ancestors: torch.Tensor
    paths: torch.Tensor
    score: torch.Tensor
    valid: torch.Tensor
    rank: torch.Tensor
    max_siblings: int


def tree_tables(tree, slots: torch.Tensor) -> TreeTables:
    """`TreeTables` of a `DraftTree` (built once per generation) or of `RowTrees` (every round, on the device);
    ``slots`` is ``0 .. T - 1`` ``(T,)``. The deepest matching node wins; siblings never both match (distinct
    candidates against one sample)."""
    t = tree.num_nodes
    node = slots[None, :, None] if tree.per_row else slots[:, None]  # a node's own slot pads its path
    valid = tree.valid if tree.per_row else torch.ones_like(slots, dtype=torch.bool)
    return TreeTables(depths=tree.depths, mask=tree.attention_mask, parents=tree.parents.clamp_min(0), is_root=slots == 0,
                      ancestors=tree.attention_mask.float(), paths=torch.where(tree.node_paths < 0, node, tree.node_paths),
                      score=((tree.depths + 1) * t - slots) * valid, valid=valid,
                      rank=tree.earlier_siblings.sum(-1), max_siblings=tree.max_children)


def compile_round(round_fn: Callable = None, fullgraph: bool = True, **options) -> Callable[[DeviceLoop], None]:
    """A round function (`chain_round` by default, or `head_tree_round`) compiled whole
    (``torch.compile(fullgraph=True)``): one graph per batch, draft shape and attended length. Under CUDA graphs
    (``mode="reduce-overhead"``) each round is a new graph step."""
    round_fn = round_fn or chain_round
    # a copy of the function with its own code object: dynamo keeps graphs, and counts them against its recompile
    # limit, per code object, so each compiled pipeline gets its own rather than sharing one with every other
    own = types.FunctionType(round_fn.__code__.replace(), round_fn.__globals__, round_fn.__name__)
    compiled = torch.compile(own, fullgraph=fullgraph, **options)
    graphs = options.get("mode") in ("reduce-overhead", "max-autotune")

    def run(loop: DeviceLoop) -> None:
        if graphs and loop.cache.storage.device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()
        with eager_target(loop.backbone.target_module):  # the module is traced inside this graph, not called compiled
            compiled(loop)

    return run


def state_tensors(state: DeviceState) -> List[torch.Tensor]:
    """The state's tensors (their ``data_ptr`` must not change from round to round)."""
    return [getattr(state, f.name) for f in fields(state)]
