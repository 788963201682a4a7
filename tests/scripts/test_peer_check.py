"""scripts/peer_check.py: on a machine without CUDA its dry run builds the tiny Janus layout and times transformers'
own image ``generate`` beside our AR and SJD, with every column, the greedy check and both files."""

import json

import pytest
from helpers import run_script

COLUMNS = ("seconds_per_image", "passes_per_call", "codes_per_pass", "ms_per_pass", "peak_mib", "speedup_vs_peer",
           "pass_cost_in_ar_steps")


def test_peer_check_dry_run_writes_its_report(tmp_path):
    out = tmp_path / "peer"
    run_script("peer_check.py", "--out", str(out), "--dry-run", "--skip-compiled", "--greedy-check", "--num-prompts", "1",
               "--num-images-per-prompt", "1", "2")
    assert sorted(p.name for p in out.iterdir()) == ["peer_check.json", "peer_check.md"]
    report = json.loads((out / "peer_check.json").read_text())
    assert report["dtype"] == "float32" and report["versions"]["transformers"] and not report["skipped"]
    block = report["layouts"]["janus-tiny"]
    # the peer (transformers' generate) and our AR loop emit the same greedy codes
    assert block["greedy"]["equal"] and block["greedy"]["codes"] == 16
    for n in ("1", "2"):
        rows = block["rows"][n]
        assert list(rows) == ["peer", "ar", "sjd"]
        for name, row in rows.items():
            assert all(row[c] is not None for c in COLUMNS if c != "pass_cost_in_ar_steps" or name != "peer"), name
        assert rows["peer"]["passes_per_call"] == 16 and rows["peer"]["speedup_vs_peer"] == 1.0
        assert rows["ar"]["passes_per_call"] == 16 and rows["ar"]["codes_per_pass"] == 1.0
        assert rows["sjd"]["passes_per_call"] <= 16 and rows["ar"]["pass_cost_in_ar_steps"] == 1.0
    table = (out / "peer_check.md").read_text()
    assert "| peer | 1 |" in table and "| sjd | 2 |" in table


@pytest.mark.parametrize("argv, message", [
    (["--num-prompts", "0"], "--num-prompts values must be >= 1"),
    (["--budget-s", "nan"], "--budget-s must be a positive number"),
    (["--skip-eager", "--skip-compiled"], "leave none of our rows"),
])
def test_peer_check_refuses_bad_arguments(tmp_path, argv, message):
    result = run_script("peer_check.py", "--out", str(tmp_path / "x"), "--dry-run", *argv, check=False)
    assert result.returncode == 2 and message in result.stderr
