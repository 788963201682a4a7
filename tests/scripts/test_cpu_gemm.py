"""scripts/cpu_gemm.py: both variants timed for every shape and row count (checked equal first), and the report
(device, versions, command, settings, microseconds per call)."""

import json

import pytest
import torch

from helpers import run_script

pytestmark = pytest.mark.skipif(not torch._C.has_mkl, reason="the packed GEMM is MKL's")


def test_every_shape_and_row_count_is_timed_and_reported(tmp_path):
    done = run_script("cpu_gemm.py", "--shapes", "8x12", "16x8", "--rows", "1", "5", "--repeats", "1", "--inner", "2",
                      "--threads", "1", "--out", str(tmp_path))
    report = json.loads((tmp_path / "cpu_gemm.json").read_text())
    assert report["device"].startswith("cpu") and report["versions"]["torch"] and report["dtype"] == "float32"
    assert report["command"].startswith("cpu_gemm.py --shapes 8x12") and report["shapes"] == [[8, 12], [16, 8]]
    cases = {(r["in"], r["out"], r["rows"], r["variant"]) for r in report["results"]}
    assert cases == {(k, n, m, v) for k, n in ((8, 12), (16, 8)) for m in (1, 5) for v in ("unpacked", "packed")}
    assert all(0 < r["min_us"] <= r["median_us"] <= r["max_us"] for r in report["results"])
    assert "| 16x8 | 5 |" in done.stdout


@pytest.mark.parametrize("argv,message", [(["--shapes", "8by12"], "--shapes must be INxOUT"),
                                          (["--shapes", "8x0"], "--shapes must be INxOUT pairs of ints >= 1"),
                                          (["--rows", "0"], "--rows, --repeats and --inner must be >= 1")])
def test_bad_arguments_are_refused(tmp_path, argv, message):
    done = run_script("cpu_gemm.py", *argv, "--out", str(tmp_path), check=False)
    assert done.returncode == 2 and message in done.stderr
