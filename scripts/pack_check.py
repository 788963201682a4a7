#!/usr/bin/env python
"""One eager target pass on weights as stored against the same pass on weights packed for MKL's GEMM
(`pipe.pack_weights`), interleaved in one process, per number of rows and fed tokens: what packing saves on a
whole pass (attention, norms and the code head included), beside ``scripts/cpu_gemm.py``'s single layer.

    python scripts/pack_check.py --threads 2 --shapes 1x9 2x9 4x1 4x9 --out docs/benchmarks/pack_check

``RxT`` is R rows (images, times 2 with CFG) feeding T tokens each. Writes ``<out>/pack_check.json`` (device,
versions, settings, milliseconds per pass) and prints a markdown table. The embedded model by default.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")  # as scripts/benchmark.py: before torch's OpenMP start-up

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402

import spatial_pipelines  # noqa: E402
from spatial_pipelines.cli import load_pipeline  # noqa: E402
from spatial_pipelines.embedded import default_model_path  # noqa: E402
from spatial_pipelines.pipelines import PassCost  # noqa: E402
from spatial_pipelines.pipelines.packed_weights import PackedWeights, mkl_packing_available, packable_linears  # noqa: E402


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
    if not mkl_packing_available():
        raise SystemExit("pack_check: this torch build has no MKL packed GEMM (torch.ops.mkl._mkl_linear)")
    if args.threads:
        torch.set_num_threads(args.threads)
    pipe = load_pipeline(args.model or default_model_path(), torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    backbone = pipe.backbone
    packs, linears = PackedWeights(), packable_linears(backbone.target_module)
    rows_out = []
    for rows, fed in args.shapes:
        times = {"as stored": [], "packed": []}
        for rep in range(args.repeats):
            for mode in (("as stored", "packed") if rep % 2 == 0 else ("packed", "as stored")):  # interleaved
                cost = PassCost(backbone, rows, repeats=1, warmup=1)  # a fresh cache each: filling it is untimed
                if mode == "packed":
                    with packs.applied(linears, rows * fed):
                        times[mode].append(cost.measure([fed])[fed])
                else:
                    times[mode].append(cost.measure([fed])[fed])
        ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
        rows_out.append({"rows": rows, "fed": fed, "ms_as_stored": ms["as stored"], "ms_packed": ms["packed"],
                         "packed_over_as_stored": ms["packed"] / ms["as stored"]})
    report = {"model": args.model or "embedded twemoji_llamagen", "device": f"cpu ({platform.processor() or platform.machine()}, "
              f"{torch.get_num_threads()} threads, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')})",
              "command": " ".join(["pack_check.py"] + list(sys.argv[1:] if argv is None else argv)),
              "dtype": "float32", "repeats": args.repeats, "linear_layers": len(linears),
              "versions": {"spatial_pipelines": spatial_pipelines.__version__, "torch": torch.__version__},
              "shapes": rows_out}
    lines = ["| rows x fed | ms / pass, as stored | ms / pass, packed | packed / as stored |", "|---|---:|---:|---:|"]
    lines += [f"| {r['rows']} x {r['fed']} | {r['ms_as_stored']:.2f} | {r['ms_packed']:.2f} | {r['packed_over_as_stored']:.2f} |"
              for r in rows_out]
    print("\n".join(lines))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "pack_check.json"), "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
