"""A static key/value cache and the two edits speculative decoding needs: crop and compact.

Slots are physical: the cache holds ``length`` filled slots per row, the same for every row. Which slots a
row may attend to is ``key_valid`` ``(B, max_length)`` (padding inside a prompt is a filled but invalid
slot), so rows with prompts of different lengths share one slot index. Logical positions (for RoPE) are
passed to the model separately.

Two shapes of a pass (``fixed_shape``):

- growing (the default): a pass over ``T`` new tokens attends to slots ``[0, length + T)``; the cheapest in eager
  mode, but the attended length changes every round, so a compiled step would recompile for every length.
- fixed: a pass attends to a fixed number of slots, the mask says which are valid, and the new keys are written
  by index at ``write_index`` (a tensor, so moving it recompiles nothing). The lengths are at most
  ``attend_buckets``, counted back from the end (``max_length``, ``max_length - step``, ...; ``step =
  max(max_length / attend_buckets, min_attend_step)``), the pass taking the shortest that holds every filled slot:
  a compiled step (``torch.compile(dynamic=False)``, CUDA graphs) has at most ``attend_buckets`` shapes per fed
  length, and early rounds do not read the whole cache (transformers' ``StaticLayer`` and gpt-fast:
  ``attend_buckets=1``).
"""

import contextlib
from typing import List, Optional, Protocol, Tuple, runtime_checkable

import torch


def varying_length_attention(device: torch.device, fixed_shape: bool):
    """The attention kernels for a target pass on ``device``: on CUDA with a growing cache (a new attended length every
    round), every SDPA backend but cuDNN's. Why: cuDNN builds an execution plan per exact shape on the host (tens of
    ms), so a round whose key length is new would build one every round; flash / memory-efficient attention take any
    length for free. Fixed-shape rounds reuse a few lengths, and keep cuDNN."""
    if device.type != "cuda" or fixed_shape:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


@runtime_checkable
class KVCache(Protocol):
    """What the generation loop and a backbone need from a KV cache (`StaticKVCache`, and `TransformersCacheView` in
    front of one for transformers models).

    - ``length``: filled slots (host-side int); ``max_length``: allocated slots.
    - ``prepare_write(t)``: before a pass over ``t`` new tokens (fixes where they are written).
    - ``update(layer_idx, key, value)``: write one layer's new keys/values, return what the pass attends to.
    - ``attention_mask(new_mask, new_valid)``: the boolean mask ``(B, 1, T, S)`` of the pass.
    - ``advance(new_valid, t)``: after the pass, account for the ``t`` slots written.
    - ``crop(length)``: drop the slots after ``length`` (a measured pass's).

    Per row (a batch whose rows advance on their own on the device, `StaticKVCache.track_rows_on_device`):
    ``row_starts`` holds each row's filled slots (``(R,)`` on the device; ``length`` is a host bound on them), a pass
    writes row ``r``'s ``T`` new keys at slots ``row_starts[r] + [0, T)`` (``write_index`` ``(R, T)``), the mask reads
    each row's own valid keys, and ``keep_prefixes`` / ``keep_paths`` keep each row's accepted slots.
    """

    length: int
    max_length: int

    def prepare_write(self, t: int) -> None: ...

    def update(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]: ...

    def attention_mask(self, new_mask: torch.Tensor, new_valid: Optional[torch.Tensor]) -> torch.Tensor: ...

    def advance(self, new_valid: Optional[torch.Tensor], t: Optional[int] = None) -> None: ...

    def crop(self, length: int) -> None: ...

class StaticKVCache:
    """Preallocated per-layer key/value tensors ``(B, H_kv, max_length, D)``.

    Args:
        num_layers (`int`): transformer blocks.
        batch_size (`int`): rows (CFG rows included).
        num_kv_heads (`int`), head_dim (`int`): key/value head shape.
        max_length (`int`): slots to allocate.
        dtype, device: storage of the tensors.
        fixed_shape (`bool`): passes attend to one of a few fixed lengths (see the module docstring).
        attend_buckets (`int`): with ``fixed_shape``, how many lengths passes attend to (1: always the whole cache).
        min_attend_step (`int`): the lengths are at least this many slots apart (fewer buckets on a short cache); on
            the pipeline's caches (a multiple of 256 slots) every generation then ends in the last length.
    """

    def __init__(self, num_layers: int, batch_size: int, num_kv_heads: int, head_dim: int, max_length: int,
                 dtype: torch.dtype = torch.float32, device: Optional[torch.device] = None, fixed_shape: bool = False,
                 attend_buckets: int = 4, min_attend_step: int = 256):
        if not isinstance(attend_buckets, int) or isinstance(attend_buckets, bool) or attend_buckets < 1:
            raise ValueError(f"`attend_buckets` must be an int >= 1, got {attend_buckets!r}.")
        # one tensor for every layer's keys and values, so compacting an accepted path is one gather and one copy
        # for the whole cache instead of two per layer (per-op dispatch dominates a small model's round)
        self.storage = torch.zeros(num_layers, 2, batch_size, num_kv_heads, max_length, head_dim, dtype=dtype, device=device)
        self.keys: List[torch.Tensor] = [self.storage[i, 0] for i in range(num_layers)]  # (B, H_kv, S, D) views
        self.values: List[torch.Tensor] = [self.storage[i, 1] for i in range(num_layers)]
        self.key_valid = torch.zeros(batch_size, max_length, dtype=torch.bool, device=device)  # (B, S)
        # index tensors of the fixed-shape write, built once: nothing is made from Python values inside a round
        self._layer_index = torch.arange(num_layers, device=device)[:, None]  # (L, 1): row i is layer i's index
        self._row_index = torch.arange(batch_size, device=device)[:, None]  # (B, 1)
        self.length = 0  # host-side int: filled slots (never read back from the device)
        self.max_length = max_length
        self.fixed_shape = fixed_shape
        self.attend_buckets = attend_buckets
        self.attend_step = max(-(-max_length // attend_buckets), min_attend_step)  # lengths: max_length - k * step
        self.write_index: Optional[torch.Tensor] = None  # (T,) slots the next pass writes (fixed shape); (R, T) per row
        self.attend_length = max_length  # slots the next pass attends to (fixed shape; a host int a graph is made for)
        self.row_starts: Optional[torch.Tensor] = None  # (R,) per row on the device (`track_rows_on_device`)
        self._slot_offsets: Optional[torch.Tensor] = None  # (T,) 0..T-1 for the device-row write index, built once
        # eager writes (`_eager_write`): the scatter index made from `write_index` once a pass, and the attended views
        self._scatter_source: Optional[torch.Tensor] = None
        self._scatter_index: Optional[torch.Tensor] = None
        self._attended: Tuple[int, list] = (-1, [])

    def reset(self) -> None:
        """Empty the cache for a new generation (the storage is kept: reusing it keeps its address, which CUDA graphs
        replay)."""
        self.key_valid.zero_()
        self.length = 0
        self.write_index = None
        self.row_starts = None

    @property
    def num_rows(self) -> int:
        return self.key_valid.shape[0]

    @property
    def per_row(self) -> bool:
        """Whether rows advance on their own (`track_rows_on_device`)."""
        return self.row_starts is not None

    def track_rows_on_device(self, fed: int) -> None:
        """From now on every row keeps its own filled slots on the device (``row_starts`` ``(R,)``, all starting at
        ``length``), for rounds run whole on the device (`spatial_pipelines.pipelines.device_loop`): every pass feeds
        ``fed`` slots per row, written at ``row_starts[r] + [0, fed)``; `keep_prefixes` and `keep_paths` move the
        starts by each row's accepted count, and ``length`` / ``attend_length`` are a host bound (`set_bound`). Why
        per row: rows accept different runs, and a shared length makes every row wait for the shortest; why on the
        device: reading the accepted lengths would sync every round."""
        device = self.key_valid.device
        self.row_starts = torch.full((self.key_valid.shape[0],), self.length, dtype=torch.long, device=device)
        self._slot_offsets = torch.arange(fed, device=device)  # (T,)

    def _check_end(self, end: int) -> None:
        if end > self.max_length:
            raise ValueError(f"KV cache overflow: {end} slots needed, {self.max_length} allocated.")

    def _bucket(self, end: int) -> int:
        """The shortest attended length, counted back from the end by ``attend_step``, that holds slot ``end``."""
        return self.max_length - ((self.max_length - end) // self.attend_step) * self.attend_step

    def set_bound(self, end: int) -> None:
        """Device rows: no row's next pass writes past slot ``end`` (a host-side bound); the pass attends to the
        shortest length that holds it (fixed shape: a bucket counted back from the end; growing: ``end`` itself)."""
        self._check_end(end)
        self.length = end
        self.attend_length = self._bucket(end) if self.fixed_shape else end

    def keep_prefixes(self, counts: torch.Tensor) -> None:
        """Device rows, after a pass: row ``r`` keeps the first ``counts[r]`` ``(R,)`` of the slots it was fed (an
        accepted chain is a prefix: nothing moves); the rest stay invalid and the next pass overwrites them."""
        valid = self._slot_offsets[None] < counts[:, None]  # (R, T)
        self.key_valid.scatter_(1, self.write_index, valid)
        self.row_starts.add_(counts)

    def keep_paths(self, paths: torch.Tensor, counts: torch.Tensor) -> None:
        """Device rows, after a pass over a tree: row ``r`` keeps the fed slots ``paths[r, :counts[r]]`` (``paths``
        ``(R, C)`` slot offsets from its start, root first), moved to its first ``counts[r]`` fed slots; the rest stay
        invalid. Every row moves all ``C`` entries (fixed shape; those past its count land in invalid slots). Called
        before the next pass's writes (`HeadTreeLoop`), so the slots come from the row's start.

        One cloned advanced-index read and one ``index_put_`` on ``storage`` for every layer and row. Why: compiled by
        inductor after a pass had read the cache, a ``scatter_`` became two copies of the whole storage per round
        (~100x slower); before the pass, with the clone, the write happens in place."""
        rows, starts = self._row_index[: paths.shape[0]], self.row_starts[:, None]  # (R, 1), (R, 1)
        slots = starts + self._slot_offsets  # (R, T) the row's fed slots
        picked = self.storage[:, :, rows, :, starts + paths].clone()  # (R, C, L, 2, H_kv, D)
        self.storage[:, :, rows, :, slots[:, : paths.shape[1]]] = picked
        self.key_valid.scatter_(1, slots, self._slot_offsets[None] < counts[:, None])  # (R, T)
        self.row_starts.add_(counts)

    def prepare_write(self, t: int) -> None:
        """Before a pass over ``t`` new tokens: they go to slots ``[length, length + t)``. Fixed shape: the slots as
        a tensor, so the compiled step reads them as data (a host int would be baked into the graph)."""
        if self.row_starts is not None:  # device rows: (R, T) slots from the device starts, no host value
            self.write_index = self.row_starts[:, None] + self._slot_offsets[:t]  # (R, T)
            return
        end = self.length + t
        self._check_end(end)
        if self.fixed_shape:
            self.write_index = torch.arange(self.length, end, device=self.key_valid.device)  # (T,) no host sync
            self.attend_length = self._bucket(end)

    def update(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Write ``key``/``value`` ``(B, H_kv, T, D)`` into slots ``[length, length + T)`` of one layer and return
        what the pass attends to: that layer's keys/values over ``[0, length + T)`` (growing), or over
        ``[0, attend_length)`` (fixed shape: written by index, `prepare_write` first). ``length`` moves on in `advance`.
        Per row: row ``r`` writes at ``write_index[r]`` and the pass attends to ``[0, attend_length)``."""
        if self.per_row or self.fixed_shape:
            if self.write_index is None or self.write_index.shape[-1] != key.shape[2]:  # (R, T) per row, else (T,)
                kind = "per-row" if self.per_row else "fixed-shape"
                raise ValueError(f"Call `prepare_write({key.shape[2]})` before a pass on a {kind} cache.")
            if torch.compiler.is_compiling():
                self._index_write(layer_idx, key, value, key.shape[0] if self.per_row else None)
                a = self.attend_length
                return self.storage[layer_idx, 0, :, :, :a], self.storage[layer_idx, 1, :, :, :a]  # (B, H_kv, A, D)
            return self._eager_write(layer_idx, key, value)
        end = self.length + key.shape[2]
        self._check_end(end)
        self.keys[layer_idx][:, :, self.length : end] = key
        self.values[layer_idx][:, :, self.length : end] = value
        return self.keys[layer_idx][:, :, :end], self.values[layer_idx][:, :, :end]

    def _index_write(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor, rows: Optional[int]) -> None:
        """Write one layer's keys and values ``(B, H_kv, T, D)`` at ``write_index`` (per row: row ``r`` at
        ``write_index[r]``) with one ``index_put_`` on ``storage`` itself, every index a tensor.

        Why not ``storage[layer, 0].index_copy_(...)``: under torch.compile a write into a *view* of a graph input
        becomes a copy of the whole storage per write (~8x slower than eager on a CPU); a write into the graph input
        itself is an in-place store of the new slots (gpt-fast's pattern), at an address CUDA graphs replay."""
        layer = self._layer_index[layer_idx]  # (1,)
        kv = torch.stack([key, value])  # (2, B, H_kv, T, D): keys and values in one write
        if rows is None:  # advanced indices on dims 0 and 4 -> the written block is (T, 2, B, H_kv, D)
            self.storage[layer, :, :, :, self.write_index] = kv.permute(3, 0, 1, 2, 4)
        else:  # layer, row (R, 1) and slot (R, T) indices -> the written block is (R, T, 2, H_kv, D)
            row = self._row_index[:rows]  # (R, 1)
            self.storage[layer, :, row, :, self.write_index] = kv.permute(1, 3, 0, 2, 4)

    def _eager_write(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """`update` outside a graph: one write each into the layer's key and value views, and the attended views
        kept per ``attend_length``. Why: eager, every indexing op is a dispatch, and the graph's form (one
        ``index_put_`` on ``storage``, views sliced per pass) costs 11 ops a layer where this costs 2."""
        if self.per_row:  # row r's slots write_index[r]: one index (R, H_kv, T, D) per pass, shared by every layer
            if self._scatter_source is not self.write_index:
                self._scatter_source = self.write_index
                self._scatter_index = self.write_index[:, None, :, None].expand(*key.shape)
            self.keys[layer_idx].scatter_(2, self._scatter_index, key)
            self.values[layer_idx].scatter_(2, self._scatter_index, value)
        else:
            self.keys[layer_idx].index_copy_(2, self.write_index, key)
            self.values[layer_idx].index_copy_(2, self.write_index, value)
        a = self.attend_length
        if self._attended[0] != a:  # made again only when the attended length moves to another bucket
            self._attended = (a, [(k[:, :, :a], v[:, :, :a]) for k, v in zip(self.keys, self.values)])
        return self._attended[1][layer_idx]  # (B, H_kv, A, D) each

    def attention_mask(self, new_mask: torch.Tensor, new_valid: Optional[torch.Tensor]) -> torch.Tensor:
        """Boolean mask ``(B, 1, T, length + T)`` for ``T`` new queries (fixed shape: ``(B, 1, T, attend_length)``).

        Args:
            new_mask: ``(B, T, T)`` or ``(T, T)`` which new tokens see which (causal or a tree mask; every token
                sees itself).
            new_valid: ``(B, T)`` which new tokens are real (padding is not); ``None``: all of them (decoding
                rounds), which skips the padding terms.
        """
        b, t = self.key_valid.shape[0], new_mask.shape[-1]
        new = new_mask.expand(b, t, t)  # (B, T, T)
        if new_valid is not None:  # a padded query sees itself: no NaN rows
            new = (new & new_valid[:, None, :]) | torch.eye(t, dtype=torch.bool, device=new_mask.device)
        if not (self.per_row or self.fixed_shape):
            past = self.key_valid[:, None, : self.length].expand(b, t, self.length)  # (B, T, L)
            return torch.cat([past, new], dim=-1)[:, None]  # (B, 1, T, L + T)
        # the valid past, then the new tokens' own columns written at their slots (each row's own, per row)
        a = self.attend_length
        mask = self.key_valid[:, None, :a].expand(b, t, a).clone()  # (B, T, A)
        if self.per_row:
            return mask.scatter_(2, self.write_index[:, None, :].expand(b, t, t), new)[:, None]  # (B, 1, T, A)
        return mask.index_copy_(2, self.write_index, new)[:, None]  # (B, 1, T, A)

    def advance(self, new_valid: Optional[torch.Tensor], t: Optional[int] = None) -> None:
        """Account for the ``T`` slots just written by every layer (``new_valid`` ``(B, T)``, or ``None`` and ``t``:
        all valid). Per row: the slots stay invalid until `keep_prefixes` or `keep_paths` says which of them each row
        keeps."""
        if self.row_starts is not None:  # device rows: `keep_prefixes` validates what each row keeps
            return
        t = t if new_valid is None else new_valid.shape[1]
        self.key_valid[:, self.length : self.length + t] = True if new_valid is None else new_valid
        self.length += t

    def crop(self, length: int) -> None:
        """Keep the first ``length`` slots (drop rejected drafts)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"`length` must be in [0, {self.length}], got {length}.")
        self.key_valid[:, length : self.length] = False
        self.length = length

class TransformersCacheView:
    """The part of a transformers ``Cache`` a decoder layer calls, served by a `StaticKVCache`.

    transformers' Llama-style attention calls ``cache.update(key, value, layer_idx, ...)`` (the trailing arguments
    changed across 5.x; none is needed here) and the model asks ``get_seq_length()`` when it is given no
    ``cache_position``; with explicit ``position_ids``, ``cache_position`` and a 4-D mask nothing else is touched.
    So a transformers backbone (Janus-Pro, Emu3) runs on the library's static cache, cropped and compacted as for
    our own models. The loop's side of the `KVCache` protocol is the wrapped cache's (``length`` moves on only in
    `StaticKVCache.advance`).
    """

    is_compileable = False  # tells transformers not to build its own static-shape machinery around it

    def __init__(self, cache: StaticKVCache):
        self.cache = cache

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """transformers' argument order -> `StaticKVCache.update`: keys/values ``(B, H_kv, L + T, D)`` (fixed shape:
        ``(B, H_kv, S, D)``)."""
        return self.cache.update(layer_idx, key_states, value_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.cache.length

    def __len__(self) -> int:
        return len(self.cache.keys)

    def __getattr__(self, name: str):  # the loop's side of `KVCache`: length, crop, advance, ...
        if name == "cache":  # not set yet (copy/unpickle): no recursion
            raise AttributeError(name)
        return getattr(self.cache, name)


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean attention mask (``True``: may attend) -> the float additive mask transformers expects for a 4-D
    ``attention_mask`` (0 where allowed, ``finfo(dtype).min`` where not). A bool 4-D mask is silently misread by
    transformers' eager attention, so transformers backbones always get this."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)
