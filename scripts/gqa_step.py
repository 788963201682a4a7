#!/usr/bin/env python
"""What a GQA trunk's step costs against an MHA trunk's with the same keys and values: a transformers Llama trunk with
``--heads`` query heads on ``--kv-heads`` key/value heads (the families' grouped attention, and transformers' sdpa,
which repeats the keys and values to every query head), and one with ``--kv-heads`` heads on as many key/value heads
(MHA), the same head size, hidden size, layers and cache length: the same key/value bytes read per step. The query
side is not the same: the GQA trunk has ``heads / kv_heads`` times the query heads (its ``q_proj`` / ``o_proj``
weights and its attention FLOPs), which the MHA trunk does not pay. So a second MHA trunk (``mha-same-weights``) also
holds the GQA trunk's weight count, the ``q_proj`` / ``o_proj`` difference moved into its MLP (a wider
``intermediate_size``): the same key/value bytes and the same weight bytes per step, only the query heads differ.

Two levels, timed interleaved (every variant once per repeat, medians over repeats; the spread is the noise):

* ``attention``: one layer's attention over the cache, ``(R, H, T, D)`` queries on ``(R, H_kv, S + T, D)`` keys and
  values under a chain mask: ``grouped`` (SDPA's grouped heads), ``folded`` (query groups folded into the query axis),
  ``sdpa`` (transformers' sdpa: keys and values repeated, except one fed token in eager, whose query heads it packs
  into the query axis) and ``mha``;
* ``trunk``: a step of the whole trunk over ``T`` fed tokens on the library's static KV cache (`language_model_forward`):
  ``gqa`` (grouped attention), ``gqa-sdpa`` (transformers' sdpa) and ``mha``.

    python scripts/gqa_step.py --rows 2 8 --fed 1 16 --cache-length 1024 --compile --out docs/benchmarks/gqa

Writes ``<out>/gqa_step.json`` (device, threads, versions, command, settings, ms per step per case) and prints a
markdown table.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")  # as scripts/benchmark.py: before torch's OpenMP start-up

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import LlamaConfig, LlamaModel  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

import spatial_pipelines  # noqa: E402
from spatial_pipelines.core.kv_cache import StaticKVCache, additive_mask  # noqa: E402
from spatial_pipelines.pipelines.transformers_utils import (  # noqa: E402
    GROUPED_SDPA, folded_group_attention, grouped_head_attention, language_model_forward, use_grouped_attention,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from keyed_noise_cost import cpu_name  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", type=int, default=16, help="query heads of the GQA trunk")
    p.add_argument("--kv-heads", type=int, default=4, help="key/value heads of both trunks (the MHA trunk's heads)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--hidden-size", type=int, default=1024)
    p.add_argument("--intermediate-size", type=int, default=2816)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--cache-length", type=int, default=1024, help="filled cache slots S a step attends to")
    p.add_argument("--rows", type=int, nargs="+", default=[2, 8], help="rows R (CFG rows included)")
    p.add_argument("--fed", type=int, nargs="+", default=[1, 16], help="fed tokens T per step")
    p.add_argument("--levels", nargs="+", default=["attention", "trunk"], choices=["attention", "trunk"])
    p.add_argument("--repeats", type=int, default=15, help="interleaved repeats (the median is reported)")
    p.add_argument("--inner", type=int, default=3, help="steps timed together in one repeat")
    p.add_argument("--compile", action="store_true", help="also time each variant compiled (inductor, static shapes)")
    p.add_argument("--skip-eager", action="store_true")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="docs/benchmarks/gqa")
    args = p.parse_args(argv)
    if args.kv_heads < 1 or args.heads % args.kv_heads or args.heads <= args.kv_heads:
        p.error("--heads must be a multiple of --kv-heads, larger than it")
    if min(args.rows + args.fed) < 1 or args.cache_length < 1 or args.repeats < 1 or args.inner < 1:
        p.error("--rows, --fed, --cache-length, --repeats and --inner must be >= 1")
    if args.skip_eager and not args.compile:
        p.error("--skip-eager leaves nothing to time without --compile")
    return args


class Heads(torch.nn.Module):
    """What transformers' sdpa reads of an attention module: its query heads per key/value head."""

    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def attention_variants(args, rows: int, fed: int):
    """``{name: (function, inputs)}`` for one layer's attention over the cache."""
    g = torch.Generator().manual_seed(args.seed)
    s, d, hkv, h = args.cache_length + fed, args.head_dim, args.kv_heads, args.heads
    key, value = torch.randn(rows, hkv, s, d, generator=g), torch.randn(rows, hkv, s, d, generator=g)
    query = torch.randn(rows, h, fed, d, generator=g)
    allowed = torch.ones(fed, s, dtype=torch.bool)
    allowed[:, -fed:] = torch.ones(fed, fed, dtype=torch.bool).tril()  # the cache, then the fed tokens causally
    mask = additive_mask(allowed.expand(rows, 1, fed, s), torch.float32)  # (R, 1, T, S + T)
    scale = d ** -0.5
    grouped, mha = Heads(h // hkv), Heads(1)
    inputs = (query, key, value, mask)
    # every variant returns transformers' layout (R, T, H, D)
    return {
        "grouped": (lambda q, k, v, m: grouped_head_attention(q, k, v, m, scale).transpose(1, 2), inputs),
        "folded": (lambda q, k, v, m: folded_group_attention(q, k, v, m, scale).transpose(1, 2), inputs),
        "sdpa": (lambda q, k, v, m: sdpa_attention_forward(grouped, q, k, v, m, scaling=scale)[0], inputs),
        "mha": (lambda q, k, v, m: sdpa_attention_forward(mha, q, k, v, m, scaling=scale)[0], (query[:, :hkv], *inputs[1:])),
    }


def same_weights_intermediate(args) -> int:
    """The MLP width at which an MHA trunk of ``kv_heads`` heads holds as many weights as the GQA trunk: the GQA
    ``q_proj`` and ``o_proj`` hold ``2 * hidden * head_dim * (heads - kv_heads)`` more, an MLP ``3 * hidden`` per unit."""
    return args.intermediate_size + round(2 * args.head_dim * (args.heads - args.kv_heads) / 3)


def trunk(args, heads: int, attention: str, intermediate_size=None) -> LlamaModel:
    torch.manual_seed(args.seed)
    intermediate_size = args.intermediate_size if intermediate_size is None else intermediate_size
    config = LlamaConfig(vocab_size=32, hidden_size=args.hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=args.kv_heads,
                         head_dim=args.head_dim, max_position_embeddings=args.cache_length + max(args.fed) + 1)
    model = LlamaModel(config).eval()
    model.config._attn_implementation = "sdpa"
    if attention == GROUPED_SDPA:
        use_grouped_attention(model)
    assert model.config._attn_implementation == attention
    return model


def trunk_variants(args, models, rows: int, fed: int):
    """``{name: (function, inputs)}`` for a step of each trunk: ``T`` fed tokens after ``S`` filled slots (fixed-shape
    cache, so a compiled trunk keeps its shapes), the cache cropped back after each step."""
    g = torch.Generator().manual_seed(args.seed)
    embeds = torch.randn(rows, fed, args.hidden_size, generator=g)
    positions = torch.arange(args.cache_length, args.cache_length + fed)
    out = {}
    for name, model in models.items():
        cache = StaticKVCache(args.layers, rows, args.kv_heads, args.head_dim, args.cache_length + fed, fixed_shape=True,
                              attend_buckets=1)
        cache.storage.normal_(generator=torch.Generator().manual_seed(args.seed))  # the same keys for every trunk
        cache.prepare_write(args.cache_length)
        cache.advance(None, args.cache_length)

        def step(e, p, model=model, cache=cache):
            hidden = language_model_forward(model, e, p, None, None, cache)
            cache.crop(args.cache_length)
            return hidden

        out[name] = (step, (embeds, positions))
    return out


def time_interleaved(functions, repeats: int, inner: int):
    """ms per call of each function: every function once per repeat, in turn; median and the spread (min, max)."""
    times = {name: [] for name in functions}
    with torch.no_grad():
        for fn, inputs in functions.values():  # warm-up (and compilation)
            for _ in range(2):
                fn(*inputs)
        for _ in range(repeats):
            for name, (fn, inputs) in functions.items():
                start = time.perf_counter()
                for _ in range(inner):
                    fn(*inputs)
                times[name].append((time.perf_counter() - start) / inner * 1e3)
    return {name: {"median_ms": statistics.median(t), "min_ms": min(t), "max_ms": max(t)} for name, t in times.items()}


def check_same(functions, reference: str, against) -> None:
    """Each variant's output equals ``reference``'s (the MHA variant computes something else and is skipped)."""
    with torch.no_grad():
        fn, inputs = functions[reference]
        want = fn(*inputs)
        for name in against:
            fn, inputs = functions[name]
            got = fn(*inputs)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=f"{name} != {reference}")


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    modes = ([] if args.skip_eager else ["eager"]) + (["compiled"] if args.compile else [])
    models = {}
    if "trunk" in args.levels:
        models = {"gqa": trunk(args, args.heads, GROUPED_SDPA), "gqa-sdpa": trunk(args, args.heads, "sdpa"),
                  "mha": trunk(args, args.kv_heads, "sdpa"),
                  "mha-same-weights": trunk(args, args.kv_heads, "sdpa", same_weights_intermediate(args))}
        count = {name: sum(p.numel() for p in m.layers.parameters()) for name, m in models.items()}
        assert abs(count["mha-same-weights"] - count["gqa"]) <= 3 * args.hidden_size * args.layers, count
        models["gqa-sdpa"].load_state_dict(models["gqa"].state_dict())
    results = []
    for level in args.levels:
        for rows in args.rows:
            for fed in args.fed:
                variants = attention_variants(args, rows, fed) if level == "attention" else trunk_variants(args, models, rows, fed)
                reference, same = ("sdpa", ["grouped", "folded"]) if level == "attention" else ("gqa-sdpa", ["gqa"])
                check_same(variants, reference, same)
                for mode in modes:
                    timed = variants
                    if mode == "compiled":  # the trunks compiled as modules, as a pipeline compiles its target
                        torch._dynamo.reset()
                        if level == "attention":
                            timed = {n: (torch.compile(fn, dynamic=False), inputs) for n, (fn, inputs) in variants.items()}
                        for model in models.values():
                            model.compile(dynamic=False)
                    for name, t in time_interleaved(timed, args.repeats, args.inner).items():
                        results.append({"level": level, "mode": mode, "rows": rows, "fed": fed, "variant": name, **t})
                    for model in models.values():
                        model._compiled_call_impl = None  # eager again
                    print(f"{level} R={rows} T={fed} {mode}: done", flush=True)
    print(f"\n{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}, S={args.cache_length}, "
          f"GQA {args.heads}/{args.kv_heads} heads vs MHA {args.kv_heads}/{args.kv_heads}, head dim {args.head_dim}\n")
    print("| level | mode | R | T | variant | ms (median) | min-max | / MHA | / MHA of the same weights |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        same = {x["variant"]: x["median_ms"] for x in results if all(x[k] == r[k] for k in ("level", "mode", "rows", "fed"))}
        ratio = f"{r['median_ms'] / same['mha-same-weights']:.2f}" if "mha-same-weights" in same else ""
        print(f"| {r['level']} | {r['mode']} | {r['rows']} | {r['fed']} | {r['variant']} | {r['median_ms']:.3f} | "
              f"{r['min_ms']:.3f}-{r['max_ms']:.3f} | {r['median_ms'] / same['mha']:.2f} | {ratio} |")
    report = {
        "command": " ".join([os.path.basename(sys.argv[0])] + (argv if argv is not None else sys.argv[1:])),
        "device": f"cpu ({cpu_name()})", "threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "versions": {"spatial_pipelines": spatial_pipelines.__version__, "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "results": results,
    }
    with open(os.path.join(args.out, "gqa_step.json"), "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
