"""What a round does around the model, per decoder: host reads, eager aten ops and compiles per round
(`spatial_pipelines.pipelines.round_counts.count_rounds`), eager and with the step compiled, at several batch sizes.
Counts only, no timing: what a GPU round pays for (a device sync per host read, a launch per eager op), measured on
any device.

    python scripts/round_counts.py --decoders ar sjd medusa eagle --images 1 4 --out docs/benchmarks/v2/round_counts

For each row the pipeline runs one generation to warm up (and compile), then one counted generation with another
prompt. Writes ``<out>/round_counts.json`` (device, versions, command, per row the counts) and
``<out>/round_counts.md`` (a table).
"""

import argparse
import json
import os
import platform
import sys

import torch

import spatial_pipelines
from spatial_pipelines.cli import embedded_heads_path, load_pipeline
from spatial_pipelines.core.contracts import DRAFTER, OFFSET_LOGITS
from spatial_pipelines.decoders import DECODERS
from spatial_pipelines.embedded import default_model_path
from spatial_pipelines.pipelines.round_counts import count_rounds

PROMPTS = ("a red heart", "a smiling face with sunglasses")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="pipeline folder (default: the embedded model)")
    p.add_argument("--heads", nargs="*", default=None, help="draft heads folders, one per kind (default: the embedded model's)")
    p.add_argument("--decoders", nargs="+", default=["ar", "sjd", "medusa", "eagle"], choices=sorted(DECODERS))
    p.add_argument("--images", type=int, nargs="+", default=[1, 4], help="images per call")
    p.add_argument("--modes", nargs="+", default=["eager", "compiled"], choices=["eager", "compiled"])
    p.add_argument("--backend", default="inductor", help="torch.compile backend of the compiled rows")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if min(args.images) < 1:
        p.error(f"--images must be >= 1, got {args.images}")
    return args


def load(args, compiled: bool):
    """A fresh pipeline (a compiled step is kept per pipeline) and the heads of ``--heads`` by kind (loaded once, then
    detached until a decoder needs them)."""
    pipe = load_pipeline(args.model or default_model_path())
    pipe.set_progress_bar_config(disable=True)
    if compiled:
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)  # a graph per row
        pipe.enable_compile(backend=args.backend, keep_if_slower=True)
    heads = {}
    for path in args.heads if args.heads is not None else [embedded_heads_path(k) for k in (OFFSET_LOGITS, DRAFTER)]:
        loaded = pipe.load_draft_heads(path)
        heads[loaded.provides.kind] = loaded
    pipe.set_draft_heads(None)
    return pipe, heads


def count_row(pipe, heads, name: str, images: int) -> dict:
    pipe.decoder = DECODERS[name]()
    need = pipe.decoder.heads_needed()
    pipe.set_draft_heads(None if need is None else next(heads[k] for k in need.kinds if k in heads))
    generators = [torch.Generator().manual_seed(i) for i in range(images)]
    pipe(PROMPTS[0], num_images_per_prompt=images, generator=generators, output_type="latent")
    with count_rounds(pipe) as counts:
        out = pipe(PROMPTS[1], num_images_per_prompt=images, generator=generators, output_type="latent")
    config = {k: v for k, v in pipe.decoder.config.items() if not k.startswith("_")}
    return {"decoder": name, "images": images, "decoder_config": {**config, **pipe.decoder.fixed_sizes()},
            "codes_per_pass_per_row": float(out.stats.mean_accepted_length), **counts.as_dict()}


def markdown(rows) -> str:
    lines = ["| decoder | mode | images | rounds | host reads / round | eager ops / round | compiled regions / round | recompiles |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['decoder']} | {r['mode']} | {r['images']} | {r['rounds']} | {r['host_reads_per_round']:.2f} | "
                     f"{r['eager_ops_per_round']:.1f} | {r['compiled_calls_per_round']:.2f} | {r['recompiles']} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for mode in args.modes:
        pipe, heads = load(args, mode == "compiled")
        for name in args.decoders:
            for images in args.images:
                rows.append({"mode": mode, **count_row(pipe, heads, name, images)})
                print(markdown(rows[-1:]).splitlines()[-1], flush=True)
    report = {"device": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
              "model": args.model or "embedded twemoji_llamagen", "backend": args.backend, "command": " ".join(sys.argv),
              "versions": {"torch": torch.__version__, "spatial_pipelines": spatial_pipelines.__version__}, "rows": rows}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "round_counts.json"), "w") as f:
        json.dump(report, f, indent=2)
    with open(os.path.join(args.out, "round_counts.md"), "w") as f:
        f.write(markdown(rows))
    return report


if __name__ == "__main__":
    main()
