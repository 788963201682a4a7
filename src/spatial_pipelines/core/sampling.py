"""Turning target logits into a distribution, and keyed noise: every random draw of a generation.

Everything here is fp32 and free of host syncs. Each image draws one seed from its generator (`draw_seeds`), and every
random number a round needs is a hash of that seed and a counter: the Gumbel noise of grid position ``j`` and code
``v`` (`keyed_gumbel`), as vLLM keys its sampler's noise by request, and keyed uniforms of streams salted apart
(`keyed_uniform`: acceptance tests, residual draws, random drafts, ADT-Tree's shapes). The code at ``j`` is
``argmax(log p_j + G(seed, j))`` (Gumbel-max: a draw from ``p_j``, `keyed_sample`), whatever pass computes ``p_j``:
every exact decoder then commits AR's image for a seed, at any draft size or batch, and verification is "does the draft
equal the target's keyed sample". Under ``sampling_noise="drawn"`` a method's own acceptance test (``u < p / q``) runs
on keyed streams of its own.
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
        noise (`str`): ``"keyed"``: each image's noise is keyed by its seed and grid position (`keyed_gumbel`), so
            every exact decoder commits AR's codes for a seed; ``"drawn"``: random numbers are drawn from the
            generators as the decoder uses them (the image then depends on the decoder and its draft sizes).
    """

    guidance_scale: float = 1.0
    temperature: float = 1.0
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    cfg: Optional[bool] = None
    noise: str = "drawn"

    @property
    def keyed(self) -> bool:
        """Whether the target is sampled by keyed noise (greedy decoding needs no noise at all)."""
        return self.noise == "keyed" and not self.greedy

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
    return filtered_logits(logits, config).softmax(dim=-1)


def filtered_logits(logits: torch.Tensor, config: SamplingConfig, top_k: bool = True) -> torch.Tensor:
    """``log p`` up to a constant per distribution (fp32, ``-inf`` where top-k or top-p removed a code): the
    temperature, top-k (unless ``top_k=False``) and top-p of `logits_to_probs` without its softmax. Not for
    ``temperature == 0``."""
    logits = logits.float()
    if config.temperature < TINY_TEMPERATURE:
        # the same softmax, shifted first: logits / T would overflow fp32 (inf - inf = NaN), and T itself rounds to 0
        shifted = logits - logits.amax(dim=-1, keepdim=True)  # (..., V) <= 0, the largest logits at 0
        logits = torch.where(shifted == 0, 0.0, shifted / config.temperature)  # the rest -> -inf: the greedy limit
    else:
        logits = logits / config.temperature
    return apply_top_p(apply_top_k(logits, config.top_k) if top_k else logits, config.top_p)


def keyed_sample(logits: torch.Tensor, config: SamplingConfig, seeds: torch.Tensor,
                 index: Union[int, torch.Tensor]) -> torch.Tensor:
    """The code each distribution gives under keyed noise: ``argmax(log p + G(seed, index, code))`` (Gumbel-max, a
    draw from ``p``), ``(B, ...)`` long from CFG-mixed ``logits (B, ..., V)``; the argmax when greedy.

    Args:
        seeds (`torch.LongTensor` `(B,)`): the rows' seeds (`draw_seeds`).
        index (`int` or `torch.LongTensor`): the grid index each distribution is for: an `int`, ``(...)`` shared by
            the rows, or ``(B, ...)``.
    """
    if config.greedy:
        return logits.argmax(dim=-1)
    v = logits.shape[-1]
    top_k = bool(config.top_k) and config.top_k < v
    # without top-p the k codes top-k keeps are the k largest scaled logits: one top-k over V, not a mask and a top-k
    scores = filtered_logits(logits, config, top_k=not top_k or config.top_p is not None)  # (B, ..., V)
    index = index if isinstance(index, int) else index[..., None]  # (..., 1): one grid index per distribution
    # noise for the k codes top-k kept only: the rest are -inf anyway (logits tied exactly at the k-th largest: k of
    # them stay in the race here, where `apply_top_k` keeps every tied code)
    if top_k:
        kept, codes = scores.topk(config.top_k, dim=-1)  # (B, ..., k)
        pick = (kept + keyed_gumbel(seeds, index, codes, v)).argmax(dim=-1, keepdim=True)
        return codes.gather(-1, pick).squeeze(-1)
    codes = torch.arange(v, device=logits.device).expand(scores.shape)  # (B, ..., V) a view
    return (scores + keyed_gumbel(seeds, index, codes, v)).argmax(dim=-1)


#: Noise settings a pipeline call takes (``sampling_noise=``): see the module docstring.
SAMPLING_NOISE = ("keyed", "drawn")

# SplitMix64's constants, as signed int64 (torch has no uint64 arithmetic; int64 products wrap like uint64's)
_GAMMA = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)


def _shift_right(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 words (torch's ``>>`` is arithmetic: it copies the sign bit)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def keyed_gumbel(seeds: torch.Tensor, index: Union[int, torch.Tensor], codes: torch.Tensor,
                 num_codes: int) -> torch.Tensor:
    """Gumbel(0, 1) noise that depends only on ``(seed, grid index, code)``: fp32, the shape of ``codes``.

    The word ``seed + (index * num_codes + code + 1) * gamma`` goes through SplitMix64's finaliser (a bijection of
    64-bit words with full avalanche), so within one seed no two (index, code) pairs share a value; its top 23 bits
    give ``u`` in ``(0, 1)`` (both ends excluded, so the noise is finite) and ``G = -log(-log(u))``.

    Args:
        seeds (`torch.LongTensor` `(B,)`): one seed per row.
        index (`int` or `torch.LongTensor`): the grid index of each slot, broadcastable against ``codes``
            (``(T, 1)`` for ``codes (B, T, k)``, ``(B, T, 1)`` for one index per row and slot), or one `int`.
        codes (`torch.LongTensor` `(B, ...)`): the codes to draw noise for, batch first.
        num_codes (`int`): codebook size ``V`` (the counter's stride per grid index).
    """
    return -torch.log(-torch.log(_keyed_unit(seeds, index * num_codes + codes + 1)))


def keyed_uniform(seeds: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``U(0, 1)`` that depends only on ``(seed, grid index)``: fp32 ``(B, ...)`` for ``index`` ``(B, ...)``. Salt the
    seeds (`ACCEPT_STREAM`) for a stream independent of `keyed_gumbel`'s."""
    return _keyed_unit(seeds, index + 1)


def keyed_integer(seeds: torch.Tensor, index: torch.Tensor, span: Union[int, torch.Tensor]) -> torch.Tensor:
    """An integer uniform in ``[0, span)`` that depends only on ``(seed, index)`` (`keyed_uniform` scaled): long
    ``(B, ...)`` for ``index`` ``(B, ...)``; ``span`` an int or a tensor broadcasting against ``index``."""
    return (keyed_uniform(seeds, index) * span).long().clamp_max(span - 1)


def _keyed_unit(seeds: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser of ``seed + counter * gamma`` (``counter`` ``(B, ...)``, never 0), its top 23 bits as a
    number in ``(0, 1)``."""
    z = seeds.view(-1, *([1] * (counter.dim() - 1))) + counter * _GAMMA  # (B, ...) wraps modulo 2**64
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    z = z ^ _shift_right(z, 31)
    return (_shift_right(z, 41).float() + 0.5) * 2.0**-23  # (B, ...) in [2^-24, 1 - 2^-24]: exact in fp32


#: Salts (XORed into a row's seed) of the keyed streams a relaxed rule reads besides the target's samples: the
#: uniforms that test drafts against their proposals, and the draws from what is left after a rejection
ACCEPT_STREAM = 0x5DEECE66D1F0A3B7
RESIDUAL_STREAM = 0x2545F4914F6CDD1D
#: Salt of the keyed stream of drafts drawn uniformly (SJD's ``init="random"`` on the device)
INIT_STREAM = 0x9E3779B97F4A7C15 & ((1 << 63) - 1)
#: Salt of the keyed streams of SJD-PAC's continuation on the device (its tests and its residual draws)
CONTINUE_STREAM = 0x1B873593CC9E2D51
#: Salt of the keyed stream that draws SJD-PAC's proactive candidates after a position's first one, where proposals
#: are kept (drawn noise, a relaxed rule): independent of whatever drew the first
PROACTIVE_STREAM = 0x7F4A7C15F39CC060
#: Salt of the keyed stream of tree shapes drawn uniformly (ADT-Tree's ``tree_init="random"`` on the device)
SHAPE_STREAM = 0x632BE59BD9B4E019
#: Salt of the keyed stream of drafts drawn from a draft head's distribution (SSD's ``draft="sample"`` on the device)
DRAFT_STREAM = 0x7F4A7C159E3779B9


def draw_seeds(generator: GeneratorLike, batch_size: int) -> torch.Tensor:
    """One 62-bit seed per row (CPU ``(B,)`` int64): row ``b`` draws from ``generator[b]`` with a list, else the batch
    draws from the one generator (or torch's default one) at once."""
    high = 1 << 62
    if isinstance(generator, (list, tuple)):
        return torch.cat([torch.randint(high, (1,), generator=g, device=g.device).cpu() for g in generator])
    device = generator.device if generator is not None else "cpu"
    return torch.randint(high, (batch_size,), generator=generator, device=device).cpu()
