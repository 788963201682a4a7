"""``spatial-pipelines``: generate images from the command line.

    spatial-pipelines generate "grinning face" --out face.png       # the embedded Twemoji model
    spatial-pipelines generate "a red fox" --model path/to/pipeline --decoder ar --out fox.png
"""

import argparse
import json
import math
import os
import sys
from typing import List, Optional

import torch

from .decoders import DECODERS

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def load_pipeline(model: str, torch_dtype: torch.dtype = torch.float32):
    """Load a saved pipeline folder with the pipeline class its ``model_index.json`` names."""
    import spatial_pipelines

    index_path = os.path.join(model, "model_index.json")
    if not os.path.isfile(index_path):
        raise ValueError(f"`--model` {model!r} is not a pipeline folder (no model_index.json).")
    with open(index_path) as f:
        class_name = json.load(f)["_class_name"]
    pipeline_cls = getattr(spatial_pipelines, class_name, None)
    if pipeline_cls is None:
        raise ValueError(f"`--model` {model!r} holds a {class_name}, which spatial_pipelines does not provide.")
    return pipeline_cls.from_pretrained(model, dtype=torch_dtype)


def grid_image(images):
    """One image, or the images on a near-square grid (blank cells filled white)."""
    from diffusers.utils import make_image_grid
    from PIL import Image

    if len(images) == 1:
        return images[0]
    cols = math.ceil(math.sqrt(len(images)))
    rows = math.ceil(len(images) / cols)
    blank = Image.new("RGB", images[0].size, "white")
    return make_image_grid(list(images) + [blank] * (rows * cols - len(images)), rows=rows, cols=cols)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spatial-pipelines", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate an image from a prompt")
    g.add_argument("prompt", help="text prompt (or a class label for class-conditional models)")
    g.add_argument("--model", default=None, help="a saved pipeline folder (default: the embedded Twemoji model)")
    g.add_argument("--decoder", default="ar", choices=sorted(DECODERS), help="decoding algorithm (default: ar)")
    g.add_argument("--heads", default=None,
                   help="draft heads folder for decoders that need them (default with the embedded model: its shipped heads)")
    g.add_argument("--out", default="image.png", help="output PNG (a grid when --num-images > 1)")
    g.add_argument("--guidance-scale", type=float, default=None, help="CFG scale (default: the family's)")
    g.add_argument("--temperature", type=float, default=1.0, help="0 is greedy")
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--num-images", type=int, default=1)
    g.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    g.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    return parser


def embedded_heads_path(heads_class: str) -> str:
    """The heads shipped with the embedded model for a decoder's heads class."""
    from .embedded import default_heads_path, default_ssd_heads_path

    paths = {"SpatialDraftHeads": default_heads_path(), "LatentDraftHeads": default_ssd_heads_path()}
    if heads_class not in paths:
        raise ValueError(f"`--decoder` needs {heads_class} heads; the embedded model ships none: pass `--heads`.")
    return paths[heads_class]


def generate(args: argparse.Namespace) -> int:
    from .embedded import default_model_path

    pipe = load_pipeline(args.model or default_model_path(), DTYPES[args.dtype]).to(args.device)
    pipe.decoder = DECODERS[args.decoder].from_config(pipe.decoder.config)
    heads = args.heads
    if heads is None and args.model is None and pipe.decoder.draft_heads_class is not None:
        heads = embedded_heads_path(pipe.decoder.draft_heads_class)
    if heads is not None:
        pipe.load_draft_heads(heads)
    prompt = pipe.backbone.prompt_from_text(args.prompt)
    if args.num_images < 1:
        raise ValueError(f"`--num-images` must be >= 1, got {args.num_images}.")
    generators = [torch.Generator().manual_seed(args.seed + i) for i in range(args.num_images)]
    out = pipe(
        prompt, guidance_scale=args.guidance_scale, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, num_images_per_prompt=args.num_images, generator=generators,
    )
    image = grid_image(out.images)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    image.save(args.out)
    s = out.stats
    print(
        f"saved {args.out} | decoder {args.decoder} | {s.num_forward_passes} target forward passes for "
        f"{s.num_tokens} tokens (mean accepted length {s.mean_accepted_length:.2f}) | "
        f"{s.wall_time_s:.2f} s wall-clock, {s.num_tokens / s.wall_time_s:.1f} tokens/s"
    )
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return generate(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
