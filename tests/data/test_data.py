import pytest
import torch

from spatial_pipelines.data import TwemojiDataset, caption_from_name, split_of, twemoji_items


def test_captions_come_from_emoji_names():
    items = twemoji_items("all")
    assert len(items) == 3953  # of the 4,009 emoji, the ones with an English name
    by_file = {it.filename: it.caption for it in items}
    assert by_file["1f004.png"] == "mahjong red dragon"
    assert by_file["1f600.png"] == "grinning face"
    assert caption_from_name(":red_heart:") == "red heart"
    assert len({it.caption for it in items}) == len(items)  # captions identify images


def test_split_is_deterministic_and_disjoint():
    train, held_out = twemoji_items("train"), twemoji_items("eval")
    assert len(train) + len(held_out) == 3953
    assert 0.04 < len(held_out) / 3953 < 0.06
    assert not {it.caption for it in train} & {it.caption for it in held_out}
    assert [it.caption for it in held_out] == [it.caption for it in twemoji_items("eval")]
    assert all(split_of(it.caption) == "eval" for it in held_out)
    assert split_of("grinning face") == split_of("grinning face")


def test_images_are_composited_on_white():
    ds = TwemojiDataset("all", resolution=96, limit=3)
    item = ds[0]
    assert item["pixel_values"].shape == (3, 96, 96) and item["caption"] == "mahjong red dragon"
    x = item["pixel_values"]
    assert -1.0 <= x.min() and x.max() <= 1.0
    assert torch.allclose(x[:, 0, 0], torch.ones(3))  # the transparent corner became white


def test_bad_split_raises():
    with pytest.raises(ValueError, match="split"):
        twemoji_items("test")


def test_canonical_background_codes_replace_plain_patches_only():
    from spatial_pipelines.data import canonical_background_codes
    from spatial_pipelines.testing import dummy_pipeline

    vq = dummy_pipeline("llamagen", grid=(4, 4), num_codes=16).vqvae  # downsample 2: 8x8 pixels -> 4x4 codes
    pixels = torch.ones(2, 3, 8, 8)
    pixels[0, :, 4:, 4:] = torch.tensor([1.0, -1.0, -1.0])[:, None, None]  # a red square: patches 10, 11, 14, 15
    pixels[1, 0, 0, 0] = 0.995  # within the tolerance: still background
    pixels[1, 1, 7, 7] = 0.9  # outside it: patch 15 of image 1 is not background
    codes = torch.randint(16, (2, 16), generator=torch.Generator().manual_seed(0))
    canvas = vq.encode(torch.ones(1, 3, 8, 8)).indices.flatten()  # (16,)
    got = canonical_background_codes(vq, pixels, codes)
    kept = {0: [10, 11, 14, 15], 1: [15]}
    for row in (0, 1):
        for i in range(16):
            assert got[row, i] == (codes[row, i] if i in kept[row] else canvas[i]), (row, i)
    with pytest.raises(ValueError, match="`background` must be in"):
        canonical_background_codes(vq, pixels, codes, background=float("nan"))
    with pytest.raises(ValueError, match="`tolerance` must be in"):
        canonical_background_codes(vq, pixels, codes, tolerance=-0.1)
    with pytest.raises(ValueError, match="`codes` must have shape"):
        canonical_background_codes(vq, pixels, codes[:, :8])


def test_canonical_background_changes_nothing_under_the_embedded_patch_tokenizer():
    # the embedded tokenizer gives every plain-white patch one code already (the reason it replaced the
    # convolutional VQ, whose white patches spread over 98 codes): canonicalising its grids is the identity
    from spatial_pipelines.data import canonical_background_codes
    from spatial_pipelines.embedded import default_model_path
    from spatial_pipelines.models import load_vq_model

    vq = load_vq_model(f"{default_model_path()}/vqvae").eval()
    ds = TwemojiDataset("all", resolution=96, limit=8)
    pixels = torch.stack([ds[i]["pixel_values"] for i in range(8)])
    with torch.no_grad():
        codes = vq.encode(pixels).indices.flatten(1)
        canon = canonical_background_codes(vq, pixels, codes)
    white = (pixels == 1).all(1)  # (8, 96, 96)
    assert white.float().mean() > 0.1 and torch.equal(canon, codes)
