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

from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple

import torch

from ..core.kv_cache import StaticKVCache, varying_length_attention
from .compiled import mark_static_cache, uses_cuda_graphs
from .device_loop import compile_round
from .pass_cost import PassCost

if TYPE_CHECKING:
    from .rows import RowBatch
    from .backbone import SpatialBackbone

#: Fixed-shape caches are allocated in multiples of this many slots (one graph serves every prompt length that
#: rounds up to the same size).
STATIC_LENGTH_MULTIPLE = 256


#: `SpatialARPipeline.enable_compile` raises dynamo's per-function recompile limit to at least this: each decoder
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


class StaticShapesMixin:
    """The pipeline's static-shape rounds and compiled step (`SpatialARPipeline` inherits it): `static_shapes`, the
    round's cache, padding and target call, and `enable_compile` / `disable_compile`."""

    @property
    def static_shapes(self) -> bool:
        """Whether every round of a generation runs the target with a few fixed shapes: the KV cache (its length rounded
        up) attended over one of at most ``attend_buckets`` fixed lengths and every draft padded to the decoder's
        largest (`static_shapes` module). On by
        default when the target is compiled (`enable_compile`), off otherwise (eager, the growing slice is cheaper).
        Set it to ``True``/``False`` to choose, ``None`` for the default. Outputs are the same either way."""
        chosen = self.__dict__.get("_static_shapes")
        return self.is_compiled if chosen is None else chosen

    @static_shapes.setter
    def static_shapes(self, value: Optional[bool]) -> None:
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"`static_shapes` must be True, False or None (the default: on when compiled), got {value!r}.")
        self.__dict__["_static_shapes"] = value

    def _make_cache(self, backbone: "SpatialBackbone", rows: int, needed: int) -> StaticKVCache:
        """Step 3's KV cache. With static shapes its length is rounded up (one size serves many prompt lengths) and the
        cache is kept for the next call of the same size: its tensors keep their address, which CUDA graphs replay."""
        if not self.static_shapes:
            return backbone.make_cache(rows, needed)
        length = static_cache_length(needed)
        cache = backbone.caches.kv_cache
        if (cache is None or cache.max_length != length or cache.storage.shape[2] != rows
                or cache.storage.dtype != backbone.dtype or cache.storage.device != self._execution_device):
            cache = backbone.make_cache(rows, length)
            cache.fixed_shape = True
            backbone.caches.kv_cache = cache
        cache.reset()
        mark_static_cache(cache, uses_cuda_graphs(backbone.target_module, cache.storage.device))
        return cache

    def _pad_round(self, embeds, position_ids, mask, batch: "RowBatch"):
        """Static shapes: pad the round's fed embeddings ``(R, T', D)`` to ``batch.fed_size`` slots (`pad_fed`)."""
        fed, size = embeds.shape[1], batch.fed_size
        batch.fed_slots += size
        batch.padded_slots += size - fed
        return pad_fed(embeds, position_ids, mask, size)  # (R, F, D): padding feeds a zero vector

    def _target_forward(self, backbone: "SpatialBackbone", embeds, position_ids, mask, cache) -> torch.Tensor:
        """The round's target pass. Under CUDA graphs each round is a new graph step and the output is copied out of
        the graph's memory (the next replay overwrites it, and decoders keep hidden states across rounds)."""
        graphs = uses_cuda_graphs(backbone.target_module, embeds.device)
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        with varying_length_attention(embeds.device, cache.fixed_shape):
            hidden = backbone.forward(embeds, position_ids, mask, None, cache)  # (R, T', D)
        return hidden.clone() if graphs else hidden

    def enable_compile(
        self,
        mode: Optional[str] = None,
        dynamic: bool = False,
        fullgraph: Optional[bool] = None,
        backend: str = "inductor",
        keep_if_slower: bool = False,
        measure: bool = True,
        **kwargs,
    ) -> Dict[str, Any]:
        """Compile the round's target step once per shape, and keep it only where it measures faster.

        With the target compiled, `static_shapes` is on: every round of a generation feeds the same number of slots
        and attends to one of a few fixed lengths (`StaticKVCache`'s ``attend_buckets``), so a handful of graphs (one
        per length reached) serve the whole generation and every later one of the same batch, draft size and cache
        size; a new prompt length compiles nothing (the prefill runs eagerly). The first round of each new shape
        compiles (tens of seconds with inductor on a CPU). Dynamo's per-function recompile limit is raised to at least
        `RECOMPILE_LIMIT` (64), since swapping decoders adds graphs.

        Args:
            mode (`str`, *optional*): ``torch.compile``'s mode; default ``"reduce-overhead"`` (CUDA graphs) on a GPU
                with inductor, none otherwise.
            dynamic (`bool`): ``False`` (the default): static shapes, one graph per shape.
            fullgraph (`bool`, *optional*): no graph breaks allowed; default: the backbone's ``supports_fullgraph``.
            backend (`str`): ``"inductor"``, or ``"eager"`` / ``"aot_eager"`` to check graphs and recompiles quickly.
            keep_if_slower (`bool`): keep the compiled step even when it measures slower.
            measure (`bool`): time the eager and compiled passes (one fed token and eight, CFG rows, after warming up)
                and drop the compiled step unless it is faster; ``False`` keeps it unmeasured.
            kwargs: further ``torch.compile`` options.

        Returns:
            ``{"eager_ms": {T: ms}, "compiled_ms": {T: ms}, "enabled": bool, "options": {...}}`` (no timings when
            ``measure=False``).
        """
        backbone = self.backbone
        module = backbone.target_module
        on_gpu = self._execution_device.type == "cuda"
        if mode is None and on_gpu and backend == "inductor":
            mode = "reduce-overhead"
        options = dict(backend=backend, dynamic=dynamic, fullgraph=backbone.supports_fullgraph if fullgraph is None else fullgraph,
                       **({} if mode is None else {"mode": mode}), **kwargs)
        rows, sizes = (2 if backbone.default_guidance_scale != 1.0 else 1), [1, 8]
        self.disable_compile()
        # a graph per fed size and attended length (`attend_buckets`): swapping decoders passes dynamo's default of 8
        # graphs per function, past which it would fail (fullgraph) or run eagerly without a word
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        eager = PassCost(backbone, rows, repeats=5, warmup=1).measure(sizes) if measure else {}
        module.compile(**options)
        module._spatial_compile_mode = mode  # read by `uses_cuda_graphs`
        module._spatial_compile_options = options  # device rounds compile with the same (`_compiled_device_round`)
        compiled = PassCost(backbone, rows, repeats=5, warmup=2, compiled=True, fixed_shape=True).measure(sizes) if measure else {}
        enabled = keep_if_slower or not measure or compiled[1] < eager[1]
        if not enabled:
            self.disable_compile()
        self.backbone.caches.pass_costs.clear()  # "auto" sizes are chosen again for the forward that runs now
        return {"eager_ms": {t: 1e3 * s for t, s in eager.items()}, "compiled_ms": {t: 1e3 * s for t, s in compiled.items()},
                "enabled": enabled, "options": {k: v for k, v in options.items() if isinstance(v, (str, bool, int, float, type(None)))}}

    def disable_compile(self) -> None:
        """Undo `enable_compile`: the target forward runs eagerly again."""
        module = self.backbone.target_module
        module._compiled_call_impl = None  # what nn.Module.compile sets
        module._spatial_compile_mode = None
        module._spatial_compile_options = None
        module.__dict__.pop("_spatial_device_rounds", None)
        self.backbone.caches.pass_costs.clear()
        self.backbone.caches.kv_cache = None

    def _compiled_device_round(self, round_fn):
        """With the target compiled: a round that runs whole on the device (`device_loop.chain_round` or
        `head_tree_round`) compiled whole with the same options (`device_loop.compile_round`, ``fullgraph=True``),
        made once per function and `enable_compile`; ``None`` when eager."""
        if not self.is_compiled:
            return None
        module = self.backbone.target_module
        rounds = module.__dict__.setdefault("_spatial_device_rounds", {})
        compiled = rounds.get(round_fn.__name__)
        if compiled is None:
            options = dict(getattr(module, "_spatial_compile_options", None) or {})
            options["fullgraph"] = self.backbone.supports_fullgraph
            compiled = rounds[round_fn.__name__] = compile_round(round_fn, **options)
        return compiled

    @property
    def is_compiled(self) -> bool:
        return getattr(self.backbone.target_module, "_compiled_call_impl", None) is not None
