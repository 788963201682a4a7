"""The Janus-Pro family: transformers' `JanusForConditionalGeneration` (Llama trunk, separate image-generation head,
embeddings and VQ decoder) with its `JanusProcessor`, and loading from the plain transformers checkpoint layout.

What image generation uses of the model (transformers 5.x, ``generate(..., generation_mode="image")``):

* the prompt is the processor's chat template with ``add_generation_prompt=True`` followed by ``<begin_of_image>``;
  with CFG the unconditional row is the same prompt with every token but BOS and BOI replaced by the pad id;
* codes come from ``model.model.generation_head`` on the post-norm last hidden state (``lm_head`` is text only),
  guidance on the raw logits (default scale 5);
* a code is fed back through ``generation_embeddings`` then ``generation_aligner``
  (``prepare_embeddings_for_image_generation``), never ``embed_tokens``;
* ``vision_config.num_image_tokens`` codes (576 = 24 x 24 at 384 px) in raster order, no end-of-row token; the VQ
  decoder reads ``vq_config.num_patches`` rows, L2-normalised code vectors.
"""

import os
import string
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, ProcessorMixin

from ..core.layout import ImageTokenLayout
from ..decoders.decoding_utils import SpatialDecoderMixin
from ..heads.heads_utils import DraftHeadsMixin
from .backbone import PromptEmbeddings
from .checkpoint_checks import load_checked_model, read_backbone_config
from .pass_cost import GPU_DRAFT_SIZES
from .pipeline_utils import SpatialARPipeline
from .transformers_utils import TransformersBackbone, TransformersPipelineMixin, natural_scale_init

#: Janus-Pro's CFG scale (the checkpoints' generation config and the paper's sampling setting).
JANUS_DEFAULT_GUIDANCE_SCALE = 5.0


class JanusProBackbone(TransformersBackbone):
    """Adapter over `JanusForConditionalGeneration` + `JanusProcessor` for the generation loop."""

    family = "janus"

    family_name = "Janus-Pro"
    processor_kind = "the model's JanusProcessor"
    grid_file = "config.json"
    grid_key = "vision_config.num_image_tokens"
    family_guidance_scale = JANUS_DEFAULT_GUIDANCE_SCALE

    @classmethod
    def grid_from_configs(cls, config, generation_config) -> Tuple[int, int]:
        """Rows: what the VQ decoder reads (``vq_config.num_patches``, image_size // patch_size); codes: what
        ``generate`` emits (``vision_config.num_image_tokens``)."""
        height = config.vq_config.num_patches
        num_tokens = config.vision_config.num_image_tokens
        if num_tokens % height:
            raise ValueError(
                f"`vision_config.num_image_tokens` ({num_tokens}) is not a whole number of rows of "
                f"`vq_config.num_patches` ({height}) codes; this Janus config has no image grid."
            )
        return height, num_tokens // height

    # -- modules ----------------------------------------------------------------------------------------
    @property
    def text_model(self) -> torch.nn.Module:
        return self.transformer.model.language_model

    # -- facts ------------------------------------------------------------------------------------------
    @property
    def layout(self) -> ImageTokenLayout:
        return ImageTokenLayout(*self.grid_from_configs(self.transformer.config, {}))

    @property
    def num_image_codes(self) -> int:
        return self.transformer.config.vq_config.num_embeddings

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.transformer.config.vq_config.channel_multiplier) - 1)

    @property
    def codebook(self) -> torch.Tensor:
        return F.normalize(self.vqmodel.quantize.embedding.weight, p=2, dim=-1)  # as `get_codebook_entry` reads them

    # -- special tokens ---------------------------------------------------------------------------------
    def _token_id(self, name: str) -> int:
        """BOS / pad / BOI ids: the generation config's (what ``generate`` uses), else the tokenizer's."""
        config, tokenizer = self.generation_config, self.tokenizer
        if name == "boi":
            value = (getattr(config, "generation_kwargs", None) or {}).get("boi_token_id")
            if value is None:
                value = getattr(config, "boi_token_id", None)
            if value is None:
                value = tokenizer.convert_tokens_to_ids(self.pipe.processor.image_start_token)
        else:
            value = getattr(config, f"{name}_token_id", None)
            if value is None:
                value = getattr(tokenizer, f"{name}_token_id")
        if isinstance(value, (list, tuple)):
            value = value[0]
        if value is None:
            raise ValueError(f"This Janus checkpoint names no {name} token (generation config or tokenizer).")
        return int(value)

    # -- prompts ----------------------------------------------------------------------------------------
    def prompt_text(self, prompt: str) -> str:
        """The text Janus-Pro reads for an image prompt: the chat template's user turn and assistant prefix (the
        processor appends ``<begin_of_image>``)."""
        processor = self.pipe.processor
        if not getattr(processor, "chat_template", None):
            return prompt
        messages = [{"role": "user", "content": [{"type": "text", "text": prompt}]}]
        return processor.apply_chat_template(messages, add_generation_prompt=True)

    def tokenize(self, prompts: List[str], device: torch.device):
        """Prompt ids ``(B, P)`` (left-padded, BOS first, BOI last) and their mask ``(B, P)``."""
        index = {p: i for i, p in enumerate(dict.fromkeys(prompts))}  # each distinct prompt once (repeated rows)
        unique = list(index)
        enc = self.pipe.processor(
            text=[self.prompt_text(p) for p in unique], generation_mode="image", padding=True, padding_side="left",
            return_tensors="pt",
        )
        rows = torch.tensor([index[p] for p in prompts]) if len(unique) < len(prompts) else slice(None)
        return enc["input_ids"][rows].to(device), enc["attention_mask"][rows].to(device).bool()

    def unconditional_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Janus' unconditional prompt: every token but BOS and BOI replaced by the pad id."""
        keep = (ids == self._token_id("bos")) | (ids == self._token_id("boi"))
        return ids.masked_fill(~keep, self._token_id("pad"))

    def encode_prompt(self, prompts, negative_prompts, do_cfg, device) -> PromptEmbeddings:
        self._onload()
        if do_cfg and negative_prompts is not None:  # one padded batch: cond and uncond rows of one length
            ids, valid = self.tokenize(list(prompts) + list(negative_prompts), device)
        else:
            ids, valid = self.tokenize(list(prompts), device)
            if do_cfg:  # the uncond row keeps the cond row's padding mask, as `generate` does
                ids, valid = torch.cat([ids, self.unconditional_ids(ids)]), valid.repeat(2, 1)
        embeds = self.text_model.get_input_embeddings()(ids)  # (R, P, D)
        return PromptEmbeddings(embeds, valid)

    # -- the target -------------------------------------------------------------------------------------
    def embed_image_tokens(self, codes: torch.Tensor) -> torch.Tensor:
        self._onload()
        return self.transformer.prepare_embeddings_for_image_generation(codes)  # generation_embeddings -> aligner

    def output_head(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.transformer.model.generation_head(hidden_states).float()

    @property
    def round_modules(self):
        model = self.transformer.model  # the code embedding's aligner and the image head run beside the trunk
        return (self.target_module, model.generation_aligner, model.generation_head)

    # -- pixels -----------------------------------------------------------------------------------------
    def _pixel_normalization(self, device: torch.device):
        """The processor's (mean, std) per channel on ``device``: the VQ model's pixels are ``(x - mean) / std`` of
        [0, 1] images."""
        image_processor = getattr(self.pipe.processor, "image_processor", None)
        if image_processor is None or not getattr(image_processor, "do_normalize", True):
            return None
        mean, std = image_processor.image_mean, image_processor.image_std
        as_tensor = lambda v: torch.tensor(v if isinstance(v, (list, tuple)) else [v] * 3, dtype=torch.float32)  # noqa: E731
        return as_tensor(mean)[:, None, None].to(device), as_tensor(std)[:, None, None].to(device)

    @torch.no_grad()
    def decode_image(self, tokens: torch.Tensor) -> torch.Tensor:
        self._onload()
        vq = self.vqmodel
        b, h, w = tokens.shape
        if [h, w] == list(vq.quantize.quant_state_dims):
            pixels = vq.decode(tokens.reshape(b, h * w))  # (B, 3, h*f, w*f)
        else:  # a grid the VQ config does not fix (tiny test configs): the same computation for any H x W
            latent = F.normalize(vq.quantize.embedding(tokens), p=2, dim=-1).permute(0, 3, 1, 2)  # (B, d, H, W)
            pixels = vq.decoder(vq.post_quant_conv(latent))
        norm = self._pixel_normalization(pixels.device)
        if norm is None:
            return pixels
        return (pixels.float() * norm[1] + norm[0]) * 2 - 1  # the processor's [0, 1] range -> [-1, 1]

    @torch.no_grad()
    def encode_image(self, pixels: torch.Tensor) -> torch.Tensor:
        self._onload()
        norm = self._pixel_normalization(pixels.device)
        x = pixels.float()
        if norm is not None:
            x = ((x + 1) / 2 - norm[0]) / norm[1]
        weight = self.vqmodel.quant_conv.weight
        tokens = self.vqmodel.encode(x.to(weight.device, weight.dtype)).image_tokens
        return tokens.reshape(pixels.shape[0], -1)  # (B, H*W)


class JanusProPipeline(TransformersPipelineMixin, SpatialARPipeline):
    r"""Janus-Pro text-to-image generation with a swappable speculative decoder.

    Args:
        transformer (`JanusForConditionalGeneration`): the transformers model (trunk, image-generation head and
            embeddings, VQ decoder). Its ``generation_config`` holds the sampling defaults the pipeline uses when a
            call does not pass them: ``guidance_scale`` (Janus-Pro: 5) and ``top_k`` (none: all 16,384 codes);
            they are saved and loaded with the model.
        processor (`JanusProcessor`): tokenizer, chat template and the image processor whose normalisation gives the
            pixel range.
        decoder (`SpatialDecoderMixin`): the decoding algorithm (`AutoregressiveDecoder` or a speculative one).
        draft_heads (`DraftHeadsMixin`, *optional*): draft heads for the decoders that need them.

    Load the released checkpoints with `from_backbone` (``"deepseek-community/Janus-Pro-7B"``), saved pipelines with
    ``from_pretrained``. The model must use ``sdpa`` or ``eager`` attention (tree masks); another implementation is
    switched to ``sdpa``.
    """

    backbone_class = JanusProBackbone
    default_draft_sizes = GPU_DRAFT_SIZES  # a 1-8B model on a GPU: drafts as large as acceptance pays for

    @classmethod
    def dummy_components(cls, grid=(4, 4), num_codes: int = 16) -> Dict[str, Any]:
        """Tiny random ``__init__`` components but decoder and heads (`testing.dummy_pipeline`; under a seed)."""
        return dummy_janus_components(grid, num_codes)

    def __init__(self, transformer: PreTrainedModel, processor: ProcessorMixin, decoder: SpatialDecoderMixin,
                 draft_heads: Optional[DraftHeadsMixin] = None):
        super().__init__()
        from transformers import JanusForConditionalGeneration

        if not isinstance(transformer, JanusForConditionalGeneration):
            raise ValueError(f"`transformer` must be a JanusForConditionalGeneration, got {type(transformer).__name__}.")
        self._register_transformer(transformer.model.language_model, "Janus", draft_heads, transformer=transformer.eval(),
                                   processor=processor, decoder=decoder)

    @classmethod
    def load_backbone_components(cls, repo_or_path: Union[str, os.PathLike], torch_dtype: Optional[torch.dtype] = None,
                                 dtype: Optional[torch.dtype] = None, processor: Optional[ProcessorMixin] = None,
                                 attn_implementation: str = "sdpa", device_map: Union[None, str, Dict[str, Any]] = None,
                                 **hub_kwargs) -> Dict[str, Any]:
        """Read a transformers Janus checkpoint (``config.json`` + safetensors + processor files; a local folder or a
        Hub repo id such as ``"deepseek-community/Janus-Pro-1B"``, from the Hub cache when ``HF_HUB_OFFLINE=1``).

        Args:
            torch_dtype / dtype (`torch.dtype`, *optional*): weights dtype (e.g. ``torch.bfloat16``); default: as
                transformers loads it.
            processor (`JanusProcessor`, *optional*): use this processor instead of the checkpoint's.
            attn_implementation (`str`): ``"sdpa"`` (default) or ``"eager"``; flash attention cannot take tree masks.
            device_map (`str` or `dict`, *optional*): transformers' ``device_map`` for the model (``"auto"``, or one GPU
                and ``"cpu"`` offload; not several GPUs: `check_device_map`).
            hub_kwargs: ``revision``, ``cache_dir``, ``token``, ``local_files_only``, ... for both ``from_pretrained``.
        """
        from transformers import JanusForConditionalGeneration, JanusProcessor

        weights_dtype, hub_kwargs, config = read_backbone_config(
            repo_or_path, hub_kwargs, "janus", "a Janus checkpoint", attn_implementation, torch_dtype, dtype)
        model = load_checked_model(cls.backbone_class, JanusForConditionalGeneration, repo_or_path, config, hub_kwargs,
                                   attn_implementation, weights_dtype, device_map)
        if processor is None:
            processor = JanusProcessor.from_pretrained(repo_or_path, **hub_kwargs)
        return {"transformer": model, "processor": processor}


# -- tiny random components, for tests (`dummy_components`, `spatial_pipelines.testing.dummy_pipeline`) --------------
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
    from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import JanusProcessor, PreTrainedTokenizerFast
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
    natural_scale_init(model, ("model.vision_model",), (model.model.language_model.embed_tokens.weight, 1.0),
                       (model.model.generation_embeddings.weight, 1.0))
    gen = model.generation_config  # what `generate(generation_mode="image")` and the released checkpoints set
    gen.guidance_scale, gen.temperature = 5.0, 1.0
    gen.bos_token_id, gen.pad_token_id = ids["bos"], ids["pad"]
    gen.generation_kwargs = {"boi_token_id": ids["boi"]}
    return {"transformer": model, "processor": processor}
