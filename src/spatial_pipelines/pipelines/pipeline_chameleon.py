"""The Chameleon family: transformers' `ChameleonForConditionalGeneration` (the Anole and Lumina-mGPT checkpoints) with
our `ChameleonVQModel` as the VQGAN decoder transformers lacks; the shared adapter and `AnolePipeline`.

Chameleon facts the adapter relies on (transformers 5.x):

* image codes are ordinary tokens ``IMGIMG<digits as letters A-J>Z`` of the 65,536-token vocabulary (ids 4..8195
  released), mapped by name through the model's ``vocabulary_mapping`` (``img2bpe``), never by an offset;
* ``ChameleonForConditionalGeneration.forward`` sets every image-token logit to ``finfo.min`` (a text model in
  transformers): the adapter runs the trunk (``model.model``) and applies ``lm_head`` restricted to the image rows;
* an image is ``<racm3:break>`` (begin image, 8197) + the codes + ``<eoss>`` (end image, 8196, never generated here);
* Anole / Chameleon prompt (Chameleon's ``TokenManager.tokens_from_ui`` with a text turn, as Anole's ``text2image.py``
  calls it): ``BOS text <reserved08706> <racm3:break>``, then 32x32 codes (512 px, no end-of-row token);
* CFG: Chameleon mixes three rows (full prompt, image-only prompt, unconditional ``BOS <racm3:break>``) as
  ``u + s_img (i - u) + s_txt (f - i)`` on raw logits; for a text-only prompt the image-only row IS the unconditional
  one, so this is plain CFG with ``s_txt`` (3.0) against ``BOS <racm3:break>``, as LANTERN (``ea_model_anole.py``) and
  ADT-Tree run Anole. A ``negative_prompt`` replaces that row with the negative text in the prompt format.
"""

import os
import re
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from transformers import ChameleonForConditionalGeneration

from ..core.layout import ImageTokenLayout
from ..decoders.decoding_utils import SpatialDecoderMixin
from ..heads.heads_utils import DraftHeadsMixin
from ..models.vq_chameleon import ChameleonVQModel, load_chameleon_vq, tiny_chameleon_vq
from .backbone import PromptEmbeddings
from .checkpoint_checks import load_checked_model, read_backbone_config
from .pass_cost import GPU_DRAFT_SIZES
from .pipeline_utils import SpatialARPipeline
from .transformers_utils import (GRID_KEY, CodeIndex, TransformersBackbone, TransformersPipelineMixin, configure_generation,
                                 left_padded, natural_scale_init, onload)

#: Chameleon's structural tokens (names in the model's ``vocabulary_map``).
BEGIN_IMAGE_TOKEN = "<racm3:break>"
END_OF_TURN_TOKEN = "<reserved08706>"
#: Anole's published setting: 32x32 codes (512 px), text CFG 3.0 (Chameleon's ``guidance_scale_text``; the scale
#: the LANTERN and ADT-Tree papers use on Anole).
ANOLE_IMAGE_GRID = (32, 32)
ANOLE_GUIDANCE_SCALE = 3.0
#: The Chameleon VQGAN in transformers format (the decoder transformers lacks), as converted with the Anole port.
ANOLE_VQ_REPO = "leloy/Anole-7b-v0.1-vqvae-hf"


class ChameleonBackbone(TransformersBackbone):
    """Adapter over `ChameleonForConditionalGeneration` (trunk, head over the whole vocabulary), its tokenizer (or
    `ChameleonProcessor`) and a `ChameleonVQModel`. Subclasses fix the family's prompt and image layout."""

    family = "chameleon"

    default_image_grid: Tuple[int, int] = ANOLE_IMAGE_GRID
    family_guidance_scale: float = ANOLE_GUIDANCE_SCALE
    #: whether the default unconditional row starts with BOS (Chameleon: ``BOS <racm3:break>``)
    unconditional_has_bos: bool = True
    family_name = "Chameleon"
    processor_kind = "a ChameleonProcessor or the checkpoint's tokenizer"

    # -- modules ----------------------------------------------------------------------------------------------
    @property
    def text_model(self) -> torch.nn.Module:
        """The decoder stack (`ChameleonModel`: ``embed_tokens``, ``layers``, final ``norm``)."""
        return self.transformer.model

    @property
    def vqgan(self) -> ChameleonVQModel:
        return self.pipe.vqgan

    # -- facts ------------------------------------------------------------------------------------------------
    @property
    def layout(self) -> ImageTokenLayout:
        h, w = self.image_grid
        return ImageTokenLayout(h, w)

    @property
    def vae_scale_factor(self) -> int:
        return self.vqgan.downsample_factor

    @property
    def codebook(self) -> torch.Tensor:
        """``(V, embed_dim)``: what `decode_code` looks codes up in (not normalised), on the trunk's device (with model
        CPU offload the VQGAN sits on the CPU while the loop runs)."""
        return self.vqgan.codebook.to(self.text_model.embed_tokens.weight.device)

    def _index(self) -> CodeIndex:
        return self.cached_code_index(self.transformer.model.vocabulary_mapping, self._build_index)

    def _build_index(self, device: torch.device) -> CodeIndex:
        mapping = self.transformer.model.vocabulary_mapping
        index = CodeIndex.from_img2bpe(mapping.img2bpe, device, f"{self.family_name}'s `IMGIMG...Z`")
        codebook_size = self.vqgan.config.codebook_size
        if index.ids.shape[0] != codebook_size:
            raise ValueError(f"The {self.family_name} vocabulary has {index.ids.shape[0]} image tokens but the VQ "
                             f"codebook (`vqgan`) has {codebook_size} codes.")
        return index

    def token_id(self, name: str) -> int:
        """Id of a structural token, from the model's own ``vocabulary_map`` (the tokenizer's when the map lacks it)."""
        vocab = self.transformer.config.vocabulary_map or {}
        value = vocab.get(name)
        if value is None and self.tokenizer is not None:
            value = self.tokenizer.convert_tokens_to_ids(name)
            if value == getattr(self.tokenizer, "unk_token_id", None):
                value = None
        if value is None:
            raise ValueError(f"The {self.family_name} vocabulary has no {name!r} token; it is not a {self.family_name} "
                             "checkpoint.")
        return int(value)

    @property
    def bos_token_id(self) -> int:
        value = getattr(self.tokenizer, "bos_token_id", None)
        if value is None:
            value = self.transformer.config.bos_token_id
        if value is None:
            raise ValueError(f"This {self.family_name} checkpoint names no BOS token (tokenizer or config).")
        return int(value)

    # -- prompts ----------------------------------------------------------------------------------------------
    def prompt_text(self, text: str) -> str:
        """The text the model reads for an image prompt (Anole: the prompt itself)."""
        return text

    def image_start_ids(self) -> List[int]:
        """What precedes the first code: ``<racm3:break>`` (Lumina-mGPT adds its resolution tokens)."""
        return [self.token_id(BEGIN_IMAGE_TOKEN)]

    def condition_ids(self, text: str) -> List[int]:
        """``BOS text <reserved08706> <racm3:break> ...``: a user turn closed by Chameleon's end-of-turn token, then the
        image start."""
        body = self.tokenizer(self.prompt_text(text), add_special_tokens=False).input_ids
        return [self.bos_token_id, *body, self.token_id(END_OF_TURN_TOKEN), *self.image_start_ids()]

    def unconditional_ids(self) -> List[int]:
        """The default unconditional row of CFG (Anole: ``BOS <racm3:break>``)."""
        return ([self.bos_token_id] if self.unconditional_has_bos else []) + self.image_start_ids()

    def prompt_ids(self, prompts: List[str], negative_prompts: Optional[List[str]], do_cfg: bool,
                   device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
        """Token ids ``(R, P)`` of the prefix rows (conditional, then with CFG the unconditional ones), left-padded to
        one length, and which are real ``(R, P)``. Each distinct text is tokenized once."""
        texts = list(prompts) + (list(negative_prompts) if do_cfg and negative_prompts is not None else [])
        encoded = {t: self.condition_ids(t) for t in dict.fromkeys(texts)}
        rows = [encoded[t] for t in prompts]
        if do_cfg:
            if negative_prompts is not None:
                rows += [encoded[t] for t in negative_prompts]
            else:
                rows += [self.unconditional_ids()] * len(prompts)
        pad = getattr(self.tokenizer, "pad_token_id", None)
        ids, valid = left_padded(rows, pad if pad is not None else (self.transformer.config.pad_token_id or 0))
        return ids.to(device), valid.to(device)

    def encode_prompt(self, prompts, negative_prompts, do_cfg, device) -> PromptEmbeddings:
        self._onload()
        self.check_tree_attention(self.transformer.config._attn_implementation)
        ids, valid = self.prompt_ids(prompts, negative_prompts, do_cfg, device)
        return PromptEmbeddings(self.text_model.embed_tokens(ids), valid)

    # -- pixels -----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def decode_image(self, tokens: torch.Tensor) -> torch.Tensor:
        """Code grids ``(B, H, W)`` -> ``vqgan.decode_code`` -> images in [-1, 1] (Chameleon's VQGAN works in that range)."""
        onload(self.vqgan, self.vqgan.codebook)
        return self.vqgan.decode_code(tokens.to(self.vqgan.codebook.device))

    @torch.no_grad()
    def encode_image(self, pixels: torch.Tensor) -> torch.Tensor:
        onload(self.vqgan, self.vqgan.codebook)
        weight = self.vqgan.codebook
        return self.vqgan.encode(pixels.to(weight.device, weight.dtype)).indices.flatten(1)  # (B, H*W)


class AnoleBackbone(ChameleonBackbone):
    """Anole: 32x32 codes wrapped in ``<racm3:break>`` ... ``<eoss>``, no end-of-row token; prompt ``BOS text
    <reserved08706> <racm3:break>``; CFG 3 against ``BOS <racm3:break>``."""

    family = "anole"

    family_name = "Anole"


class ChameleonARPipeline(TransformersPipelineMixin, SpatialARPipeline):
    r"""Base of the Chameleon-architecture pipelines (Anole, Lumina-mGPT): components, checks and loading.

    Args:
        transformer (`ChameleonForConditionalGeneration`): the AR model. Its ``generation_config`` holds the sampling
            defaults (``guidance_scale``, ``top_k``) and the image grid (``image_grid``, codes); they travel with it.
        processor (`ChameleonProcessor` or the checkpoint's tokenizer): tokenizes the prompts.
        vqgan (`ChameleonVQModel`): Chameleon's VQGAN, whose decoder turns codes into pixels (transformers has none).
        decoder (`SpatialDecoderMixin`): the decoding algorithm (`AutoregressiveDecoder` or a speculative one).
        draft_heads (`DraftHeadsMixin`, *optional*): draft heads for the decoders that need them.
    """

    backbone_class = ChameleonBackbone
    default_draft_sizes = GPU_DRAFT_SIZES  # a 1-8B model on a GPU: drafts as large as acceptance pays for
    model_cpu_offload_seq = "transformer->vqgan"
    #: the VQ checkpoint `from_backbone` reads when ``vq`` is not given (Chameleon's VQGAN, shared by Anole and
    #: Lumina-mGPT)
    default_vq_repo: Optional[str] = ANOLE_VQ_REPO

    def __init__(self, transformer: ChameleonForConditionalGeneration, processor: Any, vqgan: ChameleonVQModel,
                 decoder: SpatialDecoderMixin, draft_heads: Optional[DraftHeadsMixin] = None):
        super().__init__()
        if not isinstance(transformer, ChameleonForConditionalGeneration):
            raise ValueError(f"`transformer` must be a ChameleonForConditionalGeneration, got {type(transformer).__name__}.")
        if not isinstance(vqgan, ChameleonVQModel):
            raise ValueError(f"`vqgan` must be a ChameleonVQModel (Chameleon's VQGAN decoder), got {type(vqgan).__name__}; "
                             "convert the released weights with `load_chameleon_vq` or scripts/convert_chameleon_vqgan.py.")
        self._register_transformer(transformer.model, "Chameleon", draft_heads, transformer=transformer.eval(),
                                   processor=processor, vqgan=vqgan.eval(), decoder=decoder)

    @classmethod
    def default_image_grid_for(cls, repo_or_path, vae_scale_factor: int) -> Tuple[int, int]:
        """The grid of a checkpoint that does not record one."""
        return tuple(cls.backbone_class.default_image_grid)

    @classmethod
    def load_backbone_components(cls, repo_or_path: Union[str, os.PathLike],
                                 vq: Union[None, str, os.PathLike, ChameleonVQModel] = None, processor: Any = None,
                                 image_grid: Optional[Tuple[int, int]] = None,
                                 default_guidance_scale: Optional[float] = None, default_top_k: Optional[int] = None,
                                 torch_dtype: Optional[torch.dtype] = None, dtype: Optional[torch.dtype] = None,
                                 attn_implementation: str = "sdpa", device_map: Union[None, str, Dict[str, Any]] = None,
                                 **hub_kwargs) -> Dict[str, Any]:
        """Read a transformers Chameleon checkpoint (``config.json`` with model_type ``chameleon`` + safetensors +
        tokenizer files; a folder or a Hub repo id, through the Hub cache, ``HF_HUB_OFFLINE`` honoured) and
        Chameleon's VQGAN.

        Args:
            vq: the VQGAN: a `ChameleonVQModel`, a folder saved by it (``scripts/convert_chameleon_vqgan.py``), a
                transformers-format VQ folder or Hub repo (``config.json`` model_type ``chameleon_vqgan`` + safetensors),
                or Meta's ``vqgan.ckpt`` (with ``vqgan.yaml`` beside it) or the folder holding them; default
                ``default_vq_repo``.
            processor (*optional*): use this `ChameleonProcessor` or tokenizer instead of the checkpoint's.
            image_grid (`tuple[int, int]`, *optional*): codes per column and row (default: the family's).
            default_guidance_scale, default_top_k (*optional*): written into the model's generation config (defaults:
                the family's).
            torch_dtype / dtype: weights' dtype (e.g. ``torch.bfloat16``), for the model and the VQGAN.
            attn_implementation (`str`): ``"sdpa"`` or ``"eager"`` (draft trees need an arbitrary attention mask).
            device_map (`str` or `dict`, *optional*): transformers' ``device_map`` for the model (not several GPUs; the
                VQGAN is loaded whole).
            hub_kwargs: ``revision``, ``cache_dir``, ``token``, ``local_files_only``, ... for every download.
        """
        from transformers import AutoTokenizer, ChameleonProcessor

        weights_dtype, hub_kwargs, config = read_backbone_config(
            repo_or_path, hub_kwargs, "chameleon", "a Chameleon-architecture checkpoint", attn_implementation,
            torch_dtype, dtype)
        if processor is None:
            try:
                processor = ChameleonProcessor.from_pretrained(repo_or_path, **hub_kwargs)
            except (OSError, ValueError, TypeError, KeyError):  # a repo with tokenizer files only (Lumina-mGPT)
                processor = AutoTokenizer.from_pretrained(repo_or_path, **hub_kwargs)
        if not config.vocabulary_map:  # the image-token names are the tokenizer's
            config.vocabulary_map = dict(getattr(processor, "tokenizer", processor).get_vocab())
        model = load_checked_model(cls.backbone_class, ChameleonForConditionalGeneration, repo_or_path, config,
                                   hub_kwargs, attn_implementation, weights_dtype, device_map, image_grid, True)
        vqgan = load_vq(vq if vq is not None else cls.default_vq_repo, torch_dtype=weights_dtype, **hub_kwargs)
        if image_grid is None and getattr(model.generation_config, GRID_KEY, None) is None:
            image_grid = cls.default_image_grid_for(repo_or_path, vqgan.downsample_factor)
        configure_generation(model, image_grid=image_grid, guidance_scale=default_guidance_scale, top_k=default_top_k)
        return {"transformer": model, "processor": processor, "vqgan": vqgan}


class AnolePipeline(ChameleonARPipeline):
    r"""Anole (Chameleon architecture) text-to-image generation with a swappable speculative decoder.

    Components as `ChameleonARPipeline`. Defaults: a 32x32 grid (512 px), CFG 3.0 against ``BOS <racm3:break>``, no
    top-k. Load ``leloy/Anole-7b-v0.1-hf`` with `from_backbone` (its VQGAN from ``leloy/Anole-7b-v0.1-vqvae-hf`` by
    default, or ``vq=`` Meta's ``vqgan.ckpt`` / a converted folder); saved pipelines with ``from_pretrained``.
    """

    backbone_class = AnoleBackbone

    @classmethod
    def dummy_components(cls, grid=(4, 4), num_codes: int = 16) -> Dict[str, Any]:
        """Tiny random ``__init__`` components but decoder and heads (`testing.dummy_pipeline`; under a seed)."""
        return dummy_chameleon_components(grid, num_codes)


def load_vq(vq: Union[str, os.PathLike, ChameleonVQModel], torch_dtype: Optional[torch.dtype] = None,
            **hub_kwargs) -> ChameleonVQModel:
    """A `ChameleonVQModel` from a model, a local path in any layout `load_chameleon_vq` reads, or a Hub repo id (its
    snapshot downloaded, or read from the Hub cache when offline)."""
    if isinstance(vq, ChameleonVQModel):
        return vq.to(torch_dtype) if torch_dtype is not None else vq
    if not isinstance(vq, (str, os.PathLike)):
        raise ValueError(f"`vq` must be a ChameleonVQModel, a path or a Hub repo id, got {type(vq).__name__}.")
    path = os.fspath(vq)
    if not os.path.exists(path):
        if not re.fullmatch(r"[\w.-]+/[\w.-]+", path):
            raise ValueError(f"`vq` {path!r} is neither an existing path nor a Hub repo id.")
        from huggingface_hub import snapshot_download

        keys = ("revision", "cache_dir", "token", "local_files_only")
        path = snapshot_download(path, allow_patterns=["*.json", "*.safetensors", "*.ckpt", "*.yaml"],
                                 **{k: v for k, v in hub_kwargs.items() if k in keys and v is not None})
    return load_chameleon_vq(path, torch_dtype=torch_dtype).eval()


# -- tiny random components, for tests (`dummy_components`, `spatial_pipelines.testing.dummy_pipeline`) --------------
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

    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

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
    from transformers import ChameleonConfig, ChameleonProcessor
    from transformers.models.chameleon.image_processing_pil_chameleon import ChameleonImageProcessorPil

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
    # qk-norm kept; embeddings at 0.5 (1.0 lets the last code dominate: constant grids)
    natural_scale_init(model, ("norm", "model.vqmodel"), (model.model.embed_tokens.weight, 0.5),
                       (model.lm_head.weight, 0.5))
    vqgan = tiny_chameleon_vq(num_codes, seed=int(torch.randint(0, 2**31 - 1, ()).item()))
    extra = {"resolution_patch_size": vqgan.downsample_factor} if lumina else {}
    configure_generation(model, image_grid=grid, guidance_scale=3.0, **extra)
    processor = tokenizer if lumina else ChameleonProcessor(image_processor=ChameleonImageProcessorPil(), tokenizer=tokenizer,
                                                            image_seq_length=grid[0] * grid[1])
    return {"transformer": model, "processor": processor, "vqgan": vqgan}
