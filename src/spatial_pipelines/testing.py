"""Tiny random pipelines for tests (ours and users'): CPU, built in well under a second, no downloads."""

import string
from typing import Any, Dict, Tuple, Union

import torch
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast, T5Config, T5EncoderModel

from .decoders import DECODERS, AutoregressiveDecoder, SpatialDecoderMixin
from .heads import DraftHeadsMixin
from .models import LlamaGenTransformer, LlamaGenVQModel
from .pipelines import LlamaGenPipeline, SpatialARPipeline
from .pipelines.pipeline_utils import _find_subclass

FAMILIES = ("llamagen", "janus", "emu3", "anole", "lumina_mgpt")


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A BERT-style WordPiece tokenizer over single characters, built in memory (no vocabulary download)."""
    chars = string.ascii_lowercase + string.digits + string.punctuation
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"] + list(chars) + [f"##{c}" for c in chars]
    tok = Tokenizer(models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]"
    )


def dummy_llamagen_components(
    grid: Tuple[int, int] = (4, 4),
    num_codes: int = 16,
    condition_type: str = "text",
    num_classes: int = 10,
    end_of_row: bool = False,
) -> Dict[str, Any]:
    """Random tiny LlamaGen components (call under a fixed seed for reproducibility)."""
    tokenizer = tiny_tokenizer() if condition_type == "text" else None
    text_encoder = None
    if condition_type == "text":
        text_encoder = T5EncoderModel(
            T5Config(vocab_size=len(tokenizer), d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2)
        ).eval()
    transformer = LlamaGenTransformer(
        vocab_size=num_codes, hidden_size=32, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, condition_type=condition_type, num_classes=num_classes, caption_dim=16,
        num_condition_tokens=8 if condition_type == "text" else 1, grid_height=grid[0], grid_width=grid[1],
        end_of_row_token=end_of_row,
    )
    # weights at a tiny model's natural scale (not LlamaGen's 0.02 for wide models): attention then depends on
    # content and position, so a wrong mask, position or cache entry changes the output and tests see it
    for name, param in transformer.named_parameters():
        if param.dim() == 2:
            torch.nn.init.normal_(param, std=1.0 / param.shape[-1] ** 0.5)
    torch.nn.init.normal_(transformer.tok_embeddings.weight, std=1.0)
    torch.nn.init.normal_(transformer.output.weight, std=0.5)
    if end_of_row:  # drawn last: the other weights are those of the same seed without an EOL
        torch.nn.init.normal_(transformer.eol_embedding, std=1.0)
    vqvae = LlamaGenVQModel(
        codebook_size=num_codes, codebook_embed_dim=4, encoder_ch_mult=(1, 2), decoder_ch_mult=(1, 2),
        z_channels=8, base_channels=8, num_res_blocks=1, norm_num_groups=4,
    )
    return {"transformer": transformer.eval(), "vqvae": vqvae.eval(), "text_encoder": text_encoder, "tokenizer": tokenizer}


def dummy_pipeline(
    family: str,
    decoder: Union[None, str, SpatialDecoderMixin] = None,
    draft_heads: Union[None, str, DraftHeadsMixin] = None,
    *,
    grid: Tuple[int, int] = (4, 4),
    num_codes: int = 16,
    seed: int = 0,
    condition_type: str = "text",
    end_of_row: bool = False,
) -> SpatialARPipeline:
    """A tiny random pipeline of ``family`` on CPU.

    Args:
        family (`str`): one of ``"llamagen"``, ``"janus"``, ``"emu3"``, ``"anole"``, ``"lumina_mgpt"``.
        decoder: a decoder, a short name from ``DECODERS`` (``"ar"`` ...), or ``None`` for `AutoregressiveDecoder`.
        draft_heads: heads, ``"random"`` for randomly initialised heads of the kind the decoder needs, or ``None``.
        grid (`tuple[int, int]`): the code grid (height, width).
        num_codes (`int`): codebook size.
        seed (`int`): weights are a function of the seed alone (the global RNG is left untouched).
        condition_type (`str`): LlamaGen only: ``"text"`` (a tiny T5 encoder) or ``"class"``.
        end_of_row (`bool`): LlamaGen only: give the transformer an end-of-row token fed after every row (the
            layout Emu3 and Lumina-mGPT use), to exercise EOL handling on a small model.
    """
    if family not in FAMILIES:
        raise ValueError(f"`family` must be one of {FAMILIES}, got {family!r}.")
    if family not in FAMILY_BUILDERS:
        raise ValueError(f"`family` {family!r} has no pipeline in this version; available: {tuple(FAMILY_BUILDERS)}.")
    if family != "llamagen" and (condition_type != "text" or end_of_row):
        raise ValueError("`condition_type` and `end_of_row` are LlamaGen options (a family's own layout is fixed).")
    if isinstance(decoder, str):
        if decoder not in DECODERS:
            raise ValueError(f"`decoder` must be one of {sorted(DECODERS)} or a decoder object, got {decoder!r}.")
        decoder = DECODERS[decoder]()
    decoder = decoder if decoder is not None else AutoregressiveDecoder()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        pipe = FAMILY_BUILDERS[family](decoder, grid, num_codes, condition_type=condition_type, end_of_row=end_of_row)
        if isinstance(draft_heads, str):
            if draft_heads != "random":
                raise ValueError(f"`draft_heads` must be heads, 'random' or None, got {draft_heads!r}.")
            draft_heads = random_draft_heads(pipe, decoder)
        if draft_heads is not None:
            pipe.set_draft_heads(draft_heads)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _llamagen(decoder: SpatialDecoderMixin, grid: Tuple[int, int], num_codes: int, condition_type: str = "text",
              end_of_row: bool = False) -> SpatialARPipeline:
    return LlamaGenPipeline(**dummy_llamagen_components(grid, num_codes, condition_type, end_of_row=end_of_row), decoder=decoder)


#: family -> ``builder(decoder, grid, num_codes, **family_options)`` returning the tiny pipeline (under a fixed seed).
#: A new family adds one entry.
FAMILY_BUILDERS: Dict[str, Any] = {"llamagen": _llamagen}


def random_draft_heads(pipe: SpatialARPipeline, decoder: SpatialDecoderMixin) -> DraftHeadsMixin:
    """Randomly initialised heads of the kind ``decoder`` needs, sized for ``pipe``'s backbone."""
    if decoder.draft_heads_class is None:
        raise ValueError(f"`draft_heads='random'`: {type(decoder).__name__} uses no draft heads.")
    heads_cls = _find_subclass(DraftHeadsMixin, decoder.draft_heads_class)
    if heads_cls is None or not hasattr(heads_cls, "for_backbone"):
        raise ValueError(f"`draft_heads='random'`: no heads class {decoder.draft_heads_class!r} is available.")
    return heads_cls.for_backbone(pipe.backbone, decoder)
