#!/usr/bin/env python
"""What one linear layer costs on the CPU by the rows a pass feeds (batch x CFG x slots): MKL's GEMM on the weights as
stored (``unpacked``: `torch.nn.functional.linear`, what an eager pass and an unfrozen compiled graph call) against
the same weights packed once for that row count (``packed``: `torch.ops.mkl._mkl_linear`, what inductor's
``freezing`` emits for a float32 linear: `enable_compile(freeze_weights=...)`). Why it matters: a speculative round
feeds several rows where AR feeds one or two, and on unpacked weights MKL leaves its few-row kernel at 4 rows.

The shapes are the embedded model's trunk (``in -> out`` of its attention and MLP projections and its head) unless
``--shapes`` names others (``512x1536`` is 512 in, 1536 out). Timed interleaved (both variants once per repeat,
medians over repeats; the spread is the noise)::

    python scripts/cpu_gemm.py --rows 1 2 3 4 5 9 17 --threads 2 --out docs/benchmarks/cpu_gemm

Writes ``<out>/cpu_gemm.json`` (device, threads, versions, command, settings, microseconds per call per shape and row
count) and prints a markdown table.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")  # as scripts/benchmark.py: before torch's OpenMP start-up

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import spatial_pipelines  # noqa: E402
from keyed_noise_cost import cpu_name  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=None,
                   help="linear shapes as INxOUT (default: the embedded model's trunk and head)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 9, 17], help="rows fed per call")
    p.add_argument("--repeats", type=int, default=7, help="timed repeats per variant (medians over them)")
    p.add_argument("--inner", type=int, default=300, help="calls per timed repeat")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--out", default="cpu_gemm")
    args = p.parse_args(argv)
    if not torch._C.has_mkl:
        p.error("this torch has no MKL: there is no packed GEMM to time")
    if min(args.rows) < 1 or args.repeats < 1 or args.inner < 1:
        p.error("--rows, --repeats and --inner must be >= 1")
    try:
        args.shape_list = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes] if args.shapes else None
    except ValueError:
        p.error(f"--shapes must be INxOUT pairs of ints, got {args.shapes}")
    if args.shape_list is not None and any(len(s) != 2 or min(s) < 1 for s in args.shape_list):
        p.error(f"--shapes must be INxOUT pairs of ints >= 1, got {args.shapes}")
    return args


def model_shapes():
    """The distinct ``(in, out)`` of the embedded model's linear layers (its trunk and head)."""
    from spatial_pipelines.embedded import load_default_pipeline

    transformer = load_default_pipeline().transformer
    return sorted({(m.in_features, m.out_features) for m in transformer.modules() if isinstance(m, torch.nn.Linear)})


def time_interleaved(functions, repeats: int, inner: int):
    """Microseconds per call of each function: every function once per repeat, in turn; median, min and max."""
    times = {name: [] for name in functions}
    with torch.no_grad():
        for fn in functions.values():  # warm-up
            for _ in range(max(inner // 10, 1)):
                fn()
        for _ in range(repeats):
            for name, fn in functions.items():
                start = time.perf_counter()
                for _ in range(inner):
                    fn()
                times[name].append(1e6 * (time.perf_counter() - start) / inner)
    return {name: {"median_us": statistics.median(t), "min_us": min(t), "max_us": max(t)} for name, t in times.items()}


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    shapes = args.shape_list or model_shapes()
    gen = torch.Generator().manual_seed(0)
    results = []
    for k, n in shapes:
        weight = torch.randn(n, k, generator=gen)
        for rows in args.rows:
            x = torch.randn(rows, k, generator=gen)
            packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)  # packed once per row count, as freezing does
            functions = {"unpacked": lambda: F.linear(x, weight),
                         "packed": lambda: torch.ops.mkl._mkl_linear(x, packed, weight, None, rows)}
            torch.testing.assert_close(functions["packed"](), functions["unpacked"](), rtol=1e-4, atol=1e-4)
            timed = time_interleaved(functions, args.repeats, args.inner)
            results += [{"in": k, "out": n, "rows": rows, "variant": v, **t} for v, t in timed.items()]
        print(f"{k}x{n}: done", flush=True)
    print(f"\n{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}, float32\n")
    print("| in x out | rows | unpacked us | packed us | unpacked / packed |")
    print("|---|---:|---:|---:|---:|")
    for r in results:
        if r["variant"] == "unpacked":
            p = next(x for x in results if x["variant"] == "packed" and (x["in"], x["out"], x["rows"]) == (r["in"], r["out"], r["rows"]))
            print(f"| {r['in']}x{r['out']} | {r['rows']} | {r['median_us']:.1f} | {p['median_us']:.1f} | "
                  f"{r['median_us'] / p['median_us']:.2f} |")
    report = {
        "command": " ".join([os.path.basename(sys.argv[0])] + (argv if argv is not None else sys.argv[1:])),
        "device": f"cpu ({cpu_name()})", "threads": torch.get_num_threads(), "dtype": "float32",
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "versions": {"spatial_pipelines": spatial_pipelines.__version__, "torch": torch.__version__},
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "shape_list")},
        "shapes": [list(s) for s in shapes],
        "results": results,
    }
    with open(os.path.join(args.out, "cpu_gemm.json"), "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
