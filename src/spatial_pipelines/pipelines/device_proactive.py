"""SJD-PAC's proactive drafting run whole on the device (`ProactiveLoop`, `proactive_round`).

The window of ``L`` drafts is a static tree (`decoding_jacobi.proactive_tree`): ``K`` candidates at each of the first
``P`` positions (their Cartesian product, a ``K``-ary tree), then one draft per position after the path of first
candidates. Each position's first candidate is its SJD draft (a redraw from the last pass, a fresh draft by the
decoder's ``init``, anchored or continued as `device_chain` does it); the other ``K - 1`` are drawn without
replacement from the same law by Gumbel top-K on a keyed stream, and kept in the state at fixed addresses.

A round, on device tensors only:

0. the last round's accepted path moves to its rows' first cache slots (`StaticKVCache.keep_paths`);
1. the tree's nodes gathered from the drafts and the candidates (one static index), fed with the tree mask (and the
   end-of-row slots where the layout has them: `device_tree.end_of_row_slots`), one target pass;
2. verification: under keyed noise (or greedy) a node is accepted when it equals its parent's keyed sample, so the
   committed codes are AR's for a seed; under drawn noise or a relaxed rule each position's candidates are tested in
   rank order against their proposals (the position's ``q`` less the earlier candidates: drawn without replacement),
   the parent's ``p`` replaced by its residual after each rejection, on keyed uniforms of the rows' seeds
   (`speculative_matches`); the deepest node whose path is accepted ends the run, and the code after it is the
   parent's keyed sample (keyed) or a keyed draw from its residual (drawn);
3. commit, then the next drafts: this pass's samples at the fed slots along the first-candidate descent below the
   last accepted node (`decoding_jacobi.descent_table`), fresh drafts after them, and the first ``P`` positions'
   other candidates (`draw_alternatives`).
"""

from dataclasses import dataclass
from typing import Callable, List, Optional

import torch

from ..core.acceptance import EXACT, AcceptanceRule
from ..core.kv_cache import StaticKVCache
from ..core.sampling import (PROACTIVE_STREAM, RESIDUAL_STREAM, SamplingConfig, filtered_logits,
                             keyed_gumbel, keyed_sample, logits_to_probs)
from ..decoders.decoding_jacobi import descent_table, proactive_tree
from .backbone import PromptEmbeddings, SpatialBackbone
from .device_chain import UNIT_SAMPLING, ChainState, check_init, anchor_left, continue_drafts, fresh_drafts, predict_above
from .device_eol import eol_slot_count
from ..core.verification import sibling_matches
from .device_tree import TreeLoop, commit_path, deepest_match, tree_pass, tree_tables


def proactive_eol_slots(layout, tree) -> int:
    """EOL slots a round of the candidates' tree feeds per row (`device_eol.eol_slot_count` of its nodes per depth)."""
    return min(tree.num_nodes, eol_slot_count(layout, torch.bincount(tree.depths).tolist()))


@dataclass(kw_only=True)
class ProactiveState(ChainState):
    """`device_chain.ChainState` (``drafts``: each position's first candidate; ``q``, ``raced``, ``above`` as there)
    plus the other candidates and the accepted path.

    Args:
        alternatives (`torch.LongTensor` `(B, P, K - 1)`): the other candidates of the first ``P`` positions, in the
            order they were drawn (``-1``: none, e.g. behind a point mass).
        path (`torch.LongTensor` `(R, L + 1 (+ 1))`), kept (`torch.LongTensor` `(R,)`): per cache row, the fed slots
            of the last round's accepted path and how many it keeps (`device_tree.HeadTreeState`'s).
    """

    alternatives: torch.Tensor
    path: torch.Tensor
    kept: torch.Tensor


class ProactiveLoop(TreeLoop):
    """SJD with proactive drafting (`JacobiDecoder(proactive_width=K > 1)`): `proactive_round`, the module docstring's
    steps.

    Args:
        window (`int`): positions drafted per round (``L``).
        width (`int`): candidates per position at the first ``depth`` positions (``K > 1``).
        depth (`int`): positions with ``K`` candidates (``P``; at most ``L``).
        init, guess, anchor, continuation, proposals: as `device_chain.ChainLoop`'s (the anchor and continuation act
            where proposals are kept: under keyed noise they change no committed code).
        The other arguments are `DeviceLoop`'s.
    """

    def __init__(self, backbone: SpatialBackbone, window: int, width: int, depth: int, sampling: SamplingConfig,
                 seeds: torch.Tensor, prefix: PromptEmbeddings, cache: StaticKVCache, round_fn: Optional[Callable] = None,
                 rule: AcceptanceRule = EXACT, neighbours: Optional[torch.Tensor] = None, init: str = "above",
                 anchor: bool = False, continuation: bool = False, proposals: bool = False, guess: Optional[Callable] = None):
        check_init(init, guess)
        if width < 2 or window < 1:
            raise ValueError(f"Proactive drafting needs `width` >= 2 and a window, got width={width}, window={window}.")
        tree = proactive_tree(window, width, depth)
        self.window, self.width, self.levels = window, width, min(depth, window)
        self.num_nodes, self.max_codes = tree.num_nodes, window + 1
        self.eol_slots = proactive_eol_slots(backbone.layout, tree)
        self.init, self.guess = init, guess
        self.draft_passes_per_round = int(guess is not None)  # the head's
        self.proposals = proposals or rule.relaxes  # speculative sampling against kept proposals
        self.anchor, self.continuation = anchor and self.proposals, continuation and self.proposals
        self.num_codes = v = backbone.num_image_codes
        device = prefix.embeds.device
        # constants of every round, built once (a round allocates nothing it could keep)
        self.uniform_q = torch.full((v,), 1.0 / v, device=device)  # random drafts' proposal
        self.code_range = torch.arange(v, device=device)  # (V,) the codes Gumbel noise is drawn for
        # under keyed noise, a fresh draft's log-weights: uniform for random drafts, else a point mass (nothing more)
        self.fresh_row = torch.full((v,), 0.0 if init == "random" else float("-inf"), device=device)
        super().__init__(backbone, sampling, seeds, prefix, cache, round_fn, rule, neighbours)
        self.draft_offsets = torch.arange(window, device=device)  # (L,)
        self.tables = tree_tables(tree.to(device), self.node_slots)  # the static tree's
        self.descent = descent_table(tree).to(device)  # (T, L + 1) the first-candidate descent below every node
        depths, ranks = tree.depths[1:], tree.ranks[1:].clamp_min(0)  # (T - 1,)
        # where each node's code lies in [drafts, alternatives.flatten()]: its position's draft, or candidate rank - 1
        source = torch.where(ranks == 0, depths - 1, window + (depths - 1) * (width - 1) + ranks - 1)
        self.node_source = source.to(device)  # (T - 1,)
        positions = (depths - 1).clamp_max(self.levels - 1)  # (T - 1,) a chain node reads the last level's (unused)
        # [i, k]: candidate k of node i's position was offered before node i (the exclusions of its proposal)
        self.earlier = (torch.arange(width)[None] < ranks[:, None]).to(device)  # (T - 1, K)
        self.node_position = positions.to(device)

    @staticmethod
    def fed_slots(layout, window: int, width: int, depth: int, **_) -> int:
        """Slots a round feeds per row, before the loop is made (the cache's size)."""
        tree = proactive_tree(window, width, depth)
        return tree.num_nodes + proactive_eol_slots(layout, tree)

    def new_state(self, **common) -> ProactiveState:
        device, b, rows = common["tokens"].device, self.batch_size, self.cache.num_rows
        drafts = torch.zeros(b, self.window, dtype=torch.long, device=device)
        return ProactiveState(
            drafts=drafts,
            alternatives=torch.full((b, self.levels, self.width - 1), -1, dtype=torch.long, device=device),
            path=torch.zeros(rows, self.path_slots, dtype=torch.long, device=device),
            kept=torch.zeros(rows, dtype=torch.long, device=device),  # the prompt pass left nothing to move
            q=torch.zeros(b, self.window, self.num_codes, device=device) if self.proposals else None,
            raced=torch.zeros_like(drafts, dtype=torch.bool) if self.continuation else None,  # first drafts: copies
            above=torch.full_like(common["tokens"], -1) if self.guess is not None else None, **common)

    @classmethod
    def default_round(cls) -> Callable:
        return proactive_round

    def extra_buffers(self) -> List[torch.Tensor]:
        return []

    def start_rows(self, first: torch.Tensor, hidden: torch.Tensor) -> None:
        s = self.state
        if self.guess is not None:  # the prompt's last output predicted the first code: guess the one below it
            predict_above(self, hidden[: self.batch_size, None], first[:, None], torch.ones_like(first), s.committed - 1)
        index = 1 + self.draft_offsets.expand_as(s.drafts)  # (B, L) the grid index of each draft
        codes, q = fresh_drafts(self, index, s.committed, first, s.drafts)  # the first row has nothing above
        s.drafts.copy_(codes)
        if self.proposals:
            s.q.copy_(q)
        levels = index[:, : self.levels]  # (B, P)
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
    (`verification.sibling_matches` with each node's proposal). Child ``x`` of rank ``r`` was drawn from its position's
    ``q`` less the ``r`` candidates before it (renormalised: a draw without replacement), so that is its proposal.

    Why keyed streams of their own (`ACCEPT_STREAM` keyed by grid index and rank): a position's uniforms are read in
    the one round whose walk reaches it (it is committed then), by one parent (the walk visits one node per depth);
    the candidates were drawn from other streams (`draw_alternatives`), so given them the uniforms are fresh.

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
    """Step 3's drafting: the next window after the last accepted node ``last`` ``(B,)`` at depth ``depth`` ``(B,)``.
    A position this pass predicted takes the keyed sample (and ``p``, its proposal) of the fed slot that predicted it
    along the first-candidate descent below ``last``; the rest are fresh (`device_chain.fresh_drafts`); continuation
    and the anchor as `device_chain.next_drafts` applies them; then the other candidates of the first ``P``.

    Args:
        logits (`torch.Tensor` `(B, T, V)`): every node's mixed logits; samples (`torch.LongTensor` `(B, T)`): their keyed
            samples; probs (`torch.Tensor` `(B, T, V)`, *optional*): their ``p``, where proposals are kept.
        committed (`torch.LongTensor` `(B,)`): each row's committed codes after this round.
    """
    s, window, v = loop.state, loop.window, loop.num_codes
    source = depth[:, None] + 1 + loop.draft_offsets  # (B, L) the depth of the slot that predicted each next position
    redrawn_here = source <= window  # (B, L)
    slot = loop.descent[last[:, None], source.clamp_max(window)]  # (B, L) that slot (one past the window: any)
    redrawn = samples.gather(1, slot)  # (B, L)
    # the draft before the first fresh one: the last redraw, or the newest code when every draft was accepted
    before = torch.where(depth < window, redrawn[:, -1], s.last)  # (B,)
    index = committed[:, None] + loop.draft_offsets  # (B, L) the grid index of each next draft
    fresh, q = fresh_drafts(loop, index, committed, before, s.drafts)  # (B, L), (B, L, V) or None
    if probs is not None:
        drawn_from = probs.gather(1, slot[..., None].expand(-1, -1, v))  # (B, L, V)
        if loop.continuation:  # before the drafts and proposals move: the old ones are tested
            redrawn = continue_drafts(loop, redrawn, drawn_from, source, index)
        s.q.copy_(torch.where(redrawn_here[..., None], drawn_from, q))
    s.drafts.copy_(torch.where(redrawn_here, redrawn, fresh))
    if loop.anchor:
        anchor_left(s)
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
    without their first candidate, a draw without replacement from the position's law less that code.

    Under keyed noise ``scores`` ``(B, P, V)`` are the law's log-weights and the noise is the target's own keyed
    stream: the first candidate is the top of that race (where it is a redraw), so the others are its runners-up, the
    codes most likely to be the target's sample if ``p`` moved (any candidates keep the committed codes AR's). With
    kept proposals (``scores`` ``None``) the law is ``q`` and the noise a keyed stream of its own (`PROACTIVE_STREAM`),
    independent of what drew the first candidate (the target's stream, a continuation's or an init's), as an exact
    verification needs."""
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
