"""Turning target logits into a distribution and drawing from it.

Everything here is fp32 and free of host syncs: drawing uses the exponential race
(``argmax(p / E)``, ``E ~ Exp(1)``), which picks index ``i`` with probability ``p_i`` exactly, as
``torch.multinomial`` does, but without its device-to-host check.
"""

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

GeneratorLike = Union[None, torch.Generator, Sequence[torch.Generator]]


@dataclass(frozen=True)
class SamplingConfig:
    """How target logits become the distribution ``p`` the decoders must reproduce.

    Args:
        guidance_scale (`float`): CFG scale ``s`` in ``uncond + s * (cond - uncond)``; 1 disables CFG.
        temperature (`float`): 0 means greedy (``p`` is a point mass on the argmax).
        top_k (`int`, *optional*): keep the ``k`` most likely codes (``None``/0: all).
        top_p (`float`, *optional*): nucleus mass in (0, 1] (``None``/1: all).
        cfg (`bool`, *optional*): whether unconditional rows run; ``None``: when ``guidance_scale != 1``. A scale
            changed during a call keeps the rows the call started with (``cfg=True`` with a scale of 1 mixes them to
            the conditional model).
    """

    guidance_scale: float = 1.0
    temperature: float = 1.0
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    cfg: Optional[bool] = None

    @property
    def do_cfg(self) -> bool:
        return self.guidance_scale != 1.0 if self.cfg is None else self.cfg

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def cfg_mix(logits: torch.Tensor, guidance_scale: float) -> torch.Tensor:
    """Classifier-free guidance on stacked rows: ``(2B, ..., V)`` [cond rows, then uncond rows] -> ``(B, ..., V)`` fp32."""
    cond, uncond = logits.float().chunk(2, dim=0)  # (B, ..., V) each
    return uncond + guidance_scale * (cond - uncond)


def apply_top_k(logits: torch.Tensor, top_k: Optional[int]) -> torch.Tensor:
    """Mask all but the ``top_k`` largest logits with ``-inf`` (``None``/0 or ``>= V``: unchanged)."""
    if not top_k or top_k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # (..., 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: Optional[float]) -> torch.Tensor:
    """Nucleus filtering: keep the smallest set of most likely codes whose mass reaches ``top_p``."""
    if top_p is None or top_p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    sorted_probs = sorted_logits.softmax(dim=-1)
    remove = sorted_probs.cumsum(dim=-1) - sorted_probs > top_p  # mass before this code already exceeds top_p
    remove = remove.scatter(-1, order, remove)
    return logits.masked_fill(remove, float("-inf"))


#: Below this temperature ``logits / T`` can overflow fp32; `logits_to_probs` then shifts the logits first.
TINY_TEMPERATURE = 1e-20


def one_hot(codes: torch.Tensor, num_classes: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``codes (...)`` -> ``(..., num_classes)`` one-hot in ``dtype``, by a scatter. Why not `F.one_hot`: it reads the
    codes' min and max back to the host to check them, two device syncs per call on a GPU."""
    out = torch.zeros(*codes.shape, num_classes, dtype=dtype, device=codes.device)
    return out.scatter_(-1, codes[..., None], 1)


def logits_to_probs(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """Target distribution ``p`` (fp32) from CFG-mixed logits: temperature, then top-k, then top-p.

    ``temperature == 0`` gives a one-hot on the argmax, so exact acceptance rules reproduce greedy decoding.
    """
    logits = logits.float()
    if config.greedy:
        return one_hot(logits.argmax(dim=-1), logits.shape[-1])
    if config.temperature < TINY_TEMPERATURE:
        # the same softmax, shifted first: logits / T would overflow fp32 (inf - inf = NaN), and T itself rounds to 0
        shifted = logits - logits.amax(dim=-1, keepdim=True)  # (..., V) <= 0, the largest logits at 0
        logits = torch.where(shifted == 0, 0.0, shifted / config.temperature)  # the rest -> -inf: the greedy limit
    else:
        logits = logits / config.temperature
    logits = apply_top_p(apply_top_k(logits, config.top_k), config.top_p)
    return logits.softmax(dim=-1)


class RandomSource:
    """Random numbers per batch row, reproducible per row.

    With a list of generators, row ``b`` draws only from ``generators[b]``, so a batch equals the single runs
    made with the same generators. With one generator (or none) the whole batch draws from it at once.

    Args:
        generator: ``None``, one `torch.Generator`, or one per batch row.
        batch_size (`int`): rows of the batch.
        device (`torch.device`): where the numbers are used.
    """

    def __init__(self, generator: GeneratorLike, batch_size: int, device: torch.device):
        self.generator = generator
        self.batch_size = batch_size
        self.device = torch.device(device)

    def _draw(self, shape: Sequence[int], fill) -> torch.Tensor:
        if isinstance(self.generator, (list, tuple)):
            rows = [fill(torch.empty(tuple(shape), device=g.device), g) for g in self.generator]
            return torch.stack(rows).to(self.device)  # (B, *shape)
        g = self.generator
        out = torch.empty((self.batch_size, *shape), device=g.device if g is not None else self.device)
        return fill(out, g).to(self.device)

    def split(self, rows: Sequence[int]) -> "RandomSource":
        """The random source of the rows ``rows`` alone: their own generators (a list), or the shared one."""
        generator = [self.generator[r] for r in rows] if isinstance(self.generator, (list, tuple)) else self.generator
        return RandomSource(generator, len(rows), self.device)

    def uniform(self, *shape: int) -> torch.Tensor:
        """``U[0, 1)`` of shape ``(B, *shape)``."""
        return self._draw(shape, lambda t, g: t.uniform_(0.0, 1.0, generator=g))

    def exponential(self, *shape: int) -> torch.Tensor:
        """``Exp(1)`` of shape ``(B, *shape)``."""
        return self._draw(shape, lambda t, g: t.exponential_(1.0, generator=g))


def sample_from_probs(probs: torch.Tensor, random: RandomSource) -> torch.Tensor:
    """Draw one code per distribution with no host sync: ``probs (B, ..., V)`` -> ``(B, ...)`` long.

    Exponential race: ``argmax_i p_i / E_i`` with ``E_i ~ Exp(1)`` is distributed as ``p``. A point mass
    (greedy) always returns its argmax.
    """
    noise = random.exponential(*probs.shape[1:])  # (B, ..., V)
    return (probs / noise).argmax(dim=-1)
