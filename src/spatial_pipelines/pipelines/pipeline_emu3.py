"""The Emu3 family: transformers' `Emu3ForConditionalGeneration` (text trunk + VQ model in one component) and its
`Emu3Processor`, loaded from our saved folders or from the plain transformers repo (``BAAI/Emu3-Gen-hf``).

Emu3 facts the adapter relies on (transformers 5.x):

* image codes are ordinary BPE tokens ``<|visual token NNNNNN|>`` of the 184k text vocabulary; codes and ids are
  mapped by name through ``vocabulary_mapping`` (``img2bpe``), never by an offset;
* the image follows ``BOS text <|image start|> "{h}*{w}" <|image token|>``: ``h`` rows of ``w`` codes, each row
  followed by the end-of-row token ``<|extra_200|>`` (the loop forces it; its output predicts the next row's first
  code); after the last row Emu3 writes EOL, EOF, EOI and EOS, which carry no code and are never generated here;
* Emu3's own generation restricts the head to the visual tokens (``prefix_allowed_tokens_fn``) and mixes CFG
  in log-softmax space with a negative prompt; restricted to the visual columns that equals the raw-logit mix used
  here (the two differ by a per-row constant).
"""

import os
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from transformers import Emu3ForConditionalGeneration, Emu3Processor

from ..core.layout import ImageTokenLayout
from ..decoders.decoding_utils import SpatialDecoderMixin
from ..heads.heads_utils import DraftHeadsMixin
from .backbone import PromptEmbeddings
from .checkpoint_checks import load_checked_model, read_backbone_config
from .pass_cost import GPU_DRAFT_SIZES
from .pipeline_utils import SpatialARPipeline
from .transformers_utils import CodeIndex, TransformersBackbone, TransformersPipelineMixin, left_padded, natural_scale_init
from .transformers_utils import configure_generation as configure_shared

#: Emu3's published sampling settings (its image-generation example: CFG 3.0 with this negative prompt; top-k 2048
#: is in the released checkpoint's generation config).
EMU3_GUIDANCE_SCALE = 3.0
EMU3_NEGATIVE_PROMPT = (
    "lowres, bad anatomy, bad hands, text, error, missing fingers, extra digit, fewer digits, cropped, worst quality, "
    "low quality, normal quality, jpeg artifacts, signature, watermark, username, blurry."
)
#: Emu3's default image: 720x720 pixels (the processor's ``image_area`` 518400 at ratio 1:1), 8 pixels per code.
EMU3_IMAGE_GRID = (90, 90)
#: special tokens of Emu3's tokenizer (``tokenizer.boi_token`` ... when the tokenizer names them).
EMU3_SPECIAL_TOKENS = {"boi_token": "<|image start|>", "image_wrapper_token": "<|image token|>"}
#: where the image grid and the default unconditional prompt are kept: the transformer's generation config, so they
#: travel with the component (``Emu3Pipeline(**pipe.components)``, save/load, ``from_pipe``).
NEGATIVE_PROMPT_KEY = "default_negative_prompt"


class Emu3Backbone(TransformersBackbone):
    """Adapter over `Emu3ForConditionalGeneration` (its text trunk, head and VQ model) and `Emu3Processor`."""

    family = "emu3"

    family_name = "Emu3"
    processor_kind = "Emu3Processor"
    default_image_grid = EMU3_IMAGE_GRID
    family_guidance_scale = EMU3_GUIDANCE_SCALE
    row_end_positions = 1  # the end-of-row token after every row

    @property
    def text_model(self) -> torch.nn.Module:
        return self.transformer.model.text_model

    # -- facts -------------------------------------------------------------------------------------------------
    @property
    def layout(self) -> ImageTokenLayout:
        h, w = self.image_grid
        return ImageTokenLayout(h, w, eol_token_id=self._index().eol_id)

    @property
    def vae_scale_factor(self) -> int:
        return self.vqmodel.spatial_scale_factor

    @property
    def codebook(self) -> torch.Tensor:
        self._onload()
        return self.vqmodel.quantize.embedding.weight  # (V, embed_dim): what `vqmodel.decode` looks codes up in

    @property
    def default_negative_prompt(self) -> str:
        saved = getattr(self.generation_config, NEGATIVE_PROMPT_KEY, None)
        return saved if saved is not None else EMU3_NEGATIVE_PROMPT

    def _index(self) -> CodeIndex:
        return self.cached_code_index(self.transformer.vocabulary_mapping, self._build_index)

    def _build_index(self, device: torch.device) -> CodeIndex:
        mapping = self.transformer.vocabulary_mapping
        if mapping.eol_token_id is None:
            raise ValueError("The Emu3 `vocabulary_map` has no end-of-row token `<|extra_200|>`.")
        index = CodeIndex.from_img2bpe(mapping.img2bpe, device, "`<|visual token 000000|>` ...", int(mapping.eol_token_id))
        codebook_size = self.transformer.config.vq_config.codebook_size
        if index.ids.shape[0] != codebook_size:
            raise ValueError(f"The Emu3 vocabulary has {index.ids.shape[0]} visual tokens but the VQ codebook has "
                             f"{codebook_size} codes.")
        return index

    def _token(self, name: str) -> str:
        tokenizer = self.tokenizer
        token = getattr(tokenizer, name, None) or EMU3_SPECIAL_TOKENS[name]
        if tokenizer.convert_tokens_to_ids(token) in (None, tokenizer.unk_token_id):
            raise ValueError(f"The tokenizer has no {token!r} token ({name}); it is not an Emu3 tokenizer.")
        return token

    # -- prompts -----------------------------------------------------------------------------------------------
    def image_prompt(self, text: str) -> str:
        """The text Emu3 reads before the image (its processor's ``return_for_image_generation`` format):
        ``BOS text <|image start|>{h}*{w}<|image token|>``."""
        h, w = self.image_grid
        bos = self.tokenizer.bos_token or ""
        return f"{bos}{text}{self._token('boi_token')}{h}*{w}{self._token('image_wrapper_token')}"

    def prompt_ids(self, texts: List[str], device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
        """Token ids ``(R, P)`` of the image prompts, left-padded, and which are real ``(R, P)``."""
        tokenizer = self.tokenizer
        # images per prompt repeat texts: each is tokenized once
        encoded = {t: tokenizer(self.image_prompt(t), add_special_tokens=False).input_ids for t in dict.fromkeys(texts)}
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        ids, valid = left_padded([encoded[t] for t in texts], pad)  # (R, P)
        return ids.to(device), valid.to(device)

    def encode_prompt(self, prompts, negative_prompts, do_cfg, device) -> PromptEmbeddings:
        self._onload()
        self.check_tree_attention(self.transformer.config.text_config._attn_implementation)
        texts = list(prompts)
        if do_cfg:
            texts += list(negative_prompts) if negative_prompts is not None else [self.default_negative_prompt] * len(prompts)
        ids, valid = self.prompt_ids(texts, device)
        return PromptEmbeddings(self.text_model.embed_tokens(ids), valid)

    # -- the trunk ---------------------------------------------------------------------------------------------
    @property
    def eol_embedding(self) -> torch.Tensor:
        self._onload()
        return self.text_model.embed_tokens.weight[self._index().eol_id]

    # -- pixels ------------------------------------------------------------------------------------------------
    def decode_image(self, tokens: torch.Tensor) -> torch.Tensor:
        """``vqmodel.decode((B, h, w))`` -> the VQ model's normalised pixels -> [-1, 1] through the image processor's
        mean and std (what `Emu3ImageProcessor.postprocess` undoes)."""
        self._onload()
        pixels = self.vqmodel.decode(tokens.to(self.vqmodel.quantize.embedding.weight.device)).float()  # (B, 3, h, w)
        processor = getattr(self.pipe.processor, "image_processor", None)
        mean, std = getattr(processor, "image_mean", None), getattr(processor, "image_std", None)
        if mean is not None and std is not None:
            mean, std = (torch.as_tensor(v, dtype=pixels.dtype, device=pixels.device).reshape(1, -1, 1, 1)
                         for v in (mean, std))
            pixels = (pixels * std + mean) * 2 - 1
        return pixels.clamp(-1, 1)


class Emu3Pipeline(TransformersPipelineMixin, SpatialARPipeline):
    r"""Emu3 text-to-image generation with a swappable speculative decoder.

    Args:
        transformer (`Emu3ForConditionalGeneration`): the AR model (text trunk, head over the text vocabulary and VQ
            model). Its ``generation_config`` holds the sampling defaults (``guidance_scale``, ``top_k``), the image grid
            (``image_grid``, codes; default 90x90 = 720 pixels) and the default unconditional prompt
            (``default_negative_prompt``; default Emu3's published negative prompt).
        processor (`Emu3Processor`): its tokenizer encodes the prompts; its image processor's mean and std map the
            VQ model's output to pixels.
        decoder (`SpatialDecoderMixin`): the decoding algorithm (`AutoregressiveDecoder` or a speculative one).
        draft_heads (`DraftHeadsMixin`, *optional*): draft heads for the decoders that need them.
    """

    backbone_class = Emu3Backbone
    default_draft_sizes = GPU_DRAFT_SIZES  # a 1-8B model on a GPU: drafts as large as acceptance pays for

    @classmethod
    def dummy_components(cls, grid=(4, 4), num_codes: int = 16) -> Dict[str, Any]:
        """Tiny random ``__init__`` components but decoder and heads (`testing.dummy_pipeline`; under a seed)."""
        return dummy_emu3_components(grid, num_codes)

    def __init__(self, transformer: Emu3ForConditionalGeneration, processor: Emu3Processor,
                 decoder: SpatialDecoderMixin, draft_heads: Optional[DraftHeadsMixin] = None):
        super().__init__()
        if not isinstance(transformer, Emu3ForConditionalGeneration):
            raise ValueError(f"`transformer` must be an Emu3ForConditionalGeneration (text model + VQ model), got {type(transformer).__name__}.")
        self._register_transformer(transformer.model.text_model, None, draft_heads, transformer=transformer,
                                   processor=processor, decoder=decoder)

    @classmethod
    def load_backbone_components(cls, repo_or_path: Union[str, os.PathLike],
                                 image_grid: Optional[Tuple[int, int]] = None,
                                 default_guidance_scale: Optional[float] = None, default_top_k: Optional[int] = None,
                                 default_negative_prompt: Optional[str] = None,
                                 torch_dtype: Optional[torch.dtype] = None, dtype: Optional[torch.dtype] = None,
                                 attn_implementation: str = "sdpa", device_map: Union[None, str, Dict[str, Any]] = None,
                                 **kwargs) -> Dict[str, Any]:
        """Read a transformers Emu3 repo (``config.json`` + safetensors + tokenizer/processor files; a folder or a Hub
        repo id such as ``BAAI/Emu3-Gen-hf``, through the Hub cache, ``HF_HUB_OFFLINE`` honoured).

        Args:
            image_grid (`tuple[int, int]`, *optional*): codes per column and row (default 90x90: 720 pixels). Any
                positive sizes, odd or not square: the prompt states ``{h}*{w}``, an end-of-row token follows each row,
                and the image is ``8h x 8w`` pixels.
            default_guidance_scale, default_top_k, default_negative_prompt (*optional*): written into the model's
                generation config (defaults: Emu3's 3.0, the checkpoint's ``top_k``, Emu3's negative prompt).
            torch_dtype / dtype: weights' dtype (e.g. ``torch.bfloat16``).
            attn_implementation (`str`): ``"sdpa"`` or ``"eager"`` (draft trees need an arbitrary attention mask).
            device_map (`str` or `dict`, *optional*): transformers' ``device_map`` for the model (not several GPUs).
            kwargs: to transformers' ``from_pretrained`` (``revision``, ``cache_dir``, ``token``, ``local_files_only``).
        """
        weights_dtype, kwargs, config = read_backbone_config(repo_or_path, kwargs, "emu3", "an Emu3 checkpoint",
                                                             attn_implementation, torch_dtype, dtype, hub_only=True)
        transformer = load_checked_model(cls.backbone_class, Emu3ForConditionalGeneration, repo_or_path, config, kwargs,
                                         attn_implementation, weights_dtype, device_map, image_grid)
        processor = Emu3Processor.from_pretrained(repo_or_path, **kwargs)
        configure_generation(transformer, image_grid=image_grid, guidance_scale=default_guidance_scale,
                             top_k=default_top_k, negative_prompt=default_negative_prompt)
        return {"transformer": transformer, "processor": processor}


def configure_generation(transformer: Emu3ForConditionalGeneration, image_grid: Optional[Tuple[int, int]] = None,
                         guidance_scale: Optional[float] = None, top_k: Optional[int] = None,
                         negative_prompt: Optional[str] = None) -> None:
    """`transformers_utils.configure_generation` plus Emu3's default unconditional prompt (``None`` leaves a value)."""
    if negative_prompt is not None and not isinstance(negative_prompt, str):
        raise ValueError(f"`default_negative_prompt` must be a string, got {negative_prompt!r}.")
    configure_shared(transformer, image_grid=image_grid, guidance_scale=guidance_scale, top_k=top_k,
                     **{NEGATIVE_PROMPT_KEY: negative_prompt})


# -- tiny random components, for tests (`dummy_components`, `spatial_pipelines.testing.dummy_pipeline`) --------------
#: The tiny Emu3 tokenizer's special tokens: Emu3's names (BOS ``<|extra_203|>``, EOS ``<|extra_204|>``, pad, image
#: start/end/wrapper, EOL ``<|extra_200|>``, EOF ``<|extra_201|>``, the ``<image>`` placeholder).
TINY_EMU3_TOKENS = ("<|endoftext|>", "<|extra_203|>", "<|extra_204|>", "<image>", "<|image start|>", "<|image end|>",
                    "<|image token|>", "<|extra_200|>", "<|extra_201|>")


def tiny_emu3_processor(num_codes: int = 16):
    """An `Emu3Processor` over a byte-level tokenizer (no merges: one token per byte, like Emu3's BPE without its
    merges) holding Emu3's special tokens and ``num_codes`` visual tokens ``<|visual token NNNNNN|>``, built in memory.
    The visual tokens get ids in a shuffled order, so code -> id is not an offset (Emu3 maps them by name)."""
    import random

    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import Emu3ImageProcessor, PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    codes = list(range(num_codes))
    random.Random(num_codes).shuffle(codes)
    names = list(TINY_EMU3_TOKENS) + [f"<|visual token {c:06d}|>" for c in codes]
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
    from transformers import Emu3Config

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
    natural_scale_init(model, ("model.vqmodel",), (model.model.text_model.embed_tokens.weight, 1.0),
                       (model.lm_head.weight, 0.5))
    gen = model.generation_config  # as the released checkpoint: sampling, EOS/pad; plus our grid and defaults
    gen.do_sample, gen.pad_token_id, gen.eos_token_id = True, tokenizer.pad_token_id, tokenizer.eos_token_id
    configure_generation(model, image_grid=grid, guidance_scale=3.0, negative_prompt="lowres, blurry")
    return {"transformer": model, "processor": processor}
