import math
import re

import pytest
import torch

from spatial_pipelines.core import ImageTokenLayout, SamplingConfig, apply_top_k, apply_top_p, cfg_mix, logits_to_probs
from spatial_pipelines.core.kv_cache import StaticKVCache
from spatial_pipelines.core.tree import tree_from_parents
from spatial_pipelines.models import LlamaGenTransformer

from helpers import chi_square_pvalue
from helpers.walks import RandomSource, sample_from_probs


# -- layout -------------------------------------------------------------------------------------------------
def test_layout_raster_roundtrip_and_positions():
    layout = ImageTokenLayout(3, 4)
    idx = torch.arange(12)
    r, c = layout.raster_to_rc(idx)
    assert torch.equal(layout.rc_to_raster(r, c), idx)
    assert layout.row_stride == 4 and layout.sequence_length == 12
    assert layout.sequence_position(5, 10) == 15


def test_layout_with_end_of_row_token():
    layout = ImageTokenLayout(3, 4, eol_token_id=99)
    assert layout.row_stride == 5 and layout.sequence_length == 15 and layout.num_tokens == 12
    # code (1, 0) sits one row stride after code (0, 0); the EOL of row 0 is at offset 4
    assert layout.sequence_offset(4) == 5 and layout.sequence_offset(3) == 3
    assert layout.sequence_position(11, 7) == 7 + 2 * 5 + 3


@pytest.mark.parametrize("h,w", [(0, 3), (2, -1)])
def test_layout_rejects_empty_grid(h, w):
    with pytest.raises(ValueError):
        ImageTokenLayout(h, w)


# -- sampling ------------------------------------------------------------------------------------------------
def test_cfg_mix_formula():
    cond, uncond = torch.randn(2, 5), torch.randn(2, 5)
    out = cfg_mix(torch.cat([cond, uncond]).half(), 4.0)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, uncond.half().float() + 4.0 * (cond.half().float() - uncond.half().float()))


def test_top_k_and_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(apply_top_k(logits, 2)).tolist() == [[False, False, True, True]]
    assert torch.equal(apply_top_k(logits, 0), logits) and torch.equal(apply_top_k(logits, 10), logits)
    # nucleus 0.7: 0.5 alone is short of 0.7, 0.5 + 0.3 reaches it
    assert torch.isinf(apply_top_p(logits, 0.7)).tolist() == [[False, False, True, True]]
    assert torch.isinf(apply_top_p(logits, 0.4)).tolist() == [[False, True, True, True]]
    assert torch.equal(apply_top_p(logits, 1.0), logits)


def test_logits_to_probs_greedy_is_point_mass_and_temperature_sharpens():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    assert logits_to_probs(logits, SamplingConfig(temperature=0)).tolist() == [[0.0, 1.0, 0.0]]
    p1 = logits_to_probs(logits, SamplingConfig(temperature=1.0))
    p_half = logits_to_probs(logits, SamplingConfig(temperature=0.5))
    torch.testing.assert_close(p1, logits.softmax(-1))
    assert p_half[0, 1] > p1[0, 1]
    p = logits_to_probs(logits, SamplingConfig(temperature=1.0, top_k=2))
    assert p[0, 0] == 0 and torch.isclose(p.sum(), torch.tensor(1.0))


def test_sample_from_probs_follows_distribution():
    probs = torch.tensor([0.05, 0.1, 0.25, 0.6, 0.0])
    n = 20000
    draws = sample_from_probs(probs.expand(n, -1).clone(), RandomSource(torch.Generator().manual_seed(0), n, "cpu"))
    counts = torch.bincount(draws, minlength=5)
    assert counts[4] == 0
    assert chi_square_pvalue(counts, probs) > 1e-3
    # the test has power: the same draws do not fit a slightly different distribution
    assert chi_square_pvalue(counts, torch.tensor([0.05, 0.12, 0.23, 0.6, 0.0])) < 1e-3


def test_random_source_rows_follow_their_own_generator():
    gens = [torch.Generator().manual_seed(s) for s in (1, 2, 3)]
    batch = RandomSource(gens, 3, "cpu").exponential(4)
    singles = [RandomSource(torch.Generator().manual_seed(s), 1, "cpu").exponential(4)[0] for s in (1, 2, 3)]
    assert torch.equal(batch, torch.stack(singles))


# -- KV cache ------------------------------------------------------------------------------------------------
def _tiny_transformer(end_of_row_token=False):
    torch.manual_seed(0)
    model = LlamaGenTransformer(
        vocab_size=16, hidden_size=32, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, condition_type="class", num_classes=4, num_condition_tokens=1, grid_height=3,
        grid_width=3, zero_prefix_rope=False, end_of_row_token=end_of_row_token,
    ).eval()
    if end_of_row_token:
        torch.nn.init.normal_(model.eol_embedding)
    return model


@torch.no_grad()
def test_kv_cache_incremental_equals_full_recompute():
    model = _tiny_transformer()
    emb = torch.cat([model.embed_condition(torch.tensor([1, 2])), model.embed_image_tokens(torch.randint(0, 16, (2, 6)))], 1)
    full = model(emb, torch.arange(7)).hidden_states
    cache = model.make_cache(2, 16)
    parts = [model(emb[:, :3], torch.arange(3), past_key_values=cache).hidden_states]
    for t in range(3, 7):
        parts.append(model(emb[:, t : t + 1], torch.tensor([t]), past_key_values=cache).hidden_states)
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-5, atol=1e-5)
    assert cache.length == 7


@torch.no_grad()
def test_kv_cache_crop_drops_rejected_drafts():
    model = _tiny_transformer()
    ids = torch.randint(0, 16, (1, 5))
    emb = torch.cat([model.embed_condition(torch.tensor([1])), model.embed_image_tokens(ids)], 1)  # (1, 6, D)
    cache = model.make_cache(1, 16)
    model(emb[:, :4], torch.arange(4), past_key_values=cache)
    wrong = model.embed_image_tokens((ids[:, 3:5] + 1) % 16)
    model(wrong, torch.arange(4, 6), past_key_values=cache)  # drafts that get rejected
    cache.crop(4)
    got = model(emb[:, 4:6], torch.arange(4, 6), past_key_values=cache).hidden_states
    torch.testing.assert_close(got, model(emb, torch.arange(6)).hidden_states[:, 4:6], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="length"):
        cache.crop(99)


@torch.no_grad()
@pytest.mark.parametrize("fixed_shape", [False, True])
def test_kv_cache_keep_paths_equals_recompute(fixed_shape):
    """Invariant 3: after a tree pass, each row keeping its own accepted path (`keep_paths`, rows advancing on the
    device) leaves the cache as if the path had been fed alone."""
    model = _tiny_transformer()
    b = 2
    prefix = model.embed_condition(torch.tensor([0, 3]))  # (B, 1, D)
    # a tree of 4 drafts after the prefix: 0 -> {1, 2}, 1 -> 3; row 0 keeps [0, 1, 3], row 1 keeps [0, 2]
    tree_ids = torch.randint(0, 16, (b, 4))
    depth = torch.tensor([0, 1, 1, 2])
    mask = tree_from_parents([-1, 0, 0, 1]).attention_mask
    cache = model.make_cache(b, 16)
    cache.fixed_shape = fixed_shape
    model(prefix, torch.tensor([0]), past_key_values=cache)
    cache.track_rows_on_device(4)
    cache.set_bound(1 + 4)
    model(model.embed_image_tokens(tree_ids), 1 + depth, attention_mask=mask, past_key_values=cache)
    paths, counts = torch.tensor([[0, 1, 3], [0, 2, 2]]), torch.tensor([3, 2])
    cache.keep_paths(paths, counts)  # before the next pass's writes
    assert cache.row_starts.tolist() == [4, 3]
    nxt = torch.randint(0, 16, (b, 1))
    cache.set_bound(4 + 1)
    got = model(model.embed_image_tokens(nxt), torch.tensor([[4], [3]]), past_key_values=cache).hidden_states
    for r in range(b):  # recompute [prefix, path, next] from scratch, row by row
        path_ids = tree_ids[r : r + 1, paths[r, : counts[r]]]
        seq = torch.cat([prefix[r : r + 1], model.embed_image_tokens(torch.cat([path_ids, nxt[r : r + 1]], 1))], 1)
        want = model(seq, torch.arange(seq.shape[1])).hidden_states[:, -1:]
        torch.testing.assert_close(got[r : r + 1], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["fixed", "per_row"])
def test_kv_cache_index_write_lands_where_the_growing_write_does(mode):
    """A fixed-shape (or per-row) write puts every layer's keys and values in the same slots as the growing slice
    write, touches nothing else, and returns the attended prefix of the cache."""
    layers, b, h, d, s = 3, 2, 3, 4, 40
    grow = StaticKVCache(layers, b, h, d, s)
    fixed = StaticKVCache(layers, b, h, d, s, fixed_shape=True, attend_buckets=2, min_attend_step=8)
    for cache in (grow, fixed):
        cache.prepare_write(5)
        for i in range(layers):
            cache.update(i, torch.full((b, h, 5, d), float(i + 1)), torch.full((b, h, 5, d), -float(i + 1)))
        cache.advance(None, 5)
    if mode == "per_row":  # row 1 writes two slots earlier than row 0 (rows advancing on the device)
        fixed.track_rows_on_device(3)
        fixed.row_starts = torch.tensor([5, 3])
        fixed.set_bound(8)
    keys, values = torch.randn(layers, b, h, 3, d), torch.randn(layers, b, h, 3, d)
    grow.prepare_write(3)
    fixed.prepare_write(3)
    for i in range(layers):
        want = grow.update(i, keys[i], values[i])
        got = fixed.update(i, keys[i], values[i])
        assert got[0].shape == (b, h, fixed.attend_length, d) and fixed.attend_length >= 8
        if mode == "fixed":
            assert torch.equal(got[0][:, :, :8], want[0]) and torch.equal(got[1][:, :, :8], want[1])
    if mode == "per_row":  # what the growing write would leave if row 1 had been 2 slots shorter
        grow.storage[:, :, 1, :, 3:6] = torch.stack([keys[:, 1], values[:, 1]], 1)
        grow.storage[:, :, 1, :, 6:8] = 0
    assert torch.equal(fixed.storage, grow.storage)


@pytest.mark.parametrize("per_row", [False, True])
def test_compiled_kv_cache_write_copies_no_cache(per_row):
    """Under inductor the fixed-shape (and per-row) write stores the new slots in place: no buffer the size of a
    layer's keys is allocated. (A write into a view of the storage was functionalized into a copy of the storage per
    layer, and made the compiled step several times slower than eager.)"""
    from torch._inductor.utils import run_and_get_code

    layers, b, h, d, s = 3, 2, 3, 8, 40
    cache = StaticKVCache(layers, b, h, d, s, fixed_shape=True, attend_buckets=1)
    cache.prepare_write(10)
    cache.advance(None, 10)
    if per_row:
        cache.track_rows_on_device(2)
        cache.set_bound(12)
    cache.prepare_write(2)

    def step(key, value):
        out = key.new_zeros(())
        for i in range(layers):
            k, v = cache.update(i, key + i, value - i)
            out = out + k.sum() + v.sum()
        return out

    key, value = torch.randn(b, h, 2, d), torch.randn(b, h, 2, d)
    storage = cache.storage.clone()
    torch._dynamo.reset()
    got, codes = run_and_get_code(torch.compile(step, backend="inductor", fullgraph=True), key, value)
    torch._dynamo.reset()
    written = cache.storage.clone()
    cache.storage.copy_(storage)
    want = step(key, value)
    assert torch.equal(written, cache.storage)  # the compiled write is the eager one, bit for bit
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # sums in another order
    shapes = [tuple(int(x) for x in m.split(",") if x.strip()) for code in codes
              for m in re.findall(r"empty_strided_cpu\(\(([0-9, ]*)\)", code)]
    assert shapes and max(math.prod(shape) for shape in shapes) < b * h * s * d


@torch.no_grad()
def test_teacher_forced_hidden_states_and_condition_drop():
    model = _tiny_transformer()  # class-conditional, 3x3 grid
    codes = torch.randint(0, 16, (2, 9))
    labels = torch.tensor([1, 2])
    got = model.teacher_forced_hidden_states(codes, labels, torch.ones(2, 1, dtype=torch.bool), drop=torch.tensor([False, True]))
    assert got.shape == (2, 9, 32)
    dropped = torch.tensor([1, model.config.num_classes])  # the dropped row gets the unconditional class
    emb = torch.cat([model.embed_condition(dropped), model.embed_image_tokens(codes[:, :-1])], 1)
    torch.testing.assert_close(got, model(emb, torch.arange(9)).hidden_states, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_teacher_forcing_with_eol_reads_each_code_from_the_input_before_it():
    model = _tiny_transformer(end_of_row_token=True)  # 3x3 grid, EOL after rows 0 and 1
    codes = torch.randint(0, 16, (2, 9))
    labels = torch.tensor([1, 2])
    got = model.teacher_forced_hidden_states(codes, labels, torch.ones(2, 1, dtype=torch.bool))
    eol = model.eol_embedding.expand(2, 1, -1)
    e = model.embed_image_tokens(codes)
    seq = torch.cat([model.embed_condition(labels), e[:, 0:3], eol, e[:, 3:6], eol, e[:, 6:8]], 1)  # (B, 11, D)
    full = model(seq, torch.arange(seq.shape[1])).hidden_states
    want = full[:, [0, 1, 2, 4, 5, 6, 8, 9, 10]]  # code 3 is read from the first EOL, code 6 from the second
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("temperature", [1e-300, 1e-38, 1e-25])
def test_a_temperature_below_fp32_range_is_the_greedy_limit(temperature):
    """``logits / T`` would overflow fp32 (and ``T`` itself rounds to 0): the distribution is still the softmax's
    limit, a point mass on the argmax, never NaN (which would sample code 0)."""
    from spatial_pipelines.core.sampling import logits_to_probs

    logits = torch.tensor([[1.0, 3.0, 2.0, -5.0]])
    probs = logits_to_probs(logits, SamplingConfig(1.0, temperature))
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0]]))


def test_growing_cache_passes_on_cuda_keep_off_cudnn_attention():
    """A growing-cache pass on CUDA attends to a new length every round; cuDNN's SDPA builds a plan per exact shape
    (tens of ms on the host), so those passes run with every other backend. Fixed-shape passes and the CPU are left
    alone. The flags are global settings, so this runs without a GPU."""
    from spatial_pipelines.core.kv_cache import varying_length_attention

    before = (torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled(),
              torch.backends.cuda.mem_efficient_sdp_enabled(), torch.backends.cuda.math_sdp_enabled())
    with varying_length_attention(torch.device("cuda"), fixed_shape=False):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
        assert torch.backends.cuda.math_sdp_enabled()
    assert (torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled(),
            torch.backends.cuda.mem_efficient_sdp_enabled(), torch.backends.cuda.math_sdp_enabled()) == before
    for device, fixed in [("cuda", True), ("cpu", False), ("cpu", True)]:
        with varying_length_attention(torch.device(device), fixed_shape=fixed):
            assert torch.backends.cuda.cudnn_sdp_enabled() == before[0]
