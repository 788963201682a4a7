#!/usr/bin/env python
"""Do "auto" draft sizes hold? Fresh processes, one after another, each load the pipeline, measure the pass cost
the way a generation does (`pipe.pass_cost`) and resolve ``"auto"`` for each decoder; the sizes they choose are
compared.

    python scripts/check_auto_sizes.py --processes 5 --decoders sjd medusa hawk --out docs/performance/auto_sizes
    python scripts/check_auto_sizes.py --model <pipeline folder> --processes 2 --decoders sjd --out /tmp/auto

Each process is a new interpreter (nothing measured is shared); they run one at a time, so they do not slow each
other down. Writes ``<out>/auto_sizes.json``: per process the chosen sizes and the measured pass costs, and per
decoder whether every process agreed.
"""

import argparse
import json
import os
import platform
import subprocess
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")  # as the benchmark runs


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="pipeline folder (default: the embedded model)")
    p.add_argument("--decoders", nargs="+", default=["sjd", "medusa", "hawk"], choices=["sjd", "medusa", "hawk"])
    p.add_argument("--processes", type=int, default=5)
    p.add_argument("--images", type=int, default=1, help="images per call the sizes are chosen for")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--out", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.processes < 1:
        p.error(f"--processes must be >= 1, got {args.processes}")
    if args.images < 1:
        p.error(f"--images must be >= 1, got {args.images}")
    if not args.worker and args.out is None:
        p.error("--out is required")
    return args


def worker(args) -> dict:
    """In a fresh process: the sizes ``"auto"`` chooses for each decoder, and the pass costs they came from (the
    choice needs no heads: it weighs the decoder's prior against the measured cost)."""
    import torch

    from spatial_pipelines.cli import load_pipeline
    from spatial_pipelines.decoders import DECODERS
    from spatial_pipelines.embedded import default_model_path

    torch.set_num_threads(args.threads)
    pipe = load_pipeline(args.model or default_model_path(), torch_dtype=getattr(torch, args.dtype))
    rows = args.images * (2 if pipe.backbone.default_guidance_scale != 1.0 else 1)
    rows = min(rows, 4 * (2 if pipe.backbone.default_guidance_scale != 1.0 else 1))  # as the loop measures
    cost = pipe.pass_cost(rows)
    chosen = {}
    for name in args.decoders:
        decoder = DECODERS[name]()
        decoder.resolve_draft_size(cost)
        chosen[name] = decoder.tree.num_nodes - 1
    return {"chosen": chosen, "pass_cost_ms": {str(t): 1e3 * s for t, s in sorted(cost.seconds.items())}}


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return None
    os.makedirs(args.out, exist_ok=True)
    command = [sys.executable, os.path.abspath(__file__), "--worker", "--decoders", *args.decoders, "--images", str(args.images),
               "--threads", str(args.threads), "--dtype", args.dtype]
    if args.model:
        command += ["--model", args.model]
    runs = []
    for i in range(args.processes):
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"process {i + 1}: {runs[-1]['chosen']}", flush=True)
    agreed = {name: len({r["chosen"][name] for r in runs}) == 1 for name in args.decoders}
    report = {"device": f"cpu ({platform.processor() or platform.machine()}, {args.threads} threads)", "dtype": args.dtype,
              "model": args.model or "embedded twemoji_llamagen", "images_per_call": args.images, "processes": runs,
              "agreed": agreed}
    with open(os.path.join(args.out, "auto_sizes.json"), "w") as f:
        json.dump(report, f, indent=2)
    print("agreed:", agreed)
    return report


if __name__ == "__main__":
    main()
