import pytest
import torch

from pipeline_mixin import PipelineTesterMixin, gen
from spatial_pipelines import LlamaGenPipeline
from spatial_pipelines.testing import dummy_pipeline


class TestLlamaGenTextPipeline(PipelineTesterMixin):
    family = "llamagen"
    pipeline_class = LlamaGenPipeline
    bad_prompts = [([1, 2], "prompt"), (["ok", 3], "prompt")]

    def test_left_padding_matches_unpadded_caption(self):
        # a short caption padded to the prefix length must act exactly like the same caption with no padding
        pipe = self.get_pipeline()
        backbone = pipe.backbone
        emb = backbone.encode_prompt(["ab"], None, False, torch.device("cpu"))
        assert emb.valid[0].tolist() == [False] * 4 + [True] * 4  # [CLS] a ##b [SEP] at the end
        n_pad = int((~emb.valid[0]).sum())
        full = backbone.forward(emb.embeds, torch.arange(8), None, emb.valid, None)[:, -1]
        trimmed = backbone.forward(emb.embeds[:, n_pad:], torch.arange(n_pad, 8), None, None, None)[:, -1]
        torch.testing.assert_close(full, trimmed, rtol=1e-5, atol=1e-5)

    def test_default_guidance_is_llamagen_t2i(self):
        assert self.get_pipeline().backbone.default_guidance_scale == 7.5


class TestLlamaGenClassPipeline(PipelineTesterMixin):
    family = "llamagen"
    pipeline_class = LlamaGenPipeline
    dummy_kwargs = {"condition_type": "class"}
    prompts = [3, 7, 1]
    bad_prompts = [("a red fox", "prompt"), ([10], "prompt"), ([-1], "prompt")]

    def test_default_guidance_is_llamagen_c2i(self):
        assert self.get_pipeline().backbone.default_guidance_scale == 4.0


def test_rectangular_grid():
    pipe = dummy_pipeline("llamagen", grid=(2, 5), num_codes=8)
    out = pipe("wide", generator=gen(0), output_type="pt")
    assert out.tokens.shape == (1, 2, 5) and out.images.shape == (1, 3, 4, 10)
    assert out.stats.num_forward_passes == 10


def test_text_prompt_needs_text_encoder():
    pipe = dummy_pipeline("llamagen")
    pipe.register_modules(text_encoder=None)
    with pytest.raises(ValueError, match="text_encoder"):
        pipe("a fox")


def test_dummy_pipeline_rejects_unknown_family():
    with pytest.raises(ValueError, match="family"):
        dummy_pipeline("dalle")


def test_dummy_pipeline_is_deterministic_and_leaves_global_rng():
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    a, b = dummy_pipeline("llamagen", seed=5), dummy_pipeline("llamagen", seed=5)
    assert torch.equal(torch.random.get_rng_state(), state)
    for p, q in zip(a.transformer.parameters(), b.transformer.parameters()):
        assert torch.equal(p, q)
