#!/usr/bin/env python
"""What `pipe.tune_decoder` picks, and does it hold? Fresh processes, one after another, each load the pipeline and
tune each decoder for each batch size (`tune_decoder(batch_size=n)`: the pass cost ``c(T)`` and the decoder's own
work measured the way ``"auto"`` measures them); the sizes they choose are compared.

    python scripts/check_auto_sizes.py --processes 3 --decoders sjd medusa hawk eagle --images 1 4 8 --out docs/benchmarks/v2/tuned_sizes
    python scripts/check_auto_sizes.py --model <pipeline folder> --processes 2 --decoders sjd --out /tmp/auto

Each process is a new interpreter (nothing measured is shared); they run one at a time, so they do not slow each
other down. Writes ``<out>/auto_sizes.json``: per process the chosen sizes (per decoder, per batch size) and the
measured pass costs, and per decoder and batch size whether every process agreed.
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
    p.add_argument("--decoders", nargs="+", default=["sjd", "medusa", "hawk", "eagle"], choices=["sjd", "medusa", "hawk", "eagle"])
    p.add_argument("--processes", type=int, default=5)
    p.add_argument("--heads", default=None, help="draft heads folder for decoders that need them (default: the embedded model's)")
    p.add_argument("--images", type=int, nargs="+", default=[1], help="images per call the sizes are chosen for (one tuning each)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--sweeps", type=int, default=None, help="timed sweeps per measurement (default: the library's, SWEEPS)")
    p.add_argument("--out", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.processes < 1:
        p.error(f"--processes must be >= 1, got {args.processes}")
    if min(args.images) < 1:
        p.error(f"--images must be >= 1, got {args.images}")
    if not args.worker and args.out is None:
        p.error("--out is required")
    return args


def worker(args) -> dict:
    """In a fresh process: the size `tune_decoder` picks for each decoder at each batch size (with the decoder's heads
    loaded), each decoder's whole round per candidate size as `tune_decoder` timed it, and the target pass cost c(T) with
    its fitted curve beside them."""
    import torch

    from spatial_pipelines.cli import embedded_heads_path, load_pipeline
    from spatial_pipelines.decoders import DECODERS
    from spatial_pipelines.embedded import default_model_path

    torch.set_num_threads(args.threads)
    if args.sweeps is not None:
        import spatial_pipelines.pipelines.pass_cost as pass_cost

        pass_cost.SWEEPS = args.sweeps
    pipe = load_pipeline(args.model or default_model_path(), torch_dtype=getattr(torch, args.dtype))
    chosen, round_ms = {}, {}
    for name in args.decoders:
        pipe.decoder = DECODERS[name]()
        need = pipe.decoder.heads_needed()
        if need is not None:
            pipe.load_draft_heads(args.heads or embedded_heads_path(need.kinds[0]))
        chosen[name] = {str(n): pipe.tune_decoder(batch_size=n).config[pipe.decoder.draft_size_name] for n in args.images}
        for per_decoder in pipe.__dict__.get("_round_costs", {}).values():
            for kept in per_decoder.values():
                if type(kept.decoder) is type(pipe.decoder):
                    round_ms[name] = {str(n): 1e3 * s for n, s in sorted(kept.seconds.items())}
    costs = pipe.pass_cost(2 if pipe.backbone.default_guidance_scale > 1 else 1)
    fit = costs.fitted([1, 2, 4, 8, 16, 32])
    return {"chosen": chosen, "pass_cost_ms": {str(t): 1e3 * s for t, s in sorted(costs.seconds.items())},
            "fitted_pass_cost_ms": {"base": 1e3 * fit.base, "slope": 1e3 * fit.slope, "extra_slope": 1e3 * fit.extra_slope,
                                    "knee": fit.knee},
            "round_ms": round_ms}


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return None
    os.makedirs(args.out, exist_ok=True)
    command = [sys.executable, os.path.abspath(__file__), "--worker", "--decoders", *args.decoders, "--images", *map(str, args.images),
               *(["--sweeps", str(args.sweeps)] if args.sweeps is not None else []),
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
    agreed = {name: {str(n): len({r["chosen"][name][str(n)] for r in runs}) == 1 for n in args.images} for name in args.decoders}
    report = {"device": f"cpu ({platform.processor() or platform.machine()}, {args.threads} threads)", "dtype": args.dtype,
              "model": args.model or "embedded twemoji_llamagen", "images_per_call": args.images, "processes": runs,
              "agreed": agreed}
    with open(os.path.join(args.out, "auto_sizes.json"), "w") as f:
        json.dump(report, f, indent=2)
    print("agreed:", agreed)
    return report


if __name__ == "__main__":
    main()
