"""`EagleDraftHead`: the EAGLE drafter's shapes, causality, KV cache and the backbone check."""

import pytest
import torch

from spatial_pipelines import EagleDraftHead
from spatial_pipelines.testing import dummy_pipeline


@pytest.fixture(scope="module")
def setup():
    pipe = dummy_pipeline("llamagen", grid=(3, 4), num_codes=16)
    torch.manual_seed(0)
    head = EagleDraftHead.for_backbone(pipe.backbone).eval()
    return pipe, head


def _inputs(pipe, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    d = pipe.backbone.hidden_size
    feats = torch.randn(2, n, d, generator=g)
    codes = torch.randint(0, 16, (2, n), generator=g)
    return feats, pipe.backbone.embed_image_tokens(codes)


def test_drafter_is_causal_and_its_cache_matches_one_pass(setup):
    pipe, head = setup
    feats, embeds = _inputs(pipe, 12)
    with torch.no_grad():
        full = head(feats, embeds, torch.arange(12))  # (2, 12, D)
        assert full.shape == feats.shape
        # changing input 7 leaves outputs 0..6 alone
        changed = feats.clone()
        changed[:, 7] += 1.0
        other = head(changed, embeds, torch.arange(12))
        torch.testing.assert_close(other[:, :7], full[:, :7])
        assert not torch.allclose(other[:, 7:], full[:, 7:])
        # the same sequence fed 5 + 4 + 3 through the drafter's own cache
        cache = head.make_cache(2, 16)
        parts = [head(feats[:, a:b], embeds[:, a:b], torch.arange(a, b), cache=cache) for a, b in ((0, 5), (5, 9), (9, 12))]
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=1e-5)
    assert cache.length == 12


def test_drafter_tree_mask_sees_only_ancestors(setup):
    pipe, head = setup
    feats, embeds = _inputs(pipe, 6, seed=1)
    with torch.no_grad():
        cache = head.make_cache(2, 16)
        head(feats[:, :3], embeds[:, :3], torch.arange(3), cache=cache)
        # two siblings after the prefix: each sees the cache and itself, not the other
        mask = torch.tensor([[True, False], [False, True]])
        both = head(feats[:, 3:5], embeds[:, 3:5], torch.tensor([3, 3]), attention_mask=mask, cache=cache)
        cache.crop(3)
        alone = head(feats[:, 4:5], embeds[:, 4:5], torch.tensor([3]), cache=cache)
    torch.testing.assert_close(both[:, 1:], alone, atol=1e-5, rtol=1e-5)


def test_drafter_roundtrip_and_backbone_check(setup, tmp_path):
    pipe, head = setup
    head.save_pretrained(tmp_path / "eagle")
    assert (tmp_path / "eagle" / "diffusion_pytorch_model.safetensors").is_file()
    loaded = pipe.load_draft_heads(tmp_path / "eagle")
    assert isinstance(loaded, EagleDraftHead)
    for k, v in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v)
    other = dummy_pipeline("llamagen", grid=(4, 4), num_codes=16)
    with pytest.raises(ValueError, match="grid_height"):
        other.load_draft_heads(tmp_path / "eagle")


@pytest.mark.parametrize("kwargs,name", [({"hidden_size": 30, "num_attention_heads": 4}, "hidden_size"),
                                         ({"num_attention_heads": 0}, "num_attention_heads"),
                                         ({"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 3}, "num_key_value_heads")])
def test_drafter_bad_config(kwargs, name):
    with pytest.raises(ValueError, match=name):
        EagleDraftHead(**kwargs)
