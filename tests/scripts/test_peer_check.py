"""scripts/peer_check.py: on a machine without CUDA its dry run builds each family's tiny layout and times the peer
(transformers' own ``generate`` for Janus-Pro, Emu3 and Anole; `minimal_ar.py` eager and compiled for LlamaGen) beside
our AR and SJD (and SJD at the window `tune_decoder` picks), with every column, the greedy check and both files; a
run stopped mid-block keeps what it timed."""

import json

import pytest
import torch
from helpers import load_script, run_script

COLUMNS = ("seconds_per_image", "passes_per_call", "codes_per_pass", "ms_per_pass", "peak_mib", "speedup_vs_peer",
           "pass_cost_in_ar_steps")


def test_peer_check_dry_run_writes_its_report(tmp_path):
    out = tmp_path / "peer"
    run_script("peer_check.py", "--out", str(out), "--dry-run", "--layouts", "janus-tiny", "--skip-compiled", "--greedy-check",
               "--tuned", "--trees", "--num-prompts", "1", "--num-images-per-prompt", "1", "2", "--threads", "1")
    assert sorted(p.name for p in out.iterdir()) == ["peer_check.json", "peer_check.md"]
    report = json.loads((out / "peer_check.json").read_text())
    assert report["dtype"] == "float32" and report["versions"]["transformers"] and not report["skipped"]
    block = report["layouts"]["janus-tiny"]
    # the peer (transformers' generate) and our AR loop emit the same greedy codes
    assert block["greedy"]["equal"] and block["greedy"]["codes"] == 16
    for n in ("1", "2"):
        rows = block["rows"][n]
        # --tuned: SJD (and with --trees Medusa on random heads) at the size tune_decoder(prompt=...) picked for n
        # images, on a prompt no timed call uses; 0: no drafts
        window, nodes = block["tuned"][f"x{n}"]["sjd"]["window_size"], block["tuned"][f"x{n}"]["medusa"]["num_draft_tokens"]
        assert list(rows) == ["peer", "ar", "sjd", f"sjd tuned (window {window})", "medusa", f"medusa tuned (nodes {nodes})"]
        assert 0 <= window <= 32 and 0 <= nodes <= 16
        for name, row in rows.items():
            assert all(row[c] is not None for c in COLUMNS if c != "pass_cost_in_ar_steps" or name != "peer"), name
        assert rows["peer"]["passes_per_call"] == 16 and rows["peer"]["speedup_vs_peer"] == 1.0
        assert rows["ar"]["passes_per_call"] == 16 and rows["ar"]["codes_per_pass"] == 1.0
        assert rows["sjd"]["passes_per_call"] <= 16 and rows["ar"]["pass_cost_in_ar_steps"] == 1.0
    table = (out / "peer_check.md").read_text()
    assert "| peer | 1 |" in table and "| sjd | 2 |" in table


def test_peer_check_dry_run_covers_emu3_anole_and_llamagen(tmp_path):
    """The peers emit our AR loop's greedy codes token for token: Emu3's constrained ``generate`` (its EOLs forced:
    a row of 4 codes takes 5 steps, then EOF, EOI, EOS), Anole's (image tokens only) and LlamaGen's minimal loop."""
    out = tmp_path / "peer"
    run_script("peer_check.py", "--out", str(out), "--dry-run", "--layouts", "emu3-tiny", "anole-tiny", "llamagen-tiny",
               "--skip-compiled", "--greedy-check", "--num-prompts", "1", "--threads", "1")
    report = json.loads((out / "peer_check.json").read_text())
    assert list(report["layouts"]) == ["emu3-tiny", "anole-tiny", "llamagen-tiny"] and not report["skipped"]
    peer_passes = {"emu3-tiny": 4 * 5 + 3, "anole-tiny": 16, "llamagen-tiny": 16}
    for name, block in report["layouts"].items():
        assert block["greedy"] == {"equal": True, "equal_share": 1.0, "codes": 16}, name
        rows = block["rows"]["1"]
        assert list(rows) == ["peer", "ar", "sjd"], name
        for row_name, row in rows.items():
            assert all(row[c] is not None for c in COLUMNS if c != "pass_cost_in_ar_steps" or row_name != "peer"), (name, row_name)
        assert rows["peer"]["passes_per_call"] == peer_passes[name] and rows["ar"]["codes_per_pass"] == 1.0
    assert "Emu3ForConditionalGeneration.generate" in report["layouts"]["emu3-tiny"]["peer"]
    assert report["layouts"]["emu3-tiny"]["sampling"] == {"guidance_scale": 3.0, "temperature": 1.0, "top_k": 64}
    assert report["layouts"]["llamagen-tiny"]["sampling"]["guidance_scale"] == 4.0
    assert "## anole-tiny" in (out / "peer_check.md").read_text()


class Stop(Exception):
    pass


def test_peer_check_keeps_every_timed_call_and_llamagen_has_a_compiled_peer(tmp_path, monkeypatch):
    """LlamaGen's rows: the minimal loop eager (``peer``) and compiled (``peer [compiled]``), our compiled rows set
    beside the compiled one; a run stopped after three timed calls has saved all three."""
    script = load_script("peer_check.py")
    timed_call, calls = script.timed_call, []

    def stopping(*args):
        if len(calls) == 3:
            raise Stop
        calls.append(args[1].name)
        return timed_call(*args)

    monkeypatch.setattr(script, "timed_call", stopping)
    out = tmp_path / "peer"
    threads = torch.get_num_threads()
    try:
        with pytest.raises(Stop):
            script.main(["--out", str(out), "--dry-run", "--layouts", "llamagen-tiny", "--skip-eager", "--num-prompts", "1",
                         "--threads", "1"])
    finally:
        torch.set_num_threads(threads)
    assert calls == ["peer", "peer [compiled]", "ar [compiled]"]
    rows = json.loads((out / "peer_check.json").read_text())["layouts"]["llamagen-tiny"]["rows"]["1"]
    assert list(rows) == calls and all(row["calls"] == 1 for row in rows.values())
    compiled_peer = rows["peer [compiled]"]["seconds_per_image"]
    assert rows["ar [compiled]"]["speedup_vs_peer"] == pytest.approx(compiled_peer / rows["ar [compiled]"]["seconds_per_image"])
    assert rows["peer [compiled]"]["passes_per_call"] == 16 and rows["peer [compiled]"]["warmup_s"] > 0


@pytest.mark.parametrize("argv, message", [
    (["--num-prompts", "0"], "--num-prompts values must be >= 1"),
    (["--budget-s", "nan"], "--budget-s must be a positive number"),
    (["--skip-eager", "--skip-compiled"], "leave none of our rows"),
])
def test_peer_check_refuses_bad_arguments(tmp_path, argv, message):
    result = run_script("peer_check.py", "--out", str(tmp_path / "x"), "--dry-run", *argv, check=False)
    assert result.returncode == 2 and message in result.stderr
