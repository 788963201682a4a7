#!/usr/bin/env python
"""Benchmark decoders on one pipeline, same prompts and seeds, in one run: target forward passes, mean accepted
length, wall-clock and speed-up versus the AR baseline (the same fast loop, not a slow `generate`).

    python scripts/benchmark.py --decoders ar medusa hawk --heads <heads folder> --num-prompts 50 --out docs/benchmarks

Writes ``<out>/benchmark.json`` and ``<out>/benchmark.md``.
"""

import argparse
import json
import os
import platform
import random
import time

import diffusers
import torch
import transformers

import spatial_pipelines
from spatial_pipelines.cli import load_pipeline
from spatial_pipelines.data import twemoji_items
from spatial_pipelines.decoders import DECODERS
from spatial_pipelines.embedded import default_model_path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="pipeline folder (default: the embedded model)")
    p.add_argument("--decoders", nargs="+", default=["ar", "medusa", "hawk"], choices=sorted(DECODERS))
    p.add_argument("--heads", default=None, help="draft heads folder for the decoders that need them")
    p.add_argument("--num-prompts", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=1, help="images per call (1: the latency setting)")
    p.add_argument("--guidance-scale", type=float, default=None)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default="docs/benchmarks")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    pipe = load_pipeline(args.model or default_model_path()).to(args.device)
    pipe.set_progress_bar_config(disable=True)
    if args.heads:
        pipe.load_draft_heads(args.heads)
    prompts = random.Random(args.seed).sample([it.caption for it in twemoji_items("all")], args.num_prompts)
    pipe(prompts[:1], output_type="latent", generator=torch.Generator().manual_seed(0))  # warm-up
    rows = {}
    for name in args.decoders:
        pipe.decoder = DECODERS[name].from_config(pipe.decoder.config)
        passes, accepted, draft_passes, tokens = 0, [], 0, 0
        start = time.perf_counter()
        for i in range(0, len(prompts), args.batch_size):
            chunk = prompts[i : i + args.batch_size]
            gens = [torch.Generator().manual_seed(args.seed + i + j) for j in range(len(chunk))]
            out = pipe(chunk, guidance_scale=args.guidance_scale, temperature=args.temperature, top_k=args.top_k,
                       generator=gens, output_type="latent")
            passes += out.stats.num_forward_passes * len(chunk)
            draft_passes += out.stats.num_draft_passes * len(chunk)
            accepted.append(out.stats.accepted_lengths.float())
            tokens += out.stats.num_tokens
        seconds = time.perf_counter() - start
        rows[name] = {
            "decoder_config": {k: v for k, v in dict(pipe.decoder.config).items() if not k.startswith("_")},
            "target_forward_passes_per_image": passes / len(prompts),
            "draft_passes_per_image": draft_passes / len(prompts),
            "mean_accepted_length": torch.cat([a.flatten() for a in accepted]).mean().item(),
            "wall_clock_s": seconds,
            "seconds_per_image": seconds / len(prompts),
            "tokens_per_s": tokens / seconds,
        }
        print(name, json.dumps(rows[name]))
    base = rows.get("ar")
    for r in rows.values():
        r["speedup_vs_ar"] = base["wall_clock_s"] / r["wall_clock_s"] if base else None
        r["pass_reduction_vs_ar"] = base["target_forward_passes_per_image"] / r["target_forward_passes_per_image"] if base else None
    report = {
        "model": args.model or "embedded twemoji_llamagen",
        "heads": args.heads,
        "num_prompts": len(prompts),
        "batch_size": args.batch_size,
        "sampling": {"guidance_scale": args.guidance_scale if args.guidance_scale is not None else pipe.backbone.default_guidance_scale,
                     "temperature": args.temperature, "top_k": args.top_k, "seed": args.seed},
        "device": args.device if args.device != "cpu" else f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)",
        "dtype": str(pipe.transformer.dtype),
        "versions": {"spatial_pipelines": spatial_pipelines.__version__, "torch": torch.__version__,
                     "diffusers": diffusers.__version__, "transformers": transformers.__version__},
        "decoders": rows,
    }
    with open(os.path.join(args.out, "benchmark.json"), "w") as f:
        json.dump(report, f, indent=2)
    lines = ["| decoder | target passes / image | mean accepted length | s / image | speed-up vs AR |", "|---|---|---|---|---|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['target_forward_passes_per_image']:.1f} | {r['mean_accepted_length']:.2f} | "
                     f"{r['seconds_per_image']:.2f} | {r['speedup_vs_ar']:.2f}x |")
    with open(os.path.join(args.out, "benchmark.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
