"""SSD's latent draft heads: predict the backbone's own **pre-norm** hidden state at a spatial offset.

One predictor per offset and direction (paper, eq. 2)::

    z = [h_j ; e(x_j)]                          # pre-norm hidden state that predicted code j, embedding of code j
    f(z) = W0 z + SwiGLU(RMSNorm(W0 z))         # W0: (D, 2D); SwiGLU(u) = W2 (SiLU(W1 u) * W3 u)

A horizontal predictor with offset ``k`` predicts ``h_{j+k}`` (so code ``j + k`` through the backbone's own final
norm and image-code head); a vertical predictor with offset ``d`` predicts ``h_{j + d*W}``, the code ``d`` rows
below. The heads never see the target's logits: they are trained with SmoothL1 against the frozen backbone's
hidden states (``scripts/train_heads.py --kind ssd``).
"""

from typing import Optional, Sequence

import torch
from diffusers.configuration_utils import register_to_config
from torch import nn

from ..core.contracts import LATENT
from .heads_utils import DraftHeadsMixin, check_heads_args, check_heads_size, check_offsets

DIRECTIONS = ("horizontal", "vertical")


class LatentPredictor(nn.Module):
    """``f(z) = W0 z + SwiGLU(RMSNorm(W0 z))`` with bias-free projections.

    Initialised as "copy the source hidden state": ``W0 = [I, 0]`` and ``W2 = 0`` (an untrained predictor drafts
    the code its source position predicted, a sensible first guess for neighbouring image codes).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, eps: float = 1e-5):
        super().__init__()
        self.w0 = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.norm = nn.RMSNorm(hidden_size, eps=eps)
        self.w1 = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.w3 = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.w2 = nn.Linear(intermediate_size, hidden_size, bias=False)
        with torch.no_grad():
            self.w0.weight.zero_()
            self.w0.weight[:, :hidden_size].copy_(torch.eye(hidden_size))
            self.w2.weight.zero_()

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        x = self.w0(z)  # (..., D)
        u = self.norm(x)
        return x + self.w2(nn.functional.silu(self.w1(u)) * self.w3(u))  # (..., D)


class LatentDraftHeads(DraftHeadsMixin):
    r"""Horizontal and vertical latent predictors (SSD).

    Args:
        base_model_name_or_path (`str`, *optional*), base_model_revision (`str`, *optional*): the backbone.
        hidden_size (`int`), num_image_codes (`int`), grid_height (`int`), grid_width (`int`): backbone facts.
        family (`str`, *optional*): the backbone's family (``"llamagen"``, ``"janus"``, ...); heads that record
            one are refused by a backbone of another family.
        horizontal_offsets (`list[int]`): raster offsets of the horizontal predictors (default ``1..5``).
        vertical_offsets (`list[int]`): row offsets of the vertical predictors (default ``1..2``).
        intermediate_size (`int`, *optional*): SwiGLU width ``m`` (default ``2 * hidden_size``, as the paper).
        rms_norm_eps (`float`): epsilon of the predictors' RMSNorm.
    """

    kind = LATENT

    @register_to_config
    def __init__(self, base_model_name_or_path: Optional[str] = None, base_model_revision: Optional[str] = None,
                 hidden_size: int = 1280, num_image_codes: int = 16384, grid_height: int = 16, grid_width: int = 16,
                 horizontal_offsets: Sequence[int] = (1, 2, 3, 4, 5), vertical_offsets: Sequence[int] = (1, 2),
                 intermediate_size: Optional[int] = None, rms_norm_eps: float = 1e-5, family: Optional[str] = None):
        super().__init__()
        check_heads_args(base_model_name_or_path, base_model_revision, family=family,
                         ints=[("hidden_size", hidden_size), ("num_image_codes", num_image_codes), ("grid_height", grid_height),
                               ("grid_width", grid_width)],
                         optional_ints=[("intermediate_size", intermediate_size)], positives=[("rms_norm_eps", rms_norm_eps)])
        check_offsets(horizontal_offsets, vertical_offsets)
        m = intermediate_size or 2 * hidden_size
        count = len(horizontal_offsets) + len(vertical_offsets)
        check_heads_size(type(self).__name__, count * (2 * hidden_size * hidden_size + hidden_size + 3 * hidden_size * m),
                         [("hidden_size", hidden_size), ("intermediate_size", m), ("predictors", count)])
        self.horizontal = nn.ModuleList(LatentPredictor(hidden_size, m, rms_norm_eps) for _ in horizontal_offsets)
        self.vertical = nn.ModuleList(LatentPredictor(hidden_size, m, rms_norm_eps) for _ in vertical_offsets)

    def predictors(self, direction: str) -> nn.ModuleList:
        if direction not in DIRECTIONS:
            raise ValueError(f"`direction` must be one of {DIRECTIONS}, got {direction!r}.")
        return self.horizontal if direction == "horizontal" else self.vertical

    def offsets(self, direction: str) -> list:
        return list(self.config.horizontal_offsets if direction == "horizontal" else self.config.vertical_offsets)

    def forward(self, hidden_states: torch.Tensor, token_embeds: torch.Tensor, direction: str,
                num_offsets: Optional[int] = None) -> torch.Tensor:
        """Pre-norm hidden states ``(..., D)`` and the embeddings of the codes they predicted ``(..., D)`` ->
        predicted pre-norm hidden states ``(..., K, D)`` for the first ``num_offsets`` offsets of ``direction``."""
        heads = self.predictors(direction)
        k = len(heads) if num_offsets is None else num_offsets
        dtype = heads[0].w0.weight.dtype  # heads may run in another precision than the trunk
        z = torch.cat([hidden_states.to(dtype), token_embeds.to(dtype)], dim=-1)  # (..., 2D)
        return torch.stack([heads[i](z) for i in range(k)], dim=-2)  # (..., K, D)

    def draft_logits(self, backbone, hidden_states: torch.Tensor, codes: torch.Tensor, direction: str, num_offsets: int,
                     source_index: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Draft logits through the backbone's own final norm and image-code head.

        Args:
            backbone: the family adapter (``embed_image_tokens``, ``image_logits``).
            hidden_states (`torch.Tensor` `(B, n, D)`): pre-norm hidden states that predicted ``codes``.
            codes (`torch.LongTensor` `(B, n)`): the codes committed at those positions.
            direction (`str`): ``"horizontal"`` or ``"vertical"``.
            num_offsets (`int`): use the first ``num_offsets`` offsets of that direction.
            source_index (`torch.LongTensor` `(n,)`, *optional*): raster index of each source (unused here; a
                subclass, e.g. an oracle in tests, may read it).

        Returns:
            `torch.Tensor` `(B, n, K, V)` fp32 logits.
        """
        predicted = self(hidden_states, backbone.embed_image_tokens(codes), direction, num_offsets)  # (B, n, K, D)
        return backbone.image_logits(predicted.flatten(1, 2)).unflatten(1, predicted.shape[1:3])  # (B, n, K, V)
