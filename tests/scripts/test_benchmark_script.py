"""Smoke test of scripts/benchmark.py on a tiny saved pipeline: decoder variants, heads picked per decoder,
quality columns and the side-by-side picture (the real runs and their commands: docs/benchmarks.md and the archive it links)."""

import json

import pytest

from spatial_pipelines import HawkDecoder, LatentDraftHeads, SpatialDraftHeads, SSDDecoder
from spatial_pipelines.testing import dummy_pipeline

from helpers import load_script, run_script

plot_batches = load_script("plot_batches.py")


def test_benchmark_rows_quality_and_picture(tmp_path):
    pipe = dummy_pipeline("llamagen", grid=(4, 4))
    pipe.save_pretrained(tmp_path / "model")
    SpatialDraftHeads.for_backbone(pipe.backbone, HawkDecoder()).save_pretrained(tmp_path / "spatial")
    LatentDraftHeads.for_backbone(pipe.backbone, SSDDecoder()).save_pretrained(tmp_path / "latent")
    out = tmp_path / "bench"
    cmd = ["benchmark.py", "--model", str(tmp_path / "model"),
           "--decoders", "ar", "minimal-ar", "hawk", "ssd:vertical_rounds=0", "ssd:vertical_rounds=2,draft=sample", "sjd:init=left",
           "medusa:acceptance=lantern,acceptance.k=3,acceptance.delta=0.2", "--heads", str(tmp_path / "spatial"), str(tmp_path / "latent"), "--num-prompts", "3", "--limit", "40", "--quality", "--top-k", "2",
           "--diversity-prompts", "1", "--diversity-samples", "2", "--picture", "2", "--out", str(out)]
    run_script(*cmd)
    report = json.loads((out / "benchmark.json").read_text())
    rows = report["decoders"]
    assert list(rows) == ["ar", "minimal-ar", "hawk", "ssd:vertical_rounds=0", "ssd:vertical_rounds=2,draft=sample", "sjd:init=left",
                          "medusa:acceptance=lantern,acceptance.k=3,acceptance.delta=0.2"]
    minimal = rows.pop("minimal-ar")  # the independent AR loop: a timing row, no quality columns
    assert minimal["warmup_s"] > 0  # warmed up like every other row
    assert minimal["exact"] and minimal["target_forward_passes_per_image"] == 16 and minimal["speedup_vs_ar"] > 0
    assert rows["ar"]["target_forward_passes_per_image"] == 16 and rows["ar"]["speedup_vs_ar"] == 1.0
    assert all(r["warmup_s"] > 0 for r in rows.values())  # every decoder row generated one untimed image first
    # 4x4 grid, k_h = 5: prefill + one chunk of 2 drafts and the code after them (2 passes); 3 rows x (r + 1)
    assert rows["ssd:vertical_rounds=0"]["target_forward_passes_per_image"] == 1 + 2 + 3 * 1
    assert rows["ssd:vertical_rounds=2,draft=sample"]["target_forward_passes_per_image"] == 1 + 2 + 3 * 3
    assert rows["ssd:vertical_rounds=2,draft=sample"]["decoder_config"]["draft"] == "sample"
    assert rows["hawk"]["heads"].endswith("spatial") and rows["ssd:vertical_rounds=0"]["heads"].endswith("latent")
    assert not rows["ssd:vertical_rounds=0"]["exact"] and rows["sjd:init=left"]["exact"]
    assert not rows["medusa:acceptance=lantern,acceptance.k=3,acceptance.delta=0.2"]["exact"]  # a relaxed rule: labelled lossy
    for r in rows.values():
        assert r["fd_effnet"] >= 0 and 0 <= r["retrieval"]["top5"] <= 1 and r["lpips_diversity"] >= 0
        assert r["target_nll_per_code"] > 0 and 0 <= r["outside_target_support"] <= 1
    for exact in ("ar", "hawk", "sjd:init=left"):  # exact decoders draw only what the target could draw
        assert rows[exact]["outside_target_support"] == 0
    # random heads, no repair: many codes the target's top-2 would never give
    assert rows["ssd:vertical_rounds=0"]["outside_target_support"] > 0.2
    table = (out / "benchmark.md").read_text()
    assert "FD-EffNet" in table and "`ssd:vertical_rounds=0`" in table
    assert (out / "decoders_side_by_side.png").stat().st_size > 0
    assert (out / "speed_quality.png").stat().st_size > 0


def test_bench_cost_tables_breakdown_and_plot(tmp_path):
    """scripts/bench_cost.py: c(T) per size, the round split per decoder (sections add up to at most the round),
    and the cost model's prediction next to the measured speed-up."""
    pipe = dummy_pipeline("llamagen", grid=(4, 4))
    pipe.save_pretrained(tmp_path / "model")
    SpatialDraftHeads.for_backbone(pipe.backbone, HawkDecoder()).save_pretrained(tmp_path / "spatial")
    out = tmp_path / "cost"
    cmd = ["bench_cost.py", "--model", str(tmp_path / "model"),
           "--decoders", "ar", "medusa", "sjd:window_size=3", "--heads", str(tmp_path / "spatial"),
           "--num-prompts", "2", "--limit", "20", "--sizes", "1", "4", "--repeats", "2", "--out", str(out)]
    run_script(*cmd)
    report = json.loads((out / "cost.json").read_text())
    assert set(report["pass_cost_ms"]) == {"1", "4"} and all(v > 0 for v in report["pass_cost_ms"].values())
    rows = report["decoders"]
    assert list(rows) == ["ar", "medusa", "sjd:window_size=3"]
    assert rows["sjd:window_size=3"]["fed_tokens_per_round"] == 4 and rows["ar"]["codes_per_pass"] == 1.0
    for r in rows.values():
        parts = r["breakdown_ms"]
        assert parts["forward"] > 0 and parts["other"] >= -1e-6  # the named sections never exceed the round
        assert 0 <= r["outside_forward_share"] < 1 and r["predicted_speedup"] > 0
    assert (out / "cost.png").stat().st_size > 0 and "c(T) / c(1)" in (out / "cost.md").read_text()
    # where codes are lost: one acceptance rate per drafted depth (a 3-draft window), none for AR
    assert rows["ar"]["acceptance_by_depth"] is None
    rates = rows["sjd:window_size=3"]["acceptance_by_depth"]
    assert len(rates) == 3 and all(r is None or 0 <= r <= 1 for r in rates)
    assert "| `sjd:window_size=3` |" in (out / "cost.md").read_text().split("draft 1")[-1]


def test_benchmark_compiled_rows_and_batches(tmp_path):
    """``--compile`` adds every row run on a compiled copy of the pipeline (speed-ups against eager and compiled AR,
    graphs compiled while timed); ``--num-images-per-prompt`` runs every row at each batch (speed-ups against AR at
    the same batch)."""
    pipe = dummy_pipeline("llamagen", grid=(4, 4))
    pipe.save_pretrained(tmp_path / "model")
    out = tmp_path / "bench"
    run_script("benchmark.py", "--model", str(tmp_path / "model"), "--decoders", "ar", "sjd:window_size=3", "--compile",
               "--compile-backend", "eager", "--num-images-per-prompt", "1", "2", "--num-prompts", "2", "--limit", "40",
               "--out", str(out))
    report = json.loads((out / "benchmark.json").read_text())
    rows = report["decoders"]
    assert list(rows) == ["ar", "sjd:window_size=3", "ar [compiled]", "sjd:window_size=3 [compiled]",
                          "ar x2", "sjd:window_size=3 x2", "ar x2 [compiled]", "sjd:window_size=3 x2 [compiled]"]
    assert report["num_images_per_prompt"] == [1, 2] and report["compile"]["enabled"]
    for name, r in rows.items():
        assert r["images_per_prompt"] == (2 if " x2" in name else 1) and r["compiled"] == name.endswith("[compiled]")
        assert r["target_forward_passes_per_image"] > 0 and r["images_per_s"] > 0
        if r["compiled"]:
            assert r["graphs_compiled_while_timed"] == 0 and r["speedup_vs_compiled_ar"] > 0 and 0 <= r["padded_fraction"] < 1
        else:
            assert r["speedup_vs_compiled_ar"] is None
            # AR and SJD run device rounds (fixed shapes: a finished row's slots are padding), so every row reports it
            assert 0 <= r["padded_fraction"] < 1 and (r["padded_fraction"] == 0 or " x2" in name)
        if " x2" in name:
            assert r["slowest_row_pass_share"] == 1.0  # the batch took no pass more than its slowest row
    assert rows["ar x2"]["speedup_vs_ar"] == 1.0 and rows["ar [compiled]"]["speedup_vs_compiled_ar"] == 1.0
    assert rows["ar"]["target_forward_passes_per_image"] == rows["ar x2 [compiled]"]["target_forward_passes_per_image"] == 16
    assert "speed-up vs compiled AR" in (out / "benchmark.md").read_text()
    assert (out / "batches.png").stat().st_size > 0


def test_benchmark_skip_eager_keeps_only_the_compiled_rows(tmp_path):
    """``--compile --skip-eager``: only the compiled rows, each against compiled AR (no eager row to compare with);
    without ``--compile`` it is refused."""
    pipe = dummy_pipeline("llamagen", grid=(4, 4))
    pipe.save_pretrained(tmp_path / "model")
    out = tmp_path / "bench"
    run_script("benchmark.py", "--model", str(tmp_path / "model"), "--decoders", "ar", "sjd:window_size=3", "--compile",
               "--skip-eager", "--compile-backend", "eager", "--num-images-per-prompt", "1", "2", "--num-prompts", "1",
               "--limit", "40", "--out", str(out))
    rows = json.loads((out / "benchmark.json").read_text())["decoders"]
    assert list(rows) == ["ar [compiled]", "sjd:window_size=3 [compiled]", "ar x2 [compiled]", "sjd:window_size=3 x2 [compiled]"]
    for r in rows.values():
        assert r["compiled"] and r["speedup_vs_ar"] is None and r["speedup_vs_compiled_ar"] > 0
    assert rows["ar x2 [compiled]"]["speedup_vs_compiled_ar"] == 1.0 and (out / "batches.png").stat().st_size > 0
    for bad in (["--skip-eager"], ["--skip-eager", "--compile", "--picture", "1"]):
        refused = run_script("benchmark.py", "--model", str(tmp_path / "model"), *bad, "--out", str(out), check=False)
        assert refused.returncode == 2 and "--skip-eager" in refused.stderr
    # the eager rows from a run of their own, and both runs' speed-ups against images per prompt in one plot
    run_script("benchmark.py", "--model", str(tmp_path / "model"), "--decoders", "ar", "sjd:window_size=3",
               "--num-images-per-prompt", "1", "2", "--num-prompts", "1", "--limit", "40", "--out", str(tmp_path / "eager"))
    reports = [json.loads((tmp_path / "eager" / "benchmark.json").read_text()), json.loads((out / "benchmark.json").read_text())]
    lines = plot_batches.speedup_lines(reports)
    assert sorted(lines) == [("sjd:window_size=3", False), ("sjd:window_size=3", True)]
    assert [n for n, _ in lines["sjd:window_size=3", True]] == [1, 2]
    assert lines["sjd:window_size=3", True][1][1] == rows["sjd:window_size=3 x2 [compiled]"]["speedup_vs_compiled_ar"]
    run_script("plot_batches.py", str(tmp_path / "eager" / "benchmark.json"), str(out / "benchmark.json"),
               "--out", str(tmp_path / "speedup.png"))
    assert (tmp_path / "speedup.png").stat().st_size > 0
    reports[0]["decoders"]["sjd:window_size=3"]["speedup_vs_ar"] = None  # a run with no AR row: nothing to draw
    with pytest.raises(ValueError, match="no AR row"):
        plot_batches.speedup_lines(reports)


def test_benchmark_reads_a_prompts_file_through_the_job_loop(tmp_path):
    """``--prompts-file``: the prompts of a job file (its first ``--num-prompts`` rows), generated through
    `spatial_pipelines.jobs.generate_batches` as jobs are; ``--quality`` with it is refused (it scores against the
    Twemoji captions' images)."""
    pipe = dummy_pipeline("llamagen", grid=(4, 4))
    pipe.save_pretrained(tmp_path / "model")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "red heart"}\n{"prompt": "fire"}\n{"prompt": "sun"}\n')
    out = tmp_path / "bench"
    run_script("benchmark.py", "--model", str(tmp_path / "model"), "--decoders", "ar", "sjd", "--prompts-file", str(prompts),
               "--num-prompts", "2", "--limit", "40", "--out", str(out))
    report = json.loads((out / "benchmark.json").read_text())
    assert report["num_prompts"] == 2 and report["decoders"]["sjd"]["target_forward_passes_per_image"] < 16
    refused = run_script("benchmark.py", "--model", str(tmp_path / "model"), "--prompts-file", str(prompts), "--quality",
                         "--out", str(out), check=False)
    assert refused.returncode == 2 and "--quality" in refused.stderr


def test_benchmark_time_budget_times_every_row_on_the_same_first_prompts(tmp_path):
    """``--time-budget-s``: no new prompt starts once the timed runs passed the budget; every row ran on the same
    first prompts and the report says how many; a budget that is not positive, or beside ``--quality``, is refused."""
    pipe = dummy_pipeline("llamagen", grid=(4, 4))
    pipe.save_pretrained(tmp_path / "model")
    out = tmp_path / "bench"
    run_script("benchmark.py", "--model", str(tmp_path / "model"), "--decoders", "ar", "sjd", "--num-prompts", "4",
               "--limit", "40", "--time-budget-s", "1e-9", "--out", str(out))
    report = json.loads((out / "benchmark.json").read_text())
    assert report["num_prompts"] == 4 and report["num_prompts_timed"] == 1  # the first prompt starts at 0 s
    assert report["decoders"]["sjd"]["target_forward_passes_per_image"] < 16
    for bad in (["--time-budget-s", "0"], ["--time-budget-s", "nan"], ["--time-budget-s", "10", "--quality"]):
        refused = run_script("benchmark.py", "--model", str(tmp_path / "model"), *bad, "--out", str(out), check=False)
        assert refused.returncode == 2 and "--time-budget-s" in refused.stderr


def test_benchmark_resume_times_only_the_prompts_it_does_not_hold(tmp_path):
    """``--resume``: a run stopped by its time budget after one prompt, run again, times only the prompts it does not
    hold (a line cut by a kill is timed again) and reports the same figures as one process; a file of another run
    (here another seed) is refused, naming the setting, and ``--resume`` with ``--quality`` is refused."""
    pipe = dummy_pipeline("llamagen", grid=(4, 4))
    pipe.save_pretrained(tmp_path / "model")
    out = tmp_path / "bench"
    cmd = ["benchmark.py", "--model", str(tmp_path / "model"), "--decoders", "ar", "sjd", "--num-prompts", "3", "--limit", "40"]
    run_script(*cmd, "--resume", "--time-budget-s", "1e-9", "--out", str(out))
    first = json.loads((out / "benchmark.json").read_text())
    assert first["num_prompts_timed"] == 1 and list(first["timed_by_processes"].values()) == [1]
    assert len((out / "timed_runs.jsonl").read_text().splitlines()) == 2  # the run's key, then one line per prompt
    with open(out / "timed_runs.jsonl", "a") as f:
        f.write('{"first_prompt": 1, "next_prompt": 2, "ru')  # a kill while the second prompt's line was written
    run_script(*cmd, "--resume", "--out", str(out))
    report = json.loads((out / "benchmark.json").read_text())
    assert report["num_prompts_timed"] == 3 and sum(report["timed_by_processes"].values()) == 3
    assert len((out / "timed_runs.jsonl").read_text().splitlines()) == 4
    run_script(*cmd, "--out", str(tmp_path / "whole"))
    whole = json.loads((tmp_path / "whole" / "benchmark.json").read_text())
    assert whole["timed_by_processes"] is None
    for name in ("ar", "sjd"):
        for column in ("target_forward_passes_per_image", "mean_accepted_length"):
            assert report["decoders"][name][column] == pytest.approx(whole["decoders"][name][column])
    refused = run_script(*cmd, "--resume", "--seed", "1", "--out", str(out), check=False)
    assert refused.returncode != 0 and "other seed" in refused.stderr
    refused = run_script(*cmd, "--resume", "--quality", "--out", str(out), check=False)
    assert refused.returncode == 2 and "--resume" in refused.stderr


def test_benchmark_reports_training_and_held_out_captions_apart():
    """`by_split`: each row's figures on the captions the embedded model trained on and on the held-out ones, with
    the ratios against AR computed within each split; a prompt file has no split."""
    from types import SimpleNamespace

    from spatial_pipelines.data.twemoji import split_of, twemoji_items

    bench_module = load_script("benchmark.py")
    captions = [it.caption for it in twemoji_items("all")]
    train, held_out = next(c for c in captions if split_of(c) == "train"), next(c for c in captions if split_of(c) == "eval")

    def part(seconds, passes, accepted):
        return None, None, {"passes": passes, "draft_passes": 0, "tokens": 16, "seconds": seconds, "images": 1,
                            "accepted_sum": accepted, "accepted_count": 1}

    args = SimpleNamespace(prompts_file=None, batch_size=1)
    bench = SimpleNamespace(prompts=[train, held_out, train])
    ar = bench_module.by_split(args, bench, [part(1.0, 16, 1.0)] * 3)
    sjd = bench_module.by_split(args, bench, [part(0.25, 4, 4.0), part(0.5, 8, 2.0), part(0.25, 4, 4.0)])
    assert ar["train"]["prompts"] == 2 and ar["eval"]["prompts"] == 1
    assert sjd["train"]["mean_accepted_length"] == 4.0 and sjd["eval"]["mean_accepted_length"] == 2.0
    rows = {"ar": {"decoder": "ar", "compiled": False, "images_per_prompt": 1, "images_per_s": 1.0,
                   "target_forward_passes_per_image": 16, "by_split": ar},
            "sjd": {"decoder": "sjd", "compiled": False, "images_per_prompt": 1, "images_per_s": 3.0,
                    "target_forward_passes_per_image": 16 / 3, "by_split": sjd}}
    bench_module.add_speedups(rows)
    assert rows["sjd"]["by_split"]["train"]["speedup_vs_same_ar"] == 4.0
    assert rows["sjd"]["by_split"]["eval"]["speedup_vs_same_ar"] == 2.0 and rows["sjd"]["by_split"]["eval"]["pass_reduction_vs_ar"] == 2.0
    table = "\n".join(bench_module.markdown_table(SimpleNamespace(compile=False, quality=False),
                                                  {k: {**r, "exact": True, "mean_accepted_length": 1.0, "seconds_per_image": 1.0} for k, r in rows.items()}))
    assert "held-out" in table and "| `sjd` | 1 | 2.00 | 2.00x | 2 | 4.00 | 4.00x |" in table
    assert bench_module.by_split(SimpleNamespace(prompts_file="p.txt", batch_size=1), bench, []) is None
