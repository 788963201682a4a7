"""scripts/gpu_check.py: on a machine without CUDA it runs its dry run (tiny models, the dynamo-only backend): every
step and file of the real check, in seconds."""

import json

from helpers import run_script


def test_gpu_check_dry_run_writes_its_report(tmp_path):
    out = tmp_path / "check"
    run_script("gpu_check.py", "--out", str(out), "--num-images-per-prompt", "1", "2")
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json", "gpu_check.md", "roofline.png", "speed.png"]
    assert all(p.stat().st_size < 16 * 2**20 for p in out.iterdir())
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["dry_run"] and report["compile_backend"] == "eager" and report["roofline"]["presets"]["tiny"]["verify"]
    for model in ("embedded", "janus-pro-1b-layout"):
        rows = report["decoding"][model]["rows"]
        assert len(rows) == 3 * 2 * 2  # ar, sjd, medusa x (1, 2 images) x (eager, compiled)
        for key, r in rows.items():
            assert r["images_per_s"] > 0 and r["target_passes_per_image"] > 0 and r["speedup_vs_same_ar"] > 0
            if r["compiled"]:
                assert r["graphs_compiled_while_timed"] == 0 and r["padded_fraction"] is not None
        assert rows["ar x2 [compiled]"]["speedup_vs_same_ar"] == 1.0
    assert "janus-pro-1b-layout" in (out / "gpu_check.md").read_text()
