"""Background canonicalisation of VQ code grids (the embedded model's training data).

A VQ encoder sees past its own patch: the code of a plain white patch depends on what lies around it, including
what lies *below and to the right*, which an AR model has not generated yet. On Twemoji, 25% of the patches are
plain background, only a third of them get the code a blank canvas gets there, and the rest spread over a dozen
near-identical codes (swapping one for another moves a decoded pixel by at most a few percent). An AR model must
guess which one from the caption alone, and one wrong guess takes a model that memorised the grid off it. Giving
every background patch one code, the one a blank canvas gets at that place, removes that guess and keeps the
reconstruction (measured in docs/quality.md).
"""

import torch
import torch.nn.functional as F


@torch.no_grad()
def canonical_background_codes(vqvae, pixels: torch.Tensor, codes: torch.Tensor, background: float = 1.0,
                               tolerance: float = 0.01) -> torch.Tensor:
    """Codes with every background patch's code replaced by the code of a blank canvas at the same place.

    Args:
        vqvae: the tokenizer (`encode(pixels).indices` and `downsample_factor`).
        pixels (`torch.Tensor` `(B, 3, H, W)`): the images in [-1, 1] that ``codes`` encode.
        codes (`torch.LongTensor` `(B, h * w)`): their code grids in raster order.
        background (`float`): the background value in [-1, 1] of every channel (1.0: white).
        tolerance (`float`): a pixel is background when every channel is within this of ``background``.

    Returns:
        `torch.LongTensor` `(B, h * w)`: ``codes`` with the background patches' codes made canonical.
    """
    if not -1 <= background <= 1:
        raise ValueError(f"`background` must be in [-1, 1], got {background}.")
    if not 0 <= tolerance < 2:
        raise ValueError(f"`tolerance` must be in [0, 2), got {tolerance}.")
    f = vqvae.downsample_factor
    b, _, height, width = pixels.shape
    if codes.shape != (b, (height // f) * (width // f)):
        raise ValueError(f"`codes` must have shape {(b, (height // f) * (width // f))} for pixels of shape "
                         f"{tuple(pixels.shape)}, got {tuple(codes.shape)}.")
    blank = torch.full((1, 3, height, width), background, dtype=pixels.dtype, device=pixels.device)
    canvas = vqvae.encode(blank).indices.reshape(1, -1).to(codes.device)  # (1, h*w) a blank canvas's codes
    plain = ((pixels - background).abs() <= tolerance).all(1, keepdim=True).float()  # (B, 1, H, W)
    patch = (F.avg_pool2d(plain, f) == 1).flatten(1).to(codes.device)  # (B, h*w) every pixel is background
    return torch.where(patch, canvas.expand_as(codes), codes)
