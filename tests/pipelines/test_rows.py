"""Every row of a batch advances on its own (`RowBatch`): a batch of different prompts, one generator per row, gives
each row what its prompt gives alone, in as many target passes as its slowest row alone, for every exact decoder on
the tiny LlamaGen and on a transformers family (Janus-Pro)."""

import dataclasses
from dataclasses import dataclass
from typing import Optional

import pytest
import torch

from helpers import gen
from helpers.tables import EXACT_CASES, make
from spatial_pipelines import AutoregressiveDecoder, JacobiDecoder
from spatial_pipelines.core.kv_cache import StaticKVCache
from spatial_pipelines.core.sampling import RandomSource, SamplingConfig
from spatial_pipelines.decoders.decoding_utils import DecodingState
from spatial_pipelines.testing import dummy_pipeline

PROMPTS = ["red fox", "sky", "x", "cats"]

#: Exact decoders with fixed draft sizes: "auto" sizes are chosen per batch size, so a batch and a row alone may feed
#: different drafts (and draw different random numbers); their greedy codes still agree (`test_batch_equals_alone`).
SIZED_CASES = [c for c in EXACT_CASES if not c.values[0](**c.values[1]).sizes_from_pass_cost]
TRANSFORMERS_CASES = [c for c in SIZED_CASES if c.id in ("ar", "medusa-paths", "hawk-small", "sjd-left", "sjd-proactive", "eagle", "adt-vertical")]


def _batch_and_alone(pipe, temperature: float, sampling_noise=None):
    call = dict(output_type="latent", temperature=temperature, guidance_scale=2.0, sampling_noise=sampling_noise)
    batch = pipe(PROMPTS, generator=[gen(i) for i in range(len(PROMPTS))], **call)
    alone = [pipe(p, generator=gen(i), **call) for i, p in enumerate(PROMPTS)]
    return batch, alone


def _check(batch, alone, sized: bool, speculates: bool = True):
    for i, one in enumerate(alone):
        assert torch.equal(batch.tokens[i], one.tokens[0]), f"row {i} differs from its prompt alone"
    if sized:
        passes = [one.stats.num_forward_passes for one in alone]
        assert batch.stats.row_forward_passes == passes
        assert batch.stats.num_forward_passes == max(passes)  # the batch waits for nobody and costs its slowest row
        if speculates:  # rows that speculate advance differently
            assert len(set(passes)) > 1  # the comparison is not vacuous


@pytest.mark.parametrize("decoder_cls,kwargs,heads", EXACT_CASES)
def test_batch_equals_alone_greedy(decoder_cls, kwargs, heads):
    pipe = make(decoder_cls, kwargs, heads, grid=(4, 5))
    batch, alone = _batch_and_alone(pipe, 0.0)
    _check(batch, alone, sized=not pipe.decoder.sizes_from_pass_cost, speculates=decoder_cls is not AutoregressiveDecoder)


@pytest.mark.parametrize("decoder_cls,kwargs,heads", SIZED_CASES)
def test_batch_equals_alone_sampled(decoder_cls, kwargs, heads):
    """Sampled with drawn noise: each row draws from its own generator what it draws alone, in the same order."""
    pipe = make(decoder_cls, kwargs, heads, grid=(4, 5))
    batch, alone = _batch_and_alone(pipe, 1.0, "drawn")
    _check(batch, alone, sized=True, speculates=decoder_cls is not AutoregressiveDecoder)


@pytest.mark.parametrize("decoder_cls,kwargs,heads", [c for c in EXACT_CASES if c.values[0](**c.values[1]).supports_keyed_noise])
def test_batch_equals_alone_sampled_with_keyed_noise(decoder_cls, kwargs, heads):
    """Sampled with keyed noise: a row's codes are its prompt's alone even where "auto" sizes differ between the batch
    and a row alone (the codes are AR's for the row's seed)."""
    pipe = make(decoder_cls, kwargs, heads, grid=(4, 5))
    batch, alone = _batch_and_alone(pipe, 1.0, "keyed")
    _check(batch, alone, sized=not pipe.decoder.sizes_from_pass_cost, speculates=decoder_cls is not AutoregressiveDecoder)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
@pytest.mark.parametrize("decoder_cls,kwargs,heads", TRANSFORMERS_CASES)
def test_batch_equals_alone_on_a_transformers_family(decoder_cls, kwargs, heads, temperature):
    pipe = make(decoder_cls, kwargs, heads, family="janus", grid=(4, 5))
    batch, alone = _batch_and_alone(pipe, temperature)
    _check(batch, alone, sized=True, speculates=decoder_cls is not AutoregressiveDecoder)


def test_batch_equals_alone_with_end_of_row_tokens():
    """Rows at different cursors feed end-of-row tokens at different slots of the same pass."""
    pipe = dummy_pipeline("llamagen", JacobiDecoder(window_size=4, init="left", coupling="none", anchor="none"), None,
                          grid=(4, 5), end_of_row=True)
    batch, alone = _batch_and_alone(pipe, 1.0)
    _check(batch, alone, sized=True)


def test_many_rows_share_few_states():
    """Rows that never diverge share one state: 512 images of a 2x2 grid end in a handful of states, not 512."""
    pipe = dummy_pipeline("llamagen", JacobiDecoder(window_size=3, init="random", coupling="none", anchor="none"), None,
                          grid=(2, 2), num_codes=4)
    pipe.device_rounds = False  # drawn noise runs on the device too: this is the row-group loop's bookkeeping
    seen = []
    original = type(pipe.loop)._stats

    def spy(self, batch, *args):
        seen.append((len(batch.groups), batch.num_splits))
        return original(self, batch, *args)

    type(pipe.loop)._stats = spy
    try:
        out = pipe("a fox", guidance_scale=2.0, num_images_per_prompt=512, generator=gen(0), output_type="latent")
    finally:
        type(pipe.loop)._stats = original
    groups, splits = seen[0]
    assert 1 < groups <= 16 and splits >= 1
    assert out.stats.num_forward_passes == max(out.stats.row_forward_passes)
    assert (out.tokens >= 0).all()


def test_a_state_field_not_declared_fails_loudly():
    """`DecodingState.split` refuses a state class with a field in none of its row / shared lists: a decoder author
    who forgets one gets an error naming it, not a batch whose rows silently share what should be theirs."""

    @dataclass
    class ForgetfulState(DecodingState):
        window: Optional[torch.Tensor] = None

    pipe = dummy_pipeline("llamagen", AutoregressiveDecoder(), None)
    state = pipe.decoder.init_state(pipe.backbone.layout, SamplingConfig(), RandomSource(None, 2, "cpu"), 2, 4, torch.device("cpu"))
    forgetful = ForgetfulState(**{f.name: getattr(state, f.name) for f in dataclasses.fields(state) if f.name != "mask"},
                               window=torch.zeros(2, 3))
    with pytest.raises(TypeError, match="ForgetfulState.window"):
        forgetful.split([1])
    assert state.split([1]).tokens.shape == (1, state.tokens.shape[1])


def test_cache_rows_keep_their_own_paths():
    """`StaticKVCache.track_rows` / `keep_rows`: each row writes after its own filled slots and keeps its own accepted
    slots; the keys a row attends to are those of a cache that row had alone."""
    torch.manual_seed(0)
    layers, heads, dim = 2, 1, 4

    def cache(rows):
        c = StaticKVCache(layers, rows, heads, dim, 32)
        c.advance(None, 3)  # a 3-slot prompt
        return c

    batch = cache(2)
    batch.track_rows()
    alone = [cache(1), cache(1)]
    for kept in ([2, torch.tensor([0, 2])], [torch.tensor([1, 3, 0]), 1], [0, 4]):
        t = 4
        keys = torch.randn(2, heads, t, dim)
        batch.prepare_write(t)
        for layer in range(layers):
            batch.update(layer, keys, -keys)
        batch.advance(None, t)
        batch.keep_rows(kept)
        for r, one in enumerate(alone):
            start = one.length
            one.prepare_write(t)
            for layer in range(layers):
                one.update(layer, keys[r : r + 1], -keys[r : r + 1])
            one.advance(None, t)
            if isinstance(kept[r], int):
                one.crop(start + kept[r])
            else:
                one.keep(start, kept[r][None])
    for r, one in enumerate(alone):
        assert batch.row_lengths[r] == one.length
        valid = batch.key_valid[r]
        assert int(valid.sum()) == one.length == int(valid[: one.length].sum())
        assert torch.equal(batch.storage[:, :, r, :, : one.length], one.storage[:, :, 0, :, : one.length])
