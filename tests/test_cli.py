import PIL.Image
import pytest

from spatial_pipelines.cli import main
from spatial_pipelines.testing import dummy_pipeline


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "pipe"
    dummy_pipeline("llamagen").save_pretrained(path)
    return path


def test_generate_writes_png_and_reports(model_dir, tmp_path, capsys):
    out = tmp_path / "fox.png"
    assert main(["generate", "a red fox", "--model", str(model_dir), "--decoder", "ar", "--out", str(out), "--seed", "3"]) == 0
    assert PIL.Image.open(out).size == (8, 8)
    printed = capsys.readouterr()
    assert "16 target forward passes" in printed.out and "s wall-clock" in printed.out
    assert "16/16" in printed.err  # the progress bar


def test_generate_grid_and_same_seed(model_dir, tmp_path):
    a, b = tmp_path / "a.png", tmp_path / "b.png"
    for path in (a, b):
        assert main(["generate", "fox", "--model", str(model_dir), "--out", str(path), "--num-images", "3", "--temperature", "0.7"]) == 0
    assert PIL.Image.open(a).size == (16, 16)  # 3 images on a 2x2 grid
    assert a.read_bytes() == b.read_bytes()


def test_generate_reports_bad_input(model_dir, tmp_path, capsys):
    assert main(["generate", "fox", "--model", str(model_dir), "--out", str(tmp_path / "x.png"), "--top-p", "2"]) == 2
    assert "--top-p" in capsys.readouterr().err
    assert main(["generate", "fox", "--model", str(tmp_path / "nothing"), "--out", str(tmp_path / "x.png")]) == 2
    assert "nothing' is not an existing folder" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["generate", "fox", "--model", str(tmp_path / "empty"), "--out", str(tmp_path / "x.png")]) == 2
    assert "model_index.json" in capsys.readouterr().err


def test_generate_with_a_decoder_that_needs_heads(model_dir, tmp_path, capsys):
    from spatial_pipelines import LatentDraftHeads, LlamaGenPipeline, SSDDecoder

    pipe = LlamaGenPipeline.from_pretrained(model_dir)
    LatentDraftHeads.for_backbone(pipe.backbone, SSDDecoder()).save_pretrained(tmp_path / "heads")
    out = tmp_path / "ssd.png"
    assert main(["generate", "fox", "--model", str(model_dir), "--decoder", "ssd", "--out", str(out)]) == 2
    assert "LatentDraftHeads" in capsys.readouterr().err  # no heads: a clear error, not a crash
    assert main(["generate", "fox", "--model", str(model_dir), "--decoder", "ssd", "--heads", str(tmp_path / "heads"), "--out", str(out)]) == 0
    assert "decoder ssd | 12 target forward passes" in capsys.readouterr().out  # 4x4: 1 + 2 + 3 rows x (2 + 1)
