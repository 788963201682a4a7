#!/usr/bin/env python
"""Where a decoding round's time goes: the target pass cost ``c(T)`` for ``T`` fed tokens on this device, and per
decoder the split of a round into draft (heads, tree building), forward (embedding, target pass, norm and
image-code head), accept (CFG mix, sampling, exact acceptance, commit), kv (cache compaction or crop), eol and the
rest. The cost model it checks: speed-up ~= (codes per pass) / (round cost / AR step cost).

    python scripts/bench_cost.py --decoders ar medusa hawk sjd sjd:init=left --num-prompts 6 --out docs/performance

Writes ``<out>/cost.json`` and ``<out>/cost.png`` (c(T) relative to c(1), and the stacked round breakdown per
decoder), prints markdown tables. Decoders and heads are given as for ``scripts/benchmark.py`` (the embedded
model's shipped heads are used by default).
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")  # as scripts/benchmark.py: before torch's OpenMP start-up

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

import spatial_pipelines  # noqa: E402
from spatial_pipelines.cli import load_pipeline  # noqa: E402
from spatial_pipelines.data import TwemojiDataset  # noqa: E402
from spatial_pipelines.embedded import default_model_path  # noqa: E402
from spatial_pipelines.pipelines import PassCost  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark import parse_decoder  # noqa: E402

SECTIONS = ("draft", "eol", "forward", "accept", "kv")


def parse_args(argv=None):
    e = os.path.dirname(default_model_path())
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="pipeline folder (default: the embedded model)")
    p.add_argument("--decoders", nargs="+", type=parse_decoder, default=[parse_decoder(d) for d in ("ar", "medusa", "hawk", "sjd")])
    p.add_argument("--heads", nargs="*", default=[os.path.join(e, "twemoji_llamagen_spatial_heads"), os.path.join(e, "twemoji_llamagen_latent_heads")])
    p.add_argument("--num-prompts", type=int, default=6)
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64], help="fed tokens T for c(T)")
    p.add_argument("--repeats", type=int, default=20, help="timed passes per T")
    p.add_argument("--limit", type=int, default=None, help="use only the first N Twemoji as prompts (smoke tests)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--out", default="docs/performance")
    args = p.parse_args(argv)
    if any(t < 1 for t in args.sizes) or args.repeats < 1 or args.num_prompts < 1:
        p.error("--sizes, --repeats and --num-prompts must be >= 1")
    return args


@torch.no_grad()
def acceptance_by_depth(decoder, committed: torch.Tensor):
    """Where a decoder's codes per pass are lost: ``[P(draft d accepted | drafts before it accepted)]`` for the
    depths of a static draft (SJD's window, Medusa's and Hawk's trees), from the codes each pass committed
    (``k`` codes: ``k - 1`` accepted drafts and one bonus or resampled code). ``None`` for AR and for trees whose
    depth changes per round (EAGLE-2, ADT-Tree)."""
    tree = getattr(decoder, "tree", None)
    if tree is None or getattr(decoder, "uses_drafter_passes", False):
        return None
    accepted = committed.long() - 1  # (passes,) drafts accepted per pass
    rates = []
    for d in range(tree.max_depth):
        tried = int((accepted >= d).sum())
        rates.append(int((accepted >= d + 1).sum()) / tried if tried else None)
    return rates


def load_with_heads(args):
    """The pipeline, and the heads of ``--heads`` by kind (loaded, then detached until a decoder needs them)."""
    pipe = load_pipeline(args.model or default_model_path(), torch_dtype=getattr(torch, args.dtype)).to(args.device)
    pipe.set_progress_bar_config(disable=True)
    heads = {}
    for path in args.heads:
        loaded = pipe.load_draft_heads(path)
        heads[loaded.provides.kind] = loaded
    pipe.set_draft_heads(None)
    return pipe, heads


def build_decoders(args, heads) -> dict:
    """``{spec: (decoder, heads it drafts with or None)}`` for every decoder spec."""
    decoders = {}
    for spec, decoder_cls, kwargs in args.decoders:
        if decoder_cls is None:
            continue
        decoder = decoder_cls(**kwargs)
        needed, need = decoder.heads_needed(), None  # need: the kind of loaded heads the decoder runs with
        if needed is not None:
            need = next((k for k in needed.kinds if k in heads), None)
            if need is None:
                raise SystemExit(f"decoder {spec!r} needs {needed.describe()}: pass their folder with --heads")
        decoders[spec] = (decoder, heads.get(need))
    return decoders


def profile_decoders(args, pipe, decoders: dict, prompts) -> dict:
    """Every decoder warmed up once (and its "auto" sizes resolved), then run on every prompt with its rounds
    profiled, interleaved: a slow spell of the machine hits every decoder alike. Per decoder: seconds per section,
    rounds, passes, wall clock and the codes each pass committed."""
    sync = torch.cuda.synchronize if str(args.device).startswith("cuda") else None
    totals = {spec: {"seconds": {}, "rounds": 0, "passes": 0, "wall": 0.0, "accepted": []} for spec in decoders}
    for spec, (decoder, h) in decoders.items():
        pipe.decoder = decoder
        pipe.set_draft_heads(h)
        pipe(prompts[:1], output_type="latent", generator=torch.Generator().manual_seed(0))
    for i, prompt in enumerate(prompts):
        for spec, (decoder, h) in decoders.items():
            pipe.decoder = decoder
            pipe.set_draft_heads(h)
            with pipe.profile_rounds(synchronize=sync) as timer:
                start = time.perf_counter()
                out = pipe([prompt], output_type="latent", generator=[torch.Generator().manual_seed(args.seed + i)])
                totals[spec]["wall"] += time.perf_counter() - start
            for k, v in timer.seconds.items():
                totals[spec]["seconds"][k] = totals[spec]["seconds"].get(k, 0.0) + v
            totals[spec]["rounds"] += timer.rounds
            totals[spec]["passes"] += out.stats.num_forward_passes
            totals[spec]["accepted"].append(out.stats.accepted_lengths[1:, 0])  # codes per pass, prefill excluded
    return totals


def decoder_rows(totals: dict, decoders: dict, num_tokens: int, num_prompts: int) -> dict:
    """Per decoder: the round's split in ms, codes per pass, acceptance by depth, and against AR's step the
    predicted and measured speed-ups."""
    rows = {}
    for spec, tot in totals.items():
        decoder = decoders[spec][0]
        round_ms = 1000 * tot["seconds"]["round"] / tot["rounds"]
        ms = {k: 1000 * tot["seconds"].get(k, 0.0) / tot["rounds"] for k in SECTIONS}
        ms["other"] = round_ms - sum(ms.values())
        rows[spec] = {
            "decoder_class": type(decoder).__name__,
            "fed_tokens_per_round": decoder.max_draft_tokens,
            "codes_per_pass": num_tokens * num_prompts / tot["passes"],
            "round_ms": round_ms,
            "breakdown_ms": ms,
            "outside_forward_share": 1 - ms["forward"] / round_ms,
            "seconds_per_image": tot["wall"] / num_prompts,
            "acceptance_by_depth": acceptance_by_depth(decoder, torch.cat(tot["accepted"])),
        }
    base = rows.get("ar")
    for r in rows.values():
        if base:
            r["round_cost_vs_ar_step"] = r["round_ms"] / base["round_ms"]
            r["predicted_speedup"] = r["codes_per_pass"] / r["round_cost_vs_ar_step"]
            r["measured_speedup"] = base["seconds_per_image"] / r["seconds_per_image"]
    return rows


def run(args) -> dict:
    """``c(T)`` for every ``--sizes``, and every decoder's rounds profiled: the report."""
    pipe, heads = load_with_heads(args)
    backbone = pipe.backbone
    batch_rows = 2 if backbone.default_guidance_scale != 1.0 else 1
    c = PassCost(backbone, batch_rows, repeats=args.repeats, warmup=3).measure(args.sizes)
    prompts = random.Random(args.seed).sample(TwemojiDataset("all", 96, limit=args.limit).captions, args.num_prompts)
    decoders = build_decoders(args, heads)
    totals = profile_decoders(args, pipe, decoders, prompts)
    return {
        "model": args.model or "embedded twemoji_llamagen",
        "device": (torch.cuda.get_device_name(args.device) if str(args.device).startswith("cuda")
                   else f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')})"),
        "dtype": args.dtype,
        "versions": {"spatial_pipelines": spatial_pipelines.__version__, "torch": torch.__version__},
        "batch_rows": batch_rows,
        "pass_cost_ms": {str(t): 1000 * s for t, s in c.items()},
        "num_prompts": len(prompts),
        "decoders": decoder_rows(totals, decoders, backbone.layout.num_tokens, len(prompts)),
    }


def markdown_tables(report: dict) -> list:
    """``cost.md``: c(T), the round split per decoder, and where each static draft loses its codes."""
    c = {int(t): ms for t, ms in report["pass_cost_ms"].items()}
    rows = report["decoders"]
    lines = ["| T fed | c(T) ms | c(T) / c(1) |", "|---|---|---|"]
    lines += [f"| {t} | {ms:.2f} | {ms / c[min(c)]:.2f} |" for t, ms in c.items()]
    lines += ["", "| decoder | fed / round | codes / pass | round ms | " + " | ".join(f"{k} ms" for k in SECTIONS)
              + " | other ms | outside forward | round / AR step | predicted speed-up | measured speed-up |",
              "|" + "---|" * (9 + len(SECTIONS))]
    for spec, r in rows.items():
        b = r["breakdown_ms"]
        lines.append(f"| `{spec}` | {r['fed_tokens_per_round']} | {r['codes_per_pass']:.2f} | {r['round_ms']:.2f} | "
                     + " | ".join(f"{b[k]:.2f}" for k in SECTIONS) + f" | {b['other']:.2f} | {100 * r['outside_forward_share']:.0f}% | "
                     f"{r.get('round_cost_vs_ar_step', float('nan')):.2f} | {r.get('predicted_speedup', float('nan')):.2f}x | "
                     f"{r.get('measured_speedup', float('nan')):.2f}x |")
    depths = {spec: r["acceptance_by_depth"] for spec, r in rows.items() if r["acceptance_by_depth"]}
    if depths:  # where the codes per pass are lost
        shown = min(8, max(len(v) for v in depths.values()))
        lines += ["", "| decoder | " + " | ".join(f"draft {d + 1}" for d in range(shown)) + " |", "|" + "---|" * (shown + 1)]
        for spec, rates in depths.items():
            cells = [f"{rates[d]:.2f}" if d < len(rates) and rates[d] is not None else "-" for d in range(shown)]
            lines.append(f"| `{spec}` | " + " | ".join(cells) + " |")
    return lines


def write(args, report: dict) -> None:
    """``cost.json``, ``cost.md`` (also printed) and ``cost.png``."""
    with open(os.path.join(args.out, "cost.json"), "w") as f:
        json.dump(report, f, indent=2)
    lines = markdown_tables(report)
    with open(os.path.join(args.out, "cost.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(report, os.path.join(args.out, "cost.png"))


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    write(args, run(args))


def plot(report, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6), dpi=110)
    ts = [int(t) for t in report["pass_cost_ms"]]
    ms = list(report["pass_cost_ms"].values())
    a.plot(ts, [m / ms[0] for m in ms], marker="o")
    a.set_xscale("log", base=2)
    a.set_xlabel("fed tokens T")
    a.set_ylabel("c(T) / c(1)")
    a.set_title(f"target pass cost\n{report['device']}", fontsize=7)
    a.grid(alpha=0.3)
    names = list(report["decoders"])
    bottom = [0.0] * len(names)
    for k in SECTIONS + ("other",):
        vals = [report["decoders"][n]["breakdown_ms"][k] for n in names]
        b.bar(range(len(names)), vals, bottom=bottom, label=k)
        bottom = [x + y for x, y in zip(bottom, vals)]
    b.set_xticks(range(len(names)), [n.replace(":", "\n").replace(",", "\n") for n in names], fontsize=6, rotation=30, ha="right")
    b.set_ylabel("ms per round")
    b.set_title("round breakdown", fontsize=8)
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    main()
