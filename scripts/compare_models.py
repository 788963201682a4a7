#!/usr/bin/env python
"""Two or more pipelines side by side on the same captions and seeds: one column per caption, one row per model, the
real emoji on top. What a person sees before and after a model changes.

    python scripts/compare_models.py --models runs/old_pipeline src/spatial_pipelines/embedded/twemoji_llamagen \
        --labels shipped new --out docs/quality/compare.png

The default captions are eight common emoji (the README's first command draws one of them) and eight more training
captions; every image is drawn with the model's own sampling defaults and the generator seeded ``--seed``.
"""

import argparse
import os

import torch

from spatial_pipelines.cli import load_pipeline
from spatial_pipelines.data import TwemojiDataset
from spatial_pipelines.decoders import DECODERS

CAPTIONS = ["red heart", "grinning face", "pizza", "snowman", "cat face", "sun", "rocket", "red apple",
            "thumbs up", "fire", "dog face", "rainbow", "ghost", "birthday cake", "smiling face with sunglasses", "deciduous tree"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", required=True, help="pipeline folders")
    p.add_argument("--labels", nargs="+", default=None, help="one per model (default: the folder names)")
    p.add_argument("--captions", nargs="+", default=CAPTIONS)
    p.add_argument("--decoder", default=None, help="decoder name for every model (default: each folder's own)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="PNG path")
    args = p.parse_args(argv)
    args.labels = args.labels or [os.path.basename(os.path.normpath(m)) for m in args.models]
    if len(args.labels) != len(args.models):
        p.error(f"--labels gives {len(args.labels)} names for {len(args.models)} --models")
    return args


def real_images(captions, resolution: int) -> list:
    """The Twemoji image of each caption (``None`` where no emoji carries it)."""
    data = TwemojiDataset("all", resolution)
    index = {c: i for i, c in enumerate(data.captions)}
    return [data[index[c]]["pixel_values"] if c in index else None for c in captions]


@torch.no_grad()
def draw(folder: str, captions, seed: int, decoder=None) -> torch.Tensor:
    """Images ``(N, 3, H, W)`` in [0, 1], one per caption, each from a generator seeded ``seed``."""
    pipe = load_pipeline(folder)
    pipe.set_progress_bar_config(disable=True)
    if decoder is not None:
        pipe.decoder = DECODERS[decoder]()
    gens = [torch.Generator().manual_seed(seed) for _ in captions]
    return pipe(captions, generator=gens, output_type="pt").images


def main(argv=None):
    args = parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [draw(m, args.captions, args.seed, args.decoder) for m in args.models]
    real = real_images(args.captions, rows[0].shape[-1])
    n = len(args.captions)
    fig, axes = plt.subplots(len(rows) + 1, n, figsize=(n * 1.1, (len(rows) + 1) * 1.25), dpi=110, squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for j, caption in enumerate(args.captions):
        axes[0, j].set_title(caption[:18], fontsize=5)
        if real[j] is not None:
            axes[0, j].imshow(((real[j].permute(1, 2, 0) + 1) / 2).numpy())
        for i, images in enumerate(rows):
            axes[i + 1, j].imshow(images[j].float().permute(1, 2, 0).clamp(0, 1).numpy())
    for i, label in enumerate(["real"] + args.labels):
        axes[i, 0].text(-0.1, 0.5, label, transform=axes[i, 0].transAxes, fontsize=6, ha="right", va="center")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    fig.savefig(args.out)
    plt.close(fig)
    print(args.out)


if __name__ == "__main__":
    main()
