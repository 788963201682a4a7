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
    EagleDraftHead,
    LatentDraftHeads,
    LlamaGenPipeline,
    MedusaDecoder,
    SpatialDraftHeads,
    SSDDecoder,
)
from spatial_pipelines.heads import DraftHeadsMixin
from spatial_pipelines.testing import dummy_llamagen_components, dummy_pipeline


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


def test_heads_made_for_the_same_base_model_are_accepted():
    pipe = dummy_pipeline("llamagen", MedusaDecoder(num_heads=2, top_k=2))
    pipe.register_to_config(_name_or_path="org/tiny")
    pipe.draft_heads = _heads(pipe, base_model_name_or_path="org/tiny")
    pipe.draft_heads = _heads(pipe, base_model_name_or_path="/a/folder/of/another/machine")  # cannot be told: accepted
    pipe.register_to_config(_name_or_path=None)
    pipe.draft_heads = _heads(pipe, base_model_name_or_path="org/another-model")  # a pipeline built in memory


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


# -- 4. saving onto a file: a ValueError naming the path, nothing written ---------------------------------------------
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
