import math
import re

import pytest
import torch

from spatial_pipelines.core import (
    ImageTokenLayout,
    RandomSource,
    SamplingConfig,
    apply_top_k,
    apply_top_p,
    cfg_mix,
    logits_to_probs,
    sample_from_probs,
)
from spatial_pipelines.core.kv_cache import StaticKVCache
from spatial_pipelines.core.layout import EndOfRowInsertion
from spatial_pipelines.core.tree import tree_from_parents
from spatial_pipelines.models import LlamaGenTransformer

from helpers import chi_square_pvalue


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
@pytest.mark.parametrize("per_row", [False, True])
def test_kv_cache_keep_accepted_path_equals_recompute(per_row):
    """Invariant 3: committing an accepted tree path leaves the cache as if the path had been fed alone."""
    model = _tiny_transformer()
    b = 2
    prefix = model.embed_condition(torch.tensor([0, 3]))  # (B, 1, D)
    # a tree of 4 drafts after the prefix: 0 -> {1, 2}, 1 -> 3; paths [0, 1, 3] and [0, 2]
    tree_ids = torch.randint(0, 16, (b, 4))
    parent = [-1, 0, 0, 1]
    depth = torch.tensor([0, 1, 1, 2])
    mask = torch.eye(4, dtype=torch.bool)
    for i, p in enumerate(parent):
        while p >= 0:
            mask[i, p] = True
            p = parent[p]
    cache = model.make_cache(b, 16)
    model(prefix, torch.tensor([0]), past_key_values=cache)
    model(model.embed_image_tokens(tree_ids), 1 + depth, attention_mask=mask, past_key_values=cache)
    paths = torch.tensor([[0, 1, 3], [0, 2, 2]]) if per_row else torch.tensor([0, 1, 3])
    n = 2 if per_row else 3
    keep = paths[:, :n] if per_row else paths.expand(b, -1)  # (B, n): a shared path is every row's
    cache.keep(1, keep)
    assert cache.length == 1 + n
    # feed one more token and compare with recomputing [prefix, path, next] from scratch
    nxt = torch.randint(0, 16, (b, 1))
    got = model(model.embed_image_tokens(nxt), torch.tensor([1 + n]), past_key_values=cache).hidden_states
    path_ids = tree_ids.gather(1, keep)
    seq = torch.cat([prefix, model.embed_image_tokens(torch.cat([path_ids, nxt], 1))], 1)
    want = model(seq, torch.arange(seq.shape[1])).hidden_states[:, -1:]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    fresh = model.make_cache(b, 16)
    model(seq[:, :-1], torch.arange(seq.shape[1] - 1), past_key_values=fresh)
    for kept, want_kv in zip(cache.keys + cache.values, fresh.keys + fresh.values):
        torch.testing.assert_close(kept[:, :, : 1 + n], want_kv[:, :, : 1 + n], rtol=1e-5, atol=1e-5)


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
    if mode == "per_row":  # row 1 writes two slots earlier than row 0
        fixed.track_rows()
        fixed.row_lengths = [5, 3]
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
        cache.track_rows()
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


@pytest.mark.parametrize("with_q", [True, False], ids=["q", "point-mass"])
def test_accept_independently_keeps_each_position_distributed_as_p(with_q):
    """Per position, accept-or-redraw turns a draw from ``q`` (or a fixed draft) into a draw from ``p``.
    Pearson chi-square over 6 codes, 40,000 draws per position; fails when p < 1e-4."""
    from spatial_pipelines.core.sampling import RandomSource
    from spatial_pipelines.core.verification import accept_independently

    g = torch.Generator().manual_seed(0)
    n, v, reps = 3, 6, 40000
    p = torch.rand(n, v, generator=g).softmax(-1)
    q = (torch.rand(n, v, generator=g) * 3).softmax(-1)
    random = RandomSource(g, reps, torch.device("cpu"))
    if with_q:
        tokens = (q.expand(reps, n, v) / random.exponential(n, v)).argmax(-1)  # (reps, n) drawn from q
        out, accepted = accept_independently(tokens, p.expand(reps, n, v), random, q.expand(reps, n, v))
    else:
        tokens = torch.tensor([0, 2, 5]).expand(reps, n)  # fixed drafts: point masses
        out, accepted = accept_independently(tokens, p.expand(reps, n, v), random)
    for j in range(n):
        assert chi_square_pvalue(torch.bincount(out[:, j], minlength=v), p[j]) > 1e-4
    assert torch.equal(out[accepted], tokens[accepted])


# -- end-of-row tokens ------------------------------------------------------------------------------------
EOL_LAYOUT = ImageTokenLayout(3, 3, eol_token_id=16)  # rows 4 positions apart; codes 2 and 5 end rows


def test_end_of_row_insertion_in_a_chain_is_a_longer_chain():
    positions = EOL_LAYOUT.sequence_position(torch.arange(1, 5), 1)  # codes 1..4 after a 1-token prefix
    assert positions.tolist() == [2, 3, 5, 6]
    ins = EndOfRowInsertion.for_positions(EOL_LAYOUT, positions[None], 1)  # one tree (N = 1) every row shares
    assert ins.row_end.tolist() == [[False, True, False, False]]
    assert ins.source.tolist() == [[0, 1, 1, 2, 3]] and ins.is_eol.tolist() == [[False, False, True, False, False]]
    assert ins.position_ids(positions).tolist() == [2, 3, 4, 5, 6]  # the EOL fills the gap; a shared draft stays (T',)
    assert ins.view.tolist() == [[0, 2, 3, 4]]  # code 2's output is its EOL's
    mask = ins.attention_mask(torch.ones(4, 4, dtype=torch.bool).tril())
    assert torch.equal(mask, torch.ones(5, 5, dtype=torch.bool).tril())
    assert [ins.keep_length(k) for k in range(5)] == [0, 1, 3, 4, 5]
    assert ins.keep_indices(torch.tensor([[0, 1, 2], [0, 1, 2]])).tolist() == [[0, 1, 2, 3]] * 2
    # from the host-side depths (what the loop uses for shared drafts): the same tables, no device read
    hosted = EndOfRowInsertion.for_depths(EOL_LAYOUT, (0, 1, 2, 3), 1, torch.device("cpu"))
    for name in ("source", "is_eol", "is_pad", "slot", "view", "row_end"):
        assert torch.equal(getattr(hosted, name), getattr(ins, name)), name
    assert hosted.depth_ends is not None and [hosted.keep_length(k) for k in range(5)] == [0, 1, 3, 4, 5]
    # the last row's end is followed by nothing; a draft without row ends needs no insertion
    assert EndOfRowInsertion.for_positions(EOL_LAYOUT, EOL_LAYOUT.sequence_position(torch.tensor([[7, 8]]), 1), 1) is None
    assert EndOfRowInsertion.for_depths(EOL_LAYOUT, (0, 1), 7, torch.device("cpu")) is None


def test_end_of_row_insertion_gives_every_row_end_candidate_its_own_eol():
    # root = code 1; candidates a, b for code 2 (the row end); c under a and d under b for code 3
    tree = tree_from_parents([-1, 0, 0, 1, 2])
    positions = EOL_LAYOUT.sequence_position(1 + tree.depths, 1)
    ins = EndOfRowInsertion.for_depths(EOL_LAYOUT, tuple(tree.depths.tolist()), 1, torch.device("cpu"))
    assert ins.source.tolist() == [[0, 1, 1, 2, 2, 3, 4]]  # root, a, EOL(a), b, EOL(b), c, d
    mask = ins.attention_mask(tree.attention_mask)
    a, eol_a, b, eol_b, c, d = 1, 2, 3, 4, 5, 6
    assert mask[c, eol_a] and mask[c, a] and not mask[c, eol_b] and not mask[c, b]
    assert mask[d, eol_b] and not mask[d, eol_a]
    assert mask[eol_a, a] and not mask[a, eol_a] and not mask[eol_a, b]
    assert ins.position_ids(positions).tolist() == [2, 3, 4, 3, 4, 5, 5]
    assert ins.keep_indices(torch.tensor([[0, 2, 4], [0, 1, 3]])).tolist() == [[0, 3, 4, 6], [0, 1, 2, 5]]
    unplaced = EndOfRowInsertion.for_positions(EOL_LAYOUT, positions[None], 1)  # no host depths: the kept slots are read
    assert torch.equal(unplaced.source, ins.source) and unplaced.depth_ends is None
    with pytest.raises(ValueError, match="share a cursor"):
        unplaced.keep_indices(torch.tensor([[0, 2], [0, 0]]))


def test_per_row_end_of_row_insertion_matches_each_row_alone():
    """One tree per row (EAGLE-2): each row's slots are those of `EndOfRowInsertion` for that row alone, padded to
    the row with the most EOLs; nothing sees a pad and no pad is kept."""
    trees = [tree_from_parents([-1, 0, 0, 1, 2]), tree_from_parents([-1, 0, 1, 1, 3])]  # 2 row-end nodes, then 1
    positions = torch.stack([EOL_LAYOUT.sequence_position(1 + t.depths, 1) for t in trees])  # (2, 5)
    masks = torch.stack([t.attention_mask for t in trees])
    ids = torch.arange(10).reshape(2, 5)
    ins = EndOfRowInsertion.for_positions(EOL_LAYOUT, positions, 1)
    assert ins.source.shape == (2, 7) and ins.is_pad.sum(1).tolist() == [0, 1]
    fed_mask, fed_pos, fed_ids = ins.attention_mask(masks), ins.position_ids(positions), ins.input_ids(ids)
    for r, tree in enumerate(trees):
        alone = EndOfRowInsertion.for_positions(EOL_LAYOUT, positions[r : r + 1], 1)  # the row's tree alone (N = 1)
        n = alone.source.shape[1]
        assert ins.source[r, :n].tolist() == alone.source[0].tolist() and ins.view[r].tolist() == alone.view[0].tolist()
        assert torch.equal(fed_mask[r, :n, :n], alone.attention_mask(tree.attention_mask))
        assert fed_pos[r, :n].tolist() == alone.position_ids(positions[r]).tolist()
        assert fed_ids[r, :n].tolist() == alone.input_ids(ids[r : r + 1])[0].tolist()
    assert not fed_mask[1, :, 6].any() and fed_mask[1, 6, 0]  # the pad sees the root, nothing sees it
    # rows keep paths through the same raster positions: root, a depth-1 node (with its EOL), a depth-2 node
    assert ins.keep_indices(torch.tensor([[0, 2, 4], [0, 1, 3]])).tolist() == [[0, 3, 4, 6], [0, 1, 2, 4]]
    hidden = torch.arange(7.0).expand(4, 7)  # CFG: 2B fed rows read the B rows' tables
    assert ins.outputs(hidden)[2].tolist() == ins.view[0].float().tolist()
    assert EndOfRowInsertion.for_positions(EOL_LAYOUT, EOL_LAYOUT.sequence_position(torch.tensor([[7, 8]]), 1), 1) is None


@torch.no_grad()
def test_kv_after_a_tree_through_a_row_end_equals_recompute():
    """Invariant 3 with EOLs: keeping an accepted path that crosses a row end leaves the cache (and the next
    output) as if ``[prefix, codes, EOL, codes]`` had been fed from scratch."""
    model = _tiny_transformer(end_of_row_token=True)
    layout = model.layout
    b = 2
    prefix = model.embed_condition(torch.tensor([0, 3]))  # (B, 1, D)
    committed = torch.randint(0, 16, (b, 2))  # codes 0, 1
    cache = model.make_cache(b, 32)
    model(torch.cat([prefix, model.embed_image_tokens(committed[:, :1])], 1), torch.arange(2), past_key_values=cache)
    # root = code 1 (fed now), then two candidates for code 2 (the row end) and one child each for code 3
    tree = tree_from_parents([-1, 0, 0, 1, 2])
    ids = torch.cat([committed[:, 1:], torch.randint(0, 16, (b, 4))], 1)  # (B, 5)
    positions = layout.sequence_position(1 + tree.depths, 1)
    ins = EndOfRowInsertion.for_positions(layout, positions[None], 1)
    embeds = ins.embeds(model.embed_image_tokens(ins.input_ids(ids)), model.eol_embedding)
    start = cache.length
    model(embeds, ins.position_ids(positions), attention_mask=ins.attention_mask(tree.attention_mask), past_key_values=cache)
    path = torch.tensor([[0, 2, 4], [0, 1, 3]])  # row 0 accepts b then d, row 1 a then c
    cache.keep(start, ins.keep_indices(path))
    assert cache.length == start + 4  # root, candidate, its EOL, child
    seq_codes = torch.cat([committed[:, :1], ids.gather(1, path)], 1)  # codes 0..3
    seq = torch.cat([prefix, model.embed_image_tokens(seq_codes[:, :3]), model.eol_embedding.expand(b, 1, -1),
                     model.embed_image_tokens(seq_codes[:, 3:])], 1)  # (B, 1 + 5, D)
    fresh = model.make_cache(b, 32)
    model(seq, torch.arange(seq.shape[1]), past_key_values=fresh)
    assert fresh.length == cache.length
    for kept, want in zip(cache.keys + cache.values, fresh.keys + fresh.values):
        torch.testing.assert_close(kept[:, :, : cache.length], want[:, :, : cache.length], rtol=1e-5, atol=1e-5)


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
