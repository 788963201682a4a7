#!/usr/bin/env python
"""Our decoders beside the loop a user of the family already runs: transformers' own ``generate`` (Janus-Pro's image
mode, Emu3's and Chameleon's constrained ``generate`` with CFG) or, for LlamaGen, an independent gpt-fast-style loop
(`minimal_ar.py`, eager and compiled), on one random-weight model per layout, in one process, interleaved prompt by
prompt.

    python scripts/peer_check.py --out peer --layouts janus-25m janus-100m        # the CPU rows (fp32)
    python scripts/peer_check.py --out peer --layouts janus-pro-1b janus-pro-7b \\
        --num-images-per-prompt 1 4 --skip-eager --budget-s 240                   # a GPU (bf16, compiled)
    python scripts/peer_check.py --out /tmp/peer --dry-run                        # anywhere: tiny models, seconds

Each layout is built with random weights (nothing downloaded) at a stated shape: the trunk's width, depth, query and
key/value heads and MLP width, and the image grid and codebook; the GPU layouts are the released configs'
(Janus-Pro-1B: DeepSeek-LLM 1.5B, 24 layers of 2048, 16 heads; Janus-Pro-7B: 30 layers of 4096, 32 heads; both 24x24
codes of 16,384). Sampling is the family's released default (Janus-Pro: CFG 5, temperature 1, all codes).

Rows, per images-per-prompt: the peer (``peer``), our AR eager (``ar``) and compiled (``ar [compiled]``), our SJD
(``sjd``, its defaults) eager and compiled, and, with ``--trees``, Medusa on random heads of the kind it drafts with.
Every row gets one untimed call first (it compiles), then ``--num-prompts`` timed calls interleaved prompt by prompt.
Columns: seconds per image and its ratio to the peer, target passes per call (the call's images advance in one
batched pass), codes per pass per image, ms per pass and the pass's cost in our AR steps, peak memory (CUDA: the allocator's peak; CPU: the process's resident set above its level
before the call). ``--greedy-check`` runs the peer and our eager AR at temperature 0 on the first prompt and records
whether the codes are equal. A row whose warm-up would overrun ``--budget-s`` is skipped and named.

Writes ``peer_check.json`` (settings, device, versions, command, rows; saved after every block) and ``peer_check.md``.
"""

import argparse
import contextlib
import copy
import json
import os
import platform
import sys
import threading
import time
from typing import Callable, Dict, List, Optional

import diffusers
import torch
import transformers

import spatial_pipelines
from spatial_pipelines import DECODERS, JanusProPipeline

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

PROMPTS = ["a red fox in the snow", "a bowl of ramen on a wooden table", "a lighthouse at dusk", "an astronaut riding a horse",
           "a watercolor of a city street", "a cat asleep on a windowsill", "a sailing boat on a calm lake", "a bowl of fruit"]

#: trunk and grid of each layout: Llama trunk (width, layers, query heads, key/value heads, MLP width), the image grid
#: (rows = cols) and the codebook; the cpu ones are the sizes a 2-core CPU times in minutes
LAYOUTS = {
    "janus-tiny": dict(family="janus", hidden=64, layers=2, heads=4, kv_heads=4, mlp=128, grid=4, codes=64),
    "janus-25m": dict(family="janus", hidden=512, layers=8, heads=8, kv_heads=8, mlp=1408, grid=16, codes=1024),
    "janus-100m": dict(family="janus", hidden=1024, layers=8, heads=16, kv_heads=16, mlp=2816, grid=16, codes=1024),
    "janus-pro-1b": dict(family="janus", hidden=2048, layers=24, heads=16, kv_heads=16, mlp=5632, grid=24, codes=16384),
    "janus-pro-7b": dict(family="janus", hidden=4096, layers=30, heads=32, kv_heads=32, mlp=11008, grid=24, codes=16384),
}
#: the family's released sampling defaults (Janus-Pro's model card and generation config)
SAMPLING = {"janus": dict(guidance_scale=5.0, temperature=1.0, top_k=None)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for peer_check.json and peer_check.md")
    p.add_argument("--layouts", nargs="+", default=None, choices=sorted(LAYOUTS),
                   help="default: janus-25m janus-100m on a CPU, janus-pro-1b janus-pro-7b on CUDA, janus-tiny with --dry-run")
    p.add_argument("--num-images-per-prompt", type=int, nargs="+", default=[1])
    p.add_argument("--num-prompts", type=int, default=2, help="timed calls per row, one prompt each")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="default: bfloat16 on CUDA, else float32")
    p.add_argument("--skip-eager", action="store_true", help="our compiled rows only (the peer always runs)")
    p.add_argument("--skip-compiled", action="store_true", help="our eager rows only")
    p.add_argument("--trees", action="store_true", help="also Medusa on random heads (its round's cost)")
    p.add_argument("--greedy-check", action="store_true", help="peer and our AR at temperature 0: equal codes?")
    p.add_argument("--budget-s", type=float, default=None, help="skip rows whose warm-up would start after this many seconds")
    p.add_argument("--dry-run", action="store_true", help="the tiny layout on the CPU, eager backend for compile")
    p.add_argument("--threads", type=int, default=None, help="torch threads on a CPU")
    args = p.parse_args(argv)
    for name, values in (("--num-images-per-prompt", args.num_images_per_prompt), ("--num-prompts", [args.num_prompts])):
        if min(values) < 1:
            p.error(f"{name} values must be >= 1, got {values}")
    if args.num_prompts > len(PROMPTS):
        p.error(f"--num-prompts is at most {len(PROMPTS)}, got {args.num_prompts}")
    if args.skip_eager and args.skip_compiled:
        p.error("--skip-eager and --skip-compiled leave none of our rows")
    if args.budget_s is not None and not args.budget_s > 0:
        p.error(f"--budget-s must be a positive number of seconds, got {args.budget_s}")
    args.device = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
    args.layouts = args.layouts or (["janus-tiny"] if args.dry_run else
                                    ["janus-pro-1b", "janus-pro-7b"] if args.device.type == "cuda" else ["janus-25m", "janus-100m"])
    args.dtype = getattr(torch, args.dtype or ("bfloat16" if args.device.type == "cuda" else "float32"))
    args.compile_backend = "eager" if args.dry_run else "inductor"
    return args


# -- the model -----------------------------------------------------------------------------------------------------
def janus_model(layout: dict, device, dtype, natural_scale: bool):
    """A random `JanusForConditionalGeneration` of ``layout`` on ``device`` in ``dtype``, its processor (a tiny
    tokenizer: the text vocabulary does not enter an image step) and the generation config Janus-Pro ships. The
    vision tower (image understanding only) and the VQ decoder (not timed: codes are returned) are kept small.
    ``natural_scale``: weights of std 1/sqrt(fan_in) (outputs then depend on the content: greedy checks mean
    something), else transformers' own init (std 0.02: near-uniform codes, as in a cost-only run)."""
    from transformers import JanusConfig, JanusForConditionalGeneration, JanusVisionConfig, JanusVQVAEConfig, LlamaConfig

    from spatial_pipelines.testing import tiny_janus_processor

    patch, grid, d = 4, layout["grid"], layout["hidden"]
    processor = tiny_janus_processor(grid * patch)
    tok = processor.tokenizer
    ids = {n: tok.convert_tokens_to_ids(t) for n, t in (("pad", "<pad>"), ("bos", "<bos>"), ("eos", "<eos>"),
                                                         ("boi", "<begin_of_image>"), ("image", "<image_placeholder>"))}
    text = LlamaConfig(vocab_size=len(tok), hidden_size=d, intermediate_size=layout["mlp"], num_hidden_layers=layout["layers"],
                       num_attention_heads=layout["heads"], num_key_value_heads=layout["kv_heads"], max_position_embeddings=4096,
                       bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"])
    vision = JanusVisionConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, mlp_ratio=2, image_size=grid * patch,
                               patch_size=patch, projection_dim=d, num_image_tokens=grid * grid)
    vq = JanusVQVAEConfig(embed_dim=8, num_embeddings=layout["codes"], latent_channels=8, base_channels=32, channel_multiplier=[1, 1],
                          num_res_blocks=1, projection_dim=d, image_token_embed_dim=d, num_hidden_layers=2)
    config = JanusConfig(text_config=text, vision_config=vision, vq_config=vq, image_token_id=ids["image"])
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = JanusForConditionalGeneration._from_config(config, dtype=dtype).eval()
    if natural_scale:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if param.dim() == 2 and not name.startswith("model.vision_model"):
                    param.normal_(std=1.0 / param.shape[-1] ** 0.5)
            model.model.language_model.embed_tokens.weight.normal_(std=1.0)
            model.model.generation_embeddings.weight.normal_(std=1.0)
    gen = model.generation_config
    gen.guidance_scale, gen.temperature, gen.do_sample = SAMPLING["janus"]["guidance_scale"], 1.0, True
    gen.bos_token_id, gen.pad_token_id = ids["bos"], ids["pad"]
    gen.generation_kwargs = {"boi_token_id": ids["boi"]}
    return model, processor


def parameter_count(model) -> Dict[str, float]:
    trunk = sum(p.numel() for p in model.model.language_model.parameters())
    return {"trunk_m": round(trunk / 1e6, 1), "total_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 1)}


# -- rows ----------------------------------------------------------------------------------------------------------
def janus_peer(model, processor, backbone, prompts: List[str], n: int, temperature: float, seed: int) -> torch.Tensor:
    """transformers' own image generation, as Janus-Pro's model card runs it: ``n`` images per prompt as a batch of
    repeated prompts, CFG as a doubled batch, ``do_sample`` unless ``temperature`` is 0."""
    inputs = processor(text=[backbone.prompt_text(p) for p in prompts for _ in range(n)], generation_mode="image",
                       padding=True, return_tensors="pt").to(model.device)
    torch.manual_seed(seed)
    sample = dict(do_sample=True, temperature=temperature) if temperature else dict(do_sample=False)
    return model.generate(**inputs, generation_mode="image", guidance_scale=SAMPLING["janus"]["guidance_scale"], **sample)


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


def build_rows(args, model, processor, n: int, cache: dict) -> List[Row]:
    """The peer's row, then ours for ``n`` images per prompt (our pipelines are built once per layout, in
    ``cache``: ``{compiled: pipeline}`` sharing the model's weights)."""
    backbone_pipe = cache.get(False) or cache.setdefault(False, our_pipeline(model, processor, compiled=False, args=args))
    sampling = SAMPLING["janus"]

    def peer(prompts, n_, seed):
        codes = janus_peer(model, processor, backbone_pipe.backbone, prompts, n_, sampling["temperature"], seed)
        return codes, codes.shape[1]  # one batched pass per code

    rows = [Row("peer", peer, "peer")]
    modes = ([] if args.skip_eager else [False]) + ([] if args.skip_compiled else [True])
    decoders = ["ar", "sjd"] + (["medusa"] if args.trees else [])
    for compiled in modes:
        if compiled and True not in cache:
            cache[True] = our_pipeline(model, processor, compiled=True, args=args)
        pipe = cache[compiled]
        for name in decoders:
            decoder = DECODERS[name]()
            heads = None
            if decoder.heads_needed() is not None:
                from spatial_pipelines.testing import random_draft_heads

                heads = cache.setdefault(("heads", compiled, name), random_draft_heads(pipe, decoder))

            def ours(prompts, n_, seed, pipe=pipe, decoder=decoder, heads=heads):
                pipe.decoder = decoder
                pipe.set_draft_heads(heads)
                gens = [torch.Generator().manual_seed(seed + i) for i in range(len(prompts) * n_)]
                out = pipe(prompts, num_images_per_prompt=n_, guidance_scale=sampling["guidance_scale"],
                           temperature=sampling["temperature"], top_k=sampling["top_k"], generator=gens, output_type="latent")
                return out.tokens.flatten(1), out.stats.num_forward_passes

            rows.append(Row(name + (" [compiled]" if compiled else ""), ours, name))
    return rows


def our_pipeline(model, processor, compiled: bool, args):
    """Our pipeline over ``model``; ``compiled``: over a copy of its weights, compiled (`enable_compile` compiles the
    trunk module in place, so the peer and our eager rows keep the uncompiled one)."""
    if compiled:
        model = copy.deepcopy(model)
    pipe = JanusProPipeline(transformer=model, processor=processor, decoder=DECODERS["ar"]())
    pipe.set_progress_bar_config(disable=True)
    if compiled:
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
        pipe.enable_compile(backend=args.compile_backend, keep_if_slower=True, measure=False)
    return pipe


def greedy_check(args, model, processor, cache) -> dict:
    """Peer and our eager AR at temperature 0 on the first prompt: are the codes equal?"""
    pipe = cache.get(False) or cache.setdefault(False, our_pipeline(model, processor, compiled=False, args=args))
    pipe.decoder, _ = DECODERS["ar"](), pipe.set_draft_heads(None)
    theirs = janus_peer(model, processor, pipe.backbone, PROMPTS[:1], 1, 0.0, 0)
    ours = pipe(PROMPTS[:1], guidance_scale=SAMPLING["janus"]["guidance_scale"], temperature=0, output_type="latent").tokens.flatten(1)
    equal = (theirs.cpu() == ours.cpu())
    return {"equal": bool(equal.all()), "equal_share": round(float(equal.float().mean()), 4), "codes": equal.numel()}


@contextlib.contextmanager
def short_image(model, num_codes: int):
    """Inside the block transformers' image generation emits ``num_codes`` codes (the vision config's
    ``num_image_tokens``, which its ``generate`` reads)."""
    config = model.model.vision_model.config
    full, config.num_image_tokens = config.num_image_tokens, num_codes
    try:
        yield
    finally:
        config.num_image_tokens = full


def timed_call(args, row: Row, prompts, n: int, seed: int):
    sync(args.device)
    with PeakMemory(args.device) as mem:
        start = time.perf_counter()
        codes, passes = row.run(prompts, n, seed)
        sync(args.device)
        seconds = time.perf_counter() - start
    return codes, passes, seconds, mem.peak_mib


def run_block(args, layout_name: str, model, processor, n: int, cache: dict, started: float, report: dict) -> dict:
    """Every row at ``n`` images per prompt: warm-ups (skipping rows past the budget), then timed calls interleaved
    prompt by prompt. Returns ``{row name: columns}``."""
    rows = build_rows(args, model, processor, n, cache)
    live = []
    for row in rows:
        if args.budget_s is not None and time.perf_counter() - started > args.budget_s:
            report["skipped"].append(f"{layout_name} {row.name} x{n}")
            continue
        start = time.perf_counter()
        if row.kind == "peer":  # the peer compiles nothing: a short generation warms its kernels and allocator
            with short_image(model, 16):
                row.run(PROMPTS[:1], n, 10_000)
        else:  # ours: a whole generation compiles every graph the timed calls meet
            row.run(PROMPTS[:1], n, 10_000)
        sync(args.device)
        row.warmup_s = time.perf_counter() - start
        live.append(row)
    for i, prompt in enumerate(PROMPTS[: args.num_prompts]):
        for row in live:
            codes, passes, seconds, peak = timed_call(args, row, [prompt], n, i * 100)
            row.seconds += seconds
            row.calls += 1
            row.images += n
            row.passes += passes
            row.codes += codes.numel()
            row.peak_mib = max(row.peak_mib, peak)
    out, ar = {}, {}
    for row in live:
        ms_per_pass = 1000 * row.seconds / row.passes
        # a call's rows advance in one batched pass: passes per call, codes per pass per row
        out[row.name] = {"seconds_per_image": row.seconds / row.images, "passes_per_call": row.passes / row.calls,
                         "codes_per_pass": (row.codes / row.images) / (row.passes / row.calls), "ms_per_pass": ms_per_pass, "peak_mib": round(row.peak_mib, 1),
                         "warmup_s": round(row.warmup_s, 2), "images": row.images}
        if row.kind == "ar" or row.kind == "peer":
            ar.setdefault(row.name.endswith("[compiled]"), ms_per_pass)
    peer = out.get("peer")
    for name, col in out.items():
        if peer is not None:
            col["speedup_vs_peer"] = peer["seconds_per_image"] / col["seconds_per_image"]
        ours_ar = out.get("ar [compiled]" if name.endswith("[compiled]") else "ar")
        if ours_ar is not None:
            col["pass_cost_in_ar_steps"] = col["ms_per_pass"] / ours_ar["ms_per_pass"]
    return out


def device_name(args) -> str:
    if args.device.type == "cuda":
        return torch.cuda.get_device_name(args.device)
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"cpu ({cpu}, {torch.get_num_threads()} threads)"


def markdown(report: dict) -> str:
    lines = [f"# Against the family's own loop: {report['device']}, {report['dtype']}", "",
             f"`{report['command']}`", ""]
    for layout, block in report["layouts"].items():
        lines += [f"## {layout}: {block['parameters']}", ""]
        if "greedy" in block:
            lines += [f"Greedy codes equal to the peer's: {block['greedy']}", ""]
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
              "sampling": SAMPLING, "num_prompts": args.num_prompts, "layouts": {}, "skipped": []}
    models = {}
    for layout_name in args.layouts:  # every layout built first: a budget that runs out leaves each one's first batch
        layout = LAYOUTS[layout_name]
        model, processor = janus_model(layout, args.device, args.dtype, natural_scale=args.device.type != "cuda")
        models[layout_name] = (model, processor, {})
        report["layouts"][layout_name] = {"layout": layout, "parameters": parameter_count(model), "rows": {}}
    with torch.no_grad():
        for layout_name, (model, processor, cache) in models.items():
            if args.greedy_check:
                report["layouts"][layout_name]["greedy"] = greedy_check(args, model, processor, cache)
        for n in args.num_images_per_prompt:
            for layout_name, (model, processor, cache) in models.items():
                block = run_block(args, layout_name, model, processor, n, cache, started, report)
                report["layouts"][layout_name]["rows"][n] = block
                report["elapsed_s"] = round(time.perf_counter() - started, 1)
                save(args, report)
                print(markdown(report), flush=True)
    save(args, report)
    return report


if __name__ == "__main__":
    main()
