"""Every row of a batch advances on its own: decoder states over groups of rows, one target pass for all of them.

A batch of images is decoded as its rows would be alone. The rows start in one decoder state (one group: they sit at
the same grid cursor and draft together). When the rows of a group accept runs of different lengths, the decoder's
step stops before it changes anything (`RowsDiverged`) and the group is split by run length
(`DecodingState.split`); each part commits its own run with the verification already drawn and from then on keeps
its own cursor, window or tree and its rows' own random numbers. Each round:

1. every unfinished group proposes its draft at its own cursor (its own positions and end-of-row tokens);
2. the drafts are placed at their rows, padded to one width, and fed in one target pass, each row writing its keys
   after its own filled slots of the KV cache (`StaticKVCache.track_rows`);
3. every group accepts and commits its rows' runs, and the cache keeps each row's accepted slots (`keep_rows`).

Nothing is carried, dropped or waited for: a batch takes as many passes as its slowest row alone, and with one
generator per row each row gives what its prompt gives alone (a row draws from its own generator exactly what it
draws alone, in the same order). A finished row feeds masked padding (it writes no code and keeps no slot) until the
batch ends. Rows that never diverge (a 2x2 grid sampled 8,000 times lands in a handful of groups) share one state,
so a large batch of few distinct histories costs few states.
"""

from dataclasses import dataclass
from typing import Dict, List, Optional, Union

import torch

from ..core.layout import EndOfRowInsertion, ImageTokenLayout
from ..core.sampling import RandomSource, SamplingConfig
from ..decoders.decoding_utils import DecodingState, Draft, SpatialDecoderMixin


@dataclass
class RowGroup:
    """Rows of a batch that share one decoder state (same cursor, same history).

    Args:
        rows (`list[int]`): the batch rows, in the state's row order.
        state (`DecodingState`): their state (its batch size is ``len(rows)``).
        index (`torch.LongTensor` `(n,)`): ``rows`` on the device (built once per group).
    """

    rows: List[int]
    state: DecodingState
    index: torch.Tensor


@dataclass
class RowBatch:
    """The decoder states of one generation's rows, and what the loop counts over all of them.

    Args:
        layout (`ImageTokenLayout`): the image grid.
        batch_size (`int`): images.
        groups (`list[RowGroup]`): the states, each over some of the rows; every row in exactly one.
        tokens (`torch.LongTensor` `(B, H*W)`), acceptance_map (`torch.LongTensor` `(B, H*W)`): every row's codes and
            the accepted length of the pass that committed each, gathered from the groups by `sync` (the groups'
            own tensors are the record while the loop runs).
        fed_size (`int`, *optional*): with static shapes, the slots every round feeds per row; ``None``: the widest
            draft of the round.
        fed_slots (`int`), padded_slots (`int`): with static shapes or several rows, the slots fed to the target
            (every row counted), and how many of them were padding (narrower drafts, finished rows, static shapes).
        num_splits (`int`): times a group was split because its rows diverged.
    """

    layout: ImageTokenLayout
    batch_size: int
    groups: List[RowGroup]
    tokens: torch.Tensor
    acceptance_map: torch.Tensor
    fed_size: Optional[int] = None
    fed_slots: int = 0
    padded_slots: int = 0
    num_splits: int = 0

    @classmethod
    def create(cls, decoder: SpatialDecoderMixin, layout: ImageTokenLayout, sampling: SamplingConfig, generator,
               batch_size: int, prefix_length: int, device: torch.device, backbone=None) -> "RowBatch":
        """The rows in one state from ``decoder.init_state`` (one state per row for a decoder that `separate_rows`).
        With a list of generators row ``b`` draws only from ``generator[b]``, in the order it would alone."""
        parts = [list(range(batch_size))] if batch_size == 1 or not decoder.separate_rows else [[b] for b in range(batch_size)]
        random = RandomSource(generator, batch_size, device, keyed=sampling.keyed)  # keyed: one seed per row, drawn now
        groups = []
        for rows in parts:
            part = random if len(parts) == 1 else random.split(rows)
            state = decoder.init_state(layout, sampling, part, len(rows), prefix_length, device, backbone)
            state.split_rows = batch_size > 1
            groups.append(RowGroup(rows, state, torch.tensor(rows, device=device)))
        if len(groups) == 1:  # the batch's record is the state's own until the rows split
            tokens, acceptance_map = groups[0].state.tokens, groups[0].state.acceptance_map
        else:
            tokens = torch.full((batch_size, layout.num_tokens), -1, dtype=torch.long, device=device)
            acceptance_map = torch.zeros(batch_size, layout.num_tokens, dtype=torch.long, device=device)
        return cls(layout=layout, batch_size=batch_size, groups=groups, tokens=tokens, acceptance_map=acceptance_map)

    def active(self) -> List[RowGroup]:
        """The groups whose grids are not full yet."""
        return [g for g in self.groups if not g.state.finished]

    @property
    def finished(self) -> bool:
        return all(g.state.finished for g in self.groups)

    @property
    def num_committed(self) -> int:
        """Codes every row has committed (the slowest row's count)."""
        return min(g.state.num_committed for g in self.groups)

    @property
    def total_committed(self) -> int:
        """Codes committed over all rows (the progress bar's count)."""
        return sum(g.state.num_committed * len(g.rows) for g in self.groups)

    @property
    def sampling(self) -> SamplingConfig:
        return self.groups[0].state.sampling

    @sampling.setter
    def sampling(self, value: SamplingConfig) -> None:  # a callback's new guidance scale reaches every row
        for g in self.groups:
            g.state.sampling = value

    def replace(self, group: RowGroup, parts: List[RowGroup]) -> None:
        """Put the groups ``parts`` (a split of ``group``) in its place; the batch's record is now gathered."""
        i = next(k for k, g in enumerate(self.groups) if g is group)
        if len(self.groups) == 1 and self.tokens is group.state.tokens:  # the record was the one state's own
            self.tokens, self.acceptance_map = self.tokens.clone(), self.acceptance_map.clone()
        self.groups[i : i + 1] = parts
        self.num_splits += 1

    def sync(self) -> None:
        """Gather every group's codes and acceptance record into ``tokens`` / ``acceptance_map``."""
        for g in self.groups:
            if g.state.tokens is not self.tokens:
                self.tokens[g.index] = g.state.tokens
                self.acceptance_map[g.index] = g.state.acceptance_map

    def write_back(self) -> None:
        """Push ``tokens`` / ``acceptance_map`` (changed by a callback) back into the groups' states."""
        for g in self.groups:
            if g.state.tokens is not self.tokens:
                g.state.tokens.copy_(self.tokens[g.index])
                g.state.acceptance_map.copy_(self.acceptance_map[g.index])

    def accepted_lengths(self) -> torch.Tensor:
        """``(passes, B)``: the accepted length of every target pass per row, ``0`` for passes after a row finished."""
        passes = max(len(g.state.accepted_lengths) for g in self.groups)
        out = torch.zeros(passes, self.batch_size, dtype=torch.long, device=self.tokens.device)
        for g in self.groups:
            if g.state.accepted_lengths:
                out[: len(g.state.accepted_lengths), g.index] = torch.stack(g.state.accepted_lengths)
        return out

    def row_passes(self) -> List[int]:
        """Target passes each row took (its prompt pass included): what it takes alone."""
        passes = [0] * self.batch_size
        for g in self.groups:
            for r in g.rows:
                passes[r] = len(g.state.accepted_lengths)
        return passes

    @property
    def num_draft_passes(self) -> int:
        return sum(g.state.num_draft_passes for g in self.groups)

    def report(self) -> Dict[str, float]:
        """The decoder's own statistics (`DecodingState.report`), averaged over the rows."""
        reports = [(len(g.rows), g.state.report()) for g in self.groups]
        keys = [k for k in reports[0][1] if all(k in r for _, r in reports)]
        return {k: sum(n * float(r[k]) for n, r in reports) / self.batch_size for k in keys}


def split_group(group: RowGroup, runs: List[int]) -> List[RowGroup]:
    """``group`` split by its rows' run lengths ``runs`` (one part per length, rows in order). The first part keeps
    the group's draft-pass count, the others start from 0 (the batch sums them)."""
    parts = []
    for run in sorted(set(runs)):
        local = [i for i, r in enumerate(runs) if r == run]
        state = group.state.split(local)
        if parts:
            state.num_draft_passes = 0
        rows = [group.rows[i] for i in local]
        parts.append((local, RowGroup(rows, state, torch.tensor(rows, device=group.index.device))))
    return parts


@dataclass
class FedGroup:
    """One group's part of a round: its draft with the end-of-row tokens put in.

    Args:
        group (`RowGroup`): the rows.
        draft (`Draft`): what the decoder proposed.
        input_ids (`torch.LongTensor` `(n, T')`), position_ids (`torch.LongTensor` `(T',)` or `(n, T')`),
            attention_mask (`torch.BoolTensor` `(T', T')` or `(n, T', T')`): what the rows feed.
        eol (`EndOfRowInsertion`, *optional*): the end-of-row insertion.
    """

    group: RowGroup
    draft: Draft
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    eol: Optional[EndOfRowInsertion]

    @property
    def width(self) -> int:
        return self.input_ids.shape[1]


def insert_end_of_rows(layout: ImageTokenLayout, state: DecodingState, draft: Draft, group: Optional[RowGroup] = None) -> FedGroup:
    """End-of-row tokens are forced, never drafted: one is fed after every fed code that ends a row."""
    input_ids, position_ids, mask = draft.input_ids, draft.position_ids, draft.attention_mask  # (n, T)
    eol = None
    if layout.has_eol and draft.per_row:  # one tree per row (EAGLE-2, ADT-Tree): tables per row
        eol = EndOfRowInsertion.for_positions(layout, position_ids, state.prefix_length, root=state.num_committed - 1)
    elif layout.has_eol:  # a shared draft: placed from its host-side depths, no device read
        eol = EndOfRowInsertion.for_depths(layout, draft.depths, state.num_committed - 1, input_ids.device)
    if eol is not None:
        input_ids, position_ids, mask = eol.input_ids(input_ids), eol.position_ids(position_ids), eol.attention_mask(mask)
    return FedGroup(group, draft, input_ids, position_ids, mask, eol)


def stack_groups(fed: List[FedGroup], batch: RowBatch, width: int, device: torch.device):
    """The round's inputs over every batch row, each group's draft at its rows, padded to ``width`` slots: codes
    ``(B, F)``, positions ``(B, F)``, masks ``(B, F, F)`` and end-of-row slots ``(B, F)``. A padded slot (and every
    slot of a finished row) feeds code 0 at a position inside the grid and sees only itself; no real slot sees it.
    One group over every row in order (no split yet) is fed as it is: no copies."""
    b = batch.batch_size
    if len(fed) == 1 and fed[0].width == width and fed[0].group.rows == list(range(b)):
        f = fed[0]
        is_eol = f.eol.is_eol.expand(b, width) if f.eol is not None else None
        return f.input_ids, f.position_ids.expand(b, width), f.attention_mask.expand(b, width, width), is_eol
    ids = torch.zeros(b, width, dtype=torch.long, device=device)
    masks = torch.eye(width, dtype=torch.bool, device=device).expand(b, width, width).clone()  # (B, F, F)
    positions = batch.groups[0].state.positions[-1:].expand(b, width).clone()  # (B, F) inside the grid's table
    is_eol = torch.zeros(b, width, dtype=torch.bool, device=device)
    for f in fed:
        t, index, n = f.width, f.group.index, len(f.group.rows)
        ids[index, :t] = f.input_ids
        pos = f.position_ids.expand(n, t)
        positions[index, :t] = pos
        if t < width:  # padding sits at the row's last real position
            positions[index, t:] = pos[:, -1:]
        masks[index, :t, :t] = f.attention_mask.expand(n, t, t)
        if f.eol is not None:
            is_eol[index, :t] = f.eol.is_eol.expand(n, t)
    return ids, positions, masks, is_eol


Kept = Union[int, torch.Tensor]
