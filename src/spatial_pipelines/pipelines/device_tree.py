"""Tree decoders' rounds run whole on the device (shared parts: `device_loop.DeviceLoop`).

A head tree (`HeadTreeLoop`) drafts a static tree of the draft heads' candidates (Medusa's top-k, Hawk's pools) from
the hidden state that predicted each row's newest code; a grown tree (`DynamicTreeLoop`) comes from a drafter with its
own cache (`EagleDrafter`) that grows one tree per row (`RowTrees`). Both are verified alike (`verify_tree_round`):
the deepest node whose path matches the keyed samples node by node is accepted (a sibling when it equals its
parent's sample; under a relaxed rule when that sample lies in the node's claim, `sibling_matches`), the samples
along it are committed, and the cache moves the path's slots (and the EOL slots it crossed, `device_eol`) to the
row's first ones (`StaticKVCache.keep_paths`)."""

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch

from ..core.acceptance import EXACT, AcceptanceRule
from ..core.kv_cache import StaticKVCache
from ..core.verification import TreeTables, deepest_match, sibling_matches, tree_tables
from ..core.sampling import RESIDUAL_STREAM, SamplingConfig, keyed_sample, logits_to_probs
from .backbone import PromptEmbeddings, SpatialBackbone
from .device_chain import UNIT_SAMPLING
from .device_eol import EndOfRowSlots, end_of_row_slots, eol_slot_count, path_slot_count, path_with_end_of_row
from .device_loop import DeviceLoop, DeviceState, commit_run, record_progress


@dataclass
class HeadTreeState(DeviceState):
    """`DeviceState` plus the hidden state the heads draft from.

    Args:
        hidden (`torch.Tensor` `(B, D)`): per row, the pre-norm hidden state that predicted its newest code.
        path (`torch.LongTensor` `(R, P)`), kept (`torch.LongTensor` `(R,)`): per cache row, the fed slots of the last
            round's accepted path (and the EOL slots it crossed) and how many it keeps, moved by the next round.
    """

    hidden: torch.Tensor
    path: torch.Tensor
    kept: torch.Tensor


@dataclass
class DynamicTreeState(DeviceState):
    """`DeviceState` plus what a drafter that grows per-row trees reads (`DynamicTreeLoop`).

    Args:
        path (`torch.LongTensor` `(R, P)`), kept (`torch.LongTensor` `(R,)`): as `HeadTreeState`'s.
        features (`torch.Tensor` `(R, D + 1, D)`): per cache row, the pre-norm hidden states that predicted the codes
            the last round committed (after the prompt pass: the prompt's last, in slot 0).
        fresh (`torch.LongTensor` `(B,)`): codes the last round committed per row (not read by the drafter yet).
        tree_shapes (`torch.LongTensor` `(N + 1, B, 2)`): per round, each row's kept tree depth and its ``k``.
    """

    path: torch.Tensor
    kept: torch.Tensor
    features: torch.Tensor
    fresh: torch.Tensor
    tree_shapes: torch.Tensor


class TreeLoop(DeviceLoop):
    """What the tree loops share: ``T`` tree nodes per row, then (with end-of-row tokens) ``E`` EOL slots (a host bound,
    `eol_slots_of`); the accepted path's cache slots (``P``: its nodes and the EOL slots it crossed) moved by the next
    round. A subclass sets ``num_nodes`` (``T``), ``max_codes`` and ``eol_slots`` before `DeviceLoop.__init__`."""

    def __init__(self, backbone: SpatialBackbone, sampling: SamplingConfig, seeds: torch.Tensor, prefix: PromptEmbeddings,
                 cache: StaticKVCache, round_fn: Optional[Callable] = None, rule: AcceptanceRule = EXACT,
                 neighbours: Optional[torch.Tensor] = None):
        self.fed = self.num_nodes + self.eol_slots
        self.path_slots = path_slot_count(backbone.layout, self.max_codes)  # each crossed row end keeps its EOL slot
        self.hidden_size, self.hidden_dtype = prefix.embeds.shape[-1], prefix.embeds.dtype
        super().__init__(backbone, sampling, seeds, prefix, cache, round_fn, rule, neighbours)
        device = prefix.embeds.device
        self.node_slots = self.slots[: self.num_nodes]  # (T,)
        self.eol_eye = torch.eye(self.eol_slots, dtype=torch.bool, device=device)  # (E, E) an EOL slot sees itself

    @staticmethod
    def eol_slots_of(layout, drafter, num_nodes: int) -> int:
        """EOL slots a round of the drafter's trees (``num_nodes`` nodes) feeds (`eol_slot_count`), from the nodes per
        depth at most: a static tree's ``depth_counts``, or ``nodes_per_depth`` below the root."""
        counts = getattr(drafter, "depth_counts", None)
        counts = tuple(counts) if counts is not None else (1,) + (drafter.nodes_per_depth,) * drafter.tree_depth
        return min(num_nodes, eol_slot_count(layout, counts))

    def extra_buffers(self) -> List[torch.Tensor]:
        return self.drafter.buffers()


class HeadTreeLoop(TreeLoop):
    """A static tree of draft-head candidates (Medusa, Hawk: a `TreeRound`'s drafter).

    Args:
        drafter (`HeadDrafter`): drafts the tree's nodes from each row's hidden state; the rest are `DeviceLoop`'s.
    """

    def __init__(self, backbone: SpatialBackbone, drafter, sampling: SamplingConfig, seeds: torch.Tensor,
                 prefix: PromptEmbeddings, cache: StaticKVCache, round_fn: Optional[Callable] = None,
                 rule: AcceptanceRule = EXACT, neighbours: Optional[torch.Tensor] = None):
        tree = drafter.tree
        self.drafter, self.num_nodes, self.max_codes = drafter, tree.num_nodes, tree.max_depth + 1
        self.eol_slots = self.eol_slots_of(backbone.layout, drafter, self.num_nodes)
        super().__init__(backbone, sampling, seeds, prefix, cache, round_fn, rule, neighbours)
        self.tree_tables = tree_tables(tree, self.node_slots)  # the static tree's, built once

    @staticmethod
    def fed_slots(layout, drafter, **_) -> int:
        """Slots a round feeds per row, before the loop is made (the cache's size)."""
        num_nodes = drafter.tree.num_nodes
        return num_nodes + TreeLoop.eol_slots_of(layout, drafter, num_nodes)

    def new_state(self, **common) -> HeadTreeState:
        device, rows = common["tokens"].device, self.cache.num_rows
        return HeadTreeState(
            hidden=torch.zeros(self.batch_size, self.hidden_size, dtype=self.hidden_dtype, device=device),
            path=torch.zeros(rows, self.path_slots, dtype=torch.long, device=device),
            kept=torch.zeros(rows, dtype=torch.long, device=device), **common)  # the prompt pass left nothing to move

    draft_passes_per_round = 1  # the heads

    @classmethod
    def default_round(cls) -> Callable:
        return head_tree_round

    def start_rows(self, first: torch.Tensor, hidden: torch.Tensor) -> None:
        self.state.hidden.copy_(hidden[: self.batch_size])  # the conditional rows' (the heads read no CFG twin)


class DynamicTreeLoop(TreeLoop):
    """A drafter that grows each row's own tree every round (EAGLE-2: a `TreeRound` drafter with ``per_row_trees``).

    Args:
        drafter (`EagleDrafter`): ``drafter(loop)`` gives each row's node codes ``(B, T - 1)`` and its `RowTrees`; it
            has ``num_nodes`` (``T - 1``), ``tree_depth``, ``nodes_per_depth`` (at most), ``draft_passes`` per round,
            ``start(loop)``, ``report(shapes)``, ``buffers()`` and ``set_bound(committed)`` (a host bound).
        The other arguments are `DeviceLoop`'s.
    """

    def __init__(self, backbone: SpatialBackbone, drafter, sampling: SamplingConfig, seeds: torch.Tensor,
                 prefix: PromptEmbeddings, cache: StaticKVCache, round_fn: Optional[Callable] = None,
                 rule: AcceptanceRule = EXACT, neighbours: Optional[torch.Tensor] = None):
        self.drafter, self.num_nodes, self.max_codes = drafter, drafter.num_nodes + 1, drafter.tree_depth + 1
        self.eol_slots = self.eol_slots_of(backbone.layout, drafter, self.num_nodes)
        self.draft_passes_per_round = drafter.draft_passes
        super().__init__(backbone, sampling, seeds, prefix, cache, round_fn, rule, neighbours)

    @staticmethod
    def fed_slots(layout, drafter, **_) -> int:
        """Slots a round feeds per row, before the loop is made (the cache's size)."""
        num_nodes = drafter.num_nodes + 1
        return num_nodes + TreeLoop.eol_slots_of(layout, drafter, num_nodes)

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


def head_tree_round(loop: HeadTreeLoop) -> None:
    """One round of a head tree (`HeadTreeLoop`) on device tensors only: draft, verify and commit
    (`verify_tree_round`), then the hidden state the heads read next."""
    s, backbone = loop.state, loop.backbone
    active = s.committed < loop.layout.num_tokens  # (B,)
    # 0. the last round's accepted path moves to its rows' first slots, before this pass writes or reads the cache
    with loop.timer.section("kv"):  # `profile_rounds` in an eager round (a compiled round keeps no sections)
        loop.cache.keep_paths(s.path, s.kept)
    # 1. draft the tree's nodes from the hidden state that predicted each row's newest code (-1: none offered)
    with loop.timer.section("draft"):
        fed = torch.cat([s.last[:, None], loop.drafter(backbone, s.hidden, s.committed)], 1)  # (B, T) the root first
    # 2-5. verify and commit (`verify_tree_round`)
    hidden, path, accepted = verify_tree_round(loop, fed, loop.tree_tables, active)  # (R, T, D), (B, D + 1), (B,)
    # 6. the heads' next input: the hidden state of the node that predicted the newest code (conditional rows)
    node = path.gather(1, (accepted - 1).clamp_min(0)[:, None])  # (B, 1)
    picked = hidden[: loop.batch_size].gather(1, node[..., None].expand(-1, -1, hidden.shape[-1]))[:, 0]  # (B, D)
    s.hidden.copy_(torch.where(active[:, None], picked, s.hidden))


def dynamic_tree_round(loop: "DynamicTreeLoop") -> None:
    """One round of a drafter that grows each row's own tree (`DynamicTreeLoop`, EAGLE-2) on device tensors only: grow
    the trees, verify and commit (`verify_tree_round`), keep the accepted path's features for the drafter."""
    s = loop.state
    active = s.committed < loop.layout.num_tokens  # (B,)
    # 0. the last round's accepted path moves to its rows' first slots, before this pass writes or reads the cache
    with loop.timer.section("kv"):  # `profile_rounds` in an eager round (a compiled round keeps no sections)
        loop.cache.keep_paths(s.path, s.kept)
    # 1. the drafter grows one tree per row (its own cache keeps each row's accepted prefix)
    with loop.timer.section("draft"):
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
    """Steps 2-5 and 7 of a tree round over the tree ``fed`` ``(B, T)`` (root first, ``-1``: not offered): the pass
    (`tree_pass`), every node's keyed sample, the deepest node whose path matches them (a sibling when it equals its
    parent's sample), the samples along it committed (`commit_path`). Returns the hidden states each node's output
    stands for ``(R, T, D)``, the accepted path ``(B, D + 1)`` (padded with its last node) and the committed counts
    ``(B,)``."""
    s, sampling, n = loop.state, loop.sampling, loop.layout.num_tokens
    eol, hidden, logits, predicts = tree_pass(loop, fed, tables)
    with loop.timer.section("accept"):
        # 3. every slot's keyed sample, then the sample each node's output stands for (a row end: its EOL's)
        samples = keyed_sample(logits, sampling, s.seeds, predicts.clamp_max(n - 1))  # (B, T (+ E))
        predictor = eol.predictor if eol is not None else None  # (B, T)
        if predictor is not None:
            samples = samples.gather(1, predictor)  # (B, T)
        # 4. a node matches when it equals its parent's sample (a relaxed rule: when the sample lies in the node's claim);
        #    the accepted node is the deepest whose path all matches
        if loop.rule.relaxes:
            index = predicts.clamp_max(n - 1)  # (B, T (+ E)) the grid index each slot's output predicts
            index = index.gather(1, predictor) if predictor is not None else index  # (B, T)
            named = samples if loop.rule.claims_neighbours else None  # a claim one sample of p decides
            matches, left = sibling_matches(loop.rule, loop.neighbours, node_probs(logits, sampling, predictor), fed,
                                            tables, s.seeds, index, samples=named)
            if named is None:  # a claim naming no codes: the deepest node's code is a draw from its residual
                samples = keyed_sample(left.log(), UNIT_SAMPLING, s.seeds ^ RESIDUAL_STREAM, index)  # (B, T)
        else:
            matches = (fed == samples.gather(1, tables.parents.expand_as(fed))) | tables.is_root  # (B, T)
        path, depth = deepest_match(tables, matches)  # (B, D + 1), (B,)
        _, accepted = commit_path(loop, fed, path, depth, samples.gather(1, path), active, eol)
    return hidden, path, accepted


def tree_pass(loop: TreeLoop, fed: torch.Tensor, tables: "TreeTables"):
    """Steps 1-3 of a tree round's pass: the EOL slots (`device_eol.end_of_row_slots`), one target pass
    (`tree_forward`), the CFG mix. Returns the EOL slots (or ``None``), the hidden states each node's output stands for
    ``(R, T, D)``, the mixed logits of every fed slot ``(B, T (+ E), V)`` and the grid index each predicts."""
    eol = None
    if loop.layout.has_eol:  # the EOL slots after the nodes that end a row
        with loop.timer.section("eol"):
            eol = end_of_row_slots(loop, tables, loop.state.committed)
    with loop.timer.section("forward"):
        hidden, logits, predicts = tree_forward(loop, fed, tables, eol)  # (R, T (+ E), D), (R, T (+ E), V)
    if eol is not None:
        predictor = eol.predictor.repeat(2, 1) if loop.sampling.do_cfg else eol.predictor  # (R, T)
        hidden = hidden.gather(1, predictor[..., None].expand(-1, -1, hidden.shape[-1]))  # (R, T, D)
    return eol, hidden, loop.guided(logits), predicts


def commit_path(loop: TreeLoop, fed: torch.Tensor, path: torch.Tensor, depth: torch.Tensor, bonus: torch.Tensor,
                active: torch.Tensor, eol: Optional[EndOfRowSlots]):
    """Steps 5 and 7 of a tree round: commit the accepted ``path`` ``(B, D + 1)`` (``depth`` ``(B,)`` deep): its nodes'
    codes in ``fed`` ``(B, T)``, then ``bonus``, the code after the deepest; each cache row keeps the path's slots (and
    the EOL slots it crossed) for the next round to move. Returns the codes ``(B, D + 1)`` and the counts ``(B,)``."""
    s, sampling = loop.state, loop.sampling
    below = torch.cat([path[:, 1:], path[:, -1:]], 1)  # (B, D + 1) each code: an accepted node, then the bonus
    codes = torch.where(loop.code_offsets < depth[:, None], fed.gather(1, below), bonus)  # (B, D + 1)
    accepted = commit_run(loop, codes, depth, active)  # (B,) 0 once finished
    kept_path, kept = path_with_end_of_row(loop, eol, path, accepted) if eol is not None else (path, accepted)
    s.committed.add_(accepted)
    record_progress(s)
    s.path.copy_(kept_path.repeat(2, 1) if sampling.do_cfg else kept_path)
    s.kept.copy_(kept.repeat(2) if sampling.do_cfg else kept)
    return codes, accepted


def tree_forward(loop: TreeLoop, fed: torch.Tensor, tables: "TreeTables", eol: Optional["EndOfRowSlots"]):
    """Step 2 of a tree round: the nodes ``fed`` ``(B, T)`` (and the EOL slots ``eol``) at their positions with the tree
    mask, one target pass. Returns the hidden states ``(R, T (+ E), D)``, their logits ``(R, T (+ E), V)`` fp32 and the
    grid index each slot's output predicts ``(B, T (+ E))``."""
    s, backbone, sampling, cache, layout = loop.state, loop.backbone, loop.sampling, loop.cache, loop.layout
    n = layout.num_tokens
    newest = s.committed[:, None] - 1 + tables.depths  # (B, T) the grid index each node drafts (the root: the newest)
    offsets = layout.sequence_offset(newest.clamp_max(n - 1))  # (B, T)
    predicts = newest + 1  # (B, T) the grid index each fed slot's output predicts
    codes = fed.clamp_min(0)  # (B, T) a slot with no candidate is fed as code 0 and never accepted
    embeds = backbone.embed_image_tokens(codes.repeat(2, 1) if sampling.do_cfg else codes)  # (R, T, D)
    mask = tables.mask  # (T, T) or (B, T, T)
    if eol is not None:
        offsets, predicts = torch.cat([offsets, eol.offsets], 1), torch.cat([predicts, eol.predicts], 1)  # (B, T + E)
        eol_embeds = backbone.eol_embedding.to(embeds.dtype).expand(embeds.shape[0], loop.eol_slots, -1)
        embeds, mask = torch.cat([embeds, eol_embeds], 1), eol.mask  # (R, T + E, D), (B, T + E, T + E)
    position_ids = loop.first_position + offsets.clamp_max(layout.sequence_length - 1)  # (B, T (+ E))
    position_ids = position_ids.repeat(2, 1) if sampling.do_cfg else position_ids  # (R, T (+ E))
    mask = mask.repeat(2, 1, 1) if sampling.do_cfg and mask.dim() == 3 else mask
    hidden = backbone.forward(embeds, position_ids, mask, None, cache)  # (R, T (+ E), D)
    logits = backbone.image_logits(hidden)  # (R, T (+ E), V) fp32
    return hidden, logits, predicts


def node_probs(logits: torch.Tensor, sampling: SamplingConfig, predictor: Optional[torch.Tensor]) -> torch.Tensor:
    """``p`` of every tree node's output ``(B, T, V)`` from the mixed logits of every fed slot ``(B, T (+ E), V)``: with
    end-of-row slots, a node that ends a row stands for its EOL slot's output (``predictor`` ``(B, T)``)."""
    if predictor is not None:
        logits = logits.gather(1, predictor[..., None].expand(-1, -1, logits.shape[-1]))  # (B, T, V)
    return logits_to_probs(logits, sampling)
