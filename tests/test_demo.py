"""The demo's logic without a browser: request checks, AR against every registered decoder on the same seeds, the
acceptance picture, the command's options and its message when Gradio is missing."""

import sys

import numpy as np
import pytest
import torch

from spatial_pipelines import demo
from spatial_pipelines.cli import main
from spatial_pipelines.decoders import DECODERS

from helpers import tiny_pipeline_with_every_heads


@pytest.fixture(scope="module")
def pipe_and_heads():
    """A tiny pipeline and random heads of every kind a registered decoder drafts with."""
    return tiny_pipeline_with_every_heads()


def test_choices_are_the_registry_but_ar():
    choices = demo.decoder_choices()
    assert sorted(name for _, name in choices) == sorted(n for n in DECODERS if n != "ar")
    labels = dict((name, label) for label, name in choices)
    assert labels["sjd"].startswith("sjd (exact): ") and labels["ssd"].startswith("ssd (lossy): ")
    assert [name for _, name in choices].index("ssd") == len(choices) - 1  # exact ones first


@pytest.mark.parametrize("request_args, message", [
    (("", "sjd", 0, 1), "`prompt` is empty"),
    (("   ", "sjd", 0, 1), "`prompt` is empty"),
    (("fox", "sjd", 0, 5), "`images per prompt` must be an int in [1, 4]"),
    (("fox", "sjd", 0, 0), "`images per prompt` must be an int in [1, 4]"),
    (("fox", "sjd", -1, 1), "`seed` must be an int"),
    (("fox", "sjd", 0.5, 1), "`seed` must be an int"),
    (("fox", "ar", 0, 1), "`decoder` must be one of"),
    (("fox", "nope", 0, 1), "`decoder` must be one of"),
])
def test_bad_requests_are_named(request_args, message):
    with pytest.raises(ValueError) as err:
        demo.check_request(*request_args, max_images=4)
    assert message in str(err.value)


def test_a_good_request_comes_back_with_ints():
    assert demo.check_request(" fox ", "sjd", 3.0, 2.0, max_images=4) == ("fox", "sjd", 3, 2)


def test_every_decoder_against_ar(pipe_and_heads):
    pipe, heads = pipe_and_heads
    for _, name in demo.decoder_choices():
        result = demo.compare_decoders(pipe, heads, "fox", name, seed=3, num_images=2)
        assert len(result.ar.images) == len(result.decoder.images) == 2
        assert result.ar.stats.num_forward_passes == 16  # 4x4 codes, one per pass
        assert result.decoder.stats.acceptance_map.shape == (2, 4, 4)
        if DECODERS[name]().is_exact:  # keyed noise: AR's images
            assert result.identical and result.verdict.startswith("Identical"), (name, result.verdict)
        else:
            assert not result.identical and result.verdict.startswith(f"Different: {name} (lossy)"), result.verdict
        assert type(pipe.decoder).short_name == "ar" and pipe.draft_heads is None  # left as it was
        table = demo.stats_table(result)
        assert f"| {name} |" in table and "codes per pass" in table and "x |" in table


def test_missing_heads_fail_before_ar_runs(pipe_and_heads):
    pipe, _ = pipe_and_heads
    calls = []
    with pytest.raises(ValueError, match="decoder 'medusa' drafts with .*--heads FOLDER"):
        demo.compare_decoders(pipe, {}, "fox", "medusa", 0, 1, progress=lambda f, d: calls.append(d))
    assert calls == [] and type(pipe.decoder).short_name == "ar"


def test_acceptance_picture_colours_each_code_by_its_pass():
    grid = torch.tensor([[[1, 3], [3, 5]]])
    picture = np.asarray(demo.acceptance_picture(grid, size=64))
    # each code is a square of 32 pixels (2 of border around the grid)
    assert tuple(picture[2 + 16, 2 + 16]) == demo.PALETTE[0]  # one code per pass: the darkest colour
    assert tuple(picture[2 + 48, 2 + 48]) == demo.PALETTE[-1]  # the longest run: the brightest
    assert tuple(picture[2 + 16, 2 + 48]) == demo.PALETTE[2]  # 3 of 1..5: the middle
    assert picture.shape[1] == 68 and picture.shape[0] > 68  # the colour bar under the grid
    two = demo.acceptance_picture(torch.ones(2, 3, 3, dtype=torch.long), size=30)
    assert two.width == 2 * (30 + 4)  # two grids side by side, each with its border
    with pytest.raises(ValueError, match="acceptance_map"):
        demo.acceptance_picture(torch.ones(3, 3, dtype=torch.long))


def test_demo_options_are_checked_before_the_model_loads(capsys):
    assert main(["demo", "--port", "70000"]) == 2
    assert "`--port` must be an int in [0, 65535]" in capsys.readouterr().err
    assert demo.main(["--max-images", "0"]) == 2
    assert "`--max-images`" in capsys.readouterr().err


def test_without_gradio_the_command_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "gradio", None)  # `import gradio` raises ImportError
    assert main(["demo"]) == 1
    err = capsys.readouterr().err
    assert "needs Gradio" in err and 'pip install -e ".[demo]"' in err


def test_importing_the_package_does_not_import_gradio():
    code = "import sys, spatial_pipelines, spatial_pipelines.demo, spatial_pipelines.cli; assert 'gradio' not in sys.modules"
    import subprocess

    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0
