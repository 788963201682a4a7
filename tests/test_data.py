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
