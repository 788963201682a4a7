#!/usr/bin/env python
"""Roofline of one decoding step: how close an AR step of a random-weight backbone gets to the memory-bandwidth
floor, and what verifying K fed tokens in one pass costs relative to that step (the budget speculative decoders
spend their drafts in).

    python scripts/bench_roofline.py --device cuda --dtype bfloat16 --out docs/performance/roofline
    python scripts/bench_roofline.py --presets llamagen-xl --ks 1 4 16 64 --compile --out docs/performance/roofline
    python scripts/bench_roofline.py --presets tiny --device cpu --ks 1 4 --repeats 2 --warmup 1 --out /tmp/roofline
    python scripts/bench_roofline.py --presets embedded-v2 embedded-15m embedded-27m embedded-40m --device cpu \
        --ks 1 4 8 12 16 24 32 --repeats 40 --out docs/performance/v2/trunk_sizes

Backbones are built from config only (``LlamaGenTransformer`` sized as LlamaGen GPT-XL, Janus-Pro-7B and
Lumina-mGPT-7B; normal-init weights, nothing downloaded), directly on ``--device`` in ``--dtype``. Every step
feeds ``--batch`` rows (the CFG pair) against a KV cache holding ``--cache-length`` positions, computes the final
norm and the image-code head over every fed token, and is cropped back so the cache length stays fixed. The
floor is (weights read per step + KV read) / ``--peak-bandwidth-gbs``. Timings are medians (CUDA events on a
GPU, ``perf_counter`` on the CPU). Writes ``<out>/roofline.json`` and ``<out>/roofline.png``, prints markdown.
"""

import argparse
import gc
import json
import os
import platform
import statistics
import time

import diffusers
import torch

import spatial_pipelines
from spatial_pipelines.models.transformer_llamagen import LlamaGenTransformer

# prompt prefixes: LlamaGen's 120 T5 tokens; Janus-Pro and Lumina-mGPT embed the prompt with the LLM's own text
# vocabulary, which a step never reads, so a one-class label table stands in and only the prefix length counts
EMBEDDED = dict(vocab_size=512, grid_height=24, grid_width=24, condition_type="text", caption_dim=384,
                num_condition_tokens=24, multiple_of=64, zero_prefix_rope=False)
PRESETS = {
    "llamagen-xl": dict(
        hidden_size=1280, num_layers=36, num_attention_heads=20, vocab_size=16384, grid_height=24, grid_width=24,
        condition_type="text", caption_dim=2048, num_condition_tokens=120,
    ),
    "janus-pro-7b": dict(
        hidden_size=4096, num_layers=30, num_attention_heads=32, intermediate_size=11008, vocab_size=16384,
        grid_height=24, grid_width=24, condition_type="class", num_classes=1, num_condition_tokens=64,
    ),
    "lumina-mgpt-7b": dict(
        hidden_size=4096, num_layers=32, num_attention_heads=32, intermediate_size=11008, vocab_size=8192,
        grid_height=48, grid_width=48, end_of_row_token=True, condition_type="class", num_classes=1,
        num_condition_tokens=64,
    ),
    # the embedded Twemoji model's layout (24x24 patch codes, 512 codes, 24 MiniLM caption tokens) at growing trunk
    # sizes: does a larger model make a verification window cheaper relative to an AR step on this machine?
    "embedded-v2": dict(EMBEDDED, hidden_size=256, num_layers=6, num_attention_heads=8),
    "embedded-15m": dict(EMBEDDED, hidden_size=384, num_layers=8, num_attention_heads=6),
    "embedded-27m": dict(EMBEDDED, hidden_size=512, num_layers=8, num_attention_heads=8),
    "embedded-40m": dict(EMBEDDED, hidden_size=512, num_layers=12, num_attention_heads=8),
    "tiny": dict(
        hidden_size=64, num_layers=2, num_attention_heads=4, vocab_size=64, grid_height=4, grid_width=4,
        condition_type="text", caption_dim=16, num_condition_tokens=4,
    ),
}
DEFAULT_PRESETS = ["llamagen-xl", "janus-pro-7b", "lumina-mgpt-7b"]
# peak HBM bandwidth (GB/s) by device-name fragments; the first entry whose fragments all match wins
PEAK_BANDWIDTH_GBS = [
    (("h200",), 4800.0),
    (("h100", "pcie"), 2000.0),
    (("h100",), 3350.0),
    (("a100", "80gb"), 2039.0),
    (("a100",), 1555.0),
]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text!r}")
    return value


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", nargs="+", choices=sorted(PRESETS), default=DEFAULT_PRESETS)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--batch", type=positive_int, default=2, help="rows per step (2: the CFG pair)")
    p.add_argument("--cache-length", type=non_negative_int, default=None,
                   help="cached positions (default: per preset, the prefix plus half the image sequence)")
    p.add_argument("--ks", nargs="+", type=positive_int, default=[1, 2, 4, 8, 16, 32, 64, 128, 256],
                   help="fed tokens per verification pass")
    p.add_argument("--repeats", type=positive_int, default=20)
    p.add_argument("--warmup", type=non_negative_int, default=5)
    p.add_argument("--peak-bandwidth-gbs", type=float, default=None,
                   help="peak memory bandwidth (default: looked up from the GPU name; none on the CPU)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the step (mode reduce-overhead on cuda, the default mode elsewhere)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="docs/performance/roofline")
    args = p.parse_args(argv)
    if args.peak_bandwidth_gbs is not None and args.peak_bandwidth_gbs <= 0:
        p.error(f"--peak-bandwidth-gbs must be positive, got {args.peak_bandwidth_gbs}")
    args.device = torch.device(args.device)
    args.dtype = DTYPES[args.dtype or ("bfloat16" if args.device.type == "cuda" else "float32")]
    args.ks = sorted(set(args.ks))
    return args


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type} ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def lookup_peak_bandwidth(name: str):
    """Peak GB/s of a known GPU name, else None."""
    name = name.lower()
    for fragments, gbs in PEAK_BANDWIDTH_GBS:
        if all(f in name for f in fragments):
            return gbs
    return None


def build_backbone(config: dict, device: torch.device, dtype: torch.dtype) -> LlamaGenTransformer:
    """Random-weight backbone allocated and initialised on ``device`` in ``dtype`` (no fp32 copy on the host)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaGenTransformer(**config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval().requires_grad_(False)


def default_cache_length(model: LlamaGenTransformer) -> int:
    """Prefix plus half the image sequence (end-of-row tokens included): the middle of a generation."""
    return model.config.num_condition_tokens + model.layout.sequence_length // 2


def step_bytes(model: LlamaGenTransformer, batch: int, cache_length: int, fed: int = 1):
    """Bytes one step must read: (weights, KV). Weights are the blocks, the final norm and the code head; the
    embedding rows gathered for the fed tokens and the prefix embedder are left out (a few KB, or unused)."""
    read = [model.layers, model.norm, model.output]
    weights = sum(p.numel() * p.element_size() for m in read for p in m.parameters())
    attn = model.layers[0].attention
    elem = model.output.weight.element_size()
    kv = len(model.layers) * 2 * batch * attn.num_kv_heads * (cache_length + fed) * attn.head_dim * elem
    return weights, kv


def median_ms(step, reset, repeats: int, warmup: int, device: torch.device) -> float:
    """Median wall time of ``step()`` in ms; ``reset()`` runs after every call, outside the timed region."""
    for _ in range(warmup):
        step()
        reset()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
            reset()
    else:
        for _ in range(repeats):
            start = time.perf_counter()
            step()
            times.append((time.perf_counter() - start) * 1e3)
            reset()
    return statistics.median(times)


@torch.no_grad()
def bench_preset(name: str, args) -> dict:
    """AR step, its bandwidth floor and the verification cost at every K for one preset."""
    config = PRESETS[name]
    # 1. the backbone, and a cache holding a real prefill of random tokens
    start = time.perf_counter()
    model = build_backbone(config, args.device, args.dtype)
    build_s = time.perf_counter() - start
    cache_length = default_cache_length(model) if args.cache_length is None else args.cache_length
    gen = torch.Generator(args.device).manual_seed(args.seed)
    cache = prefilled_cache(model, args, cache_length, gen)
    # 2. one pass over K fed tokens (compiled: one static graph per K), timed at K = 1 (an AR step) and every K
    step = verify_step(model, cache, args)
    ar_ms = time_fed(model, cache, step, args, cache_length, gen, 1)
    verify = []
    for k in args.ks:  # K = 1 is timed again: its ratio shows the noise of the measurement
        ms = time_fed(model, cache, step, args, cache_length, gen, k)
        verify.append({"K": k, "ms": ms, "relative_to_ar": ms / ar_ms})
    # 3. the bytes an AR step moves, against the peak bandwidth
    row = roofline_row(model, args, config, cache_length, build_s, ar_ms, verify)
    del model, cache, step
    if args.compile:
        torch._dynamo.reset()  # drops the compiled graphs (and their CUDA-graph pools) of this preset
    gc.collect()
    if args.device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def prefilled_cache(model: LlamaGenTransformer, args, cache_length: int, gen: torch.Generator):
    """A cache with room for the largest K after ``cache_length`` prefilled slots (the keys and values of random
    tokens, from a real prefill)."""
    b, d, last = args.batch, model.config.hidden_size, model.freqs_cis.shape[0] - 1
    cache = model.make_cache(b, cache_length + max(args.ks))
    if cache_length:
        embeds = torch.randn(b, cache_length, d, generator=gen, device=args.device, dtype=args.dtype)  # (B, L, D)
        model(embeds, torch.arange(cache_length, device=args.device).clamp(max=last), past_key_values=cache)
    return cache


def verify_step(model: LlamaGenTransformer, cache, args):
    """One pass over fed tokens through ``cache``: the logits ``(B, K, V)`` of every fed token; with ``--compile`` one
    static graph per K (the cache tensors keep their addresses, so CUDA graphs may mutate them)."""

    def step(embeds, positions, mask):
        out = model(embeds, positions, attention_mask=mask, past_key_values=cache)
        return model.output(out.last_hidden_state).float()  # (B, K, V): logits of every fed token

    if not args.compile:
        return step
    dynamo = torch._dynamo.config
    limit = "recompile_limit" if hasattr(dynamo, "recompile_limit") else "cache_size_limit"
    setattr(dynamo, limit, max(getattr(dynamo, limit), 4 * len(args.ks)))
    for t in [*cache.keys, *cache.values, cache.key_valid]:
        torch._dynamo.mark_static_address(t)
    return torch.compile(step, mode="reduce-overhead" if args.device.type == "cuda" else None, dynamic=False)


def time_fed(model: LlamaGenTransformer, cache, step, args, cache_length: int, gen: torch.Generator, k: int) -> float:
    """Median ms of one pass over ``k`` random tokens fed as a chain after the cached ones (the cache cropped back
    after each)."""
    b, d, last = args.batch, model.config.hidden_size, model.freqs_cis.shape[0] - 1
    embeds = torch.randn(b, k, d, generator=gen, device=args.device, dtype=args.dtype)  # (B, K, D)
    positions = (cache_length + torch.arange(k, device=args.device)).clamp(max=last)  # (K,)
    mask = torch.ones(k, k, dtype=torch.bool, device=args.device).tril()  # (K, K): a chain is a tree
    return median_ms(
        lambda: step(embeds, positions, mask), lambda: cache.crop(cache_length), args.repeats,
        max(args.warmup, 3) if args.compile else args.warmup, args.device,
    )


def roofline_row(model: LlamaGenTransformer, args, config: dict, cache_length: int, build_s: float, ar_ms: float,
                 verify: list) -> dict:
    """One preset's report row: sizes, the AR step against its bandwidth floor, and the verification costs."""
    weight_bytes, kv_bytes = step_bytes(model, args.batch, cache_length)
    moved = weight_bytes + kv_bytes
    peak = args.peak_bandwidth_gbs
    return {
        "config": dict(config),
        "params": sum(p.numel() for p in model.parameters()),
        "weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "weight_bytes_per_step": weight_bytes,
        "cache_length": cache_length,
        "kv_bytes_per_step": kv_bytes,
        "build_seconds": build_s,
        "ms_per_ar_step": ar_ms,
        "floor_ms": moved / (peak * 1e9) * 1e3 if peak else None,
        "achieved_bandwidth_gbs": moved / (ar_ms * 1e-3) / 1e9,
        "fraction_of_peak": moved / (ar_ms * 1e-3) / 1e9 / peak if peak else None,
        "verify": verify,
    }


def plot(report: dict, path: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.8), dpi=120)
    for name, row in report["presets"].items():
        ks = [v["K"] for v in row["verify"]]
        ax.plot(ks, [v["relative_to_ar"] for v in row["verify"]], marker="o", label=name)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    ks = sorted({v["K"] for row in report["presets"].values() for v in row["verify"]})
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.set_xlabel("fed tokens K per verification pass")
    ax.set_ylabel("cost / one AR step")
    ax.set_title(f"{report['device']}, {report['dtype']}, batch {report['batch']}", fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def markdown(report: dict) -> str:
    """A summary table (one row per preset) and the relative verification costs (one column per K)."""
    lines = [
        "| preset | params (M) | weights read (GB) | cached | ms / AR step | floor ms | GB/s | % of peak |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in report["presets"].items():
        pct = None if r["fraction_of_peak"] is None else 100 * r["fraction_of_peak"]
        lines.append(
            f"| `{name}` | {r['params'] / 1e6:.1f} | {r['weight_bytes_per_step'] / 1e9:.3f} | {r['cache_length']} | "
            f"{r['ms_per_ar_step']:.3f} | {fmt(r['floor_ms'], '.3f')} | {r['achieved_bandwidth_gbs']:.1f} | {fmt(pct, '.0f')} |"
        )
    ks = [v["K"] for v in next(iter(report["presets"].values()))["verify"]]
    lines += ["", "| preset | " + " | ".join(f"K={k}" for k in ks) + " |", "|---|" + "---:|" * len(ks)]
    for name, r in report["presets"].items():
        lines.append(f"| `{name}` | " + " | ".join(f"{v['relative_to_ar']:.2f}" for v in r["verify"]) + " |")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(args.seed)
    name = device_name(args.device)
    if args.peak_bandwidth_gbs is None and args.device.type == "cuda":
        args.peak_bandwidth_gbs = lookup_peak_bandwidth(name)
    if args.peak_bandwidth_gbs is None:
        print(f"no peak bandwidth known for {name!r}: pass --peak-bandwidth-gbs for the floor and the fraction of peak")
    report = {
        "device": name,
        "dtype": str(args.dtype).removeprefix("torch."),
        "batch": args.batch,
        "peak_bandwidth_gbs": args.peak_bandwidth_gbs,
        "compile": args.compile,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "versions": {"spatial_pipelines": spatial_pipelines.__version__, "torch": torch.__version__,
                     "diffusers": diffusers.__version__},
        "presets": {},
    }
    for preset in args.presets:
        report["presets"][preset] = row = bench_preset(preset, args)
        print(preset, json.dumps({k: v for k, v in row.items() if k not in ("config", "verify")}))
    with open(os.path.join(args.out, "roofline.json"), "w") as f:
        json.dump(report, f, indent=2)
    plot(report, os.path.join(args.out, "roofline.png"))
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
