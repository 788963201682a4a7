"""The references the device rounds are tested against, in the tests only: the sequential walk of a draft tree
(`verify_tree_sequential`: siblings tried one by one, each rejection replacing ``p`` by its residual; by any
acceptance rule) and random numbers drawn from generators per row (`RandomSource`)."""

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from spatial_pipelines.core.acceptance import EXACT, AcceptanceRule
from spatial_pipelines.core.tree import DraftTree

GeneratorLike = Union[None, torch.Generator, Sequence[torch.Generator]]


class RandomSource:
    """Random numbers per batch row, reproducible per row: with a list of generators row ``b`` draws only from
    ``generators[b]``, so a batch equals the single runs made with the same generators; with one generator (or none)
    the whole batch draws from it at once.

    Args:
        generator: ``None``, one `torch.Generator`, or one per batch row.
        batch_size (`int`): rows of the batch.
        device (`torch.device`): where the numbers are used.
    """

    def __init__(self, generator: GeneratorLike, batch_size: int, device: torch.device):
        self.generator, self.batch_size, self.device = generator, batch_size, torch.device(device)

    def _draw(self, shape: Sequence[int], fill) -> torch.Tensor:
        if isinstance(self.generator, (list, tuple)):
            rows = [fill(torch.empty(tuple(shape), device=g.device), g) for g in self.generator]
            return torch.stack(rows).to(self.device)  # (B, *shape)
        g = self.generator
        out = torch.empty((self.batch_size, *shape), device=g.device if g is not None else self.device)
        return fill(out, g).to(self.device)

    def uniform(self, *shape: int) -> torch.Tensor:
        """``U[0, 1)`` of shape ``(B, *shape)``."""
        return self._draw(shape, lambda t, g: t.uniform_(0.0, 1.0, generator=g))

    def exponential(self, *shape: int) -> torch.Tensor:
        """``Exp(1)`` of shape ``(B, *shape)``."""
        return self._draw(shape, lambda t, g: t.exponential_(1.0, generator=g))


def sample_from_probs(probs: torch.Tensor, random: RandomSource) -> torch.Tensor:
    """Draw one code per distribution with no host sync: ``probs (B, ..., V)`` -> ``(B, ...)`` long.

    Exponential race: ``argmax_i p_i / E_i`` with ``E_i ~ Exp(1)`` is distributed as ``p``. A point mass
    (greedy) always returns its argmax.
    """
    noise = random.exponential(*probs.shape[1:])  # (B, ..., V)
    return (probs / noise).argmax(dim=-1)


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



def _verify_chain(tokens, probs, u, noise, q, rows, rule=EXACT, neighbours=None) -> TreeAcceptance:
    """`verify_tree` for a chain (node ``i`` at depth ``i``): the same rule with no siblings, in a third of the ops
    (an SJD window pays this every round)."""
    b, t, v = probs.shape
    x = tokens[:, 1:]  # (B, T-1)
    valid = x >= 0
    xs = x.clamp_min(0)
    if not rule.relaxes:
        px = probs[:, :-1].gather(-1, xs[..., None]).squeeze(-1)  # (B, T-1) p of each draft after the node before it
    else:
        relaxed = rule.relax(probs[:, :-1], xs, neighbours)  # claims of every draft at once
        px = relaxed.mass  # (B, T-1)
    qx = 1.0 if q is None else q[:, 1:].gather(-1, xs[..., None]).squeeze(-1)
    accept = valid & (u * qx < px)  # u < min(1, p/q) without dividing
    depths = torch.arange(t, device=probs.device)  # (T,) a chain's node index is its depth
    num_accepted = accept.long().cumprod(-1).sum(-1)  # (B,) the accepted run from the root
    last = num_accepted
    path = depths.expand(b, t)
    path = torch.where(path <= last[:, None], path, -1)  # (B, T)
    p_last = probs[rows, last]  # (B, V)
    rejected = last < t - 1  # a draft after the last node was tried and rejected (or not offered)
    nxt = (last + 1).clamp_max(t - 1)
    code = xs[rows, nxt - 1]  # (B,) the rejected draft (if any)
    hit = (rejected & valid[rows, nxt - 1])[:, None]
    if rule.relaxes:  # p~ of the rejected draft: its kept neighbours' mass moved onto it
        sel = relaxed.select((rows, nxt - 1))
        p_left = sel.removed(p_last, code) if q is None else (sel.target(p_last, code) - q[rows, nxt]).clamp_min(0)
        p_left = torch.where(hit, p_left, p_last)
    elif q is None:
        p_left = torch.where(hit & (torch.arange(v, device=probs.device) == code[:, None]), 0.0, p_last)
    else:
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
    rule: AcceptanceRule = EXACT,
    neighbours: Optional[torch.Tensor] = None,
) -> TreeAcceptance:
    """`verify_tree` by walking the tree depth by depth and sibling by sibling, applying each rejected sibling's
    residual ``norm(max(p~ - q, 0))`` before the next is tried: the general rule for siblings drawn from
    different proposals or claiming under a relaxed rule, and the reference the vectorised walk is tested against.

    Under LANTERN the siblings of one step share its TVD budget ``delta`` (tracked in the units of the step's
    original ``p``): the step's output is ``p`` with every tried sibling's kept mass moved onto it, at TVD
    ``sum moved <= delta`` from ``p``.

    Where the tree ends in a chain (`DraftTree.chain_from`: an SJD-PAC window, a small head tree), the walk goes
    level by level only down to the chain's head and takes the chain in one vectorised step (`_verify_chain`):
    one candidate per level has no sibling residual to carry.

    ``random`` draws ``(B, D, K)`` uniforms and ``(B, V)`` exponentials per call.
    """
    b, t, v = probs.shape
    depth, k = tree.max_depth, tree.children.shape[-1]
    levels = depth if tree.per_row else tree.chain_from  # walked sibling by sibling; the chain below is vectorised
    rows = torch.arange(b, device=probs.device)
    uniforms = random.uniform(max(depth, 1), k)  # (B, D, K)
    cur = torch.zeros(b, dtype=torch.long, device=probs.device)  # (B,) current node
    alive = torch.ones(b, dtype=torch.bool, device=probs.device)  # still walking
    path = torch.full((b, depth + 1), -1, dtype=torch.long, device=probs.device)
    path[:, 0] = 0
    p_left = probs[:, 0]  # (B, V) what the bonus is drawn from
    # 1. level by level: try the current node's children in order; rows that stop draw the bonus from their residual
    for d in range(levels):
        moved, nxt, p = _walk_level(tree, tokens, probs, q, rule, neighbours, uniforms[:, d], rows, cur, alive)
        stop = alive & ~moved
        p_left = torch.where(stop[:, None], p, p_left)
        cur = torch.where(moved, nxt, cur)
        path[:, d + 1] = torch.where(moved, nxt, torch.full_like(nxt, -1))
        alive &= moved
    # 2. the bonus of rows that reached the last walked level (a leaf or the chain head): a draw from its p
    p_left = torch.where(alive[:, None], probs[rows, cur], p_left)
    noise = random.exponential(v)  # (B, V) Exp(1)
    bonus = (p_left / noise).argmax(-1)  # exponential race: a draw from p_left
    # 3. rows at the chain's head go down the chain in one step
    if levels < depth:
        cur, bonus = _walk_chain_tail(tree, tokens, probs, q, rule, neighbours, uniforms[:, levels:, 0], noise, rows,
                                      levels, path, cur, alive, bonus)
    num_accepted = (path[:, 1:] >= 0).sum(-1)
    return TreeAcceptance(path=path, num_accepted=num_accepted, bonus=bonus, last_node=cur)


def _walk_level(tree, tokens, probs, q, rule, neighbours, uniforms, rows, cur, alive):
    """One level of `verify_tree_sequential`: the children of each row's current node ``cur`` tried in order against
    ``uniforms`` ``(B, K)``, each rejection replacing ``p`` by its residual (a relaxed rule's TVD budget shared by
    the level's siblings). Returns ``(moved (B,), the accepted child (B,), the residual p (B, V))``."""
    b, k = probs.shape[0], tree.children.shape[-1]
    p = probs[rows, cur]  # (B, V)
    moved = torch.zeros(b, dtype=torch.bool, device=probs.device)
    nxt = cur.clone()
    spent = torch.zeros(b, dtype=probs.dtype, device=probs.device)  # TVD used by this step's rejected siblings
    scale = torch.ones(b, dtype=probs.dtype, device=probs.device)  # mass of the step's p that p now stands for
    for j in range(k):
        node = tree.children[rows, cur, j] if tree.per_row else tree.children[cur, j]  # (B,) -1: no such sibling
        safe = node.clamp_min(0)
        valid = alive & ~moved & (node >= 0) & (tokens[rows, safe] >= 0)
        x = torch.where(valid, tokens[rows, safe], 0)  # (B,) code 0 stands in where there is no candidate
        relaxed = rule.relax(p, x, neighbours, rule.budget_left(spent, scale))
        px = relaxed.mass
        qx = torch.ones_like(px) if q is None else q[rows, safe].gather(1, x[:, None]).squeeze(1)
        accept = valid & (uniforms[:, j] * qx < px)  # u < min(1, p~/q) without dividing
        nxt = torch.where(accept, safe, nxt)
        moved |= accept
        reject = valid & ~accept
        rest = relaxed.removed(p, x) if q is None else (relaxed.target(p, x) - q[rows, safe]).clamp_min(0)  # (B, V)
        total, spent_next, scale_next = relaxed.rejected(rest, spent, scale)  # (B,) each
        spent, scale = torch.where(reject, spent_next, spent), torch.where(reject, scale_next, scale)
        p = torch.where(reject[:, None] & (total[:, None] > 0), rest / total.clamp_min(1e-30)[:, None], p)
    return moved, nxt, p


def _walk_chain_tail(tree, tokens, probs, q, rule, neighbours, uniforms, noise, rows, levels, path, cur, alive, bonus):
    """The chain below `DraftTree.chain_from` in one `_verify_chain` step, for the rows that reached its head: writes
    their path below ``levels`` in place and returns their ``(last node (B,), bonus (B,))``."""
    index = tree.chain_index  # (m + 1,) the head, then one node per depth
    chain = _verify_chain(tokens[:, index], probs[:, index], uniforms, noise,
                          None if q is None else q[:, index], rows, rule, neighbours)
    on = alive & (cur == index[0])  # (B,)
    below = torch.where(chain.path >= 0, index[chain.path.clamp_min(0)], -1)  # (B, m + 1) tree nodes
    path[:, levels:] = torch.where(on[:, None], below, path[:, levels:])
    cur = torch.where(on, index[chain.last_node], cur)
    bonus = torch.where(on, chain.bonus, bonus)
    return cur, bonus
