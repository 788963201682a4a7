#!/usr/bin/env python
"""Train the embedded model's VQ tokenizer (LlamaGen VQ structure, or a k-means patch codebook) on Twemoji.

    accelerate launch scripts/train_vq.py --out runs/vq          # or plain `python`, on CPU or GPU(s)
    python scripts/train_vq.py --kind patch --codebook-size 512 --out runs/vq_patch   # k-means, about a minute on CPU

``--kind patch`` fits a `PatchVQModel`: each code is the nearest of the k-means centroids of the training images'
``--patch-size`` patches, so a code depends on its own patch alone (see `spatial_pipelines.models.vq_patch`).

Resumes from the newest checkpoint in ``--out``. Writes ``<out>/vqvae`` (diffusers format), ``metrics.json``
(reconstruction PSNR / LPIPS on the held-out emoji) and ``loss_curve.png``.
"""

import argparse
import json
import math
import os

import torch
import torch.nn.functional as F

from spatial_pipelines import LlamaGenVQModel, PatchVQModel
from spatial_pipelines.data import TwemojiDataset
from spatial_pipelines.training import add_training_args, end_run, fit, prepare_and_resume, setup


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kind", choices=["conv", "patch"], default="conv",
                   help="conv: LlamaGen's convolutional VQ, trained by gradient; patch: k-means pixel patches")
    p.add_argument("--patch-size", type=int, default=4, help="--kind patch: patch side in pixels")
    p.add_argument("--kmeans-iterations", type=int, default=30, help="--kind patch: Lloyd iterations")
    p.add_argument("--kmeans-patches", type=int, default=300_000, help="--kind patch: patches sampled for the fit")
    p.add_argument("--resolution", type=int, default=96)
    p.add_argument("--codebook-size", type=int, default=1024)
    p.add_argument("--codebook-dim", type=int, default=8)
    p.add_argument("--base-channels", type=int, default=32)
    p.add_argument("--ch-mult", type=int, nargs="+", default=[1, 2, 2])
    p.add_argument("--z-channels", type=int, default=64)
    p.add_argument("--num-res-blocks", type=int, default=1)
    p.add_argument("--norm-num-groups", type=int, default=32)
    p.add_argument("--entropy-loss-ratio", type=float, default=0.05)
    p.add_argument("--crop", type=int, default=48, help="train on random crops of this side (convolutions do not care)")
    add_training_args(p, out="runs/vq", batch_size=32, steps=3000, lr=3e-4, checkpoint_every=250, log_every=25)
    return p.parse_args(argv)


def random_crop(x: torch.Tensor, size: int) -> torch.Tensor:
    """The same random ``size`` x ``size`` window of every image of the batch (full images if ``size`` >= side)."""
    side = x.shape[-1]
    if size >= side:
        return x
    i, j = torch.randint(0, side - size + 1, (2,)).tolist()
    return x[..., i : i + size, j : j + size]


def psnr(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """PSNR in dB of images in [-1, 1], per image."""
    mse = ((a.clamp(-1, 1) - b) / 2).pow(2).flatten(1).mean(1)
    return 10 * torch.log10(1.0 / mse.clamp_min(1e-10))


@torch.no_grad()
def evaluate(model, dataset, accelerator, batch_size=64):
    model.eval()
    scores, used = [], set()
    for i in range(0, len(dataset), batch_size):
        x = torch.stack([dataset[j]["pixel_values"] for j in range(i, min(i + batch_size, len(dataset)))]).to(accelerator.device)
        with accelerator.autocast():
            recon, enc = model(x)
        scores.append(psnr(recon.float(), x))
        used.update(enc.indices.unique().tolist())
    model.train()
    return torch.cat(scores).mean().item(), len(used)


def save_with_metrics(model, args, accelerator, train, held_out, steps):
    value, used = evaluate(model, held_out, accelerator)
    model.save_pretrained(os.path.join(args.out, "vqvae"))
    metrics = {"kind": args.kind, "heldout_psnr_db": value, "codes_used_heldout": used, "codebook_size": args.codebook_size,
               "steps": steps, "num_train_images": len(train), "num_heldout_images": len(held_out)}
    with open(os.path.join(args.out, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=2)
    print(json.dumps(metrics))


def main(argv=None):
    args = parse_args(argv)
    if args.kind == "patch" and args.resolution % args.patch_size:
        raise ValueError(f"`--resolution` ({args.resolution}) must be a multiple of `--patch-size` ({args.patch_size}).")
    accelerator, log = setup(args)

    train = TwemojiDataset("train", args.resolution, limit=args.limit)
    held_out = TwemojiDataset("eval", args.resolution, limit=args.limit)
    if args.kind == "patch":  # a fit, not a training run: no optimiser, no checkpoints
        if accelerator.is_main_process:
            images = train.images.float() / 127.5 - 1.0  # (N, 3, R, R)
            model = PatchVQModel.fit(images, codebook_size=args.codebook_size, patch_size=args.patch_size,
                                     iterations=args.kmeans_iterations, max_patches=args.kmeans_patches, seed=args.seed)
            save_with_metrics(model.to(accelerator.device), args, accelerator, train, held_out, steps=args.kmeans_iterations)
        end_run(accelerator)
        return
    loader = torch.utils.data.DataLoader(train, batch_size=args.batch_size, shuffle=True, drop_last=True)
    model = LlamaGenVQModel(
        codebook_size=args.codebook_size, codebook_embed_dim=args.codebook_dim, encoder_ch_mult=args.ch_mult,
        decoder_ch_mult=args.ch_mult, z_channels=args.z_channels, base_channels=args.base_channels,
        num_res_blocks=args.num_res_blocks, norm_num_groups=args.norm_num_groups, entropy_loss_ratio=args.entropy_loss_ratio,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 100) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
    model, opt, sched, batches, step = prepare_and_resume(accelerator, args, log, model, opt, loader, sched)

    def loss_fn(batch):
        x = random_crop(batch["pixel_values"], args.crop)
        recon, enc = model(x)
        rec = F.l1_loss(recon.float(), x) + F.mse_loss(recon.float(), x)
        parts = {"recon": rec.item(), "vq": enc.vq_loss.item(), "commit": enc.commit_loss.item(), "entropy": enc.entropy_loss.item()}
        return rec + enc.vq_loss + enc.commit_loss + enc.entropy_loss, parts

    fit(accelerator, model=model, optimizer=opt, scheduler=sched, batches=batches, loss_fn=loss_fn, steps=args.steps,
        out=args.out, log=log, start_step=step, log_every=args.log_every, checkpoint_every=args.checkpoint_every,
        title="VQ tokenizer training on Twemoji", plot_keys=["recon", "vq", "commit"], desc="train VQ")

    if accelerator.is_main_process:
        save_with_metrics(accelerator.unwrap_model(model), args, accelerator, train, held_out, steps=args.steps)
    end_run(accelerator)


if __name__ == "__main__":
    main()
