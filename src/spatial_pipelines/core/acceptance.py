"""Exact acceptance of draft trees (DESIGN.md section 5), batched and free of host syncs.

Every candidate carries a proposal distribution ``q``. A candidate produced deterministically (top-k, copied,
cached) is a point mass, and the rule reduces to "accept with ``p(x)``, else zero ``p[x]`` and renormalise".
Siblings are tried in order, each with its own ``q``; a rejection replaces ``p`` by the residual
``norm(max(p - q, 0))``. When every sibling fails, or a leaf is reached, one code is drawn from what is left.
Either way the committed codes follow the target distribution exactly.
"""

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from .sampling import RandomSource
from .tree import DraftTree


@dataclass
class TreeAcceptance:
    """Result of verifying one tree per row.

    Args:
        path (`torch.LongTensor` `(B, D + 1)`): accepted node indices from the root (column 0), ``-1`` after the
            last accepted node.
        num_accepted (`torch.LongTensor` `(B,)`): accepted drafts (root excluded).
        bonus (`torch.LongTensor` `(B,)`): the code drawn after the last accepted node.
        last_node (`torch.LongTensor` `(B,)`): the last accepted node (whose output gave ``bonus``).
    """

    path: torch.Tensor
    num_accepted: torch.Tensor
    bonus: torch.Tensor
    last_node: torch.Tensor


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``norm(max(p - q, 0))`` row-wise; a row with nothing left keeps ``p`` (cannot happen for exact use)."""
    r = (p - q).clamp_min(0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp_min(1e-30), p)


def verify_tree(
    tree: DraftTree,
    tokens: torch.Tensor,
    probs: torch.Tensor,
    random: RandomSource,
    q: Optional[torch.Tensor] = None,
    distinct_siblings: bool = False,
) -> TreeAcceptance:
    """Walk every row's tree from the root, accepting candidates exactly.

    Vectorised over every node at once (no loop over depths or siblings) when the candidates are point masses
    (``q is None``: top-k, copied or cached drafts) or the tree is a chain (each node has at most one child);
    other trees with a known ``q`` per node fall back to `verify_tree_sequential`, whose residuals chain from
    sibling to sibling.

    Args:
        tree (`DraftTree`): the shared tree shape.
        tokens (`torch.LongTensor` `(B, T)`): the code at every node (node 0: the root, not verified); ``-1``
            marks a node that this row does not offer (an empty or duplicate pool slot): it is skipped.
        probs (`torch.Tensor` `(B, T, V)`): target distribution after each node (fp32).
        random (`RandomSource`): draws ``(B, T - 1 + V)`` uniforms per call (fixed shape): one per node, and the
            exponentials of the bonus draw.
        q (`torch.Tensor` `(B, T, V)`, *optional*): each node's proposal distribution; ``None`` means point masses.
        distinct_siblings (`bool`): the caller guarantees that no two offered siblings carry the same code (top-k
            candidates, de-duplicated pools), which skips the duplicate check.
    """
    if q is not None and tree.max_children > 1:
        return verify_tree_sequential(tree, tokens, probs, random, q)
    b, t, v = probs.shape
    if t == 1:  # nothing drafted: the bonus is a plain draw from the root's p
        noise = -torch.log(random.uniform(v))  # (B, V) Exp(1); u = 0 gives inf: that code scores 0, never NaN
        bonus = (probs[:, 0] / noise).argmax(-1)
        zero = torch.zeros(b, dtype=torch.long, device=probs.device)
        return TreeAcceptance(path=zero[:, None], num_accepted=zero, bonus=bonus, last_node=zero)
    rows = torch.arange(b, device=probs.device)
    draws = random.uniform(t - 1 + v)  # (B, T - 1 + V): one random call per round
    u, noise = draws[:, : t - 1], -torch.log(draws[:, t - 1 :])  # (B, T-1) uniforms, (B, V) Exp(1)
    if tree.max_children == 1:
        return _verify_chain(tokens, probs, u, noise, q, rows)
    parents = tree.parents[1:]  # (T-1,)
    x = tokens[:, 1:]  # (B, T-1) candidate of every node
    siblings = tree.earlier_siblings[1:, 1:]  # (T-1, T-1)
    valid = x >= 0
    if not distinct_siblings:
        # a candidate that repeats an earlier sibling's code is offered nothing: after that sibling's rejection p(x) = 0
        valid = valid & ~((x[:, :, None] == x[:, None, :]) & siblings & (x[:, None, :] >= 0)).any(-1)  # (B, T-1)
    xs = x.clamp_min(0)
    # p(x) under the parent's distribution, read straight from the flat (B, T*V) view: no (B, T-1, V) copy
    px = probs.reshape(b, t * v).gather(1, parents * v + xs) * valid  # (B, T-1)
    if q is None:
        # point masses: after rejecting earlier siblings s, p is renormalised over 1 - sum p(s)
        left = 1.0 - (px[:, None, :] * siblings).sum(-1)  # (B, T-1) mass not taken by earlier siblings
        accept = valid & (u * left < px)  # u < p(x) / left, without dividing
    else:
        # a chain: one candidate per node, accepted with min(1, p/q)
        qx = q[:, 1:].gather(-1, xs[..., None]).squeeze(-1)  # (B, T-1)
        accept = valid & (u * qx < px)
    # a node is taken when it is the first accepted sibling and every ancestor was taken too
    first = accept & ~((accept[:, None, :] & siblings).any(-1))  # (B, T-1)
    above = tree.attention_mask[1:, 1:]  # (T-1, T-1) ancestors-or-self below the root
    taken = ~((above & ~first[:, None, :]).any(-1))  # (B, T-1)
    depth = torch.where(taken, tree.depths[1:], 0)  # (B, T-1)
    num_accepted, deepest = depth.max(-1)  # taken nodes form one path: its deepest node ends it
    last = torch.where(num_accepted > 0, deepest + 1, 0)  # (B,)
    path = tree.node_paths[last]  # (B, D + 1)
    # the bonus: from the last node's p, less what its children (all tried and rejected) took
    p_last = probs[rows, last]  # (B, V)
    kids = tree.children[last]  # (B, K) -1 where there is no such child
    node_valid = torch.cat([valid.new_zeros(b, 1), valid], 1)  # (B, T) the root is never a child
    kid_valid = (kids >= 0) & node_valid.gather(1, kids.clamp_min(0))
    if q is None:
        kid_codes = torch.where(kid_valid, tokens.gather(1, kids.clamp_min(0)), 0)  # (B, K)
        removed = torch.zeros_like(p_last).scatter_add_(1, kid_codes, kid_valid.to(p_last.dtype)) > 0  # (B, V)
        p_left = p_last.masked_fill(removed, 0.0)
    else:
        q_kid = q[rows, kids[:, 0].clamp_min(0)]  # (B, V) a chain: at most one child
        p_left = torch.where(kid_valid[:, :1], (p_last - q_kid).clamp_min(0), p_last)
    p_left = torch.where(p_left.sum(-1, keepdim=True) > 0, p_left, p_last)  # nothing left: cannot happen exactly
    bonus = (p_left / noise).argmax(-1)  # exponential race: a draw from p_left (no normalising needed)
    return TreeAcceptance(path=path, num_accepted=num_accepted, bonus=bonus, last_node=last)


def _verify_chain(tokens, probs, u, noise, q, rows) -> TreeAcceptance:
    """`verify_tree` for a chain (node ``i`` at depth ``i``): the same rule with no siblings, in a third of the ops
    (an SJD window pays this every round)."""
    b, t, v = probs.shape
    x = tokens[:, 1:]  # (B, T-1)
    valid = x >= 0
    xs = x.clamp_min(0)
    px = probs[:, :-1].gather(-1, xs[..., None]).squeeze(-1)  # (B, T-1) p of each draft after the node before it
    qx = 1.0 if q is None else q[:, 1:].gather(-1, xs[..., None]).squeeze(-1)
    accept = valid & (u * qx < px)  # u < min(1, p/q) without dividing
    num_accepted = accept.long().cumprod(-1).sum(-1)  # (B,) the accepted run from the root
    last = num_accepted  # a chain's node index is its depth
    path = torch.arange(t, device=probs.device).expand(b, t)
    path = torch.where(path <= last[:, None], path, -1)  # (B, T)
    p_last = probs[rows, last]  # (B, V)
    rejected = last < t - 1  # a draft after the last node was tried and rejected (or not offered)
    nxt = (last + 1).clamp_max(t - 1)
    if q is None:
        code = xs[rows, nxt - 1]
        hit = rejected & valid[rows, nxt - 1]
        p_left = torch.where(hit[:, None] & (torch.arange(v, device=probs.device) == code[:, None]), 0.0, p_last)
    else:
        hit = (rejected & valid[rows, nxt - 1])[:, None]
        p_left = torch.where(hit, (p_last - q[rows, nxt]).clamp_min(0), p_last)
    p_left = torch.where(p_left.sum(-1, keepdim=True) > 0, p_left, p_last)  # nothing left: cannot happen exactly
    bonus = (p_left / noise).argmax(-1)  # exponential race: a draw from p_left
    return TreeAcceptance(path=path, num_accepted=num_accepted, bonus=bonus, last_node=last)


def verify_tree_sequential(
    tree: DraftTree,
    tokens: torch.Tensor,
    probs: torch.Tensor,
    random: RandomSource,
    q: Optional[torch.Tensor] = None,
) -> TreeAcceptance:
    """`verify_tree` by walking the tree depth by depth and sibling by sibling, applying each rejected sibling's
    residual ``norm(max(p - q, 0))`` before the next is tried: the general rule for siblings drawn from
    different proposals, and the reference the vectorised walk is tested against.

    ``random`` draws ``(B, D, K)`` uniforms and ``(B, V)`` exponentials per call.
    """
    b, t, v = probs.shape
    depth, k = tree.max_depth, tree.children.shape[1]
    rows = torch.arange(b, device=probs.device)
    uniforms = random.uniform(max(depth, 1), k)  # (B, D, K)
    cur = torch.zeros(b, dtype=torch.long, device=probs.device)  # (B,) current node
    alive = torch.ones(b, dtype=torch.bool, device=probs.device)  # still walking
    path = torch.full((b, depth + 1), -1, dtype=torch.long, device=probs.device)
    path[:, 0] = 0
    p_left = probs[:, 0]  # (B, V) what the bonus is drawn from
    for d in range(depth):
        p = probs[rows, cur]  # (B, V)
        moved = torch.zeros(b, dtype=torch.bool, device=probs.device)
        nxt = cur.clone()
        for j in range(k):
            node = tree.children[cur, j]  # (B,) -1 where there is no such sibling
            safe = node.clamp_min(0)
            valid = alive & ~moved & (node >= 0) & (tokens[rows, safe] >= 0)
            x = torch.where(valid, tokens[rows, safe], 0)  # (B,) code 0 stands in where there is no candidate
            px = p.gather(1, x[:, None]).squeeze(1)
            qx = torch.ones_like(px) if q is None else q[rows, safe].gather(1, x[:, None]).squeeze(1)
            accept = valid & (uniforms[:, d, j] * qx < px)  # u < min(1, p/q) without dividing
            nxt = torch.where(accept, safe, nxt)
            moved |= accept
            reject = valid & ~accept
            q_node = torch.nn.functional.one_hot(x, v).to(p.dtype) if q is None else q[rows, safe]
            p = torch.where(reject[:, None], residual(p, q_node), p)
        # rows that stop here draw the bonus from their residual; rows that moved go one level down
        stop = alive & ~moved
        p_left = torch.where(stop[:, None], p, p_left)
        cur = torch.where(moved, nxt, cur)
        path[:, d + 1] = torch.where(moved, nxt, torch.full_like(nxt, -1))
        alive &= moved
    p_left = torch.where(alive[:, None], probs[rows, cur], p_left)  # reached the deepest level
    bonus = (p_left / random.exponential(v)).argmax(-1)  # exponential race: a draw from p_left
    num_accepted = (path[:, 1:] >= 0).sum(-1)
    return TreeAcceptance(path=path, num_accepted=num_accepted, bonus=bonus, last_node=cur)


def accept_independently(
    tokens: torch.Tensor, probs: torch.Tensor, random: RandomSource, q: Optional[torch.Tensor] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Test every drafted position on its own (SSD's "verification as auto-correction"): accept ``x`` with
    ``min(1, p(x) / q(x))``, otherwise replace it by a draw from ``norm(max(p - q, 0))``.

    Each position's result follows its ``p`` exactly *given the context it was evaluated in*; positions do not
    wait for their left neighbours, which is what makes the rule lossy for the joint distribution.

    Args:
        tokens (`torch.LongTensor` `(B, n)`): drafted codes.
        probs (`torch.Tensor` `(B, n, V)`): target distribution at each position (fp32).
        random (`RandomSource`): draws ``(B, n)`` uniforms and ``(B, n, V)`` exponentials per call.
        q (`torch.Tensor` `(B, n, V)`, *optional*): the distribution each code was drawn from; ``None`` means
            point masses (argmax or copied drafts).

    Returns:
        ``(codes (B, n), accepted (B, n) bool)``.
    """
    uniforms = random.uniform(tokens.shape[1])  # (B, n)
    px = probs.gather(-1, tokens[..., None]).squeeze(-1)  # (B, n)
    qx = torch.ones_like(px) if q is None else q.gather(-1, tokens[..., None]).squeeze(-1)
    accepted = uniforms * qx < px  # u < min(1, p/q) without dividing
    q_full = torch.nn.functional.one_hot(tokens, probs.shape[-1]).to(probs.dtype) if q is None else q
    left = residual(probs, q_full)  # (B, n, V)
    redrawn = (left / random.exponential(*left.shape[1:])).argmax(-1)  # (B, n) exponential race
    return torch.where(accepted, tokens, redrawn), accepted
