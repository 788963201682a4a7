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


def _norm(channels: int, groups: int) -> nn.GroupNorm:
    return nn.GroupNorm(num_groups=groups, num_channels=channels, eps=1e-6, affine=True)


class ResnetBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, groups: int, dropout: float = 0.0):
        super().__init__()
        self.norm1 = _norm(in_channels, groups)
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, padding=1)
        self.norm2 = _norm(out_channels, groups)
        self.dropout = nn.Dropout(dropout)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1)
        if in_channels != out_channels:
            self.nin_shortcut = nn.Conv2d(in_channels, out_channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(self.dropout(F.silu(self.norm2(h))))
        if hasattr(self, "nin_shortcut"):
            x = self.nin_shortcut(x)
        return x + h


class AttnBlock(nn.Module):
    """Single-head self-attention over the spatial positions."""

    def __init__(self, channels: int, groups: int):
        super().__init__()
        self.norm = _norm(channels, groups)
        self.q = nn.Conv2d(channels, channels, 1)
        self.k = nn.Conv2d(channels, channels, 1)
        self.v = nn.Conv2d(channels, channels, 1)
        self.proj_out = nn.Conv2d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        n = self.norm(x)
        q, k, v = (m(n).reshape(b, 1, c, h * w).transpose(-1, -2) for m in (self.q, self.k, self.v))  # (B, 1, HW, C)
        out = F.scaled_dot_product_attention(q, k, v).transpose(-1, -2).reshape(b, c, h, w)
        return x + self.proj_out(out)


class Downsample(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, stride=2, padding=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (0, 1, 0, 1)))  # asymmetric padding, as taming-transformers


class Upsample(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


def _stage(num_blocks: int, block_in: int, block_out: int, with_attn: bool, groups: int, dropout: float):
    stage = nn.Module()
    stage.res = nn.ModuleList()
    stage.attn = nn.ModuleList()
    for _ in range(num_blocks):
        stage.res.append(ResnetBlock(block_in, block_out, groups, dropout))
        block_in = block_out
        if with_attn:
            stage.attn.append(AttnBlock(block_in, groups))
    return stage


def _mid(channels: int, groups: int, dropout: float) -> nn.ModuleList:
    return nn.ModuleList(
        [ResnetBlock(channels, channels, groups, dropout), AttnBlock(channels, groups), ResnetBlock(channels, channels, groups, dropout)]
    )


def _run_stage(stage: nn.Module, h: torch.Tensor) -> torch.Tensor:
    for i, res in enumerate(stage.res):
        h = res(h)
        if len(stage.attn) > 0:
            h = stage.attn[i](h)
    return h


class Encoder(nn.Module):
    def __init__(self, in_channels, ch, ch_mult, num_res_blocks, z_channels, groups, dropout):
        super().__init__()
        self.conv_in = nn.Conv2d(in_channels, ch, 3, padding=1)
        in_mult = (1,) + tuple(ch_mult)
        self.conv_blocks = nn.ModuleList()
        for level, mult in enumerate(ch_mult):
            last = level == len(ch_mult) - 1
            stage = _stage(num_res_blocks, ch * in_mult[level], ch * mult, last, groups, dropout)
            if not last:
                stage.downsample = Downsample(ch * mult)
            self.conv_blocks.append(stage)
        block_in = ch * ch_mult[-1]
        self.mid = _mid(block_in, groups, dropout)
        self.norm_out = _norm(block_in, groups)
        self.conv_out = nn.Conv2d(block_in, z_channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(x)
        for stage in self.conv_blocks:
            h = _run_stage(stage, h)
            if hasattr(stage, "downsample"):
                h = stage.downsample(h)
        for block in self.mid:
            h = block(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class Decoder(nn.Module):
    def __init__(self, z_channels, ch, ch_mult, num_res_blocks, out_channels, groups, dropout):
        super().__init__()
        block_in = ch * ch_mult[-1]
        self.conv_in = nn.Conv2d(z_channels, block_in, 3, padding=1)
        self.mid = _mid(block_in, groups, dropout)
        self.conv_blocks = nn.ModuleList()
        for level in reversed(range(len(ch_mult))):
            stage = _stage(num_res_blocks + 1, block_in, ch * ch_mult[level], level == len(ch_mult) - 1, groups, dropout)
            block_in = ch * ch_mult[level]
            if level != 0:
                stage.upsample = Upsample(block_in)
            self.conv_blocks.append(stage)
        self.norm_out = _norm(block_in, groups)
        self.conv_out = nn.Conv2d(block_in, out_channels, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(z)
        for block in self.mid:
            h = block(h)
        for stage in self.conv_blocks:
            h = _run_stage(stage, h)
            if hasattr(stage, "upsample"):
                h = stage.upsample(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class VectorQuantizer(nn.Module):
    def __init__(self, codebook_size: int, embed_dim: int, l2_norm: bool):
        super().__init__()
        self.l2_norm = l2_norm
        self.embedding = nn.Embedding(codebook_size, embed_dim)
        nn.init.uniform_(self.embedding.weight, -1.0 / codebook_size, 1.0 / codebook_size)
        if l2_norm:
            self.embedding.weight.data = F.normalize(self.embedding.weight.data, dim=-1)

    @property
    def codebook(self) -> torch.Tensor:
        """Code vectors as the decoder sees them ``(V, d)`` (L2-normalised when the tokenizer is)."""
        w = self.embedding.weight
        return F.normalize(w, dim=-1) if self.l2_norm else w


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


class LlamaGenVQModel(ModelMixin, ConfigMixin):
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
    def __init__(
        self,
        codebook_size: int = 16384,
        codebook_embed_dim: int = 8,
        codebook_l2_norm: bool = True,
        commit_loss_beta: float = 0.25,
        entropy_loss_ratio: float = 0.0,
        encoder_ch_mult: Sequence[int] = (1, 1, 2, 2, 4),
        decoder_ch_mult: Sequence[int] = (1, 1, 2, 2, 4),
        z_channels: int = 256,
        base_channels: int = 128,
        num_res_blocks: int = 2,
        norm_num_groups: int = 32,
        in_channels: int = 3,
        out_channels: int = 3,
        dropout: float = 0.0,
    ):
        super().__init__()
        if len(encoder_ch_mult) != len(decoder_ch_mult):
            raise ValueError("`encoder_ch_mult` and `decoder_ch_mult` must have the same length (same downsampling).")
        g = norm_num_groups
        self.encoder = Encoder(in_channels, base_channels, encoder_ch_mult, num_res_blocks, z_channels, g, dropout)
        self.decoder = Decoder(z_channels, base_channels, decoder_ch_mult, num_res_blocks, out_channels, g, dropout)
        self.quantize = VectorQuantizer(codebook_size, codebook_embed_dim, codebook_l2_norm)
        self.quant_conv = nn.Conv2d(z_channels, codebook_embed_dim, 1)
        self.post_quant_conv = nn.Conv2d(codebook_embed_dim, z_channels, 1)

    @property
    def downsample_factor(self) -> int:
        return 2 ** (len(self.config.encoder_ch_mult) - 1)

    @property
    def codebook(self) -> torch.Tensor:
        return self.quantize.codebook

    def encode(self, pixels: torch.Tensor) -> VQEncoderOutput:
        """Images in [-1, 1] ``(B, 3, H, W)`` -> nearest codes and losses."""
        z = self.quant_conv(self.encoder(pixels)).permute(0, 2, 3, 1)  # (B, h, w, d)
        codebook = self.codebook
        if self.config.codebook_l2_norm:
            z = F.normalize(z, dim=-1)
        flat = z.reshape(-1, z.shape[-1])  # (N, d)
        dist = flat.pow(2).sum(1, keepdim=True) + codebook.pow(2).sum(1) - 2 * flat @ codebook.t()  # (N, V)
        indices = dist.argmin(dim=1)
        z_q = codebook[indices].view(z.shape)
        vq_loss = torch.mean((z_q - z.detach()) ** 2)
        commit_loss = self.config.commit_loss_beta * torch.mean((z_q.detach() - z) ** 2)
        entropy = self.config.entropy_loss_ratio * _entropy_loss(-dist) if self.config.entropy_loss_ratio > 0 else dist.new_zeros(())
        z_q = z + (z_q - z).detach()  # straight-through
        return VQEncoderOutput(
            quant=z_q.permute(0, 3, 1, 2),
            indices=indices.view(z.shape[:3]),
            vq_loss=vq_loss,
            commit_loss=commit_loss,
            entropy_loss=entropy,
        )

    def decode(self, quant: torch.Tensor) -> torch.Tensor:
        """Latents ``(B, d, h, w)`` -> images in about [-1, 1]."""
        return self.decoder(self.post_quant_conv(quant))

    def decode_code(self, codes: torch.Tensor) -> torch.Tensor:
        """Code grid ``(B, h, w)`` -> images ``(B, 3, h * f, w * f)``."""
        quant = self.codebook[codes].permute(0, 3, 1, 2)  # (B, d, h, w)
        return self.decode(quant)

    def forward(self, pixels: torch.Tensor) -> Tuple[torch.Tensor, VQEncoderOutput]:
        enc = self.encode(pixels)
        return self.decode(enc.quant), enc
