#!/usr/bin/env python
"""Convert Chameleon's VQGAN image tokenizer (used by Anole and Lumina-mGPT) into a spatial_pipelines ChameleonVQModel.

    # Meta's original release: tokenizer/vqgan.ckpt + tokenizer/vqgan.yaml
    python scripts/convert_chameleon_vqgan.py chameleon/tokenizer/vqgan.ckpt --out chameleon-vqgan
    python scripts/convert_chameleon_vqgan.py chameleon/tokenizer --out chameleon-vqgan    # folder with both files

    # a transformers-format VQ repo (config.json with model_type "chameleon_vqgan" + safetensors with decoder weights)
    python scripts/convert_chameleon_vqgan.py Anole-7b-v0.1-vqvae-hf --out chameleon-vqgan

The output folder (``config.json`` + ``diffusion_pytorch_model.safetensors``) loads with
``ChameleonVQModel.from_pretrained(out)``. transformers' own Chameleon checkpoints hold the encoder only and are refused
with the list of missing decoder keys.
"""

import argparse

import torch

from spatial_pipelines.models import load_chameleon_vq

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", help="vqgan.ckpt, a folder holding vqgan.ckpt + vqgan.yaml, or an HF-format VQ folder")
    parser.add_argument("--config", default=None, help="vqgan.yaml (default: the .yaml beside the .ckpt) or a config.json")
    parser.add_argument("--norm-num-groups", type=int, default=None, help="GroupNorm groups (default 32, as the original)")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--out", required=True, help="output folder")
    args = parser.parse_args(argv)

    model = load_chameleon_vq(args.source, args.config, norm_num_groups=args.norm_num_groups, torch_dtype=DTYPES[args.dtype])
    model.save_pretrained(args.out, safe_serialization=True)
    c = model.config
    print(
        f"saved {args.out}: ChameleonVQModel, {c.codebook_size} codes x {c.embed_dim}, downsample {model.downsample_factor}, "
        f"channels {c.base_channels} x {list(c.channel_multiplier)}, {args.dtype}"
    )


if __name__ == "__main__":
    main()
