"""What a generation returns: the images and code grids (`SpatialPipelineOutput`) and what it cost (`DecodingStats`)."""

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Union

import numpy as np
import PIL.Image
import torch
from diffusers.utils import BaseOutput


@dataclass
class DecodingStats:
    """What one generation cost.

    Args:
        num_forward_passes (`int`): target forward passes, prefill included.
        num_draft_passes (`int`): forward passes of draft heads or draft models.
        num_tokens (`int`): image codes generated over the whole batch.
        mean_accepted_length (`float`): codes committed per target pass per row: every row's codes over the passes
            that row took (a row that finished early is not charged for the passes the batch ran after it).
        accepted_lengths (`torch.LongTensor` `(num_forward_passes, B)`): codes committed by each pass in each row
            (``0`` in the passes after a row finished).
        acceptance_map (`torch.LongTensor` `(B, H, W)`): accepted length of the pass that committed each code.
        wall_time_s (`float`): wall-clock seconds of the whole call.
        padded_fraction (`float`, *optional*): with static shapes (`SpatialARPipeline.static_shapes`) or several
            images, the share of the slots the rounds fed to the target that were padding (the price of one
            fixed-shape step, of rows whose drafts are narrower than the widest, and of rows already finished).
        row_forward_passes (`list[int]`): per image, the target passes it took (prefill included): what it takes
            alone. Every row advances on its own, so ``num_forward_passes`` is their maximum.
        decoder_stats (`dict`): what the decoder reports about its own rounds (its loop's ``report``). EAGLE-2 and
            ADT-Tree report ``mean_tree_depth`` (mean depth of the trees verified, over passes and rows) and
            ``mean_tree_width`` (the same for the ``top_k`` the trees were grown with); other decoders report
            nothing. A new decoder reports here without a new field.
    """

    num_forward_passes: int
    num_draft_passes: int
    num_tokens: int
    mean_accepted_length: float
    accepted_lengths: torch.Tensor
    acceptance_map: torch.Tensor
    wall_time_s: float
    padded_fraction: Optional[float] = None
    row_forward_passes: List[int] = field(default_factory=list)
    decoder_stats: Dict[str, float] = field(default_factory=dict)


@dataclass
class SpatialPipelineOutput(BaseOutput):
    """
    Args:
        images (`list[PIL.Image.Image]`, `np.ndarray` or `torch.Tensor`): the images; with
            ``output_type="latent"`` the token grids.
        tokens (`torch.LongTensor` `(B, H, W)`): codebook indices.
        stats (`DecodingStats`): passes, acceptance and time.
    """

    images: Union[List[PIL.Image.Image], np.ndarray, torch.Tensor]
    tokens: torch.Tensor
    stats: DecodingStats
