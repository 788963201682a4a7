"""SJD-PAC's proactive drafting run whole on the device (`ProactiveLoop`, `proactive_round`).

The window of ``L`` drafts is a static tree (`decoding_jacobi.proactive_tree`): ``K`` candidates at each of the first
``P`` positions (a ``K``-ary tree), then one draft per position after the path of first candidates. A position's
first candidate is its SJD draft (`device_chain.place_drafts`); the other ``K - 1`` are drawn without replacement
from the same law by Gumbel top-K on a keyed stream (`draw_alternatives`). A round, on device tensors only:

0. the last round's accepted path moves to its rows' first cache slots (`StaticKVCache.keep_paths`);
1. the tree's nodes gathered from the drafts and candidates, one target pass (`device_tree.tree_pass`);
2. a node is accepted when it equals its parent's keyed sample (keyed noise, greedy: AR's codes for a seed), or by
   multi-candidate speculative sampling on keyed uniforms (drawn noise, relaxed rules: `speculative_matches`);
3. commit (`device_tree.commit_path`), then the next drafts along the first-candidate descent below the last
   accepted node (`decoding_jacobi.descent_table`) and the other candidates (`next_candidates`)."""

from dataclasses import dataclass
from typing import Callable, List, Optional

import torch

from ..core.acceptance import EXACT, AcceptanceRule
from ..core.kv_cache import StaticKVCache
from ..core.sampling import (PROACTIVE_STREAM, RESIDUAL_STREAM, SamplingConfig, filtered_logits,
                             keyed_gumbel, keyed_sample, logits_to_probs)
from ..decoders.decoding_jacobi import descent_table, proactive_tree
from .backbone import PromptEmbeddings, SpatialBackbone
from .device_chain import UNIT_SAMPLING, ChainDrafts, ChainState, place_drafts, predict_above
from .device_eol import eol_slot_count
from ..core.verification import sibling_matches
from .device_tree import TreeLoop, commit_path, deepest_match, tree_pass, tree_tables


def proactive_eol_slots(layout, tree) -> int:
    """EOL slots a round of the candidates' tree feeds per row (`device_eol.eol_slot_count` of its nodes per depth)."""
    return min(tree.num_nodes, eol_slot_count(layout, torch.bincount(tree.depths).tolist()))


@dataclass(kw_only=True)
class ProactiveState(ChainState):
    """`device_chain.ChainState` (``drafts``: each position's first candidate) plus the other candidates and the path.

    Args:
        alternatives (`torch.LongTensor` `(B, P, K - 1)`): the other candidates of the first ``P`` positions, in the
            order they were drawn (``-1``: none, e.g. behind a point mass).
        path (`torch.LongTensor` `(R, L + 1 (+ 1))`), kept (`torch.LongTensor` `(R,)`): `device_tree.HeadTreeState`'s.
    """

    alternatives: torch.Tensor
    path: torch.Tensor
    kept: torch.Tensor


class ProactiveLoop(ChainDrafts, TreeLoop):
    """SJD with proactive drafting (`JacobiDecoder(proactive_width=K > 1)`): `proactive_round`.

    Args:
        window (`int`): positions drafted per round (``L``).
        width (`int`): candidates per position at the first ``depth`` positions (``K > 1``).
        depth (`int`): positions with ``K`` candidates (``P``; at most ``L``).
        init, guess, anchor, continuation, proposals: as `device_chain.ChainLoop`'s.
        The other arguments are `DeviceLoop`'s.
    """

    def __init__(self, backbone: SpatialBackbone, window: int, width: int, depth: int, sampling: SamplingConfig,
                 seeds: torch.Tensor, prefix: PromptEmbeddings, cache: StaticKVCache, round_fn: Optional[Callable] = None,
                 rule: AcceptanceRule = EXACT, neighbours: Optional[torch.Tensor] = None, init: str = "above",
                 anchor: bool = False, continuation: bool = False, proposals: bool = False, guess: Optional[Callable] = None):
        device = prefix.embeds.device
        self.setup_drafts(backbone, window, rule, init, anchor, continuation, proposals, guess, device)
        if width < 2 or window < 1:
            raise ValueError(f"Proactive drafting needs `width` >= 2 and a window, got width={width}, window={window}.")
        tree = proactive_tree(window, width, depth)
        self.width, self.levels = width, min(depth, window)
        self.num_nodes, self.max_codes = tree.num_nodes, window + 1
        self.eol_slots = proactive_eol_slots(backbone.layout, tree)
        self.code_range = torch.arange(self.num_codes, device=device)  # (V,) the codes Gumbel noise is drawn for
        # under keyed noise, a fresh draft's log-weights: uniform for random drafts, else a point mass (nothing more)
        self.fresh_row = torch.full((self.num_codes,), 0.0 if init == "random" else float("-inf"), device=device)
        super().__init__(backbone, sampling, seeds, prefix, cache, round_fn, rule, neighbours)
        self.tables = tree_tables(tree.to(device), self.node_slots)  # the static tree's
        self.descent = descent_table(tree).to(device)  # (T, L + 1) the first-candidate descent below every node
        positions, ranks = tree.depths[1:] - 1, tree.ranks[1:].clamp_min(0)  # (T - 1,) each node's position and rank
        # where each node's code lies in [drafts, alternatives.flatten()]: its position's draft, or candidate rank - 1
        self.node_source = torch.where(ranks == 0, positions, window + positions * (width - 1) + ranks - 1).to(device)
        # [i, k]: candidate k of node i's position was offered before node i (the exclusions of its proposal)
        self.earlier = (torch.arange(width)[None] < ranks[:, None]).to(device)  # (T - 1, K)
        self.node_position = positions.clamp_max(self.levels - 1).to(device)  # (T - 1,) a chain node: the last level's

    @staticmethod
    def fed_slots(layout, window: int, width: int, depth: int, **_) -> int:
        """Slots a round feeds per row, before the loop is made (the cache's size)."""
        tree = proactive_tree(window, width, depth)
        return tree.num_nodes + proactive_eol_slots(layout, tree)

    def new_state(self, **common) -> ProactiveState:
        device, b, rows = common["tokens"].device, self.batch_size, self.cache.num_rows
        return ProactiveState(
            alternatives=torch.full((b, self.levels, self.width - 1), -1, dtype=torch.long, device=device),
            path=torch.zeros(rows, self.path_slots, dtype=torch.long, device=device),
            kept=torch.zeros(rows, dtype=torch.long, device=device),  # the prompt pass left nothing to move
            **self.draft_fields(common["tokens"]), **common)

    @classmethod
    def default_round(cls) -> Callable:
        return proactive_round

    def extra_buffers(self) -> List[torch.Tensor]:
        return []

    def start_rows(self, first: torch.Tensor, hidden: torch.Tensor) -> None:
        super().start_rows(first, hidden)  # the drafts, then the other candidates of the first P positions
        levels = 1 + self.draft_offsets[: self.levels].expand(self.batch_size, -1)  # (B, P) their grid indices
        draw_alternatives(self, fresh_scores(self, levels.shape), levels)


def proactive_round(loop: ProactiveLoop) -> None:
    """One round of proactive SJD (`ProactiveLoop`), the module docstring's steps, on device tensors only."""
    s, sampling, layout, tables = loop.state, loop.sampling, loop.layout, loop.tables
    n, b = layout.num_tokens, loop.batch_size
    active = s.committed < n  # (B,)
    # 0. the last round's accepted path moves to its rows' first slots, before this pass writes or reads the cache
    with loop.timer.section("kv"):  # `profile_rounds` in an eager round (a compiled round keeps no sections)
        loop.cache.keep_paths(s.path, s.kept)
    # 1. the tree: each node is its position's draft or one of its other candidates; one target pass
    candidates = torch.cat([s.drafts, s.alternatives.flatten(1)], 1)  # (B, L + P (K - 1))
    fed = torch.cat([s.last[:, None], candidates.gather(1, loop.node_source.expand(b, -1))], 1)  # (B, T) root first
    eol, hidden, logits, _ = tree_pass(loop, fed, tables)  # the EOL slots, (R, T, D), (B, T (+ E), V)
    with loop.timer.section("accept"):
        # 2. every node's output (a row end: its EOL slot's) and its keyed sample
        if eol is not None:
            logits = logits.gather(1, eol.predictor[..., None].expand(-1, -1, logits.shape[-1]))  # (B, T, V)
        index = (s.committed[:, None] + tables.depths).clamp_max(n - 1)  # (B, T) the grid index each output predicts
        samples = keyed_sample(logits, sampling, s.seeds, index)  # (B, T)
        probs = logits_to_probs(logits, sampling) if loop.proposals else None  # (B, T, V)
        if probs is not None:
            matches, residual = speculative_matches(loop, probs, fed, index)  # (B, T), (B, T, V)
        else:
            matches, residual = (fed == samples.gather(1, tables.parents.expand_as(fed))) | tables.is_root, None
        path, depth = deepest_match(tables, matches)  # (B, L + 1), (B,)
        last_node = path.gather(1, depth[:, None])  # (B, 1)
        if residual is None:  # keyed: the code after the run is the last node's keyed sample
            bonus = samples.gather(1, last_node)  # (B, 1)
        else:  # drawn: a keyed draw from what its rejected children left
            left = residual.gather(1, last_node[..., None].expand(-1, -1, residual.shape[-1]))  # (B, 1, V)
            bonus = keyed_sample(left.log(), UNIT_SAMPLING, s.seeds ^ RESIDUAL_STREAM, index.gather(1, last_node))
        # 3. commit the run and keep the path's cache slots (`device_tree.commit_path`), then the next drafts
        codes, accepted = commit_path(loop, fed, path, depth, bonus, active, eol)  # (B, L + 1), (B,)
    with loop.timer.section("draft"):
        if loop.guess is not None:  # the head guesses the codes one row below the run, from the path's outputs
            path_hidden = hidden[:b].gather(1, path[..., None].expand(-1, -1, hidden.shape[-1]))  # (B, L + 1, D)
            predict_above(loop, path_hidden, codes, accepted, s.committed - accepted)
        next_candidates(loop, logits, samples, probs, last_node[:, 0], depth, s.committed)


def speculative_matches(loop: ProactiveLoop, probs: torch.Tensor, fed: torch.Tensor, index: torch.Tensor):
    """Step 2 under drawn noise or a relaxed rule: multi-candidate speculative sampling, every parent at once
    (`verification.sibling_matches`). Child ``x`` of rank ``r`` was drawn from its position's ``q`` less the ``r``
    candidates before it (renormalised: a draw without replacement), so that is its proposal. Its uniforms
    (`ACCEPT_STREAM`) are read once, in the round whose walk commits the position, and the candidates came from other
    streams, so they are fresh.

    Args:
        probs (`torch.Tensor` `(B, T, V)`): ``p`` after every node.
        fed (`torch.LongTensor` `(B, T)`): the nodes' codes, root first (``-1``: none offered).
        index (`torch.LongTensor` `(B, T)`): the grid index each node's output predicts (clamped to the grid).

    Returns which nodes are accepted ``(B, T)`` and every node's ``p`` less its rejected children ``(B, T, V)``."""
    s, tables = loop.state, loop.tables
    b, t, v = probs.shape
    q = s.q.gather(1, (tables.depths[1:] - 1)[None, :, None].expand(b, -1, v))  # (B, T - 1, V) the position's q
    levels = torch.cat([s.drafts[:, : loop.levels, None], s.alternatives], 2)  # (B, P, K)
    earlier = torch.where(loop.earlier, levels[:, loop.node_position], -1)  # (B, T - 1, K) offered before the node
    hit = torch.zeros_like(q).scatter_add_(2, earlier.clamp_min(0), (earlier >= 0).float()) > 0  # add: -1s map to 0
    q = q.masked_fill(hit, 0.0)
    q = torch.cat([probs[:, :1], q / q.sum(-1, keepdim=True).clamp_min(1e-30)], 1)  # (B, T, V) the root's: never read
    return sibling_matches(loop.rule, loop.neighbours, probs, fed, tables, s.seeds, index, q=q)


def next_candidates(loop: ProactiveLoop, logits: torch.Tensor, samples: torch.Tensor, probs: Optional[torch.Tensor],
                    last: torch.Tensor, depth: torch.Tensor, committed: torch.Tensor) -> None:
    """Step 3's drafting after the last accepted node ``last`` ``(B,)`` at depth ``depth`` ``(B,)``: a position this
    pass predicted takes the keyed sample (and ``p``) of the slot that predicted it along the first-candidate descent
    below ``last``, the rest fresh drafts (`device_chain.place_drafts`); then the other candidates of the first ``P``.

    Args:
        logits (`torch.Tensor` `(B, T, V)`), samples (`torch.LongTensor` `(B, T)`), probs (`torch.Tensor` `(B, T, V)`,
            *optional*): every node's mixed logits, keyed sample and ``p`` (where proposals are kept).
        committed (`torch.LongTensor` `(B,)`): each row's committed codes after this round.
    """
    s, window, v = loop.state, loop.window, loop.num_codes
    source = depth[:, None] + 1 + loop.draft_offsets  # (B, L) the depth of the slot that predicted each next position
    redrawn_here = source <= window  # (B, L)
    slot = loop.descent[last[:, None], source.clamp_max(window)]  # (B, L) that slot (one past the window: any)
    redrawn = samples.gather(1, slot)  # (B, L)
    # the draft before the first fresh one: the last redraw, or the newest code when every draft was accepted
    before = torch.where(depth < window, redrawn[:, -1], s.last)  # (B,)
    drawn_from = probs.gather(1, slot[..., None].expand(-1, -1, v)) if probs is not None else None  # (B, L, V)
    index = place_drafts(loop, redrawn, drawn_from, source, committed, before)  # (B, L)
    levels = index[:, : loop.levels]  # (B, P)
    if probs is not None:
        scores = None  # the kept proposals, after any anchoring
    else:  # keyed: the candidates race the target's own noise over the pass's filtered logits (greedy: the logits)
        here = slot[:, : loop.levels, None].expand(-1, -1, v)  # (B, P, V)
        chosen = logits.gather(1, here)
        chosen = chosen if loop.sampling.greedy else filtered_logits(chosen, loop.sampling)
        scores = torch.where(redrawn_here[:, : loop.levels, None], chosen, fresh_scores(loop, levels.shape))
    draw_alternatives(loop, scores, levels)


def fresh_scores(loop: ProactiveLoop, shape) -> torch.Tensor:
    """Under keyed noise, the log-weights ``(*shape, V)`` of a fresh draft's law: uniform for random drafts (zeros),
    a point mass otherwise (``-inf``: the draft is all its position offers). With kept proposals: ``None``."""
    return None if loop.proposals else loop.fresh_row.expand(*shape, loop.num_codes)  # a view of one (V,) row


def draw_alternatives(loop: ProactiveLoop, scores: Optional[torch.Tensor], index: torch.Tensor) -> None:
    """The other ``K - 1`` candidates of the first ``P`` positions at grid indices ``index`` ``(B, P)``: Gumbel top-K
    without the first candidate, a draw without replacement from the position's law less that code. Under keyed noise
    ``scores`` ``(B, P, V)`` are the law's log-weights and the noise the target's own stream, so the others are the
    race's runners-up. With kept proposals (``scores`` ``None``) the law is ``q`` and the noise its own stream
    (`PROACTIVE_STREAM`), independent of the first candidate's, as an exact verification needs."""
    s = loop.state
    first = s.drafts[:, : loop.levels, None]  # (B, P, 1)
    keyed = scores is not None
    scores = scores if keyed else s.q[:, : loop.levels].log()  # (B, P, V)
    scores = scores.scatter(2, first, float("-inf"))
    if not loop.sampling.greedy:
        seeds = s.seeds if keyed else s.seeds ^ PROACTIVE_STREAM
        scores = scores + keyed_gumbel(seeds, index.clamp_max(loop.layout.num_tokens - 1)[..., None],
                                       loop.code_range.expand(scores.shape), loop.num_codes)
    top = scores.topk(loop.width - 1, dim=-1)  # (B, P, K - 1)
    s.alternatives.copy_(torch.where(top.values > float("-inf"), top.indices, -1))
