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

    One form serves every draft: the tables have a leading dimension ``N``, one row of tables per fed tree. A draft
    that every batch row shares (a tree or a window, `for_depths`) has ``N = 1``, and its one row serves every batch
    row by broadcasting; a draft with one tree per batch row (EAGLE-2, ADT-Tree, `for_positions`) has ``N = B``, each
    row with its own row-ending nodes, padded to the row with the most EOLs. A pad slot re-feeds the root at the
    root's position, sees the root and the cache only, is seen by no slot and is never kept. Rows still commit the
    same raster positions, so every row keeps the same number of EOLs.

    Args:
        source (`torch.LongTensor` `(N, T')`): the draft node each fed slot comes from (an EOL: its parent; a pad: 0).
        is_eol (`torch.BoolTensor` `(N, T')`): end-of-row slots.
        is_pad (`torch.BoolTensor` `(N, T')`): padding slots.
        slot (`torch.LongTensor` `(N, T)`): the fed slot of each draft node.
        view (`torch.LongTensor` `(N, T)`): per draft node, the fed slot whose output predicts the code after it.
        row_end (`torch.BoolTensor` `(N, T)`): draft nodes an EOL follows.
        depth_ends (`tuple[bool]`, *optional*): per depth, whether the nodes at that depth end a row (host-side). A
            kept path has one node per depth, so with it the kept slots are known without a device read.
    """

    source: torch.Tensor
    is_eol: torch.Tensor
    is_pad: torch.Tensor
    slot: torch.Tensor
    view: torch.Tensor
    row_end: torch.Tensor
    depth_ends: Optional[Tuple[bool, ...]] = None

    @classmethod
    def for_depths(
        cls, layout: ImageTokenLayout, depths: Tuple[int, ...], root: int, device: torch.device
    ) -> Optional["EndOfRowInsertion"]:
        """The insertion for a draft every batch row shares, whose node ``i`` sits at raster index
        ``root + depths[i]`` (clamped to the last code: nodes past the grid are never committed), ``root`` being the
        newest committed code. Host-side only: no device read, here or in `keep_indices`. ``None`` when no fed node
        ends a row."""
        depth_ends = layout.row_ends_after(root, max(depths) + 1)
        if not any(depth_ends):
            return None
        return _insertion(tuple(depth_ends[d] for d in depths), depth_ends, device)

    @classmethod
    def for_positions(
        cls, layout: ImageTokenLayout, position_ids: torch.Tensor, prefix_length: int, root: Optional[int] = None
    ) -> Optional["EndOfRowInsertion"]:
        """The insertion for drafts fed at ``position_ids`` ``(N, T)``, one tree per row (``N = 1``: one tree every
        row shares); ``None`` when no row's fed node ends a row. Built with tensor ops; one host read (the most EOLs
        of a row, which sizes the fed length).

        With ``root``, the newest committed code's raster index (the nodes at depth ``d`` of every row's tree sit at
        ``root + d``), the rounds whose trees cannot reach a row end (most rounds) are told on the host, with no read,
        and `keep_indices` / `keep_length` need no read either.
        """
        n, t = position_ids.shape
        depth_ends = None
        if root is not None:  # a node's depth is below T: row ends the trees could reach, known on the host
            depth_ends = layout.row_ends_after(root, t)
            if not any(depth_ends):
                return None
        row_end = layout.ends_row(position_ids - prefix_length)  # (N, T)
        extra = int(row_end.sum(1).max())  # the host read
        if extra == 0:
            return None
        return _tables(row_end, extra, depth_ends)

    def _rows(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        """A ``(N, ...)`` table for ``rows`` rows: as it is for ``N = 1`` (it broadcasts) or ``N = rows``, repeated
        for ``2B`` CFG rows (the unconditional rows verify the same drafts)."""
        n = x.shape[0]
        return x if n in (1, rows) else x.repeat(rows // n, *([1] * (x.dim() - 1)))

    def input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``(B, T)`` -> ``(B, T')``; EOL slots carry their parent's code, pads the root's."""
        return input_ids.gather(1, self.source.expand(input_ids.shape[0], -1))

    def position_ids(self, position_ids: torch.Tensor) -> torch.Tensor:
        """``(T,)`` (a shared draft) or ``(B, T)`` -> ``(T',)`` or ``(B, T')``: an EOL sits one position after the
        row's last code; a pad at the root's."""
        per_tree = position_ids.reshape(self.source.shape[0], -1)  # (N, T)
        fed = per_tree.gather(1, self.source) + self.is_eol.long()  # (N, T')
        return fed.reshape(*position_ids.shape[:-1], -1)

    def attention_mask(self, attention_mask: torch.Tensor) -> torch.Tensor:
        """``(T, T)`` (a shared draft) or ``(B, T, T)`` -> ``(T', T')`` or ``(B, T', T')``: a slot sees what its node
        sees, except that a node does not see its own EOL (which comes after it) while the node's descendants and the
        EOL do; no slot sees a pad."""
        n, width = self.source.shape
        t = attention_mask.shape[-1]
        mask = attention_mask.expand(n, t, t)
        mask = mask.gather(1, self.source[:, :, None].expand(n, width, t)).gather(2, self.source[:, None, :].expand(n, width, width))
        own = self.source[:, :, None] == self.source[:, None, :]  # (N, T', T') slots of the same draft node
        own_eol = own & self.is_eol[:, None, :] & ~self.is_eol[:, :, None]  # a node's own EOL comes after it
        return (mask & ~own_eol & ~self.is_pad[:, None, :]).reshape(*attention_mask.shape[:-2], width, width)

    def embeds(self, embeds: torch.Tensor, eol_embedding: torch.Tensor) -> torch.Tensor:
        """Put the EOL embedding ``(D,)`` into the EOL slots of ``(R, T', D)``."""
        return torch.where(self._rows(self.is_eol, embeds.shape[0])[..., None], eol_embedding.to(embeds.dtype), embeds)

    def outputs(self, fed: torch.Tensor) -> torch.Tensor:
        """``(R, T', ...)`` outputs over the fed slots -> ``(R, T, ...)``: per draft node, the output predicting the
        code after it."""
        if self.view.shape[0] == 1:  # one tree for every row: a plain column index, no row index built per round
            return fed[:, self.view[0]]
        view = self._rows(self.view, fed.shape[0])  # (R, T)
        return fed[torch.arange(fed.shape[0], device=fed.device)[:, None], view]

    def keep_length(self, length: int) -> int:
        """A kept prefix of ``length`` draft nodes (a chain: every row ends rows at the same nodes) -> fed slots."""
        if self.depth_ends is not None:  # node j of a chain is at depth j
            return length + sum(self.depth_ends[:length])
        return length + int(self.row_end[0, :length].sum())

    def keep_indices(self, keep: torch.Tensor) -> torch.Tensor:
        """Kept draft nodes ``(B, n)`` -> kept fed slots ``(B, n')``, each row-ending node followed by its EOL.

        The rows of one decoder state keep paths at the same positions (they share a cursor), so every row keeps as many EOLs. With
        `depth_ends` the path's EOLs follow from its length alone (node ``j`` of a path is at depth ``j``): index
        ops, no device read. Otherwise the indices are read on the host.
        """
        b = keep.shape[0]
        slots = self.slot.expand(b, -1).gather(1, keep)  # (B, n)
        pairs = torch.stack([slots, slots + 1], -1).flatten(1)  # (B, 2n): a node, then the slot after it
        if self.depth_ends is not None:
            return pairs[:, _path_slots(self.depth_ends[: keep.shape[1]], keep.device)]
        wanted = torch.stack([torch.ones_like(slots, dtype=torch.bool), self.row_end.expand(b, -1).gather(1, keep)], -1).flatten(1)
        counts = wanted.sum(1).tolist()
        if len(set(counts)) != 1:
            raise ValueError("Rows keep paths that end different numbers of rows; the rows of one state share a cursor.")
        return pairs[wanted].reshape(b, counts[0])


def _tables(row_end: torch.Tensor, extra: int, depth_ends: Optional[Tuple[bool, ...]]) -> EndOfRowInsertion:
    """The slot tables of `EndOfRowInsertion` from the row-ending nodes ``(N, T)`` of each tree, ``extra`` being the
    most EOLs of one tree (host int: it sizes the fed length ``T' = T + extra``)."""
    n, t = row_end.shape
    device = row_end.device
    ends = row_end.long()
    slot = torch.arange(t, device=device) + ends.cumsum(1) - ends  # (N, T) EOLs before a node shift it
    width = t + extra
    nodes = torch.arange(t, device=device).expand(n, t)
    # one spare column takes the writes of nodes without an EOL, then is dropped
    eol_slot = torch.where(row_end, slot + 1, width)  # (N, T)
    source = torch.zeros(n, width + 1, dtype=torch.long, device=device)
    source.scatter_(1, slot, nodes).scatter_(1, eol_slot, nodes)
    is_eol = torch.zeros(n, width + 1, dtype=torch.bool, device=device).scatter_(1, eol_slot, True)
    used = torch.zeros(n, width + 1, dtype=torch.bool, device=device)
    used.scatter_(1, slot, True).scatter_(1, eol_slot, True)
    return EndOfRowInsertion(source=source[:, :width], is_eol=is_eol[:, :width], is_pad=~used[:, :width], slot=slot,
                             view=slot + ends, row_end=row_end, depth_ends=depth_ends)


@functools.lru_cache(maxsize=256)
def _insertion(row_end: Tuple[bool, ...], depth_ends: Tuple[bool, ...], device: torch.device) -> EndOfRowInsertion:
    """The insertion of a shared draft (``N = 1``), built once per row-end pattern and device: a static tree meets the
    same few patterns every row, so the index tensors are not built and copied to the device every round."""
    return _tables(torch.tensor([row_end], device=device), sum(row_end), depth_ends)


@functools.lru_cache(maxsize=256)
def _path_slots(depth_ends: Tuple[bool, ...], device: torch.device) -> torch.Tensor:
    """Which of a path's (node, slot after it) pairs are kept: every node, and the slot after a row-ending one."""
    return torch.tensor([k for j, end in enumerate(depth_ends) for k in ((2 * j, 2 * j + 1) if end else (2 * j,))], device=device)
