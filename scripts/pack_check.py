#!/usr/bin/env python
"""One eager target pass on weights as stored against the same pass on weights packed for each GEMM kernel this torch
has (MKL's and oneDNN's: `pipe.pack_weights`), interleaved in one process, per number of rows and fed tokens: what
packing saves on a whole pass (attention, norms and the code head included), beside ``scripts/cpu_gemm.py``'s single
layer, and the kernel `PackedWeights.choose` times fastest for the pipeline's default.

    python scripts/pack_check.py --threads 2 --shapes 1x9 2x9 4x1 4x9 --out docs/benchmarks/pack_check

``RxT`` is R rows (images, times 2 with CFG) feeding T tokens each. Writes ``<out>/pack_check.json`` (device,
versions, settings, milliseconds per pass) and prints a markdown table. The embedded model by default.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")  # as scripts/benchmark.py: before torch's OpenMP start-up

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402

import spatial_pipelines  # noqa: E402
from keyed_noise_cost import cpu_name  # noqa: E402
from spatial_pipelines.cli import load_pipeline  # noqa: E402
from spatial_pipelines.embedded import default_model_path  # noqa: E402
from spatial_pipelines.pipelines import PassCost  # noqa: E402
from spatial_pipelines.pipelines.packed_weights import PackedWeights, available_kernels, packable_linears  # noqa: E402


def shape(text: str):
    rows, _, fed = text.partition("x")
    if not (rows.isdigit() and fed.isdigit() and int(rows) > 0 and int(fed) > 0):
        raise argparse.ArgumentTypeError(f"a shape is ROWSxFED with two positive integers, e.g. 2x9; got {text!r}")
    return int(rows), int(fed)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="pipeline folder (default: the embedded model)")
    p.add_argument("--shapes", type=shape, nargs="+", default=[shape(s) for s in ("1x9", "2x9", "4x1", "4x9")])
    p.add_argument("--repeats", type=int, default=7, help="interleaved measurements per shape and setting (median)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--out", default=None, help="folder for pack_check.json")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be at least 1, got {args.repeats}")
    return args


def main(argv=None):
    args = parse_args(argv)
    kernels = available_kernels()
    if not kernels:
        raise SystemExit("pack_check: this torch build has neither MKL's nor oneDNN's packed GEMM")
    if args.threads:
        torch.set_num_threads(args.threads)
    pipe = load_pipeline(args.model or default_model_path(), torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    backbone = pipe.backbone
    packs, linears = PackedWeights(), packable_linears(backbone.target_module)
    modes = ["as stored"] + kernels
    rows_out = []
    for rows, fed in args.shapes:
        times = {mode: [] for mode in modes}
        for rep in range(args.repeats):
            for mode in modes[rep % len(modes):] + modes[: rep % len(modes)]:  # interleaved, each repeat one later
                cost = PassCost(backbone, rows, repeats=1, warmup=1)  # a fresh cache each: filling it is untimed
                with packs.applied(linears, rows * fed, mode) if mode != "as stored" else contextlib.nullcontext():
                    times[mode].append(cost.measure([fed])[fed])
        ms = {mode: 1e3 * statistics.median(v) for mode, v in times.items()}
        chosen = pipe.loop.pack_kernel(linears, rows * fed)  # what the pipeline's eager rounds would run on
        rows_out.append({"rows": rows, "fed": fed, "ms_as_stored": ms["as stored"],
                         **{f"ms_{k}": ms[k] for k in kernels}, "chosen": chosen or "as stored"})
    report = {"model": args.model or "embedded twemoji_llamagen", "device": f"cpu ({cpu_name()}, "
              f"{torch.get_num_threads()} threads, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')})",
              "command": " ".join(["pack_check.py"] + list(sys.argv[1:] if argv is None else argv)),
              "dtype": "float32", "repeats": args.repeats, "linear_layers": len(linears),
              "versions": {"spatial_pipelines": spatial_pipelines.__version__, "torch": torch.__version__},
              "shapes": rows_out}
    lines = ["| rows x fed | ms / pass, as stored | " + " | ".join(f"ms / pass, {k}" for k in kernels) + " | timed choice |",
             "|---|---:|" + "---:|" * len(kernels) + "---|"]
    lines += [f"| {r['rows']} x {r['fed']} | {r['ms_as_stored']:.2f} | " + " | ".join(f"{r[f'ms_{k}']:.2f}" for k in kernels)
              + f" | {r['chosen']} |" for r in rows_out]
    print("\n".join(lines))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "pack_check.json"), "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
