"""Medusa-style draft heads with spatial offsets (Medusa and Hawk).

Each head is a stack of ResBlocks (``x + SiLU(W x + b)``, ``W`` zero-initialised, so an untrained head starts
as the identity) on the backbone's last **post-norm** hidden state; its output goes through the backbone's own
image-code head. A horizontal head with offset ``k`` drafts the code ``k`` raster positions after the code the
backbone predicts at that step; a vertical head with offset ``d`` drafts the code ``d`` rows below it.
"""

from typing import Optional, Sequence

import torch
from diffusers.configuration_utils import register_to_config
from torch import nn

from .heads_utils import DraftHeadsMixin, check_offsets


class ResBlock(nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


class SpatialDraftHeads(DraftHeadsMixin):
    r"""Horizontal and vertical Medusa heads.

    Args:
        base_model_name_or_path (`str`, *optional*), base_model_revision (`str`, *optional*): the backbone.
        hidden_size (`int`), num_image_codes (`int`), grid_height (`int`), grid_width (`int`): backbone facts.
        horizontal_offsets (`list[int]`): raster offsets of the horizontal heads (Medusa: ``1..K``).
        vertical_offsets (`list[int]`): row offsets of the vertical heads (Hawk: ``1..VSD``; empty for Medusa).
        num_layers (`int`): ResBlocks per head.
    """

    @register_to_config
    def __init__(
        self,
        base_model_name_or_path: Optional[str] = None,
        base_model_revision: Optional[str] = None,
        hidden_size: int = 1280,
        num_image_codes: int = 16384,
        grid_height: int = 16,
        grid_width: int = 16,
        horizontal_offsets: Sequence[int] = (1, 2, 3, 4),
        vertical_offsets: Sequence[int] = (),
        num_layers: int = 1,
    ):
        super().__init__()
        check_offsets(horizontal_offsets, vertical_offsets)

        def head():
            return nn.Sequential(*[ResBlock(hidden_size) for _ in range(num_layers)])

        self.horizontal = nn.ModuleList(head() for _ in horizontal_offsets)
        self.vertical = nn.ModuleList(head() for _ in vertical_offsets)

    def forward(self, hidden_states: torch.Tensor, horizontal: Optional[Sequence[int]] = None, vertical: Optional[Sequence[int]] = None):
        """Post-norm hidden states ``(B, D)`` -> head features ``(B, H_h, D)`` and ``(B, H_v, D)`` (for the
        backbone's output head).

        Args:
            horizontal, vertical (`list[int]`, *optional*): indices of the heads to run, in the order wanted (default:
                all); a decoder runs only the heads it drafts with.
        """
        empty = hidden_states.new_zeros(hidden_states.shape[0], 0, hidden_states.shape[-1])  # (B, 0, D)
        hs = list(self.horizontal) if horizontal is None else [self.horizontal[i] for i in horizontal]
        vs = list(self.vertical) if vertical is None else [self.vertical[i] for i in vertical]
        return (torch.stack([h(hidden_states) for h in hs], 1) if hs else empty,
                torch.stack([h(hidden_states) for h in vs], 1) if vs else empty)

    def horizontal_index(self, offset: int) -> int:
        return list(self.config.horizontal_offsets).index(offset)

    def vertical_index(self, offset: int) -> int:
        return list(self.config.vertical_offsets).index(offset)
