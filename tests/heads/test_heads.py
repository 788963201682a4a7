import json
from typing import Optional

import pytest
import torch
from diffusers.configuration_utils import register_to_config
from torch import nn

from spatial_pipelines import DECODERS, DraftHeadsMixin
from spatial_pipelines.heads import check_backbone_facts
from spatial_pipelines.testing import dummy_pipeline


class ToyHeads(DraftHeadsMixin):
    """A minimal concrete heads class: the base behaviour under test is the same for every head kind."""

    @register_to_config
    def __init__(
        self,
        base_model_name_or_path: Optional[str] = None,
        base_model_revision: Optional[str] = None,
        hidden_size: int = 32,
        num_image_codes: int = 16,
        grid_height: int = 4,
        grid_width: int = 4,
        num_heads: int = 2,
    ):
        super().__init__()
        self.proj = nn.Linear(hidden_size, hidden_size * num_heads)


def facts_of(pipe):
    return pipe.backbone.facts()


def test_heads_save_load_roundtrip_with_card(tmp_path):
    heads = ToyHeads(base_model_name_or_path="org/llamagen-t2i")
    heads.save_pretrained(tmp_path / "heads")
    files = sorted(p.name for p in (tmp_path / "heads").iterdir())
    assert files == ["README.md", "config.json", "diffusion_pytorch_model.safetensors"]
    card = (tmp_path / "heads" / "README.md").read_text()
    assert "base_model: org/llamagen-t2i" in card and "base_model_relation: adapter" in card
    config = json.loads((tmp_path / "heads" / "config.json").read_text())
    assert config["base_model_name_or_path"] == "org/llamagen-t2i" and config["hidden_size"] == 32
    loaded = ToyHeads.from_pretrained(tmp_path / "heads")
    assert torch.equal(loaded.proj.weight, heads.proj.weight)


@pytest.mark.parametrize("kind", ["medusa", "ssd", "eagle"])
def test_heads_variant_save_and_load(tmp_path, kind):
    """``save_pretrained(variant="fp16")`` writes ``diffusion_pytorch_model.fp16.safetensors`` and
    ``from_pretrained(variant="fp16")`` reads it back (every heads class); asking for a variant that was not saved
    is an error naming it."""
    pipe = dummy_pipeline("llamagen", kind, "random")
    heads = pipe.draft_heads
    heads.save_pretrained(tmp_path / "heads", variant="fp16")
    assert (tmp_path / "heads" / "diffusion_pytorch_model.fp16.safetensors").is_file()
    loaded = type(heads).from_pretrained(tmp_path / "heads", variant="fp16")
    saved, read = heads.state_dict(), loaded.state_dict()
    assert saved and list(read) == list(saved)  # zip below would pass over an empty or shorter listing
    for name, a in saved.items():
        assert torch.equal(a, read[name]), name
    with pytest.raises((ValueError, OSError), match="bf16|variant"):
        type(heads).from_pretrained(tmp_path / "heads", variant="bf16")


def test_pickle_saves_are_refused_never_silently_made_safetensors(tmp_path):
    """Heads and pipelines answer ``safe_serialization=False`` alike: a `ValueError` before anything is written."""
    for obj in (ToyHeads(), dummy_pipeline("llamagen")):
        with pytest.raises(ValueError, match="`safe_serialization` must be True"):
            obj.save_pretrained(tmp_path / "out", safe_serialization=False)
        assert not (tmp_path / "out").exists()


def test_pipeline_loads_matching_heads(tmp_path):
    pipe = dummy_pipeline("llamagen")
    ToyHeads().save_pretrained(tmp_path / "heads")
    heads = pipe.load_draft_heads(tmp_path / "heads")
    assert isinstance(heads, ToyHeads) and pipe.draft_heads is heads
    assert pipe.config.draft_heads[1] == "ToyHeads"


@pytest.mark.parametrize("fact,value", [("hidden_size", 64), ("num_image_codes", 32), ("grid_height", 8), ("grid_width", 2)])
def test_mismatched_heads_raise_before_loading(tmp_path, fact, value):
    pipe = dummy_pipeline("llamagen")
    ToyHeads(**{fact: value}).save_pretrained(tmp_path / "heads")
    with pytest.raises(ValueError, match=f"draft_heads.*{fact}"):
        pipe.load_draft_heads(tmp_path / "heads")
    assert pipe.draft_heads is None
    with pytest.raises(ValueError, match=fact):
        dummy_pipeline("llamagen", draft_heads=ToyHeads(**{fact: value}))
    with pytest.raises(ValueError, match=fact):
        ToyHeads.from_pretrained(tmp_path / "heads", backbone_facts=facts_of(pipe))


def test_weights_that_do_not_fit_the_config_raise(tmp_path):
    ToyHeads(num_heads=2).save_pretrained(tmp_path / "heads")
    config_path = tmp_path / "heads" / "config.json"
    config = json.loads(config_path.read_text())
    config["num_heads"] = 3  # the weights stay those of 2 heads
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="draft_heads"):
        ToyHeads.from_pretrained(tmp_path / "heads")


def test_unknown_heads_class_raises(tmp_path):
    ToyHeads().save_pretrained(tmp_path / "heads")
    config_path = tmp_path / "heads" / "config.json"
    config = json.loads(config_path.read_text())
    config["_class_name"] = "NotAHeadsClass"
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="NotAHeadsClass"):
        dummy_pipeline("llamagen").load_draft_heads(tmp_path / "heads")


def test_check_backbone_facts_lists_every_mismatch():
    with pytest.raises(ValueError) as err:
        check_backbone_facts({"hidden_size": 1, "num_image_codes": 2}, {"hidden_size": 3, "num_image_codes": 4})
    assert "hidden_size" in str(err.value) and "num_image_codes" in str(err.value)


def test_failed_heads_save_keeps_previous(tmp_path, monkeypatch):
    old = ToyHeads()
    old.save_pretrained(tmp_path / "heads")
    new = ToyHeads()

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(ToyHeads, "model_card", boom)
    with pytest.raises(OSError):
        new.save_pretrained(tmp_path / "heads")
    assert torch.equal(ToyHeads.from_pretrained(tmp_path / "heads").proj.weight, old.proj.weight)


@pytest.mark.parametrize("decoder", ["medusa", "hawk", "ssd", "eagle"])
def test_heads_follow_the_backbone_dtype(decoder):
    # fp32 heads attached to a bf16 backbone are cast like an adapter (they read its bf16 hidden states)
    pipe = dummy_pipeline("llamagen", decoder=decoder, draft_heads="random").to(dtype=torch.bfloat16)
    heads = pipe.draft_heads.to(dtype=torch.float32)
    pipe.set_draft_heads(heads)
    assert {p.dtype for p in heads.parameters()} == {torch.bfloat16}
    pipe.draft_heads = heads.to(dtype=torch.float32)  # the `pipe.scheduler = ...` habit attaches them alike
    assert {p.dtype for p in pipe.draft_heads.parameters()} == {torch.bfloat16}
    out = pipe("a prompt", generator=torch.Generator().manual_seed(0), output_type="latent")
    assert out.tokens.shape[0] == 1 and bool((out.tokens >= 0).all())


@pytest.mark.parametrize("decoder", ["medusa", "hawk"])
def test_stacked_heads_follow_a_cast_after_a_call(decoder):
    """Loaded heads are in eval mode, where a round runs them as one matmul over their stacked weights, kept between
    calls. A pipeline cast after a call (``.to()`` keeps each parameter and its version counter) stacks them again:
    the call runs, and in float64 gives the greedy codes of AR in float64."""
    pipe = dummy_pipeline("llamagen", decoder=decoder, draft_heads="random", grid=(4, 4))
    pipe.set_progress_bar_config(disable=True)
    pipe.draft_heads.eval()
    pipe("a prompt", temperature=0, output_type="latent")
    pipe.to(dtype=torch.float64)
    out = pipe("a prompt", temperature=0, output_type="latent")
    pipe.decoder = DECODERS["ar"]()
    assert out.tokens.equal(pipe("a prompt", temperature=0, output_type="latent").tokens)
