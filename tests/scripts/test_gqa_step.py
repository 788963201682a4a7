"""scripts/gqa_step.py: every variant of both levels timed, the grouped ones checked against transformers' sdpa, and
the report (device, versions, command, settings, ms per step)."""

import json

from helpers import run_script


def test_every_variant_is_timed_and_reported(tmp_path):
    done = run_script("gqa_step.py", "--heads", "4", "--kv-heads", "2", "--head-dim", "8", "--hidden-size", "16",
                      "--intermediate-size", "32", "--layers", "1", "--cache-length", "12", "--rows", "2", "--fed", "1", "3",
                      "--repeats", "1", "--inner", "1", "--threads", "1", "--out", str(tmp_path))
    report = json.loads((tmp_path / "gqa_step.json").read_text())
    assert report["device"].startswith("cpu") and report["versions"]["torch"] and report["versions"]["transformers"]
    assert report["command"].startswith("gqa_step.py --heads 4") and report["settings"]["cache_length"] == 12
    cases = {(r["level"], r["mode"], r["fed"], r["variant"]) for r in report["results"]}
    assert cases == {(level, "eager", fed, v) for fed in (1, 3) for level, variants in
                     (("attention", ("grouped", "folded", "sdpa", "mha")), ("trunk", ("gqa", "gqa-sdpa", "mha", "mha-same-weights")))
                     for v in variants}
    assert all(0 < r["min_ms"] <= r["median_ms"] <= r["max_ms"] for r in report["results"])
    assert "| trunk | eager | 2 | 3 | gqa |" in done.stdout


def test_heads_must_be_grouped(tmp_path):
    done = run_script("gqa_step.py", "--heads", "4", "--kv-heads", "4", "--out", str(tmp_path), check=False)
    assert done.returncode == 2 and "--heads must be a multiple" in done.stderr
