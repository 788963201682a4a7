#!/usr/bin/env python
"""Measure a pipeline + decoder on Twemoji captions: FD-EffNet, caption retrieval, LPIPS diversity, VQ
reconstruction, the model's fit to the real grids (teacher-forced, and greedy free-running), and a contact sheet of
generated images next to the real emoji.

    python scripts/evaluate.py --decoder ar --out docs/quality        # the embedded model, default settings

Writes ``<out>/eval_<decoder>.json`` and ``<out>/contact_sheet_<decoder>.png``.
"""

import argparse
import json
import os
import platform
import random
import time
from types import SimpleNamespace

import numpy as np
import torch

import spatial_pipelines
from spatial_pipelines.cli import load_pipeline
from spatial_pipelines.data import TwemojiDataset, canonical_background_codes
from spatial_pipelines.decoders import DECODERS
from spatial_pipelines.embedded import default_model_path
from spatial_pipelines.jobs import PromptRow, generate_batches
from spatial_pipelines.evaluation import LPIPS, EffNetFeatures, extract_features, frechet_distance, lpips_diversity, retrieval_accuracy


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="pipeline folder (default: the embedded model)")
    p.add_argument("--decoder", default="ar", choices=sorted(DECODERS))
    p.add_argument("--num-train-captions", type=int, default=300)
    p.add_argument("--num-eval-captions", type=int, default=206, help="held-out captions (206 exist)")
    p.add_argument("--diversity-prompts", type=int, default=16)
    p.add_argument("--diversity-samples", type=int, default=4)
    p.add_argument("--free-running-captions", type=int, default=64,
                   help="training captions decoded greedily and compared code for code with their real grids")
    p.add_argument("--canonical-background", action="store_true",
                   help="compare the fits with canonical-background grids (for a model trained with "
                        "train_ar.py --canonical-background)")
    p.add_argument("--guidance-scale", type=float, default=None)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default="docs/quality")
    return p.parse_args(argv)


def generate(pipe, prompts, args, seed_offset=0):
    """Images in [-1, 1] ``(N, 3, H, W)`` through the jobs' prompt loop (`spatial_pipelines.jobs.generate_batches`:
    prompt ``j`` seeded ``args.seed + seed_offset + j``) and the summed decoding stats."""
    images, passes, seconds, calls = [], 0, 0.0, 0
    rows = [PromptRow(j, prompt) for j, prompt in enumerate(prompts)]
    call = dict(guidance_scale=args.guidance_scale, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                output_type="pt")
    for _, out, _ in generate_batches(pipe, rows, seed=args.seed + seed_offset, batch_size=args.batch_size, call_kwargs=call):
        images.append(out.images.cpu() * 2 - 1)
        passes += out.stats.num_forward_passes
        seconds += out.stats.wall_time_s
        calls += 1
    return torch.cat(images), {"forward_passes_per_call": passes / calls, "wall_time_s": seconds}


def real_grids(pipe, images, canonical):
    """The real images' code grids ``(b, N)``, background made canonical when the model was trained that way."""
    images = images.to(pipe.device)
    codes = pipe.backbone.encode_image(images)
    return canonical_background_codes(pipe.vqvae, images, codes) if canonical else codes


@torch.no_grad()
def teacher_forced_fit(pipe, images, captions, device, batch_size=32, canonical=False):
    """How well the model knows the grids of real images (a memorisation gauge that needs no sampling): per code, the
    conditional model's NLL and greedy accuracy given the true codes before it, over the real images' VQ grids; and
    the share of grids whose every code but at most 2% the model predicts greedily."""
    backbone = pipe.backbone
    nll, hits, grids_known, n = 0.0, 0, 0, 0
    for i in range(0, len(captions), batch_size):
        codes = real_grids(pipe, images[i : i + batch_size], canonical)  # (b, N)
        prefix = backbone.encode_prompt(captions[i : i + batch_size], None, False, device)
        logits = backbone.image_logits(backbone.teacher_forced_hidden_states(prefix, codes))  # (b, N, V)
        nll += torch.nn.functional.cross_entropy(logits.flatten(0, 1), codes.flatten(), reduction="sum").item()
        right = logits.argmax(-1) == codes  # (b, N)
        hits += right.sum().item()
        grids_known += (right.float().mean(1) >= 0.98).sum().item()
        n += codes.numel()
    return {"nll_per_code": nll / n, "greedy_accuracy": hits / n, "grids_known_98pct": grids_known / len(captions)}


@torch.no_grad()
def free_running_fit(pipe, images, captions, guidance_scale, batch_size=64, canonical=False):
    """How much of the real grids the model reproduces when it feeds its own codes (the exposure-bias gap next to
    `teacher_forced_fit`): greedy decoding (top-k 1) at ``guidance_scale`` from each caption, compared code for code
    with the real image's grid. Reports the share of codes equal, the median raster index of the first code that
    differs (the grid's length when none does), and the share of grids reproduced to 90% or better."""
    agree, first, close = [], [], 0
    for i in range(0, len(captions), batch_size):
        chunk = captions[i : i + batch_size]
        codes = real_grids(pipe, images[i : i + batch_size], canonical).cpu()  # (b, N)
        out = pipe(chunk, guidance_scale=guidance_scale, top_k=1, output_type="latent",
                   generator=torch.Generator().manual_seed(0))
        same = out.images.reshape(len(chunk), -1).cpu() == codes  # (b, N)
        agree.append(same.float().mean(1))
        wrong = ~same
        first += torch.where(wrong.any(1), wrong.float().argmax(1), same.shape[1]).tolist()
        close += (same.float().mean(1) >= 0.9).sum().item()
    return {"code_agreement": torch.cat(agree).mean().item(), "median_first_divergence": float(np.median(first)),
            "grids_reproduced_90pct": close / len(captions), "num_grids": len(captions), "guidance_scale": guidance_scale}


def contact_sheet(real, generated, captions, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(captions)
    cols = 8  # 4 (real, generated) pairs per row
    rows = (n + 3) // 4
    fig, axes = plt.subplots(rows, cols, figsize=(cols * 1.4, rows * 1.75), dpi=110)
    for ax in axes.flat:
        ax.axis("off")
    for k, caption in enumerate(captions):
        r, c = divmod(k, 4)
        for j, (img, tag) in enumerate(((real[k], "real"), (generated[k], "generated"))):
            ax = axes[r, 2 * c + j]
            ax.imshow(((img.permute(1, 2, 0).clamp(-1, 1) + 1) / 2).numpy())
            ax.set_title(f"{caption[:22]}\n({tag})" if j == 0 else f"\n({tag})", fontsize=6)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def load_references(args):
    """The pipeline with ``--decoder``, and every Twemoji image with its EffNet features: what samples are scored
    against."""
    pipe = load_pipeline(args.model or default_model_path()).to(args.device)
    pipe.decoder = DECODERS[args.decoder].from_config(pipe.decoder.config)
    pipe.set_progress_bar_config(disable=True)
    resolution = pipe.backbone.layout.height * pipe.backbone.vae_scale_factor
    real = TwemojiDataset("all", resolution)
    real_images = torch.stack([real[i]["pixel_values"] for i in range(len(real))])
    effnet, lpips = EffNetFeatures(), LPIPS()
    ref = SimpleNamespace(dataset=real, images=real_images, feats=extract_features(effnet, real_images),
                          index={c: i for i, c in enumerate(real.captions)}, effnet=effnet, lpips=lpips)
    return pipe, ref


def images_of(ref, captions):
    """The real images of ``captions``."""
    return ref.images[[ref.index[c] for c in captions]]


def sample_scores(args, pipe, ref, rng, train_caps, eval_caps) -> dict:
    """The samples of every caption and their scores: FD-EffNet against the real images of the same captions and two
    controls, caption retrieval (and with shuffled prompts), and LPIPS diversity of a few prompts' seeds."""
    prompts = train_caps + eval_caps
    generated, cost = generate(pipe, prompts, args)
    gen_feats = extract_features(ref.effnet, generated)
    matched = ref.feats[[ref.index[c] for c in prompts]]
    others = [c for c in ref.dataset.captions if c not in set(prompts)]
    control = ref.feats[[ref.index[c] for c in rng.sample(others, len(prompts))]]
    shuffled = prompts[:]
    rng.shuffle(shuffled)
    div_prompts = train_caps[: args.diversity_prompts // 2] + eval_caps[: args.diversity_prompts - args.diversity_prompts // 2]
    rep = [p for p in div_prompts for _ in range(args.diversity_samples)]
    div_images, _ = generate(pipe, rep, args, seed_offset=10**6)
    diversity = [lpips_diversity(ref.lpips, div_images[k : k + args.diversity_samples]) for k in range(0, len(rep), args.diversity_samples)]
    n, captions = len(train_caps), ref.dataset.captions
    return {
        "generated": generated, "prompts": prompts, "cost": cost, "num_diversity_prompts": len(div_prompts),
        "fd_effnet_vs_real_same_captions": frechet_distance(gen_feats, matched),
        "fd_effnet_label_shuffled_control": frechet_distance(gen_feats, control),
        "fd_effnet_real_vs_real_control": frechet_distance(matched, control),
        "retrieval_train": retrieval_accuracy(gen_feats[:n], prompts[:n], ref.feats, captions),
        "retrieval_heldout": retrieval_accuracy(gen_feats[n:], prompts[n:], ref.feats, captions),
        "retrieval_shuffled_prompts_control": retrieval_accuracy(gen_feats, shuffled, ref.feats, captions),
        "lpips_diversity": float(np.mean(diversity)),
    }


def vq_scores(args, pipe, ref, train_caps, eval_caps) -> dict:
    """The tokenizer: held-out images through the grids the model is trained to reproduce (PSNR, LPIPS), and the
    retrieval ceiling of a model that reproduced each training image's exact codes."""

    def reconstruct(images):
        grid = (pipe.backbone.layout.height, pipe.backbone.layout.width)
        return torch.cat([pipe.vqvae.decode_code(real_grids(pipe, images[i : i + 64], args.canonical_background).view(-1, *grid)).cpu()
                          for i in range(0, len(images), 64)])

    heldout_real = images_of(ref, eval_caps)
    recon = reconstruct(heldout_real)
    mse = ((recon.clamp(-1, 1) - heldout_real) / 2).pow(2).flatten(1).mean(1)
    train_recon = reconstruct(images_of(ref, train_caps)).clamp(-1, 1)
    return {
        "heldout_real": heldout_real, "recon": recon,
        "ceiling": retrieval_accuracy(extract_features(ref.effnet, train_recon), train_caps, ref.feats, ref.dataset.captions),
        "psnr_db": (10 * torch.log10(1 / mse.clamp_min(1e-10))).mean().item(),
        "lpips": ref.lpips(recon, heldout_real).mean().item(),
    }


def fit_scores(args, pipe, ref, train_caps, eval_caps) -> dict:
    """The model's fit to the real grids: teacher-forced on training and held-out captions, greedy free-running on
    the first ``--free-running-captions`` training ones."""
    canonical = args.canonical_background
    guidance = args.guidance_scale if args.guidance_scale is not None else pipe.backbone.default_guidance_scale
    k = min(args.free_running_captions, len(train_caps))
    return {
        "teacher_forced_train": teacher_forced_fit(pipe, images_of(ref, train_caps), train_caps, args.device, canonical=canonical),
        "teacher_forced_heldout": teacher_forced_fit(pipe, images_of(ref, eval_caps), eval_caps, args.device, canonical=canonical),
        "free_running_greedy_train": free_running_fit(pipe, images_of(ref, train_caps[:k]), train_caps[:k], guidance,
                                                      args.batch_size, canonical),
    }


def make_report(args, pipe, samples: dict, vq: dict, fits: dict, num_train: int, num_heldout: int, seconds: float) -> dict:
    """``eval_<decoder>.json``."""
    cost, num_samples = samples["cost"], len(samples["prompts"])
    return {
        "model": args.model or "embedded twemoji_llamagen",
        "decoder": args.decoder,
        "settings": {"guidance_scale": args.guidance_scale if args.guidance_scale is not None else pipe.backbone.default_guidance_scale,
                     "temperature": args.temperature, "top_k": args.top_k if args.top_k is not None else pipe.backbone.default_top_k,
                     "top_p": args.top_p, "seed": args.seed},
        "num_samples": num_samples,
        "num_train_captions": num_train,
        "num_heldout_captions": num_heldout,
        **{k: samples[k] for k in ("fd_effnet_vs_real_same_captions", "fd_effnet_label_shuffled_control",
                                   "fd_effnet_real_vs_real_control", "retrieval_train", "retrieval_heldout",
                                   "retrieval_shuffled_prompts_control")},
        "retrieval_train_vq_reconstruction_ceiling": vq["ceiling"],
        "fit_grids_canonical_background": args.canonical_background,
        **fits,
        "lpips_diversity": samples["lpips_diversity"],
        "lpips_diversity_prompts": samples["num_diversity_prompts"],
        "lpips_diversity_samples_per_prompt": args.diversity_samples,
        "vq_heldout_psnr_db": vq["psnr_db"],
        "vq_heldout_lpips": vq["lpips"],
        "target_forward_passes_per_image": cost["forward_passes_per_call"],  # every image of a call shares its passes
        "batch_size": args.batch_size,
        "generation_wall_time_s": cost["wall_time_s"],
        "seconds_per_image": cost["wall_time_s"] / num_samples,
        "total_eval_time_s": seconds,
        "device": str(args.device) if args.device != "cpu" else f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
        "dtype": str(pipe.transformer.dtype),
        "versions": {"spatial_pipelines": spatial_pipelines.__version__, "torch": torch.__version__},
    }


def write_pictures(args, ref, samples: dict, vq: dict, train_caps, eval_caps) -> None:
    """``vq_reconstructions.png`` (held-out images over their reconstructions) and ``contact_sheet_<decoder>.png``."""
    from diffusers.utils import make_image_grid
    from PIL import Image

    def to_pil(t):
        return Image.fromarray(((t.clamp(-1, 1) + 1) * 127.5).round().byte().permute(1, 2, 0).numpy())

    heldout_real, recon = vq["heldout_real"], vq["recon"]
    k = min(12, len(heldout_real))
    strip = [to_pil(t) for t in torch.cat([heldout_real[:k], recon[:k]])]
    make_image_grid(strip, rows=2, cols=k).save(os.path.join(args.out, "vq_reconstructions.png"))
    sheet = train_caps[:16] + eval_caps[:16]
    prompts = samples["prompts"]
    contact_sheet(images_of(ref, sheet), samples["generated"][[prompts.index(c) for c in sheet]], sheet,
                  os.path.join(args.out, f"contact_sheet_{args.decoder}.png"),
                  f"{args.decoder} decoder: first 4 rows training captions, last 4 rows held-out captions")


@torch.no_grad()
def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    pipe, ref = load_references(args)
    rng = random.Random(args.seed)
    train_caps = rng.sample([it.caption for it in ref.dataset.items if it.split == "train"], args.num_train_captions)
    eval_caps = rng.sample([it.caption for it in ref.dataset.items if it.split == "eval"], args.num_eval_captions)
    t0 = time.perf_counter()
    samples = sample_scores(args, pipe, ref, rng, train_caps, eval_caps)
    vq = vq_scores(args, pipe, ref, train_caps, eval_caps)
    fits = fit_scores(args, pipe, ref, train_caps, eval_caps)
    report = make_report(args, pipe, samples, vq, fits, len(train_caps), len(eval_caps), time.perf_counter() - t0)
    with open(os.path.join(args.out, f"eval_{args.decoder}.json"), "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2))
    write_pictures(args, ref, samples, vq, train_caps, eval_caps)


if __name__ == "__main__":
    main()
