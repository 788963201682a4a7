"""The transformers families' GQA trunks attend to the cache's key/value heads as they are (`grouped_sdpa_attention`):
no `repeat_kv` in a pipeline's passes, no buffer of the repeated cache in a compiled step, and the hidden states of
transformers' own sdpa (keys and values repeated to every query head) for chain and tree masks, left-padded prompts and
CFG's doubled rows, on both ways of pairing the heads (SDPA's grouped heads, query groups folded into the query axis)."""

import math
import re

import pytest
import torch
import transformers.integrations.sdpa_attention as transformers_sdpa_module
from transformers import LlamaConfig, LlamaModel

from spatial_pipelines import JacobiDecoder
from spatial_pipelines.core.kv_cache import StaticKVCache
from spatial_pipelines.core.tree import tree_from_parents
from spatial_pipelines.pipelines import transformers_utils
from spatial_pipelines.pipelines.transformers_utils import (
    GROUPED_SDPA, folded_group_attention, grouped_head_attention, grouped_sdpa_attention, language_model_forward,
    use_grouped_attention,
)
from spatial_pipelines.testing import dummy_pipeline


def spy_repeat_kv(monkeypatch):
    """The shapes transformers' sdpa repeats to every query head from now on (``repeat_kv`` with ``n_rep > 1``)."""
    calls = []
    original = transformers_sdpa_module.repeat_kv

    def spy(hidden_states, n_rep):
        if n_rep > 1:
            calls.append(tuple(hidden_states.shape))
        return original(hidden_states, n_rep)

    monkeypatch.setattr(transformers_sdpa_module, "repeat_kv", spy)
    return calls


@pytest.mark.parametrize("family", ["janus", "emu3", "anole"])
def test_a_gqa_trunk_repeats_no_keys_and_values(family, monkeypatch):
    calls = spy_repeat_kv(monkeypatch)
    pipe = dummy_pipeline(family, JacobiDecoder(window_size=3), grid=(3, 3))
    config = pipe.backbone.text_model.config
    assert config.num_key_value_heads < config.num_attention_heads and config._attn_implementation == GROUPED_SDPA
    prompts = ["a red fox", "x"]  # left padding; CFG doubles the rows; window passes under chain masks
    out = pipe(prompts, guidance_scale=3.0, temperature=0, output_type="latent").tokens
    assert calls == []
    config._attn_implementation = "sdpa"  # control: transformers' sdpa repeats them, for the same codes
    assert torch.equal(pipe(prompts, guidance_scale=3.0, temperature=0, output_type="latent").tokens, out)
    assert calls


def tiny_llama(heads, kv_heads):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=50, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, head_dim=8)
    model = LlamaModel(config).eval()
    model.config._attn_implementation = "sdpa"
    return model


def passes(model, fixed_shape):
    """A CFG batch (2 prompts -> 4 rows) of left-padded prompts, then a chain pass (causal, 3 tokens) and a tree pass
    (5 nodes) on the static cache: the pre-norm states of the real tokens of each."""
    torch.manual_seed(1)
    config = model.config
    lengths = torch.tensor([6, 3, 6, 3])  # cond rows, then their uncond rows
    valid = torch.arange(6)[None] >= 6 - lengths[:, None]  # (4, 6) left-padded
    positions = (valid.cumsum(1) - 1).clamp_min(0)
    cache = StaticKVCache(config.num_hidden_layers, 4, config.num_key_value_heads, config.head_dim, 32,
                          fixed_shape=fixed_shape, attend_buckets=1)
    prompt = language_model_forward(model, torch.randn(4, 6, 48), positions, None, valid, cache)
    chain = language_model_forward(model, torch.randn(4, 3, 48), lengths[:, None] + torch.arange(3), None, None, cache)
    tree = tree_from_parents([-1, 0, 0, 1, 2])
    nodes = language_model_forward(model, torch.randn(4, 5, 48), (lengths + 3)[:, None] + tree.depths,
                                   tree.attention_mask, None, cache)
    return prompt[valid], chain, nodes


@pytest.mark.parametrize("fixed_shape", [False, True], ids=["growing", "fixed"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (6, 2)])
@pytest.mark.parametrize("pairing", ["grouped_heads", "folded"])
def test_grouped_attention_equals_repeated_keys_and_values(pairing, heads, kv_heads, fixed_shape, monkeypatch):
    model = tiny_llama(heads, kv_heads)
    want = passes(model, fixed_shape)  # transformers' sdpa: keys and values repeated
    use_grouped_attention(model)
    assert model.config._attn_implementation == GROUPED_SDPA
    if pairing == "folded":  # the pairing other devices take, run here on the CPU
        monkeypatch.setattr(transformers_utils, "grouped_head_attention", folded_group_attention)
    calls = spy_repeat_kv(monkeypatch)
    got = passes(model, fixed_shape)
    assert calls == []
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attend", [grouped_head_attention, folded_group_attention])
@pytest.mark.parametrize("mask_heads", [1, 6])
@pytest.mark.parametrize("dtype", [torch.bool, torch.float32])
def test_pairings_equal_repeat_kv(attend, mask_heads, dtype):
    """Query head ``h`` reads key/value head ``h // G``, under a mask shared by the heads or one per head."""
    torch.manual_seed(0)
    b, h, hkv, t, s, d = 2, 6, 2, 4, 9, 8
    query, key, value = torch.randn(b, h, t, d), torch.randn(b, hkv, s, d), torch.randn(b, hkv, s, d)
    allowed = torch.rand(b, mask_heads, t, s) > 0.4
    allowed[..., 0] = True  # every query sees a key
    mask = allowed if dtype == torch.bool else torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(dtype).min)
    want = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(h // hkv, 1), value.repeat_interleave(h // hkv, 1), attn_mask=mask, scale=0.3)
    torch.testing.assert_close(attend(query, key, value, mask, 0.3), want, rtol=1e-5, atol=1e-5)


def test_mha_trunks_and_other_implementations_keep_their_path(monkeypatch):
    mha = tiny_llama(4, 4)
    use_grouped_attention(mha)
    assert mha.config._attn_implementation == "sdpa"
    eager = tiny_llama(4, 2)
    eager.config._attn_implementation = "eager"
    use_grouped_attention(eager)
    assert eager.config._attn_implementation == "eager"
    # a module without grouped heads (a vision tower) reaching the grouped function takes transformers' sdpa
    plain = []
    monkeypatch.setattr(transformers_sdpa_module, "sdpa_attention_forward",
                        lambda *args, **kwargs: plain.append(args) or (args[1], None))
    module = torch.nn.Module()
    module.num_key_value_groups = 1
    query = torch.randn(1, 2, 3, 8)
    grouped_sdpa_attention(module, query, query, query, torch.zeros(1, 1, 3, 3))
    assert len(plain) == 1


@pytest.mark.slow
def test_compiled_gqa_step_allocates_no_repeated_cache():
    """Under inductor the step reads the cache's key/value heads: no buffer as large as the cache repeated to every
    query head (``(R, H, S, D)``), and the step's states are transformers' sdpa's."""
    from torch._inductor.utils import run_and_get_code

    model = tiny_llama(4, 2)
    r, s, d = 2, 64, 8

    def cache_after_prompt():
        torch.manual_seed(2)
        cache = StaticKVCache(2, r, 2, d, s, fixed_shape=True, attend_buckets=1)
        language_model_forward(model, torch.randn(r, 5, 48), torch.arange(5), None, None, cache)
        return cache

    embeds, positions = torch.randn(r, 3, 48), torch.arange(5, 8)
    want = language_model_forward(model, embeds, positions, None, None, cache_after_prompt())
    use_grouped_attention(model)
    cache = cache_after_prompt()
    torch._dynamo.reset()
    got, codes = run_and_get_code(
        torch.compile(lambda e, p: language_model_forward(model, e, p, None, None, cache), backend="inductor"),
        embeds, positions)
    torch._dynamo.reset()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    shapes = [tuple(int(x) for x in m.split(",") if x.strip()) for code in codes
              for m in re.findall(r"empty_strided_cpu\(\(([0-9, ]*)\)", code)]
    assert shapes and max(math.prod(shape) for shape in shapes) < r * 4 * s * d
