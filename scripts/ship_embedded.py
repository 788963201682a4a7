#!/usr/bin/env python
"""Copy a trained pipeline into the package as the embedded default, storing weights in fp16 where that is
lossless enough (greedy grids must agree with fp32 weights), and report the folder size.

    python scripts/ship_embedded.py --pipeline runs/ar/pipeline
"""

import argparse
import json
import os

import torch

from spatial_pipelines import LlamaGenPipeline
from spatial_pipelines.embedded import default_model_path

CHECK_PROMPTS = ["grinning face", "red heart", "thumbs up", "rocket", "Japan", "pizza"]
MAX_MB = 60


def folder_mb(path: str) -> float:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs) / 2**20


@torch.no_grad()
def greedy(pipe):
    return pipe(CHECK_PROMPTS, temperature=0, output_type="latent").tokens


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pipeline", default="runs/ar/pipeline")
    p.add_argument("--min-agreement", type=float, default=0.99, help="share of greedy codes fp16 storage must keep")
    p.add_argument("--guidance-scale", type=float, default=None, help="the model's default CFG scale")
    p.add_argument("--top-k", type=int, default=None, help="the model's default top-k")
    args = p.parse_args(argv)

    pipe = LlamaGenPipeline.from_pretrained(args.pipeline)
    pipe.set_progress_bar_config(disable=True)
    reference = greedy(pipe)
    half = LlamaGenPipeline.from_pretrained(args.pipeline)
    half.set_progress_bar_config(disable=True)
    for module in (half.transformer, half.vqvae):
        for param in module.parameters():
            param.data = param.data.half().float()  # what fp16 storage gives back
    agreement = (greedy(half) == reference).float().mean().item()
    pixels = (half.vqvae.decode_code(reference) - pipe.vqvae.decode_code(reference)).abs().max().item()
    use_fp16 = agreement >= args.min_agreement
    print(f"fp16 storage keeps {agreement:.4f} of the greedy codes; VQ decode max |diff| {pixels:.2e} -> {'fp16' if use_fp16 else 'fp32'}")
    if use_fp16:
        pipe.transformer.to(torch.float16)
        pipe.vqvae.to(torch.float16)
    pipe.transformer.register_to_config(default_guidance_scale=args.guidance_scale, default_top_k=args.top_k)  # travel with it
    out = default_model_path()
    pipe.save_pretrained(out, model_card=False)  # the card is hub_cards/twemoji_llamagen.md (scripts/make_cards.py)
    size = folder_mb(out)
    print(json.dumps({"shipped_to": out, "size_mb": round(size, 2), "fp16": use_fp16, "greedy_agreement": agreement}))
    if size > MAX_MB:
        raise SystemExit(f"the embedded folder is {size:.1f} MB, over the {MAX_MB} MB budget")


if __name__ == "__main__":
    main()
