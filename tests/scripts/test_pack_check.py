"""scripts/pack_check.py: every shape timed as stored and on each packed kernel, the timed choice, and the report (device, versions, command, settings,
milliseconds per pass)."""

import json

import pytest

from helpers import run_script
from spatial_pipelines.pipelines.packed_weights import available_kernels

pytestmark = pytest.mark.skipif(not available_kernels(), reason="the packed GEMMs are MKL's and oneDNN's")


def test_every_shape_is_timed_both_ways_and_reported(tmp_path):
    done = run_script("pack_check.py", "--shapes", "1x3", "2x5", "--repeats", "1", "--threads", "1", "--out", str(tmp_path))
    report = json.loads((tmp_path / "pack_check.json").read_text())
    assert report["device"].startswith("cpu") and report["versions"]["torch"] and report["dtype"] == "float32"
    assert report["command"].startswith("pack_check.py --shapes 1x3 2x5") and report["linear_layers"] > 0
    assert [(r["rows"], r["fed"]) for r in report["shapes"]] == [(1, 3), (2, 5)]
    assert all(r["ms_as_stored"] > 0 and all(r[f"ms_{k}"] > 0 for k in available_kernels()) for r in report["shapes"])
    assert all(r["chosen"] in ["as stored"] + available_kernels() for r in report["shapes"])
    assert "| 2 x 5 |" in done.stdout


@pytest.mark.parametrize("argv,message", [(["--shapes", "2by9"], "a shape is ROWSxFED"),
                                          (["--shapes", "0x9"], "a shape is ROWSxFED"),
                                          (["--repeats", "0"], "--repeats must be at least 1")])
def test_bad_arguments_are_refused(tmp_path, argv, message):
    done = run_script("pack_check.py", *argv, "--out", str(tmp_path), check=False)
    assert done.returncode == 2 and message in done.stderr
