"""Draft trees as data: node parents and depths, the tree attention mask, root-to-leaf retrieve indices and a
child table, built vectorised from parent indices or from a list of paths.

Node 0 is the root: the newest committed code, fed first. A node at depth ``d`` drafts the code ``d`` raster
positions after the root. Candidates of one parent are siblings, tried in node order.
"""

from dataclasses import dataclass, fields
from typing import ClassVar, Sequence, Tuple

import torch


class _TreeSizes:
    """The sizes `DraftTree` and `RowTrees` read off their tables' last dimension (a shape, not a device read)."""

    @property
    def num_nodes(self) -> int:
        return self.parents.shape[-1]

    @property
    def max_depth(self) -> int:
        return self.node_paths.shape[-1] - 1

    @property
    def max_children(self) -> int:
        """Most children of one node (1 for a chain; for `RowTrees`, a bound on any node's)."""
        return self.children.shape[-1]

    def to(self, device):
        values = (getattr(self, f.name) for f in fields(self))
        return type(self)(*(v.to(device) if isinstance(v, torch.Tensor) else v for v in values))


@dataclass(frozen=True)
class DraftTree(_TreeSizes):
    """A static draft tree.

    Args:
        parents (`torch.LongTensor` `(T,)`): parent node of each node (``-1`` for the root).
        depths (`torch.LongTensor` `(T,)`): depth of each node (root 0).
        attention_mask (`torch.BoolTensor` `(T, T)`): ``[i, j]`` is True when ``j`` is ``i`` or an ancestor of ``i``.
        children (`torch.LongTensor` `(T, K)`): children of each node in sibling order, padded with ``-1``.
        retrieve_indices (`torch.LongTensor` `(L, D + 1)`): node indices of every root-to-leaf path, padded with ``-1``.
        ranks (`torch.LongTensor` `(T,)`): for trees built from paths, the candidate rank each node takes at its
            depth (``-1`` for the root).
        node_paths (`torch.LongTensor` `(T, D + 1)`): root-to-node indices of every node, padded with ``-1``
            (the accepted path is one row of it: a gather, no walk).
        earlier_siblings (`torch.BoolTensor` `(T, T)`): ``[i, j]`` is True when ``j`` is a sibling tried before ``i``.
        chain_from (`int`): host int: the depth below which the tree is one chain (one node per depth, each the only
            child of the one before): ``0`` for a chain, the depth ``P`` of an SJD-PAC window's candidate levels,
            ``D`` when the deepest level has several nodes. A walk vectorises the chain part.
        chain_index (`torch.LongTensor` `(D - chain_from + 1,)`): the chain's head (at depth ``chain_from``) and the
            chain's nodes below it, in depth order.
    """

    parents: torch.Tensor
    depths: torch.Tensor
    attention_mask: torch.Tensor
    children: torch.Tensor
    retrieve_indices: torch.Tensor
    ranks: torch.Tensor
    node_paths: torch.Tensor
    earlier_siblings: torch.Tensor
    chain_from: int = 0
    chain_index: torch.Tensor = None
    per_row: ClassVar[bool] = False  # one tree for every batch row (`RowTrees`: one per row)


def tree_from_parents(parents: Sequence[int], ranks: Sequence[int] = None) -> DraftTree:
    """Build a tree from parent indices; every parent must come before its children (``parents[0] == -1``)."""
    parents = torch.as_tensor(list(parents), dtype=torch.long)
    t = parents.shape[0]
    if t == 0 or parents[0] != -1 or (parents[1:] < 0).any() or (parents[1:] >= torch.arange(1, t)).any():
        raise ValueError("`parents` must start with the root (-1) and list every parent before its children.")
    depths = torch.zeros(t, dtype=torch.long)
    ancestors = torch.eye(t, dtype=torch.bool)
    for i in range(1, t):  # parents precede children: one pass fills depths and ancestor rows
        depths[i] = depths[parents[i]] + 1
        ancestors[i] |= ancestors[parents[i]]
    counts = torch.bincount(parents[1:], minlength=t)
    children = torch.full((t, max(int(counts.max()), 1)), -1, dtype=torch.long)
    fill = torch.zeros(t, dtype=torch.long)
    for i in range(1, t):
        p = parents[i]
        children[p, fill[p]] = i
        fill[p] += 1
    leaves = [i for i in range(t) if counts[i] == 0]
    depth = int(depths.max())
    node_paths = torch.full((t, depth + 1), -1, dtype=torch.long)
    for i in range(t):
        path = ancestors[i].nonzero().flatten()  # ancestors in index order = root-to-node order
        node_paths[i, : path.numel()] = path
    retrieve = node_paths[leaves]  # (L, D + 1) the root-to-leaf paths
    same_parent = parents[:, None] == parents[None, :]
    earlier = same_parent & (torch.arange(t)[None, :] < torch.arange(t)[:, None])  # siblings are tried in index order
    ranks = torch.as_tensor(list(ranks), dtype=torch.long) if ranks is not None else torch.full((t,), -1, dtype=torch.long)
    by_depth = [[] for _ in range(depth + 1)]
    for i, d in enumerate(depths.tolist()):
        by_depth[d].append(i)
    chain_from = depth
    while chain_from >= 1 and len(by_depth[chain_from]) == 1:  # one node per depth below: a chain (each the only child)
        chain_from -= 1
    head = int(parents[by_depth[chain_from + 1][0]]) if chain_from < depth else by_depth[depth][0]
    chain_index = torch.tensor([head] + [by_depth[d][0] for d in range(chain_from + 1, depth + 1)], dtype=torch.long)
    return DraftTree(parents, depths, ancestors, children, retrieve, ranks, node_paths, earlier, chain_from, chain_index)


def tree_from_paths(paths: Sequence[Tuple[int, ...]]) -> DraftTree:
    """Build a Medusa-style tree from candidate-rank paths: ``(0,)`` is the top-1 candidate at depth 1,
    ``(0, 2)`` the top-3 candidate at depth 2 under it. Every prefix of a path is a node; siblings are ordered
    by rank."""
    nodes = sorted({tuple(p[:k]) for p in paths for k in range(1, len(p) + 1)}, key=lambda p: (len(p), p))
    if any(r < 0 for p in nodes for r in p):
        raise ValueError("`paths` hold candidate ranks, which must be >= 0.")
    index = {(): 0}
    parents, ranks = [-1], [-1]
    for node in nodes:
        index[node] = len(parents)
        parents.append(index[node[:-1]])
        ranks.append(node[-1])
    return tree_from_parents(parents, ranks)


def chain_tree(length: int) -> DraftTree:
    """A chain of ``length`` drafts after the root (Jacobi windows, one-candidate trees)."""
    return tree_from_parents([-1] + list(range(length)), [-1] + [0] * length)


@dataclass(frozen=True)
class RowTrees(_TreeSizes):
    """One draft tree per batch row (EAGLE-2's dynamic trees), padded to ``T`` nodes, built on the device.

    Node 0 of every row is the root. A padding node is not ``valid``: its parent is ``-1``, it sees only itself and
    it is never accepted. Parents need not precede their children.

    Args:
        parents (`torch.LongTensor` `(B, T)`): parent of each node (``-1``: the root and padding).
        valid (`torch.BoolTensor` `(B, T)`): real nodes.
        depths (`torch.LongTensor` `(B, T)`): depth of each node (root and padding 0).
        attention_mask (`torch.BoolTensor` `(B, T, T)`): ``[b, i, j]`` when ``j`` is ``i`` or an ancestor of ``i``.
        node_paths (`torch.LongTensor` `(B, T, D + 1)`): root-to-node indices, ``-1`` after the node.
        earlier_siblings (`torch.BoolTensor` `(B, T, T)`): ``[b, i, j]`` when ``j`` is a sibling tried before ``i``
            (siblings are tried in index order).
        children (`torch.LongTensor` `(B, T, K)`): children of each node in sibling order, padded with ``-1``.
    """

    parents: torch.Tensor
    valid: torch.Tensor
    depths: torch.Tensor
    attention_mask: torch.Tensor
    node_paths: torch.Tensor
    earlier_siblings: torch.Tensor
    children: torch.Tensor
    per_row: ClassVar[bool] = True  # tables with a leading batch dimension


def row_trees_from_parents(parents: torch.Tensor, valid: torch.Tensor, max_depth: int, max_children: int) -> RowTrees:
    """Build `RowTrees` from parent indices ``(B, T)`` and the valid-node mask ``(B, T)`` with tensor ops only (no host
    reads): ``max_depth + 1`` rounds of following parent pointers give every node's ancestors, depth and path.

    Args:
        parents (`torch.LongTensor` `(B, T)`): ``parents[:, 0]`` is ``-1`` (the root); padding nodes may hold anything.
        valid (`torch.BoolTensor` `(B, T)`): real nodes; the root is always real.
        max_depth (`int`): a bound on the trees' depth (host int; sizes the tables).
        max_children (`int`): a bound on any node's children (host int; sizes the child table).
    """
    b, t = parents.shape
    device = parents.device
    index = torch.arange(t, device=device)
    valid = valid.clone()
    valid[:, 0] = True
    parents = torch.where(valid & (index > 0), parents, -1)  # (B, T)
    cur = torch.where(valid, index.expand(b, t), -1)  # (B, T) the ancestor ``s`` steps up (self at s = 0)
    ups = []
    for _ in range(max_depth + 1):
        ups.append(cur)
        cur = torch.where(cur >= 0, parents.gather(1, cur.clamp_min(0)), -1)
    ups = torch.stack(ups, -1)  # (B, T, D + 1)
    depths = ((ups >= 0).sum(-1) - 1).clamp_min(0)  # (B, T)
    ancestors = torch.zeros(b, t, t + 1, dtype=torch.bool, device=device)  # a spare column takes the -1s
    ancestors.scatter_(2, torch.where(ups >= 0, ups, t), True)
    ancestors = ancestors[:, :, :t] | torch.eye(t, dtype=torch.bool, device=device)  # padding sees itself
    # the ancestor at depth d is ``depth - d`` steps up
    steps = depths[..., None] - torch.arange(max_depth + 1, device=device)  # (B, T, D + 1)
    node_paths = torch.where(steps >= 0, ups.gather(2, steps.clamp_min(0)), -1)
    node_paths = torch.where(valid[..., None], node_paths, -1)
    real = valid & (index > 0)
    same = (parents[:, :, None] == parents[:, None, :]) & real[:, :, None] & real[:, None, :]
    earlier = same & (index[None, :] < index[:, None])  # (B, T, T)
    rank = earlier.sum(-1)  # (B, T) siblings before each node
    children = torch.full((b, t * max_children + 1), -1, dtype=torch.long, device=device)  # a spare slot takes the rest
    slot = torch.where(real & (rank < max_children), parents.clamp_min(0) * max_children + rank, t * max_children)
    children.scatter_(1, slot, torch.where(real, index.expand(b, t), -1))
    children[:, -1] = -1
    return RowTrees(parents, valid, depths, ancestors, node_paths, earlier, children[:, :-1].view(b, t, max_children))
