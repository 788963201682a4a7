"""What keyed noise costs in codes per pass: each decoder under ``sampling_noise="drawn"`` and ``"keyed"``, same
prompts and generators, on one pipeline (the embedded model by default). Counts only, no timing: target passes
and codes per pass per image, and whether each keyed image equals AR's for the same generator.

    python scripts/keyed_noise_cost.py --num-prompts 30 --decoders sjd medusa eagle --out docs/benchmarks/v2/keyed_noise

Writes ``<out>/keyed_noise.json`` (device, versions, command, per decoder and noise: passes, codes, codes per pass).
"""

import argparse
import json
import os
import platform
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import spatial_pipelines  # noqa: E402
from spatial_pipelines.cli import embedded_heads_path  # noqa: E402
from spatial_pipelines.data.twemoji import TwemojiDataset  # noqa: E402
from spatial_pipelines.decoders import DECODERS, AutoregressiveDecoder  # noqa: E402
from spatial_pipelines.embedded import load_default_pipeline  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--decoders", nargs="+", default=["sjd", "medusa", "eagle"], choices=sorted(DECODERS))
    p.add_argument("--num-prompts", type=int, default=30)
    p.add_argument("--num-images-per-prompt", type=int, default=1)
    p.add_argument("--seed", type=int, default=0, help="prompt sample; image i of prompt j uses seed 1000 * j + i")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default="docs/benchmarks/v2/keyed_noise")
    args = p.parse_args(argv)
    if args.num_prompts < 1 or args.num_images_per_prompt < 1:
        p.error("--num-prompts and --num-images-per-prompt must be at least 1")
    return args


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux), else what `platform` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def generate(pipe, prompts, images: int, noise: str):
    """Every prompt's images, one generator per image: the code grids, target passes per image (summed over rows) and
    codes committed."""
    grids, passes, codes = [], 0, 0
    for j, prompt in enumerate(prompts):
        generators = [torch.Generator().manual_seed(1000 * j + i) for i in range(images)]
        out = pipe(prompt, num_images_per_prompt=images, generator=generators, output_type="latent", sampling_noise=noise)
        grids.append(out.tokens)
        passes += sum(out.stats.row_forward_passes)
        codes += out.stats.num_tokens
    return torch.cat(grids), passes, codes


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    pipe = load_default_pipeline()
    pipe.set_progress_bar_config(disable=True)
    real = TwemojiDataset("all", pipe.backbone.layout.height * pipe.backbone.vae_scale_factor)
    prompts = random.Random(args.seed).sample(real.captions, args.num_prompts)
    pipe.decoder = AutoregressiveDecoder()
    reference, _, _ = generate(pipe, prompts, args.num_images_per_prompt, "keyed")
    rows = {}
    for name in args.decoders:
        decoder = DECODERS[name]()
        need = decoder.heads_needed()
        pipe.set_draft_heads(None)
        if need is not None:
            pipe.load_draft_heads(embedded_heads_path(need.kinds[0]))
        pipe.decoder = decoder
        for noise in ("drawn", "keyed"):
            grids, passes, codes = generate(pipe, prompts, args.num_images_per_prompt, noise)
            rows[f"{name}/{noise}"] = {"passes": passes, "codes": codes, "codes_per_pass": codes / passes,
                                       "images_equal_to_ar": int((grids == reference).flatten(1).all(1).sum())}
            print(f"{name:8s} {noise:6s} codes/pass {codes / passes:.3f}  images equal to AR's: "
                  f"{rows[f'{name}/{noise}']['images_equal_to_ar']}/{len(grids)}", flush=True)
        drawn, keyed = rows[f"{name}/drawn"]["codes_per_pass"], rows[f"{name}/keyed"]["codes_per_pass"]
        print(f"{name:8s} keyed / drawn: {keyed / drawn:.3f}", flush=True)
    report = {
        "command": " ".join([os.path.basename(sys.argv[0])] + (argv if argv is not None else sys.argv[1:])),
        "device": f"cpu ({cpu_name()})", "threads": torch.get_num_threads(),
        "versions": {"spatial_pipelines": spatial_pipelines.__version__, "torch": torch.__version__},
        "num_prompts": args.num_prompts, "num_images_per_prompt": args.num_images_per_prompt, "rows": rows,
    }
    with open(os.path.join(args.out, "keyed_noise.json"), "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
