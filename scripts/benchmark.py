#!/usr/bin/env python
"""Benchmark decoders on one pipeline, same prompts and seeds, in one run: target forward passes, mean accepted
length, wall-clock and speed-up versus the AR baseline (the same fast loop, not a slow `generate`), and with
``--quality`` FD-EffNet, caption retrieval and LPIPS diversity of each decoder's images, and the target model's
own score of each decoder's code grids (NLL per code, share of codes outside the sampling support).

    python scripts/benchmark.py --decoders ar medusa hawk sjd sjd:init=left ssd:vertical_rounds=0 \\
        ssd:num_vertical_rows=2,staged_base_rounds=2,staged_incremental_rounds=1 \\
        --heads <spatial heads folder> <latent heads folder> --quality --picture 6 --out docs/benchmarks

A decoder is ``name`` or ``name:key=value,key=value`` (values are JSON, else strings); each decoder gets the
loaded heads of the class it needs. Decoders are timed interleaved (every decoder on prompt 1, then on prompt 2
...), so a slow spell of a shared machine hits every row alike; ``minimal-ar`` adds the row of an independent
gpt-fast-style AR loop over the same weights (`scripts/minimal_ar.py`), the floor the pipeline's AR loop must match.
On a CPU the OpenMP threads spin between passes (``OMP_WAIT_POLICY=ACTIVE``, set before torch loads unless you
set it): a speculative round's small host ops would otherwise put them to sleep before every target pass. Writes ``<out>/benchmark.json``, ``<out>/benchmark.md``, with
``--picture N`` ``<out>/decoders_side_by_side.png`` (the first N prompts and seeds under every decoder), and with
``--quality`` ``<out>/speed_quality.png`` (speed-up against FD-EffNet and target NLL, exact and lossy rows marked),
and with ``--compile`` or several ``--num-images-per-prompt`` ``<out>/batches.png`` (images per second per decoder,
eager and compiled, one panel per batch).

``--compile`` adds every row run on a second copy of the pipeline with the target step compiled (`enable_compile`:
static shapes, one graph per row and batch, compiled in the row's warm-up call): rows ``<decoder> [compiled]``,
with their speed-up against eager AR and against compiled AR, the share of padded slots, and the graphs compiled
while timed (0 when every round replayed a warm graph). ``--num-images-per-prompt 1 4 8`` runs every row at each
batch (rows ``<decoder> xN``; speed-ups against AR at the same batch).
"""

import argparse
import json
import os
import platform
import random
import re
import sys
import subprocess
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from types import SimpleNamespace
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")  # must precede torch's OpenMP start-up

import diffusers
import numpy as np
import torch
import transformers
from torch._dynamo.utils import counters

import spatial_pipelines
from spatial_pipelines.cli import load_pipeline
from spatial_pipelines.data import TwemojiDataset
from spatial_pipelines.data.twemoji import split_of
from spatial_pipelines.decoders import DECODERS
from spatial_pipelines.embedded import default_model_path
from spatial_pipelines.jobs import PromptRow, generate_batches, read_prompts


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from keyed_noise_cost import cpu_name  # noqa: E402
from minimal_ar import minimal_ar_generate  # noqa: E402

MINIMAL_AR = "minimal-ar"


def parse_decoder(spec: str):
    """``"ssd:vertical_rounds=1,draft=sample"`` -> (spec, decoder class, {"vertical_rounds": 1, "draft": "sample"});
    ``"medusa:acceptance=lantern,acceptance.delta=0.2"`` -> ``{"acceptance": {"name": "lantern", "delta": 0.2}}``."""
    if spec == MINIMAL_AR:
        return spec, None, {}
    name, _, options = spec.partition(":")
    if name not in DECODERS:
        raise argparse.ArgumentTypeError(f"unknown decoder {name!r}; choose from {sorted(DECODERS)}")
    kwargs = {}
    for item in filter(None, re.split(r",(?![^\[]*\])", options)):  # commas inside [...] belong to a list value
        key, eq, value = item.partition("=")
        if not eq:
            raise argparse.ArgumentTypeError(f"decoder option {item!r} of {spec!r} is not key=value")
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            pass
        parent, dot, setting = key.partition(".")
        if dot:  # "acceptance.k=3": a setting of a dict-valued option (a rule name given before becomes its "name")
            current = kwargs.get(parent, {})
            kwargs[parent] = {**({"name": current} if isinstance(current, str) else current), setting: value}
        else:
            kwargs[key] = value
    return spec, DECODERS[name], kwargs


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="pipeline folder (default: the embedded model)")
    p.add_argument("--decoders", nargs="+", type=parse_decoder, default=[parse_decoder(d) for d in ("ar", "medusa", "hawk")])
    p.add_argument("--heads", nargs="*", default=[], help="draft heads folders; each decoder uses the ones of its class")
    p.add_argument("--num-prompts", type=int, default=50)
    p.add_argument("--prompts-file", default=None,
                   help="prompts from a .txt / .jsonl / .csv file (as `spatial-pipelines generate --prompts-file`; its first "
                        "--num-prompts rows) instead of a sample of Twemoji captions; not with --quality")
    p.add_argument("--split", default="all", choices=["all", "train", "eval"], help="where the prompts are sampled")
    p.add_argument("--batch-size", type=int, default=1, help="images per call (1: the latency setting)")
    p.add_argument("--guidance-scale", type=float, default=None)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quality", action="store_true", help="also FD-EffNet, retrieval and LPIPS diversity per decoder")
    p.add_argument("--diversity-prompts", type=int, default=4)
    p.add_argument("--diversity-samples", type=int, default=4)
    p.add_argument("--picture", type=int, default=0, help="side-by-side picture of the first N prompts")
    p.add_argument("--limit", type=int, default=None, help="use only the first N Twemoji as prompts and gallery (smoke tests)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="weights' dtype")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--compile", action="store_true",
                   help="also every row with the target step compiled (pipe.enable_compile on a second copy of the pipeline, "
                        "static shapes, kept even where slower): rows '<decoder> [compiled]', each also against compiled AR")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend of --compile")
    p.add_argument("--freeze-weights", default="auto", choices=["auto", "on", "off"],
                   help="with --compile: fold the weights into the compiled rounds (enable_compile's freeze_weights; "
                        "auto: on a CPU for float32 passes of 4 or more rows)")
    p.add_argument("--pack-weights", default="auto", choices=["auto", "on", "off"],
                   help="the eager rows' linear weights packed for MKL's GEMM (pipe.pack_weights; auto: on a CPU for "
                        "float32 passes of 4 or more rows)")
    p.add_argument("--skip-eager", action="store_true",
                   help="with --compile: only the compiled rows, each against compiled AR (the eager rows of the same "
                        "prompts come from a run without it)")
    p.add_argument("--num-images-per-prompt", type=int, nargs="+", default=[1],
                   help="images per prompt in one call; several values run every row at each (rows '<decoder> xN')")
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="start no new prompt after this many seconds of timed runs: every row is timed on the same "
                        "prompts (the first ones), and the report says how many (`num_prompts_timed`)")
    p.add_argument("--resume", action="store_true",
                   help=f"keep each timed prompt's rows in OUT/{RESUME_FILE} and, run again with the same settings on "
                        "the same code and CPU, time only the prompts it does not hold yet (a run longer than one sitting)")
    p.add_argument("--out", default="docs/benchmarks")
    args = p.parse_args(argv)
    if args.resume and (args.quality or args.picture):
        p.error("--resume keeps the timings, not the images --quality and --picture score: run those without it")
    if args.time_budget_s is not None and not args.time_budget_s > 0:
        p.error(f"--time-budget-s must be a positive number of seconds, got {args.time_budget_s}")
    if args.time_budget_s is not None and (args.quality or args.picture):
        p.error("--time-budget-s times fewer prompts than --quality and --picture score: run those without it")
    if args.skip_eager and not args.compile:
        p.error("--skip-eager leaves only the compiled rows: pass --compile with it")
    if args.skip_eager and (args.quality or args.picture):
        p.error("--skip-eager: --quality and --picture score the eager one-image rows, which it skips")
    if args.prompts_file is not None and args.quality:
        p.error("--quality scores against the Twemoji captions' images: sample them (no --prompts-file)")
    return args


def run_decoder(pipe, prompts, args, seed_offset=0, output_type="latent", num_images_per_prompt=1):
    """Generate ``prompts`` through the jobs' prompt loop (`spatial_pipelines.jobs.generate_batches`: one seeded
    generator per image, prompt ``j`` seeded ``args.seed + seed_offset + j``); returns outputs, code grids and the
    summed cost (passes and tokens per image)."""
    outs, grids = [], []
    cost = {"passes": 0, "draft_passes": 0, "tokens": 0, "images": 0, "accepted_sum": 0.0, "accepted_count": 0, "seconds": 0.0, "tree_depth": [], "tree_width": [],
            "padded": [], "compiled_graphs": 0}
    rows = [PromptRow(j, prompt) for j, prompt in enumerate(prompts)]
    call = dict(guidance_scale=args.guidance_scale, temperature=args.temperature, top_k=args.top_k, output_type=output_type)
    batches = generate_batches(pipe, rows, seed=args.seed + seed_offset, images_per_prompt=num_images_per_prompt,
                               batch_size=args.batch_size, call_kwargs=call)
    while True:
        graphs = counters["stats"]["unique_graphs"]
        try:
            keys, out, seconds = next(batches)
        except StopIteration:
            break
        cost["seconds"] += seconds
        cost["compiled_graphs"] += counters["stats"]["unique_graphs"] - graphs  # a timed call that compiled: a recompile
        images = len(keys)
        cost["images"] += images
        cost["passes"] += out.stats.num_forward_passes * images
        cost["draft_passes"] += out.stats.num_draft_passes * images
        accepted, row_passes = out.stats.accepted_lengths, torch.tensor(out.stats.row_forward_passes)
        ran = torch.arange(accepted.shape[0])[:, None] < row_passes[None]  # (passes, B) the passes each row took
        cost["accepted_sum"] += accepted[ran].float().sum().item()  # codes per pass per row, after the timed call
        cost["accepted_count"] += int(ran.sum())
        cost["tokens"] += out.stats.num_tokens
        if out.stats.padded_fraction is not None:
            cost["padded"].append(out.stats.padded_fraction)
        cost.setdefault("slowest_row_share", []).append(max(out.stats.row_forward_passes) / out.stats.num_forward_passes)
        if "mean_tree_depth" in out.stats.decoder_stats:  # dynamic trees (EAGLE-2, ADT-Tree)
            cost["tree_depth"].append(out.stats.decoder_stats["mean_tree_depth"])
            cost["tree_width"].append(out.stats.decoder_stats["mean_tree_width"])
        outs.append(out.images.cpu() * 2 - 1 if output_type == "pt" else out.tokens)
        grids.append(out.tokens.cpu())
    return torch.cat(outs), torch.cat(grids), cost


def side_by_side(images: dict, prompts, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(images)
    fig, axes = plt.subplots(len(prompts), len(names), figsize=(1.3 * len(names), 1.4 * len(prompts)), dpi=110, squeeze=False)
    for r, prompt in enumerate(prompts):
        for c, name in enumerate(names):
            ax = axes[r, c]
            ax.imshow(((images[name][r].permute(1, 2, 0).clamp(-1, 1) + 1) / 2).numpy())
            ax.set_xticks([])
            ax.set_yticks([])
            if r == 0:
                ax.set_title(name.replace(":", "\n").replace(",", "\n"), fontsize=5)
            if c == 0:
                ax.set_ylabel(prompt[:18], fontsize=5)
    fig.suptitle("same prompts and seeds under every decoder", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


@torch.no_grad()
def plot_speed_quality(report: dict, path: str) -> None:
    """Speed-up versus quality, one point per decoder row: FD-EffNet (left) and the target's NLL per code (right);
    exact rows as circles, lossy rows (LANTERN, SSD) as triangles."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {k: r for k, r in report["decoders"].items() if "fd_effnet" in r}
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.5))
    for ax, key, label in ((axes[0], "fd_effnet", "FD-EffNet to the real Twemoji (lower is better)"),
                           (axes[1], "target_nll_per_code", "target NLL per code (lower: likelier under the model)")):
        for name, r in rows.items():
            ax.scatter(r["speedup_vs_ar"], r[key], marker="o" if r["exact"] else "^", s=60,
                       color="tab:blue" if r["exact"] else "tab:red")
            ax.annotate(name, (r["speedup_vs_ar"], r[key]), fontsize=6, xytext=(4, 2), textcoords="offset points")
        ax.set_xlabel("wall-clock speed-up vs AR (same run)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].scatter([], [], marker="o", color="tab:blue", label="exact")
    axes[0].scatter([], [], marker="^", color="tab:red", label="lossy")
    axes[0].legend(loc="best")
    fig.suptitle(f"{report['model']}: {report['num_prompts']} prompts, {report['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def plot_batches(report: dict, path: str) -> None:
    """Images per second of every decoder at each images-per-prompt, eager and compiled side by side (one group of
    bars per decoder, one panel per batch), with each bar's speed-up against AR run the same way."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["decoders"].values() if r["decoder_class"] != "minimal gpt-fast-style AR loop (scripts/minimal_ar.py)"]
    batches = sorted({r["images_per_prompt"] for r in rows})
    decoders = list(dict.fromkeys(r["decoder"] for r in rows))
    modes = sorted({r["compiled"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(4.2 * len(batches), 3.8), dpi=120, squeeze=False)
    width = 0.8 / len(modes)
    for ax, n in zip(axes[0], batches):
        for m, compiled_row in enumerate(modes):
            for d, name in enumerate(decoders):
                r = next((r for r in rows if r["decoder"] == name and r["compiled"] == compiled_row and r["images_per_prompt"] == n), None)
                if r is None:
                    continue
                x = d + (m - (len(modes) - 1) / 2) * width
                ax.bar(x, r["images_per_s"], width, color="tab:orange" if compiled_row else "tab:blue",
                       label=("compiled" if compiled_row else "eager") if d == 0 else None)
                ratio = r["speedup_vs_compiled_ar"] if compiled_row else r["speedup_vs_ar"]
                if ratio is not None:
                    ax.annotate(f"{ratio:.2f}x", (x, r["images_per_s"]), ha="center", va="bottom", fontsize=6)
        ax.set_xticks(range(len(decoders)), decoders, fontsize=7, rotation=30)
        ax.set_title(f"{n} image(s) per prompt", fontsize=8)
        ax.set_ylabel("images / s")
        ax.legend(fontsize=7)
    fig.suptitle(f"{report['model']}: {report['num_prompts']} prompts, {report['device']}, {report['dtype']} "
                 "(labels: speed-up vs AR run the same way)", fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# -- running the rows --------------------------------------------------------------------------------------------
class Setup(NamedTuple):
    """One row of the report: its name, the spec it came from, and what runs it."""

    name: str
    spec: str
    decoder_cls: Optional[type]  # None: the minimal AR loop
    decoder: Any
    need: Optional[str]  # the kind of loaded heads the row runs with
    compiled: bool
    images_per_prompt: int


@dataclass
class Bench:
    """What every row shares: the pipelines (``{compiled: pipeline}``), their loaded heads (``{(compiled, kind): (heads,
    folder)}``), what ``--compile`` reported, the prompts, the sampling settings, and the ``--quality`` references."""

    pipes: Dict[bool, Any]
    heads: Dict[Tuple[bool, str], Tuple[Any, str]]
    compiled: Optional[Dict[str, Any]]
    prompts: List[Any]
    guidance: float
    top_k: Optional[int]
    quality: Optional[SimpleNamespace]
    prompts_timed: Optional[int] = None  # set when `--time-budget-s` stopped the timed runs early
    started: str = ""  # when this process started (UTC, ISO): each line of a resumed run says which process timed it
    parts: List[str] = field(default_factory=list)  # with --resume: when the process that timed each earlier batch started
    timed_here: int = 0  # batches this process timed

    @property
    def pipe(self):
        return self.pipes[False]

    def use(self, setup: Setup):
        """The pipeline of ``setup``, with its decoder and heads set."""
        p = self.pipes[setup.compiled]
        p.decoder = setup.decoder
        p.set_draft_heads(self.heads[setup.compiled, setup.need][0] if setup.need else None)
        return p


def load_pipelines(args):
    """The pipeline, and with ``--compile`` a second copy of it with the target step compiled; what enabling
    compilation reported; the heads of ``--heads`` loaded onto each."""
    pipe = load_pipeline(args.model or default_model_path(), torch_dtype=getattr(torch, args.dtype)).to(args.device)
    pipe.set_progress_bar_config(disable=True)
    pipe.pack_weights = {"auto": None, "on": True, "off": False}[args.pack_weights]
    pipes = {False: pipe}
    compiled = None
    if args.compile:
        # a second copy of the weights, compiled: the eager rows keep running eagerly beside it in the same run
        cpipe = load_pipeline(args.model or default_model_path(), torch_dtype=getattr(torch, args.dtype)).to(args.device)
        cpipe.set_progress_bar_config(disable=True)
        # one static-shape graph per decoder row and batch: more than dynamo's default limit of 8 graphs per function
        # in one run (past it dynamo would silently run eager); every timed call's compilations are counted below
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
        freeze = {"auto": None, "on": True, "off": False}[args.freeze_weights]
        compiled = cpipe.enable_compile(backend=args.compile_backend, keep_if_slower=True, freeze_weights=freeze)
        pipes[True] = cpipe
    heads = {}
    for compiled_pipe, p in pipes.items():
        for path in args.heads:
            loaded = p.load_draft_heads(path)
            heads[compiled_pipe, loaded.provides.kind] = (loaded, path)
        p.set_draft_heads(None)
    return pipes, compiled, heads


def quality_references(args, prompts, resolution) -> Optional[SimpleNamespace]:
    """What ``--quality`` scores against: every Twemoji image's features, those of each prompt's own image, the
    prompts of the diversity samples; ``None`` without ``--quality``."""
    if not args.quality:
        return None
    from spatial_pipelines.evaluation import LPIPS, EffNetFeatures, extract_features

    everything = TwemojiDataset("all", resolution, limit=args.limit)
    real_images = torch.stack([everything[i]["pixel_values"] for i in range(len(everything))])
    effnet, lpips = EffNetFeatures(), LPIPS()
    real_feats = extract_features(effnet, real_images)
    index = {c: i for i, c in enumerate(everything.captions)}
    return SimpleNamespace(
        everything=everything, effnet=effnet, lpips=lpips, real_feats=real_feats,
        matched=real_feats[[index[c] for c in prompts]],
        div_rep=[p for p in prompts[: args.diversity_prompts] for _ in range(args.diversity_samples)],
    )


def prepare(args) -> Bench:
    """The pipelines and heads, the prompts (a seeded sample of Twemoji captions, or ``--prompts-file``) and the
    quality references."""
    pipes, compiled, heads = load_pipelines(args)
    pipe = pipes[False]
    resolution = pipe.backbone.layout.height * pipe.backbone.vae_scale_factor
    real = TwemojiDataset(args.split, resolution, limit=args.limit)
    if args.prompts_file is not None:
        prompts = [row.prompt for row in read_prompts(args.prompts_file)][: args.num_prompts]
    else:
        prompts = random.Random(args.seed).sample(real.captions, args.num_prompts)
    guidance = args.guidance_scale if args.guidance_scale is not None else pipe.backbone.default_guidance_scale
    top_k = args.top_k if args.top_k is not None else pipe.backbone.default_top_k
    return Bench(pipes, heads, compiled, prompts, guidance, top_k, quality_references(args, prompts, resolution),
                 started=datetime.now(timezone.utc).isoformat(timespec="seconds"))


def row_setups(args, bench: Bench) -> List[Setup]:
    """Every row: each decoder spec at each ``--num-images-per-prompt``, eager and (with ``--compile``) compiled, each
    with a fresh decoder and the loaded heads of the kind it drafts with."""
    setups = []
    for n in args.num_images_per_prompt:
        for compiled_row in bench.pipes:
            if args.skip_eager and not compiled_row:
                continue
            for spec, decoder_cls, kwargs in args.decoders:
                name = spec + (f" x{n}" if n != 1 else "") + (" [compiled]" if compiled_row else "")
                if decoder_cls is None:
                    if n == 1 and not compiled_row:  # the reference loop: one image, eager
                        setups.append(Setup(name, spec, None, None, None, False, 1))
                    continue
                decoder = decoder_cls(**kwargs)  # a fresh config: no option leaks from another row
                needed, need = decoder.heads_needed(), None
                if needed is not None:
                    need = next((k for k in needed.kinds if (compiled_row, k) in bench.heads), None)
                    if need is None:
                        raise SystemExit(f"decoder {spec!r} needs {needed.describe()}: pass their folder with --heads")
                setups.append(Setup(name, spec, decoder_cls, decoder, need, compiled_row, n))
    return setups


def warm_up(args, bench: Bench, setups: List[Setup]) -> Dict[str, float]:
    """One untimed call per row (the only warm-up), its seconds per row: it resolves "auto" draft sizes (a one-time
    measurement of the pass cost per pipeline, charged otherwise to whichever row asks first), compiles the row's step
    shape and warms each row's code paths."""
    warmup = {}
    for setup in setups:
        start = time.perf_counter()
        if setup.decoder_cls is None:
            minimal_ar_generate(bench.pipe, bench.prompts[:1], bench.guidance, args.temperature, bench.top_k,
                                [torch.Generator().manual_seed(args.seed)])
        else:
            bench.use(setup)(bench.prompts[:1], guidance_scale=args.guidance_scale, temperature=args.temperature,
                             top_k=args.top_k, generator=torch.Generator().manual_seed(args.seed), output_type="latent",
                             num_images_per_prompt=setup.images_per_prompt)
        warmup[setup.name] = time.perf_counter() - start
    return warmup


def run_minimal_ar(args, bench: Bench, prompts, seed: int) -> tuple:
    """One timed batch of the minimal AR loop (prompt ``j`` seeded ``seed + j``), as `run_decoder` returns it."""
    pipe = bench.pipe
    gens = [torch.Generator().manual_seed(seed + j) for j in range(len(prompts))]
    start = time.perf_counter()
    grid = minimal_ar_generate(pipe, prompts, bench.guidance, args.temperature, bench.top_k, gens)
    return None, grid, {"passes": pipe.backbone.layout.num_tokens * len(gens), "draft_passes": 0, "images": len(gens),
                        "tokens": grid.numel(), "accepted_sum": 1.0, "accepted_count": 1, "seconds": time.perf_counter() - start}


def timed_runs(args, bench: Bench, setups: List[Setup], output_type: str) -> Dict[str, list]:
    """The timed runs, interleaved batch by batch (every row on batch 1, then on batch 2 ...): each row's
    `run_decoder` results (with ``--resume``, first the ones stored by earlier processes of the same run)."""
    runs, first, store = resumed_runs(args, bench, setups) if args.resume else ({s.name: [] for s in setups}, 0, None)
    start = time.perf_counter()
    for i in range(first, len(bench.prompts), args.batch_size):
        if i > first and args.time_budget_s is not None and time.perf_counter() - start > args.time_budget_s:  # at least one
            bench.prompts_timed = i  # every row ran on the same first prompts
            break
        batch = bench.prompts[i : i + args.batch_size]
        for setup in setups:
            if setup.decoder_cls is None:
                runs[setup.name].append(run_minimal_ar(args, bench, batch, args.seed + i))
                continue
            quality_row = setup.images_per_prompt == 1 and not setup.compiled  # quality columns and pictures: eager 1-image rows
            runs[setup.name].append(run_decoder(bench.use(setup), batch, args, seed_offset=i,
                                                output_type=output_type if quality_row else "latent",
                                                num_images_per_prompt=setup.images_per_prompt))
        bench.timed_here += 1
        if store is not None:  # one line per batch, written whole once every row ran on it
            with open(store, "a") as f:
                f.write(json.dumps({"first_prompt": i, "next_prompt": i + len(batch), "started": bench.started,
                                    "runs": {name: parts[-1][2] for name, parts in runs.items()}}) + "\n")
    return runs


# -- a run over several processes (--resume) ---------------------------------------------------------------------
RESUME_FILE = "timed_runs.jsonl"


def resume_key(args) -> dict:
    """What every process of one run shares: the settings that change a row's figures (heads and model by folder
    name: a clone elsewhere is the same run), the code's commit, the CPU, the threads and the versions."""
    skip = {"time_budget_s", "resume", "out", "decoders", "heads", "model"}
    settings = {k: v for k, v in vars(args).items() if k not in skip}
    settings.update(decoders=[spec for spec, _, _ in args.decoders], heads=[os.path.basename(os.path.normpath(h)) for h in args.heads],
                    model=args.model and os.path.basename(os.path.normpath(args.model)))
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=os.path.dirname(os.path.abspath(__file__)),
                                capture_output=True, text=True).stdout.strip() or None
    except OSError:  # no git: the versions and settings still have to match
        commit = None
    return {"settings": settings, "commit": commit, "cpu": cpu_name(), "threads": torch.get_num_threads(),
            "versions": {"spatial_pipelines": spatial_pipelines.__version__, "torch": torch.__version__}}


def resumed_runs(args, bench: Bench, setups: List[Setup]):
    """``OUT/timed_runs.jsonl``: the runs it holds (``(None, None, cost)`` per row and batch), the first prompt not yet
    timed and the file to append to. A new file starts with the run's `resume_key`; a file whose key differs is
    refused, naming what differs; a line cut short by a kill is dropped (that batch is timed again)."""
    path = os.path.join(args.out, RESUME_FILE)
    key, runs, first = resume_key(args), {s.name: [] for s in setups}, 0
    lines = []
    if os.path.exists(path):
        with open(path) as f:
            for text in f:
                try:
                    lines.append(json.loads(text))
                except json.JSONDecodeError:
                    break  # the kill's cut line, and nothing after it
    if lines:
        stored = lines[0]["key"]
        differ = sorted(k for k in set(stored) | set(key) if stored.get(k) != key.get(k))
        differ += sorted(k for k in set(stored["settings"]) | set(key["settings"])
                         if stored["settings"].get(k) != key["settings"].get(k))
        if differ:
            raise SystemExit(f"--resume: {path} holds a run with other {', '.join(d for d in differ if d != 'settings')}: "
                             "continue it with the same command, code and CPU, or give another --out")
        for line in lines[1:]:
            for name, cost in line["runs"].items():
                runs[name].append((None, None, cost))
            first = line["next_prompt"]
    with open(path, "w") as f:  # rewritten whole: a cut line does not stay in the middle
        f.write("".join(json.dumps(line) + "\n" for line in (lines or [{"key": key}])))
    bench.parts = [line["started"] for line in lines[1:]]
    return runs, first, path


# -- the rows' numbers -------------------------------------------------------------------------------------------
def summed_cost(parts, warmup_s: float):
    """A row's cost over its runs, and its per-image figures."""
    keys = ("passes", "draft_passes", "tokens", "seconds", "images", "accepted_sum", "accepted_count")
    cost = {k: sum(c[k] for *_, c in parts) for k in keys}
    per_image = {"target_forward_passes_per_image": cost["passes"] / cost["images"], "wall_clock_s": cost["seconds"],
                 "seconds_per_image": cost["seconds"] / cost["images"], "images_per_s": cost["images"] / cost["seconds"],
                 "tokens_per_s": cost["tokens"] / cost["seconds"], "warmup_s": warmup_s}
    return cost, per_image


def minimal_ar_row(spec: str, per_image: dict) -> dict:
    return {"decoder": spec, "compiled": False, "images_per_prompt": 1,
            "decoder_class": "minimal gpt-fast-style AR loop (scripts/minimal_ar.py)", "decoder_config": {}, "heads": None,
            "exact": True, "draft_passes_per_image": 0.0, "mean_accepted_length": 1.0, **per_image}


def decoder_row(setup: Setup, bench: Bench, parts, cost: dict, per_image: dict) -> dict:
    """A decoder row's speed columns: its config (with what "auto" chose), passes, acceptance, padding, the graphs
    compiled while timed, and a dynamic tree's mean shape."""
    decoder = setup.decoder
    config = {k: v for k, v in dict(decoder.config).items() if not k.startswith("_")}
    if decoder.draft_size_name is not None:  # the size drafted with: a family's default for None, "auto"'s choice
        config.update({f"resolved_{k}": v for k, v in decoder.fixed_sizes().items()})
        config["resolved_draft_tokens"] = decoder.tree.num_nodes - 1
    row = {
        "decoder": setup.spec,
        "compiled": setup.compiled,
        "images_per_prompt": setup.images_per_prompt,
        "decoder_class": setup.decoder_cls.__name__,
        "decoder_config": config,
        "heads": bench.heads[setup.compiled, setup.need][1] if setup.need else None,
        "exact": decoder.is_exact,
        "draft_passes_per_image": cost["draft_passes"] / cost["images"],
        "mean_accepted_length": cost["accepted_sum"] / cost["accepted_count"],
        **per_image,  # warmup_s: the untimed first call, with any one-time "auto" size measurement or compilation
    }
    padded = [f for *_, c in parts for f in c.get("padded", [])]
    if padded:  # static shapes: the share of fed slots that were padding
        row["padded_fraction"] = float(np.mean(padded))
    shares = [f for *_, c in parts for f in c.get("slowest_row_share", [])]
    if shares:  # the slowest row's passes over the call's (1: the batch took no pass more than its slowest row)
        row["slowest_row_pass_share"] = float(np.mean(shares))
    if setup.compiled:  # compilations during timed calls (0: every round replayed a warm graph)
        row["graphs_compiled_while_timed"] = sum(c.get("compiled_graphs", 0) for *_, c in parts)
    depths = [d for *_, c in parts for d in c.get("tree_depth", [])]
    if depths:
        row["mean_tree_depth"] = float(np.mean(depths))
        row["mean_tree_width"] = float(np.mean([w for *_, c in parts for w in c["tree_width"]]))
    return row


def quality_columns(args, bench: Bench, pipe, images, grids) -> dict:
    """FD-EffNet, caption retrieval, the target's score of the code grids and LPIPS diversity of one row."""
    from spatial_pipelines.evaluation import extract_features, frechet_distance, lpips_diversity, retrieval_accuracy, target_fit

    q, columns = bench.quality, {}
    feats = extract_features(q.effnet, images)
    columns["fd_effnet"] = frechet_distance(feats, q.matched)
    columns["retrieval"] = retrieval_accuracy(feats, bench.prompts, q.real_feats, q.everything.captions)
    fit = target_fit(pipe, bench.prompts, grids, args.guidance_scale, args.temperature, args.top_k)
    columns["target_nll_per_code"] = fit["nll_per_code"].mean().item()
    columns["outside_target_support"] = fit["outside_support"].mean().item()
    div, _, _ = run_decoder(pipe, q.div_rep, args, seed_offset=10**6, output_type="pt")
    k = args.diversity_samples
    columns["lpips_diversity"] = float(np.mean([lpips_diversity(q.lpips, div[i : i + k]) for i in range(0, len(div), k)]))
    return columns


def by_split(args, bench: Bench, parts) -> Optional[Dict[str, dict]]:
    """A row's figures on the training captions and on the held-out ones (``split_of``: the embedded model never saw
    the ``"eval"`` captions), each batch counted where all its prompts fall; ``None`` for a prompt file."""
    if args.prompts_file is not None:
        return None
    groups: Dict[str, list] = {}
    for k, part in enumerate(parts):
        batch = bench.prompts[k * args.batch_size : (k + 1) * args.batch_size]
        splits = {split_of(p) for p in batch}
        if len(splits) == 1:
            groups.setdefault(splits.pop(), []).append(part)
    out = {}
    for split, group in sorted(groups.items()):
        cost, per_image = summed_cost(group, 0.0)
        out[split] = {"prompts": len(group) * args.batch_size, "seconds_per_image": per_image["seconds_per_image"],
                      "target_forward_passes_per_image": per_image["target_forward_passes_per_image"],
                      "mean_accepted_length": cost["accepted_sum"] / cost["accepted_count"]}
    return out


def report_rows(args, bench: Bench, setups: List[Setup], warmup: dict, runs: dict):
    """Every row of the report (printed as it is made), and the pictures of the eager one-image rows."""
    rows, pictures = {}, {}
    for setup in setups:
        parts = runs[setup.name]
        cost, per_image = summed_cost(parts, warmup[setup.name])
        if setup.decoder_cls is None:
            rows[setup.name] = {**minimal_ar_row(setup.spec, per_image), "by_split": by_split(args, bench, parts)}
            print(setup.name, json.dumps(rows[setup.name]))
            continue
        p = bench.use(setup)
        row = decoder_row(setup, bench, parts, cost, per_image)
        row["by_split"] = by_split(args, bench, parts)
        eager_single = setup.images_per_prompt == 1 and not setup.compiled
        if (args.quality or args.picture) and eager_single:  # resumed runs keep no images: refused with these options
            images, grids = torch.cat([im for im, _, _ in parts]), torch.cat([g for _, g, _ in parts])
        if args.quality and eager_single:
            row.update(quality_columns(args, bench, p, images, grids))
        if args.picture and eager_single:
            pictures[setup.spec] = images[: args.picture]
        rows[setup.name] = row
        print(setup.name, json.dumps(row))
    return rows, pictures


def add_speedups(rows: dict) -> None:
    """Speed-ups within the run: against eager AR at the same images per prompt, and against AR run the same way."""

    def ar_row(compiled_row, n):
        return next((r for r in rows.values() if r["decoder"] == "ar" and r["compiled"] == compiled_row and r["images_per_prompt"] == n), None)

    for r in rows.values():
        eager_ar, same_ar = ar_row(False, r["images_per_prompt"]), ar_row(r["compiled"], r["images_per_prompt"])
        r["speedup_vs_ar"] = r["images_per_s"] / eager_ar["images_per_s"] if eager_ar else None
        r["speedup_vs_compiled_ar"] = r["images_per_s"] / same_ar["images_per_s"] if same_ar and r["compiled"] else None
        r["pass_reduction_vs_ar"] = (eager_ar["target_forward_passes_per_image"] / r["target_forward_passes_per_image"]
                                     if eager_ar else None)
        for split, col in (r.get("by_split") or {}).items():  # the same ratios on the training and held-out captions
            ar_split = (same_ar or {}).get("by_split") or {}
            if split in ar_split:
                col["speedup_vs_same_ar"] = ar_split[split]["seconds_per_image"] / col["seconds_per_image"]
                col["pass_reduction_vs_ar"] = (ar_split[split]["target_forward_passes_per_image"]
                                               / col["target_forward_passes_per_image"])


def run_benchmark(args):
    """Every row, warmed up once and then timed interleaved: the shared setup, the rows and their pictures."""
    bench = prepare(args)
    setups = row_setups(args, bench)
    output_type = "pt" if args.quality or args.picture else "latent"
    warmup = warm_up(args, bench, setups)
    runs = timed_runs(args, bench, setups, output_type)
    rows, pictures = report_rows(args, bench, setups, warmup, runs)
    add_speedups(rows)
    return bench, rows, pictures


# -- writing the report ------------------------------------------------------------------------------------------
def make_report(args, bench: Bench, rows: dict) -> dict:
    """``benchmark.json``: the run's settings, device and versions, and the rows."""
    pipe = bench.pipe
    quality = None
    if args.quality:
        quality = {"fd_effnet": "vs the real images of the same captions",
                   "retrieval": f"top-k nearest of {len(bench.quality.everything)} real Twemoji carry the prompt's caption",
                   "lpips_diversity": f"{args.diversity_prompts} prompts x {args.diversity_samples} seeds",
                   "target_nll_per_code": "mean -log p(code | codes before it), CFG-mixed, temperature 1, no filtering",
                   "outside_target_support": "share of codes the sampling distribution gives probability 0"}
    device = (torch.cuda.get_device_name(args.device) if str(args.device).startswith("cuda")
              else f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')})")
    return {
        "model": args.model or "embedded twemoji_llamagen",
        "num_prompts": len(bench.prompts),
        "num_prompts_timed": bench.prompts_timed if bench.prompts_timed is not None else len(bench.prompts),
        "timed_by_processes": processes_of(args, bench),
        "prompt_split": args.split,
        "batch_size": args.batch_size,
        "num_images_per_prompt": args.num_images_per_prompt,
        "sampling": {"guidance_scale": args.guidance_scale if args.guidance_scale is not None else pipe.backbone.default_guidance_scale,
                     "temperature": args.temperature,
                     "top_k": args.top_k if args.top_k is not None else pipe.backbone.default_top_k, "seed": args.seed},
        "quality": quality,
        "device": device,
        "dtype": str(pipe.transformer.dtype),
        "pack_weights": args.pack_weights,
        "compile": bench.compiled,
        "versions": {"spatial_pipelines": spatial_pipelines.__version__, "torch": torch.__version__,
                     "diffusers": diffusers.__version__, "transformers": transformers.__version__},
        "decoders": rows,
    }


def processes_of(args, bench: Bench) -> Optional[Dict[str, int]]:
    """With --resume: how many batches each process of the run timed, by its start (UTC); ``None`` without it."""
    if not args.resume:
        return None
    return dict(Counter(bench.parts + [bench.started] * bench.timed_here))


def markdown_table(args, rows: dict) -> List[str]:
    """``benchmark.md``: one line per row."""
    header = "| decoder | exact | target passes / image | mean accepted length | s / image | images / s | speed-up vs AR |"
    if args.compile:
        header += " speed-up vs compiled AR |"
    if args.quality:
        header += " FD-EffNet | retrieval top-1 / top-5 | LPIPS diversity | target NLL / code | codes outside target support |"
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for name, r in rows.items():
        speedup = "-" if r["speedup_vs_ar"] is None else f"{r['speedup_vs_ar']:.2f}x"
        line = (f"| `{name}` | {'yes' if r['exact'] else 'no'} | {r['target_forward_passes_per_image']:.1f} | "
                f"{r['mean_accepted_length']:.2f} | {r['seconds_per_image']:.2f} | {r['images_per_s']:.2f} | {speedup} |")
        if args.compile:
            line += f" {r['speedup_vs_compiled_ar']:.2f}x |" if r.get("speedup_vs_compiled_ar") is not None else " - |"
        if args.quality and "fd_effnet" not in r:
            line += " - | - | - | - | - |"
        elif args.quality:
            line += (f" {r['fd_effnet']:.1f} | {100 * r['retrieval']['top1']:.0f}% / {100 * r['retrieval']['top5']:.0f}% | "
                     f"{r['lpips_diversity']:.3f} | {r['target_nll_per_code']:.3f} | {100 * r['outside_target_support']:.1f}% |")
        lines.append(line)
    splits = sorted({k for r in rows.values() for k in (r.get("by_split") or {})})
    if splits:  # the embedded model trained on the "train" captions: its figures there may flatter it
        lines += ["", "By caption split (the model never saw the held-out `eval` captions):", "",
                  "| decoder | " + " | ".join(f"{k}: prompts | {k}: codes / pass | {k}: vs AR same mode" for k in splits) + " |",
                  "|---|" + "---:|" * (3 * len(splits))]
        for name, r in rows.items():
            cells = []
            for k in splits:
                col = (r.get("by_split") or {}).get(k)
                speed = col.get("speedup_vs_same_ar") if col else None
                cells += ["-", "-", "-"] if col is None else [str(col["prompts"]), f"{col['mean_accepted_length']:.2f}",
                                                          "-" if speed is None else f"{speed:.2f}x"]
            lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return lines


def write_outputs(args, bench: Bench, rows: dict, pictures: dict) -> None:
    """``benchmark.json``, ``benchmark.md`` (also printed) and the pictures and plots the options ask for."""
    report = make_report(args, bench, rows)
    with open(os.path.join(args.out, "benchmark.json"), "w") as f:
        json.dump(report, f, indent=2)
    lines = markdown_table(args, rows)
    with open(os.path.join(args.out, "benchmark.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    if args.picture:
        side_by_side(pictures, bench.prompts[: args.picture], os.path.join(args.out, "decoders_side_by_side.png"))
    if args.quality:
        plot_speed_quality(report, os.path.join(args.out, "speed_quality.png"))
    if args.compile or len(args.num_images_per_prompt) > 1:
        plot_batches(report, os.path.join(args.out, "batches.png"))


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    bench, rows, pictures = run_benchmark(args)
    write_outputs(args, bench, rows, pictures)


if __name__ == "__main__":
    main()
