"""scripts/keyed_noise_cost.py: codes per pass under drawn and keyed noise, and keyed images equal to AR's."""

import json

from helpers import run_script


def test_keyed_images_equal_ar_and_the_report_has_both_noises(tmp_path):
    run_script("keyed_noise_cost.py", "--num-prompts", "1", "--decoders", "sjd", "--threads", "1", "--out", str(tmp_path))
    report = json.loads((tmp_path / "keyed_noise.json").read_text())
    rows = report["rows"]
    assert set(rows) == {"sjd/drawn", "sjd/keyed"}
    assert rows["sjd/keyed"]["images_equal_to_ar"] == 1
    for row in rows.values():
        assert row["codes"] == 576 and 1 <= row["codes_per_pass"] == row["codes"] / row["passes"]
    assert report["versions"]["torch"] and report["num_prompts"] == 1
