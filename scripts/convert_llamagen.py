#!/usr/bin/env python
"""Convert original LlamaGen checkpoints (GPT ``.pt`` + VQ ``.pt``) into a spatial_pipelines pipeline folder.

    python scripts/convert_llamagen.py --gpt-ckpt c2i_XL_384.pt --vq-ckpt vq_ds16_c2i.pt \
        --gpt-model GPT-XL --image-size 384 --out llamagen-c2i-xl-384

    python scripts/convert_llamagen.py --gpt-ckpt t2i_XL_stage2_512.pt --vq-ckpt vq_ds16_t2i.pt \
        --gpt-model GPT-XL --image-size 512 --text-encoder google/flan-t5-xl --out llamagen-t2i-xl-512

The folder loads with ``LlamaGenPipeline.from_pretrained(out)``. Weights are written as safetensors.
"""

import argparse

import torch

from spatial_pipelines import LlamaGenPipeline

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def load_text_encoder(name_or_path: str):
    """A transformers text encoder and its tokenizer (T5-family checkpoints load encoder-only)."""
    from transformers import AutoConfig, AutoModel, AutoTokenizer, T5EncoderModel

    config = AutoConfig.from_pretrained(name_or_path)
    model_cls = T5EncoderModel if config.model_type in ("t5", "mt5", "umt5") else AutoModel
    return model_cls.from_pretrained(name_or_path).eval(), AutoTokenizer.from_pretrained(name_or_path)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpt-ckpt", required=True, help="original GPT checkpoint (.pt)")
    parser.add_argument("--vq-ckpt", required=True, help="original VQ checkpoint (.pt)")
    parser.add_argument("--gpt-model", default=None, help="GPT-B ... GPT-7B (default: inferred from the shapes)")
    parser.add_argument("--num-heads", type=int, default=None, help="attention heads, if not a named size")
    parser.add_argument("--image-size", type=int, default=256)
    parser.add_argument("--downsample-size", type=int, default=16)
    parser.add_argument("--text-encoder", default=None, help="transformers encoder for text models (LlamaGen: flan-t5-xl)")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--out", required=True, help="output pipeline folder")
    args = parser.parse_args(argv)

    text_encoder, tokenizer = load_text_encoder(args.text_encoder) if args.text_encoder else (None, None)
    pipe = LlamaGenPipeline.from_backbone(
        args.gpt_ckpt,
        vq_checkpoint=args.vq_ckpt,
        gpt_model=args.gpt_model,
        num_attention_heads=args.num_heads,
        image_size=args.image_size,
        downsample_size=args.downsample_size,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        torch_dtype=DTYPES[args.dtype],
    )
    pipe.save_pretrained(args.out)
    c = pipe.transformer.config
    print(
        f"saved {args.out}: {c.condition_type}-conditional LlamaGen, {c.num_layers} layers x {c.hidden_size}, "
        f"{c.vocab_size} codes, grid {c.grid_height}x{c.grid_width}"
    )


if __name__ == "__main__":
    main()
