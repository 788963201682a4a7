"""Verification of draft trees on device tensors, for every round of the engine (docs/design.md, "Acceptance rules"):
fixed shapes, no host read, by any acceptance rule (`acceptance.py`).

Under keyed noise (or greedy) every node has the target's keyed sample after it, and a point-mass candidate is accepted
exactly when it equals its parent's sample (AR's image for a seed); the round commits the deepest node whose every
ancestor matched (`deepest_match`) and the samples along it. A relaxed rule's siblings, and candidates drawn from kept
proposals (SJD-PAC's), are tried one after another, each on its parent's ``p`` less what the siblings tried before it
took (`sibling_matches`). A chain's drafts drawn from kept proposals are tested by speculative sampling
(`spatial_pipelines.pipelines.device_chain.relaxed_chain`). The sequential walk they are tested against lives in the
tests (``tests/helpers/walks.py``).
"""

from dataclasses import dataclass
from typing import Optional

import torch

from .acceptance import AcceptanceRule
from .sampling import ACCEPT_STREAM, keyed_uniform


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


def deepest_match(tables: "TreeTables", matches: torch.Tensor):
    """The deepest node whose every ancestor matches, per row (``matches`` ``(B, T)``): its root-to-node slots
    ``(B, D + 1)`` (padded with the node) and its depth ``(B,)``. One matmul counts the misses on each node's path."""
    misses = (~matches).float()[:, None] @ tables.ancestors.transpose(-1, -2)  # (B, 1, T) misses on each node's path
    best = ((misses[:, 0] == 0) * tables.score).argmax(1)  # (B,)
    paths = tables.paths.expand(matches.shape[0], -1, -1)  # (B, T, D + 1)
    path = paths.gather(1, best[:, None, None].expand(-1, 1, paths.shape[-1]))[:, 0]  # (B, D + 1)
    return path, tables.depths.expand_as(matches).gather(1, best[:, None])[:, 0]


def sibling_matches(rule: AcceptanceRule, neighbours: Optional[torch.Tensor], probs: torch.Tensor, fed: torch.Tensor,
                    tables: TreeTables, seeds: torch.Tensor, index: torch.Tensor, samples: Optional[torch.Tensor] = None,
                    q: Optional[torch.Tensor] = None):
    """Which nodes the walk accepts, sibling after sibling (`verify_tree_sequential`'s walk, every parent at once):
    each child is tried on its parent's ``p`` (``p~``: a relaxed rule's claim) less what its earlier siblings'
    rejections took (sharing a relaxed rule's TVD budget), none after a sibling that was accepted.

    - ``samples`` (point-mass candidates and a rule whose claim names its codes, LANTERN's): node ``x`` is accepted
      when its parent's keyed sample ``y`` lies in its claim. ``y ~ p``, so a sibling is accepted, given its earlier
      siblings were not, with its claim on the residual, and a row that accepts none keeps ``y``, distributed as the
      residual: the only randomness is ``y`` (siblings never both match: an earlier claim's codes have no mass left).
    - else a keyed uniform per sibling (`ACCEPT_STREAM`, keyed by grid index and rank): ``u < p'(x) / q(x)`` with
      ``q`` each node's proposal ``(B, T, V)`` (SJD-PAC's candidates, drawn without replacement) or a point mass; a
      rejection leaves ``norm(max(p' - q, 0))``; the code after the run is a draw from the last node's residual.

    Args:
        probs (`torch.Tensor` `(B, T, V)`): the distribution each node's output gives its children.
        fed (`torch.LongTensor` `(B, T)`): the nodes' codes (``-1``: none offered), root first.
        seeds (`torch.LongTensor` `(B,)`), index (`torch.LongTensor` `(B, T)`): the rows' seeds and the grid index
            each node's output predicts (the uniforms' keys).

    Returns ``(matches (B, T) bool, the root always; every node's p less its rejected children (B, T, V))``."""
    b, t, v = probs.shape
    parents = tables.parents.expand(b, t)  # (B, T)
    x = fed.clamp_min(0)  # (B, T) each node's code
    offered = (fed >= 0) & tables.valid & ~tables.is_root  # (B, T)
    rank, spare = tables.rank.expand(b, t), torch.full_like(parents, t)
    if samples is not None:
        y = samples.gather(1, parents)  # (B, T) the parent's sample
    else:  # one uniform per sibling of each grid index
        u = keyed_uniform(seeds ^ ACCEPT_STREAM, index.gather(1, parents) * tables.max_siblings + rank)  # (B, T)
        qx = 1.0 if q is None else q.gather(2, x[..., None])[..., 0]  # (B, T)
    # per parent (row T: a spare the untried nodes write to): p less its rejected children, the TVD they used (in
    # units of p), the mass of p the residual stands for, and whether a child was accepted
    residual = torch.cat([probs, probs.new_zeros(b, 1, v)], 1)  # (B, T + 1, V)
    spent, scale = probs.new_zeros(b, t + 1), probs.new_ones(b, t + 1)  # (B, T + 1)
    taken = torch.zeros(b, t + 1, dtype=torch.bool, device=probs.device)  # (B, T + 1)
    matches = tables.is_root.expand(b, t)
    for r in range(tables.max_siblings):  # the r-th child of every parent at once (at most one per parent)
        tried = offered & (rank == r) & ~taken.gather(1, parents)  # (B, T)
        p = residual.gather(1, parents[..., None].expand(b, t, v))  # (B, T, V) the parent's residual
        spent_p, scale_p = spent.gather(1, parents), scale.gather(1, parents)  # (B, T)
        relaxed = rule.relax(p, x, neighbours, rule.budget_left(spent_p, scale_p))
        if samples is not None:
            claimed = y == x
            if relaxed.kept is not None:
                claimed = claimed | ((relaxed.neighbours == y[..., None]) & relaxed.kept).any(-1)
            claimed = claimed & (p.gather(2, y[..., None])[..., 0] > 0)  # y lies in no earlier sibling's claim
        else:
            claimed = u * qx < relaxed.mass  # u < min(1, p~(x) / q(x)) without dividing
        hit = tried & claimed
        matches = matches | hit
        rest = relaxed.removed(p, x) if q is None else (relaxed.target(p, x) - q).clamp_min(0)  # (B, T, V)
        total, spent_next, scale_next = relaxed.rejected(rest, spent_p, scale_p)  # (B, T) each
        dest = torch.where(tried, parents, spare)[..., None]  # (B, T, 1)
        nxt = torch.where(total[..., None] > 0, rest / total.clamp_min(1e-30)[..., None], p)  # nothing left: never rejected
        residual = residual.scatter(1, dest.expand(b, t, v), nxt)
        spent, scale = spent.scatter(1, dest[..., 0], spent_next), scale.scatter(1, dest[..., 0], scale_next)
        taken = taken.scatter(1, torch.where(hit, parents, spare), hit)
    return matches, residual[:, :t]
