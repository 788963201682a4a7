"""A minimal, independent gpt-fast-style AR loop over a `LlamaGenTransformer`'s weights: the reference the pipeline's
own AR loop is timed against (`scripts/benchmark.py` reports it as the ``minimal-ar`` row).

Static KV cache written at a fixed index, one boolean mask row per step sliced from a table built once, RoPE rows
sliced from a complex table built once, CFG rows as one batch, sampling by the Gumbel-max race (no host sync) with the
pipelines' keyed noise (`spatial_pipelines.core.sampling.keyed_gumbel`: one seed per image, drawn from its generator,
noise keyed by grid position and code). It shares no code with the pipeline's loop, decoders or cache: only the weights, the
prompt encoding and the noise function.

``compile=True`` is gpt-fast's recipe: the one-token decode step (embedding, every layer, final norm, head and CFG
mix) is one function compiled once with static shapes (``mode="reduce-overhead"``, CUDA graphs, on CUDA); the code it
reads and writes between steps (static KV cache, mask table) lives in buffers kept across calls of the same shape, so a
second call replays what the first compiled and recorded. The prefill and the sampling stay eager.
"""

from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from spatial_pipelines.core.sampling import draw_seeds, keyed_gumbel


@torch.no_grad()
def minimal_ar_generate(
    pipe, prompts: List[str], guidance_scale: float, temperature: float, top_k: Optional[int], generators,
    compile: bool = False, compile_backend: str = "inductor",
) -> torch.Tensor:
    """Code grids ``(B, H, W)`` for ``prompts`` with plain AR decoding; ``generators`` one per image (each gives its
    image's noise seed). ``compile``: the decode step through `torch.compile` (``compile_backend``; inductor runs it as
    ``"reduce-overhead"`` on CUDA)."""
    seeds = draw_seeds(generators, len(generators)) if temperature != 0 else None
    t = pipe.transformer
    cfg = guidance_scale != 1.0
    device = pipe._execution_device
    # 1. the prompt's prefix, then the static cache, mask and RoPE tables (built once)
    prefix = pipe.backbone.encode_prompt(list(prompts), None, cfg, device)  # (R, P, D), valid (R, P)
    model = StaticModel(t, prefix, guidance_scale if cfg else None, device, reuse=compile)
    rows, p, total = model.rows, model.prefix_length, model.total
    b, n = len(prompts), total - p

    def sample(logits, j: int):  # the code at grid index j
        return sample_code(logits, j, temperature, top_k, seeds, device)

    # 2. prefill: the prompt in one pass; its last position gives the first code
    x = model.forward(prefix.embeds, torch.arange(p, device=device), model.masks[:, None, :p, :].expand(rows, 1, p, total))
    tokens = torch.empty(b, n, dtype=torch.long, device=device)
    tokens[:, 0] = sample(model.logits(x[:, -1]), 0)
    # 3. one code per step: feed the last code at its slot, attend through one row of the mask table
    positions = torch.arange(p, total, device=device)  # slot of each image code's input, built once
    if compile:
        step = compiled_step(compile_backend, device)
        for j in range(1, n):
            tokens[:, j] = sample(step(model, tokens[:, j - 1].clone(), positions[j - 1 : j].clone()), j)
        return tokens.view(b, t.config.grid_height, t.config.grid_width)
    for j in range(1, n):
        code = tokens[:, j - 1]
        x = t.tok_embeddings.weight[code.repeat(2) if cfg else code][:, None]  # (R, 1, D)
        slot = positions[j - 1 : j]
        mask = model.masks[:, None, p + j - 1 : p + j, :]  # (R, 1, 1, S) a view of the table
        x = model.forward(x, slot, mask)
        tokens[:, j] = sample(model.logits(x[:, -1]), j)
    return tokens.view(b, t.config.grid_height, t.config.grid_width)


def decode_step(model: "StaticModel", code: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """One step as one function of fixed shapes: the last codes ``(B,)`` fed at ``slot`` ``(1,)`` -> guided logits
    ``(B, V)`` (the mask row is looked up by the slot inside, so no input changes shape or offset between steps)."""
    x = model.t.tok_embeddings.weight[code.repeat(2) if model.guidance_scale is not None else code][:, None]
    mask = model.masks.index_select(1, slot)[:, None]  # (R, 1, 1, S)
    return model.logits(model.forward(x, slot, mask)[:, -1])


#: the compiled decode step, one per (backend, device type): compiled once, its graphs reused by every later call
_COMPILED: Dict[Tuple[str, str], object] = {}


def compiled_step(backend: str, device: torch.device):
    key = (backend, device.type)
    if key not in _COMPILED:
        mode = "reduce-overhead" if backend == "inductor" and device.type == "cuda" else None
        _COMPILED[key] = torch.compile(decode_step, backend=backend, mode=mode, fullgraph=True, dynamic=False)
    return _COMPILED[key]


#: static buffers (KV cache, mask and RoPE tables) kept across compiled calls, by shape, dtype and device: CUDA graphs record
#: their addresses, so a call of the same shape reuses them (as gpt-fast's ``setup_caches``)
_BUFFERS: Dict[tuple, tuple] = {}


class StaticModel:
    """A `LlamaGenTransformer`'s forward over a static KV cache written at fixed slots: the cache, the mask table
    (row ``i`` lets position ``i`` see the valid prefix slots and every image slot ``<= i``) and the complex RoPE table
    are built once, for ``R`` rows (CFG rows as one batch) and ``S = P + H * W`` slots.

    Args:
        transformer (`LlamaGenTransformer`): the weights.
        prefix: the encoded prompt (``embeds`` ``(R, P, D)``, ``valid`` ``(R, P)``).
        guidance_scale (`float`, *optional*): mixes the two halves of the rows' logits; ``None``: no CFG.
        device (`torch.device`): where the cache and tables live.
        reuse (`bool`): take the cache and tables from buffers kept across calls of this shape (their addresses
            marked static for `torch.compile`), the tables copied in.
    """

    def __init__(self, transformer, prefix, guidance_scale: Optional[float], device, reuse: bool = False):
        t = self.t = transformer
        self.guidance_scale = guidance_scale
        self.rows, self.prefix_length, self.d = prefix.embeds.shape
        self.h, self.hkv = t.config.num_attention_heads, t.layers[0].attention.num_kv_heads
        self.hd = self.d // self.h
        self.total = self.prefix_length + t.config.grid_height * t.config.grid_width
        rows, total = self.rows, self.total
        rope = torch.view_as_complex(t.freqs_cis.float().contiguous())  # (S, hd/2)
        causal = torch.ones(total, total, dtype=torch.bool, device=device).tril()
        valid = torch.cat([prefix.valid, torch.ones(rows, total - self.prefix_length, dtype=torch.bool, device=device)], 1)  # (R, S)
        masks = (causal[None] & valid[:, None, :]) | torch.eye(total, dtype=torch.bool, device=device)  # (R, S, S)
        key = (rows, self.hkv, total, self.hd, len(t.layers), prefix.embeds.dtype, str(device))
        if reuse and key in _BUFFERS:
            self.keys, self.values, self.masks, self.rope = _BUFFERS[key]
            for buffer in (*self.keys, *self.values):
                buffer.zero_()
            self.masks.copy_(masks)
            self.rope.copy_(rope)
            return
        self.keys = [torch.zeros(rows, self.hkv, total, self.hd, dtype=prefix.embeds.dtype, device=device) for _ in t.layers]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self.masks, self.rope = masks, rope
        if reuse:
            for buffer in (*self.keys, *self.values, self.masks, self.rope):
                torch._dynamo.mark_static_address(buffer)
            _BUFFERS[key] = (self.keys, self.values, self.masks, self.rope)

    def apply_rope(self, x, heads, pos):  # x (R, T, heads*hd) -> (R, T, heads, hd)
        # in fp32 (view_as_complex has no bf16; as the model's own apply_rope), back to the weights' dtype
        z = torch.view_as_complex(x.float().reshape(self.rows, -1, heads, self.hd // 2, 2)) * self.rope[pos][None, :, None]
        return torch.view_as_real(z).flatten(3).type_as(x)

    def layer_forward(self, x, layer, i, pos, mask):  # x (R, T, D); pos (T,) slots written
        h, hkv, hd, d = self.h, self.hkv, self.hd, self.d
        a = layer.attention
        y = F.rms_norm(x, (d,), layer.attention_norm.weight, layer.attention_norm.eps)
        qkv = F.linear(y, a.wqkv.weight)
        q, k, v = qkv.split([h * hd, hkv * hd, hkv * hd], -1)
        q, k = self.apply_rope(q, h, pos), self.apply_rope(k, hkv, pos)
        self.keys[i].index_copy_(2, pos, k.transpose(1, 2))  # fixed-shape cache write
        self.values[i].index_copy_(2, pos, v.reshape(self.rows, -1, hkv, hd).transpose(1, 2))
        o = F.scaled_dot_product_attention(q.transpose(1, 2), self.keys[i], self.values[i], attn_mask=mask, enable_gqa=h != hkv)
        x = x + F.linear(o.transpose(1, 2).reshape(self.rows, -1, d), a.wo.weight)
        ff = layer.feed_forward
        y = F.rms_norm(x, (d,), layer.ffn_norm.weight, layer.ffn_norm.eps)
        return x + F.linear(F.silu(F.linear(y, ff.w1.weight)) * F.linear(y, ff.w3.weight), ff.w2.weight)

    def forward(self, x, pos, mask):  # x (R, T, D) -> (R, T, D) through every layer
        for i, layer in enumerate(self.t.layers):
            x = self.layer_forward(x, layer, i, pos, mask)
        return x

    def logits(self, x):  # (R, D) -> (B, V) guided
        t = self.t
        logits = F.linear(F.rms_norm(x, (self.d,), t.norm.weight, t.norm.eps), t.output.weight).float()
        if self.guidance_scale is not None:
            cond, uncond = logits.chunk(2)
            logits = uncond + self.guidance_scale * (cond - uncond)
        return logits


def sample_code(logits, j: int, temperature: float, top_k: Optional[int], seeds, device) -> torch.Tensor:
    """The code ``(B,)`` at grid index ``j`` from guided ``logits`` ``(B, V)``: argmax at temperature 0, else the
    Gumbel-max race over the ``top_k`` largest with keyed noise (``seeds``)."""
    if temperature == 0:
        return logits.argmax(-1)
    kept, codes = (logits / temperature).topk(top_k or logits.shape[-1], -1)  # (B, k) the rest would be -inf
    pick = (kept + keyed_gumbel(seeds.to(device), j, codes, logits.shape[-1])).argmax(-1, keepdim=True)
    return codes.gather(-1, pick).squeeze(-1)
