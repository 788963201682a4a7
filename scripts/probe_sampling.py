#!/usr/bin/env python
"""Choose a model's default sampling settings: caption retrieval and FD-EffNet of AR samples on a few training
captions for each (guidance scale, top-k) pair, in one run with the same prompts and seeds.

    python scripts/probe_sampling.py --model runs/ar/pipeline --guidance-scales 3 5 7 --top-ks 20 100 --out runs/probe

Writes ``<out>/probe_sampling.json``; pass the chosen pair to ``scripts/ship_embedded.py``.
"""

import argparse
import itertools
import json
import os
import random

import torch

from spatial_pipelines.cli import load_pipeline
from spatial_pipelines.data import TwemojiDataset
from spatial_pipelines.embedded import default_model_path
from spatial_pipelines.evaluation import EffNetFeatures, extract_features, frechet_distance, retrieval_accuracy


@torch.no_grad()
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="pipeline folder (default: the embedded model)")
    p.add_argument("--guidance-scales", type=float, nargs="+", default=[3.0, 5.0])
    p.add_argument("--top-ks", type=int, nargs="+", default=[100])
    p.add_argument("--num-captions", type=int, default=64, help="training captions sampled")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/probe")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)

    pipe = load_pipeline(args.model or default_model_path())
    pipe.set_progress_bar_config(disable=True)
    resolution = pipe.backbone.layout.height * pipe.backbone.vae_scale_factor
    real = TwemojiDataset("all", resolution)
    effnet = EffNetFeatures()
    real_feats = extract_features(effnet, torch.stack([real[i]["pixel_values"] for i in range(len(real))]))
    index = {c: i for i, c in enumerate(real.captions)}
    prompts = random.Random(args.seed).sample([it.caption for it in real.items if it.split == "train"], args.num_captions)
    matched = real_feats[[index[c] for c in prompts]]
    results = []
    for scale, top_k in itertools.product(args.guidance_scales, args.top_ks):
        images = []
        for i in range(0, len(prompts), args.batch_size):
            chunk = prompts[i : i + args.batch_size]
            gens = [torch.Generator().manual_seed(args.seed + i + j) for j in range(len(chunk))]
            images.append(pipe(chunk, guidance_scale=scale, top_k=top_k, generator=gens, output_type="pt").images * 2 - 1)
        feats = extract_features(effnet, torch.cat(images))
        row = {"guidance_scale": scale, "top_k": top_k, "retrieval_train": retrieval_accuracy(feats, prompts, real_feats, real.captions),
               "fd_effnet_same_captions": frechet_distance(feats, matched)}
        results.append(row)
        print(json.dumps(row))
    with open(os.path.join(args.out, "probe_sampling.json"), "w") as f:
        json.dump({"model": args.model, "num_captions": len(prompts), "seed": args.seed, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
