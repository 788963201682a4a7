"""Prompt-file jobs (`spatial_pipelines.jobs`, ``spatial-pipelines generate --prompts-file``): prompt files read or
refused line by line, seeds that do not depend on the split, a job killed with SIGKILL and run again (nothing lost,
nothing twice), the same job over two processes under ``torchrun``, and a folder holding another job refused."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from PIL import Image

from spatial_pipelines import cli
from spatial_pipelines.jobs import JobFolder, PromptRow, image_seed, read_prompts, row_seed

PROMPTS = ["red heart", "fire", "thumbs up", "rocket"]  # the job is killed once 2 are recorded


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# -- prompt files -----------------------------------------------------------------------------------------------------

def test_prompt_files_of_every_format(tmp_path):
    txt = read_prompts(_write(tmp_path, "p.txt", "red heart\nfire\n"))
    assert txt == [PromptRow(0, "red heart"), PromptRow(1, "fire")]
    jsonl = read_prompts(_write(tmp_path, "p.jsonl", '{"prompt": "red heart", "seed": 7}\n{"prompt": "fire"}\n'))
    assert jsonl == [PromptRow(0, "red heart", 7), PromptRow(1, "fire")]
    csv = read_prompts(_write(tmp_path, "p.csv", 'prompt,seed\n"red heart, big",3\nfire,\n'))
    assert csv == [PromptRow(0, "red heart, big", 3), PromptRow(1, "fire")]


@pytest.mark.parametrize("name,text,match", [
    ("p.md", "red heart\n", r"\.txt, \.jsonl or \.csv"),
    ("p.txt", "", "holds no prompt"),
    ("p.txt", "red heart\n\nfire\n", "line 2: the prompt is empty"),
    ("p.jsonl", '{"prompt": "a"}\nnot json\n', "line 2 is not JSON"),
    ("p.jsonl", '{"text": "a"}\n', "line 1 must be an object with a `prompt` field"),
    ("p.jsonl", '{"prompt": "a", "seed": -1}\n', "line 1: `seed` must be an int"),
    ("p.jsonl", '{"prompt": "a", "seed": 1.5}\n', "line 1: `seed` must be an int"),
    ("p.csv", "text\nred heart\n", "must have a `prompt` column"),
])
def test_bad_prompt_files_are_refused_naming_the_line(tmp_path, name, text, match):
    with pytest.raises(ValueError, match=match):
        read_prompts(_write(tmp_path, name, text))


def test_seeds_do_not_depend_on_the_split():
    assert row_seed(PromptRow(5, "a"), 100) == 105 and row_seed(PromptRow(5, "a", 7), 100) == 7
    assert image_seed(105, 0) == 105
    assert image_seed(105, 1) == image_seed(105, 1) != image_seed(106, 0)
    assert len({image_seed(s, k) for s in range(50) for k in range(4)}) == 200


def test_a_folder_with_other_settings_is_refused_naming_the_setting(tmp_path):
    JobFolder(str(tmp_path / "job"), {"--decoder": "sjd", "--seed": 0}).open()
    with pytest.raises(ValueError, match="`--decoder` was 'sjd', now 'ar'"):
        JobFolder(str(tmp_path / "job"), {"--decoder": "ar", "--seed": 0}).open()
    JobFolder(str(tmp_path / "job"), {"--decoder": "ar", "--seed": 0}).open(overwrite=True)  # starts afresh


def test_a_line_cut_by_a_kill_is_not_a_record_and_is_dropped(tmp_path):
    folder = JobFolder(str(tmp_path), {})
    folder.open()
    Image.new("RGB", (4, 4)).save(tmp_path / "000000_0.png")
    Image.new("RGB", (4, 4)).save(tmp_path / "000001_0.png")
    folder.record([{"row": 0, "k": 0, "file": "000000_0.png"}])
    with open(folder.manifest, "a") as f:
        f.write('{"row": 1, "k": 0, "fi')  # a kill during the write
    assert list(folder.recorded()) == [(0, 0)]
    folder.record([{"row": 1, "k": 0, "file": "000001_0.png"}])
    assert list(folder.recorded()) == [(0, 0), (1, 0)]
    assert all(json.loads(line) for line in open(folder.manifest))


def test_cli_job_arguments_are_checked_before_loading(tmp_path, capsys):
    prompts = _write(tmp_path, "p.txt", "red heart\n")
    cases = [
        (["generate", "--prompts-file", prompts], "needs `--out DIR`"),
        (["generate", "red heart", "--prompts-file", prompts, "--out", str(tmp_path / "j")], "not both"),
        (["generate", "--prompts-file", prompts, "--out", str(tmp_path / "j"), "--batch-size", "0"], "--batch-size"),
        (["generate", "--prompts-file", prompts, "--out", prompts], "is a file"),
        (["generate", "red heart", "--overwrite"], "apply to `--prompts-file`"),
        (["generate"], "give a `prompt`"),
    ]
    for argv, match in cases:
        assert cli.main(argv) == 2, argv
        assert match in capsys.readouterr().err, argv


# -- jobs on the embedded model ---------------------------------------------------------------------------------------

def _job(prompts, out, *extra, **popen):
    cmd = [sys.executable, "-m", "spatial_pipelines.cli", "generate", "--prompts-file", prompts, "--out", str(out),
           "--decoder", "sjd", *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def _rows(out):
    lines = [json.loads(line) for line in open(out / "manifest.jsonl")]
    return sorted((e["row"], e["k"], e["prompt"], e["seed"], e["file"]) for e in lines)


def _check_complete(out):
    rows = _rows(out)
    assert [r[0] for r in rows] == list(range(len(PROMPTS))) and [r[2] for r in rows] == PROMPTS
    files = sorted(p.name for p in out.iterdir() if p.suffix == ".png")
    assert files == sorted(r[4] for r in rows) and len(set(files)) == len(PROMPTS)
    for name in files:
        with Image.open(out / name) as im:
            im.verify()
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp.png")]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["complete"] and summary["images"] == len(PROMPTS) and summary["codes_per_pass"] > 1
    return rows


@pytest.mark.slow
def test_a_killed_job_resumes_then_torchrun_makes_the_same_rows(tmp_path, capsys):
    prompts = _write(tmp_path, "prompts.txt", "\n".join(PROMPTS) + "\n")
    out = tmp_path / "job"
    job = _job(prompts, out)
    deadline = time.time() + 300
    while time.time() < deadline and job.poll() is None:  # SIGKILL once the second image is recorded
        if (out / "manifest.jsonl").exists() and sum(1 for _ in open(out / "manifest.jsonl")) >= 2:
            job.send_signal(signal.SIGKILL)
            break
        time.sleep(0.05)
    job.wait()
    assert job.returncode == -signal.SIGKILL, job.stderr.read()[-2000:]
    recorded_before = _rows(out)
    assert 2 <= len(recorded_before) < len(PROMPTS)

    again = _job(prompts, out)
    stdout, stderr = again.communicate(timeout=600)
    assert again.returncode == 0, stderr[-2000:]
    rows = _check_complete(out)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["run_images"] == len(PROMPTS) - len(recorded_before)  # nothing made twice
    assert set(recorded_before) <= set(rows)

    other = ["generate", "--prompts-file", prompts, "--out", str(out), "--decoder", "ar"]  # refused before loading
    assert cli.main(other) == 2 and "`--decoder` was 'sjd', now 'ar'" in capsys.readouterr().err

    split = tmp_path / "split"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "spatial_pipelines.cli",
           "generate", "--prompts-file", prompts, "--out", str(split), "--decoder", "sjd"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert _check_complete(split) == rows  # the same rows, prompts, seeds and files, each once


def test_a_full_disk_is_a_clear_error_and_the_manifest_stays_whole(tmp_path, monkeypatch):
    """The second image cannot be written (ENOSPC): a `ValueError` naming the path; the first image and its manifest
    line stay, no temporary file is left, and the job run again finishes the rest."""
    import errno

    from spatial_pipelines.jobs import run_job
    from spatial_pipelines.testing import dummy_pipeline

    pipe = dummy_pipeline("llamagen", grid=(4, 4))
    pipe.set_progress_bar_config(disable=True)
    rows = [PromptRow(i, p) for i, p in enumerate(["a", "b", "c"])]
    folder = JobFolder(str(tmp_path / "job"), {"--decoder": "ar"})
    folder.open()
    saves, save = [], Image.Image.save

    def full_disk(image, fp, *args, **kwargs):
        saves.append(fp)
        if len(saves) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return save(image, fp, *args, **kwargs)

    monkeypatch.setattr(Image.Image, "save", full_disk)
    with pytest.raises(ValueError, match=r"could not write .*000001_0\.png.*No space left on device"):
        run_job(pipe, rows, folder, seed=0, progress=False)
    assert list(folder.recorded()) == [(0, 0)]
    assert not [p for p in (tmp_path / "job").iterdir() if p.name.endswith(".tmp.png")]
    monkeypatch.setattr(Image.Image, "save", save)
    summary = run_job(pipe, rows, folder, seed=0, progress=False)
    assert summary["complete"] and summary["run_images"] == 2 and list(folder.recorded()) == [(0, 0), (1, 0), (2, 0)]


def test_an_unwritable_folder_is_refused_before_loading(tmp_path, monkeypatch):
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: False if str(path) == str(tmp_path) else real_access(path, mode))
    with pytest.raises(ValueError, match="is not writable by this user"):
        JobFolder(str(tmp_path / "job"), {}).check_writable()
