"""LlamaGen's VQ tokenizer (the VQ-16 / VQ-8 structure): conv encoder/decoder and an L2-normalised codebook.

Module names follow the original ``vq_model.py`` (``encoder.conv_blocks.N.res.M``, ``quantize.embedding``,
``quant_conv``, ``post_quant_conv`` ...), so original checkpoints load after dropping training-only buffers.
"""

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from diffusers.utils import BaseOutput
from torch import nn

from ..utils import CheckedSaveMixin
from ..weight_checks import CheckedLoadMixin
from .vq_blocks import AttnBlock, ResnetBlock, VQAutoencoderMixin, code_distances, decoder_stages, encoder_stages, vq_norm


def _mid(channels: int, groups: int, dropout: float) -> nn.Sequential:
    """The middle block, ``mid.0`` / ``mid.1`` / ``mid.2`` as in the original."""
    return nn.Sequential(
        ResnetBlock(channels, channels, groups, dropout), AttnBlock(channels, groups), ResnetBlock(channels, channels, groups, dropout)
    )


class Encoder(nn.Module):
    def __init__(self, in_channels, ch, ch_mult, num_res_blocks, z_channels, groups, dropout):
        super().__init__()
        self.conv_in = nn.Conv2d(in_channels, ch, 3, padding=1)
        attn = [level == len(ch_mult) - 1 for level in range(len(ch_mult))]  # attention at the coarsest level only
        self.conv_blocks = encoder_stages(ch, ch_mult, num_res_blocks, attn, groups, dropout, "res")
        block_in = ch * ch_mult[-1]
        self.mid = _mid(block_in, groups, dropout)
        self.norm_out = vq_norm(block_in, groups)
        self.conv_out = nn.Conv2d(block_in, z_channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(x)
        for stage in self.conv_blocks:
            h = stage(h)
        return self.conv_out(F.silu(self.norm_out(self.mid(h))))


class Decoder(nn.Module):
    def __init__(self, z_channels, ch, ch_mult, num_res_blocks, out_channels, groups, dropout):
        super().__init__()
        block_in = ch * ch_mult[-1]
        self.conv_in = nn.Conv2d(z_channels, block_in, 3, padding=1)
        self.mid = _mid(block_in, groups, dropout)
        attn = [level == len(ch_mult) - 1 for level in range(len(ch_mult))]
        self.conv_blocks = nn.ModuleList(decoder_stages(ch, ch_mult, num_res_blocks + 1, attn, groups, dropout, "res"))
        self.norm_out = vq_norm(ch * ch_mult[0], groups)
        self.conv_out = nn.Conv2d(ch * ch_mult[0], out_channels, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.mid(self.conv_in(z))
        for stage in self.conv_blocks:  # coarsest first
            h = stage(h)
        return self.conv_out(F.silu(self.norm_out(h)))


@dataclass
class VQEncoderOutput(BaseOutput):
    """
    Args:
        quant (`torch.Tensor` `(B, d, h, w)`): quantised latents (straight-through gradients).
        indices (`torch.LongTensor` `(B, h, w)`): code indices.
        vq_loss, commit_loss, entropy_loss (`torch.Tensor`): codebook, commitment and entropy losses.
    """

    quant: torch.Tensor
    indices: Optional[torch.Tensor] = None
    vq_loss: Optional[torch.Tensor] = None
    commit_loss: Optional[torch.Tensor] = None
    entropy_loss: Optional[torch.Tensor] = None


def _entropy_loss(affinity: torch.Tensor, temperature: float = 0.01) -> torch.Tensor:
    """Per-sample entropy minus batch entropy of the soft code assignment (encourages codebook usage)."""
    logits = affinity.reshape(-1, affinity.shape[-1]) / temperature
    probs = logits.softmax(-1)
    avg = probs.mean(0)
    return -(probs * logits.log_softmax(-1)).sum(-1).mean() + (avg * torch.log(avg + 1e-5)).sum()


class LlamaGenVQModel(CheckedLoadMixin, CheckedSaveMixin, ModelMixin, ConfigMixin, VQAutoencoderMixin):
    r"""LlamaGen's VQ image tokenizer.

    Args:
        codebook_size (`int`), codebook_embed_dim (`int`): codes and their width (VQ-16: 16384 x 8).
        codebook_l2_norm (`bool`): compare and decode with L2-normalised latents and codes.
        commit_loss_beta (`float`), entropy_loss_ratio (`float`): training loss weights.
        encoder_ch_mult, decoder_ch_mult (`tuple[int]`): channel multipliers; ``len - 1`` halvings.
        z_channels (`int`), base_channels (`int`), num_res_blocks (`int`): trunk size.
        norm_num_groups (`int`): GroupNorm groups (32 in the original).
    """

    @register_to_config
    def __init__(self, codebook_size: int = 16384, codebook_embed_dim: int = 8, codebook_l2_norm: bool = True,
                 commit_loss_beta: float = 0.25, entropy_loss_ratio: float = 0.0,
                 encoder_ch_mult: Sequence[int] = (1, 1, 2, 2, 4), decoder_ch_mult: Sequence[int] = (1, 1, 2, 2, 4),
                 z_channels: int = 256, base_channels: int = 128, num_res_blocks: int = 2, norm_num_groups: int = 32,
                 in_channels: int = 3, out_channels: int = 3, dropout: float = 0.0):
        super().__init__()
        if len(encoder_ch_mult) != len(decoder_ch_mult):
            raise ValueError("`encoder_ch_mult` and `decoder_ch_mult` must have the same length (same downsampling).")
        g = norm_num_groups
        self.encoder = Encoder(in_channels, base_channels, encoder_ch_mult, num_res_blocks, z_channels, g, dropout)
        self.decoder = Decoder(z_channels, base_channels, decoder_ch_mult, num_res_blocks, out_channels, g, dropout)
        self.add_quantizer(codebook_size, codebook_embed_dim, z_channels, codebook_l2_norm)

    @property
    def downsample_factor(self) -> int:
        return 2 ** (len(self.config.encoder_ch_mult) - 1)

    def encode(self, pixels: torch.Tensor) -> VQEncoderOutput:
        """Images in [-1, 1] ``(B, 3, H, W)`` -> nearest codes and losses."""
        z = self.quant_conv(self.encoder(pixels)).permute(0, 2, 3, 1)  # (B, h, w, d)
        if self.config.codebook_l2_norm:
            z = F.normalize(z, dim=-1)
        dist = code_distances(z.reshape(-1, z.shape[-1]), self.codebook)  # (N, V)
        indices = dist.argmin(dim=1)
        z_q = self.codebook[indices].view(z.shape)
        vq_loss = torch.mean((z_q - z.detach()) ** 2)
        commit_loss = self.config.commit_loss_beta * torch.mean((z_q.detach() - z) ** 2)
        entropy = self.config.entropy_loss_ratio * _entropy_loss(-dist) if self.config.entropy_loss_ratio > 0 else dist.new_zeros(())
        z_q = z + (z_q - z).detach()  # straight-through
        return VQEncoderOutput(quant=z_q.permute(0, 3, 1, 2), indices=indices.view(z.shape[:3]), vq_loss=vq_loss,
                               commit_loss=commit_loss, entropy_loss=entropy)

    def decode_code(self, codes: torch.Tensor) -> torch.Tensor:
        """Code grid ``(B, h, w)`` -> images ``(B, 3, h * f, w * f)``."""
        return self.decode(self.codebook[codes].permute(0, 3, 1, 2))  # (B, d, h, w) quantised latents

    def forward(self, pixels: torch.Tensor) -> Tuple[torch.Tensor, VQEncoderOutput]:
        enc = self.encode(pixels)
        return self.decode(enc.quant), enc
