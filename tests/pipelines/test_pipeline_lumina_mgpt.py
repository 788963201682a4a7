"""Lumina-mGPT (Chameleon architecture with resolution and end-of-row tokens): the shared pipeline contract, its prompt
template and structural tokens, token-for-token agreement with the plain reference loop over the transformers model
(EOLs and resolution tokens written in), loading its repo layout (tokenizer files only) plus a VQ checkpoint."""

import json

import pytest
import torch

from spatial_pipelines import AutoregressiveDecoder, JacobiDecoder, LuminaMGPTPipeline, SSDDecoder
from spatial_pipelines.testing import dummy_pipeline

from helpers import OracleHeads, PipelineTesterMixin, chameleon_reference_greedy, gen, write_transformers_repo

PROMPTS = ["a red fox", "blue sky", "x"]


class TestLuminaMGPTPipeline(PipelineTesterMixin):
    family = "lumina_mgpt"
    pipeline_class = LuminaMGPTPipeline
    prompts = PROMPTS
    bad_prompts = [([1, 2], "prompt"), (["ok", 3], "prompt")]
    failing_component = "vqgan"

    def test_defaults_travel_with_the_transformer(self, tmp_path):
        pipe = self.get_pipeline(grid=(3, 5))
        pipe.save_pretrained(tmp_path / "pipe")
        for p in (LuminaMGPTPipeline(**pipe.components), LuminaMGPTPipeline.from_pretrained(tmp_path / "pipe")):
            b = p.backbone
            assert (b.layout.height, b.layout.width, b.layout.row_stride) == (3, 5, 6)
            assert b.default_guidance_scale == 3.0 and b.default_top_k == 2000 and b.resolution_patch_size == 2
        index = json.loads((tmp_path / "pipe" / "model_index.json").read_text())
        assert index["transformer"] == ["transformers", "ChameleonForConditionalGeneration"]

    def test_eol_is_never_in_the_tokens(self):
        pipe = self.get_pipeline()
        tokens = pipe(self.prompts, generator=gen(0), output_type="latent").tokens
        assert tokens.max() < pipe.backbone.num_image_codes


def test_structure_tokens_and_template():
    """``BOS "Generate an image of {w}x{h} ...:\\n{prompt}" <reserved08706> <racm3:break> <res h> <res w>``; the
    unconditional row ``<racm3:break> <res h> <res w>``; the EOL ``<reserved08799>`` in the layout."""
    pipe = dummy_pipeline("lumina_mgpt", grid=(4, 5))  # 2 px per code, one resolution step per 2 px: 8 x 10 px
    vocab = pipe.transformer.config.vocabulary_map
    backbone = pipe.backbone
    assert backbone.prompt_text("a fox") == "Generate an image of 10x8 according to the following prompt:\na fox"
    start = [vocab["<racm3:break>"], vocab["<reserved08804>"], vocab["<reserved08805>"]]
    ids, valid = backbone.prompt_ids(["a fox"], None, True, torch.device("cpu"))
    text = pipe.processor(backbone.prompt_text("a fox"), add_special_tokens=False).input_ids
    assert ids[0][valid[0]].tolist() == [vocab["<s>"], *text, vocab["<reserved08706>"], *start]
    assert ids[1][valid[1]].tolist() == start
    layout = backbone.layout
    assert layout.eol_token_id == vocab["<reserved08799>"] and layout.row_stride == 6
    torch.testing.assert_close(backbone.eol_embedding, pipe.transformer.get_input_embeddings().weight[vocab["<reserved08799>"]])
    # two codes per resolution step, as the released checkpoints (16 px codes, 32 px steps): 48 codes -> 24 steps
    pipe.transformer.generation_config.resolution_patch_size = 4
    pipe.transformer.generation_config.image_grid = [48, 32]
    assert backbone.image_start_ids()[1:] == [vocab["<reserved08824>"], vocab["<reserved08816>"]]
    assert backbone.prompt_text("x").startswith("Generate an image of 64x96 ")
    pipe.transformer.generation_config.image_grid = [47, 32]
    with pytest.raises(ValueError, match="image_grid"):
        backbone.image_start_ids()


@pytest.mark.parametrize("prompts,guidance_scale,negative", [
    (["a red fox", "x"], 3.0, None),  # Lumina's unconditional row, batch with left padding
    (["a red fox"], 3.0, ["blue sky"]),  # a negative prompt (the template around it)
    (["blue sky"], 1.0, None),
], ids=["cfg-batch", "cfg-negative", "no-cfg"])
def test_greedy_equals_the_reference_loop(prompts, guidance_scale, negative):
    """Invariant 1 against the plain transformers loop with Lumina's sequence written out (resolution tokens after
    ``<racm3:break>``, an EOL after every row), for the AR decoder and a speculative one whose windows cross row ends."""
    pipe = dummy_pipeline("lumina_mgpt", grid=(4, 5))
    ref = chameleon_reference_greedy(pipe, prompts, guidance_scale, negative, lumina=True)
    assert ref.unique().numel() > 1
    for decoder in (AutoregressiveDecoder(), JacobiDecoder(window_size=4)):
        pipe.decoder = decoder
        out = pipe(prompts, negative_prompt=negative, guidance_scale=guidance_scale, temperature=0, output_type="latent")
        assert torch.equal(out.tokens, ref), type(decoder).__name__


def test_reference_sees_a_missing_eol():
    """Control: the same loop without the EOLs gives another grid, so the comparison above fails for a loop that
    skips them."""
    pipe = dummy_pipeline("lumina_mgpt", grid=(4, 5))
    with_eol = chameleon_reference_greedy(pipe, ["a red fox"], 3.0, lumina=True)
    assert not torch.equal(with_eol, chameleon_reference_greedy(pipe, ["a red fox"], 3.0, lumina=True, eol=False))


def test_ssd_oracle_drafts_give_the_autoregressive_grid():
    """Drafts that are the AR grid itself are all accepted and give it back: SSD's drafts land on the right positions
    of Lumina's EOL layout (CFG, batch 2)."""
    pipe = dummy_pipeline("lumina_mgpt", grid=(4, 5))
    prompts = ["a red fox", "x"]
    ref = pipe(prompts, temperature=0, output_type="latent").tokens
    decoder = SSDDecoder(num_horizontal=2, vertical_rounds=0, horizontal_rounds=0)
    heads = OracleHeads.for_backbone(pipe.backbone, decoder, random_init=False)
    heads.set_grid(ref)
    pipe.decoder = decoder
    pipe.set_draft_heads(heads)
    assert torch.equal(pipe(prompts, temperature=0, output_type="latent").tokens, ref)


def test_from_backbone_folder(tmp_path):
    """Lumina's repo layout: config.json (model_type chameleon, with Lumina's extra ``z_loss_weight``; here without a
    ``vocabulary_map``), safetensors and tokenizer files only (no processor); the VQGAN from a converted folder; the
    grid from the repo name's size."""
    pipe = dummy_pipeline("lumina_mgpt", grid=(4, 5))
    repo = write_transformers_repo(pipe, tmp_path / "Lumina-mGPT-7B-512")
    config = json.loads((repo / "config.json").read_text())
    config.update(z_loss_weight=0.0, architectures=["ChameleonXLLMXForConditionalGeneration"])
    del config["vocabulary_map"]  # then the image-token names come from the tokenizer
    (repo / "config.json").write_text(json.dumps(config))
    assert not (repo / "processor_config.json").exists() and not (repo / "preprocessor_config.json").exists()
    pipe.vqgan.save_pretrained(tmp_path / "vq")
    plain = LuminaMGPTPipeline.from_backbone(repo, vq=tmp_path / "vq")
    b = plain.backbone
    assert (b.layout.height, b.layout.width, b.layout.has_eol) == (256, 256, True)  # 512 px / 2 px per tiny code
    assert b.default_guidance_scale == 3.0 and b.default_top_k == 2000 and b.resolution_patch_size == 32

    loaded = LuminaMGPTPipeline.from_backbone(repo, vq=tmp_path / "vq", image_grid=(4, 5), resolution_patch_size=2,
                                              default_top_k=0, dtype=torch.float32)
    loaded.set_progress_bar_config(disable=True)
    assert loaded.backbone.default_top_k == 0
    ref = pipe(PROMPTS, temperature=0, output_type="latent").tokens
    assert torch.equal(loaded(PROMPTS, temperature=0, output_type="latent").tokens, ref)
    assert LuminaMGPTPipeline.default_image_grid_for("Alpha-VLLM/Lumina-mGPT-7B-768", 16) == (48, 48)
    assert LuminaMGPTPipeline.default_image_grid_for("somewhere/else", 16) == (48, 48)
    with pytest.raises(ValueError, match="dtype"):
        LuminaMGPTPipeline.from_backbone(repo, vq=tmp_path / "vq", torch_dtype=torch.bfloat16, dtype=torch.float32)
    with pytest.raises(ValueError, match="resolution_patch_size"):
        LuminaMGPTPipeline.from_backbone(repo, vq=tmp_path / "vq", resolution_patch_size=0)
