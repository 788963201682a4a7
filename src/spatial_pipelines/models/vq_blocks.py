"""The taming-transformers convolutional VQ blocks that LlamaGen's VQ tokenizer and Chameleon's VQGAN share: the
resnet and attention blocks, the 2x resamplers, a resolution level of resnet blocks, the codebook, the
nearest-code distances and the model-level ``decode`` / ``codebook``.

Parameter names are those of both originals (``norm1``, ``conv1``, ``nin_shortcut``, ``q``/``k``/``v``/``proj_out``,
``downsample.conv``, ``quantize.embedding`` ...); where the two originals name the same module differently (a level's
list of resnet blocks is ``block`` in taming/Chameleon, ``res`` in LlamaGen), the name is an argument.
"""

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn


def vq_norm(channels: int, groups: int) -> nn.GroupNorm:
    """GroupNorm with the originals' ``eps=1e-6`` and affine parameters."""
    return nn.GroupNorm(num_groups=groups, num_channels=channels, eps=1e-6, affine=True)


class ResnetBlock(nn.Module):
    """Pre-norm resnet block without timestep projection; a 1x1 ``nin_shortcut`` when the width changes."""

    def __init__(self, in_channels: int, out_channels: int, groups: int, dropout: float = 0.0):
        super().__init__()
        self.norm1 = vq_norm(in_channels, groups)
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, padding=1)
        self.norm2 = vq_norm(out_channels, groups)
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
        self.norm = vq_norm(channels, groups)
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


class ResnetStage(nn.Module):
    """One resolution level: resnet blocks, each followed by an attention block when the level has attention, then
    the level's ``downsample`` or ``upsample`` where the caller attached one.

    Args:
        in_channels (`int`), out_channels (`int`): widths into the first block and out of every block.
        num_blocks (`int`): resnet blocks.
        with_attn (`bool`): an ``attn[j]`` block after every ``block[j]``.
        groups (`int`), dropout (`float`): GroupNorm groups and resnet dropout.
        blocks_name (`str`): the attribute (and parameter-name part) of the resnet blocks' list: ``"block"``
            (taming, Chameleon) or ``"res"`` (LlamaGen).
    """

    def __init__(self, in_channels: int, out_channels: int, num_blocks: int, with_attn: bool, groups: int,
                 dropout: float, blocks_name: str):
        super().__init__()
        self.blocks_name = blocks_name
        blocks = nn.ModuleList()
        setattr(self, blocks_name, blocks)  # registered before `attn`: the originals' state-dict order
        self.attn = nn.ModuleList()
        for _ in range(num_blocks):
            blocks.append(ResnetBlock(in_channels, out_channels, groups, dropout))
            in_channels = out_channels
            if with_attn:
                self.attn.append(AttnBlock(out_channels, groups))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for j, block in enumerate(getattr(self, self.blocks_name)):
            h = block(h)
            if len(self.attn) > 0:
                h = self.attn[j](h)
        if hasattr(self, "downsample"):
            h = self.downsample(h)
        if hasattr(self, "upsample"):
            h = self.upsample(h)
        return h


def encoder_stages(ch: int, ch_mult: Sequence[int], num_blocks: int, attn_levels: Sequence[bool], groups: int,
                   dropout: float, blocks_name: str) -> nn.ModuleList:
    """The encoder's levels, finest first: level ``i`` maps ``ch * ch_mult[i - 1]`` (``ch`` for the first) to
    ``ch * ch_mult[i]`` and halves the resolution with a ``downsample`` except at the last level.

    Args:
        ch (`int`), ch_mult (`tuple[int]`): base width and per-level multipliers.
        num_blocks (`int`): resnet blocks per level.
        attn_levels (`tuple[bool]`): per level, whether it has attention.
        groups (`int`), dropout (`float`), blocks_name (`str`): as [`ResnetStage`].
    """
    in_mult = (1,) + tuple(ch_mult)
    stages = nn.ModuleList()
    for i, mult in enumerate(ch_mult):
        stage = ResnetStage(ch * in_mult[i], ch * mult, num_blocks, attn_levels[i], groups, dropout, blocks_name)
        if i != len(ch_mult) - 1:
            stage.downsample = Downsample(ch * mult)
        stages.append(stage)
    return stages


def decoder_stages(ch: int, ch_mult: Sequence[int], num_blocks: int, attn_levels: Sequence[bool], groups: int,
                   dropout: float, blocks_name: str) -> list:
    """The decoder's levels in data-flow order (coarsest first): level ``i`` maps the previous width (``ch *
    ch_mult[-1]`` for the first) to ``ch * ch_mult[i]`` and doubles the resolution with an ``upsample`` except at
    level 0. Arguments as [`encoder_stages`] (``attn_levels`` indexed by level)."""
    width = ch * ch_mult[-1]
    stages = []
    for i in reversed(range(len(ch_mult))):
        stage = ResnetStage(width, ch * ch_mult[i], num_blocks, attn_levels[i], groups, dropout, blocks_name)
        width = ch * ch_mult[i]
        if i != 0:
            stage.upsample = Upsample(width)
        stages.append(stage)
    return stages


class VectorQuantizer(nn.Module):
    """The codebook (``embedding``), optionally L2-normalised (LlamaGen) or plain (Chameleon).

    Args:
        codebook_size (`int`), embed_dim (`int`): number of codes and their width.
        l2_norm (`bool`): codes (and the latents compared with them) are L2-normalised.
    """

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


def code_distances(flat: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """Squared Euclidean distances ``(N, V)`` from latents ``(N, d)`` to codes ``(V, d)``, in their dtype."""
    return flat.pow(2).sum(1, keepdim=True) + codebook.pow(2).sum(1) - 2 * flat @ codebook.t()


class VQAutoencoderMixin:
    """The ``codebook`` and ``decode`` of a model with ``quantize`` (a [`VectorQuantizer`]), ``post_quant_conv`` and
    ``decoder`` modules, which `add_quantizer` registers together with ``quant_conv``."""

    def add_quantizer(self, codebook_size: int, embed_dim: int, z_channels: int, l2_norm: bool) -> None:
        """Register ``quantize``, ``quant_conv`` (z -> embed_dim) and ``post_quant_conv`` (embed_dim -> z), in that
        order (the originals' state-dict order), after ``encoder`` and ``decoder``."""
        self.quantize = VectorQuantizer(codebook_size, embed_dim, l2_norm)
        self.quant_conv = nn.Conv2d(z_channels, embed_dim, 1)
        self.post_quant_conv = nn.Conv2d(embed_dim, z_channels, 1)

    @property
    def codebook(self) -> torch.Tensor:
        """The code vectors ``(V, embed_dim)`` as the decoder sees them."""
        return self.quantize.codebook

    def decode(self, quant: torch.Tensor) -> torch.Tensor:
        """Code vectors ``(B, d, H, W)`` -> images ``(B, C, H * f, W * f)``, unclamped."""
        return self.decoder(self.post_quant_conv(quant))
