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
        breakdown = report["decoding"][model]["breakdown"]  # where a round's time goes, eager and compiled
        assert sorted(breakdown) == sorted(f"{d}{m}" for d in ("ar", "sjd", "medusa") for m in ("", " [compiled]"))
        for key, b in breakdown.items():
            assert b["rounds"] > 0 and b["ms_per_round"]["round"] >= b["ms_per_round"]["forward"] > 0
            if "[compiled]" not in key:  # ops are counted on eager rounds; AR reads the host less than once a round
                assert b["ops_per_round"] > 50 and b["host_reads_per_round"] >= 0
        assert breakdown["ar"]["host_reads_per_round"] < 1
    assert "janus-pro-1b-layout" in (out / "gpu_check.md").read_text()


def test_saved_captions_stand_in_for_the_text_encoder(tmp_path):
    """`--save-captions` then `--captions`: the embedded pipeline built on the stored caption features encodes the
    check's prompts exactly as MiniLM does, and refuses a prompt it holds no caption for."""
    import importlib.util

    import pytest
    import torch

    from spatial_pipelines.embedded import load_default_pipeline

    run_script("gpu_check.py", "--save-captions", str(tmp_path / "captions"))
    assert sum(p.stat().st_size for p in (tmp_path / "captions").iterdir()) < 2**20
    spec = importlib.util.spec_from_file_location("gpu_check", "scripts/gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    stored = gpu_check.embedded_pipeline(torch.device("cpu"), torch.float32, str(tmp_path / "captions"))
    real = load_default_pipeline()
    prompts = gpu_check.PROMPTS[::3]
    a = real.backbone.encode_prompt(prompts, None, True, torch.device("cpu"))
    b = stored.backbone.encode_prompt(prompts, None, True, torch.device("cpu"))
    assert torch.equal(a.embeds, b.embeds) and torch.equal(a.valid, b.valid)
    with pytest.raises(KeyError, match="no caption"):
        stored.backbone.encode_prompt(["a prompt it never saw"], None, True, torch.device("cpu"))


def test_gpu_check_compiled_rows_only(tmp_path):
    """``--skip-eager --skip-roofline --models``: only the compiled rows of the named model, compared with compiled
    AR (no eager AR to compare with: "-" in the table)."""
    out = tmp_path / "check"
    run_script("gpu_check.py", "--out", str(out), "--num-images-per-prompt", "1", "--skip-eager", "--skip-roofline",
               "--models", "janus-pro-1b-layout")
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["roofline"] is None and list(report["decoding"]) == ["janus-pro-1b-layout"]
    rows = report["decoding"]["janus-pro-1b-layout"]["rows"]
    assert sorted(rows) == ["ar x1 [compiled]", "medusa x1 [compiled]", "sjd x1 [compiled]"]
    assert all(r["speedup_vs_eager_ar"] is None and r["speedup_vs_same_ar"] > 0 for r in rows.values())
    assert "| - |" in (out / "gpu_check.md").read_text()
