"""EAGLE's drafter: one decoder layer that reads the target's own features (docs/design.md, "The methods in one line each").

At image position ``j`` the drafter reads ``fc([e(x_j); f_j])``: the embedding of code ``j`` and the target's
pre-norm last hidden state ``f_j`` that predicted it, and predicts ``f_{j+1}``, the state that will predict code
``j + 1``. Its logits go through the backbone's own final norm and image-code head, so the drafter has no head of its
own. It attends over the image positions before it (its own small KV cache of the accepted prefix at inference),
with 2-D RoPE over (row, column) of the grid. The layer is a Llama block (RMSNorm, attention, SwiGLU), the block
type of the LlamaGen, Janus-Pro, Emu3 and Chameleon trunks, at the backbone's width.

Trained by ``scripts/train_heads.py --kind eagle``: SmoothL1 on the next feature plus 0.1 x cross-entropy of its
logits, with noise on the input features, on the model's own generations.
"""

from typing import Optional

import torch
from diffusers.configuration_utils import register_to_config
from torch import nn

from ..core.contracts import DRAFTER
from ..core.kv_cache import StaticKVCache, varying_length_attention
from ..models.blocks import TransformerBlock, llamagen_intermediate_size, rope_2d_table
from .heads_utils import DraftHeadsMixin, check_heads_args, check_heads_size


class EagleDraftHead(DraftHeadsMixin):
    r"""The EAGLE drafter for one backbone.

    Args:
        base_model_name_or_path (`str`, *optional*), base_model_revision (`str`, *optional*): the backbone.
        hidden_size (`int`), num_image_codes (`int`), grid_height (`int`), grid_width (`int`): backbone facts.
        family (`str`, *optional*): the backbone's family (``"llamagen"``, ``"janus"``, ...); heads that record
            one are refused by a backbone of another family.
        num_attention_heads (`int`): attention heads of the drafter's layer.
        num_key_value_heads (`int`, *optional*): GQA heads (default: as many as attention heads).
        intermediate_size (`int`, *optional*): SwiGLU width (default: LlamaGen's rule, ``8/3 * hidden_size``
            rounded up to a multiple of 64).
        norm_eps (`float`), rope_theta (`float`): the layer's RMSNorm epsilon and RoPE base.
    """

    kind = DRAFTER

    @register_to_config
    def __init__(self, base_model_name_or_path: Optional[str] = None, base_model_revision: Optional[str] = None,
                 hidden_size: int = 1280, num_image_codes: int = 16384, grid_height: int = 16, grid_width: int = 16,
                 num_attention_heads: int = 20, num_key_value_heads: Optional[int] = None,
                 intermediate_size: Optional[int] = None, norm_eps: float = 1e-5, rope_theta: float = 10000.0,
                 family: Optional[str] = None):
        super().__init__()
        check_heads_args(base_model_name_or_path, base_model_revision, family=family,
                         ints=[("hidden_size", hidden_size), ("num_attention_heads", num_attention_heads), ("grid_height", grid_height),
                               ("grid_width", grid_width), ("num_image_codes", num_image_codes)],
                         optional_ints=[("num_key_value_heads", num_key_value_heads), ("intermediate_size", intermediate_size)],
                         positives=[("norm_eps", norm_eps), ("rope_theta", rope_theta)])
        if hidden_size % num_attention_heads or (hidden_size // num_attention_heads) % 4:
            raise ValueError(f"`hidden_size` ({hidden_size}) must split into `num_attention_heads` ({num_attention_heads}) heads "
                             "whose size is a multiple of 4 (2-D RoPE).")
        kv_heads = num_key_value_heads or num_attention_heads
        if num_attention_heads % kv_heads:
            raise ValueError(f"`num_key_value_heads` ({kv_heads}) must divide `num_attention_heads` ({num_attention_heads}).")
        width = intermediate_size or llamagen_intermediate_size(hidden_size, 64, None)
        head_dim = hidden_size // num_attention_heads
        values = (2 * hidden_size + 1) * hidden_size + hidden_size * (hidden_size + 2 * kv_heads * head_dim) \
            + hidden_size * hidden_size + 3 * hidden_size * width + 2 * hidden_size + grid_height * grid_width * head_dim
        check_heads_size(type(self).__name__, values, [("hidden_size", hidden_size), ("intermediate_size", width),
                                                       ("grid_height", grid_height), ("grid_width", grid_width)])
        self.fc = nn.Linear(2 * hidden_size, hidden_size, bias=True)
        self.layer = TransformerBlock(hidden_size, num_attention_heads, kv_heads, width, norm_eps, 0.0)
        table = rope_2d_table(grid_height, grid_width, hidden_size // num_attention_heads, rope_theta, 0, False)  # (H*W, D/2, 2)
        self.register_buffer("rope_cos_sin", table, persistent=False)

    @classmethod
    def for_backbone(cls, backbone, decoder=None, random_init: bool = True, **kwargs) -> "EagleDraftHead":
        """A drafter sized for ``backbone`` (its width, codes, grid; the attention heads of its trunk when it says)."""
        heads = getattr(backbone, "num_attention_heads", None) or max(1, backbone.hidden_size // 64)
        head = cls(base_model_name_or_path=kwargs.pop("base_model_name_or_path", None), num_attention_heads=heads,
                   **{**backbone.facts(), **kwargs})
        return head._redrawn() if random_init else head

    @property
    def head_dim(self) -> int:
        return self.config.hidden_size // self.config.num_attention_heads

    def make_cache(self, batch_size: int, max_length: int, dtype=None, device=None, **kwargs) -> StaticKVCache:
        """The drafter's own KV cache: ``max_length`` slots per row (accepted prefix plus one draft tree); ``kwargs``
        go to `StaticKVCache` (``fixed_shape``, ...)."""
        p = next(self.parameters())
        return StaticKVCache(1, batch_size, self.layer.attention.num_kv_heads, self.head_dim, max_length,
                             dtype=dtype or p.dtype, device=device or p.device, **kwargs)

    def forward(self, features: torch.Tensor, token_embeds: torch.Tensor, raster_index: torch.Tensor,
                attention_mask: Optional[torch.Tensor] = None, cache: Optional[StaticKVCache] = None,
                past_visible: Optional[torch.Tensor] = None, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Predict the next features.

        Args:
            features (`torch.Tensor` `(B, T, D)`): pre-norm target features ``f_j`` (or the drafter's own
                predictions of them, deeper in a draft tree).
            token_embeds (`torch.Tensor` `(B, T, D)`): embeddings of the codes ``x_j`` those features predicted.
            raster_index (`torch.LongTensor` `(T,)` or `(B, T)`): the grid position ``j`` of each input (its RoPE).
            attention_mask (`torch.BoolTensor` `(T, T)` or `(B, T, T)`, *optional*): which new inputs see which
                (default causal; a tree mask when drafting). Everything in ``cache`` is seen.
            cache (`StaticKVCache`, *optional*): the drafter's KV cache; the new inputs are written after its
                ``length`` filled slots and ``advance`` is called.
            past_visible (`torch.BoolTensor` `(B, T, length)`, *optional*): which cached slots each new input sees
                (a tree's nodes see the accepted prefix and their own ancestors only); default all of them.
            mask (`torch.BoolTensor` `(B, T, A)`, *optional*): the whole mask over the slots the pass attends to, the
                new ones included, for a cache whose rows write at their own slots (`EagleDrafter`: the caller set
                its ``write_index``); ``attention_mask`` and ``past_visible`` are then not read.

        Returns:
            `torch.Tensor` `(B, T, D)`: predicted pre-norm features ``f_{j+1}``.
        """
        b, t, _ = features.shape
        dtype = self.fc.weight.dtype
        x = self.fc(torch.cat([token_embeds.to(dtype), features.to(dtype)], dim=-1))  # (B, T, D)
        if raster_index.dim() == 1:
            raster_index = raster_index[None].expand(b, t)
        rope = self.rope_cos_sin[raster_index]  # (B, T, D/2, 2) real pairs: the head's layer is small
        if attention_mask is None:
            attention_mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        if mask is not None:  # the caller's, over every attended slot
            mask = mask[:, None]  # (B, 1, T, A)
        elif cache is None:
            mask = attention_mask.expand(b, t, t)[:, None]  # (B, 1, T, T)
        elif past_visible is None:
            mask = cache.attention_mask(attention_mask, None)  # (B, 1, T, L + T)
        else:
            mask = torch.cat([past_visible, attention_mask.expand(b, t, t)], dim=-1)[:, None]  # (B, 1, T, L + T)
        with varying_length_attention(x.device, cache is None or cache.fixed_shape):  # a new length every pass
            out = self.layer(x, rope, mask, cache, 0)
        if cache is not None:
            cache.advance(None, t)
        return out
