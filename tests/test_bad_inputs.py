"""What users and attackers hand us (docs/checks.md): broken or hostile pipeline folders, heads that do not belong to
the backbone, settings past what they can cost, saving onto a file. Each row asserts the error type, that the message
names the file, key or argument, and that nothing was written or changed (`test_diffusers_habits.py` holds the
call-argument table)."""

import json
import logging
import shutil
import time
from pathlib import Path

import pytest
import torch
from diffusers.utils import logging as diffusers_logging

from spatial_pipelines import (
    ADTTreeDecoder,
    AnolePipeline,
    EagleDraftHead,
    Emu3Pipeline,
    JanusProPipeline,
    LatentDraftHeads,
    LlamaGenPipeline,
    LlamaGenTransformer,
    MedusaDecoder,
    SpatialDraftHeads,
    SSDDecoder,
)
from spatial_pipelines.heads import DraftHeadsMixin
from spatial_pipelines.testing import dummy_llamagen_components, dummy_pipeline

from helpers import lay_out_hub_cache


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A saved dummy pipeline folder (Medusa decoder and heads) and its heads folder."""
    root = tmp_path_factory.mktemp("bad_inputs")
    pipe = dummy_pipeline("llamagen", MedusaDecoder(num_heads=2, top_k=2), "random")
    pipe.save_pretrained(root / "pipe")
    pipe.draft_heads.save_pretrained(root / "heads")
    return root


def snapshot(folder: Path):
    """Every file under ``folder`` with its bytes: what "nothing was written or changed" compares."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _edit_json(relpath, **changes):
    def edit(folder):
        path = folder / relpath
        config = json.loads(path.read_text())
        config.update(changes)
        path.write_text(json.dumps(config))
    return edit


def _truncate(folder):
    path = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 3 // 4])


def _pickle_as_safetensors(folder):
    path = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    torch.save({"tok_embeddings.weight": torch.zeros(16, 32)}, path)


def _pickle_instead(folder):
    (folder / "transformer" / "diffusion_pytorch_model.safetensors").unlink()
    torch.save({"tok_embeddings.weight": torch.zeros(16, 32)}, folder / "transformer" / "diffusion_pytorch_model.bin")


def _deep(relpath):
    def edit(folder):
        (folder / relpath).write_text('{"a": ' * 200_000 + "1" + "}" * 200_000)
    return edit


# -- 1. loading: a folder checked against itself before any weight is used ------------------------------------------
FOLDER_CASES = [  # (id, edit of a copy of the saved folder, what the message names)
    ("fewer-layers", _edit_json("transformer/config.json", num_layers=1), r"transformer/config.json' does not match the weights.*layers\.1\."),
    ("more-layers", _edit_json("transformer/config.json", num_layers=3), r"transformer/config.json' does not match the weights.*layers\.2\."),
    ("wider-config", _edit_json("transformer/config.json", hidden_size=64), r"transformer/config.json' does not match the weights: `"),
    ("larger-grid", _edit_json("transformer/config.json", grid_height=64), r"transformer/config.json': `grid_height` is 64, but the weights were trained with grid_height=4"),
    ("other-prefix", _edit_json("transformer/config.json", num_condition_tokens=9), r"transformer/config.json'.*`num_condition_tokens`"),
    ("negative-size", _edit_json("transformer/config.json", hidden_size=-32), r"transformer/config.json': `hidden_size` must be an int"),
    ("string-size", _edit_json("transformer/config.json", num_layers="2"), r"transformer/config.json': `num_layers` must be an int"),
    ("huge-size", _edit_json("vqvae/config.json", codebook_size=10**12), r"vqvae/config.json': `codebook_size` must be an int"),
    ("bool-flag", _edit_json("transformer/config.json", end_of_row_token="yes"), r"transformer/config.json': `end_of_row_token` must be true or false"),
    ("unknown-pipeline", _edit_json("model_index.json", _class_name="NoSuchPipeline"), r"model_index.json': `_class_name` 'NoSuchPipeline' is not a pipeline"),
    ("other-family-pipeline", _edit_json("model_index.json", _class_name="JanusProPipeline"), r"model_index.json': `_class_name` is 'JanusProPipeline'"),
    ("model-as-decoder", _edit_json("model_index.json", decoder=["spatial_pipelines", "LlamaGenTransformer"]), r"model_index.json': `decoder` names 'LlamaGenTransformer', which is not a SpatialDecoderMixin"),
    ("decoder-as-model", _edit_json("model_index.json", transformer=["spatial_pipelines", "MedusaDecoder"]), r"model_index.json': `transformer` names 'MedusaDecoder'"),
    ("unknown-class", _edit_json("model_index.json", vqvae=["spatial_pipelines", "NoSuchModel"]), r"model_index.json': `vqvae` names the class 'NoSuchModel'"),
    ("foreign-library", _edit_json("model_index.json", vqvae=["os", "system"]), r"model_index.json': `vqvae` names the library 'os'"),
    ("unknown-decoder-config", _edit_json("decoder/decoder_config.json", _class_name="NoSuchDecoder"), r"decoder_config.json': `_class_name` 'NoSuchDecoder'"),
    ("truncated-weights", _truncate, r"transformer/diffusion_pytorch_model.safetensors' is truncated or corrupt: it holds \d+ bytes but its header lists"),
    ("pickle-planted", _pickle_as_safetensors, r"transformer/diffusion_pytorch_model.safetensors' is a pickle.*pickles are refused"),
    ("pickle-instead", _pickle_instead, r"`transformer` folder .* holds pickled weights \(diffusion_pytorch_model.bin\).*pickles are refused"),
    ("deep-config", _deep("transformer/config.json"), r"transformer/config.json' nests 200000 levels"),
    ("deep-index", _deep("model_index.json"), r"model_index.json' nests 200000 levels"),
]


@pytest.mark.parametrize("edit,names", [c[1:] for c in FOLDER_CASES], ids=[c[0] for c in FOLDER_CASES])
def test_bad_folders(saved, tmp_path, edit, names, monkeypatch):
    folder = tmp_path / "pipe"
    shutil.copytree(saved / "pipe", folder)
    edit(folder)
    before = snapshot(folder)
    monkeypatch.setattr(torch.nn.Module, "load_state_dict", lambda *a, **k: pytest.fail("weights were used before the check"))
    with pytest.raises(ValueError, match=names):
        LlamaGenPipeline.from_pretrained(folder)
    assert snapshot(folder) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe"]


# every door a folder comes through runs the same checks: the pipeline class, diffusers' own loader (which calls each
# component class's `from_pretrained`), the component class itself, the command line's `--model`, and Hub ids (a Hub
# cache laid out by the test, read offline)
def _door_hub(tmp_path, folder):
    hub = tmp_path / "hub"
    lay_out_hub_cache(hub, "org/tiny-pipe", folder, HUB_COMMIT)
    return hub


def _door_cli(folder, tmp_path, capsys):
    from spatial_pipelines.cli import main

    code = main(["generate", "a fox", "--model", str(folder), "--out", str(tmp_path / "fox.png"), "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    raise ValueError(err)


DOORS = {  # id -> load(folder, tmp_path, capsys)
    "pipeline-class": lambda folder, tmp, cap: LlamaGenPipeline.from_pretrained(folder),
    "DiffusionPipeline": lambda folder, tmp, cap: __import__("diffusers").DiffusionPipeline.from_pretrained(folder),
    "component-class": lambda folder, tmp, cap: LlamaGenTransformer.from_pretrained(folder / "transformer"),
    "component-subfolder": lambda folder, tmp, cap: LlamaGenTransformer.from_pretrained(folder, subfolder="transformer"),
    "command-line": _door_cli,
    "hub-id-DiffusionPipeline": lambda folder, tmp, cap: __import__("diffusers").DiffusionPipeline.from_pretrained(
        "org/tiny-pipe", cache_dir=_door_hub(tmp, folder)),
    "hub-id-component": lambda folder, tmp, cap: LlamaGenTransformer.from_pretrained(
        "org/tiny-pipe", subfolder="transformer", cache_dir=_door_hub(tmp, folder)),
}
DOOR_CASES = [  # (id, edit of a copy of the saved folder, what the message names)
    ("truncated-weights", _truncate, r"transformer/diffusion_pytorch_model.safetensors' is truncated or corrupt: it holds \d+ bytes but its header lists"),
    ("pickle-instead", _pickle_instead, r"`transformer` folder .*transformer' holds pickled weights \(diffusion_pytorch_model.bin\).*pickles are "
                                        r"refused.*nothing was loaded.*`safetensors.torch.save_file\(torch.load\('.*transformer/diffusion_pytorch_model.bin', "
                                        r"weights_only=True\), '.*transformer/diffusion_pytorch_model.safetensors'\)`"),
]


@pytest.mark.parametrize("door", list(DOORS))
@pytest.mark.parametrize("edit,names", [c[1:] for c in DOOR_CASES], ids=[c[0] for c in DOOR_CASES])
def test_every_door_checks_the_folder(saved, tmp_path, edit, names, door, monkeypatch, capsys):
    from diffusers.models import model_loading_utils

    folder = tmp_path / "pipe"
    shutil.copytree(saved / "pipe", folder)
    edit(folder)
    before = snapshot(folder)
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("a pickle was loaded"))
    monkeypatch.setattr(model_loading_utils, "load_state_dict", lambda *a, **k: pytest.fail("weights were read before the check"))
    monkeypatch.setattr(torch.nn.Module, "load_state_dict", lambda *a, **k: pytest.fail("weights were used before the check"))
    with pytest.raises(ValueError, match=names):
        DOORS[door](folder, tmp_path, capsys)
    assert snapshot(folder) == before


def test_the_component_doors_load_a_whole_folder(saved, tmp_path):
    from diffusers import DiffusionPipeline

    from spatial_pipelines import LlamaGenTransformer as Transformer

    hub = _door_hub(tmp_path, saved / "pipe")
    for model in (Transformer.from_pretrained(saved / "pipe" / "transformer"),
                  Transformer.from_pretrained("org/tiny-pipe", subfolder="transformer", cache_dir=hub)):
        assert model.config.grid_height == 4
    assert type(DiffusionPipeline.from_pretrained("org/tiny-pipe", cache_dir=hub)) is LlamaGenPipeline


def test_a_saved_folder_loads_and_records_its_grid(saved):
    from spatial_pipelines.utils import SAVED_FACTS_KEY, safetensors_header

    header = safetensors_header(str(saved / "pipe" / "transformer" / "diffusion_pytorch_model.safetensors"))
    assert json.loads(header["__metadata__"][SAVED_FACTS_KEY]) == {"grid_height": 4, "grid_width": 4, "num_condition_tokens": 8}
    pipe = LlamaGenPipeline.from_pretrained(saved / "pipe")
    assert type(pipe.decoder) is MedusaDecoder and type(pipe.draft_heads) is SpatialDraftHeads


def _warnings(call):
    diffusers_logging.enable_propagation()
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("spatial_pipelines")
    logger.addHandler(handler)
    try:
        result = call()
    finally:
        logger.removeHandler(handler)
        diffusers_logging.disable_propagation()
    return result, [r.getMessage() for r in records]


def test_a_component_config_that_disagrees_with_model_index_wins_with_a_warning(saved, tmp_path):
    folder = tmp_path / "pipe"
    shutil.copytree(saved / "pipe", folder)
    (folder / "decoder" / "decoder_config.json").write_text(json.dumps({"_class_name": "SSDDecoder", "vertical_rounds": 3}))
    pipe, messages = _warnings(lambda: LlamaGenPipeline.from_pretrained(folder))
    assert type(pipe.decoder) is SSDDecoder and pipe.decoder.config.vertical_rounds == 3
    assert any("MedusaDecoder" in m and "SSDDecoder" in m for m in messages)


def test_bad_heads_folders(saved, tmp_path):
    heads = tmp_path / "heads"
    shutil.copytree(saved / "heads", heads)
    (heads / "config.json").write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(ValueError, match=r"heads/config.json' nests 200000 levels"):
        DraftHeadsMixin.from_pretrained(heads)
    shutil.rmtree(heads)
    shutil.copytree(saved / "heads", heads)
    torch.save({}, heads / "diffusion_pytorch_model.safetensors")
    with pytest.raises(ValueError, match=r"is a pickle.*pickles are refused"):
        DraftHeadsMixin.from_pretrained(heads)


# transformers families: a checkpoint is compared as transformers loads it (its conversion mapping renames Emu3's
# original names), in a pipeline folder and in the original layout `from_backbone` reads
TRANSFORMERS_PIPELINES = {"janus": JanusProPipeline, "emu3": Emu3Pipeline, "anole": AnolePipeline}


@pytest.fixture(scope="module")
def saved_transformers(tmp_path_factory):
    """A saved tiny pipeline folder of each transformers family, and (janus, emu3) its transformer in the original
    layout (config.json + model.safetensors + generation_config.json + processor files in one folder)."""
    root = tmp_path_factory.mktemp("bad_transformers")
    for family in TRANSFORMERS_PIPELINES:
        pipe = dummy_pipeline(family)
        pipe.save_pretrained(root / family)
        if family != "anole":  # Anole's from_backbone reads a VQGAN from elsewhere
            pipe.transformer.save_pretrained(root / f"{family}-original")
            pipe.processor.save_pretrained(root / f"{family}-original")
    return root


def _layers(n):
    def edit(config):
        (config.get("text_config") or config)["num_hidden_layers"] = n
    return edit


def _edit_config(edit, name="config.json"):
    def apply(folder):
        path = folder / name
        config = json.loads(path.read_text())
        edit(config)
        path.write_text(json.dumps(config))
    return apply


def _weights(change):
    def apply(folder):
        from safetensors.torch import load_file, save_file

        path = folder / "model.safetensors"
        tensors = load_file(path)
        change(tensors)
        save_file(tensors, path, metadata={"format": "pt"})
    return apply


def _drop_last_layer_norm(tensors):
    del tensors[max(k for k in tensors if k.endswith("layers.1.post_attention_layernorm.weight"))]


def _add_tensor(tensors):
    tensors["model.planted.weight"] = torch.zeros(2, 2)


def _grid(family, rows, columns):
    if family == "janus":  # Janus' grid: num_image_tokens codes in the VQ's rows (4 in the tiny model)
        return _edit_config(lambda c: c["vision_config"].update(num_image_tokens=rows * columns))
    return _edit_config(lambda c: c.update(image_grid=[rows, columns]), "generation_config.json")


TRANSFORMERS_CASES = [  # (id, edit of the transformer's folder, what the message names); the tiny models have 2 layers
    ("fewer-layers", lambda family: _edit_config(_layers(1)), r"config.json' does not match the weights: they hold `[\w.]*layers\.1\.[\w.]*` in model.safetensors \(\d+ tensors in all\) that the config does not build"),
    ("more-layers", lambda family: _edit_config(_layers(3)), r"config.json' does not match the weights: the config builds `[\w.]*layers\.2\.[\w.]*` \(\d+ tensors in all\) that the weights \(model.safetensors\) do not have"),
    ("lost-tensor", lambda family: _weights(_drop_last_layer_norm), r"config.json' does not match the weights: the config builds `[\w.]*layers\.1\.post_attention_layernorm\.weight` \(1 tensors in all\) that the weights \(model.safetensors\) do not have"),
    ("planted-tensor", lambda family: _weights(_add_tensor), r"config.json' does not match the weights: they hold `model.planted.weight` in model.safetensors \(1 tensors in all\)"),
    ("grid-past-positions", lambda family: _grid(family, 4, 1024), r"(generation_)?config.json': `(image_grid|vision_config.num_image_tokens)` asks for a 4x1024 grid, which takes 4\d{3} positions, but '.*config.json': `max_position_embeddings` is 4096"),
]


@pytest.mark.parametrize("family", list(TRANSFORMERS_PIPELINES))
@pytest.mark.parametrize("make_edit,names", [c[1:] for c in TRANSFORMERS_CASES], ids=[c[0] for c in TRANSFORMERS_CASES])
def test_bad_transformers_folders(saved_transformers, tmp_path, family, make_edit, names, monkeypatch):
    from transformers import PreTrainedModel

    folder = tmp_path / "pipe"
    shutil.copytree(saved_transformers / family, folder)
    make_edit(family)(folder / "transformer")
    before = snapshot(folder)
    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(lambda *a, **k: pytest.fail("weights were read before the check")))
    with pytest.raises(ValueError, match="transformer/" + names):
        TRANSFORMERS_PIPELINES[family].from_pretrained(folder)
    assert snapshot(folder) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe"]


@pytest.mark.parametrize("family", ["janus", "emu3"])
@pytest.mark.parametrize("make_edit,names", [c[1:] for c in TRANSFORMERS_CASES], ids=[c[0] for c in TRANSFORMERS_CASES])
def test_bad_original_checkpoints(saved_transformers, tmp_path, family, make_edit, names, monkeypatch):
    from transformers import PreTrainedModel

    folder = tmp_path / "original"
    shutil.copytree(saved_transformers / f"{family}-original", folder)
    make_edit(family)(folder)
    before = snapshot(folder)
    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(lambda *a, **k: pytest.fail("weights were read before the check")))
    with pytest.raises(ValueError, match="original/" + names):
        TRANSFORMERS_PIPELINES[family].from_backbone(folder)
    assert snapshot(folder) == before


def test_original_checkpoints_that_match_load_and_a_grid_argument_past_the_positions_is_refused(saved_transformers, monkeypatch):
    from transformers import PreTrainedModel

    for family in ("janus", "emu3"):
        pipe = TRANSFORMERS_PIPELINES[family].from_backbone(saved_transformers / f"{family}-original")
        assert pipe.backbone.layout.sequence_length < pipe.backbone.max_sequence_length
    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(lambda *a, **k: pytest.fail("weights were read before the check")))
    with pytest.raises(ValueError, match=r"`image_grid` asks for a 64x64 grid, which takes 4160 positions, but .*`max_position_embeddings` is 4096"):
        Emu3Pipeline.from_backbone(saved_transformers / "emu3-original", image_grid=(64, 64))


def _pickle_only(folder):
    from safetensors.torch import load_file

    torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()


def _pickle_planted(folder):
    torch.save({"model.planted.weight": torch.zeros(2, 2)}, folder / "model.safetensors")


def _truncated(folder):
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) * 3 // 4])


def _deep_config(folder):
    (folder / "config.json").write_text('{"a": ' * 200_000 + "1" + "}" * 200_000)


def _index_outside(folder):
    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"model.planted.weight": "../../../other.safetensors"}}))


ORIGINAL_FILE_CASES = [  # (id, edit of the checkpoint folder, what the message names): its files, not its config
    ("pickle-only", _pickle_only, r"holds pickled weights \(pytorch_model.bin\) and no safetensors.*pickles are refused"),
    ("pickle-planted", _pickle_planted, r"model.safetensors' is a pickle.*pickles are refused"),
    ("truncated-weights", _truncated, r"model.safetensors' is truncated or corrupt: it holds \d+ bytes but its header lists"),
    ("deep-config", _deep_config, r"config.json' nests 200000 levels"),
    ("shard-outside-the-repo", _index_outside, r"model.safetensors.index.json': `weight_map` maps 'model.planted.weight' to '../../../other.safetensors', not a safetensors file beside the index"),
]


def _nothing_loaded(monkeypatch):
    from transformers import PreTrainedModel

    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(lambda *a, **k: pytest.fail("weights were read before the check")))
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("a pickle was loaded"))


@pytest.mark.parametrize("family", ["janus", "emu3"])
@pytest.mark.parametrize("edit,names", [c[1:] for c in ORIGINAL_FILE_CASES], ids=[c[0] for c in ORIGINAL_FILE_CASES])
def test_bad_original_checkpoint_files(saved_transformers, tmp_path, family, edit, names, monkeypatch):
    folder = tmp_path / "original"
    shutil.copytree(saved_transformers / f"{family}-original", folder)
    edit(folder)
    before = snapshot(folder)
    _nothing_loaded(monkeypatch)
    with pytest.raises(ValueError, match=names) as caught:
        TRANSFORMERS_PIPELINES[family].from_backbone(folder)
    assert str(folder) in str(caught.value)
    assert snapshot(folder) == before


# the same checkpoints by Hub id: a Hub cache laid out as huggingface_hub lays it out (``models--org--name/snapshots/
# <commit>/``, ``refs/main``) and read offline (conftest sets ``HF_HUB_OFFLINE=1``) through ``cache_dir``, as
# transformers reads it. Every check of the local folder runs on the repo's config, index and weights' headers before
# transformers reads a weight (or would download one), and nothing is written into the cache.
HUB_COMMIT = "c" * 40


def _hub_id_of(tmp_path, family, folder, refs=("main",)):
    hub = tmp_path / "hub"
    lay_out_hub_cache(hub, f"org/{family}-tiny", folder, HUB_COMMIT, refs)
    return f"org/{family}-tiny", hub


@pytest.mark.parametrize("family", ["janus", "emu3"])
@pytest.mark.parametrize("make_edit,names", [(c[1], c[2]) for c in TRANSFORMERS_CASES] + [((lambda edit: lambda family: edit)(c[1]), c[2]) for c in ORIGINAL_FILE_CASES],
                         ids=[c[0] for c in TRANSFORMERS_CASES] + [c[0] for c in ORIGINAL_FILE_CASES])
def test_bad_original_checkpoints_by_hub_id(saved_transformers, tmp_path, family, make_edit, names, monkeypatch):
    folder = tmp_path / "original"
    shutil.copytree(saved_transformers / f"{family}-original", folder)
    make_edit(family)(folder)
    repo_id, hub = _hub_id_of(tmp_path, family, folder)
    before = snapshot(hub)
    _nothing_loaded(monkeypatch)
    with pytest.raises(ValueError, match=names) as caught:
        TRANSFORMERS_PIPELINES[family].from_backbone(repo_id, cache_dir=hub)
    message = str(caught.value)
    assert f"models--org--{family}-tiny/snapshots/{HUB_COMMIT}/" in message or f"Hub checkpoint {repo_id} " in message
    assert snapshot(hub) == before


NOT_DOWNLOADED_CASES = [  # (id, edit of the checkpoint, what the message names)
    ("fewer-layers", _edit_config(_layers(1)), r"config.json' does not match the weights: they hold `[\w.]*layers\.1\."),
    ("pickle-planted", _pickle_planted, r"'model.safetensors' of org/janus-tiny \(revision 'c{40}'\) is not a safetensors file.*pickles are refused"),
]


@pytest.mark.parametrize("edit,names", [c[1:] for c in NOT_DOWNLOADED_CASES], ids=[c[0] for c in NOT_DOWNLOADED_CASES])
def test_weights_not_yet_downloaded_are_checked_by_their_header(saved_transformers, tmp_path, edit, names, monkeypatch):
    """Online, a weights file the cache does not hold is checked by its header alone (huggingface_hub's ranged read,
    `HfApi.parse_safetensors_file_metadata`, served here from the laid-out file; nothing else goes online: the configs
    are cached and the Hub stays offline for them) before transformers would download it."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import SafetensorsParsingError
    from huggingface_hub.utils import SafetensorsFileMetadata, TensorInfo

    from spatial_pipelines import weight_checks
    from spatial_pipelines.utils import safetensors_header

    folder = tmp_path / "original"
    shutil.copytree(saved_transformers / "janus-original", folder)
    edit(folder)
    repo_id, hub = _hub_id_of(tmp_path, "janus", folder)
    read = []

    def parse(self, repo, filename, **kwargs):
        read.append((repo, filename, kwargs.get("revision")))
        try:
            header = safetensors_header(str(folder / filename))
        except ValueError as err:
            raise SafetensorsParsingError(str(err)) from None
        return SafetensorsFileMetadata(metadata=header.pop("__metadata__", {}), tensors={
            k: TensorInfo(dtype=v["dtype"], shape=v["shape"], data_offsets=tuple(v["data_offsets"])) for k, v in header.items()})

    init = weight_checks.HubCheckpoint.__init__

    def online(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.offline = False

    monkeypatch.setattr(HfApi, "parse_safetensors_file_metadata", parse)
    monkeypatch.setattr(weight_checks.HubCheckpoint, "__init__", online)
    monkeypatch.setattr(weight_checks.HubCheckpoint, "cached", lambda self, name: None)
    _nothing_loaded(monkeypatch)
    with pytest.raises(ValueError, match=names):
        JanusProPipeline.from_backbone(repo_id, cache_dir=hub, revision=HUB_COMMIT)
    assert read == [(repo_id, "model.safetensors", HUB_COMMIT)]


def test_use_safetensors_false_is_refused(saved_transformers, monkeypatch):
    _nothing_loaded(monkeypatch)
    for family in ("janus", "emu3"):
        with pytest.raises(ValueError, match=r"`use_safetensors=False` asks for pickled weights: pickles are refused"):
            TRANSFORMERS_PIPELINES[family].from_backbone(saved_transformers / f"{family}-original", use_safetensors=False)


@pytest.mark.parametrize("family,shards", [("janus", False), ("janus", True), ("emu3", False)], ids=["janus", "janus-sharded", "emu3"])
def test_an_original_checkpoint_loads_by_hub_id(saved_transformers, tmp_path, family, shards):
    """A valid checkpoint in the Hub cache loads by its id (``cache_dir``, ``revision``: a branch or a commit), checked
    first, and decodes as the same folder loaded by path; a revision the cache does not hold is transformers'
    `OSError`."""
    folder = tmp_path / "original"
    shutil.copytree(saved_transformers / f"{family}-original", folder)
    if shards:  # model.safetensors.index.json and its shards, as large checkpoints are published
        (folder / "model.safetensors").unlink()
        TRANSFORMERS_PIPELINES[family].from_backbone(saved_transformers / f"{family}-original").transformer.save_pretrained(
            folder, max_shard_size="200KB")
        assert (folder / "model.safetensors.index.json").is_file() and len(list(folder.glob("model-*.safetensors"))) > 1
    repo_id, hub = _hub_id_of(tmp_path, family, folder, refs=("main", "v1"))
    before = snapshot(hub)
    local = TRANSFORMERS_PIPELINES[family].from_backbone(folder)
    local.set_progress_bar_config(disable=True)
    ref = local(["a red fox", "x"], temperature=0, output_type="latent").tokens
    for revision in (None, "v1", HUB_COMMIT):
        pipe = TRANSFORMERS_PIPELINES[family].from_backbone(repo_id, cache_dir=hub, revision=revision)
        pipe.set_progress_bar_config(disable=True)
        assert pipe.config._name_or_path == repo_id
        assert torch.equal(pipe(["a red fox", "x"], temperature=0, output_type="latent").tokens, ref)
    with pytest.raises(OSError):
        TRANSFORMERS_PIPELINES[family].from_backbone(repo_id, cache_dir=hub, revision="not-in-the-cache")
    assert snapshot(hub) == before


@pytest.mark.parametrize("family", ["janus", "emu3", "anole", "lumina_mgpt"])
def test_a_grid_edited_past_the_positions_is_refused_at_call_time(family, monkeypatch):
    pipe = dummy_pipeline(family)
    if family == "janus":
        pipe.transformer.config.vision_config.num_image_tokens = 4 * 1024
    else:
        pipe.transformer.generation_config.image_grid = [4, 1024]
    monkeypatch.setattr(type(pipe.backbone), "encode_prompt", lambda *a, **k: pytest.fail("work began before the check"))
    key = "vision_config.num_image_tokens` in the transformer's config" if family == "janus" else "image_grid` in the transformer's generation config"
    with pytest.raises(ValueError, match=f"`{key} asks for a 4x1024 grid, which takes 4\\d{{3}} positions, but its config's `max_position_embeddings` is 4096"):
        pipe("a fox", output_type="latent")


# the embedded model: its weights record the grid and prefix it was trained for, as every saved folder's do
def test_the_embedded_model_records_its_trained_grid(tmp_path, monkeypatch):
    from spatial_pipelines.embedded import default_model_path
    from spatial_pipelines.utils import SAVED_FACTS_KEY, safetensors_header

    source = Path(default_model_path())
    header = safetensors_header(str(source / "transformer" / "diffusion_pytorch_model.safetensors"))
    config = json.loads((source / "transformer" / "config.json").read_text())
    facts = json.loads(header["__metadata__"][SAVED_FACTS_KEY])
    assert facts == {k: config[k] for k in ("grid_height", "grid_width", "num_condition_tokens")} == {
        "grid_height": 24, "grid_width": 24, "num_condition_tokens": 24}
    folder = tmp_path / "pipe"
    shutil.copytree(source, folder)
    _edit_json("transformer/config.json", grid_height=32)(folder)
    before = snapshot(folder)
    monkeypatch.setattr(torch.nn.Module, "load_state_dict", lambda *a, **k: pytest.fail("weights were used before the check"))
    with pytest.raises(ValueError, match=r"transformer/config.json': `grid_height` is 32, but the weights were trained with grid_height=24"):
        LlamaGenPipeline.from_pretrained(folder)
    assert snapshot(folder) == before


# original-format checkpoints (`.pt`, `.ckpt`) are read with torch's restricted unpickler: one that holds objects other
# than tensors is named with the argument, never unpickled, and torch's advice to load it unsafely is not passed on
def _original_llamagen(folder):
    """A tiny LlamaGen GPT and VQ as original .pt files (state dicts under `model`)."""
    pipe = dummy_pipeline("llamagen")
    torch.save({"model": pipe.transformer.state_dict()}, folder / "gpt.pt")
    torch.save({"model": pipe.vqvae.state_dict()}, folder / "vq.pt")
    return pipe


ORIGINAL_PT_CASES = [  # (id, argument, the object planted beside the tensors)
    ("gpt-with-args", "repo_or_path", "gpt.pt"),
    ("vq-with-args", "vq_checkpoint", "vq.pt"),
]


@pytest.mark.parametrize("argument,name", [c[1:] for c in ORIGINAL_PT_CASES], ids=[c[0] for c in ORIGINAL_PT_CASES])
def test_an_original_checkpoint_holding_objects_is_named_and_never_unpickled(tmp_path, argument, name, monkeypatch):
    import argparse

    _original_llamagen(tmp_path)
    path = tmp_path / name
    ckpt = torch.load(path, weights_only=True)
    torch.save({**ckpt, "args": argparse.Namespace(lr=1e-4)}, path)  # as training scripts save their arguments
    built = []
    monkeypatch.setattr(torch.nn.Module, "load_state_dict", lambda *a, **k: built.append(a) or pytest.fail("a model was built"))
    with pytest.raises(ValueError) as caught:
        LlamaGenPipeline.from_backbone(tmp_path / "gpt.pt", vq_checkpoint=tmp_path / "vq.pt", gpt_model=None,
                                       num_attention_heads=2, image_size=8, downsample_size=2)
    message = str(caught.value)
    assert f"`{argument}` {str(path)!r} holds objects other than tensors (`argparse.Namespace`)" in message
    assert "will not unpickle them" in message and "torch.serialization.safe_globals([argparse.Namespace])" in message
    assert "weights_only=False" not in message and "weights_only` set to `False" not in message
    assert caught.value.__cause__ is None and caught.value.__suppress_context__


def test_a_truncated_original_checkpoint_is_named(tmp_path):
    _original_llamagen(tmp_path)
    data = (tmp_path / "vq.pt").read_bytes()
    (tmp_path / "vq.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"`vq_checkpoint` '.*vq.pt' is not a readable torch.save checkpoint \(truncated or corrupt\?\)"):
        LlamaGenPipeline.from_backbone(tmp_path / "gpt.pt", vq_checkpoint=tmp_path / "vq.pt", num_attention_heads=2,
                                       image_size=8, downsample_size=2)


def test_the_original_vqgan_ckpt_is_read_as_tensors_only(tmp_path):
    import argparse

    from spatial_pipelines.models.vq_chameleon import load_chameleon_vq, tiny_chameleon_vq

    torch.save({"state_dict": tiny_chameleon_vq().state_dict(), "hyper_parameters": argparse.Namespace(lr=1)}, tmp_path / "vqgan.ckpt")
    with pytest.raises(ValueError, match=r"`source` '.*vqgan.ckpt' holds objects other than tensors \(`argparse.Namespace`\)"):
        load_chameleon_vq(tmp_path / "vqgan.ckpt", config={})


# -- 2. heads that do not belong: checked at attach and at call time -------------------------------------------------
def _heads(pipe, **changes):
    facts = {**pipe.backbone.facts(), **changes}
    return SpatialDraftHeads(horizontal_offsets=[1, 2], **facts)


HEADS_CASES = [  # (id, what the heads differ in, what the message names)
    ("family", {"family": "janus"}, r"family: heads 'janus' != backbone 'llamagen'"),
    ("base-model", {"base_model_name_or_path": "org/another-model"}, r"base_model_name_or_path: heads 'org/another-model' != backbone 'org/tiny'"),
    ("hidden-size", {"hidden_size": 64}, r"hidden_size: heads 64 != backbone 32"),
    ("code-count", {"num_image_codes": 32}, r"num_image_codes: heads 32 != backbone 16"),
    ("smaller-grid", {"grid_height": 3, "grid_width": 3}, r"grid_height: heads 3 != backbone 4; grid_width: heads 3 != backbone 4"),
]


@pytest.mark.parametrize("changes,names", [c[1:] for c in HEADS_CASES], ids=[c[0] for c in HEADS_CASES])
def test_heads_that_do_not_belong_are_refused_at_attach(changes, names, tmp_path):
    pipe = dummy_pipeline("llamagen", MedusaDecoder(num_heads=2, top_k=2), "random")
    pipe.register_to_config(_name_or_path="org/tiny")
    attached = pipe.draft_heads
    wrong = _heads(pipe, **changes)
    attachers = [lambda: setattr(pipe, "draft_heads", wrong), lambda: pipe.set_draft_heads(wrong),
                 lambda: pipe.load_draft_heads(folder)]
    if "base_model_name_or_path" not in changes:  # a pipeline built in memory has no source to compare
        attachers.append(lambda: LlamaGenPipeline(**{**pipe.components, "draft_heads": wrong}))
    folder = tmp_path / "heads"
    wrong.save_pretrained(folder)
    for attach in attachers:
        with pytest.raises(ValueError, match=names):
            attach()
        assert pipe.draft_heads is attached


def test_heads_made_for_the_same_base_model_are_accepted(monkeypatch):
    from spatial_pipelines.heads import heads_utils

    monkeypatch.setattr(heads_utils, "_UNTOLD", set())
    pipe = dummy_pipeline("llamagen", MedusaDecoder(num_heads=2, top_k=2))
    pipe.register_to_config(_name_or_path="org/tiny")
    _, messages = _warnings(lambda: setattr(pipe, "draft_heads", _heads(pipe, base_model_name_or_path="org/tiny")))
    assert not messages
    # a folder of another machine cannot be compared: accepted, with a warning that says so
    _, messages = _warnings(lambda: setattr(pipe, "draft_heads", _heads(pipe, base_model_name_or_path="/a/folder/of/another/machine")))
    assert [m for m in messages if "Cannot tell whether these draft heads were made for this backbone" in m
            and "'/a/folder/of/another/machine' (not a folder on this machine)" in m and "'org/tiny'" in m]
    pipe.register_to_config(_name_or_path=None)
    _, messages = _warnings(lambda: setattr(pipe, "draft_heads", _heads(pipe, base_model_name_or_path="org/another-model")))
    assert not messages  # a pipeline built in memory: nothing to compare


BASE_MODEL_CASES = [  # (id, the heads' base model given the folder and tmp_path, refused message / warned / accepted)
    ("same-folder", lambda folder, tmp: str(folder), None),
    ("relative-spelling", lambda folder, tmp: "pipe", None),
    ("symlink", lambda folder, tmp: str(tmp / "link"), None),
    ("hub-model-it-was-saved-from", lambda folder, tmp: "org/tiny", None),
    ("another-hub-model", lambda folder, tmp: "org/another-model",
     r"base_model_name_or_path: heads 'org/another-model' != backbone '.*/pipe' \(saved from 'org/tiny'\)"),
    ("moved-folder", lambda folder, tmp: "/a/moved/pipe", "warn"),
    ("another-folder", lambda folder, tmp: str(tmp / "other"), "warn"),
]


@pytest.mark.parametrize("base,expected", [c[1:] for c in BASE_MODEL_CASES], ids=[c[0] for c in BASE_MODEL_CASES])
def test_heads_against_a_backbone_loaded_from_a_local_folder(saved, tmp_path, base, expected, monkeypatch):
    """A local folder is compared by its resolved path and by the Hub model its model_index.json says it was saved
    from (when this machine's Hub cache knows it); what cannot be told is warned about, never refused."""
    from huggingface_hub import constants

    from spatial_pipelines.heads import heads_utils

    monkeypatch.setattr(heads_utils, "_UNTOLD", set())
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    (tmp_path / "hub" / "models--org--tiny").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "pipe"
    shutil.copytree(saved / "pipe", folder)
    _edit_json("model_index.json", _name_or_path="org/tiny")(folder)  # a pipeline saved from the Hub model org/tiny
    shutil.copytree(saved / "pipe", tmp_path / "other")
    (tmp_path / "link").symlink_to(folder)
    pipe = LlamaGenPipeline.from_pretrained(folder)
    attached = pipe.draft_heads
    heads = _heads(pipe, base_model_name_or_path=base(folder, tmp_path))
    heads_folder = tmp_path / "heads"
    heads.save_pretrained(heads_folder)
    for attach in (lambda: setattr(pipe, "draft_heads", heads), lambda: pipe.load_draft_heads(heads_folder)):
        if expected not in (None, "warn"):
            with pytest.raises(ValueError, match=expected):
                attach()
            assert pipe.draft_heads is attached
            continue
        monkeypatch.setattr(heads_utils, "_UNTOLD", set())
        _, messages = _warnings(attach)
        untold = [m for m in messages if "Cannot tell whether these draft heads were made for this backbone" in m]
        assert len(untold) == (1 if expected == "warn" else 0), messages
        assert pipe.draft_heads is not attached
        pipe.draft_heads = attached


def test_a_saved_from_name_the_hub_cache_does_not_know_is_not_a_refusal(saved, tmp_path, monkeypatch):
    """``runs/pipe`` reads like a Hub id; unless this machine's Hub cache holds it, it may be a relative folder: the
    heads are warned about, not refused."""
    from huggingface_hub import constants

    from spatial_pipelines.heads import heads_utils

    monkeypatch.setattr(heads_utils, "_UNTOLD", set())
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    folder = tmp_path / "pipe"
    shutil.copytree(saved / "pipe", folder)
    _edit_json("model_index.json", _name_or_path="runs/pipe")(folder)
    pipe = LlamaGenPipeline.from_pretrained(folder)
    _, messages = _warnings(lambda: setattr(pipe, "draft_heads", _heads(pipe, base_model_name_or_path="org/another-model")))
    assert [m for m in messages if "Cannot tell" in m and "(saved from 'runs/pipe')" in m]
    assert pipe.draft_heads.config.base_model_name_or_path == "org/another-model"


def _other_transformer(**changes):
    torch.manual_seed(1)
    return dummy_llamagen_components(**changes)["transformer"]


SWAP_CASES = [  # (id, the transformer swapped in, what the message names)
    ("larger-grid", dict(grid=(5, 5)), r"grid_height: heads 4 != backbone 5"),
    ("more-codes", dict(num_codes=32), r"num_image_codes: heads 16 != backbone 32"),
]


@pytest.mark.parametrize("changes,names", [c[1:] for c in SWAP_CASES], ids=[c[0] for c in SWAP_CASES])
def test_a_backbone_swapped_under_attached_heads(changes, names, monkeypatch):
    pipe = dummy_pipeline("llamagen", MedusaDecoder(num_heads=2, top_k=2), "random")
    old, new = pipe.transformer, _other_transformer(**changes)
    with pytest.raises(ValueError, match="`transformer`.*" + names):
        pipe.transformer = new  # at attach
    assert pipe.transformer is old
    pipe.__dict__["transformer"] = new  # swapped behind the pipeline's back: the call names it before any work
    monkeypatch.setattr(type(pipe.backbone), "encode_prompt", lambda *a, **k: pytest.fail("work began before the check"))
    with pytest.raises(ValueError, match=names):
        pipe("a fox", output_type="latent")


# -- 3. runaway settings: bounded by what they can cost, before any allocation ---------------------------------------
SETTING_CASES = [  # (id, factory, what the message names)
    ("ssd-rounds", lambda: SSDDecoder(vertical_rounds=10**6), r"`vertical_rounds=1000000`: at most 128"),
    ("ssd-horizontal-rounds", lambda: SSDDecoder(horizontal_rounds=10**4), r"`horizontal_rounds=10000`"),
    ("ssd-staged-rounds", lambda: SSDDecoder(num_vertical_rows=2, staged_base_rounds=10**5), r"`staged_base_rounds=100000`"),
    ("adt-width", lambda: ADTTreeDecoder(width_range=(3, 10**6)), r"`width_range=\[3, 1000000\]`.*draft nodes per round"),
    ("adt-depth", lambda: ADTTreeDecoder(depth_range=(1, 10**6)), r"`depth_range=\[1, 1000000\]`.*draft nodes per round"),
    ("adt-tree", lambda: ADTTreeDecoder(depth_range=(1, 40), width_range=(3, 40)), r"`depth_range=\[1, 40\]` with `width_range=\[3, 40\]`"),
    ("spatial-heads", lambda: SpatialDraftHeads(hidden_size=10**6), r"`hidden_size=1000000`.*SpatialDraftHeads would hold"),
    ("spatial-heads-layers", lambda: SpatialDraftHeads(hidden_size=4096, num_layers=10**5), r"`num_layers=100000`"),
    ("latent-heads", lambda: LatentDraftHeads(hidden_size=64, intermediate_size=10**9), r"`intermediate_size=1000000000`"),
    ("eagle-grid", lambda: EagleDraftHead(hidden_size=64, num_attention_heads=4, grid_height=10**5, grid_width=10**5), r"`grid_height=100000`"),
]


@pytest.mark.parametrize("factory,names", [c[1:] for c in SETTING_CASES], ids=[c[0] for c in SETTING_CASES])
def test_runaway_settings_are_refused_before_allocation(factory, names):
    start = time.perf_counter()
    with pytest.raises(ValueError, match=names):
        factory()
    assert time.perf_counter() - start < 2.0


def test_a_prompt_longer_than_the_context_is_refused_before_tokenizing(monkeypatch):
    pipe = dummy_pipeline("janus")
    limit = pipe.backbone.max_prompt_characters
    assert limit is not None
    monkeypatch.setattr(type(pipe.backbone), "encode_prompt", lambda *a, **k: pytest.fail("the prompt was tokenized"))
    cases = [({"prompt": "fox " * (limit // 4 + 1)}, "`prompt`"), ({"prompt": "fox", "negative_prompt": "x" * (limit + 1)}, "`negative_prompt`")]
    for kwargs, name in cases:
        with pytest.raises(ValueError, match=f"{name} \\[0\\] holds \\d+ characters; this model reads at most {limit}"):
            pipe(output_type="latent", **kwargs)


def test_a_llamagen_caption_is_truncated_unread_past_its_budget():
    pipe = dummy_pipeline("llamagen")
    seen = []
    tokenizer = pipe.tokenizer
    real = type(tokenizer).__call__

    def spy(self, text, *args, **kwargs):
        seen.extend(len(t) for t in ([text] if isinstance(text, str) else text))
        return real(self, text, *args, **kwargs)

    type(tokenizer).__call__ = spy
    try:
        start = time.perf_counter()
        out, messages = _warnings(lambda: pipe("red fox " * 100_000, output_type="latent", generator=torch.Generator().manual_seed(0)))
    finally:
        type(tokenizer).__call__ = real
    assert time.perf_counter() - start < 20
    assert out.tokens.shape == (1, 4, 4)
    assert max(seen) <= 32 * 9  # PROMPT_CHARACTERS_PER_TOKEN x (caption tokens + 1)
    assert any("truncated" in m and "tokens cut" in m and "more characters not read" in m for m in messages)


def test_a_10000_word_prompt_on_the_embedded_model_is_cut_with_a_warning_and_costs_a_caption(monkeypatch):
    """MiniLM reads 512 tokens and the embedded model's captions are 24: a 10,000-word prompt is cut to a caption (the
    rest unread) with the warning, and the call's prompt work costs what a caption's does; transformers' warning about
    sequences longer than the encoder reads is not given (the encoder never sees one)."""
    from spatial_pipelines.embedded import load_default_pipeline

    pipe = load_default_pipeline()
    pipe.set_progress_bar_config(disable=True)
    seen = []
    encoder_forward = type(pipe.text_encoder).forward

    def spy(self, input_ids=None, **kwargs):
        seen.append(tuple(input_ids.shape))
        return encoder_forward(self, input_ids=input_ids, **kwargs)

    monkeypatch.setattr(type(pipe.text_encoder), "forward", spy)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("transformers").addHandler(handler)

    def stop(p, i, t, kwargs):
        p._interrupt = True  # one round is enough: the prompt's work is done before it
        return kwargs

    try:
        start = time.perf_counter()
        out, messages = _warnings(lambda: pipe(" ".join(["a,"] * 10_000), output_type="latent", callback_on_step_end=stop,
                                               generator=torch.Generator().manual_seed(0)))
        elapsed = time.perf_counter() - start
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert elapsed < 20 and out.tokens.shape == (1, 24, 24)
    assert seen and all(shape[1] == 24 for shape in seen)  # the encoder read a caption, never the prompt
    assert any("reads captions of up to 24 tokens" in m and "more characters not read" in m for m in messages)
    assert not [r for r in records if "Token indices sequence length" in r.getMessage()]


def test_a_caption_longer_than_the_text_encoder_reads_is_refused_before_any_work(monkeypatch):
    """A transformer reading 8-token captions with a text encoder whose position table holds 6 (BERT): no caption can
    be encoded, refused before the prompt is tokenized."""
    from transformers import BertConfig, BertModel

    pipe = dummy_pipeline("llamagen")

    def bert(positions):
        return BertModel(BertConfig(vocab_size=len(pipe.tokenizer), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                    intermediate_size=32, max_position_embeddings=positions)).eval()

    pipe.text_encoder = encoder = bert(6)
    monkeypatch.setattr(type(pipe.backbone), "encode_prompt", lambda *a, **k: pytest.fail("the prompt was tokenized"))
    with pytest.raises(ValueError, match=r"`num_condition_tokens`: this LlamaGenTransformer reads captions of 8 tokens, "
                                         r"but the text encoder \(BertModel\) reads at most 6"):
        pipe("a fox", output_type="latent")
    assert pipe.text_encoder is encoder
    monkeypatch.undo()
    pipe.text_encoder = bert(8)  # an encoder with room for a caption: nothing refused
    assert pipe("a fox", output_type="latent", generator=torch.Generator().manual_seed(0)).tokens.shape == (1, 4, 4)


# -- 4. call arguments that diffusers refuses, or whose meaning would depend on the hash seed -------------------------
CALL_CASES = [  # (id, call arguments, what the message names)
    ("prompt-set", {"prompt": {"a fox", "a cat"}}, r"`prompt` must be a list of prompts, got a set: its order \(and so which image is which\) would depend on the hash seed"),
    ("prompt-frozenset", {"prompt": frozenset({"a fox"})}, r"`prompt` must be a list of prompts, got a frozenset"),
    ("prompt-dict-keys", {"prompt": {"a fox": 1}.keys()}, r"`prompt` must be a list of prompts, got a dict_keys"),
    ("negative-prompt-set", {"prompt": ["a fox", "a cat"], "negative_prompt": {"blurry", "dark"}}, r"`negative_prompt` must be a list of prompts, got a set"),
    ("unknown-callback-tensor", {"prompt": "a fox", "callback_on_step_end_tensor_inputs": ["prompt_embeds"]},
     r"`callback_on_step_end_tensor_inputs` has \['prompt_embeds'\]; allowed: \['tokens', 'latents', 'acceptance_map'\]"),
    ("unknown-callback-tensor-with-callback", {"prompt": "a fox", "callback_on_step_end": lambda p, i, t, k: k,
                                               "callback_on_step_end_tensor_inputs": ["noise_pred"]},
     r"`callback_on_step_end_tensor_inputs` has \['noise_pred'\]; allowed: \['tokens', 'latents', 'acceptance_map'\]"),
]


@pytest.mark.parametrize("kwargs,names", [c[1:] for c in CALL_CASES], ids=[c[0] for c in CALL_CASES])
def test_bad_call_arguments_are_refused_before_any_work(kwargs, names, monkeypatch):
    pipe = dummy_pipeline("llamagen")
    monkeypatch.setattr(type(pipe.backbone), "encode_prompt", lambda *a, **k: pytest.fail("work began before the check"))
    with pytest.raises(ValueError, match=names):
        pipe(output_type="latent", guidance_scale=2.0, **kwargs)


def test_latents_is_the_code_grid_a_callback_may_ask_for():
    """``latents`` (diffusers' name) is one of `_callback_tensor_inputs`: the code grid, the same tensor as ``tokens``."""
    pipe = dummy_pipeline("llamagen")
    seen = []
    pipe("a fox", output_type="latent", generator=torch.Generator().manual_seed(0), callback_on_step_end_tensor_inputs=["latents"],
         callback_on_step_end=lambda p, i, t, kwargs: seen.append(sorted(kwargs)) or kwargs)
    assert seen and all(keys == ["latents"] for keys in seen) and "latents" in pipe._callback_tensor_inputs


# -- 5. the command line's output path: checked before the model loads (exit code 2, one line) -----------------------
@pytest.mark.parametrize("out", ["/proc/x.png", "/proc/new-folder/x.png", "{tmp}/file/x.png"], ids=["proc", "proc-subfolder", "under-a-file"])
def test_an_output_path_that_cannot_be_written_is_refused_before_loading(out, tmp_path, capsys, monkeypatch):
    from spatial_pipelines import cli

    (tmp_path / "file").write_text("mine")
    monkeypatch.setattr(cli, "load_pipeline", lambda *a, **k: pytest.fail("the model was loaded"))
    out = out.format(tmp=tmp_path)
    assert cli.main(["generate", "a fox", "--out", out, "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: `--out`") and repr(out) in err, err
    assert not Path(out).parent.exists() or Path(out).parent in (Path("/proc"), tmp_path / "file")


# -- 6. saving onto a file: a ValueError naming the path, nothing written ---------------------------------------------
SAVE_CASES = [  # (id, what is saved)
    ("pipeline", lambda pipe: pipe),
    ("heads", lambda pipe: pipe.draft_heads),
    ("decoder", lambda pipe: pipe.decoder),
    ("transformer", lambda pipe: pipe.transformer),
    ("vqvae", lambda pipe: pipe.vqvae),
]


@pytest.mark.parametrize("part", [c[1] for c in SAVE_CASES], ids=[c[0] for c in SAVE_CASES])
def test_saving_onto_a_file(part, tmp_path):
    obj = part(dummy_pipeline("llamagen", MedusaDecoder(num_heads=2, top_k=2), "random"))
    (tmp_path / "file").write_text("mine")
    before = snapshot(tmp_path)
    for target, names in ((tmp_path / "file", r"`save_directory` '.*file' is a file"),
                          (tmp_path / "file" / "sub", r"`save_directory` '.*file/sub' lies under '.*file', which is a file")):
        with pytest.raises(ValueError, match=names):
            obj.save_pretrained(target)
        assert snapshot(tmp_path) == before
        assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]
