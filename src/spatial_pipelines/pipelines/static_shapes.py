"""Fixed-shape rounds: what lets a compiled target step (``torch.compile(dynamic=False)``, CUDA graphs) run every
round of a generation with one graph.

Three things change shape from round to round in a speculative loop, and each is fixed here:

- the attended length (the KV cache grows by the accepted count): the cache attends to all its slots instead
  (`StaticKVCache` with ``fixed_shape=True``), and its length is rounded up to `STATIC_LENGTH_MULTIPLE`, so prompts
  of different lengths share one cache size;
- the fed length (dynamic trees, end-of-row tokens, a shrinking window at the end of the grid): the draft is
  padded to the decoder's generation-wide maximum (`pad_fed`); padded slots see only themselves, no real token sees
  them, and the loop drops them from the cache after the pass;
- the write position: a tensor (``StaticKVCache.write_index``), never a host int baked into the graph.

The prefill pass (whose length is the prompt's) runs eagerly (`eager_target`), as gpt-fast does, so a new prompt
length compiles nothing.
"""

import contextlib
from typing import Iterator, Optional, Tuple

import torch

#: Fixed-shape caches are allocated in multiples of this many slots (one graph serves every prompt length that
#: rounds up to the same size).
STATIC_LENGTH_MULTIPLE = 256


def static_cache_length(needed: int) -> int:
    """``needed`` slots rounded up to a multiple of `STATIC_LENGTH_MULTIPLE`."""
    return -(-needed // STATIC_LENGTH_MULTIPLE) * STATIC_LENGTH_MULTIPLE


def pad_fed(
    input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor, size: int
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pad a round's fed tokens to ``size`` slots.

    Args:
        input_ids: ``(B, T)`` fed codes; position_ids: ``(T,)`` or ``(B, T)``; attention_mask: ``(T, T)`` or
            ``(B, T, T)`` (which fed tokens see which).
        size (`int`): the generation-wide fed length (``T <= size``).

    Returns:
        The three padded to ``size``: padded slots feed code 0 at the last real position (inside the RoPE table),
        see only themselves, and no real token sees them, so the real tokens' outputs are those of the unpadded pass.
    """
    t = input_ids.shape[1]
    if t == size:
        return input_ids, position_ids, attention_mask
    if t > size:
        raise ValueError(f"A round fed {t} tokens, more than the {size} the decoder declared (`max_draft_tokens`).")
    pad = size - t
    input_ids = torch.nn.functional.pad(input_ids, (0, pad))  # (B, size)
    position_ids = torch.cat([position_ids, position_ids[..., -1:].expand(*position_ids.shape[:-1], pad)], -1)
    mask = torch.eye(size, dtype=torch.bool, device=attention_mask.device).expand(*attention_mask.shape[:-2], size, size).clone()
    mask[..., :t, :t] = attention_mask  # (B?, size, size)
    return input_ids, position_ids, mask


@contextlib.contextmanager
def eager_target(module: torch.nn.Module) -> Iterator[None]:
    """Run ``module`` eagerly inside the block even when ``nn.Module.compile`` compiled it (passes whose shapes vary
    by design: the prefill, the start-up cost measurements)."""
    compiled = getattr(module, "_compiled_call_impl", None)
    module._compiled_call_impl = None
    try:
        yield
    finally:
        module._compiled_call_impl = compiled


def uses_cuda_graphs(module: torch.nn.Module, device: torch.device) -> bool:
    """Whether ``module`` was compiled with CUDA graphs (``mode="reduce-overhead"``) for ``device``."""
    return device.type == "cuda" and getattr(module, "_spatial_compile_mode", None) in ("reduce-overhead", "max-autotune")


def mark_static_cache(cache, enabled: bool) -> None:
    """Tell CUDA graphs the cache's tensors keep their address between replays (they are written in place every
    round, so a graph must not copy them in as fresh inputs). Once per cache; a no-op unless ``enabled``."""
    if not enabled or getattr(cache, "_marked_static", False):
        return
    torch._dynamo.mark_static_address(cache.storage)
    torch._dynamo.mark_static_address(cache.key_valid)
    cache._marked_static = True


def count_compiles() -> "CompileCounter":
    """A `CompileCounter` over the block's dynamo compilations (``with count_compiles() as c: ...; c.frames``)."""
    return CompileCounter()


class CompileCounter:
    """How many graphs dynamo compiled inside a ``with`` block (``frames``), from ``torch._dynamo.utils.counters``."""

    def __enter__(self) -> "CompileCounter":
        from torch._dynamo.utils import counters

        self._counters = counters
        self._start = counters["stats"]["unique_graphs"]
        self.frames: Optional[int] = None
        return self

    def __exit__(self, *exc) -> None:
        self.frames = self._counters["stats"]["unique_graphs"] - self._start
