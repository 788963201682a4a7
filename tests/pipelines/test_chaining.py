"""Our images feed diffusers: img2img on our PIL / tensor outputs, `make_image_grid`, a progressive GIF.

The diffusers side is a tiny random `StableDiffusionImg2ImgPipeline` built from configs, with a CLIP tokenizer
made from a vocabulary and merges written to a temporary folder: nothing is downloaded.
"""

import json
import string

import numpy as np
import PIL.Image
import pytest
import torch
from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionImg2ImgPipeline, UNet2DConditionModel
from diffusers.image_processor import VaeImageProcessor
from diffusers.utils import export_to_gif, make_image_grid
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

from spatial_pipelines import AutoregressiveDecoder, JacobiDecoder
from spatial_pipelines.embedded import load_default_pipeline
from spatial_pipelines.testing import dummy_pipeline

PROMPTS = ["a fox", "a red fox"]
MAX_TEXT_LENGTH = 16


def write_tiny_clip_tokenizer(folder) -> None:
    """A minimal byte-level BPE vocabulary (CLIP's format: word-final pieces end in ``</w>``) and merges."""
    chars = string.ascii_lowercase + string.digits
    pieces = ["<|startoftext|>", "<|endoftext|>"] + list(chars) + [c + "</w>" for c in chars]
    merges = [("o", "x</w>"), ("r", "e"), ("re", "d</w>"), ("f", "ox</w>")]
    pieces += ["".join(m) for m in merges]
    (folder / "vocab.json").write_text(json.dumps({p: i for i, p in enumerate(pieces)}))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))


@pytest.fixture(scope="module")
def img2img(tmp_path_factory):
    """A tiny random SD img2img pipeline on the CPU (VAE scale factor 2, UNet with two resolutions)."""
    folder = tmp_path_factory.mktemp("clip_tokenizer")
    write_tiny_clip_tokenizer(folder)
    tokenizer = CLIPTokenizer.from_pretrained(folder, model_max_length=MAX_TEXT_LENGTH)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        unet = UNet2DConditionModel(
            sample_size=16, in_channels=4, out_channels=4, block_out_channels=(32, 64), layers_per_block=1,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
            cross_attention_dim=32, attention_head_dim=8, norm_num_groups=16,
        )
        vae = AutoencoderKL(
            in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(16, 32), layers_per_block=1,
            down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2, norm_num_groups=8,
        )
        text_encoder = CLIPTextModel(
            CLIPTextConfig(
                vocab_size=len(tokenizer), hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=MAX_TEXT_LENGTH,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
        )
    scheduler = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False,
        set_alpha_to_one=False, steps_offset=1,
    )
    pipe = StableDiffusionImg2ImgPipeline(
        vae=vae.eval(), text_encoder=text_encoder.eval(), tokenizer=tokenizer, unet=unet.eval(), scheduler=scheduler,
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def ar_pipe():
    return dummy_pipeline("llamagen")  # 4x4 codes, VQ scale factor 2: 8x8 images


def run_img2img(img2img, image, output_type="np"):
    return img2img(
        prompt=PROMPTS, image=image, num_inference_steps=2, strength=0.5, output_type=output_type,
        generator=torch.Generator().manual_seed(0),
    ).images


def test_the_offline_clip_tokenizer_is_a_real_bpe(img2img):
    tok = img2img.tokenizer
    ids = tok("A Red Fox").input_ids
    assert tok.convert_ids_to_tokens(ids) == ["<|startoftext|>", "a</w>", "red</w>", "fox</w>", "<|endoftext|>"]
    assert tok.convert_ids_to_tokens(tok("zq").input_ids)[1:-1] == ["z", "q</w>"]  # no merge: characters
    padded = tok(PROMPTS, padding="max_length", max_length=tok.model_max_length, return_tensors="pt").input_ids
    assert padded.shape == (2, MAX_TEXT_LENGTH)


@torch.no_grad()
def test_img2img_on_our_pil_images(ar_pipe, img2img):
    out = ar_pipe(PROMPTS, output_type="pil", generator=torch.Generator().manual_seed(0))
    assert [im.size for im in out.images] == [(8, 8)] * 2
    images = run_img2img(img2img, out.images)
    assert images.shape == (2, 8, 8, 3) and images.dtype == np.float32
    assert np.isfinite(images).all() and images.min() >= 0 and images.max() <= 1


@torch.no_grad()
def test_img2img_on_our_tensors_in_0_1_as_diffusers_expects(ar_pipe, img2img):
    # our "pt" images are (B, 3, H, W) in [0, 1]: the range diffusers' VaeImageProcessor.preprocess expects for
    # tensors (it maps them to [-1, 1] itself), so they go in as they are
    pt = ar_pipe(PROMPTS, output_type="pt", generator=torch.Generator().manual_seed(0)).images
    pil = ar_pipe(PROMPTS, output_type="pil", generator=torch.Generator().manual_seed(0)).images
    assert pt.shape == (2, 3, 8, 8) and pt.min() >= 0 and pt.max() <= 1
    processor = VaeImageProcessor(vae_scale_factor=img2img.vae_scale_factor)
    # the tensor and the PIL route reach the VAE as the same [-1, 1] batch (up to PIL's 8-bit rounding)
    torch.testing.assert_close(processor.preprocess(pt), processor.preprocess(pil), atol=2 / 255, rtol=0)

    images = run_img2img(img2img, pt, output_type="pt")
    assert images.shape == (2, 3, 8, 8) and images.min() >= 0 and images.max() <= 1
    from_pil = run_img2img(img2img, pil, output_type="pt")
    torch.testing.assert_close(images, from_pil, atol=0.05, rtol=0)

    # the raw VQ decode `pipe.backbone.decode_image` is in [-1, 1]: diffusers warns and deprecates such tensors;
    # convert it with our image processor (or `(x + 1) / 2`) first
    codes = ar_pipe(PROMPTS, output_type="latent", generator=torch.Generator().manual_seed(0)).images
    raw = ar_pipe.backbone.decode_image(codes)
    assert raw.min() < 0
    with pytest.warns(FutureWarning, match=r"\[-1,1\]"):
        processor.preprocess(raw)
    torch.testing.assert_close(ar_pipe.image_processor.postprocess(raw, output_type="pt"), pt)
    torch.testing.assert_close((raw / 2 + 0.5).clamp(0, 1), pt)


@torch.no_grad()
def test_resize_to_a_multiple_of_8_with_vae_image_processor(img2img):
    ar_pipe = dummy_pipeline("llamagen", grid=(6, 6))  # 12x12 images: not a multiple of 8
    out = ar_pipe(PROMPTS, output_type="pil", generator=torch.Generator().manual_seed(0))
    processor = VaeImageProcessor(vae_scale_factor=8)  # Stable Diffusion's VAE downsamples 8x
    height, width = processor.get_default_height_width(out.images[0], 2 * 12, 2 * 12)  # 2x, rounded down to 8k
    assert (height, width) == (24, 24)
    resized = [processor.resize(im, height, width) for im in out.images]
    assert [im.size for im in resized] == [(24, 24)] * 2
    assert run_img2img(img2img, resized).shape == (2, 24, 24, 3)

    pt = ar_pipe(PROMPTS, output_type="pt", generator=torch.Generator().manual_seed(0)).images
    resized_pt = processor.resize(pt, height, width)  # tensors too; the range stays [0, 1]
    assert resized_pt.shape == (2, 3, 24, 24) and resized_pt.min() >= 0 and resized_pt.max() <= 1
    assert run_img2img(img2img, resized_pt, output_type="pt").shape == (2, 3, 24, 24)


@torch.no_grad()
def test_img2img_on_the_embedded_model(img2img):
    pipe = load_default_pipeline()  # 96x96 images: already a multiple of 8, no resize needed
    pipe.set_progress_bar_config(disable=True)
    pipe.decoder = JacobiDecoder(window_size=8)  # exact and faster than AR
    out = pipe("red heart", output_type="pil", generator=torch.Generator().manual_seed(0))
    assert out.images[0].size == (96, 96)
    assert VaeImageProcessor(vae_scale_factor=8).get_default_height_width(out.images[0]) == (96, 96)
    images = img2img(
        prompt="red heart", image=out.images, num_inference_steps=2, strength=0.5, output_type="np",
        generator=torch.Generator().manual_seed(0),
    ).images
    assert images.shape == (1, 96, 96, 3) and np.isfinite(images).all()


@torch.no_grad()
def test_make_image_grid_on_a_batch_of_4(ar_pipe):
    out = ar_pipe("a fox", num_images_per_prompt=4, output_type="pil", generator=torch.Generator().manual_seed(0))
    grid = make_image_grid(out.images, rows=2, cols=2)
    assert grid.size == (16, 16)
    for i, im in enumerate(out.images):
        x, y = 8 * (i % 2), 8 * (i // 2)
        assert np.array_equal(np.asarray(grid.crop((x, y, x + 8, y + 8))), np.asarray(im))


def preview(pipe, tokens: torch.Tensor) -> PIL.Image.Image:
    """The partial grid decoded with code 0 in the undecoded cells (``-1``), which are then painted grey."""
    pixels = pipe.backbone.decode_image(tokens.clamp(min=0))  # (B, 3, h, w) in [-1, 1]
    todo = torch.nn.functional.interpolate((tokens < 0)[:, None].float(), size=pixels.shape[-2:]) > 0
    return pipe.image_processor.postprocess(pixels.masked_fill(todo, 0.0), output_type="pil")[0]


@pytest.mark.parametrize("decoder", [AutoregressiveDecoder(), JacobiDecoder(window_size=4)], ids=["ar", "sjd"])
@torch.no_grad()
def test_progressive_gif_from_callback_on_step_end(decoder, tmp_path):
    pipe = dummy_pipeline("llamagen", decoder)
    frames, undecoded = [], []

    def on_step_end(pipe, step, num_committed, callback_kwargs):
        tokens = callback_kwargs["tokens"]  # (B, H, W), -1 where not decoded yet
        undecoded.append(int((tokens < 0).sum()))
        frames.append(preview(pipe, tokens))
        return callback_kwargs

    out = pipe("a fox", generator=torch.Generator().manual_seed(0), callback_on_step_end=on_step_end)
    num_codes = out.tokens.numel()
    assert len(frames) == out.stats.num_forward_passes - 1  # one per target pass after the prefill
    assert undecoded[-1] == 0 and all(a > b for a, b in zip(undecoded, undecoded[1:]))
    assert np.array_equal(np.asarray(frames[-1]), np.asarray(out.images[0]))  # the last preview is the image
    if isinstance(decoder, AutoregressiveDecoder):
        assert len(frames) == num_codes - 1  # the prefill pass commits the first code
    else:
        assert len(frames) < num_codes - 1  # speculation: fewer passes than codes

    path = export_to_gif(frames, str(tmp_path / "progress.gif"))
    with PIL.Image.open(path) as gif:
        assert gif.n_frames == len(frames) == out.stats.num_forward_passes - 1
        assert gif.size == frames[0].size
