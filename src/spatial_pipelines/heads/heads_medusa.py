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

from ..core.contracts import OFFSET_LOGITS
from ..utils import tensor_stamp
from .heads_utils import DraftHeadsMixin, check_heads_args, check_heads_size, check_offsets


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
        family (`str`, *optional*): the backbone's family (``"llamagen"``, ``"janus"``, ...); heads that record
            one are refused by a backbone of another family.
        horizontal_offsets (`list[int]`): raster offsets of the horizontal heads (Medusa: ``1..K``).
        vertical_offsets (`list[int]`): row offsets of the vertical heads (Hawk: ``1..VSD``; empty for Medusa).
        num_layers (`int`): ResBlocks per head.
    """

    kind = OFFSET_LOGITS

    @register_to_config
    def __init__(self, base_model_name_or_path: Optional[str] = None, base_model_revision: Optional[str] = None,
                 hidden_size: int = 1280, num_image_codes: int = 16384, grid_height: int = 16, grid_width: int = 16,
                 horizontal_offsets: Sequence[int] = (1, 2, 3, 4), vertical_offsets: Sequence[int] = (),
                 num_layers: int = 1, family: Optional[str] = None):
        super().__init__()
        check_heads_args(base_model_name_or_path, base_model_revision, family=family,
                         ints=[("hidden_size", hidden_size), ("num_image_codes", num_image_codes), ("grid_height", grid_height),
                               ("grid_width", grid_width), ("num_layers", num_layers)])
        check_offsets(horizontal_offsets, vertical_offsets)
        count = len(horizontal_offsets) + len(vertical_offsets)
        check_heads_size(type(self).__name__, count * num_layers * (hidden_size + 1) * hidden_size,
                         [("hidden_size", hidden_size), ("num_layers", num_layers), ("heads", count)])

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
        horizontal = range(len(self.horizontal)) if horizontal is None else list(horizontal)
        vertical = range(len(self.vertical)) if vertical is None else list(vertical)
        heads = [self.horizontal[i] for i in horizontal] + [self.vertical[i] for i in vertical]
        if not (self.training or self.config.num_layers != 1 or not heads):
            return self.frozen(horizontal, vertical)(hidden_states)  # inference: one matmul over the stacked weights
        empty = hidden_states.new_zeros(hidden_states.shape[0], 0, hidden_states.shape[-1])  # (B, 0, D)
        out = torch.stack([h(hidden_states) for h in heads], 1) if heads else empty  # (B, K, D)
        return out[:, : len(horizontal)], out[:, len(horizontal) :]

    def frozen(self, horizontal: Sequence[int], vertical: Sequence[int]):
        """The heads ``horizontal`` and ``vertical`` (indices) as a function of post-norm hidden states ``(B, D)``,
        their weights looked up once: what a round compiled whole calls (`MedusaDrafter`, `HawkDrafter`), with no check of
        the weights' version counters inside it. Made per generation: a later weight change needs a new one."""
        horizontal, vertical = list(horizontal), list(vertical)
        heads = [self.horizontal[i] for i in horizontal] + [self.vertical[i] for i in vertical]
        if self.training or self.config.num_layers != 1 or not heads:
            return lambda hidden_states: self(hidden_states, horizontal, vertical)
        # every head's ResBlock in one matmul over the stacked weights (one op instead of three per head)
        weight, bias = self._stacked(tuple(horizontal), tuple(vertical), heads)  # (K * D, D), (K * D,)
        n, k = len(horizontal), len(heads)

        def run(hidden_states: torch.Tensor):
            b, d = hidden_states.shape
            mixed = torch.nn.functional.linear(hidden_states, weight, bias).view(b, k, d)  # (B, K, D)
            out = hidden_states[:, None] + torch.nn.functional.silu(mixed)
            return out[:, :n], out[:, n:]

        return run

    def _stacked(self, horizontal, vertical, heads):
        """The heads' ResBlock weights stacked ``(K * D_out, D_in)`` and biases ``(K * D,)`` (one plain linear: faster
        than a batched einsum for a few rows), rebuilt only when a weight changed (`tensor_stamp`: ``.to()`` keeps the
        parameter and its version counter, not its storage) or other heads are asked for."""
        linears = [h[0].linear for h in heads]
        key = (horizontal, vertical, tuple((id(p), tensor_stamp(p)) for l in linears for p in (l.weight, l.bias)))
        cached = self.__dict__.get("_stacked_cache")
        if cached is None or cached[0] != key:
            with torch.no_grad():
                cached = (key, torch.cat([l.weight for l in linears]), torch.cat([l.bias for l in linears]))
            self.__dict__["_stacked_cache"] = cached
        return cached[1], cached[2]

    def horizontal_index(self, offset: int) -> int:
        return list(self.config.horizontal_offsets).index(offset)

    def vertical_index(self, offset: int) -> int:
        return list(self.config.vertical_offsets).index(offset)
