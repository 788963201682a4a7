"""Where the image tokens of an AR image model sit in its sequence.

An image of ``height x width`` VQ codes is emitted in raster order. Some families (Emu3, Lumina-mGPT) feed
an end-of-row (EOL) token after every row, so consecutive rows are ``row_stride = width + 1`` sequence
positions apart. Everything before the first image token (text, BOI, resolution tokens) is the prefix.
"""

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
