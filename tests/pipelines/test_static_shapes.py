"""Fixed-shape rounds (`pipe.static_shapes`) and a target step compiled once (`pipe.enable_compile`).

A new decoder adds a row to `DECODER_CASES` (exactness of the fixed-shape step) and, when it drafts differently
from the rows below, to `COMPILE_CASES` (no recompilation).
"""

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from spatial_pipelines import (
    ADTTreeDecoder,
    AutoregressiveDecoder,
    EagleDecoder,
    HawkDecoder,
    JacobiDecoder,
    MedusaDecoder,
    SSDDecoder,
)
from spatial_pipelines.core import StaticKVCache
from spatial_pipelines.core.kv_cache import KVCache, TransformersCacheView
from spatial_pipelines.pipelines.pass_cost import PassCost
from spatial_pipelines.pipelines import generation
from spatial_pipelines.pipelines.device_ssd import pass_slots
from spatial_pipelines.pipelines.static_shapes import static_cache_length
from spatial_pipelines.testing import dummy_pipeline

from helpers import DECODER_CASES

PROMPTS = ["a red fox", "x"]
# (family, dummy_pipeline options): our own model with and without end-of-row tokens, and two transformers families
STATIC_FAMILIES = [
    pytest.param("llamagen", {}, id="llamagen"),
    pytest.param("llamagen", {"end_of_row": True}, id="llamagen-eol"),
    pytest.param("janus", {}, id="janus"),
    pytest.param("emu3", {}, id="emu3"),
]


def _generate(pipe, temperature):
    generator = [torch.Generator().manual_seed(i) for i in range(len(PROMPTS))]
    return pipe(PROMPTS, guidance_scale=3.0, temperature=temperature, output_type="latent", generator=generator)


@pytest.mark.parametrize("family,dummy", STATIC_FAMILIES)
@pytest.mark.parametrize("decoder_cls,kwargs,heads", DECODER_CASES)
def test_fixed_shape_step_equals_the_growing_slice(decoder_cls, kwargs, heads, family, dummy):
    """The fixed-shape step (whole-cache attention, drafts padded to one size, writes by index) gives the grids of the
    growing-slice step: greedy token for token, and sampled with the same seeds."""
    pipe = dummy_pipeline(family, decoder_cls(**kwargs), heads, grid=(4, 5), **dummy)
    costs, round_cost = {}, pipe.round_cost  # one measured cost for both runs: "auto" sizes are then the same
    pipe.pass_cost = lambda rows: costs.setdefault(rows, PassCost(pipe.backbone, rows))
    pipe.round_cost = lambda batch, *args: costs.setdefault(("round", batch), round_cost(batch, *args))
    assert pipe.static_shapes is False
    greedy, sampled = _generate(pipe, 0), _generate(pipe, 1)
    pipe.static_shapes = True
    static_greedy, static_sampled = _generate(pipe, 0), _generate(pipe, 1)
    assert torch.equal(static_greedy.tokens, greedy.tokens)
    assert torch.equal(static_sampled.tokens, sampled.tokens)
    assert static_greedy.stats.num_forward_passes == greedy.stats.num_forward_passes
    # a batch's rows pad to the round's widest draft; static shapes pad every row to the decoder's largest
    assert 0 <= greedy.stats.padded_fraction <= static_greedy.stats.padded_fraction < 1


@pytest.mark.parametrize("buckets,lengths", [(1, (16, 16)), (4, (4, 8))])
def test_fixed_shape_cache_attends_to_fixed_lengths(buckets, lengths):
    """A fixed-shape cache writes by index and attends to one of ``attend_buckets`` lengths counted back from its end
    (the shortest that holds every filled slot); slots past the new tokens are never valid."""
    cache = StaticKVCache(num_layers=1, batch_size=2, num_kv_heads=1, head_dim=4, max_length=16, fixed_shape=True,
                          attend_buckets=buckets, min_attend_step=1)
    assert isinstance(cache, KVCache) and isinstance(TransformersCacheView(cache), KVCache)
    cache.prepare_write(3)
    keys, values = cache.update(0, torch.ones(2, 1, 3, 4), torch.ones(2, 1, 3, 4))
    assert keys.shape == values.shape == (2, 1, lengths[0], 4)
    mask = cache.attention_mask(torch.ones(3, 3, dtype=torch.bool).tril(), None)
    assert mask.shape == (2, 1, 3, lengths[0]) and mask[0, 0, :, :3].equal(torch.ones(3, 3, dtype=torch.bool).tril())
    assert not mask[..., 3:].any()  # nothing after the new tokens is valid
    cache.advance(None, 3)
    cache.prepare_write(2)
    mask = cache.attention_mask(torch.ones(2, 2, dtype=torch.bool), None)
    assert mask.shape[-1] == lengths[1] and mask[..., :5].all() and not mask[..., 5:].any()
    assert cache.storage[0, 0, 0, 0, :3].eq(1).all()  # written where prepare_write put them
    with pytest.raises(ValueError, match="prepare_write"):
        cache.update(0, torch.ones(2, 1, 4, 4), torch.ones(2, 1, 4, 4))  # 4 new keys, 2 slots prepared
    with pytest.raises(ValueError, match="overflow"):
        cache.prepare_write(14)  # 3 filled + 14 > 16
    with pytest.raises(ValueError, match="attend_buckets"):
        StaticKVCache(1, 1, 1, 4, 16, fixed_shape=True, attend_buckets=0)
    lengths = lambda size: sorted({c.max_length - ((c.max_length - e) // c.attend_step) * c.attend_step  # noqa: E731
                                   for c in [StaticKVCache(1, 1, 1, 4, size, fixed_shape=True)] for e in range(1, size + 1)})
    assert lengths(768) == [256, 512, 768] and lengths(256) == [256] and lengths(2048) == [512, 1024, 1536, 2048]


def test_static_cache_length_rounds_up():
    assert static_cache_length(1) == static_cache_length(256) == 256 and static_cache_length(257) == 512


def test_static_shapes_setting():
    pipe = dummy_pipeline("llamagen")
    for bad in ("yes", 1):
        with pytest.raises(ValueError, match="static_shapes"):
            pipe.static_shapes = bad
    pipe.static_shapes = True
    assert pipe.static_shapes
    pipe.static_shapes = None  # the default: on when compiled
    assert not pipe.static_shapes


# (decoder class, config, heads): one row per way of drafting (a chain, static trees, per-row dynamic trees, blocks)
COMPILE_CASES = [
    pytest.param(AutoregressiveDecoder, {}, None, id="ar"),
    pytest.param(MedusaDecoder, {}, "random", id="medusa"),
    pytest.param(HawkDecoder, {}, "random", id="hawk"),
    pytest.param(JacobiDecoder, {}, None, id="sjd"),
    pytest.param(EagleDecoder, {"depth": 3, "top_k": 2, "num_draft_tokens": 5}, "random", id="eagle"),
    pytest.param(ADTTreeDecoder, {"depth": 2, "top_k": 2, "depth_range": (1, 4), "width_range": (1, 4), "width_step": 1, "beta": 0.5},
                 "random", id="adt"),
    pytest.param(SSDDecoder, {}, "random", id="ssd"),
]


def _round_graphs(pipe) -> int:
    """Graphs a generation's rounds compile on a tiny grid: one, or one per pass shape of a decoder whose passes are
    known before the first (SSD: `SSDLoop.phases`)."""
    layout = pipe.backbone.layout
    if not isinstance(pipe.decoder, SSDDecoder):
        return 1
    schedule = pipe.decoder.plan(None, layout, 1, "cpu")
    return len({p.shape + (pass_slots(layout, p),) for p in schedule.passes})


@pytest.mark.parametrize("family", ["llamagen", "janus"])
@pytest.mark.parametrize("decoder_cls,kwargs,heads", COMPILE_CASES)
def test_compiled_step_compiles_once(decoder_cls, kwargs, heads, family):
    """`enable_compile` (static shapes, ``fullgraph=True``): the warm-up generation compiles one graph per attended
    length it reaches (the tiny grid's cache fits the first of the cache's `attend_buckets`: one graph; SSD one per
    shape of its passes), staying under
    dynamo's recompile limit (past it dynamo would fall back to eager without a word, hiding every recompile); a
    second generation with another prompt (another prompt length for Janus) compiles nothing. The dynamo backend
    is "eager": recompiles are decided by dynamo's guards, whatever backend runs the graph."""
    torch._dynamo.reset()
    pipe = dummy_pipeline(family, decoder_cls(**kwargs), heads, grid=(4, 5))
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        info = pipe.enable_compile(backend="eager", measure=False)
        assert info["enabled"] and info["options"]["fullgraph"] and not info["options"]["dynamic"]
        assert pipe.is_compiled and pipe.static_shapes
        start = counters["stats"]["unique_graphs"]
        warm = pipe("a red fox", guidance_scale=3.0, generator=torch.Generator().manual_seed(0), output_type="latent")
        graphs = _round_graphs(pipe)
        assert counters["stats"]["unique_graphs"] - start == graphs  # one graph for every round of the generation
        with torch._dynamo.config.patch(error_on_recompile=True):
            again = pipe("blue sky over a quiet sea", guidance_scale=3.0, generator=torch.Generator().manual_seed(1), output_type="latent")
        assert counters["stats"]["unique_graphs"] - start == graphs
    assert warm.stats.num_forward_passes > 2 and again.tokens.shape == warm.tokens.shape
    pipe.disable_compile()
    assert not pipe.is_compiled and not pipe.static_shapes


@pytest.mark.parametrize("family", ["llamagen", "janus"])
def test_compiled_step_writes_one_static_cache_input(family, monkeypatch):
    """CUDA graphs replay a step only if every input it writes in place is static (inductor skips the graph with
    "mutated inputs" otherwise). The step's only input inside the KV cache is the cache's storage itself, marked
    static: per-layer views of it would each be a mutated, unmarked input. The marking happens where CUDA graphs
    run; ``uses_cuda_graphs`` is forced here so the check runs on a CPU."""
    monkeypatch.setattr(generation, "uses_cuda_graphs", lambda module, device: True)
    torch._dynamo.reset()
    pipe = dummy_pipeline(family, AutoregressiveDecoder(), None, grid=(4, 5))
    graph_inputs = []

    def backend(gm, example_inputs):  # dynamo hands a custom backend the real input tensors
        graph_inputs.append(list(example_inputs))
        return gm

    pipe.enable_compile(backend=backend, measure=False)
    pipe("a red fox", guidance_scale=3.0, generator=torch.Generator().manual_seed(0), output_type="latent")
    storage = pipe.backbone.caches.kv_cache.storage
    assert graph_inputs
    for inputs in graph_inputs:
        in_cache = [x for x in inputs if isinstance(x, torch.Tensor) and x.untyped_storage().data_ptr() == storage.untyped_storage().data_ptr()]
        assert len(in_cache) == 1 and in_cache[0] is storage
        assert getattr(storage, "_dynamo_static_input_type", None) is not None
    pipe.disable_compile()
    torch._dynamo.reset()


def test_the_backbone_is_built_once_and_owns_what_is_kept_between_calls():
    """`pipe.backbone` is one adapter per pipeline; the static cache and the measured pass costs live on it
    (`BackboneCaches`), not in the pipeline's `__dict__`, and a swapped component is still seen."""
    pipe = dummy_pipeline("llamagen", JacobiDecoder(window_size=2))
    pipe.set_progress_bar_config(disable=True)
    backbone = pipe.backbone
    assert pipe.backbone is backbone
    pipe.static_shapes = True
    pipe("a fox", output_type="latent")
    first = backbone.caches.kv_cache
    assert first is not None and first.fixed_shape
    pipe("a fox", output_type="latent")
    assert backbone.caches.kv_cache is first  # kept for the next call of the same size
    pipe.pass_cost(2)
    assert backbone.caches.pass_costs
    assert not {"_static_cache", "_pass_costs", "_draft_pass_costs", "_code_neighbours"} & set(pipe.__dict__)
    other = dummy_pipeline("llamagen", JacobiDecoder(window_size=2), seed=1)
    pipe.transformer = other.transformer
    assert pipe.backbone is backbone and backbone.target_module is other.transformer
