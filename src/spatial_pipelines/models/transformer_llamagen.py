"""The LlamaGen transformer: Llama blocks with 2-D RoPE over the image grid and a condition prefix.

Module and parameter names follow the original LlamaGen ``gpt.py`` (``tok_embeddings``, ``layers.N.attention.
wqkv``, ``cls_embedding.cap_proj.fc1`` ...), so an original checkpoint converts by renaming nothing. Written
from the LlamaGen paper and the public description of its architecture.
"""

from dataclasses import dataclass
from typing import Optional

import torch
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from diffusers.utils import BaseOutput
from torch import nn

from ..core.kv_cache import StaticKVCache
from ..core.layout import ImageTokenLayout
from ..utils import CheckedSaveMixin, check_choice, check_number, compute_dtype
from ..weight_checks import CheckedLoadMixin
from .blocks import RMSNorm, TransformerBlock, llamagen_intermediate_size, rope_2d_table

CONDITION_TYPES = ("class", "text")


class LabelEmbedder(nn.Module):
    """Class labels -> one prefix token; index ``num_classes`` is the unconditional (CFG) class."""

    def __init__(self, num_classes: int, hidden_size: int):
        super().__init__()
        self.embedding_table = nn.Embedding(num_classes + 1, hidden_size)
        self.num_classes = num_classes

    def forward(self, labels: torch.Tensor) -> torch.Tensor:
        return self.embedding_table(labels).unsqueeze(1)  # (B, 1, D)


class CaptionMLP(nn.Module):
    def __init__(self, in_features: int, hidden_features: int, out_features: int):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features, bias=False)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(hidden_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class CaptionEmbedder(nn.Module):
    """Text-encoder token embeddings ``(B, N, caption_dim)`` -> prefix ``(B, N, D)``; ``uncond_embedding`` is
    the fixed caption used for the unconditional (CFG) row."""

    def __init__(self, caption_dim: int, hidden_size: int, num_tokens: int):
        super().__init__()
        self.cap_proj = CaptionMLP(caption_dim, hidden_size, hidden_size)
        self.register_buffer("uncond_embedding", torch.randn(num_tokens, caption_dim) / caption_dim**0.5)

    def forward(self, caption: torch.Tensor) -> torch.Tensor:
        return self.cap_proj(caption)


def check_sampling_defaults(default_guidance_scale, default_top_k) -> None:
    """Raise `ValueError` unless the saved sampling defaults are ``None`` or valid call values."""
    check_number("default_guidance_scale", default_guidance_scale, 0, optional=True)
    check_number("default_top_k", default_top_k, 0, integer=True, optional=True)


@dataclass
class LlamaGenTransformerOutput(BaseOutput):
    """
    Args:
        hidden_states (`torch.Tensor` of shape `(B, T, D)`): last hidden state **before** the final norm.
        last_hidden_state (`torch.Tensor` of shape `(B, T, D)`): the same **after** the final norm.
    """

    hidden_states: torch.Tensor
    last_hidden_state: Optional[torch.Tensor] = None


class LlamaGenTransformer(CheckedLoadMixin, CheckedSaveMixin, ModelMixin, ConfigMixin):
    r"""LlamaGen's GPT: a decoder-only Llama over ``[condition prefix, image codes]`` with 2-D RoPE.

    Args:
        vocab_size (`int`): image codes (the VQ codebook size).
        hidden_size (`int`), num_layers (`int`), num_attention_heads (`int`): trunk size.
        num_key_value_heads (`int`, *optional*): GQA heads (default: as many as attention heads).
        intermediate_size (`int`, *optional*): SwiGLU width (default: LlamaGen's rule from ``multiple_of`` and
            ``ffn_dim_multiplier``).
        rope_theta (`float`), norm_eps (`float`): RoPE base and RMSNorm epsilon.
        condition_type (`str`): ``"class"`` (a class-label prefix token) or ``"text"`` (projected text-encoder
            token embeddings).
        num_classes (`int`): labels of a class-conditional model.
        caption_dim (`int`): width of the text encoder's token embeddings.
        num_condition_tokens (`int`): prefix length (1 for class labels, the caption length for text).
        grid_height (`int`), grid_width (`int`): the image-code grid.
        zero_prefix_rope (`bool`): the original LlamaGen zeroes prefix queries/keys through its RoPE table; keep
            ``True`` to reproduce original checkpoints.
        end_of_row_token (`bool`): feed a learned end-of-row (EOL) token after every row of codes, as Emu3 and
            Lumina-mGPT do (original LlamaGen checkpoints have none). Rows are then ``grid_width + 1`` positions
            apart; the EOL takes the RoPE column ``grid_width`` and is never predicted (the decoding loop forces it).
        dropout (`float`): residual/FFN dropout while training.
        default_guidance_scale (`float`, *optional*), default_top_k (`int`, *optional*): the sampling this checkpoint
            was tuned for; a pipeline call that leaves ``guidance_scale`` / ``top_k`` at ``None`` uses them. They live
            here, in a component, so they travel with it (``Pipeline(**pipe.components)``, ``from_pipe``, save/load).
    """

    _supports_gradient_checkpointing = True
    _no_split_modules = ["TransformerBlock"]
    #: recorded in the saved weights' metadata: a folder whose config asks for another grid or prefix is refused
    trained_facts = ("grid_height", "grid_width", "num_condition_tokens")

    @register_to_config
    def __init__(self, vocab_size: int = 16384, hidden_size: int = 1280, num_layers: int = 36,
                 num_attention_heads: int = 20, num_key_value_heads: Optional[int] = None,
                 intermediate_size: Optional[int] = None, multiple_of: int = 256,
                 ffn_dim_multiplier: Optional[float] = None, rope_theta: float = 10000.0, norm_eps: float = 1e-5,
                 condition_type: str = "text", num_classes: int = 1000, caption_dim: int = 2048,
                 num_condition_tokens: int = 120, grid_height: int = 16, grid_width: int = 16,
                 zero_prefix_rope: bool = True, end_of_row_token: bool = False, dropout: float = 0.0,
                 default_guidance_scale: Optional[float] = None, default_top_k: Optional[int] = None):
        super().__init__()
        check_sampling_defaults(default_guidance_scale, default_top_k)
        check_choice("condition_type", condition_type, CONDITION_TYPES)
        if hidden_size % num_attention_heads or (hidden_size // num_attention_heads) % 4:
            raise ValueError(f"`hidden_size` ({hidden_size}) must split into `num_attention_heads` "
                             f"({num_attention_heads}) heads whose size is a multiple of 4 (2-D RoPE).")
        num_kv = num_key_value_heads or num_attention_heads
        inter = intermediate_size or llamagen_intermediate_size(hidden_size, multiple_of, ffn_dim_multiplier)
        if condition_type == "class":
            self.cls_embedding = LabelEmbedder(num_classes, hidden_size)
        else:
            self.cls_embedding = CaptionEmbedder(caption_dim, hidden_size, num_condition_tokens)
        self.tok_embeddings = nn.Embedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList(
            TransformerBlock(hidden_size, num_attention_heads, num_kv, inter, norm_eps, dropout)
            for _ in range(num_layers)
        )
        self.norm = RMSNorm(hidden_size, norm_eps)
        self.output = nn.Linear(hidden_size, vocab_size, bias=False)
        # the EOL, when there is one, is an extra column of the grid: it takes that column's rotation
        # (zeros: learned from there; drawing it would shift every other weight a seed gives)
        self.eol_embedding = nn.Parameter(torch.zeros(hidden_size)) if end_of_row_token else None
        table = rope_2d_table(grid_height, grid_width + int(end_of_row_token), hidden_size // num_attention_heads,
                              rope_theta, num_condition_tokens, zero_prefix_rope)
        self.register_buffer("freqs_cis", table, persistent=False)
        self._freqs_complex: Optional[torch.Tensor] = None  # complex view of freqs_cis, built once (not a buffer: .to(dtype) would drop its imaginary part)
        self.gradient_checkpointing = False
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)

    def rope_table(self) -> torch.Tensor:
        """``freqs_cis`` as complex rotations ``(P + H*W, D/2)``, built once per device and dtype of the buffer."""
        table = self._freqs_complex
        if table is None or table.device != self.freqs_cis.device or self._freqs_source_dtype != self.freqs_cis.dtype:
            table = self._freqs_complex = torch.view_as_complex(self.freqs_cis.float().contiguous())
            self._freqs_source_dtype = self.freqs_cis.dtype
        return table

    # -- pieces the pipeline adapter uses ---------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.config.hidden_size // self.config.num_attention_heads

    def embed_condition(self, condition: torch.Tensor) -> torch.Tensor:
        """Class labels ``(B,)`` or caption embeddings ``(B, N, caption_dim)`` -> prefix ``(B, P, D)``."""
        return self.cls_embedding(condition)

    @property
    def layout(self) -> ImageTokenLayout:
        """The code grid; with ``end_of_row_token`` the EOL's id is ``vocab_size`` (the id after the codes)."""
        c = self.config
        return ImageTokenLayout(c.grid_height, c.grid_width, c.vocab_size if c.end_of_row_token else None)

    def embed_image_tokens(self, codes: torch.Tensor) -> torch.Tensor:
        return self.tok_embeddings(codes)  # (B, T, D)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Pre-norm hidden states -> image-code logits (fp32)."""
        return self.output(self.norm(hidden_states)).float()

    def drop_condition(self, condition: torch.Tensor, drop: torch.Tensor) -> torch.Tensor:
        """Training-time CFG dropout: rows where ``drop`` is True get the null condition (the unconditional
        class, or the null caption under the row's own padding mask, as LlamaGen)."""
        if self.config.condition_type == "class":
            return torch.where(drop, torch.full_like(condition, self.config.num_classes), condition)
        null = self.cls_embedding.uncond_embedding.to(condition.dtype)
        return torch.where(drop[:, None, None], null, condition)

    def teacher_forced_hidden_states(self, codes: torch.Tensor, condition: torch.Tensor, condition_valid: torch.Tensor,
                                     drop: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Pre-norm hidden states ``(B, N, D)`` over a whole code grid ``(B, N)``: row ``i`` predicts code ``i``.

        Args:
            condition: class labels ``(B,)`` or caption embeddings ``(B, P, caption_dim)``; condition_valid ``(B, P)``.
            drop (`torch.BoolTensor` `(B,)`, *optional*): rows whose condition is dropped (CFG training).
        """
        if drop is not None:
            condition = self.drop_condition(condition, drop)
        prefix = self.embed_condition(condition)  # (B, P, D)
        p, layout = prefix.shape[1], self.layout
        # the input that precedes code i sits at p - 1 + offset(i): code i - 1, or the EOL ending the row above
        index = p - 1 + layout.sequence_offset(torch.arange(codes.shape[1], device=codes.device))  # (N,)
        seq = layout.image_sequence(self.embed_image_tokens(codes), self.eol_embedding)  # (B, S, D)
        x = torch.cat([prefix, seq], 1)[:, : p + layout.sequence_offset(codes.shape[1] - 1)]  # nothing after the last input
        valid = torch.cat([condition_valid, torch.ones_like(x[:, p:, 0], dtype=torch.bool)], 1)
        hidden = self(x, torch.arange(x.shape[1], device=x.device), token_valid=valid).hidden_states
        return hidden[:, index]

    def make_cache(self, batch_size: int, max_length: int) -> StaticKVCache:
        return StaticKVCache(len(self.layers), batch_size, self.layers[0].attention.num_kv_heads, self.head_dim,
                             max_length, dtype=compute_dtype(self),  # not an fp8 storage dtype of layerwise casting
                             device=self.tok_embeddings.weight.device)

    def forward(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: Optional[torch.Tensor] = None, token_valid: Optional[torch.Tensor] = None,
                past_key_values: Optional[StaticKVCache] = None, return_dict: bool = True, advance_cache: bool = True):
        """
        Args:
            inputs_embeds (`torch.Tensor` of shape `(B, T, D)`): prefix and/or image-code embeddings.
            position_ids (`torch.LongTensor` of shape `(B, T)` or `(T,)`): absolute positions (prefix ``0..P-1``,
                image code ``i`` at ``P + i``); they index the 2-D RoPE table.
            attention_mask (`torch.BoolTensor` of shape `(B, T, T)` or `(T, T)`, *optional*): which new tokens see
                which (default causal; a tree mask for speculative drafts). Cached tokens are always visible.
            token_valid (`torch.BoolTensor` of shape `(B, T)`, *optional*): ``False`` marks padding.
            past_key_values (`StaticKVCache`, *optional*): filled in place.
            advance_cache (`bool`): call the cache's ``prepare_write`` before the pass and ``advance`` after it. A
                compiled step passes ``False`` and its caller does both outside the graph (they move host-side
                counters, which a graph would bake in and recompile on).
        """
        b, t, _ = inputs_embeds.shape
        device = inputs_embeds.device
        if past_key_values is not None and advance_cache:
            past_key_values.prepare_write(t)
        if position_ids.dim() == 1:
            position_ids = position_ids[None].expand(b, t)
        if attention_mask is None:
            attention_mask = torch.ones(t, t, dtype=torch.bool, device=device).tril()
        if past_key_values is not None:  # token_valid None: a decoding round, nothing to pad
            mask = past_key_values.attention_mask(attention_mask, token_valid)  # (B, 1, T, L+T)
        else:
            valid = torch.ones(b, t, dtype=torch.bool, device=device) if token_valid is None else token_valid
            eye = torch.eye(t, dtype=torch.bool, device=device)
            mask = ((attention_mask.expand(b, t, t) & valid[:, None, :]) | eye)[:, None]  # (B, 1, T, T)
        # eager: complex rotations (fewest ops); compiled: cos/sin pairs (inductor generates no complex code)
        rope = self.freqs_cis[position_ids] if torch.compiler.is_compiling() else self.rope_table()[position_ids]
        h = inputs_embeds
        for i, layer in enumerate(self.layers):
            if torch.is_grad_enabled() and self.gradient_checkpointing:
                h = self._gradient_checkpointing_func(layer, h, rope, mask, past_key_values, i)
            else:
                h = layer(h, rope, mask, past_key_values, i)
        if past_key_values is not None and advance_cache:
            past_key_values.advance(token_valid, t)
        out = LlamaGenTransformerOutput(hidden_states=h, last_hidden_state=self.norm(h))
        return out if return_dict else out.to_tuple()
