"""A patch tokenizer: each code is the nearest of K pixel patches (k-means centroids).

Why it exists: a convolutional VQ encoder (LlamaGen's) sees a neighbourhood around each patch, so which code a patch
gets depends on pixels below and to the right of it, which an autoregressive model has not drawn yet. On the
embedded Twemoji data, identical 4x4 patches get the same code only 59% of the time, and plain white patches get 98
different codes. Here a code is a function of its own patch alone: a white patch is always the same code. At 4x4
patches and 512 codes it also reconstructs Twemoji more faithfully (27.4 dB held-out PSNR against 22.1 dB).
"""

from typing import Optional, Tuple

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from torch import nn

from ..utils import CheckedSaveMixin
from ..weight_checks import CheckedLoadMixin
from .vq_llamagen import VQEncoderOutput


class PatchVQModel(CheckedLoadMixin, CheckedSaveMixin, ModelMixin, ConfigMixin):
    r"""Image tokenizer whose codebook is a set of pixel patches: encoding picks the nearest patch (L2 in pixel space),
    decoding pastes the patches back. Fit the codebook with `PatchVQModel.fit` (k-means).

    Args:
        codebook_size (`int`): number of codes ``K``.
        patch_size (`int`): side ``p`` of a patch in pixels; the code grid is the image side divided by ``p``.
        in_channels (`int`): image channels (3).
    """

    @register_to_config
    def __init__(self, codebook_size: int = 512, patch_size: int = 4, in_channels: int = 3):
        super().__init__()
        if codebook_size < 1 or patch_size < 1 or in_channels < 1:
            raise ValueError(f"`codebook_size`, `patch_size` and `in_channels` must be positive, got "
                             f"{codebook_size}, {patch_size} and {in_channels}.")
        self.embedding = nn.Embedding(codebook_size, in_channels * patch_size * patch_size)  # (K, C*p*p), in [-1, 1]

    @property
    def downsample_factor(self) -> int:
        return self.config.patch_size

    @property
    def codebook(self) -> torch.Tensor:
        """Code vectors ``(K, C * p * p)``: the patches' pixels in [-1, 1], channel-major (``C, p, p``)."""
        return self.embedding.weight

    def _check_pixels(self, pixels: torch.Tensor) -> None:
        p, c = self.config.patch_size, self.config.in_channels
        if pixels.dim() != 4 or pixels.shape[1] != c or pixels.shape[2] % p or pixels.shape[3] % p:
            raise ValueError(f"`pixels` must be (B, {c}, H, W) with H and W multiples of the patch size {p}, "
                             f"got {tuple(pixels.shape)}.")

    def patchify(self, pixels: torch.Tensor) -> torch.Tensor:
        """Images ``(B, C, H, W)`` -> patch vectors ``(B, h, w, C*p*p)``."""
        self._check_pixels(pixels)
        p = self.config.patch_size
        b, c, hh, ww = pixels.shape
        x = pixels.reshape(b, c, hh // p, p, ww // p, p)  # (B, C, h, p, w, p)
        return x.permute(0, 2, 4, 1, 3, 5).reshape(b, hh // p, ww // p, c * p * p)

    def encode(self, pixels: torch.Tensor) -> VQEncoderOutput:
        """Images in [-1, 1] ``(B, C, H, W)`` -> the nearest patch codes (``indices`` ``(B, h, w)``) and the chosen
        patches as ``quant`` ``(B, C*p*p, h, w)``. No losses: the codebook is fitted, not trained by gradient."""
        z = self.patchify(pixels.to(self.codebook.dtype))  # (B, h, w, d)
        flat = z.reshape(-1, z.shape[-1])
        with torch.autocast(flat.device.type, enabled=False):  # a bf16 autocast matmul would pick other codes
            indices = _nearest(flat.float(), self.codebook.float()).view(z.shape[:3])
        zero = z.new_zeros(())
        return VQEncoderOutput(quant=self.codebook[indices].permute(0, 3, 1, 2), indices=indices,
                               vq_loss=zero, commit_loss=zero, entropy_loss=zero)

    def decode(self, quant: torch.Tensor) -> torch.Tensor:
        """Patch vectors ``(B, C*p*p, h, w)`` -> images ``(B, C, h*p, w*p)``."""
        p, c = self.config.patch_size, self.config.in_channels
        b, _, h, w = quant.shape
        x = quant.reshape(b, c, p, p, h, w).permute(0, 1, 4, 2, 5, 3)  # (B, C, h, p, w, p)
        return x.reshape(b, c, h * p, w * p)

    def decode_code(self, codes: torch.Tensor) -> torch.Tensor:
        """Code grid ``(B, h, w)`` -> images ``(B, C, h*p, w*p)`` in [-1, 1]."""
        return self.decode(self.codebook[codes].permute(0, 3, 1, 2))

    def forward(self, pixels: torch.Tensor) -> Tuple[torch.Tensor, VQEncoderOutput]:
        enc = self.encode(pixels)
        return self.decode(enc.quant), enc

    @classmethod
    def fit(cls, images: torch.Tensor, codebook_size: int = 512, patch_size: int = 4, iterations: int = 30,
            max_patches: Optional[int] = 300_000, background: Optional[float] = 1.0, seed: int = 0,
            batch_size: int = 65_536) -> "PatchVQModel":
        """Fit the codebook by k-means (Lloyd's iterations) on the patches of ``images``.

        Args:
            images (`torch.Tensor`): ``(N, C, H, W)`` in [-1, 1].
            codebook_size (`int`), patch_size (`int`): as in the constructor.
            iterations (`int`): Lloyd iterations.
            max_patches (`int`, *optional*): fit on a uniform sample of this many patches (all when `None`).
            background (`float`, *optional*): pin code 0 to the uniform patch of this value (1.0 is white), so a blank
                background is exactly one code and decodes exactly; `None` pins nothing.
            seed (`int`): seeds the sample and the initial centroids.
            batch_size (`int`): patches per distance computation (bounds memory).
        """
        if iterations < 0:
            raise ValueError(f"`iterations` must be >= 0, got {iterations}.")
        if max_patches is not None and max_patches < codebook_size:
            raise ValueError(f"`max_patches` must be at least `codebook_size` ({codebook_size}), got {max_patches}.")
        if background is not None and not -1.0 <= background <= 1.0:
            raise ValueError(f"`background` must be in [-1, 1] or None, got {background}.")
        model = cls(codebook_size=codebook_size, patch_size=patch_size, in_channels=images.shape[1])
        x = model.patchify(images.float()).reshape(-1, model.codebook.shape[1])  # (M, d)
        gen = torch.Generator().manual_seed(seed)
        if max_patches is not None and len(x) > max_patches:
            x = x[torch.randperm(len(x), generator=gen)[:max_patches]]
        if len(x) < codebook_size:
            raise ValueError(f"`images` give {len(x)} patches, fewer than `codebook_size` ({codebook_size}).")
        cent = x[torch.randperm(len(x), generator=gen)[:codebook_size]].clone()  # (K, d)
        pinned = background is not None
        if pinned:
            cent[0] = background
        for _ in range(iterations):
            assign = torch.cat([_nearest(x[i:i + batch_size], cent) for i in range(0, len(x), batch_size)])
            sums = torch.zeros_like(cent).index_add_(0, assign, x)
            counts = torch.bincount(assign, minlength=codebook_size).to(x.dtype)
            # an empty cluster restarts on a random patch rather than dying
            reseed = x[torch.randint(len(x), (codebook_size,), generator=gen)]
            cent = torch.where(counts[:, None] > 0, sums / counts.clamp_min(1)[:, None], reseed)
            if pinned:
                cent[0] = background
        with torch.no_grad():
            model.embedding.weight.copy_(cent)
        return model.eval()


def _nearest(x: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """Index of the nearest code (L2) for each row of ``x`` ``(N, d)``; ties go to the lower index."""
    dist = codebook.pow(2).sum(1) - 2 * x @ codebook.t()  # (N, K); |x|^2 is the same for every code
    return dist.argmin(dim=1)
