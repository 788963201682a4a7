#!/usr/bin/env python
"""Our decoders beside the loop a user of the family already runs, on one random-weight model per layout, in one
process, interleaved prompt by prompt.

    python scripts/peer_check.py --out peer                                       # a CPU: every family's CPU layouts (fp32)
    python scripts/peer_check.py --out peer --layouts janus-pro-1b janus-pro-7b \\
        --num-images-per-prompt 1 4 --skip-eager --budget-s 240                   # a GPU (bf16, compiled)
    python scripts/peer_check.py --out /tmp/peer --dry-run                        # anywhere: the tiny layouts, seconds

Layouts and peers (`peer_families.py` holds one adapter per family: the model, the peer, our pipeline, the sampling):

* Janus-Pro (``janus-tiny``, ``janus-25m``, ``janus-100m``; GPU: ``janus-pro-1b``, ``janus-pro-7b``, the released
  configs: DeepSeek-LLM 1.5B, 24 layers of 2048, 16 heads; 30 layers of 4096, 32 heads; both 24x24 codes of 16,384).
  Peer: transformers' ``JanusForConditionalGeneration.generate(..., generation_mode="image")`` as the model card runs
  it. Sampling: CFG 5, temperature 1, all codes.
* Emu3 (``emu3-tiny``, ``emu3-60m``: Emu3-8B's 32:8 query to key/value heads). Peer: transformers'
  ``Emu3ForConditionalGeneration.generate`` as Emu3's documentation runs it (``prefix_allowed_tokens_fn`` allowing the
  visual tokens and forcing the EOLs, CFG by ``guidance_scale`` and the negative prompt's ids). Sampling: CFG 3 with
  Emu3's negative prompt, temperature 1, top-k 2048 (at most the codebook).
* Anole / Chameleon (``anole-tiny``, ``anole-60m``: multi-head attention, qk-norm). Peer: transformers'
  ``ChameleonForConditionalGeneration.generate`` on Chameleon's image prompt, a prefix constraint allowing the image
  tokens, CFG by ``guidance_scale`` and the unconditional ids ``BOS <racm3:break>`` (the forward's image-logit mask
  lifted for the call). Sampling: our AnolePipeline's default, CFG 3, temperature 1, no top-k.
* LlamaGen (``llamagen-tiny``, ``llamagen-100m``: LlamaGen-B's shape; class-conditional). Peers: `minimal_ar.py`, an
  independent gpt-fast-style loop over the same weights, eager (``peer``) and with its decode step compiled (``peer
  [compiled]``, ``reduce-overhead`` on CUDA; runs beside our compiled rows). Sampling: LlamaGen's ``sample_c2i.py``,
  CFG 4, temperature 1, top-k 2000 (at most the codebook).

Each layout is built with random weights (nothing downloaded) at a stated shape: the trunk's width, depth, query and
key/value heads and MLP width, and the image grid and codebook (`LAYOUTS`), at a tiny model's natural weight scale
(std 1/sqrt(fan_in): codes depend on the content) but on CUDA, where Janus keeps transformers' init (std 0.02).

Rows, per images-per-prompt: the peer's, our AR eager (``ar``) and compiled (``ar [compiled]``), our SJD (``sjd``,
its defaults) eager and compiled, and, with ``--trees``, Medusa on random heads of the kind it drafts with; ``--tuned``
adds each at the size ``tune_decoder(prompt=...)`` picks (0: no drafts, AR's rounds, where none pays). Every row
gets one untimed call first (ours and a compiled peer: a whole one, it compiles; a peer that compiles nothing: a short
one), then ``--num-prompts`` timed calls interleaved prompt by prompt, each prompt's round of rows starting one row
later. Columns: seconds per image and its ratio to the peer (our compiled rows: to the compiled peer where there is one), target passes per call (the call's images advance
in one batched pass), codes per pass per image, ms per pass and the pass's cost in our AR steps, peak memory (CUDA:
the allocator's peak; CPU: the process's resident set above its level before the call). ``--greedy-check`` runs the
peer and our eager AR at temperature 0 on the first prompt and records whether the codes are equal. A row whose
warm-up would overrun ``--budget-s`` is skipped and named.

Writes ``peer_check.json`` (settings, device, versions, command, rows; saved after every timed call, so a run stopped
by a time limit keeps what it measured) and ``peer_check.md``.
"""

import argparse
import json
import os
import sys
import threading
import time
from typing import Callable, List

import diffusers
import torch
import transformers

import spatial_pipelines
from spatial_pipelines import DECODERS

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from keyed_noise_cost import cpu_name  # noqa: E402
from peer_families import Subject, family_of, peer_rows  # noqa: E402

PROMPTS = ["a red fox in the snow", "a bowl of ramen on a wooden table", "a lighthouse at dusk", "an astronaut riding a horse",
           "a watercolor of a city street", "a cat asleep on a windowsill", "a sailing boat on a calm lake", "a bowl of fruit"]

#: each layout's family and shape: the trunk (width, layers, query and key/value heads, MLP width), the image grid (rows =
#: cols) and the codebook (LlamaGen: and its classes); the cpu ones are the sizes a 2-core CPU times in minutes
LAYOUTS = {
    "janus-tiny": dict(family="janus", hidden=64, layers=2, heads=4, kv_heads=4, mlp=128, grid=4, codes=64),
    "janus-25m": dict(family="janus", hidden=512, layers=8, heads=8, kv_heads=8, mlp=1408, grid=16, codes=1024),
    "janus-100m": dict(family="janus", hidden=1024, layers=8, heads=16, kv_heads=16, mlp=2816, grid=16, codes=1024),
    "janus-pro-1b": dict(family="janus", hidden=2048, layers=24, heads=16, kv_heads=16, mlp=5632, grid=24, codes=16384),
    "janus-pro-7b": dict(family="janus", hidden=4096, layers=30, heads=32, kv_heads=32, mlp=11008, grid=24, codes=16384),
    # Emu3-8B's 4 query heads per key/value head (32:8) and MLP 3.5x the width (14336 / 4096)
    "emu3-tiny": dict(family="emu3", hidden=64, layers=2, heads=8, kv_heads=2, mlp=224, grid=4, codes=64),
    "emu3-60m": dict(family="emu3", hidden=768, layers=8, heads=12, kv_heads=3, mlp=2688, grid=16, codes=1024),
    # Chameleon-7B / Anole's multi-head attention (as many key/value heads as query heads), qk-norm, MLP 2.7x
    "anole-tiny": dict(family="anole", hidden=64, layers=2, heads=4, kv_heads=4, mlp=176, grid=4, codes=64),
    "anole-60m": dict(family="anole", hidden=768, layers=8, heads=12, kv_heads=12, mlp=2048, grid=16, codes=1024),
    # class-conditional; llamagen-100m is LlamaGen-B's released shape (111M: 12 layers of 768, 16x16 of 16384 codes)
    "llamagen-tiny": dict(family="llamagen", hidden=64, layers=2, heads=4, kv_heads=4, mlp=176, grid=4, codes=64, classes=10),
    "llamagen-100m": dict(family="llamagen", hidden=768, layers=12, heads=12, kv_heads=12, mlp=2048, grid=16, codes=16384,
                          classes=1000),
}

CPU_LAYOUTS = ("janus-25m", "janus-100m", "emu3-60m", "anole-60m", "llamagen-100m")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for peer_check.json and peer_check.md")
    p.add_argument("--layouts", nargs="+", default=None, choices=sorted(LAYOUTS),
                   help="default: every *-tiny layout with --dry-run, janus-pro-1b janus-pro-7b on CUDA, else " + " ".join(CPU_LAYOUTS))
    p.add_argument("--num-images-per-prompt", type=int, nargs="+", default=[1])
    p.add_argument("--num-prompts", type=int, default=2, help="timed calls per row, one prompt each")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="default: bfloat16 on CUDA, else float32")
    p.add_argument("--skip-eager", action="store_true", help="our compiled rows only (the peer always runs)")
    p.add_argument("--skip-compiled", action="store_true", help="our eager rows only")
    p.add_argument("--trees", action="store_true", help="also Medusa on random heads (its round's cost)")
    p.add_argument("--tuned", action="store_true", help="also SJD (and with --trees Medusa) at the size `tune_decoder` "
                   "picks, its acceptance measured on a prompt no timed call uses")
    p.add_argument("--greedy-check", action="store_true", help="peer and our AR at temperature 0: equal codes?")
    p.add_argument("--budget-s", type=float, default=None, help="skip rows whose warm-up would start after this many seconds")
    p.add_argument("--dry-run", action="store_true", help="the tiny layouts on the CPU, eager backend for compile")
    p.add_argument("--threads", type=int, default=None, help="torch threads on a CPU")
    args = p.parse_args(argv)
    for name, values in (("--num-images-per-prompt", args.num_images_per_prompt), ("--num-prompts", [args.num_prompts])):
        if min(values) < 1:
            p.error(f"{name} values must be >= 1, got {values}")
    if args.num_prompts > len(PROMPTS) - 1:  # the last prompt is `--tuned`'s calibration prompt
        p.error(f"--num-prompts is at most {len(PROMPTS) - 1}, got {args.num_prompts}")
    if args.skip_eager and args.skip_compiled:
        p.error("--skip-eager and --skip-compiled leave none of our rows")
    if args.budget_s is not None and not args.budget_s > 0:
        p.error(f"--budget-s must be a positive number of seconds, got {args.budget_s}")
    args.device = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
    args.layouts = args.layouts or ([n for n in LAYOUTS if n.endswith("-tiny")] if args.dry_run else
                                    ["janus-pro-1b", "janus-pro-7b"] if args.device.type == "cuda" else list(CPU_LAYOUTS))
    args.dtype = getattr(torch, args.dtype or ("bfloat16" if args.device.type == "cuda" else "float32"))
    args.compile_backend = "eager" if args.dry_run else "inductor"
    return args


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PeakMemory:
    """Peak memory of a call: CUDA's allocator peak, or on a CPU the resident set's peak (sampled every 5 ms) above
    its level when the block started. In MiB."""

    def __init__(self, device):
        self.device, self.peak_mib = device, 0.0

    @staticmethod
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif os.path.exists("/proc/self/statm"):
            self.base, self.top, self.stop = self.rss(), 0, threading.Event()
            self.thread = threading.Thread(target=self._sample, daemon=True)
            self.thread.start()
        return self

    def _sample(self):
        while not self.stop.wait(0.005):
            self.top = max(self.top, self.rss())

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            self.peak_mib = torch.cuda.max_memory_allocated(self.device) / 2**20
        elif hasattr(self, "thread"):
            self.stop.set()
            self.thread.join()
            self.peak_mib = max(0, max(self.top, self.rss()) - self.base) / 2**20
        return False


class Row:
    """One row: a name and a call ``run(prompts, n, seed) -> (codes, passes)``; its timed results."""

    def __init__(self, name: str, run: Callable, kind: str):
        self.name, self.run, self.kind = name, run, kind
        self.warmup_s, self.seconds, self.calls, self.images, self.passes, self.codes, self.peak_mib = None, 0.0, 0, 0, 0, 0, 0.0


def build_rows(args, subject, n: int) -> List[Row]:
    """The peer's rows, then ours for ``n`` images per prompt (our pipelines are built once per layout, in
    ``subject``, sharing the model's weights; the compiled one over a copy)."""
    family, sampling = subject.family, subject.sampling
    modes = ([] if args.skip_eager else [False]) + ([] if args.skip_compiled else [True])
    rows = []
    for name, compiled in peer_rows(subject.layout, ours_compiled=True in modes):
        def peer(prompts, n_, seed, compiled=compiled, warm=False):
            return family.peer(subject, prompts, n_, sampling["temperature"], seed, compiled=compiled, warm=warm)

        rows.append(Row(name, peer, "peer"))
    trees = ["medusa"] + (["medusa tuned"] if args.tuned else []) if args.trees else []
    decoders = ["ar", "sjd"] + (["sjd tuned"] if args.tuned else []) + trees
    for compiled in modes:
        pipe = subject.pipe(compiled)
        for name in decoders:
            base = name.split()[0]
            decoder = DECODERS[base]()
            heads = None
            if decoder.heads_needed() is not None:
                from spatial_pipelines.testing import random_draft_heads

                if (compiled, base) not in subject.heads:
                    subject.heads[(compiled, base)] = random_draft_heads(pipe, decoder)
                heads = subject.heads[(compiled, base)]
            if name.endswith(" tuned"):  # the size "auto" picks here at n images, weighed by what this model accepts
                pipe.decoder, _ = decoder, pipe.set_draft_heads(heads)
                start = time.perf_counter()
                decoder = pipe.tune_decoder(batch_size=n, guidance_scale=sampling["guidance_scale"],
                                            temperature=sampling["temperature"], top_k=sampling["top_k"],
                                            prompt=subject.prompts(PROMPTS[-1:]))
                size_name = decoder.draft_size_name
                subject.tuned.setdefault((compiled, n), {})[base] = {size_name: decoder.config[size_name],
                                                                     "tune_s": round(time.perf_counter() - start, 1)}
                name = f"{base} tuned ({'window' if base == 'sjd' else 'nodes'} {decoder.config[size_name]})"

            def ours(prompts, n_, seed, pipe=pipe, decoder=decoder, heads=heads):
                pipe.decoder = decoder
                pipe.set_draft_heads(heads)
                gens = [torch.Generator().manual_seed(seed + i) for i in range(len(prompts) * n_)]
                out = pipe(prompts, num_images_per_prompt=n_, guidance_scale=sampling["guidance_scale"],
                           temperature=sampling["temperature"], top_k=sampling["top_k"], generator=gens, output_type="latent")
                return out.tokens.flatten(1), out.stats.num_forward_passes

            rows.append(Row(name + (" [compiled]" if compiled else ""), ours, name))
    return rows


def greedy_check(subject) -> dict:
    """The (eager) peer and our eager AR at temperature 0 on the first prompt: are the codes equal?"""
    pipe = subject.pipe(False)
    pipe.decoder, _ = DECODERS["ar"](), pipe.set_draft_heads(None)
    prompts = subject.prompts(PROMPTS[:1])
    theirs, _ = subject.family.peer(subject, prompts, 1, 0.0, 0)
    ours = pipe(prompts, guidance_scale=subject.sampling["guidance_scale"], temperature=0, output_type="latent").tokens.flatten(1)
    equal = (theirs.cpu() == ours.cpu())
    return {"equal": bool(equal.all()), "equal_share": round(float(equal.float().mean()), 4), "codes": equal.numel()}


def timed_call(args, row: Row, prompts, n: int, seed: int):
    sync(args.device)
    with PeakMemory(args.device) as mem:
        start = time.perf_counter()
        codes, passes = row.run(prompts, n, seed)
        sync(args.device)
        seconds = time.perf_counter() - start
    return codes, passes, seconds, mem.peak_mib


def run_block(args, layout_name: str, subject, n: int, started: float, report: dict) -> None:
    """Every row at ``n`` images per prompt: warm-ups (skipping rows past the budget), then timed calls interleaved
    prompt by prompt; the block's columns are written into ``report`` and saved after every timed call."""
    rows = build_rows(args, subject, n)
    for (compiled, images), tuned in subject.tuned.items():
        report["layouts"][layout_name].setdefault("tuned", {})[f"x{images}" + (" [compiled]" if compiled else "")] = tuned
    prompts = subject.prompts(PROMPTS[: args.num_prompts])
    live = []
    for row in rows:
        if args.budget_s is not None and time.perf_counter() - started > args.budget_s:
            report["skipped"].append(f"{layout_name} {row.name} x{n}")
            continue
        start = time.perf_counter()
        # a peer that compiles nothing warms its kernels and allocator with a short generation (`warm`; a compiled
        # peer runs whole); ours: a whole generation compiles every graph the timed calls meet
        row.run(prompts[:1], n, 10_000, **({"warm": True} if row.kind == "peer" else {}))
        sync(args.device)
        row.warmup_s = time.perf_counter() - start
        live.append(row)
    block = report["layouts"][layout_name]["rows"].setdefault(n, {})
    for i, prompt in enumerate(prompts):
        # each prompt starts one row later: no row always runs right after the same one (a spell of a shared machine,
        # or what the row before left in the allocator and caches, moved rows of the same work 10-20% apart)
        for row in live[i % len(live):] + live[: i % len(live)]:
            codes, passes, seconds, peak = timed_call(args, row, [prompt], n, i * 100)
            row.seconds += seconds
            row.calls += 1
            row.images += n
            row.passes += passes
            row.codes += codes.numel()
            row.peak_mib = max(row.peak_mib, peak)
            block.clear()
            block.update(columns([r for r in live if r.calls]))
            report["elapsed_s"] = round(time.perf_counter() - started, 1)
            save(args, report)  # a run stopped by a time limit keeps every call it timed


def columns(rows: List[Row]) -> dict:
    """``{row name: columns}`` of the calls timed so far. Our compiled rows are set beside the compiled peer where
    there is one, else beside the peer."""
    out = {}
    for row in rows:
        # a call's rows advance in one batched pass: passes per call, codes per pass per row
        out[row.name] = {"seconds_per_image": row.seconds / row.images, "passes_per_call": row.passes / row.calls,
                         "codes_per_pass": (row.codes / row.images) / (row.passes / row.calls),
                         "ms_per_pass": 1000 * row.seconds / row.passes, "peak_mib": round(row.peak_mib, 1),
                         "warmup_s": round(row.warmup_s, 2), "images": row.images, "calls": row.calls}
    for name, col in out.items():
        compiled = name.endswith("[compiled]")
        peer = out.get("peer [compiled]" if compiled and "peer [compiled]" in out else "peer")
        if peer is not None:
            col["speedup_vs_peer"] = peer["seconds_per_image"] / col["seconds_per_image"]
        ours_ar = out.get("ar [compiled]" if compiled else "ar")
        if ours_ar is not None:
            col["pass_cost_in_ar_steps"] = col["ms_per_pass"] / ours_ar["ms_per_pass"]
    return out


def device_name(args) -> str:
    if args.device.type == "cuda":
        return torch.cuda.get_device_name(args.device)
    return f"cpu ({cpu_name()}, {torch.get_num_threads()} threads)"


def markdown(report: dict) -> str:
    lines = [f"# Against the family's own loop: {report['device']}, {report['dtype']}", "",
             f"`{report['command']}`", ""]
    for layout, block in report["layouts"].items():
        lines += [f"## {layout}: {block['parameters']}", "", f"Peer: {block['peer']} Sampling: {block['sampling']}", ""]
        if "greedy" in block:
            lines += [f"Greedy codes equal to the peer's: {block['greedy']}", ""]
        if "tuned" in block:
            lines += [f"`tune_decoder(prompt=...)` picked: {block['tuned']}", ""]
        lines += ["| row | images / prompt | s / image | vs peer | passes / call | codes / pass (per row) | ms / pass | pass cost (AR steps) | peak MiB |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for n, rows in block["rows"].items():
            for name, c in rows.items():
                lines.append(f"| {name} | {n} | {c['seconds_per_image']:.3f} | {c.get('speedup_vs_peer', float('nan')):.2f}x | "
                             f"{c['passes_per_call']:.1f} | {c['codes_per_pass']:.2f} | {c['ms_per_pass']:.2f} | "
                             f"{c.get('pass_cost_in_ar_steps', float('nan')):.2f} | {c['peak_mib']:.0f} |")
        lines.append("")
    if report["skipped"]:
        lines += ["Skipped (budget): " + ", ".join(report["skipped"]), ""]
    return "\n".join(lines)


def save(args, report: dict) -> None:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "peer_check.json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(args.out, "peer_check.md"), "w") as f:
        f.write(markdown(report))


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    report = {"command": "python scripts/peer_check.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "device": device_name(args), "dtype": str(args.dtype).replace("torch.", ""),
              "versions": {"spatial_pipelines": spatial_pipelines.__version__, "torch": torch.__version__,
                           "diffusers": diffusers.__version__, "transformers": transformers.__version__},
              "num_prompts": args.num_prompts, "layouts": {}, "skipped": []}
    subjects = {}
    for layout_name in args.layouts:  # every layout built first: a budget that runs out leaves each one's first batch
        layout = LAYOUTS[layout_name]
        family = family_of(layout)
        components = family.build(layout, args.device, args.dtype, natural_scale=args.device.type != "cuda")
        subject = subjects[layout_name] = Subject(family, layout, components, args.compile_backend)
        report["layouts"][layout_name] = {"layout": layout, "parameters": subject.parameters(), "peer": family.peer_text(),
                                          "sampling": subject.sampling, "rows": {}}
    with torch.no_grad():
        for layout_name, subject in subjects.items():
            if args.greedy_check:
                report["layouts"][layout_name]["greedy"] = greedy_check(subject)
                save(args, report)
        for n in args.num_images_per_prompt:
            for layout_name, subject in subjects.items():
                run_block(args, layout_name, subject, n, started, report)
                print(markdown(report), flush=True)
    report["elapsed_s"] = round(time.perf_counter() - started, 1)
    save(args, report)
    return report


if __name__ == "__main__":
    main()
