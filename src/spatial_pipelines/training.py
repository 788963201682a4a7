"""Helpers the training scripts share: a loss log that writes JSON + a loss-curve PNG, resumable checkpoints with
accelerate, and datasets built in resumable chunks by every process of an ``accelerate launch`` run."""

import argparse
import itertools
import json
import os
import shutil
import sys
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed


class TrainingLog:
    """Losses per step, appended to ``<dir>/log.jsonl`` (so a resumed run continues the same curve) and plotted
    to ``<dir>/loss_curve.png``."""

    def __init__(self, directory: str):
        self.path = os.path.join(directory, "log.jsonl")
        self.directory = directory
        os.makedirs(directory, exist_ok=True)

    def records(self) -> List[Dict[str, float]]:
        if not os.path.exists(self.path):
            return []
        with open(self.path) as f:
            return [json.loads(line) for line in f if line.strip()]

    def append(self, step: int, **values: float) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **{k: float(v) for k, v in values.items()}}) + "\n")

    def truncate(self, step: int) -> None:
        """Forget records after ``step`` (a run resumed from an older checkpoint re-logs them)."""
        kept = [r for r in self.records() if r["step"] <= step]
        with open(self.path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)

    def plot(self, title: str, keys: Optional[List[str]] = None, filename: str = "loss_curve.png") -> str:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        records = self.records()
        keys = keys or sorted({k for r in records for k in r if k != "step"})
        fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
        for key in keys:
            pts = [(r["step"], r[key]) for r in records if key in r]
            if pts:
                ax.plot(*zip(*pts), label=key)
        values = [r[k] for r in records for k in keys if k in r]
        # a log scale only when every value is positive
        ax.set(xlabel="step", ylabel="loss", title=title, yscale="log" if values and min(values) > 0 else "linear")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # a run that logged no step yet draws empty axes, without a legend
            ax.legend()
        fig.tight_layout()
        out = os.path.join(self.directory, filename)
        fig.savefig(out)
        plt.close(fig)
        return out


def add_training_args(parser: argparse.ArgumentParser, *, out: str, batch_size: int, steps: int, lr: float,
                      checkpoint_every: int, log_every: int) -> argparse.ArgumentParser:
    """The options every training script shares (defaults differ per script)."""
    parser.add_argument("--out", default=out, help="run folder: checkpoints, log, loss curve, result")
    parser.add_argument("--batch-size", type=int, default=batch_size)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--lr", type=float, default=lr)
    parser.add_argument("--mixed-precision", default="auto", choices=["auto", "no", "fp16", "bf16"],
                        help="autocast precision; auto: bf16 where the device computes it natively, else fp32 ('no')")
    parser.add_argument("--checkpoint-every", type=int, default=checkpoint_every)
    parser.add_argument("--log-every", type=int, default=log_every)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--limit", type=int, default=None, help="use only the first N images (smoke tests)")
    return parser


def native_bf16() -> bool:
    """Whether this machine's training device computes bf16 natively: a CUDA GPU that supports it, or a CPU with
    bf16 instructions (oneDNN's check). Elsewhere bf16 autocast is emulated and far slower than fp32 (measured
    on an AVX2-only CPU: 186 s against 7.7 s for one step of the embedded model's training)."""
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)  # private: fp32 if a torch moves it
    return bool(check()) if check is not None else False


def resolve_mixed_precision(value: str) -> str:
    """``"auto"`` becomes ``"bf16"`` where :func:`native_bf16`, else ``"no"``; other values are kept."""
    return value if value != "auto" else "bf16" if native_bf16() else "no"


def setup(args: argparse.Namespace) -> Tuple[Accelerator, TrainingLog]:
    """Accelerator with the run's precision (``auto`` resolved and written back to ``args``), seeded, and the run
    folder's log. A multi-process run that silently trained as independent single processes is refused: each
    process checks that the launcher's ``WORLD_SIZE`` is the accelerator's process count."""
    args.mixed_precision = resolve_mixed_precision(args.mixed_precision)
    # without an accelerator, processes started by `accelerate launch --multi_gpu` (torchrun) join as CPU workers
    # over gloo only when told `cpu=True`; otherwise each would train alone
    no_accelerator = not (torch.cuda.is_available() or torch.backends.mps.is_available())
    accelerator = Accelerator(mixed_precision=args.mixed_precision, cpu=no_accelerator)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != accelerator.num_processes:
        raise RuntimeError(f"Launched as {world} processes but the accelerator joined {accelerator.num_processes}.")
    set_seed(args.seed)
    return accelerator, TrainingLog(args.out)


def end_run(accelerator: Accelerator) -> None:
    """The end of a training script: every process waits for the others, then the process group is destroyed. A
    process of a multi-process run then leaves at once (output flushed, `os._exit`): once DDP has wrapped a model,
    torch keeps the gloo group's threads alive past ``destroy_process_group``, and tearing it down at interpreter
    exit races the other processes closing their sockets (an abort, or a hang). Everything is written before this."""
    accelerator.wait_for_everyone()
    accelerator.end_training()
    if accelerator.num_processes > 1:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(0)


def prepare_and_resume(accelerator: Accelerator, args: argparse.Namespace, log: TrainingLog, model, optimizer, loader, scheduler):
    """``accelerator.prepare`` the objects, resume from the newest checkpoint (the log forgets later steps) and
    return ``(model, optimizer, scheduler, endless batches, start step)``."""
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    step = resume(accelerator, args.out)
    if accelerator.is_main_process:  # one writer of the log
        log.truncate(step)
    accelerator.wait_for_everyone()
    batches: Iterator = itertools.chain.from_iterable(itertools.repeat(loader))
    return model, optimizer, scheduler, batches, step


def build_dataset(accelerator: Accelerator, path: str, num_items: int, make_chunk: Callable[[int, int], Dict[str, torch.Tensor]],
                  chunk_size: int = 32, desc: str = "generate") -> Dict[str, torch.Tensor]:
    """A dataset of ``num_items`` rows, made in chunks by every process and merged into one safetensors file.

    ``make_chunk(start, end)`` returns the tensors of items ``[start, end)`` (rows first), depending on the item
    indices only (seed per item), so the dataset is the same for any number of processes. Chunk ``c`` is made by
    process ``c % num_processes`` and renamed into ``<path>.chunks/<start>-<end>.safetensors`` once whole: a rerun
    makes only the missing chunks. The main process then concatenates them into ``path`` (and drops the chunks),
    which every process reads. An existing ``path`` is read as it is.
    """
    from safetensors.torch import load_file, save_file
    from tqdm.auto import tqdm

    if not os.path.exists(path):
        chunk_dir = path + ".chunks"
        os.makedirs(chunk_dir, exist_ok=True)
        bounds = [(s, min(s + chunk_size, num_items)) for s in range(0, num_items, chunk_size)]
        files = [os.path.join(chunk_dir, f"{s:08d}-{e:08d}.safetensors") for s, e in bounds]
        mine = [c for c in range(len(bounds)) if c % accelerator.num_processes == accelerator.process_index]
        for c in tqdm(mine, desc=desc, disable=not accelerator.is_main_process):
            if os.path.exists(files[c]):  # made by an earlier, interrupted run
                continue
            tensors = {k: v.contiguous() for k, v in make_chunk(*bounds[c]).items()}
            tmp = files[c] + f".tmp{accelerator.process_index}"
            save_file(tensors, tmp)
            os.replace(tmp, files[c])  # atomic: a chunk on disk is always whole
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            parts = [load_file(f) for f in files]
            merged = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
            save_file(merged, path + ".tmp")
            os.replace(path + ".tmp", path)
            shutil.rmtree(chunk_dir, ignore_errors=True)
        accelerator.wait_for_everyone()
    return load_file(path)


def check_replicas_in_sync(accelerator: Accelerator, model) -> None:
    """Raise if the processes of a multi-process run hold different weights (gradients were not averaged: e.g. a
    loss that called the unwrapped model, which bypasses DDP's gradient hooks)."""
    if accelerator.num_processes == 1:
        return
    params = [p.detach().float() for p in accelerator.unwrap_model(model).parameters()]
    fingerprint = torch.stack([torch.stack([p.sum(), p.abs().sum(), (p * p).sum()]) for p in params]).flatten()
    gathered = accelerator.gather(fingerprint.to(accelerator.device)[None])  # (processes, 3 * tensors)
    if not torch.equal(gathered, gathered[:1].expand_as(gathered)):
        raise RuntimeError("The processes' weights differ after training: gradients were not synchronised.")


def latest_checkpoint(directory: str) -> Optional[str]:
    """The newest ``checkpoint-<step>`` folder under ``directory`` (``None`` if none)."""
    steps = _checkpoints(directory) if os.path.isdir(directory) else []
    return os.path.join(directory, steps[-1][1]) if steps else None


def _checkpoints(directory: str) -> List[Tuple[int, str]]:
    """``(step, folder name)`` of every ``checkpoint-<step>`` folder under ``directory``, oldest first."""
    return sorted((int(d.split("-")[1]), d) for d in os.listdir(directory)
                  if d.startswith("checkpoint-") and d.split("-")[1].isdigit())


def save_checkpoint(accelerator: Accelerator, directory: str, step: int, keep: int = 2) -> str:
    """``accelerator.save_state`` (safetensors) to ``checkpoint-<step>``, keeping the ``keep`` newest."""
    path = os.path.join(directory, f"checkpoint-{step}")
    accelerator.save_state(path, safe_serialization=True)
    if accelerator.is_main_process:
        with open(os.path.join(path, "step.json"), "w") as f:
            json.dump({"step": step}, f)
        for _, d in _checkpoints(directory)[:-keep]:
            shutil.rmtree(os.path.join(directory, d), ignore_errors=True)
    return path


def resume(accelerator: Accelerator, directory: str) -> int:
    """Load the newest checkpoint under ``directory`` into the accelerator's objects; returns its step (0: none)."""
    path = latest_checkpoint(directory)
    if path is None:
        return 0
    accelerator.load_state(path)
    with open(os.path.join(path, "step.json")) as f:
        return json.load(f)["step"]


class WeightEMA:
    """An exponential moving average of a module's weights (diffusers' `EMAModel`, constant ``decay``), saved beside
    every checkpoint as ``ema.safetensors`` (names as in ``module.named_parameters()``) so a resumed run continues it:
    a run stopped while its learning rate is still high samples from noisy weights, their average less so.

    Args:
        module (`torch.nn.Module`): the module whose parameters are averaged (the unwrapped model).
        decay (`float`): in ``[0, 1)``; the average spans about ``1 / (1 - decay)`` steps.
    """

    def __init__(self, module: torch.nn.Module, decay: float):
        from diffusers.training_utils import EMAModel

        if not 0 <= decay < 1:
            raise ValueError(f"`decay` must be in [0, 1), got {decay}.")
        named = list(module.named_parameters())
        self.names = [n for n, _ in named]
        self.parameters = [p for _, p in named]
        self.average = EMAModel(self.parameters, decay=decay, min_decay=decay)  # min_decay = decay: no ramp

    def step(self) -> None:
        self.average.step(self.parameters)

    def save(self, path: str) -> None:
        from safetensors.torch import save_file

        save_file({n: p.detach().contiguous() for n, p in zip(self.names, self.average.shadow_params)},
                  os.path.join(path, "ema.safetensors"))
        with open(os.path.join(path, "ema.json"), "w") as f:
            json.dump({"decay": self.average.decay, "optimization_step": self.average.optimization_step}, f)

    def load(self, path: str) -> bool:
        """Continue the average saved in checkpoint ``path``; ``False`` (the average starts from the current
        weights) when that checkpoint has none."""
        from safetensors.torch import load_file

        file = os.path.join(path, "ema.safetensors")
        if not os.path.isfile(file):
            return False
        saved = load_file(file)
        if set(saved) != set(self.names):
            raise ValueError(f"{file} averages other parameters than this model's.")
        for name, shadow in zip(self.names, self.average.shadow_params):
            shadow.copy_(saved[name])
        with open(os.path.join(path, "ema.json")) as f:
            self.average.optimization_step = json.load(f)["optimization_step"]
        return True

    def copy_to(self, module: torch.nn.Module) -> None:
        """Write the averaged weights into ``module`` (a module with the same parameter names)."""
        params = dict(module.named_parameters())
        with torch.no_grad():
            for name, shadow in zip(self.names, self.average.shadow_params):
                params[name].copy_(shadow)


def fit(accelerator: Accelerator, *, model, optimizer, scheduler, batches, loss_fn, steps: int, out: str, log: TrainingLog,
        start_step: int = 0, log_every: int = 10, checkpoint_every: int = 250, title: str = "training",
        plot_keys: Optional[List[str]] = None, clip_grad_norm: Optional[float] = None, desc: str = "train",
        ema: Optional[WeightEMA] = None, on_checkpoint: Optional[Callable[[int, str], None]] = None) -> int:
    """The training loop the scripts share: ``loss_fn(batch) -> (loss, {name: value})`` under autocast, backward,
    optional gradient clipping, optimizer and scheduler steps (and the `WeightEMA` ``ema``, if given), a progress
    bar, logging every ``log_every`` steps and a checkpoint (with the average) + loss-curve plot every
    ``checkpoint_every`` steps and at the end, after which ``on_checkpoint(step, path)`` is called if given (a run
    that must hand its weights on while it trains). Returns the last step."""
    from tqdm.auto import tqdm

    step = start_step
    bar = tqdm(total=steps, initial=step, desc=desc, disable=not accelerator.is_main_process)
    while step < steps:
        with accelerator.autocast():
            loss, parts = loss_fn(next(batches))
        accelerator.backward(loss)
        if clip_grad_norm is not None:
            accelerator.clip_grad_norm_(model.parameters(), clip_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if ema is not None:
            ema.step()
        step += 1
        bar.update(1)
        if step % log_every == 0 and accelerator.is_main_process:
            log.append(step, loss=loss.item(), lr=scheduler.get_last_lr()[0], **{k: float(v) for k, v in parts.items()})
            bar.set_postfix(loss=f"{loss.item():.4f}")
        if step % checkpoint_every == 0 or step == steps:
            path = save_checkpoint(accelerator, out, step)
            if accelerator.is_main_process:
                if ema is not None:
                    ema.save(path)
                log.plot(title, keys=plot_keys)
                if on_checkpoint is not None:
                    on_checkpoint(step, path)
    bar.close()
    check_replicas_in_sync(accelerator, model)
    return step
