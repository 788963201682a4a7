"""The transformers-backed families run on the library's static KV cache (`language_model_forward`): a tiny
transformers Llama gives the no-cache outputs chunk by chunk, and after a tree pass whose accepted path is kept, the
cache holds what a fresh pass over the accepted sequence holds (invariant 3), under sdpa and eager attention."""

import pytest
import torch
from transformers import LlamaConfig, LlamaModel

from spatial_pipelines.core.kv_cache import StaticKVCache, additive_mask
from spatial_pipelines.core.tree import tree_from_parents
from spatial_pipelines.pipelines.transformers_utils import language_model_forward


def tiny(impl):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2)
    model = LlamaModel(cfg).eval()
    model.config._attn_implementation = impl
    return model


def pre_norm(model, embeds):
    got = []
    hook = model.norm.register_forward_pre_hook(lambda m, a: got.append(a[0]))
    with torch.no_grad():
        model(inputs_embeds=embeds)
    hook.remove()
    return got[0]


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_chunks_equal_one_pass(impl):
    model = tiny(impl)
    embeds = torch.randn(2, 10, 32)
    cache = StaticKVCache(2, 2, 2, 8, 16)
    out = torch.cat([language_model_forward(model, embeds[:, a:b], torch.arange(a, b), None, None, cache)
                     for a, b in ((0, 6), (6, 7), (7, 10))], 1)
    assert cache.length == 10
    assert torch.allclose(out, pre_norm(model, embeds), atol=1e-5)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_tree_pass_then_kept_path_equals_recompute(impl):
    model = tiny(impl)
    prefix, nodes = torch.randn(2, 4, 32), torch.randn(2, 5, 32)
    tree = tree_from_parents([-1, 0, 0, 1, 2])  # root, two candidates, one child each
    cache = StaticKVCache(2, 2, 2, 8, 16)
    language_model_forward(model, prefix, torch.arange(4), None, None, cache)
    cache.track_rows_on_device(5)  # the rows advance on the device, as in the engine's rounds
    cache.set_bound(4 + 5)
    out = language_model_forward(model, nodes, 4 + tree.depths, tree.attention_mask, None, cache)  # (2, 5, 32)
    path = torch.tensor([[0, 2, 4], [0, 1, 3]])  # per row
    for row in range(2):
        seq = torch.cat([prefix[row], nodes[row, path[row]]])[None]
        assert torch.allclose(out[row, path[row]], pre_norm(model, seq)[0, 4:], atol=1e-5)
    cache.keep_paths(path, torch.tensor([3, 3]))
    nxt = torch.randn(2, 1, 32)
    cache.set_bound(7 + 1)
    after = language_model_forward(model, nxt, torch.tensor([7]), None, None, cache)
    for row in range(2):
        seq = torch.cat([prefix[row], nodes[row, path[row]], nxt[row]])[None]
        assert torch.allclose(after[row], pre_norm(model, seq)[0, -1:], atol=1e-5)


def test_additive_mask():
    mask = torch.tensor([[True, False]])
    out = additive_mask(mask, torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out[0, 0] == 0 and out[0, 1] == torch.finfo(torch.bfloat16).min
