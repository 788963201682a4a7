"""scripts/gpu_check.py: on a machine without CUDA it runs its dry run (tiny models, the dynamo-only backend): every
step, decoder, column and file of the real check, in seconds."""

import json

from helpers import run_script


#: every exact decoder the embedded model runs: each must have its rows
DECODERS = ("ar", "sjd", "medusa", "eagle", "hawk", "adt")
#: the JSON keys and markdown column titles of every row
COLUMNS = {"ms_per_round": "ms / round", "ms_per_ar_step": "ms / AR step", "round_cost_in_ar_steps": "round cost (AR steps)",
           "eager_ops_per_round": "eager ops / round", "host_reads_per_round": "host reads / round",
           "recompiles_while_timed": "recompiles while timed", "codes_per_pass": "codes / pass"}


def test_gpu_check_dry_run_writes_its_report(tmp_path):
    """Every exact decoder at 2 images, compiled then eager (AR, SJD and Medusa's compiled rows first), each row with
    its round cost against AR's step and its counted eager ops and host reads, in the JSON and the table. (One batch
    size: each compiles its own graphs, and the rows of another size run the same steps.)"""
    out = tmp_path / "check"
    run_script("gpu_check.py", "--out", str(out), "--num-images-per-prompt", "2", "--models", "embedded", "--num-prompts", "1")
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json", "gpu_check.md", "roofline.png", "speed.png"]
    assert all(p.stat().st_size < 16 * 2**20 for p in out.iterdir())
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["dry_run"] and report["compile_backend"] == "eager" and report["roofline"]["presets"]["tiny"]["verify"]
    assert set(report["decoders"]) == set(DECODERS)
    section = report["decoding"]["embedded"]
    rows = section["rows"]
    expected = [f"{d} x2{m}" for m in (" [compiled]", "") for d in report["decoders"]]
    assert list(rows) == expected and not section["skipped_rows"]  # in the order they ran
    assert expected[:3] == [f"{d} x2 [compiled]" for d in ("ar", "sjd", "medusa")]
    assert set(section["heads"]) == {"medusa", "hawk", "eagle", "adt"}  # random heads of each decoder's kind
    for key, r in rows.items():
        assert all(r[c] is not None for c in COLUMNS), key
        assert r["ms_per_round"] > 0 and r["images_per_s"] > 0 and r["codes_per_pass"] >= 1 and r["host_reads_per_round"] >= 0
        assert r["counted"]["rounds"] >= report["counted_rounds"] and r["recompiles_while_timed"] == 0
        ar = rows[f"ar x{r['images_per_prompt']}" + (" [compiled]" if r["compiled"] else "")]
        assert r["ms_per_ar_step"] == ar["ms_per_round"] and abs(r["round_cost_in_ar_steps"] * ar["ms_per_round"] - r["ms_per_round"]) < 1e-9
        if r["compiled"]:  # the model runs inside the graph: fewer ops outside it than in the eager round
            assert r["padded_fraction"] is not None and r["eager_ops_per_round"] < rows[key.removesuffix(" [compiled]")]["eager_ops_per_round"]
        else:
            assert r["eager_ops_per_round"] > 50
    assert rows["ar x2 [compiled]"]["round_cost_in_ar_steps"] == 1.0 and rows["ar x2"]["host_reads_per_round"] < 1
    breakdown = section["breakdown"]  # where a round's time goes, eager and compiled
    assert sorted(breakdown) == sorted(f"{d}{m}" for d in DECODERS for m in ("", " [compiled]"))
    for key, b in breakdown.items():  # a compiled round is one graph, timed whole; an eager one in its parts too
        part = "sync" if key.endswith("[compiled]") else "forward"
        assert b["rounds"] > 0 and b["ms_per_round"]["round"] >= b["ms_per_round"][part] > 0
    table = (out / "gpu_check.md").read_text()
    header = next(line for line in table.splitlines() if line.startswith("| row |"))
    assert all(f"| {title} |" in header for title in COLUMNS.values())
    assert all(f"| `{key}` |" in table for key in rows) and all(f"| `{key}` |" in table for key in breakdown)


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
               "--skip-breakdown", "--models", "janus-pro-1b-layout", "--decoders", "ar", "sjd", "medusa")
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["roofline"] is None and list(report["decoding"]) == ["janus-pro-1b-layout"]
    section = report["decoding"]["janus-pro-1b-layout"]
    rows = section["rows"]
    assert list(rows) == ["ar x1 [compiled]", "sjd x1 [compiled]", "medusa x1 [compiled]"] and not section["breakdown"]
    assert all(r["speedup_vs_eager_ar"] is None and r["speedup_vs_same_ar"] > 0 and r["round_cost_in_ar_steps"] > 0 for r in rows.values())
    table = (out / "gpu_check.md").read_text()
    assert "| - |" in table and "only the cost of a round" in table  # random heads: said so


def test_the_cpu_check_is_the_real_check_on_the_embedded_model():
    """``--cpu``: the embedded model (not the tiny ones) in fp32 with inductor, no roofline and no 1B-class backbone;
    it is not a dry run, and it refuses ``--dry-run`` beside it."""
    import importlib.util

    import pytest
    import torch

    spec = importlib.util.spec_from_file_location("gpu_check", "scripts/gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    args = gpu_check.parse_args(["--out", "x", "--cpu"])
    assert args.device.type == "cpu" and not args.dry_run and args.dtype == torch.float32
    assert args.compile_backend == "inductor" and args.skip_roofline and args.models == ["embedded"]
    assert args.counted_rounds == 32
    assert gpu_check.parse_args(["--out", "x"]).models == list(gpu_check.MODELS)
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--out", "x", "--cpu", "--dry-run"])


def test_a_row_that_raises_is_recorded_and_the_check_goes_on(tmp_path, monkeypatch):
    """Device time is scarce: one broken row is named with the end of its traceback, and the rows after it still run."""
    from helpers import load_script

    check = load_script("gpu_check.py")
    real_row = check.run_row

    def broken_sjd(rows, compiled, name, n):
        if name == "sjd":
            raise RuntimeError("CUDA graph capture failed")
        return real_row(rows, compiled, name, n)

    monkeypatch.setattr(check, "run_row", broken_sjd)
    out = tmp_path / "check"
    report = check.main(["--out", str(out), "--decoders", "ar", "sjd", "medusa", "--num-images-per-prompt", "1",
                         "--models", "embedded", "--num-prompts", "1", "--skip-roofline", "--skip-eager", "--skip-breakdown"])
    section = report["decoding"]["embedded"]
    assert list(section["rows"]) == ["ar x1 [compiled]", "medusa x1 [compiled]"]
    assert "CUDA graph capture failed" in section["failed_rows"]["sjd x1 [compiled]"]
    assert "failed: `sjd x1 [compiled]`" in (out / "gpu_check.md").read_text()
    assert json.loads((out / "gpu_check.json").read_text())["decoding"]["embedded"]["failed_rows"]


def test_the_sync_cadence_is_measured_per_k(tmp_path):
    """``--rounds-per-sync``: SJD at each K, with its host reads per round (one per round at K = 1; the tiny grid is
    done in a few rounds, so a larger K reads no less often here: `tests/pipelines/test_generation.py` checks the
    cadence) and its ms per round, in the JSON and the table."""
    from helpers import load_script

    check = load_script("gpu_check.py")
    out = tmp_path / "check"
    report = check.main(["--out", str(out), "--decoders", "ar", "--num-images-per-prompt", "1", "--models", "embedded",
                         "--num-prompts", "1", "--skip-roofline", "--skip-eager", "--skip-breakdown", "--rounds-per-sync", "1", "8"])
    cadence = report["decoding"]["embedded"]["sync_cadence"]
    assert list(cadence) == ["sjd x1 K=1 [compiled]", "sjd x1 K=8 [compiled]"]
    one, eight = cadence.values()
    assert one["host_reads_per_round"] >= 1.0 and eight["host_reads_per_round"] <= one["host_reads_per_round"]
    assert one["ms_per_round"] > 0 and eight["ms_per_round"] > 0
    assert "| `sjd x1 K=8 [compiled]` |" in (out / "gpu_check.md").read_text()
