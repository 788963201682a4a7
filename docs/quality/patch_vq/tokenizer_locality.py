"""How local is a VQ tokenizer? Groups identical 4x4 pixel patches of the Twemoji training images and reports how
often a patch gets its group's most common code, and how many codes the plain white patches get (2026-11-24, commit `ef699b4`).

    python docs/quality/patch_vq/tokenizer_locality.py PATH/TO/vqvae
"""

import sys

import torch

from spatial_pipelines.data import TwemojiDataset
from spatial_pipelines.models import load_vq_model


@torch.no_grad()
def main(path):
    images = TwemojiDataset("train").images  # (N, 3, 96, 96) uint8
    vq = load_vq_model(path).eval()
    p = vq.downsample_factor
    codes = torch.cat([vq.encode(images[i:i + 256].float() / 127.5 - 1).indices.flatten() for i in range(0, len(images), 256)])
    patches = images.unfold(2, p, p).unfold(3, p, p).permute(0, 2, 3, 1, 4, 5).reshape(-1, 3 * p * p).long()  # raster order
    _, group = torch.unique(patches, dim=0, return_inverse=True)  # identical pixel patches share a group
    size = torch.bincount(group)
    pairs, count = torch.unique(group * vq.codebook.shape[0] + codes, return_counts=True)
    modal = torch.zeros_like(size).scatter_reduce_(0, pairs // vq.codebook.shape[0], count, reduce="amax")
    repeated = size > 1
    white = (patches == 255).all(1)
    print(f"patches {len(codes)}, distinct {len(size)}")
    print(f"repeated patches with their group's most common code: {modal[repeated].sum().item() / size[repeated].sum().item():.1%}")
    print(f"white patches {white.float().mean().item():.1%}, codes they get: {codes[white].unique().numel()}")


if __name__ == "__main__":
    main(sys.argv[1])
