"""Tiny random pipelines for tests (ours and users'): CPU, built in well under a second, no downloads."""

import inspect
import string
from typing import Any, Dict, Tuple, Union

import torch
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast, T5Config, T5EncoderModel

from .decoders import DECODERS, AutoregressiveDecoder, SpatialDecoderMixin
from .heads import DraftHeadsMixin, heads_class_for
from .models import LlamaGenTransformer, LlamaGenVQModel
from .pipelines import SpatialARPipeline, family_pipelines
from .utils import DerivedMapping

#: ``{family: pipeline class}`` of every loaded family (`family_pipelines`: a pipeline class with its own
#: ``dummy_components``), read off the classes at each access: a family defined in a test module is in it.
FAMILIES = DerivedMapping(family_pipelines)


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
        family (`str`): a key of `FAMILIES` (``"llamagen"``, ``"janus"``, ``"emu3"``, ...: its pipeline class's
            ``dummy_components`` builds the components).
        decoder: a decoder, a short name from ``DECODERS`` (``"ar"`` ...), or ``None`` for `AutoregressiveDecoder`.
        draft_heads: heads, ``"random"`` for randomly initialised heads of the kind the decoder needs, or ``None``.
        grid (`tuple[int, int]`): the code grid (height, width).
        num_codes (`int`): codebook size.
        seed (`int`): weights are a function of the seed alone (the global RNG is left untouched).
        condition_type (`str`): LlamaGen only: ``"text"`` (a tiny T5 encoder) or ``"class"``.
        end_of_row (`bool`): LlamaGen only: give the transformer an end-of-row token fed after every row (the
            layout Emu3 and Lumina-mGPT use), to exercise EOL handling on a small model.
    """
    pipeline_class = FAMILIES.get(family)
    if pipeline_class is None:
        raise ValueError(f"`family` must be one of {tuple(FAMILIES)}, got {family!r}.")
    options = {**({"condition_type": condition_type} if condition_type != "text" else {}),
               **({"end_of_row": end_of_row} if end_of_row else {})}  # LlamaGen's, passed only when set
    accepted = inspect.signature(pipeline_class.dummy_components).parameters
    if any(k not in accepted for k in options):
        raise ValueError("`condition_type` and `end_of_row` are LlamaGen options (a family's own layout is fixed).")
    if isinstance(decoder, str):
        if decoder not in DECODERS:
            raise ValueError(f"`decoder` must be one of {sorted(DECODERS)} or a decoder object, got {decoder!r}.")
        decoder = DECODERS[decoder]()
    decoder = decoder if decoder is not None else AutoregressiveDecoder()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        pipe = pipeline_class(**pipeline_class.dummy_components(grid, num_codes, **options), decoder=decoder)
        if isinstance(draft_heads, str):
            if draft_heads != "random":
                raise ValueError(f"`draft_heads` must be heads, 'random' or None, got {draft_heads!r}.")
            draft_heads = random_draft_heads(pipe, decoder)
        if draft_heads is not None:
            pipe.set_draft_heads(draft_heads)
    pipe.set_progress_bar_config(disable=True)
    return pipe



#: The tiny Janus tokenizer's special tokens (the real checkpoints' image tokens; short BOS/EOS/pad names).
JANUS_SPECIAL_TOKENS = ("<pad>", "<unk>", "<bos>", "<eos>", "<begin_of_image>", "<end_of_image>", "<image_placeholder>",
                        "<|User|>", "<|Assistant|>")
#: Janus-Pro's chat template in short: ``<|User|>: {text}\n\n<|Assistant|>:`` (the processor then appends BOI).
JANUS_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}<|User|>: {% else %}<|Assistant|>: {% endif %}"
    "{% for content in message['content'] %}{% if content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}"
    "{{ '\\n\\n' }}{% endfor %}{% if add_generation_prompt %}<|Assistant|>:{% endif %}"
)


def tiny_janus_processor(image_size: int = 16):
    """A `JanusProcessor` over a character-level tokenizer with Janus' special tokens and a chat template, built in
    memory (BOS prepended as Janus' Llama tokenizer does; image processor normalising with mean = std = 0.5)."""
    from tokenizers import AddedToken
    from transformers import JanusProcessor
    from transformers.models.janus.image_processing_pil_janus import JanusImageProcessorPil

    chars = string.ascii_lowercase + string.digits + string.punctuation
    vocab = list(JANUS_SPECIAL_TOKENS) + list(chars) + [f"##{c}" for c in chars]
    tok = Tokenizer(models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="<unk>"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in JANUS_SPECIAL_TOKENS])
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", vocab.index("<bos>"))])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>",
        extra_special_tokens={"image_token": "<image_placeholder>", "boi_token": "<begin_of_image>", "eoi_token": "<end_of_image>"},
    )
    image_processor = JanusImageProcessorPil(image_mean=[0.5] * 3, image_std=[0.5] * 3, size={"height": image_size, "width": image_size})
    return JanusProcessor(image_processor=image_processor, tokenizer=tokenizer, chat_template=JANUS_CHAT_TEMPLATE)


def dummy_janus_components(grid: Tuple[int, int] = (4, 4), num_codes: int = 16) -> Dict[str, Any]:
    """Random tiny Janus-Pro components (call under a fixed seed): a 2-layer Llama trunk of width 32, a VQ decoder
    that upsamples 2x, and ``grid[0] * grid[1]`` codes per image (``num_image_tokens``; the VQ reads ``grid[0]`` rows)."""
    from transformers import JanusConfig, JanusForConditionalGeneration, JanusVisionConfig, JanusVQVAEConfig, LlamaConfig

    patch = 4
    processor = tiny_janus_processor(grid[0] * patch)
    tokenizer = processor.tokenizer
    ids = {name: tokenizer.convert_tokens_to_ids(t) for name, t in
           (("pad", "<pad>"), ("bos", "<bos>"), ("eos", "<eos>"), ("boi", "<begin_of_image>"), ("image", "<image_placeholder>"))}
    text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=4096, bos_token_id=ids["bos"], eos_token_id=ids["eos"],
                       pad_token_id=ids["pad"])
    vision = JanusVisionConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, mlp_ratio=2, image_size=grid[0] * patch,
                               patch_size=patch, projection_dim=32, num_image_tokens=grid[0] * grid[1])
    vq = JanusVQVAEConfig(embed_dim=4, num_embeddings=num_codes, latent_channels=8, base_channels=32, channel_multiplier=[1, 1],
                          num_res_blocks=1, projection_dim=32, image_token_embed_dim=32, num_hidden_layers=2)
    config = JanusConfig(text_config=text, vision_config=vision, vq_config=vq, image_token_id=ids["image"])
    config._attn_implementation = "sdpa"
    model = JanusForConditionalGeneration(config).eval()
    # weights at a tiny model's natural scale (not 0.02): outputs then depend on content and position
    for name, param in model.named_parameters():
        if param.dim() == 2 and not name.startswith("model.vision_model"):
            torch.nn.init.normal_(param, std=1.0 / param.shape[-1] ** 0.5)
    torch.nn.init.normal_(model.model.language_model.embed_tokens.weight, std=1.0)
    torch.nn.init.normal_(model.model.generation_embeddings.weight, std=1.0)
    gen = model.generation_config  # what `generate(generation_mode="image")` and the released checkpoints set
    gen.guidance_scale, gen.temperature = 5.0, 1.0
    gen.bos_token_id, gen.pad_token_id = ids["bos"], ids["pad"]
    gen.generation_kwargs = {"boi_token_id": ids["boi"]}
    return {"transformer": model, "processor": processor}



#: The tiny Emu3 tokenizer's special tokens: Emu3's names (BOS ``<|extra_203|>``, EOS ``<|extra_204|>``, pad, image
#: start/end/wrapper, EOL ``<|extra_200|>``, EOF ``<|extra_201|>``, the ``<image>`` placeholder).
EMU3_SPECIAL_TOKENS = ("<|endoftext|>", "<|extra_203|>", "<|extra_204|>", "<image>", "<|image start|>", "<|image end|>",
                       "<|image token|>", "<|extra_200|>", "<|extra_201|>")


def tiny_emu3_processor(num_codes: int = 16):
    """An `Emu3Processor` over a byte-level tokenizer (no merges: one token per byte, like Emu3's BPE without its
    merges) holding Emu3's special tokens and ``num_codes`` visual tokens ``<|visual token NNNNNN|>``, built in memory.
    The visual tokens get ids in a shuffled order, so code -> id is not an offset (Emu3 maps them by name)."""
    import random

    from tokenizers import AddedToken, decoders
    from transformers import Emu3ImageProcessor, Emu3Processor

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    codes = list(range(num_codes))
    random.Random(num_codes).shuffle(codes)
    names = list(EMU3_SPECIAL_TOKENS) + [f"<|visual token {c:06d}|>" for c in codes]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in names])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|extra_203|>", eos_token="<|extra_204|>", pad_token="<|endoftext|>",
        padding_side="left", extra_special_tokens={"image_token": "<image>", "boi_token": "<|image start|>", "eoi_token": "<|image end|>",
                                                   "image_wrapper_token": "<|image token|>", "eof_token": "<|extra_201|>"},
    )
    return Emu3Processor(image_processor=Emu3ImageProcessor(image_mean=[0.5] * 3, image_std=[0.5] * 3), tokenizer=tokenizer)


def dummy_emu3_components(grid: Tuple[int, int] = (4, 4), num_codes: int = 16, *, hidden_size: int = 32,
                          num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                          intermediate_size: int = 64) -> Dict[str, Any]:
    """Random tiny Emu3 components (call under a fixed seed): a 2-layer trunk of width 32 (or the trunk the keyword
    arguments give) over a ~300-token vocabulary whose ``vocabulary_map`` names the visual tokens, a VQ model with
    ``num_codes`` codes that upsamples 2x, and the image grid, CFG default and unconditional prompt in the generation
    config."""
    from transformers import Emu3Config, Emu3ForConditionalGeneration

    from .pipelines.pipeline_emu3 import configure_generation

    processor = tiny_emu3_processor(num_codes)
    tokenizer = processor.tokenizer
    text = dict(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size,
                num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                max_position_embeddings=4096, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    vq = dict(codebook_size=num_codes, embed_dim=4, latent_channels=4, base_channels=32, channel_multiplier=[1, 1],
              num_res_blocks=1, attn_resolutions=[], hidden_size=32, num_attention_heads=1, temporal_downsample_factor=1)
    config = Emu3Config(text_config=text, vq_config=vq, vocabulary_map=tokenizer.get_vocab())
    config.text_config._attn_implementation = "sdpa"
    model = Emu3ForConditionalGeneration(config).eval()
    # weights at a tiny model's natural scale (not 0.02): outputs then depend on content and position
    for name, param in model.named_parameters():
        if param.dim() == 2 and not name.startswith("model.vqmodel"):
            torch.nn.init.normal_(param, std=1.0 / param.shape[-1] ** 0.5)
    torch.nn.init.normal_(model.model.text_model.embed_tokens.weight, std=1.0)
    torch.nn.init.normal_(model.lm_head.weight, std=0.5)
    gen = model.generation_config  # as the released checkpoint: sampling, EOS/pad; plus our grid and defaults
    gen.do_sample, gen.pad_token_id, gen.eos_token_id = True, tokenizer.pad_token_id, tokenizer.eos_token_id
    configure_generation(model, image_grid=grid, guidance_scale=3.0, negative_prompt="lowres, blurry")
    return {"transformer": model, "processor": processor}





#: The tiny Chameleon tokenizer's special tokens (Chameleon's names): BOS/pad/EOS/unk at ids 0..3 as in the released
#: vocabulary, then the image tokens, end/begin image, the end-of-turn token, Lumina-mGPT's end-of-row token and
#: resolution tokens ``<reserved08801>`` ... ``<reserved08864>``, and the ``<image>`` placeholder.
CHAMELEON_SPECIAL_TOKENS = ("<s>", "<pad>", "</s>", "<unk>")
CHAMELEON_STRUCTURE_TOKENS = ("<eoss>", "<racm3:break>", "<reserved08706>", "<reserved08799>",
                              *(f"<reserved{8800 + n:05d}>" for n in range(1, 65)), "<image>")


#: words the tiny Chameleon tokenizer merges into one token each (byte-level: "Ġ" is a leading space)
CHAMELEON_MERGED_WORDS = ("Generate", "Ġan", "Ġimage", "Ġof", "Ġaccording", "Ġto", "Ġthe", "Ġfollowing", "Ġprompt")


def chameleon_image_token(code: int) -> str:
    """Chameleon's name of image code ``code``: ``IMGIMG`` + its decimal digits written as letters A-J + ``Z``."""
    return "IMGIMG" + "".join(chr(ord("A") + int(d)) for d in str(code)) + "Z"


def tiny_chameleon_tokenizer(num_codes: int = 16):
    """A byte-level tokenizer (one token per byte but for the words of Lumina-mGPT's template) with Chameleon's special
    tokens, ``num_codes`` image tokens ``IMGIMG...Z`` and the end-of-turn token as ``sep_token``, BOS prepended as
    Chameleon's tokenizer does; built in memory. The image tokens get ids 4..4+V-1 in a shuffled code order, so code -> id is not an offset (Chameleon maps
    them by name)."""
    import random

    from tokenizers import AddedToken, decoders

    codes = list(range(num_codes))
    random.Random(num_codes).shuffle(codes)
    names = [*CHAMELEON_SPECIAL_TOKENS, *(chameleon_image_token(c) for c in codes), *CHAMELEON_STRUCTURE_TOKENS]
    vocab = {t: i for i, t in enumerate(names)}
    for c in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[c] = len(vocab)
    merges = []  # Lumina-mGPT's prompt-template words as single tokens (a real BPE's length), by prefix chains
    for word in CHAMELEON_MERGED_WORDS:
        for i in range(2, len(word) + 1):
            if word[:i] not in vocab:
                vocab[word[:i]] = len(vocab)
                merges.append((word[: i - 1], word[i - 1]))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in names])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
                                   sep_token="<reserved08706>", padding_side="left",
                                   extra_special_tokens={"image_token": "<image>"})


def dummy_chameleon_components(grid: Tuple[int, int] = (4, 4), num_codes: int = 16, lumina: bool = False, *,
                               hidden_size: int = 32, num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                               intermediate_size: int = 64) -> Dict[str, Any]:
    """Random tiny Chameleon-architecture components (call under a fixed seed): a 2-layer trunk of width 32 (qk-norm,
    GQA; or the trunk the keyword arguments give) whose ``vocabulary_map`` names ``num_codes`` image tokens, a tiny
    `ChameleonVQModel` (2 px per code) and the image grid and CFG default in the generation config. Anole gets a `ChameleonProcessor`; Lumina-mGPT (``lumina``)
    the bare tokenizer its repos ship and one resolution step per code (``resolution_patch_size`` 2 px)."""
    from transformers import ChameleonConfig, ChameleonForConditionalGeneration, ChameleonProcessor
    from transformers.models.chameleon.image_processing_pil_chameleon import ChameleonImageProcessorPil

    from .models import tiny_chameleon_vq
    from .pipelines.transformers_utils import configure_generation

    tokenizer = tiny_chameleon_tokenizer(num_codes)
    vq = dict(embed_dim=4, num_embeddings=num_codes, latent_channels=4, base_channels=32, channel_multiplier=[1],
              num_res_blocks=1, resolution=8, attn_resolutions=[])
    config = ChameleonConfig(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size,
                             num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                             max_position_embeddings=4096,
                             bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id, vocabulary_map=tokenizer.get_vocab(), vq_config=vq)
    config._attn_implementation = "sdpa"
    model = ChameleonForConditionalGeneration(config).eval()
    # weights at a tiny model's natural scale (not 0.02): outputs then depend on content and position (qk-norm kept)
    for name, param in model.named_parameters():
        if param.dim() == 2 and "norm" not in name and not name.startswith("model.vqmodel"):
            torch.nn.init.normal_(param, std=1.0 / param.shape[-1] ** 0.5)
    torch.nn.init.normal_(model.model.embed_tokens.weight, std=0.5)  # 1.0 lets the last code dominate: constant grids
    torch.nn.init.normal_(model.lm_head.weight, std=0.5)
    vqgan = tiny_chameleon_vq(num_codes, seed=int(torch.randint(0, 2**31 - 1, ()).item()))
    extra = {"resolution_patch_size": vqgan.downsample_factor} if lumina else {}
    configure_generation(model, image_grid=grid, guidance_scale=3.0, **extra)
    processor = tokenizer if lumina else ChameleonProcessor(image_processor=ChameleonImageProcessorPil(), tokenizer=tokenizer,
                                                            image_seq_length=grid[0] * grid[1])
    return {"transformer": model, "processor": processor, "vqgan": vqgan}






def random_draft_heads(pipe: SpatialARPipeline, decoder: SpatialDecoderMixin) -> DraftHeadsMixin:
    """Randomly initialised heads of the kind ``decoder`` needs (the first of its ``heads_needed().kinds``), sized for
    ``pipe``'s backbone."""
    need = decoder.heads_needed()
    if need is None:
        raise ValueError(f"`draft_heads='random'`: {type(decoder).__name__} uses no draft heads.")
    return heads_class_for(need.kinds[0]).for_backbone(pipe.backbone, decoder)
