"""The end-of-row (EOL) slots of a tree round on the device (`device_tree.tree_pass`), for layouts that feed an EOL
token after every row (Emu3, Lumina-mGPT, the tiny LlamaGen with ``end_of_row``).

A round whose newest code is ``c`` drafts grid index ``c + d`` at depth ``d``; the depths with ``(c + d) % W == W - 1``
(but the grid's last) end a row. Every node at such a depth gets an EOL slot one position after its code: it sees the
node, its ancestors and their EOL slots, the node's descendants see it, and its output predicts the next row's first
code (`ImageTokenLayout.sequence_offset` counts the EOLs before a node). The accepted path keeps each EOL slot it
crossed (`path_with_end_of_row`). The slot count is a host bound (`eol_slot_count`); unused slots see themselves."""

import math
from dataclasses import dataclass
from typing import Sequence

import torch


def eol_slot_count(layout, depth_counts: Sequence[int]) -> int:
    """EOL slots a tree round feeds per row (0 without EOLs): the most nodes over the depths of one residue mod ``W``
    (those ending rows in one round).

    Args:
        layout (`ImageTokenLayout`): the grid.
        depth_counts (`Sequence[int]`): nodes at each depth ``0 .. D`` (root first), at most (host ints).
    """
    if not layout.has_eol:
        return 0
    w = layout.width
    return min(sum(depth_counts), max(sum(depth_counts[r::w]) for r in range(min(w, len(depth_counts)))))


def path_slot_count(layout, max_codes: int) -> int:
    """Cache slots an accepted path keeps at most: its ``max_codes`` nodes (depths ``0 .. D``), and an EOL slot after
    each that ends a row (one in every ``W`` consecutive depths at most)."""
    return max_codes + (math.ceil(max_codes / layout.width) if layout.has_eol else 0)


@dataclass
class EndOfRowSlots:
    """A round's EOL slots (`end_of_row_slots`), per row.

    Args:
        ends (`torch.BoolTensor` `(B, D + 1)`): per depth, whether the code there ends a row (not the grid's last).
        predictor (`torch.LongTensor` `(B, T)`): the fed slot whose output predicts the code after each node: the node
            itself, or its EOL slot ``T + j``.
        offsets (`torch.LongTensor` `(B, E)`), predicts (`torch.LongTensor` `(B, E)`): each EOL slot's sequence offset
            and the grid index its output predicts.
        mask (`torch.BoolTensor` `(B, T + E, T + E)`): the tree mask with the EOL slots.
    """

    ends: torch.Tensor
    predictor: torch.Tensor
    offsets: torch.Tensor
    predicts: torch.Tensor
    mask: torch.Tensor


def end_of_row_slots(loop, tables, committed: torch.Tensor) -> EndOfRowSlots:
    """Per row, the EOL slots of a tree round (the module docstring's rule): one per node ending a row.

    Args:
        loop (`TreeLoop`): the generation (its layout, ``num_nodes`` ``T``, ``eol_slots`` ``E``, ``code_offsets``,
            ``node_slots`` and ``eol_eye``).
        tables (`TreeTables`): the round's tree, one for every row or one per row.
        committed (`torch.LongTensor` `(B,)`): codes committed per row.
    """
    layout, t, e = loop.layout, loop.num_nodes, loop.eol_slots
    b, n = committed.shape[0], layout.num_tokens
    newest = committed[:, None] - 1  # (B, 1)
    by_depth = (newest + loop.code_offsets).clamp_max(n - 1)  # (B, D + 1) each depth's grid index (at most the last)
    ends = layout.ends_row(layout.sequence_offset(by_depth))  # (B, D + 1) the grid's last code ends no row
    depths = tables.depths.expand(b, t).clamp(0, ends.shape[1] - 1)  # (B, T)
    at_end = ends.gather(1, depths) & tables.valid  # (B, T)
    rank = at_end.long().cumsum(1) - 1  # (B, T) the node's EOL slot
    at_end = at_end & (rank < e)  # never false for a tree within the host bound (`eol_slot_count`)
    node = loop.node_slots.expand(b, t)  # (B, T)
    owner = committed.new_full((b, e + 1), -1)  # (B, E + 1) a spare column takes the nodes without an EOL slot
    owner = owner.scatter(1, torch.where(at_end, rank, e), torch.where(at_end, node, -1))[:, :e]  # (B, E) -1: unused
    used, owner0 = owner >= 0, owner.clamp_min(0)  # (B, E)
    ancestors = tables.mask.expand(b, t, t)  # (B, T, T) [i, j]: j is i or an ancestor of i
    # node i sees EOL slot j when the slot's node is a strict ancestor of i; the slot sees its node's ancestors, and
    # the EOL slots of those (a node has one EOL slot at most, so slot j is the only one of its own node)
    below = node[:, :, None] != owner0[:, None, :]  # (B, T, E) not the slot's own node
    sees = ancestors.gather(2, owner0[:, None, :].expand(b, t, e)) & below & used[:, None, :]  # (B, T, E)
    seen = ancestors.gather(1, owner0[:, :, None].expand(b, e, t)) & used[:, :, None]  # (B, E, T)
    chained = seen.gather(2, owner0[:, None, :].expand(b, e, e)) & used[:, None, :]  # (B, E, E) an ancestor's EOL slot
    mask = torch.cat([torch.cat([ancestors, sees], 2), torch.cat([seen, chained | loop.eol_eye], 2)], 1)
    end_code = by_depth.gather(1, depths.gather(1, owner0))  # (B, E) the code each EOL slot follows
    return EndOfRowSlots(ends=ends, predictor=torch.where(at_end, t + rank, node),
                         offsets=layout.sequence_offset(end_code) + 1, predicts=end_code + 1, mask=mask)


def path_with_end_of_row(loop, eol: EndOfRowSlots, path: torch.Tensor, accepted: torch.Tensor):
    """The cache slots a row keeps: its accepted path's ``accepted`` nodes, each that ends a row followed by its EOL
    slot. A fixed-shape compaction: the (node, EOL slot) pairs of every depth, the wanted ones scattered in place.

    Args:
        loop (`TreeLoop`): the generation (its ``path_slots`` ``P``).
        eol (`EndOfRowSlots`): the round's EOL slots.
        path (`torch.LongTensor` `(B, D + 1)`): the accepted path's node slots (padded with its last node).
        accepted (`torch.LongTensor` `(B,)`): the nodes it keeps.

    Returns the kept slots ``(B, P)``, root first, and how many ``(B,)``."""
    b, c = path.shape
    pairs = torch.stack([path, eol.predictor.gather(1, path)], 2).flatten(1)  # (B, 2 (D + 1)) a node, then its EOL slot
    wanted = torch.stack([torch.ones_like(eol.ends), eol.ends], 2).flatten(1)  # (B, 2 (D + 1))
    spare = loop.path_slots
    dest = torch.where(wanted, wanted.long().cumsum(1) - 1, spare)  # (B, 2 (D + 1)) within P: at most P wanted
    slots = path.new_zeros(b, spare + 1).scatter(1, dest, pairs)[:, :spare]  # (B, P) past the count: never kept
    crossed = (eol.ends & (loop.code_offsets < accepted[:, None])).sum(1)  # (B,) row ends among the kept nodes
    return slots, accepted + crossed
