"""Verification of draft trees (docs/design.md, "Acceptance rules"): batched, free of host syncs, by any
acceptance rule (`acceptance.py`).

Every candidate carries a proposal distribution ``q``. A candidate produced deterministically (top-k, copied,
cached) is a point mass, and the exact rule reduces to "accept with ``p(x)``, else zero ``p[x]`` and renormalise".
Siblings are tried in order, each with its own ``q``; a rejection replaces ``p`` by the residual
``norm(max(p - q, 0))``. When every sibling fails, or a leaf is reached, one code is drawn from what is left.
Either way the committed codes follow the target distribution exactly under the exact rule.
"""

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from .acceptance import EXACT, AcceptanceRule
from .sampling import RandomSource, one_hot
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
        host (`tuple`, *optional*): ``(num_accepted as ints, whether every row's path is a prefix of the fed slots)``,
            once a decoder step has read them (kept with an acceptance handed to the parts of a split state, which
            then read nothing again).
    """

    path: torch.Tensor
    num_accepted: torch.Tensor
    bonus: torch.Tensor
    last_node: torch.Tensor
    host: Optional[Tuple[List[int], bool]] = None  # (num_accepted, every path a prefix) once read on the host


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
    rule: AcceptanceRule = EXACT,
    neighbours: Optional[torch.Tensor] = None,
) -> TreeAcceptance:
    """Walk every row's tree from the root, accepting candidates by ``rule`` (exactly, by default).

    Vectorised over every node at once (no loop over depths or siblings) when the candidates are point masses
    (``q is None``: top-k, copied or cached drafts) or the tree is a chain (each node has at most one child);
    other trees with a known ``q`` per node, or with a relaxed rule, fall back to `verify_tree_sequential`, whose
    residuals chain from sibling to sibling.

    Args:
        tree (`DraftTree` or `RowTrees`): the shared tree shape, or one tree per row.
        tokens (`torch.LongTensor` `(B, T)`): the code at every node (node 0: the root, not verified); ``-1``
            marks a node that this row does not offer (an empty or duplicate pool slot): it is skipped.
        probs (`torch.Tensor` `(B, T, V)`): target distribution after each node (fp32).
        random (`RandomSource`): draws ``(B, T - 1 + V)`` uniforms per call (fixed shape): one per node, and the
            exponentials of the bonus draw.
        q (`torch.Tensor` `(B, T, V)`, *optional*): each node's proposal distribution; ``None`` means point masses.
        distinct_siblings (`bool`): the caller guarantees that no two offered siblings carry the same code (top-k
            candidates, de-duplicated pools), which skips the duplicate check.
        rule (`AcceptanceRule`): how much of ``p`` a candidate claims (`resolve_acceptance`).
        neighbours (`torch.Tensor` `(V, k)`, *optional*): `codebook_neighbours`, for rules that read them.
    """
    if (q is not None or rule.relaxes) and (tree.max_children > 1 or tree.per_row):
        return verify_tree_sequential(tree, tokens, probs, random, q, rule, neighbours)
    b, t, v = probs.shape
    if t == 1:  # nothing drafted: the bonus is a plain draw from the root's p
        return _bonus_only(probs, random)
    # 1. one random call per round: a uniform per node, then the exponentials of the bonus draw
    rows = torch.arange(b, device=probs.device)
    draws = random.uniform(t - 1 + v)  # (B, T - 1 + V)
    u, noise = draws[:, : t - 1], -torch.log(draws[:, t - 1 :])  # (B, T-1) uniforms, (B, V) Exp(1)
    if tree.max_children == 1 and not tree.per_row:
        return _verify_chain(tokens, probs, u, noise, q, rows, rule, neighbours)
    # 2. the nodes each row offers (point masses, q is None here: sums over earlier siblings and over ancestors are
    #    matmuls with the tree's tables)
    x = tokens[:, 1:]  # (B, T-1) candidate of every node
    tables = _walk_tables(tree, v)
    valid = _offered_nodes(tree, x, tables, distinct_siblings)  # (B, T-1)
    # 3. the accepted path: every node tested at once, the deepest taken node ends it
    num_accepted, last = _accepted_run(probs, x, valid, u, tables)  # (B,), (B,)
    path = tree.node_paths[rows, last] if tree.per_row else tree.node_paths[last]  # (B, D + 1)
    # 4. the bonus, from the last node's p less what its children (all tried and rejected) took
    bonus = _bonus_after_children(tree, tokens, probs, valid, noise, rows, last)  # (B,)
    return TreeAcceptance(path=path, num_accepted=num_accepted, bonus=bonus, last_node=last)


def _bonus_only(probs: torch.Tensor, random: RandomSource) -> TreeAcceptance:
    """`verify_tree` when nothing was drafted (``probs`` ``(B, 1, V)``): the bonus is a plain draw from the root's p."""
    b, _, v = probs.shape
    noise = -torch.log(random.uniform(v))  # (B, V) Exp(1); u = 0 gives inf: that code scores 0, never NaN
    bonus = (probs[:, 0] / noise).argmax(-1)
    zero = torch.zeros(b, dtype=torch.long, device=probs.device)
    return TreeAcceptance(path=zero[:, None], num_accepted=zero, bonus=bonus, last_node=zero)


def _offered_nodes(tree, x: torch.Tensor, tables: "_WalkTables", distinct_siblings: bool) -> torch.Tensor:
    """Which nodes ``(B, T-1)`` a row offers: a code (not ``-1``), not padding of `RowTrees`, and not a repeat of an
    earlier sibling's code (offered nothing: its p(x) is 0 by then) unless the caller guarantees distinct siblings."""
    valid = x >= 0  # (B, T-1)
    if tree.per_row:
        valid = valid & tree.valid[:, 1:]  # padding offers nothing
    if not distinct_siblings:
        valid = valid & ~((x[:, :, None] == x[:, None, :]) & tables.siblings & (x[:, None, :] >= 0)).any(-1)
    return valid


def _accepted_run(probs: torch.Tensor, x: torch.Tensor, valid: torch.Tensor, u: torch.Tensor, tables: "_WalkTables"):
    """``(num_accepted (B,), last node (B,))`` of the vectorised walk over point masses: a node is taken when it is
    the first accepted of its siblings and every ancestor was taken too; taken nodes form one path."""
    b, t, v = probs.shape
    # p(x) under the parent's distribution, read straight from the flat (B, T*V) view: no (B, T-1, V) copy
    px = probs.reshape(b, t * v).gather(1, tables.offsets + x.clamp_min(0)) * valid  # (B, T-1)
    # after rejecting earlier siblings s, p is renormalised over 1 - sum p(s): accept when u < p(x) / left
    accept = valid & (u * (1.0 - tables.summed(px, tables.siblings_t)) < px)  # (B, T-1)
    first = accept & (tables.summed(accept.float(), tables.siblings_t) == 0)
    taken = tables.summed((~first).float(), tables.ancestors_t) == 0  # (B, T-1)
    depth = torch.where(taken, tables.depths, 0)  # (B, T-1)
    num_accepted, deepest = depth.max(-1)  # taken nodes form one path: its deepest node ends it
    last = torch.where(num_accepted > 0, deepest + 1, 0)  # (B,)
    return num_accepted, last


def _bonus_after_children(tree, tokens, probs, valid, noise, rows, last) -> torch.Tensor:
    """The bonus code ``(B,)``: an exponential race over the last node's p with its offered children's codes zeroed
    (all tried and rejected: a point mass's residual)."""
    b = probs.shape[0]
    p_last = probs[rows, last]  # (B, V)
    kids = tree.children[rows, last] if tree.per_row else tree.children[last]  # (B, K) -1 where there is no such child
    node_valid = torch.cat([valid.new_zeros(b, 1), valid], 1)  # (B, T) the root is never a child
    kid_valid = (kids >= 0) & node_valid.gather(1, kids.clamp_min(0))
    kid_codes = torch.where(kid_valid, tokens.gather(1, kids.clamp_min(0)), 0)  # (B, K)
    removed = torch.zeros_like(p_last).scatter_add_(1, kid_codes, kid_valid.to(p_last.dtype)) > 0  # (B, V)
    p_left = p_last.masked_fill(removed, 0.0)
    p_left = torch.where(p_left.sum(-1, keepdim=True) > 0, p_left, p_last)  # nothing left: cannot happen exactly
    return (p_left / noise).argmax(-1)  # exponential race: a draw from p_left (no normalising needed)


@dataclass
class _WalkTables:
    """A shared tree's index tables for the vectorised walk, built once per tree and codebook size (not per round).

    Args:
        offsets (`torch.LongTensor` `(T-1,)`): ``parent * V``: where each node's parent distribution starts in the flat
            ``(B, T * V)`` view of ``probs``.
        siblings (`torch.BoolTensor` `(T-1, T-1)`): earlier siblings below the root (all tables gain a leading
            ``(B,)`` for `RowTrees`).
        siblings_t (`torch.Tensor` `(T-1, T-1)`), ancestors_t (`torch.Tensor` `(T-1, T-1)`): earlier siblings and
            ancestors-or-self, transposed, as floats: a sum over them is one matmul.
        depths (`torch.LongTensor` `(T-1,)`): node depths below the root.
        per_row (`bool`): the tables are `RowTrees`' (a leading ``(B,)``).
    """

    offsets: torch.Tensor
    siblings: torch.Tensor
    siblings_t: torch.Tensor
    ancestors_t: torch.Tensor
    depths: torch.Tensor
    per_row: bool

    def summed(self, values: torch.Tensor, table_t: torch.Tensor) -> torch.Tensor:
        """``out[b, i] = sum_j values[b, j] * table[(b,) i, j]`` for one of these transposed tables."""
        if not self.per_row:  # a shared tree: one plain matmul (the batched form costs a bmm and two views per call)
            return values @ table_t
        return torch.matmul(values.unsqueeze(-2), table_t).squeeze(-2)


def _walk_tables(tree, v: int) -> _WalkTables:
    """The tables of a `DraftTree` (built once, kept on the tree) or of `RowTrees` (built every call: they change every
    round), with a leading batch dimension for the latter."""
    cache = None if tree.per_row else tree.__dict__.setdefault("_walk_tables", {})  # a frozen dataclass keeps a __dict__
    if cache is not None and v in cache:
        return cache[v]
    siblings = tree.earlier_siblings[..., 1:, 1:]
    tables = _WalkTables(
        offsets=tree.parents[..., 1:].clamp_min(0) * v,  # padding (-1) reads the root, never used
        siblings=siblings,
        siblings_t=siblings.transpose(-1, -2).float().contiguous(),
        ancestors_t=tree.attention_mask[..., 1:, 1:].transpose(-1, -2).float().contiguous(),
        depths=tree.depths[..., 1:],
        per_row=tree.per_row,
    )
    if cache is not None:
        cache[v] = tables
    return tables


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
    q_full = one_hot(tokens, probs.shape[-1], probs.dtype) if q is None else q
    left = residual(probs, q_full)  # (B, n, V)
    redrawn = (left / random.exponential(*left.shape[1:])).argmax(-1)  # (B, n) exponential race
    return torch.where(accepted, tokens, redrawn), accepted
