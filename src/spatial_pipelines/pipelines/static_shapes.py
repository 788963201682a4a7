"""Fixed-shape rounds: what lets a compiled target step (``torch.compile(dynamic=False)``, CUDA graphs) run every
round of a generation with one graph.

Three things change shape from round to round in a speculative loop, and each is fixed here:

- the attended length (the KV cache grows by the accepted count): the cache attends to one of a few fixed lengths
  counted back from its end (`StaticKVCache` with ``fixed_shape=True``, ``attend_buckets``), and its length is
  rounded up to `STATIC_LENGTH_MULTIPLE`, so prompts of different lengths share one cache size;
- the fed length (dynamic trees, end-of-row tokens, a shrinking window at the end of the grid): the draft is
  padded to the decoder's generation-wide maximum (`pad_fed`); padded slots see only themselves, no real token sees
  them, and the loop drops them from the cache after the pass;
- the write position: a tensor (``StaticKVCache.write_index``), never a host int baked into the graph.

The prefill pass (whose length is the prompt's) runs eagerly (`eager_target`), as gpt-fast does, so a new prompt
length compiles nothing.
"""

from typing import Tuple

import torch

#: Fixed-shape caches are allocated in multiples of this many slots (one graph serves every prompt length that
#: rounds up to the same size).
STATIC_LENGTH_MULTIPLE = 256


#: `GenerationLoop.compile` raises dynamo's per-function recompile limit to at least this: each decoder
#: configuration compiles one graph per attended length its rounds reach (at most the cache's ``attend_buckets``).
RECOMPILE_LIMIT = 64


def static_cache_length(needed: int) -> int:
    """``needed`` slots rounded up to a multiple of `STATIC_LENGTH_MULTIPLE`."""
    return -(-needed // STATIC_LENGTH_MULTIPLE) * STATIC_LENGTH_MULTIPLE


def pad_fed(
    fed: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor, size: int
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pad a round's fed tokens to ``size`` slots.

    Args:
        fed: ``(B, T)`` fed codes or ``(B, T, D)`` their embeddings; position_ids: ``(T,)`` or ``(B, T)``;
            attention_mask: ``(T, T)`` or ``(B, T, T)`` (which fed tokens see which).
        size (`int`): the generation-wide fed length (``T <= size``).

    Returns:
        The three padded to ``size``: padded slots feed zeros (code 0, or a zero embedding) at the last real position
        (inside the RoPE table), see only themselves, and no real token sees them, so the real tokens' outputs are
        those of the unpadded pass.
    """
    t = fed.shape[1]
    if t == size:
        return fed, position_ids, attention_mask
    if t > size:
        raise ValueError(f"A round fed {t} tokens, more than the {size} the decoder declared (`max_draft_tokens`).")
    pad = size - t
    fed = torch.nn.functional.pad(fed, (0, 0) * (fed.dim() - 2) + (0, pad))  # (B, size) or (B, size, D)
    position_ids = torch.cat([position_ids, position_ids[..., -1:].expand(*position_ids.shape[:-1], pad)], -1)
    mask = torch.eye(size, dtype=torch.bool, device=attention_mask.device).expand(*attention_mask.shape[:-2], size, size).clone()
    mask[..., :t, :t] = attention_mask  # (B?, size, size)
    return fed, position_ids, mask
