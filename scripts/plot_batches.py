"""Speed-up against images per prompt, from one or more `scripts/benchmark.py` reports (``benchmark.json``).

One line per decoder: eager rows solid, compiled rows dashed, each row's speed-up taken against AR run the same way in
its own report (``speedup_vs_ar`` for an eager row, ``speedup_vs_compiled_ar`` for a compiled one). A ``--compile``
run holds both kinds; two runs (an eager one and a ``--compile --skip-eager`` one) also share a plot without comparing
seconds across runs::

    python scripts/plot_batches.py docs/benchmarks/v3/batches/benchmark.json \\
        --out docs/benchmarks/v3/speedup_vs_batch.png
"""

import argparse
import json
from typing import Dict, List, Tuple

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

REFERENCE_ROW = "minimal gpt-fast-style AR loop (scripts/minimal_ar.py)"


def speedup_lines(reports: List[dict]) -> Dict[Tuple[str, bool], List[Tuple[int, float]]]:
    """``{(decoder, compiled): [(images per prompt, speed-up vs AR run the same way), ...]}``, sorted by images; AR's
    own rows (1.0 by definition) and the minimal reference loop are left out."""
    lines: Dict[Tuple[str, bool], List[Tuple[int, float]]] = {}
    for report in reports:
        for row in report["decoders"].values():
            if row.get("decoder_class") == REFERENCE_ROW or row["decoder"] == "ar":
                continue
            speedup = row["speedup_vs_compiled_ar"] if row["compiled"] else row["speedup_vs_ar"]
            if speedup is None:
                raise ValueError(f"Row {row['decoder']!r} ({'compiled' if row['compiled'] else 'eager'}, "
                                 f"x{row['images_per_prompt']}) has no AR row run the same way in its report.")
            lines.setdefault((row["decoder"], row["compiled"]), []).append((row["images_per_prompt"], speedup))
    if not lines:
        raise ValueError("The reports hold no decoder row besides AR.")
    return {key: sorted(points) for key, points in lines.items()}


def plot(reports: List[dict], path: str) -> None:
    """Draw `speedup_lines` of ``reports`` to ``path``: one colour per decoder, eager solid, compiled dashed."""
    lines = speedup_lines(reports)
    decoders = list(dict.fromkeys(name for name, _ in lines))
    colours = {name: plt.get_cmap("tab10")(i % 10) for i, name in enumerate(decoders)}
    fig, ax = plt.subplots(figsize=(6.0, 4.0), dpi=120)
    for (name, compiled), points in lines.items():
        x, y = zip(*points)
        ax.plot(x, y, "--" if compiled else "-", marker="o", color=colours[name],
                label=f"{name} ({'compiled' if compiled else 'eager'})")
    batches = sorted({n for points in lines.values() for n, _ in points})
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(n) for n in batches])
    ax.set_xlabel("images per prompt")
    ax.set_ylabel("speed-up vs AR run the same way")
    ax.legend(fontsize=6, ncol=2)
    first = reports[0]
    prompts = "/".join(str(r.get("num_prompts_timed", r["num_prompts"])) for r in reports)
    ax.set_title(f"{first['model']}, {first['dtype']}, {prompts} prompts\n{first['device']}", fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("reports", nargs="+", help="benchmark.json files of scripts/benchmark.py")
    p.add_argument("--out", required=True, help="the PNG to write")
    args = p.parse_args(argv)
    reports = []
    for path in args.reports:
        with open(path) as f:
            reports.append(json.load(f))
    plot(reports, args.out)
    print(args.out)


if __name__ == "__main__":
    main()
