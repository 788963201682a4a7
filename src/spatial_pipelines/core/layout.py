"""Where the image tokens of an AR image model sit in its sequence.

An image of ``height x width`` VQ codes is emitted in raster order. Some families (Emu3, Lumina-mGPT) feed
an end-of-row (EOL) token after every row, so consecutive rows are ``row_stride = width + 1`` sequence
positions apart. Everything before the first image token (text, BOI, resolution tokens) is the prefix.
"""

import functools
from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch

IntOrTensor = Union[int, torch.Tensor]


@dataclass(frozen=True)
class ImageTokenLayout:
    """The image-token grid of one backbone.

    Args:
        height (`int`): rows of VQ codes.
        width (`int`): columns of VQ codes.
        eol_token_id (`int`, *optional*): id of an end-of-row token fed after every row (``None``: no EOL).
    """

    height: int
    width: int
    eol_token_id: Optional[int] = None

    def __post_init__(self):
        for name in ("height", "width"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive int, got {value!r}.")

    @property
    def num_tokens(self) -> int:
        """Image codes per image (``H * W``); EOL tokens are not codes."""
        return self.height * self.width

    @property
    def has_eol(self) -> bool:
        return self.eol_token_id is not None

    @property
    def row_stride(self) -> int:
        """Sequence positions between a token and the token one row below it."""
        return self.width + int(self.has_eol)

    @property
    def sequence_length(self) -> int:
        """Sequence positions the image occupies after the prefix (EOL tokens included)."""
        return self.height * self.row_stride

    def raster_to_rc(self, index: IntOrTensor) -> Tuple[IntOrTensor, IntOrTensor]:
        """Raster index of a code -> (row, col)."""
        return index // self.width, index % self.width

    def rc_to_raster(self, row: IntOrTensor, col: IntOrTensor) -> IntOrTensor:
        """(row, col) -> raster index of a code."""
        return row * self.width + col

    def sequence_offset(self, index: IntOrTensor) -> IntOrTensor:
        """Raster index of a code -> its offset from the first image position (EOL tokens counted)."""
        row, col = self.raster_to_rc(index)
        return row * self.row_stride + col

    def sequence_position(self, index: IntOrTensor, prefix_length: IntOrTensor) -> IntOrTensor:
        """Raster index of a code -> absolute sequence position, given the prefix length."""
        return prefix_length + self.sequence_offset(index)

    def ends_row(self, offset: IntOrTensor) -> IntOrTensor:
        """Whether the code at sequence ``offset`` (from the first image position) ends a row that an EOL follows
        (every row but the last: no code follows it)."""
        return (offset % self.row_stride == self.width - 1) & (offset // self.row_stride < self.height - 1)

    @functools.lru_cache(maxsize=4096)
    def row_ends_after(self, root: int, num_depths: int) -> Tuple[bool, ...]:
        """Host-side, per depth ``d < num_depths``: whether the code ``d`` raster positions after code ``root`` (clamped
        to the last code: drafts past the grid are never committed) ends a row that an EOL follows. Cached: a
        decoding round asks it with host ints and gets it without tensor work."""
        last = self.num_tokens - 1
        return tuple(bool(self.ends_row(self.sequence_offset(min(root + d, last)))) for d in range(num_depths))

    def grid(self, tokens: torch.Tensor) -> torch.Tensor:
        """Flat codes ``(B, H*W)`` -> grid ``(B, H, W)``."""
        return tokens.reshape(tokens.shape[0], self.height, self.width)

    def image_sequence(self, code_embeds: torch.Tensor, eol_embedding: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Embeddings of a whole grid's codes ``(B, H*W, D)`` -> the image sequence the model reads ``(B, S, D)``:
        with an EOL layout, ``eol_embedding`` ``(D,)`` after every row (``S = sequence_length``)."""
        if not self.has_eol:
            return code_embeds
        b = code_embeds.shape[0]
        rows = code_embeds.reshape(b, self.height, self.width, -1)  # (B, H, W, D)
        eol = eol_embedding.to(code_embeds.dtype).expand(b, self.height, 1, -1)  # (B, H, 1, D)
        return torch.cat([rows, eol], 2).flatten(1, 2)  # (B, H*(W+1), D)


@dataclass(frozen=True)
class EndOfRowInsertion:
    """A draft with the layout's forced end-of-row tokens put in, and the maps back to the draft's own nodes.

    Decoders draft codes only, at EOL-aware positions (`ImageTokenLayout.sequence_position`), and never draft or
    verify an end-of-row token. The loop feeds one EOL right after every fed node that ends a row (except the
    last row: no code follows it), as a child of that node: the node's descendants see it, nothing else does.
    The EOL's output predicts the first code of the next row, so it stands in for its parent's output.

    Args:
        source (`torch.LongTensor` `(T',)`): the draft node each fed slot comes from (an EOL: its parent).
        is_eol (`torch.BoolTensor` `(T',)`): which fed slots are end-of-row tokens.
        view (`torch.LongTensor` `(T,)`): per draft node, the fed slot whose output predicts the code after it.
        row_end (`tuple[bool]`): per draft node, whether it ends a row that an EOL follows (host-side).
        slot (`torch.LongTensor` `(T,)`): the fed slot of each draft node.
        depth_ends (`tuple[bool]`, *optional*): per depth, whether the nodes at that depth end a row (host-side;
            set by `for_depths`). A kept path has one node per depth, so its EOLs are known without a device read.
    """

    source: torch.Tensor
    is_eol: torch.Tensor
    view: torch.Tensor
    row_end: Tuple[bool, ...]
    slot: torch.Tensor
    depth_ends: Optional[Tuple[bool, ...]] = None

    @classmethod
    def for_positions(
        cls, layout: ImageTokenLayout, position_ids: torch.Tensor, prefix_length: int
    ) -> Optional["EndOfRowInsertion"]:
        """The insertion for a draft fed at ``position_ids`` ``(T,)``; ``None`` when no fed node ends a row.
        Per-row positions ``(B, T)`` (one tree per row) give a `RowEndOfRowInsertion`.

        Reads the positions on the host: one small device-to-host copy per round. The loop uses it only for drafts
        without host-side depths (`for_depths` needs none).
        """
        if position_ids.dim() == 2:
            return RowEndOfRowInsertion.for_positions(layout, position_ids, prefix_length)
        if position_ids.dim() != 1:
            raise ValueError(f"End-of-row insertion needs positions `(T,)` or `(B, T)`, got shape {tuple(position_ids.shape)}.")
        row_end = tuple(bool(layout.ends_row(p - prefix_length)) for p in position_ids.tolist())
        if not any(row_end):
            return None
        return _insertion(row_end, None, position_ids.device)

    @classmethod
    def for_depths(
        cls, layout: ImageTokenLayout, depths: Tuple[int, ...], root: int, device: torch.device
    ) -> Optional["EndOfRowInsertion"]:
        """The insertion for a draft whose node ``i`` sits at raster index ``root + depths[i]`` (clamped to the last
        code: nodes past the grid are never committed), ``root`` being the newest committed code. Host-side only: no
        device read, here or in `keep_indices`. ``None`` when no fed node ends a row."""
        depth_ends = layout.row_ends_after(root, max(depths) + 1)
        if not any(depth_ends):
            return None
        return _insertion(tuple(depth_ends[d] for d in depths), depth_ends, device)

    def input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``(B, T)`` codes -> ``(B, T')``; EOL slots carry their parent's code (the caller embeds them as EOL)."""
        return input_ids[:, self.source]

    def position_ids(self, position_ids: torch.Tensor) -> torch.Tensor:
        """``(T,)`` -> ``(T',)``: an EOL sits one position after the row's last code."""
        return position_ids[self.source] + self.is_eol.long()

    def attention_mask(self, attention_mask: torch.Tensor) -> torch.Tensor:
        """``(T, T)`` or ``(B, T, T)`` -> ``(T', T')`` or ``(B, T', T')``: a slot sees what its node sees, except
        that a node does not see its own EOL (which comes after it) while the node's descendants and the EOL do."""
        mask = attention_mask[..., self.source, :][..., :, self.source]
        own = self.source[:, None] == self.source[None, :]  # (T', T') slots of the same draft node
        own_eol = own & self.is_eol[None, :] & ~self.is_eol[:, None]  # a node's own EOL comes after it
        return mask & ~own_eol

    def embeds(self, embeds: torch.Tensor, eol_embedding: torch.Tensor) -> torch.Tensor:
        """Put the EOL embedding ``(D,)`` into the EOL slots of ``(R, T', D)``."""
        return torch.where(self.is_eol[None, :, None], eol_embedding.to(embeds.dtype), embeds)

    def outputs(self, fed: torch.Tensor) -> torch.Tensor:
        """``(R, T', ...)`` outputs over the fed slots -> ``(R, T, ...)``: per draft node, the output predicting
        the code after it."""
        return fed[:, self.view]

    def keep_length(self, length: int) -> int:
        """A kept prefix of ``length`` draft nodes -> the fed slots to keep (their EOLs included)."""
        return length + sum(self.row_end[:length])

    def keep_indices(self, keep: torch.Tensor) -> torch.Tensor:
        """Kept draft nodes ``(n,)`` or ``(B, n)`` -> kept fed slots, each row-ending node followed by its EOL.

        Rows keep paths at the same positions (rows advance together), so every row keeps as many EOLs. Built by
        `for_depths`, the path's EOLs follow from its length alone (node ``j`` of a path is at depth ``j``): index
        ops, no device read. Otherwise the indices are read on the host.
        """
        if self.depth_ends is not None:
            pairs = torch.stack([self.slot[keep], self.slot[keep] + 1], -1).flatten(-2)  # (..., 2n): a node, the slot after it
            return pairs[..., _path_slots(self.depth_ends[: keep.shape[-1]], keep.device)]
        first = self.keep_length  # node i's slots are [first(i), first(i + 1)): itself, then its EOL if any
        rows = [
            [s for i in row for s in range(first(i), first(i + 1))] for row in (keep[None] if keep.dim() == 1 else keep).tolist()
        ]
        if len({len(r) for r in rows}) != 1:
            raise ValueError("Rows keep paths that end different numbers of rows; rows must advance together.")
        out = torch.tensor(rows, device=keep.device)
        return out[0] if keep.dim() == 1 else out


def _per_row(x: torch.Tensor, rows: int) -> torch.Tensor:
    """A ``(B, ...)`` table for ``rows`` fed rows (``2B`` with CFG: the unconditional rows verify the same drafts)."""
    return x if rows == x.shape[0] else x.repeat(rows // x.shape[0], *([1] * (x.dim() - 1)))


@dataclass(frozen=True)
class RowEndOfRowInsertion:
    """`EndOfRowInsertion` for drafts whose rows feed different trees (EAGLE-2, ADT-Tree): each row has its own
    row-ending nodes, so each row gets its own slot tables, padded to the row with the most EOLs.

    A pad slot re-feeds the root at the root's position, sees the root and the cache only, is seen by no slot and is
    never kept. Rows still commit the same raster positions, so every row keeps the same number of EOLs.

    Args:
        source (`torch.LongTensor` `(B, T')`): the draft node each fed slot comes from (an EOL: its parent; a pad: 0).
        is_eol (`torch.BoolTensor` `(B, T')`): end-of-row slots.
        is_pad (`torch.BoolTensor` `(B, T')`): padding slots.
        slot (`torch.LongTensor` `(B, T)`): the fed slot of each draft node.
        view (`torch.LongTensor` `(B, T)`): per draft node, the fed slot whose output predicts the code after it.
        row_end (`torch.BoolTensor` `(B, T)`): draft nodes an EOL follows.
        depth_ends (`tuple[bool]`, *optional*): per depth, whether the nodes at that depth end a row (host-side; see
            `for_positions`).
    """

    source: torch.Tensor
    is_eol: torch.Tensor
    is_pad: torch.Tensor
    slot: torch.Tensor
    view: torch.Tensor
    row_end: torch.Tensor
    depth_ends: Optional[Tuple[bool, ...]] = None

    @classmethod
    def for_positions(
        cls, layout: ImageTokenLayout, position_ids: torch.Tensor, prefix_length: int, root: Optional[int] = None
    ) -> Optional["RowEndOfRowInsertion"]:
        """The insertion for per-row positions ``(B, T)``; ``None`` when no row's fed node ends a row. Built with
        tensor ops; one host read (the most EOLs of a row, which sizes the fed length).

        With ``root``, the newest committed code's raster index (the nodes at depth ``d`` of every row's tree sit at
        ``root + d``), the rows whose trees cannot reach a row end (most rounds) are told on the host, with no read,
        and `keep_indices` / `keep_length` need no read either.
        """
        b, t = position_ids.shape
        depth_ends = None
        if root is not None:  # a node's depth is below T: row ends the trees could reach, known on the host
            depth_ends = layout.row_ends_after(root, t)
            if not any(depth_ends):
                return None
        row_end = layout.ends_row(position_ids - prefix_length)  # (B, T)
        extra = int(row_end.sum(1).max())  # the host read
        if extra == 0:
            return None
        ends = row_end.long()
        slot = torch.arange(t, device=row_end.device) + ends.cumsum(1) - ends  # (B, T) EOLs before a node shift it
        width = t + extra
        nodes = torch.arange(t, device=row_end.device).expand(b, t)
        # one spare column takes the writes of nodes without an EOL, then is dropped
        eol_slot = torch.where(row_end, slot + 1, width)  # (B, T)
        source = torch.zeros(b, width + 1, dtype=torch.long, device=row_end.device)
        source.scatter_(1, slot, nodes).scatter_(1, eol_slot, nodes)
        is_eol = torch.zeros(b, width + 1, dtype=torch.bool, device=row_end.device).scatter_(1, eol_slot, True)
        used = torch.zeros(b, width + 1, dtype=torch.bool, device=row_end.device)
        used.scatter_(1, slot, True).scatter_(1, eol_slot, True)
        return cls(source=source[:, :width], is_eol=is_eol[:, :width], is_pad=~used[:, :width], slot=slot,
                   view=slot + ends, row_end=row_end, depth_ends=depth_ends)

    def input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``(B, T)`` -> ``(B, T')``; EOL slots carry their parent's code, pads the root's."""
        return input_ids.gather(1, self.source)

    def position_ids(self, position_ids: torch.Tensor) -> torch.Tensor:
        """``(B, T)`` -> ``(B, T')``: an EOL sits one position after the row's last code; a pad at the root's."""
        return position_ids.gather(1, self.source) + self.is_eol.long()

    def attention_mask(self, attention_mask: torch.Tensor) -> torch.Tensor:
        """``(T, T)`` or ``(B, T, T)`` -> ``(B, T', T')``: as `EndOfRowInsertion.attention_mask`, and no slot sees a pad."""
        b, width = self.source.shape
        mask = attention_mask.expand(b, *attention_mask.shape[-2:])
        t = mask.shape[-1]
        mask = mask.gather(1, self.source[:, :, None].expand(b, width, t)).gather(2, self.source[:, None, :].expand(b, width, width))
        own = self.source[:, :, None] == self.source[:, None, :]  # (B, T', T') slots of the same draft node
        own_eol = own & self.is_eol[:, None, :] & ~self.is_eol[:, :, None]  # a node's own EOL comes after it
        return mask & ~own_eol & ~self.is_pad[:, None, :]

    def embeds(self, embeds: torch.Tensor, eol_embedding: torch.Tensor) -> torch.Tensor:
        """Put the EOL embedding ``(D,)`` into the EOL slots of ``(R, T', D)``."""
        return torch.where(_per_row(self.is_eol, embeds.shape[0])[..., None], eol_embedding.to(embeds.dtype), embeds)

    def outputs(self, fed: torch.Tensor) -> torch.Tensor:
        """``(R, T', ...)`` -> ``(R, T, ...)``: per draft node, the output predicting the code after it."""
        view = _per_row(self.view, fed.shape[0])
        return fed[torch.arange(fed.shape[0], device=fed.device)[:, None], view]

    def keep_length(self, length: int) -> int:
        """A kept prefix of ``length`` draft nodes (a chain: every row ends rows at the same nodes) -> fed slots."""
        if self.depth_ends is not None:  # node j of a chain is at depth j
            return length + sum(self.depth_ends[:length])
        return length + int(self.row_end[0, :length].sum())

    def keep_indices(self, keep: torch.Tensor) -> torch.Tensor:
        """Kept draft nodes ``(n,)`` or ``(B, n)`` -> kept fed slots ``(B, n')``, each row-ending node followed by
        its EOL (one host read, unless built with ``root``: rows must keep as many EOLs)."""
        keep = keep.expand(self.slot.shape[0], -1) if keep.dim() == 1 else keep
        slots = self.slot.gather(1, keep)  # (B, n)
        pairs = torch.stack([slots, slots + 1], -1).flatten(1)  # (B, 2n): a node, then the slot after it
        if self.depth_ends is not None:  # node j of a kept path is at depth j: its EOLs are known on the host
            return pairs[:, _path_slots(self.depth_ends[: keep.shape[1]], keep.device)]
        wanted = torch.stack([torch.ones_like(slots, dtype=torch.bool), self.row_end.gather(1, keep)], -1).flatten(1)
        counts = wanted.sum(1).tolist()
        if len(set(counts)) != 1:
            raise ValueError("Rows keep paths that end different numbers of rows; rows must advance together.")
        return pairs[wanted].reshape(keep.shape[0], counts[0])


@functools.lru_cache(maxsize=256)
def _insertion(row_end: Tuple[bool, ...], depth_ends: Optional[Tuple[bool, ...]], device: torch.device) -> EndOfRowInsertion:
    """Built once per row-end pattern and device: a static tree meets the same few patterns every row, so the
    index tensors are not copied to the device every round."""
    source, is_eol, view, slot = [], [], [], []
    for i, end in enumerate(row_end):
        slot.append(len(source))
        source.append(i)
        is_eol.append(False)
        if end:
            source.append(i)
            is_eol.append(True)
        view.append(len(source) - 1)  # the EOL when there is one, else the node itself
    return EndOfRowInsertion(
        source=torch.tensor(source, device=device),
        is_eol=torch.tensor(is_eol, device=device),
        view=torch.tensor(view, device=device),
        row_end=row_end,
        slot=torch.tensor(slot, device=device),
        depth_ends=depth_ends,
    )


@functools.lru_cache(maxsize=256)
def _path_slots(depth_ends: Tuple[bool, ...], device: torch.device) -> torch.Tensor:
    """Which of a path's (node, slot after it) pairs are kept: every node, and the slot after a row-ending one."""
    return torch.tensor([k for j, end in enumerate(depth_ends) for k in ((2 * j, 2 * j + 1) if end else (2 * j,))], device=device)
