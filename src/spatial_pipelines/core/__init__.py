"""Pure tensor code shared by decoders, heads and pipelines (depends on torch only)."""

from .contracts import DRAFTER, HEADS_KINDS, LATENT, OFFSET_LOGITS, HeadsNeed, HeadsProvide, check_heads
from .kv_cache import KVCache, StaticKVCache
from .layout import ImageTokenLayout
from .sampling import SamplingConfig, apply_top_k, apply_top_p, cfg_mix, logits_to_probs

__all__ = [
    "DRAFTER",
    "HEADS_KINDS",
    "HeadsNeed",
    "HeadsProvide",
    "LATENT",
    "OFFSET_LOGITS",
    "check_heads",
    "ImageTokenLayout",
    "SamplingConfig",
    "KVCache",
    "StaticKVCache",
    "apply_top_k",
    "apply_top_p",
    "cfg_mix",
    "logits_to_probs",
]
