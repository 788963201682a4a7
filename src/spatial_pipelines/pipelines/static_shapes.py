"""Fixed-shape rounds: what lets a compiled target step (``torch.compile(dynamic=False)``, CUDA graphs) run every
round of a generation with one graph.

Three things change shape from round to round in a speculative loop, and each is fixed here:

- the attended length (the KV cache grows by the accepted count): the cache attends to one of a few fixed lengths
  counted back from its end (`StaticKVCache` with ``fixed_shape=True``, ``attend_buckets``), and its length is
  rounded up to `STATIC_LENGTH_MULTIPLE`, so prompts of different lengths share one cache size;
- the fed length (dynamic trees, end-of-row tokens, a shrinking window at the end of the grid): every round of a
  device loop feeds the same slots (its ``fed``), a node not offered being fed as a code no sample equals;
- the write position: a tensor (``StaticKVCache.write_index``), never a host int baked into the graph.

The prefill pass (whose length is the prompt's) runs eagerly (`eager_target`), as gpt-fast does, so a new prompt
length compiles nothing.
"""

#: Fixed-shape caches are allocated in multiples of this many slots (one graph serves every prompt length that
#: rounds up to the same size).
STATIC_LENGTH_MULTIPLE = 256


#: `GenerationLoop.compile` raises dynamo's per-function recompile limit to at least this: each decoder
#: configuration compiles one graph per attended length its rounds reach (at most the cache's ``attend_buckets``).
RECOMPILE_LIMIT = 64


def static_cache_length(needed: int) -> int:
    """``needed`` slots rounded up to a multiple of `STATIC_LENGTH_MULTIPLE`."""
    return -(-needed // STATIC_LENGTH_MULTIPLE) * STATIC_LENGTH_MULTIPLE
