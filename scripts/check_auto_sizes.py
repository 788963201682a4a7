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
    p.add_argument("--heads", default=None, help="draft heads folder for decoders that need them (default: the embedded model's)")
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
    """In a fresh process: the sizes ``"auto"`` chooses for each decoder as a generation would (`resolve_draft_sizes`,
    with the decoder's heads loaded), the pass costs and the fitted curve they came from, and each decoder's
    measured round overhead."""
    import torch

    from spatial_pipelines.cli import embedded_heads_path, load_pipeline
    from spatial_pipelines.decoders import DECODERS
    from spatial_pipelines.embedded import default_model_path

    torch.set_num_threads(args.threads)
    pipe = load_pipeline(args.model or default_model_path(), torch_dtype=getattr(torch, args.dtype))
    chosen, overhead = {}, {}
    for name in args.decoders:
        decoder = DECODERS[name]()
        pipe.decoder = decoder
        need = decoder.heads_needed()
        if need is not None:
            pipe.load_draft_heads(args.heads or embedded_heads_path(need.kinds[0]))
        pipe.resolve_draft_sizes(args.images)
        chosen[name] = decoder.tree.num_nodes - 1
        for kept in pipe.__dict__["_round_overheads"].get(decoder, {}).values():
            overhead[name] = {str(n): 1e3 * s for n, s in sorted(kept.seconds.items())}
    costs = next(iter(pipe.__dict__["_pass_costs"].values()))
    fit = costs.fitted()
    return {"chosen": chosen, "pass_cost_ms": {str(t): 1e3 * s for t, s in sorted(costs.seconds.items())},
            "fitted_pass_cost_ms": {"base": 1e3 * fit.base, "slope": 1e3 * fit.slope, "extra_slope": 1e3 * fit.extra_slope,
                                    "knee": fit.knee},
            "round_overhead_ms": overhead}


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
    if args.heads:
        command += ["--heads", args.heads]
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
