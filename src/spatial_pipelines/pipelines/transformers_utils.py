"""What the transformers-backed families (Janus-Pro, Emu3) share: one target forward of a transformers language
model over the library's static KV cache, returning the pre-norm last hidden state the loop and the heads use."""

from typing import Optional

import torch

from ..core.kv_cache import StaticKVCache, TransformersCacheView, additive_mask


@torch.no_grad()
def language_model_forward(
    language_model: torch.nn.Module,
    inputs_embeds: torch.Tensor,
    position_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    token_valid: Optional[torch.Tensor],
    cache: StaticKVCache,
) -> torch.Tensor:
    """Run a transformers decoder stack (``LlamaModel``-like: ``.norm`` is its final norm) over ``inputs_embeds``
    ``(R, T, D)`` at ``position_ids`` ``(T,)`` or ``(R, T)``, appending to ``cache``.

    Args:
        attention_mask: ``(T, T)`` or ``(R, T, T)`` boolean, which new tokens see which (``None``: causal).
        token_valid: ``(R, T)`` which new tokens are real (prompt padding is not); ``None``: all.

    Returns:
        The pre-norm last hidden state ``(R, T, D)`` (transformers' ``last_hidden_state`` is post-norm: a
        forward-pre-hook on ``.norm`` reads the state before it).
    """
    r, t = inputs_embeds.shape[:2]
    device = inputs_embeds.device
    if attention_mask is None:
        attention_mask = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    mask = additive_mask(cache.attention_mask(attention_mask, token_valid), inputs_embeds.dtype)  # (R, 1, T, L + T)
    position_ids = position_ids.expand(r, t) if position_ids.dim() == 1 else position_ids
    captured = []
    hook = language_model.norm.register_forward_pre_hook(lambda module, args: captured.append(args[0]))
    try:
        language_model(
            inputs_embeds=inputs_embeds, position_ids=position_ids, attention_mask=mask,
            past_key_values=TransformersCacheView(cache), use_cache=True,
            cache_position=torch.arange(cache.length, cache.length + t, device=device),
        )
    finally:
        hook.remove()
    cache.advance(token_valid, t)
    return captured[0]
