"""Smoke test of scripts/bench_roofline.py on the tiny preset, on the CPU: report fields, the K = 1 ratio and the
plot (timings are not asserted)."""

import json

import pytest

from helpers import load_script

roofline = load_script("bench_roofline.py")


def test_roofline_report_and_plot(tmp_path):
    out = tmp_path / "roofline"
    roofline.main(["--presets", "tiny", "--device", "cpu", "--ks", "1", "4", "--repeats", "2", "--warmup", "1", "--out", str(out)])
    report = json.loads((out / "roofline.json").read_text())
    assert report["dtype"] == "float32" and report["batch"] == 2 and report["device"].startswith("cpu")
    assert {"torch", "diffusers"} <= set(report["versions"])
    row = report["presets"]["tiny"]
    assert row["params"] > 0 and row["weight_bytes"] >= row["weight_bytes_per_step"] > 0
    assert row["cache_length"] == 4 + 16 // 2  # prefix + half the 4x4 grid
    assert row["kv_bytes_per_step"] > 0 and row["ms_per_ar_step"] > 0 and row["achieved_bandwidth_gbs"] > 0
    assert row["floor_ms"] is None and row["fraction_of_peak"] is None  # no peak bandwidth known for a CPU
    assert [v["K"] for v in row["verify"]] == [1, 4]
    assert all(v["ms"] > 0 and v["relative_to_ar"] > 0 for v in row["verify"])
    assert (out / "roofline.png").stat().st_size > 0


def test_peak_bandwidth_gives_floor(tmp_path):
    report = roofline.main(["--presets", "tiny", "--device", "cpu", "--ks", "2", "--repeats", "1", "--warmup", "0",
                            "--cache-length", "3", "--peak-bandwidth-gbs", "100", "--out", str(tmp_path)])
    row = report["presets"]["tiny"]
    assert row["cache_length"] == 3
    moved = row["weight_bytes_per_step"] + row["kv_bytes_per_step"]
    assert row["floor_ms"] == pytest.approx(moved / 100e9 * 1e3)
    assert row["fraction_of_peak"] == pytest.approx(row["floor_ms"] / row["ms_per_ar_step"])


def test_peak_bandwidth_lookup():
    lookup = roofline.lookup_peak_bandwidth
    assert lookup("NVIDIA H100 80GB HBM3") == 3350 and lookup("NVIDIA H100 PCIe") == 2000
    assert lookup("NVIDIA H200") == 4800 and lookup("NVIDIA A100-SXM4-80GB") == 2039
    assert lookup("NVIDIA A100-SXM4-40GB") == 1555 and lookup("NVIDIA L4") is None


@pytest.mark.parametrize("bad", ["0", "-3"])
def test_bad_ks_rejected_before_any_work(tmp_path, capsys, bad):
    out = tmp_path / "never"
    with pytest.raises(SystemExit):
        roofline.main(["--presets", "tiny", "--device", "cpu", "--ks", "1", bad, "--out", str(out)])
    assert "must be a positive integer" in capsys.readouterr().err
    assert not out.exists()
