"""scripts/check_auto_sizes.py: fresh processes tune draft sizes (`tune_decoder`) at several batch sizes on a saved
pipeline and the report says whether they agreed (the choice itself depends on the machine's timings, so only its
form is asserted)."""

import json

from spatial_pipelines.decoders import MedusaDecoder
from spatial_pipelines.testing import dummy_pipeline, random_draft_heads

from helpers import run_script


def test_fresh_processes_report_their_choices(tmp_path):
    pipe = dummy_pipeline("llamagen", grid=(4, 4))
    pipe.save_pretrained(tmp_path / "model")
    random_draft_heads(pipe, MedusaDecoder()).save_pretrained(tmp_path / "heads")
    run_script("check_auto_sizes.py", "--model", str(tmp_path / "model"), "--heads", str(tmp_path / "heads"), "--processes", "2",
               "--decoders", "sjd", "medusa", "--images", "1", "2", "--threads", "1", "--sweeps", "2",
               "--out", str(tmp_path / "out"))
    report = json.loads((tmp_path / "out" / "auto_sizes.json").read_text())
    assert len(report["processes"]) == 2 and set(report["agreed"]) == {"sjd", "medusa"}
    assert all(set(agreed) == {"1", "2"} for agreed in report["agreed"].values())
    for run in report["processes"]:
        assert all(set(sizes) == {"1", "2"} and all(isinstance(n, int) and n >= 1 for n in sizes.values()) for sizes in run["chosen"].values())
        assert run["pass_cost_ms"] and all(ms > 0 for ms in run["pass_cost_ms"].values())
        assert run["fitted_pass_cost_ms"]["base"] >= 0 and run["fitted_pass_cost_ms"]["slope"] >= 0
        # each decoder's whole round was timed on real rounds of the engine, per candidate tree
        assert set(run["round_ms"]) == {"sjd", "medusa"} and all(ms > 0 for ms in run["round_ms"]["medusa"].values())
