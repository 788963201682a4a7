"""scripts/round_counts.py: host reads, eager ops and compiles per round, per decoder, eager and compiled, on a saved
pipeline (dynamo's eager backend: its guards and graphs without inductor's compile time)."""

import json

from spatial_pipelines.testing import dummy_pipeline

from helpers import run_script


def test_rows_for_every_decoder_mode_and_batch(tmp_path):
    dummy_pipeline("llamagen", grid=(4, 4)).save_pretrained(tmp_path / "model")
    run_script("round_counts.py", "--model", str(tmp_path / "model"), "--heads", "--decoders", "ar", "sjd", "--images", "1", "2",
               "--backend", "eager", "--threads", "1", "--out", str(tmp_path / "out"))
    report = json.loads((tmp_path / "out" / "round_counts.json").read_text())
    rows = report["rows"]
    assert {(r["decoder"], r["mode"], r["images"]) for r in rows} == {
        (d, m, n) for d in ("ar", "sjd") for m in ("eager", "compiled") for n in (1, 2)}
    for r in rows:
        assert r["rounds"] > 0 and r["eager_ops_per_round"] > 0 and r["host_reads_per_round"] >= 0
        assert (r["compiled_calls_per_round"] == 1.0) == (r["mode"] == "compiled")  # one graph call per compiled round
        assert r["mode"] == "eager" or r["recompiles"] == 0  # the warm-up generation compiled what the counted one runs
    assert report["versions"]["torch"] and (tmp_path / "out" / "round_counts.md").read_text().count("\n") == 2 + len(rows)
