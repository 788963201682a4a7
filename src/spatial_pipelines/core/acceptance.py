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
) -> TreeAcceptance:
    """Walk every row's tree from the root, accepting candidates exactly.

    Args:
        tree (`DraftTree`): the shared tree shape.
        tokens (`torch.LongTensor` `(B, T)`): the code at every node (node 0: the root, not verified); ``-1``
            marks a node that this row does not offer (an empty or duplicate pool slot): it is skipped.
        probs (`torch.Tensor` `(B, T, V)`): target distribution after each node (fp32).
        random (`RandomSource`): draws ``(B, D, K)`` uniforms and ``(B, V)`` exponentials per call (fixed shapes).
        q (`torch.Tensor` `(B, T, V)`, *optional*): each node's proposal distribution; ``None`` means point masses.
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
