"""scripts/train_embedded.py end to end at a tiny scale: the data a GPU machine needs written here, the whole run
(transformer, generated grids, every heads kind) on the CPU, its packed parts within the device tool's limits, and
the folders unpacked and loaded."""

import json

import pytest
import torch
from safetensors.torch import load_file

from spatial_pipelines import EagleDraftHead, LatentDraftHeads, LlamaGenTransformer, SpatialDraftHeads
from spatial_pipelines.embedded import load_default_pipeline

from helpers import load_script, run_script

te = load_script("train_embedded.py")
TINY = ["--hidden-size", 32, "--num-layers", 1, "--num-heads", 2, "--batch-size", 4, "--ar-steps", 3, "--snapshot-every", 2,
        "--generated", 3, "--generate-batch", 2, "--heads-steps", 2, "--heads-batch-size", 2, "--mixed-precision", "no"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("train_data")
    run_script("train_embedded.py", "--prepare", folder, "--limit", 6)
    return folder


def test_prepared_captions_are_what_minilm_gives(data):
    """The packed features, fed back through `CaptionTable`, give the pipeline the caption embeddings MiniLM gives
    (fp16 storage the only difference), and the codes are the shipped tokenizer's."""
    loaded = te.load_data(str(data), torch.device("cpu"))
    assert loaded["codes"].shape == (6, 576) and len(loaded["texts"]) == 6
    pipe = load_default_pipeline()
    emb, mask = pipe.backbone.encode_text(loaded["texts"], torch.device("cpu"))
    assert torch.equal(mask, loaded["masks"]) and (emb - loaded["captions"]).abs().max() < 5e-3
    table = load_default_pipeline(text_encoder=loaded["text_encoder"], tokenizer=loaded["tokenizer"])
    emb2, mask2 = table.backbone.encode_text(loaded["texts"], torch.device("cpu"))
    assert torch.equal(mask2, mask) and (emb2 - emb).abs().max() < 5e-3
    with pytest.raises(KeyError):  # a caption it does not hold is refused, not replaced
        table.backbone.encode_text(["a caption not in the set"], torch.device("cpu"))


def test_the_whole_run_packs_loadable_folders(data, tmp_path):
    out, work, into = tmp_path / "out", tmp_path / "work", tmp_path / "unpacked"
    run_script("train_embedded.py", "--data", data, "--out", out, "--work", work, *TINY)
    parts = sorted(out.iterdir())
    assert parts and all(p.name.startswith("train_embedded.tar.") and p.stat().st_size <= te.PART_BYTES for p in parts)
    run_script("train_embedded.py", "--unpack", out, "--into", into)
    report = json.loads((into / "train_embedded.json").read_text())
    assert report["ar"]["steps"] == 3 and report["transformer_step"] == 3 and report["generated"]["grids"] == 3
    assert all(report[f"heads_{k}"]["steps"] == 2 for k in te.HEADS)
    transformer = LlamaGenTransformer.from_pretrained(into / "transformer")
    stored = load_file(into / "transformer" / "diffusion_pytorch_model.safetensors")
    assert {t.dtype for t in stored.values()} == {torch.bfloat16} and transformer.config.hidden_size == 32
    assert (transformer.config.default_guidance_scale, transformer.config.default_top_k) == (1.0, 3)
    for kind, cls in (("hawk", SpatialDraftHeads), ("ssd", LatentDraftHeads), ("eagle", EagleDraftHead)):
        heads = cls.from_pretrained(into / f"heads_{kind}" / "heads")
        assert heads.config.hidden_size == 32 and (into / f"heads_{kind}" / "loss_curve.png").is_file()


def test_pack_splits_and_unpack_joins(tmp_path, monkeypatch):
    work, out = tmp_path / "work", tmp_path / "out"
    (work / "folder").mkdir(parents=True)
    payload = torch.randint(256, (5000,), dtype=torch.uint8).numpy().tobytes()
    (work / "folder" / "blob.bin").write_bytes(payload)
    monkeypatch.setattr(te, "PART_BYTES", 2048)
    parts = te.pack(str(work), str(out), ["folder", "missing"])
    assert len(parts) >= 3 and all((out / p.split("/")[-1]).stat().st_size <= 2048 for p in parts)
    te.pack(str(work), str(out), ["folder"])  # a later pack replaces the parts, leaving none of the old ones
    assert sorted(p.name for p in out.iterdir()) == sorted(p.split("/")[-1] for p in parts)
    te.unpack(str(out), str(tmp_path / "back"))
    assert (tmp_path / "back" / "folder" / "blob.bin").read_bytes() == payload
    with pytest.raises(ValueError, match="--unpack"):
        te.unpack(str(tmp_path / "work"), str(tmp_path / "x"))


@pytest.mark.parametrize("option, value", [("--ar-seconds", "nan"), ("--heads-seconds", "0"), ("--lr", "inf"),
                                           ("--generated", "0"), ("--ema-decay", "1")])
def test_bad_options_are_refused(option, value, capsys):
    with pytest.raises(SystemExit):
        te.parse_args(["--data", "x", option, value])
    assert option in capsys.readouterr().err
