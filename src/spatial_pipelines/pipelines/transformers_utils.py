"""What the transformers-backed families (Janus-Pro, Emu3, Anole, Lumina-mGPT) share: one target forward of a
transformers language model over the library's static KV cache (returning the pre-norm last hidden state the loop and
the heads use), the `TransformersBackbone` base adapter, code <-> token-id tables for image codes that live in a text
vocabulary, left-padded prompt rows, onloading under model CPU offload, and sampling defaults kept in the generation
config."""

import abc
import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from diffusers.utils import logging

from ..core.kv_cache import StaticKVCache, TransformersCacheView, additive_mask
from ..utils import check_number
from .backbone import SpatialBackbone
from .pass_cost import CPU_DRAFT_SIZES


@torch.no_grad()
def language_model_forward(language_model: torch.nn.Module, inputs_embeds: torch.Tensor, position_ids: torch.Tensor,
                           attention_mask: Optional[torch.Tensor], token_valid: Optional[torch.Tensor],
                           cache: StaticKVCache) -> torch.Tensor:
    """Run a transformers decoder stack (``LlamaModel``-like: ``.norm`` is its final norm) over ``inputs_embeds``
    ``(R, T, D)`` at ``position_ids`` ``(T,)`` or ``(R, T)``, appending to ``cache``.

    Args:
        attention_mask: ``(T, T)`` or ``(R, T, T)`` boolean, which new tokens see which (``None``: causal).
        token_valid: ``(R, T)`` which new tokens are real (prompt padding is not); ``None``: all.

    Returns:
        The pre-norm last hidden state ``(R, T, D)`` (transformers' ``last_hidden_state`` is post-norm: a
        forward-pre-hook on ``.norm`` reads the state before it).
    """
    r, t = inputs_embeds.shape[:2]
    device = inputs_embeds.device
    cache.prepare_write(t)  # where the new keys go (a tensor for a fixed-shape cache), before the mask reads it
    if attention_mask is None:
        attention_mask = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    mask = additive_mask(cache.attention_mask(attention_mask, token_valid), inputs_embeds.dtype)  # (R, 1, T, L + T)
    position_ids = position_ids.expand(r, t) if position_ids.dim() == 1 else position_ids
    captured = pre_norm_capture(language_model)
    cache_kwarg = {cache_argument(type(language_model)): TransformersCacheView(cache)}
    # the slots written (our cache reads none of it; the mask is given): rows on the device take row 0's, so a
    # round compiled whole bakes no host length into its graph
    if getattr(cache, "row_starts", None) is not None:
        cache_position = cache.write_index[0]  # (T,)
    else:
        cache_position = torch.arange(cache.length, cache.length + t, device=device)
    language_model(
        inputs_embeds=inputs_embeds, position_ids=position_ids, attention_mask=mask, use_cache=True, **cache_kwarg,
        cache_position=cache_position,
    )
    cache.advance(token_valid, t)
    hidden, captured.value = captured.value, None  # hold no activation between passes
    return hidden


class PreNormCapture:
    """Where the pre-norm hook puts the input of a model's final norm (``value``)."""

    value: Optional[torch.Tensor] = None

    def __call__(self, module: torch.nn.Module, args) -> None:
        self.value = args[0]  # written, never read, inside a compiled step: nothing to guard on


def pre_norm_capture(language_model: torch.nn.Module) -> PreNormCapture:
    """The `PreNormCapture` that receives the input of ``language_model.norm`` (the pre-norm last hidden state) on each
    forward.

    The hook is registered once per model and kept: a hook registered and removed around every call would be a new
    function each round, which a compiled step sees as a changed module and recompiles for. It keeps only the newest
    input, and `language_model_forward` drops it after reading it.
    """
    norm = language_model.norm
    holder = norm.__dict__.get("_spatial_pre_norm")
    if holder is None:
        holder = PreNormCapture()
        norm.register_forward_pre_hook(holder)
        norm.__dict__["_spatial_pre_norm"] = holder
    return holder


@functools.lru_cache(maxsize=None)
def cache_argument(model_class: type) -> str:
    """The keyword a transformers model's ``forward`` takes its KV cache under: ``cache`` from transformers 5.24
    (``past_key_values`` still works there, with a deprecation warning, until 5.40), ``past_key_values`` before.
    Read once per class from the signature (``inspect`` follows the deprecation wrapper's ``__wrapped__``)."""
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def same_device(a: torch.device, b: torch.device) -> bool:
    """``cuda`` and ``cuda:0`` name the same device when one of them leaves the index open."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def onload(module: Optional[torch.nn.Module], probe: torch.Tensor) -> None:
    """Run ``module``'s ``enable_model_cpu_offload`` hook unless ``probe`` (one of its weights) already sits on the
    hook's execution device. The hooks fire on a component's top-level ``forward`` only; the loop calls submodules
    (trunk, head, VQ decoder), so the backbone onloads itself, once rather than on every call of a round."""
    hook = getattr(module, "_hf_hook", None)
    device = getattr(hook, "execution_device", None)
    if device is not None and not same_device(probe.device, torch.device(device)):
        hook.pre_forward(module)


logger = logging.get_logger(__name__)

#: The generation-config key that holds the image grid (codes) of a transformers family.
GRID_KEY = "image_grid"


def check_image_fits_context(grid: Sequence[int], positions: int, limit: Optional[int], grid_where: str,
                             limit_where: str) -> None:
    """Raise `ValueError` naming where the grid is set (``grid_where``) when an image of ``positions`` positions
    (``grid`` codes, end-of-row tokens included) leaves no room for a prompt in the ``limit`` positions the model was
    trained for (``max_position_embeddings``, named by ``limit_where``): positions past them give no image."""
    if limit is None or positions < limit:
        return
    raise ValueError(f"{grid_where} asks for a {grid[0]}x{grid[1]} grid, which takes {positions} positions, but "
                     f"{limit_where} is {limit}: the model was trained for {limit} positions, prompt included, and "
                     f"positions past them give no image. Choose a grid of fewer than {limit} positions.")


#: Attention implementations that take the 4-D float masks tree decoding needs (what a family loads a model with).
TREE_MASK_ATTENTION = ("sdpa", "eager")

#: The attention implementation a family's GQA trunk runs with once in a pipeline (`use_grouped_attention`),
#: registered with transformers under this name.
GROUPED_SDPA = "spatial_grouped_sdpa"


def grouped_head_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                           scaling: Optional[float] = None) -> torch.Tensor:
    """Attention of queries ``(B, H, T, D)`` on keys and values ``(B, H_kv, S, D)``, SDPA pairing the heads itself
    (``enable_gqa``). Returns ``(B, H, T, D)``."""
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=True)


def folded_group_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                           scaling: Optional[float] = None) -> torch.Tensor:
    """Attention of queries ``(B, H, T, D)`` on keys and values ``(B, H_kv, S, D)`` with each key/value head's group
    of ``G = H / H_kv`` query heads folded into the query axis: queries ``(B, H_kv, G*T, D)``, the mask
    ``(B, 1, T, S)`` (or ``(B, H, T, S)``) repeated to ``(B, 1 or H_kv, G*T, S)``. Returns ``(B, H, T, D)``."""
    b, h, t, d = query.shape
    hkv = key.shape[1]
    groups = h // hkv
    mb, mh, _, s = mask.shape
    if mh == 1:
        mask = mask.expand(mb, groups, t, s).reshape(mb, 1, groups * t, s)
    else:
        mask = mask.reshape(mb, hkv, groups * t, s)
    query = query.reshape(b, hkv, groups * t, d)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(b, h, t, value.shape[-1])


#: transformers' attention arguments the grouped function leaves to transformers' sdpa when given.
_SDPA_EXTRA_TERMS = ("softcap", "position_bias", "sinks", "s_aux")


def grouped_sdpa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                           **kwargs) -> Tuple[torch.Tensor, None]:
    """transformers' SDPA attention, except that a GQA trunk's queries ``(B, H, T, D)`` attend to the cache's keys and
    values ``(B, H_kv, S, D)`` as they are. transformers' ``sdpa`` repeats them to every query head (``repeat_kv``)
    whenever a mask is given, so on every pass of the library's chain and tree masks: a copy of the whole attended
    cache per layer. Query head ``h`` reads key/value head ``h // (H / H_kv)``, as ``repeat_kv`` pairs them.

    MHA trunks, passes without a 4-D mask (transformers' own ``generate`` may give none), dropout and transformers'
    extra terms (``softcap``, ``position_bias``, sinks) take transformers' ``sdpa`` unchanged."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    extra = kwargs.get("output_attentions") or any(kwargs.get(k) is not None for k in _SDPA_EXTRA_TERMS)
    if groups == 1 or attention_mask is None or attention_mask.dim() != 4 or dropout or extra:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    # CPU, several fed tokens: the flash kernel takes grouped heads under a mask (scripts/gqa_step.py: faster than
    # folding at 2 threads, 16 tokens); one token, or CUDA (whose masked kernel takes no grouped heads): fold
    grouped = query.device.type == "cpu" and query.shape[2] > 1
    attend = grouped_head_attention if grouped else folded_group_attention
    return attend(query, key, value, attention_mask, scaling).transpose(1, 2).contiguous(), None


def use_grouped_attention(text_model: torch.nn.Module) -> None:
    """Run a family's GQA trunk (``text_model``: fewer key/value heads than query heads, attention ``sdpa``) with
    `grouped_sdpa_attention`, registered with transformers (attention and mask functions). ``eager``, other
    implementations and MHA trunks are left as they are. The implementation is not saved with the config: the
    pipeline switches a loaded model again."""
    config = text_model.config
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    if getattr(config, "_attn_implementation", None) != "sdpa" or kv_heads == config.num_attention_heads:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(GROUPED_SDPA, grouped_sdpa_attention)
    AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)  # for the masks transformers builds itself (`generate`)
    config._attn_implementation = GROUPED_SDPA


def check_device_map(model: torch.nn.Module) -> None:
    """Refuse a model that transformers spread over several accelerators (``hf_device_map``): the generation loop's
    static KV cache is one tensor on one device. One accelerator with weights offloaded to ``"cpu"`` / ``"disk"``
    (accelerate moves them in for each forward) is fine."""
    placed = {str(d) for d in (getattr(model, "hf_device_map", None) or {}).values()}
    accelerators = sorted(placed - {"cpu", "disk", "meta"})
    if len(accelerators) > 1:
        raise ValueError(
            f"`device_map` placed the model on {len(accelerators)} devices ({', '.join(accelerators)}); the static KV "
            "cache lives on one device. Use one GPU (bf16), `pipe.enable_model_cpu_offload()`, or a map of one GPU "
            "and 'cpu' (offloaded layers are moved in for each forward).")


def use_tree_attention(transformer: torch.nn.Module, attention: str, family: str) -> None:
    """Switch ``transformer`` to ``sdpa`` (with a warning) when its trunk's ``attention`` implementation cannot take
    tree masks."""
    if attention not in (*TREE_MASK_ATTENTION, GROUPED_SDPA):
        logger.warning(f"{family} attention implementation {attention!r} cannot take tree masks; switching to 'sdpa'.")
        transformer.set_attn_implementation("sdpa")


def left_padded(rows: Sequence[List[int]], pad: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Token-id rows of any lengths -> ids ``(R, P)`` left-padded with ``pad`` to the longest, and which are real
    ``(R, P)``."""
    length = max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (length - len(r)) + list(r) for r in rows], dtype=torch.long)  # (R, P)
    valid = torch.tensor([[False] * (length - len(r)) + [True] * len(r) for r in rows])  # (R, P)
    return ids, valid


@dataclass(frozen=True)
class CodeIndex:
    """Image codes that live in a text vocabulary (Emu3, Chameleon): code -> token id, and the ``lm_head`` rows of the
    image tokens in code order.

    Args:
        ids (`torch.LongTensor` `(V,)`): token id of each code.
        rows (`tuple[int, int]`, *optional*): ``(start, end)`` when the ids are consecutive in code order (the head is
            then a view of the weight, no copy).
        eol_id (`int`, *optional*): the end-of-row token's id (Emu3).
    """

    ids: torch.Tensor
    rows: Optional[Tuple[int, int]]
    eol_id: Optional[int] = None

    @classmethod
    def from_img2bpe(cls, img2bpe: Dict[int, int], device, what: str, eol_id: Optional[int] = None) -> "CodeIndex":
        """From a transformers vocabulary mapping's ``img2bpe`` (code -> token id, read from the token names); a
        `ValueError` saying ``what`` the names should be when the codes are not ``0..V-1`` without gaps."""
        v = len(img2bpe)
        if v == 0 or sorted(img2bpe) != list(range(v)):
            raise ValueError(f"The `vocabulary_map` must name the image tokens ({what}) for codes 0..V-1 without gaps; "
                             f"it has {v} image tokens.")
        ids = torch.tensor([img2bpe[c] for c in range(v)], dtype=torch.long)
        consecutive = bool((ids == ids[0] + torch.arange(v)).all())
        return cls(ids=ids.to(device), rows=(int(ids[0]), int(ids[0]) + v) if consecutive else None, eol_id=eol_id)

    def logits(self, lm_head_weight: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """Post-norm states ``(R, T, D)`` -> fp32 logits over the image codes only ``(R, T, V)``, columns in code order."""
        weight = lm_head_weight[self.rows[0] : self.rows[1]] if self.rows is not None else lm_head_weight.index_select(0, self.ids)
        return F.linear(hidden_states.to(weight.dtype), weight).float()


class TransformersBackbone(SpatialBackbone):
    """What the transformers-backed families share: the ``transformer`` component's decoder stack (``text_model``:
    ``embed_tokens``, ``layers``, final ``norm``) on the library's static KV cache, the sampling defaults in its
    ``generation_config``, onloading under model CPU offload, the text-prompt check, and the head and embeddings of
    codes that are vocabulary tokens (the cached `CodeIndex`). A family sets ``text_model``, ``family_name``,
    ``processor_kind`` and the rest of the `SpatialBackbone` contract."""

    #: the family's name in messages
    family_name: str = "transformers"
    #: what the pipeline's ``processor`` component is, in the message when it is missing
    processor_kind: str = "the model's processor"
    #: the grid (codes), CFG scale and top-k when the generation config names none
    default_image_grid: Optional[Tuple[int, int]] = None
    family_guidance_scale: float = 1.0
    family_top_k: Optional[int] = None
    #: positions a row of codes takes past its codes: 1 where an end-of-row token follows every row
    row_end_positions: int = 0
    #: the file of a saved transformer that sets its grid, and the key there (`grid_from_configs`)
    grid_file: str = "generation_config.json"
    grid_key: str = GRID_KEY

    @classmethod
    def grid_from_configs(cls, config, generation_config: Dict[str, Any]) -> Tuple[int, int]:
        """The grid ``(rows, columns)`` of codes a transformer asks for, read from its transformers ``config`` and its
        generation config (a dict) without building it: the generation config's `GRID_KEY`, else the family's
        default. A `ValueError` when it is not two ints >= 1."""
        grid = generation_config.get(GRID_KEY)
        if grid is None:
            grid = cls.default_image_grid
        if (not isinstance(grid, (list, tuple)) or len(grid) != 2
                or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in grid)):
            raise ValueError(f"`{GRID_KEY}` must be two ints >= 1 (rows, columns of codes), got {grid!r}.")
        return int(grid[0]), int(grid[1])

    @classmethod
    def image_positions(cls, grid: Sequence[int]) -> int:
        """Positions an image of ``grid`` codes takes in the sequence (end-of-row tokens included)."""
        return grid[0] * (grid[1] + cls.row_end_positions)

    def check_image_positions(self) -> None:
        """Raise `ValueError` naming the grid's key when the image leaves no room for a prompt in the positions the
        model was trained for (`check_image_fits_context`): a grid edited in memory, checked before a call's work."""
        layout = self.layout
        where = "generation config" if self.grid_file == "generation_config.json" else "config"
        check_image_fits_context((layout.height, layout.width), layout.sequence_length, self.max_sequence_length,
                                 f"`{self.grid_key}` in the transformer's {where}",
                                 "its config's `max_position_embeddings`")

    @property
    def transformer(self) -> torch.nn.Module:
        return self.pipe.transformer

    @property
    def vqmodel(self) -> torch.nn.Module:
        return self.transformer.model.vqmodel

    @property
    def tokenizer(self):
        """The ``processor``'s tokenizer (the component itself where it is a bare tokenizer)."""
        processor = self.pipe.processor
        return getattr(processor, "tokenizer", processor)

    @property
    def image_grid(self) -> Tuple[int, int]:
        grid = getattr(self.generation_config, GRID_KEY, None)
        return tuple(int(n) for n in grid) if grid is not None else tuple(self.default_image_grid)

    @property
    def default_guidance_scale(self) -> float:
        saved = getattr(self.generation_config, "guidance_scale", None)
        return float(saved) if saved is not None else self.family_guidance_scale

    @property
    def default_top_k(self) -> Optional[int]:
        saved = getattr(self.generation_config, "top_k", None)
        return saved if saved is not None else self.family_top_k

    # codes that are tokens of the text vocabulary (Emu3, Chameleon: the family's `CodeIndex`, ``_index()``)
    @property
    def num_image_codes(self) -> int:
        return self._index().ids.shape[0]

    def embed_image_tokens(self, codes: torch.Tensor) -> torch.Tensor:
        self._onload()
        return self.text_model.embed_tokens(self._index().ids[codes])

    def output_head(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``lm_head`` restricted to the image tokens, columns in code order (a view of the weight when their ids are
        consecutive in code order, as in the released vocabularies)."""
        self._onload()
        return self._index().logits(self.transformer.lm_head.weight, hidden_states)

    @property
    @abc.abstractmethod
    def text_model(self) -> torch.nn.Module:
        """The decoder stack the loop runs."""

    @property
    def text_config(self):
        config = self.transformer.config
        return getattr(config, "text_config", None) or config

    @property
    def generation_config(self):
        return self.transformer.generation_config

    def _onload(self) -> None:
        onload(self.transformer, self.text_model.embed_tokens.weight)

    def check_prompt(self, prompt: Sequence[Any], name: str) -> None:
        if not all(isinstance(p, str) for p in prompt):
            raise ValueError(f"`{name}` must be a string or a list of strings for {self.family_name}.")
        if self.pipe.processor is None:
            raise ValueError(f"`{name}` is text, but this pipeline has no `processor` ({self.processor_kind}); pass it "
                             "to the pipeline.")
        self.check_image_positions()

    def check_tree_attention(self, attention: str) -> None:
        """A `ValueError` unless the trunk's attention implementation takes the arbitrary masks of draft trees."""
        if attention not in (*TREE_MASK_ATTENTION, GROUPED_SDPA):
            raise ValueError(f"{self.family_name} runs with `attn_implementation` 'sdpa' or 'eager' (draft trees need an "
                             f"arbitrary attention mask), got {attention!r}.")

    def cached_code_index(self, mapping: Any, build: Callable[[torch.device], CodeIndex]) -> CodeIndex:
        """The family's `CodeIndex`, built by ``build(device)`` once per model, vocabulary ``mapping`` and ``lm_head``
        device and kept on the pipeline (one at a time), never per call."""
        t = self.transformer
        device = t.lm_head.weight.device
        cache = self.pipe.__dict__.setdefault("_code_index", {})
        key = (id(t), id(mapping), str(device))
        index = cache.get(key)
        if index is None:
            index = build(device)
            cache.clear()
            cache[key] = index
        return index

    @property
    def hidden_size(self) -> int:
        return self.text_config.hidden_size

    @property
    def max_sequence_length(self) -> Optional[int]:
        return getattr(self.text_config, "max_position_embeddings", None)

    @property
    def num_attention_heads(self) -> int:
        return self.text_config.num_attention_heads

    def forward(self, inputs_embeds, position_ids, attention_mask, token_valid, cache) -> torch.Tensor:
        self._onload()
        if cache is None:  # a one-off pass (references, tests): a cache of its own, just long enough
            cache = self.make_cache(inputs_embeds.shape[0], inputs_embeds.shape[1])
        return language_model_forward(self.text_model, inputs_embeds, position_ids, attention_mask, token_valid, cache)

    def final_norm(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.text_model.norm(hidden_states)

    @property
    def target_module(self) -> torch.nn.Module:
        return self.text_model

    def make_cache(self, rows: int, max_length: int) -> StaticKVCache:
        config = self.text_config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        weight = self.text_model.embed_tokens.weight
        hook = getattr(self.transformer, "_hf_hook", None)  # under offload the weights may still be on the CPU
        device = getattr(hook, "execution_device", None) or weight.device
        return StaticKVCache(config.num_hidden_layers, rows, config.num_key_value_heads or config.num_attention_heads,
                             head_dim, max_length, dtype=self.dtype, device=device)  # the compute dtype


class TransformersPipelineMixin:
    """What the transformers families' pipelines share (a base before `SpatialARPipeline`): their components' settings
    and their ``__init__``'s body (`_register_transformer`)."""

    cpu_draft_sizes = CPU_DRAFT_SIZES  # on a CPU a fed token past about 8 costs: the sizes tuned there
    model_cpu_offload_seq = "transformer"
    _optional_components = ["draft_heads"]

    def _register_transformer(self, trunk: torch.nn.Module, tree_family: Optional[str], draft_heads, **components):
        """Switch the ``transformer`` component's ``trunk`` to an attention that takes tree masks (warning in the name of
        ``tree_family``; ``None``: the backbone checks it per call) and to `use_grouped_attention`, register the
        components, then attach ``draft_heads`` (checked against the backbone, moved to its device and dtype)."""
        if tree_family is not None:  # the trunk's implementation: what tree masks reach
            use_tree_attention(components["transformer"], trunk.config._attn_implementation, tree_family)
        use_grouped_attention(trunk)
        self.register_modules(**components)
        self.set_draft_heads(draft_heads)


def configure_generation(transformer: torch.nn.Module, image_grid: Optional[Tuple[int, int]] = None,
                         guidance_scale: Optional[float] = None, top_k: Optional[int] = None, **extra: Any) -> None:
    """Write the image grid and sampling defaults into ``transformer.generation_config`` (``None`` leaves a value), so
    they travel with the component; ``extra`` keys (family settings) are written as they are."""
    config = transformer.generation_config
    extra = {k: v for k, v in extra.items() if v is not None}
    if any(v is not None for v in (image_grid, guidance_scale, top_k)) or extra:
        # a config transformers derived from the model config drops unknown keys when it is read back: this one is ours
        config._from_model_config = False
    if image_grid is not None:
        if (not isinstance(image_grid, (tuple, list)) or len(image_grid) != 2
                or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in image_grid)):
            raise ValueError(f"`image_grid` must be two positive ints (rows, columns of codes), got {image_grid!r}.")
        setattr(config, GRID_KEY, [int(n) for n in image_grid])
    if guidance_scale is not None:
        check_number("default_guidance_scale", guidance_scale, 0)
        config.guidance_scale = float(guidance_scale)
    if top_k is not None:
        check_number("default_top_k", top_k, 0, integer=True)
        config.top_k = int(top_k)
        config.do_sample = True  # transformers refuses to save a top_k without it
    for key, value in extra.items():
        setattr(config, key, value)


def natural_scale_init(model: torch.nn.Module, skip: Sequence[str] = (), *then: Tuple[torch.Tensor, float]) -> None:
    """A tiny random model's 2-D weights (but those whose names hold one of ``skip``) at their natural scale
    ``1 / sqrt(fan_in)`` (not the 0.02 of wide models), then each ``(weight, std)`` of ``then``: attention then depends
    on content and position, so a wrong mask, position or cache entry changes the output and tests see it."""
    for name, param in model.named_parameters():
        if param.dim() == 2 and not any(s in name for s in skip):
            torch.nn.init.normal_(param, std=1.0 / param.shape[-1] ** 0.5)
    for weight, std in then:
        torch.nn.init.normal_(weight, std=std)
