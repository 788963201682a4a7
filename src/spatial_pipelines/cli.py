"""``spatial-pipelines``: generate images from the command line.

    spatial-pipelines generate "grinning face" --out face.png       # the embedded Twemoji model
    spatial-pipelines generate "a red fox" --model path/to/pipeline --decoder ar --out fox.png
    spatial-pipelines generate "a red fox" --model org/repo --revision main --decoder medusa --heads org/heads

``--model`` and ``--heads`` take a folder or a Hub repo id; repo ids resolve through the Hub cache and honour
``HF_HUB_OFFLINE=1`` (then nothing is downloaded). Options are checked before the model loads; a bad one exits
with code 2 and a message naming it.
"""

import argparse
import os
import sys
from typing import List, Optional

import torch
from PIL import Image

from . import __version__
from .cli_utils import DTYPES, embedded_heads_path, grid_image, load_pipeline  # noqa: F401  (scripts import them from here)
from .core.sampling import SAMPLING_NOISE
from .decoders import DECODERS
from .demo import add_demo_arguments, serve
from .embedded import default_model_path
from .jobs import JobFolder, read_prompts, rows_digest, run_job
from .pipelines.call_checks import MAX_GUIDANCE_SCALE
from .utils import check_number, check_path_or_repo_id, check_writable_parent


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spatial-pipelines", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"spatial_pipelines {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate an image from a prompt, or every image of a prompt file")
    g.add_argument("prompt", nargs="?", default=None, help="text prompt (or a class label for class-conditional models)")
    g.add_argument("--prompts-file", default=None,
                   help="a job: one image set per prompt of this .txt / .jsonl / .csv file, written into the folder --out "
                        "(resumable; split between processes under torchrun or accelerate launch)")
    g.add_argument("--batch-size", type=int, default=1, help="with --prompts-file: prompts per pipeline call")
    g.add_argument("--overwrite", action="store_true", help="with --prompts-file: remove the job in --out and start afresh")
    g.add_argument("--negative-prompt", default=None, help="replaces the unconditional prompt of CFG")
    g.add_argument("--model", default=None, help="a pipeline folder or Hub repo id (default: the embedded Twemoji model)")
    g.add_argument("--revision", default=None, help="Hub revision (branch, tag or commit) of --model")
    g.add_argument("--decoder", default="sjd", choices=sorted(DECODERS),
                   help="decoding algorithm (default: sjd, speculative Jacobi decoding: exact, needs no heads, and under "
                        "keyed noise gives the image ar gives for the same seed, faster)")
    g.add_argument("--heads", default=None,
                   help="draft heads (folder or Hub repo id) for decoders that need them (default with the embedded model: its shipped heads)")
    g.add_argument("--heads-revision", default=None, help="Hub revision of --heads")
    g.add_argument("--out", default=None,
                   help="output image, e.g. .png or .jpg (a grid when --num-images > 1; default image.png); with "
                        "--prompts-file: the job's folder (required)")
    g.add_argument("--guidance-scale", type=float, default=None, help="CFG scale (default: the checkpoint's)")
    g.add_argument("--temperature", type=float, default=1.0, help="0 is greedy")
    g.add_argument("--top-k", type=int, default=None, help="default: the checkpoint's; 0 keeps every code")
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--sampling-noise", default=None, choices=list(SAMPLING_NOISE),
                   help="keyed: a seed gives the same image under every exact decoder; drawn: random numbers drawn as "
                        "the decoder uses them (default: keyed where the decoder supports it)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--num-images", "--num-images-per-prompt", dest="num_images", type=int, default=1,
                   help="images per prompt")
    g.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    g.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    add_demo_parser(sub)
    return parser


def add_demo_parser(sub) -> None:
    """``spatial-pipelines demo``: the browser app (`spatial_pipelines.demo`; Gradio, the ``demo`` extra)."""
    add_demo_arguments(sub.add_parser("demo", help="serve a page that runs AR and a speculative decoder side by side "
                                                   "(needs the demo extra)"))


def check_writable_file(path: str, name: str) -> None:
    """Raise `ValueError` naming ``name`` unless a file can be written at ``path``: not an existing folder, and its
    nearest existing parent is a folder this process may write in (the missing folders are made)."""
    full = os.path.abspath(path)
    if os.path.isdir(full):
        raise ValueError(f"`{name}` {path!r} is a folder; give a file name such as {os.path.join(path, 'image.png')!r}.")
    check_writable_parent(path, name, start=os.path.dirname(full))


def check_args(args: argparse.Namespace) -> None:
    """Every option that can be checked before the model loads; `ValueError` naming the option."""
    if args.prompts_file is None:
        if args.prompt is None:
            raise ValueError("give a `prompt`, or `--prompts-file FILE --out DIR` for a job.")
        if not args.prompt.strip():
            raise ValueError("`prompt` is empty: give the text (or class label) of the image to generate.")
        if args.overwrite or args.batch_size != 1:
            raise ValueError("`--overwrite` and `--batch-size` apply to `--prompts-file` jobs.")
        if args.out is None:
            args.out = "image.png"
    else:
        if args.prompt is not None:
            raise ValueError(f"give either a `prompt` ({args.prompt!r}) or `--prompts-file`, not both.")
        if args.out is None:
            raise ValueError("`--prompts-file` needs `--out DIR`, the job's folder.")
        check_number("--batch-size", args.batch_size, 1, integer=True, meaning="prompts per pipeline call")
    check_number("--num-images", args.num_images, 1, integer=True)
    check_number("--seed", args.seed, 0, 2**63 - 1 - args.num_images, integer=True,
                 meaning="image i is generated with seed + i")
    check_number("--temperature", args.temperature, 0, meaning="0 is greedy")
    if args.guidance_scale is not None:  # omitted: the checkpoint's
        check_number("--guidance-scale", args.guidance_scale, 0, MAX_GUIDANCE_SCALE, meaning="1 disables guidance")
    if args.top_k is not None:
        check_number("--top-k", args.top_k, 0, integer=True, meaning="0 keeps every code")
    if args.top_p is not None:
        check_number("--top-p", args.top_p, 0, 1, low_open=True)
    if args.prompts_file is None:
        check_writable_file(args.out, "--out")
        ext = os.path.splitext(args.out)[1].lower()
        if ext not in Image.registered_extensions() or Image.registered_extensions()[ext] not in Image.SAVE:
            raise ValueError(f"`--out` {args.out!r} must end with an image extension PIL writes (.png, .jpg, .webp, ...).")
    try:
        device = torch.device(args.device)
    except RuntimeError as err:
        raise ValueError(f"`--device` {args.device!r} is not a device: {err}") from None
    if device.type == "cpu" and device.index not in (None, 0):
        raise ValueError(f"`--device` {args.device!r}: the CPU is one device, `cpu` (an index other than 0 means nothing).")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"`--device` {args.device!r} asks for CUDA, but torch sees no CUDA device here; use `--device cpu`.")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"`--device` {args.device!r}: this machine has {torch.cuda.device_count()} CUDA devices.")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"`--device` {args.device!r} asks for MPS, which is not available here; use `--device cpu`.")
    if args.model is not None:
        check_path_or_repo_id(args.model, "--model")
    elif args.revision is not None:
        raise ValueError("`--revision` needs `--model` (a Hub repo id); the embedded model has no revisions.")
    if args.heads is not None:
        check_path_or_repo_id(args.heads, "--heads")
    elif args.heads_revision is not None:
        raise ValueError("`--heads-revision` needs `--heads` (a Hub repo id).")


def load_for_args(args: argparse.Namespace, device=None):
    """The pipeline the options ask for, on ``device`` (default ``--device``), with its decoder and heads."""
    pipe = load_pipeline(args.model or default_model_path(), DTYPES[args.dtype], args.revision).to(device or args.device)
    pipe.decoder = DECODERS[args.decoder].from_config(pipe.decoder.config)
    heads = args.heads
    need = pipe.decoder.heads_needed()
    if heads is None and args.model is None and need is not None:
        heads = embedded_heads_path(need.kinds[0])
    if args.heads is not None and need is None:
        print(f"warning: --decoder {args.decoder} drafts without heads: --heads {args.heads} is not used.", file=sys.stderr)
    if heads is not None:
        if os.path.exists(heads) and args.heads_revision is not None:
            raise ValueError(f"`--heads-revision` applies to Hub repo ids; `--heads` {heads!r} is a local folder.")
        try:
            pipe.load_draft_heads(heads, **({"revision": args.heads_revision} if args.heads_revision else {}))
        except OSError as err:
            raise ValueError(f"`--heads` {heads!r} could not be loaded: {err}") from err
    return pipe


def sampling_arguments(args: argparse.Namespace, pipe, images: int, option: str) -> dict:
    """The pipeline call's sampling arguments from the options, after checking that ``images`` images per call fit in
    memory (a `ValueError` naming ``option``)."""
    guidance = pipe.backbone.default_guidance_scale if args.guidance_scale is None else args.guidance_scale
    pipe.check_memory(images, guidance != 1, option)
    negative = pipe.backbone.prompt_from_text(args.negative_prompt) if args.negative_prompt is not None else None
    return dict(negative_prompt=negative, guidance_scale=args.guidance_scale, temperature=args.temperature,
                top_k=args.top_k, top_p=args.top_p, sampling_noise=args.sampling_noise)


def job_settings(args: argparse.Namespace, rows) -> dict:
    """What every image of a job depends on, keyed by the option that sets it (`jobs.JobFolder` compares them)."""
    return {"--model": args.model or "embedded", "--revision": args.revision, "--decoder": args.decoder,
            "--heads": args.heads, "--heads-revision": args.heads_revision, "--dtype": args.dtype, "--seed": args.seed,
            "--num-images-per-prompt": args.num_images, "--negative-prompt": args.negative_prompt,
            "--guidance-scale": args.guidance_scale, "--temperature": args.temperature, "--top-k": args.top_k,
            "--top-p": args.top_p, "--sampling-noise": args.sampling_noise, "--prompts-file": rows_digest(rows)}


def generate_job(args: argparse.Namespace) -> int:
    """``--prompts-file``: every image of the file into ``--out`` (`jobs.run_job`), this process's share of the rows."""
    from accelerate import PartialState

    rows = read_prompts(args.prompts_file)
    if args.seed + len(rows) - 1 > 2**63 - 1:
        raise ValueError(f"`--seed` {args.seed}: row i uses seed + i, past 2**63 - 1 for {len(rows)} rows.")
    folder = JobFolder(args.out, job_settings(args, rows))
    folder.check_writable()
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    state = PartialState(cpu=torch.device(args.device).type == "cpu") if distributed else None
    if state is None or state.is_main_process:
        folder.open(overwrite=args.overwrite)
    if state is not None:
        state.wait_for_everyone()
        if not state.is_main_process:
            folder.open()
    device = state.device if state is not None and torch.device(args.device).type != "cpu" else args.device
    pipe = load_for_args(args, device)
    pipe.set_progress_bar_config(disable=True)
    call = sampling_arguments(args, pipe, args.batch_size * args.num_images, "--batch-size")
    record = {"decoder": args.decoder, "decoder_config": dict(pipe.decoder.config)}
    summary = run_job(pipe, rows, folder, seed=args.seed, images_per_prompt=args.num_images, batch_size=args.batch_size,
                      call_kwargs=call, state=state, record_extra=record)
    if summary is not None:
        rate = f"{summary['images_per_s']:.2f} images/s" if summary["run_images"] else "nothing left to make"
        print(f"job complete: {summary['images']} images in {args.out} ({summary['run_images']} made now, {rate}) | "
              f"{summary['codes_per_pass']:.2f} codes per pass")
    return 0


def generate(args: argparse.Namespace) -> int:
    check_args(args)
    if args.prompts_file is not None:
        return generate_job(args)
    pipe = load_for_args(args)
    call = sampling_arguments(args, pipe, args.num_images, "--num-images")  # before a generator per image is made
    generators = [torch.Generator().manual_seed(args.seed + i) for i in range(args.num_images)]
    out = pipe(pipe.backbone.prompt_from_text(args.prompt), num_images_per_prompt=args.num_images, generator=generators, **call)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    grid_image(out.images).save(args.out)
    s = out.stats
    print(f"saved {args.out} | decoder {args.decoder} | {s.num_forward_passes} target forward passes for "
          f"{s.num_tokens} tokens (mean accepted length {s.mean_accepted_length:.2f}) | {s.wall_time_s:.2f} s "
          f"wall-clock, {s.num_tokens / s.wall_time_s:.1f} tokens/s")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "demo":
            return serve(args)
        return generate(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
