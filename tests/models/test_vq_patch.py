"""`PatchVQModel`: a code is a function of its own patch; the k-means fit; loading; a LlamaGen pipeline on it."""

import pytest
import torch

from spatial_pipelines import AutoregressiveDecoder, LlamaGenPipeline, PatchVQModel
from spatial_pipelines.models import load_vq_model
from spatial_pipelines.testing import dummy_llamagen_components


def blocky_images(n=6, side=16, seed=0):
    """White images with random coloured 4x4-aligned rectangles, in [-1, 1]."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.ones(n, 3, side, side)
    for i in range(n):
        for _ in range(3):
            r0, c0 = (torch.randint(0, side // 4, (2,), generator=gen) * 4).tolist()
            x[i, :, r0:r0 + 8, c0:c0 + 8] = torch.rand(3, 1, 1, generator=gen) * 2 - 1
    return x


def test_codebook_patches_encode_and_decode_exactly():
    torch.manual_seed(0)
    vq = PatchVQModel(codebook_size=8, patch_size=2, in_channels=3)
    codes = torch.randint(8, (2, 3, 5))
    pixels = vq.decode_code(codes)  # (2, 3, 6, 10)
    assert pixels.shape == (2, 3, 6, 10) and vq.downsample_factor == 2
    assert torch.equal(vq.encode(pixels).indices, codes)
    recon, enc = vq(pixels)
    assert torch.equal(recon, pixels) and enc.quant.shape == (2, 12, 3, 5)
    # channel-major patch layout: code c's vector reshaped (C, p, p) is exactly its patch
    assert torch.equal(pixels[0, :, :2, :2], vq.codebook[codes[0, 0, 0]].view(3, 2, 2))


def test_a_code_depends_on_its_own_patch_alone():
    torch.manual_seed(0)
    vq = PatchVQModel.fit(blocky_images(), codebook_size=16, patch_size=4, iterations=5)
    x = blocky_images(2, seed=1)
    before = vq.encode(x).indices
    y = x.clone()
    y[:, :, 4:, 4:] = torch.rand_like(y[:, :, 4:, 4:]) * 2 - 1  # every pixel below and right of patch (0, 0) changes
    after = vq.encode(y).indices
    assert torch.equal(before[:, 0, :], after[:, 0, :]) and torch.equal(before[:, :, 0], after[:, :, 0])


def test_fit_pins_the_background_and_beats_its_initial_codebook():
    x = blocky_images(8)
    fitted = PatchVQModel.fit(x, codebook_size=12, patch_size=4, iterations=10, seed=3)
    initial = PatchVQModel.fit(x, codebook_size=12, patch_size=4, iterations=0, seed=3)
    assert torch.equal(fitted.codebook[0], torch.ones(48))  # white is code 0, decoded exactly
    assert (fitted.encode(torch.ones(1, 3, 8, 8)).indices == 0).all()
    err = lambda vq: (vq(x)[0] - x).pow(2).mean().item()  # noqa: E731
    assert err(fitted) < err(initial)
    again = PatchVQModel.fit(x, codebook_size=12, patch_size=4, iterations=10, seed=3)
    assert torch.equal(again.codebook, fitted.codebook)  # seeded: the same codebook


@pytest.mark.parametrize("kwargs, message", [
    ({"iterations": -1}, "`iterations` must be >= 0"),
    ({"max_patches": 4}, "`max_patches` must be at least `codebook_size` (12)"),
    ({"background": 2.0}, "`background` must be in [-1, 1] or None"),
    ({"background": float("nan")}, "`background` must be in [-1, 1] or None"),
])
def test_fit_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError) as err:
        PatchVQModel.fit(blocky_images(2), codebook_size=12, patch_size=4, **kwargs)
    assert message in str(err.value)


def test_bad_pixels_and_sizes_raise():
    vq = PatchVQModel(codebook_size=4, patch_size=4)
    with pytest.raises(ValueError, match=r"`pixels` must be \(B, 3, H, W\) with H and W multiples of the patch size 4"):
        vq.encode(torch.zeros(1, 3, 10, 8))
    with pytest.raises(ValueError, match="must be positive"):
        PatchVQModel(codebook_size=0)
    with pytest.raises(ValueError, match="fewer than `codebook_size`"):
        PatchVQModel.fit(torch.zeros(1, 3, 4, 4), codebook_size=2, patch_size=4, max_patches=None)


def test_save_and_load_by_the_class_the_config_names(tmp_path):
    vq = PatchVQModel.fit(blocky_images(), codebook_size=16, patch_size=4, iterations=3)
    vq.save_pretrained(tmp_path / "patch")
    loaded = load_vq_model(str(tmp_path / "patch"))
    assert type(loaded) is PatchVQModel and torch.equal(loaded.codebook, vq.codebook)
    assert (tmp_path / "patch" / "diffusion_pytorch_model.safetensors").is_file()
    conv = dummy_llamagen_components()["vqvae"]
    conv.save_pretrained(tmp_path / "conv")
    assert type(load_vq_model(str(tmp_path / "conv"))).__name__ == "LlamaGenVQModel"
    with pytest.raises(ValueError, match="no config.json"):
        load_vq_model(str(tmp_path / "missing"))


def test_a_llamagen_pipeline_draws_through_a_patch_tokenizer_and_round_trips(tmp_path):
    torch.manual_seed(0)
    parts = dummy_llamagen_components(grid=(4, 4), num_codes=16)
    parts["vqvae"] = PatchVQModel.fit(blocky_images(), codebook_size=16, patch_size=4, iterations=3)
    pipe = LlamaGenPipeline(decoder=AutoregressiveDecoder(), **parts)
    pipe.set_progress_bar_config(disable=True)
    out = pipe("red heart", guidance_scale=2.0, temperature=0, output_type="pt")
    assert out.images.shape == (1, 3, 16, 16)
    codes = pipe("red heart", guidance_scale=2.0, temperature=0, output_type="latent").tokens
    expected = (pipe.vqvae.decode_code(codes.view(1, 4, 4)).clamp(-1, 1) + 1) / 2
    assert torch.allclose(out.images, expected, atol=1e-6)
    pipe.save_pretrained(tmp_path / "pipe")
    again = LlamaGenPipeline.from_pretrained(tmp_path / "pipe")
    assert type(again.vqvae) is PatchVQModel and torch.equal(again.vqvae.codebook, pipe.vqvae.codebook)
