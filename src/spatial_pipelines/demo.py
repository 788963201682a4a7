"""``spatial-pipelines demo``: autoregressive decoding and a speculative decoder side by side in the browser.

    pip install -e ".[demo]"
    spatial-pipelines demo                        # the embedded Twemoji model on http://127.0.0.1:7860
    spatial-pipelines demo --model path/to/pipeline --heads path/to/heads --port 8080

One click generates the prompt's images twice from the same seed, with `AutoregressiveDecoder` and with the decoder
picked, and shows both, what each cost (wall-clock, target passes, codes per pass, the speed-up), whether the images
are identical (an exact decoder under keyed noise gives AR's images) and where the drafts landed: over the code grid,
the number of codes the pass that committed each code accepted (`DecodingStats.acceptance_map`).

Gradio is an optional extra, imported only when the app is built; everything else here (`check_request`,
`compare_decoders`, `acceptance_picture`, ...) runs without it.
"""

import argparse
import math
import sys
import threading
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont, ImageOps

from .cli_utils import DTYPES, embedded_heads_path, grid_image, load_pipeline
from .decoders import DECODERS
from .embedded import default_model_path
from .utils import check_number, check_path_or_repo_id

INSTALL_HINT = 'pip install "spatial_pipelines[demo]"  (in a checkout: pip install -e ".[demo]")'
DISPLAY_SIZE = 256  # images and acceptance pictures are enlarged (nearest neighbour) to at least this many pixels
#: colours of the acceptance picture, from one code per pass (dark) to the longest run accepted in the call (bright)
PALETTE = [(68, 1, 84), (59, 82, 139), (33, 145, 140), (94, 201, 98), (253, 231, 37)]


@dataclass
class DecoderRun:
    """One decoder's generation of the request's images.

    Args:
        name (`str`): the decoder's short name (`DECODERS`).
        images (`list[PIL.Image.Image]`): the images. tokens (`torch.LongTensor` `(B, H, W)`): their code grids.
        stats (`DecodingStats`): passes, acceptance and wall-clock time of the call.
        is_exact (`bool`): the decoder, as configured, keeps the model's distribution.
    """

    name: str
    images: List[Image.Image]
    tokens: torch.Tensor
    stats: object
    is_exact: bool


@dataclass
class Comparison:
    """AR and a decoder on the same seeds: both runs, whether the images are identical, and a line saying so.

    Args:
        ar (`DecoderRun`), decoder (`DecoderRun`): the two generations.
        identical (`bool`): every image equal pixel for pixel.
        verdict (`str`): one line for the page: identical, or how much the images differ.
    """

    ar: DecoderRun
    decoder: DecoderRun
    identical: bool
    verdict: str

    @property
    def speedup(self) -> float:
        """AR's wall-clock over the decoder's."""
        return self.ar.stats.wall_time_s / max(self.decoder.stats.wall_time_s, 1e-9)


def decoder_summary(cls) -> str:
    """The first sentence of a decoder class's docstring, on one line."""
    doc = " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split())
    return doc.split(". ")[0].rstrip(".").replace("`", "") if doc else cls.__name__


def decoder_choices() -> List[tuple]:
    """``(label, short name)`` for every registered decoder but ``ar`` (the baseline every request runs): the label
    says whether the decoder is exact or lossy and what it does; the exact ones come first."""
    rows = []
    for name, cls in DECODERS.items():
        if name == "ar":
            continue
        exact = cls().is_exact
        rows.append((not exact, name, f"{name} ({'exact' if exact else 'lossy'}): {decoder_summary(cls)}"))
    return [(label, name) for _, name, label in sorted(rows)]


def check_request(prompt, decoder, seed, num_images, max_images: int) -> tuple:
    """Check one request before any work; returns ``(prompt, decoder, seed, num_images)`` with the numbers as ints.

    Args:
        prompt (`str`): the text of the image (not empty).
        decoder (`str`): a short name of `DECODERS` other than ``ar``.
        seed (`int`): image ``i`` is generated with ``seed + i``, in ``[0, 2**63 - 1 - num_images]``.
        num_images (`int`): images per prompt, in ``[1, max_images]``.
        max_images (`int`): the app's bound on ``num_images``.

    Raises:
        `ValueError` naming the argument and what it takes.
    """
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("`prompt` is empty: type the text of the image to generate, e.g. 'red heart'.")
    names = [name for _, name in decoder_choices()]
    if decoder not in names:
        raise ValueError(f"`decoder` must be one of {names} (the speculative decoder compared with ar), got {decoder!r}.")
    # number fields of a web page send floats
    num_images, seed = (int(v) if isinstance(v, float) and v.is_integer() else v for v in (num_images, seed))
    check_number("images per prompt", num_images, 1, max_images, integer=True, meaning=f"this app makes at most {max_images}")
    check_number("seed", seed, 0, 2**63 - 1 - num_images, integer=True, meaning="image i is generated with seed + i")
    return prompt.strip(), decoder, seed, num_images


def load_heads(pipe, heads: Sequence[str] = (), embedded: bool = False) -> Dict[str, object]:
    """The draft heads the registered decoders may use, loaded once: ``{kind: heads}``.

    Args:
        pipe (`SpatialARPipeline`): the pipeline; the heads are checked against its backbone and left detached.
        heads (`list[str]`): heads folders or Hub repo ids, keyed by the kind each provides.
        embedded (`bool`): also load the heads shipped with the embedded model, for every kind a decoder needs.
    """
    loaded = {}
    for path in heads:
        try:
            found = pipe.load_draft_heads(path)
        except OSError as err:
            raise ValueError(f"`--heads` {path!r} could not be loaded: {err}") from err
        loaded[found.provides.kind] = found
    if embedded:
        for cls in DECODERS.values():
            need = cls().heads_needed()
            if need is not None and not any(kind in loaded for kind in need.kinds):
                loaded[need.kinds[0]] = pipe.load_draft_heads(embedded_heads_path(need.kinds[0]))
    pipe.set_draft_heads(None)
    return loaded


def use_decoder(pipe, name: str, heads: Dict[str, object]) -> None:
    """Swap ``pipe``'s decoder for the registered decoder ``name`` with the loaded heads of a kind it drafts with.
    Raises `ValueError` naming the heads to pass (``--heads``) when none of the loaded ones fit."""
    decoder = DECODERS[name].from_config(pipe.decoder.config)
    need = decoder.heads_needed()
    chosen = None
    if need is not None:
        chosen = next((heads[kind] for kind in need.kinds if kind in heads), None)
        if chosen is None:
            raise ValueError(f"decoder {name!r} drafts with {need.describe()}, and this app has none loaded: restart "
                             f"it with `--heads FOLDER` (heads trained for this model), or pick another decoder.")
    pipe.set_draft_heads(None)
    pipe.decoder = decoder
    pipe.set_draft_heads(chosen)


def run_decoder(pipe, name: str, heads: Dict[str, object], prompt: str, seed: int, num_images: int) -> DecoderRun:
    """Generate ``num_images`` images of ``prompt`` with the decoder ``name``, image ``i`` from ``seed + i``."""
    use_decoder(pipe, name, heads)
    generators = [torch.Generator().manual_seed(seed + i) for i in range(num_images)]
    out = pipe(pipe.backbone.prompt_from_text(prompt), num_images_per_prompt=num_images, generator=generators)
    return DecoderRun(name, list(out.images), out.tokens.cpu(), out.stats, pipe.decoder.is_exact)


def compare_images(ar: DecoderRun, other: DecoderRun) -> tuple:
    """``(identical, verdict)``: whether every image of ``other`` equals AR's pixel for pixel, and a line saying so
    or how much they differ (the share of codes that differ, the mean pixel difference)."""
    pixels = [np.abs(np.asarray(a, np.int16) - np.asarray(b, np.int16)) for a, b in zip(ar.images, other.images)]
    identical = all(not p.any() for p in pixels) and torch.equal(ar.tokens, other.tokens)
    if identical:
        why = ("as an exact decoder under keyed noise must" if other.is_exact
               else "this time; a lossy decoder does not promise it")
        return True, f"Identical: the {other.name} images equal AR's pixel for pixel ({why})."
    codes = (ar.tokens != other.tokens).float().mean().item()
    mean = float(np.mean([p.mean() for p in pixels]))
    line = (f"Different: {other.name} ({'exact' if other.is_exact else 'lossy'}) changed {codes:.1%} of the codes; "
            f"mean pixel difference {mean:.1f} of 255.")
    if other.is_exact:
        line += " An exact decoder gives AR's images only under keyed noise; this run drew its noise."
    return False, line


def compare_decoders(pipe, heads: Dict[str, object], prompt: str, decoder: str, seed: int, num_images: int,
                     progress: Optional[Callable[[float, str], None]] = None) -> Comparison:
    """AR, then ``decoder``, on the same prompt and seeds (the pipeline is left with AR's decoder and no heads).

    Args:
        pipe (`SpatialARPipeline`): the pipeline. heads (`dict`): `load_heads`' loaded heads.
        prompt (`str`), decoder (`str`), seed (`int`), num_images (`int`): the request (`check_request`).
        progress (`Callable`, *optional*): ``progress(fraction, description)`` before each generation.
    """
    report = progress or (lambda fraction, desc: None)
    try:
        use_decoder(pipe, decoder, heads)  # a decoder whose heads are missing fails before AR runs
        report(0.0, "autoregressive")
        ar = run_decoder(pipe, "ar", heads, prompt, seed, num_images)
        report(0.5, decoder)
        other = run_decoder(pipe, decoder, heads, prompt, seed, num_images)
    finally:
        use_decoder(pipe, "ar", heads)
    report(1.0, "done")
    identical, verdict = compare_images(ar, other)
    return Comparison(ar, other, identical, verdict)


def _colour(t: float) -> tuple:
    """The palette's colour at ``t`` in ``[0, 1]`` (linear between its stops)."""
    x = min(max(t, 0.0), 1.0) * (len(PALETTE) - 1)
    i = min(int(x), len(PALETTE) - 2)
    f = x - i
    return tuple(round(a + (b - a) * f) for a, b in zip(PALETTE[i], PALETTE[i + 1]))


def _enlarge(image: Image.Image, size: int = DISPLAY_SIZE) -> Image.Image:
    """``image`` enlarged by a whole factor (nearest neighbour: codes stay sharp squares) to at least ``size``, with a
    white border of 2 pixels (images side by side on a grid stay apart)."""
    factor = max(1, math.ceil(size / max(image.size)))
    return ImageOps.expand(image.resize((image.width * factor, image.height * factor), Image.NEAREST), 2, "white")


def image_grid(images: Sequence[Image.Image]) -> Image.Image:
    """The images enlarged for the page, on a near-square grid (`cli.grid_image`)."""
    return grid_image([_enlarge(image.convert("RGB")) for image in images])


def acceptance_picture(acceptance_map: torch.Tensor, size: int = DISPLAY_SIZE) -> Image.Image:
    """Where the drafts landed: each code of each grid coloured by the accepted length of the pass that committed it
    (one code per pass: dark; the call's longest run: bright), enlarged to ``size`` pixels, the grids of several images
    on a near-square grid, with a colour bar under them.

    Args:
        acceptance_map (`torch.LongTensor` `(B, H, W)`): `DecodingStats.acceptance_map`.
        size (`int`): the smallest side, in pixels, of each grid's picture.
    """
    if acceptance_map.dim() != 3 or acceptance_map.numel() == 0:
        raise ValueError(f"`acceptance_map` must be a non-empty (B, H, W) tensor, got shape {tuple(acceptance_map.shape)}.")
    values = acceptance_map.detach().cpu().clamp(min=1).numpy()
    top = int(values.max())
    table = np.array([_colour((v - 1) / max(top - 1, 1)) for v in range(top + 1)], np.uint8)
    return _with_colour_bar(grid_image([_enlarge(Image.fromarray(table[v]), size) for v in values]), top)


def _with_colour_bar(picture: Image.Image, top: int) -> Image.Image:
    """``picture`` above a colour bar from 1 to ``top`` codes per pass, labelled."""
    font = ImageFont.load_default()
    width, bar, pad = picture.width, 14, 6
    canvas = Image.new("RGB", (width, picture.height + bar + 44), "white")
    canvas.paste(picture, (0, 0))
    draw = ImageDraw.Draw(canvas)
    y = picture.height + pad
    left, right = pad, width - pad
    for x in range(left, right):
        draw.line([(x, y), (x, y + bar)], fill=_colour((x - left) / max(right - left - 1, 1)))
    ticks = sorted({1, top, *(round(1 + (top - 1) * f) for f in (0.25, 0.5, 0.75))}) if top > 1 else [1]
    for value in ticks:
        x = left + (right - left - 1) * ((value - 1) / max(top - 1, 1))
        text = str(value)
        w = draw.textlength(text, font=font)
        draw.line([(x, y + bar), (x, y + bar + 3)], fill="black")
        draw.text((min(max(x - w / 2, 0), width - w), y + bar + 4), text, fill="black", font=font)
    caption = "codes accepted by the pass that committed each code"
    draw.text((pad, y + bar + 18), caption, fill="black", font=font)
    return canvas


def stats_table(comparison: Comparison) -> str:
    """A Markdown table: per decoder, wall-clock, target passes, codes per pass and the speed-up over AR."""
    rows = ["| decoder | wall-clock | target passes | codes per pass | speed-up |", "|---|---|---|---|---|"]
    for run in (comparison.ar, comparison.decoder):
        s = run.stats
        speedup = comparison.ar.stats.wall_time_s / max(s.wall_time_s, 1e-9)
        rows.append(f"| {run.name} | {s.wall_time_s:.2f} s | {s.num_forward_passes} | {s.mean_accepted_length:.2f} | "
                    f"{speedup:.2f}x |")
    return "\n".join(rows)


def build_app(pipe, heads: Dict[str, object], max_images: int = 4, max_queue: int = 8, model_name: str = "the embedded Twemoji model"):
    """The Gradio app around one loaded pipeline: prompt, seed, images per prompt and decoder in; both images, the
    stats, the verdict and the acceptance picture out. Requests queue (at most ``max_queue`` waiting, one running).

    Args:
        pipe (`SpatialARPipeline`): the pipeline, loaded once. heads (`dict`): `load_heads`' heads.
        max_images (`int`): the bound on images per prompt. max_queue (`int`): requests that may wait.
        model_name (`str`): what the page calls the model.
    """
    import gradio as gr

    check_number("max_images", max_images, 1, integer=True)
    check_number("max_queue", max_queue, 1, integer=True)
    choices = decoder_choices()
    default = "sjd" if "sjd" in dict(map(reversed, choices)) else choices[0][1]
    lock = threading.Lock()  # one pipeline: its decoder is swapped per request

    def run(prompt, decoder, seed, num_images, progress=gr.Progress(track_tqdm=True)):
        try:
            request = check_request(prompt, decoder, seed, num_images, max_images)
            with lock:
                result = compare_decoders(pipe, heads, *request, progress=lambda f, desc: progress(f, desc=desc))
        except ValueError as err:
            raise gr.Error(str(err), print_exception=False) from None
        return (image_grid(result.ar.images), image_grid(result.decoder.images),
                acceptance_picture(result.decoder.stats.acceptance_map), stats_table(result),
                f"{result.verdict}  \n**Speed-up: {result.speedup:.2f}x** ({result.decoder.name} over ar).")

    with gr.Blocks(title="spatial_pipelines demo") as app:
        gr.Markdown(f"# spatial_pipelines: AR and a speculative decoder side by side\nModel: {model_name}. Each click "
                    "generates the prompt's images with autoregressive decoding and with the decoder picked, from the "
                    "same seed.")
        with gr.Row():
            prompt = gr.Textbox(label="Prompt", placeholder="red heart", elem_id="prompt", scale=3)
            decoder = gr.Dropdown(choices=choices, value=default, label="Decoder", elem_id="decoder", scale=3)
            seed = gr.Number(value=0, precision=0, label="Seed", minimum=0, elem_id="seed", scale=1)
            num_images = gr.Slider(1, max_images, value=1, step=1, label="Images per prompt", elem_id="num-images", scale=1)
        button = gr.Button("Generate", variant="primary", elem_id="generate")
        with gr.Row():
            ar_image = gr.Image(label="AR (autoregressive)", type="pil", elem_id="ar-image", format="png", height=380)
            decoder_image = gr.Image(label="Speculative decoder", type="pil", elem_id="decoder-image", format="png", height=380)
            acceptance = gr.Image(label="Where the drafts landed", type="pil", elem_id="acceptance", format="png", height=380)
        verdict = gr.Markdown(label="Verdict", elem_id="verdict")
        stats = gr.Markdown(label="Stats", elem_id="stats")
        inputs = [prompt, decoder, seed, num_images]
        outputs = [ar_image, decoder_image, acceptance, stats, verdict]
        button.click(run, inputs, outputs, api_name="compare")
        prompt.submit(run, inputs, outputs, api_name=False)
    app.queue(max_size=max_queue, default_concurrency_limit=1)
    return app


def check_demo_args(args: argparse.Namespace) -> None:
    """The demo's options, checked before the model loads; `ValueError` naming the option."""
    check_number("--port", args.port, 0, 65535, integer=True, meaning="0 picks a free port")
    check_number("--max-images", args.max_images, 1, 64, integer=True, meaning="the bound on images per prompt")
    check_number("--max-queue", args.max_queue, 1, integer=True, meaning="requests that may wait")
    if args.model is not None:
        check_path_or_repo_id(args.model, "--model")
    for path in args.heads:
        check_path_or_repo_id(path, "--heads")


def serve(args: argparse.Namespace) -> int:
    """``spatial-pipelines demo``: load the model once, then serve the app on 127.0.0.1 until interrupted."""
    check_demo_args(args)
    try:
        import gradio  # noqa: F401
    except ImportError:
        print(f"error: the demo needs Gradio, an optional extra: {INSTALL_HINT}", file=sys.stderr)
        return 1
    pipe = load_pipeline(args.model or default_model_path(), DTYPES[args.dtype]).to(args.device)
    heads = load_heads(pipe, args.heads, embedded=args.model is None)
    name = args.model or "the embedded Twemoji model"
    app = build_app(pipe, heads, max_images=args.max_images, max_queue=args.max_queue, model_name=name)
    app.launch(server_name="127.0.0.1", server_port=args.port or None, share=args.share)
    return 0


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's options (``spatial-pipelines demo`` and ``python -m spatial_pipelines.demo``)."""
    d = parser
    d.add_argument("--model", default=None, help="a pipeline folder or Hub repo id (default: the embedded Twemoji model)")
    d.add_argument("--heads", nargs="*", default=[],
                   help="draft heads folders or Hub repo ids, one per kind (default with the embedded model: its shipped heads)")
    d.add_argument("--port", type=int, default=7860, help="port on 127.0.0.1 (0: a free one)")
    d.add_argument("--share", action="store_true", help="also serve through a public Gradio share link")
    d.add_argument("--max-images", type=int, default=4, help="the most images per prompt a request may ask for")
    d.add_argument("--max-queue", type=int, default=8, help="requests that may wait; more are turned away with a message")
    d.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    d.add_argument("--dtype", default="float32", choices=sorted(DTYPES))


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m spatial_pipelines.demo [options]``: the same as ``spatial-pipelines demo [options]``."""
    parser = argparse.ArgumentParser(prog="python -m spatial_pipelines.demo", description=__doc__.splitlines()[0])
    add_demo_arguments(parser)
    try:
        return serve(parser.parse_args(argv))
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
