"""Family-neutral Llama building blocks: RMSNorm, attention with rotary embeddings over a table, the SwiGLU
feed-forward and the pre-norm block, plus the 2-D RoPE table of an image grid. Our LlamaGen transformer and the
EAGLE drafter (which serves every family) are built from them.

Module and parameter names follow the original LlamaGen ``gpt.py`` (``attention.wqkv``, ``feed_forward.w1`` ...),
so LlamaGen checkpoints and saved drafters load unchanged.
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..core.kv_cache import StaticKVCache

def find_multiple(n: int, k: int) -> int:
    return n if n % k == 0 else n + k - n % k

def llamagen_intermediate_size(hidden_size: int, multiple_of: int, ffn_dim_multiplier: Optional[float]) -> int:
    """LlamaGen's SwiGLU width: ``2/3 * 4 * dim`` (times an optional multiplier), rounded up to ``multiple_of``."""
    hidden = int(2 * 4 * hidden_size / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return find_multiple(hidden, multiple_of)

def rope_2d_table(grid_height: int, grid_width: int, head_dim: int, theta: float, num_prefix: int,
                  zero_prefix: bool) -> torch.Tensor:
    """cos/sin table ``(num_prefix + H*W, head_dim // 2, 2)``: half the rotary pairs encode the row, half the column.

    Prefix positions get cos=sin=0 when ``zero_prefix`` (the original LlamaGen behaviour: prefix queries and keys
    are zeroed) or the identity rotation otherwise.
    """
    quarter = head_dim // 4
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim // 2, 2)[:quarter].float() / (head_dim // 2)))  # (D/4,)
    rows = torch.outer(torch.arange(grid_height).float(), freqs)  # (H, D/4)
    cols = torch.outer(torch.arange(grid_width).float(), freqs)  # (W, D/4)
    angles = torch.cat(
        [rows[:, None, :].expand(-1, grid_width, -1), cols[None, :, :].expand(grid_height, -1, -1)], dim=-1
    ).flatten(0, 1)  # (H*W, D/2)
    grid = torch.stack([angles.cos(), angles.sin()], dim=-1)  # (H*W, D/2, 2)
    prefix = torch.zeros(num_prefix, head_dim // 2, 2)
    if not zero_prefix:
        prefix[..., 0] = 1.0
    return torch.cat([prefix, grid])

def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of ``x`` ``(B, T, H, D)`` by ``table``: complex ``(B, T, D/2)`` (one complex multiply:
    the fewest ops per call, which is what a small model's step pays for) or cos/sin pairs ``(B, T, D/2, 2)``
    (fp32 math either way)."""
    if not table.is_complex():  # real arithmetic: what torch.compile turns into one fused kernel
        xs = x.float().reshape(*x.shape[:-1], -1, 2)  # (B, T, H, D/2, 2)
        cos, sin = table[:, :, None, :, 0].float(), table[:, :, None, :, 1].float()  # (B, T, 1, D/2)
        out = torch.stack([xs[..., 0] * cos - xs[..., 1] * sin, xs[..., 1] * cos + xs[..., 0] * sin], dim=-1)
        return out.flatten(3).type_as(x)
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))  # (B, T, H, D/2)
    return torch.view_as_real(xc * table[:, :, None]).flatten(3).type_as(x)

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one fused op instead of five (per-op dispatch is half a small model's step); fp32 math as LlamaGen
        return F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).type_as(x) * self.weight

class Attention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, dropout: float):
        super().__init__()
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = hidden_size // num_heads
        self.wqkv = nn.Linear(hidden_size, (num_heads + 2 * num_kv_heads) * self.head_dim, bias=False)
        self.wo = nn.Linear(hidden_size, hidden_size, bias=False)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x, rope, mask, cache: Optional[StaticKVCache], layer_idx: int) -> torch.Tensor:
        b, t, _ = x.shape
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qk, v = self.wqkv(x).split([(h + hkv) * d, hkv * d], dim=-1)
        qk = apply_rope(qk.reshape(b, t, h + hkv, d), rope).transpose(1, 2)  # (B, H + Hkv, T, D): one rotation for both
        q, k = qk[:, :h], qk[:, h:]  # (B, H, T, D), (B, Hkv, T, D)
        v = v.view(b, t, hkv, d).transpose(1, 2)  # (B, Hkv, T, D)
        if cache is not None:
            k, v = cache.update(layer_idx, k, v)  # (B, Hkv, L+T, D)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.num_kv_heads != self.num_heads)
        out = self.wo(out.transpose(1, 2).reshape(b, t, -1))
        return self.resid_dropout(out) if self.training else out  # no dropout call per layer at inference

class FeedForward(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, dropout: float):
        super().__init__()
        self.w1 = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.w3 = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.w2 = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.ffn_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.ffn_dropout(out) if self.training else out

class TransformerBlock(nn.Module):
    def __init__(self, hidden_size, num_heads, num_kv_heads, intermediate_size, norm_eps, dropout):
        super().__init__()
        self.attention = Attention(hidden_size, num_heads, num_kv_heads, dropout)
        self.feed_forward = FeedForward(hidden_size, intermediate_size, dropout)
        self.attention_norm = RMSNorm(hidden_size, norm_eps)
        self.ffn_norm = RMSNorm(hidden_size, norm_eps)

    def forward(self, x, rope, mask, cache, layer_idx):
        h = x + self.attention(self.attention_norm(x), rope, mask, cache, layer_idx)
        return h + self.feed_forward(self.ffn_norm(h))
