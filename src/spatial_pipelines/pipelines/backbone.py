"""The backbone contract: what the generation loop needs from a model family (`SpatialBackbone`), and the prompt
prefix it is prefilled with (`PromptEmbeddings`). One subclass per family, in that family's pipeline file."""

import abc
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from diffusers import DiffusionPipeline

from ..core.acceptance import codebook_neighbours
from ..core.kv_cache import StaticKVCache
from ..core.layout import ImageTokenLayout
from ..utils import compute_dtype

#: The most characters a prompt may hold per position it may take: no tokenizer of these families averages more than a
#: few characters a token, so a longer prompt cannot fit, and it is refused (or truncated) before it is tokenized.
PROMPT_CHARACTERS_PER_TOKEN = 32


@dataclass
class PromptEmbeddings:
    """The prefix the target is prefilled with: conditional rows first, then (with CFG) unconditional rows.

    Args:
        embeds (`torch.Tensor` `(R, P, D)`): prefix embeddings.
        valid (`torch.BoolTensor` `(R, P)`): ``False`` marks padding.
    """

    embeds: torch.Tensor
    valid: torch.Tensor


@dataclass
class BackboneCaches:
    """What a backbone adapter keeps from call to call (it is built once per pipeline and reads the components when
    asked, so nothing here goes stale when a decoder or heads change).

    Args:
        code_neighbours (`dict`): the codebook neighbour table of relaxed acceptance (`code_neighbours`), per codebook.
        pass_costs (`dict`): measured target pass costs (`PassCostMixin.pass_cost`), per rows, device, dtype and
            shape mode; emptied when the step is compiled or made eager again.
        kv_cache (`StaticKVCache`, *optional*): the static-shape KV cache kept for the next call of the same size (its
            address stays, which CUDA graphs replay).
    """

    code_neighbours: Dict[Any, torch.Tensor] = field(default_factory=dict)
    pass_costs: Dict[Any, Any] = field(default_factory=dict)
    kv_cache: Optional[StaticKVCache] = None


class SpatialBackbone(abc.ABC):
    """What the loop needs from a backbone family. One subclass per family, built from the pipeline's components.

    Hidden states passed around are the last hidden state **before** the final norm; `image_logits` applies the
    norm and the head restricted to image-code columns.
    """

    #: The model family (``"llamagen"``, ``"janus"``, ...): draft heads record it and are refused by another family.
    family: Optional[str] = None

    def __init__(self, pipe: DiffusionPipeline):  # the family's `SpatialARPipeline` (a subclass of it)
        self.pipe = pipe
        self.caches = BackboneCaches()  # built once per pipeline (`SpatialARPipeline.backbone`), so they last

    @property
    @abc.abstractmethod
    def layout(self) -> ImageTokenLayout:
        """The image-code grid."""

    @property
    @abc.abstractmethod
    def hidden_size(self) -> int:
        """Width of the trunk's hidden states."""

    @property
    @abc.abstractmethod
    def num_image_codes(self) -> int:
        """Codes in the VQ codebook."""

    @property
    @abc.abstractmethod
    def vae_scale_factor(self) -> int:
        """Pixels per code along each side."""

    @property
    @abc.abstractmethod
    def codebook(self) -> torch.Tensor:
        """VQ code vectors ``(V, d)`` as the VQ decoder sees them."""

    def code_neighbours(self, k: int) -> torch.Tensor:
        """The ``k`` nearest codes of every code in `codebook` (`codebook_neighbours`: ``(V, min(k, V - 1))``, nearest
        first), for relaxed acceptance (LANTERN). Computed once per codebook and ``k`` and kept in `caches`; a
        table for a larger ``k`` serves smaller ones."""
        book = self.codebook  # (V, d), L2-normalised when the tokenizer normalises
        cache = self.caches.code_neighbours
        key = (str(book.device), tuple(book.shape), float(book.detach().double().sum()), float((book.detach().double() ** 2).sum()))
        table = cache.get(key)
        if table is None or table.shape[1] < min(k, book.shape[0] - 1):
            table = codebook_neighbours(book, k)
            cache.clear()  # one codebook at a time: another one's table is stale
            cache[key] = table
        return table

    @property
    def default_guidance_scale(self) -> float:
        return 1.0

    @property
    def max_sequence_length(self) -> Optional[int]:
        """Positions the model was trained for (its context: the prompt, the image codes and their end-of-row tokens);
        ``None`` where the family's prompt has a fixed length (LlamaGen truncates its caption)."""
        return None

    @property
    def prefix_length(self) -> Optional[int]:
        """The prompt positions before the first code where the family fixes them (LlamaGen: its condition tokens),
        else ``None`` (the prompt's length varies)."""
        return None

    @property
    def max_prompt_characters(self) -> Optional[int]:
        """The longest text prompt a call reads, in characters: `PROMPT_CHARACTERS_PER_TOKEN` per position the prompt
        may take (`max_sequence_length` less the image's); longer prompts are refused before they are tokenized.
        ``None`` where the family truncates its caption itself (LlamaGen)."""
        limit = self.max_sequence_length
        if limit is None:
            return None
        return PROMPT_CHARACTERS_PER_TOKEN * max(limit - self.layout.sequence_length, 1)

    @property
    def default_top_k(self) -> Optional[int]:
        return None

    def facts(self) -> Dict[str, Any]:
        """Backbone facts draft heads must match (`spatial_pipelines.heads.check_backbone_facts`)."""
        return {"family": self.family, "hidden_size": self.hidden_size, "num_image_codes": self.num_image_codes,
                "grid_height": self.layout.height, "grid_width": self.layout.width}

    @property
    def name_or_path(self) -> Optional[str]:
        """The folder or Hub repo the pipeline was loaded from (``None`` for one built in memory): heads whose
        ``base_model_name_or_path`` surely names another model are refused, and a warning says when it cannot be told
        (`spatial_pipelines.heads.heads_utils.compare_base_models`)."""
        name = dict(getattr(self.pipe, "config", None) or {}).get("_name_or_path")
        return str(name) if name else None

    def prompt_from_text(self, text: str) -> Any:
        """A prompt typed as text (the CLI) -> what this family's ``prompt`` takes."""
        return text

    @abc.abstractmethod
    def check_prompt(self, prompt: Sequence[Any], name: str) -> None:
        """Raise `ValueError` (naming ``name``) if a prompt list is not valid for this family."""

    @abc.abstractmethod
    def encode_prompt(self, prompts: List[Any], negative_prompts: Optional[List[Any]], do_cfg: bool,
                      device: torch.device) -> PromptEmbeddings:
        """One row per image; with CFG the unconditional rows follow the conditional ones."""

    @abc.abstractmethod
    def embed_image_tokens(self, codes: torch.Tensor) -> torch.Tensor:
        """Codes ``(R, T)`` -> input embeddings ``(R, T, D)``."""

    @property
    def eol_embedding(self) -> torch.Tensor:
        """Input embedding ``(D,)`` of the end-of-row token; families whose layout has one must provide it."""
        raise ValueError(
            f"{type(self).__name__} has no end-of-row token, but its layout sets `eol_token_id`: a family whose "
            "layout has EOLs must give its backbone an `eol_embedding`."
        )

    @abc.abstractmethod
    def forward(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, attention_mask: Optional[torch.Tensor],
                token_valid: Optional[torch.Tensor], cache: Optional[StaticKVCache]) -> torch.Tensor:
        """Target forward -> pre-norm hidden states ``(R, T, D)``; appends the new keys/values to ``cache``."""

    @abc.abstractmethod
    def final_norm(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The trunk's final norm: pre-norm -> post-norm hidden states."""

    @abc.abstractmethod
    def output_head(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Post-norm hidden states -> image-code logits (fp32); draft heads share it."""

    def image_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Pre-norm hidden states ``(R, T, D)`` -> image-code logits ``(R, T, V)`` in fp32."""
        return self.output_head(self.final_norm(hidden_states))

    @torch.no_grad()
    def teacher_forced_hidden_states(self, prefix: PromptEmbeddings, codes: torch.Tensor) -> torch.Tensor:
        """Pre-norm hidden states ``(B, N, D)`` over whole code grids ``(B, N)`` after the prefix rows ``prefix``
        ``(B, P, D)``: ``[:, j]`` is the state that predicts code ``j`` (what draft heads train on). One forward over
        ``[prefix, codes]`` (EOLs written in for EOL layouts) on a cache of its own, at the positions the loop uses."""
        layout = self.layout
        b, n = codes.shape
        p = prefix.embeds.shape[1]
        image = layout.image_sequence(self.embed_image_tokens(codes), self.eol_embedding if layout.has_eol else None)  # (B, S, D)
        x = torch.cat([prefix.embeds, image.to(prefix.embeds.dtype)], 1)[:, : p + layout.sequence_offset(n - 1)]  # nothing after the last input
        valid = torch.cat([prefix.valid, torch.ones(b, x.shape[1] - p, dtype=torch.bool, device=x.device)], 1)
        cache = self.make_cache(b, x.shape[1])
        hidden = self.forward(x, torch.arange(x.shape[1], device=x.device), None, valid, cache)  # (B, T, D)
        # the input that precedes code j sits at p - 1 + offset(j): code j - 1, or the EOL ending the row above
        return hidden[:, p - 1 + layout.sequence_offset(torch.arange(n, device=x.device))]

    def encode_image(self, pixels: torch.Tensor) -> torch.Tensor:
        """Images ``(B, 3, h, w)`` in [-1, 1] -> their code grids ``(B, H*W)`` (families with a VQ encoder)."""
        raise ValueError(f"{type(self).__name__} cannot encode images into codes; train on generated grids instead.")

    @property
    @abc.abstractmethod
    def target_module(self) -> torch.nn.Module:
        """The module whose forward `forward` runs: what `SpatialARPipeline.enable_compile` compiles, and whose dtype
        draft heads take (`dtype`)."""

    @property
    def round_modules(self) -> Tuple[torch.nn.Module, ...]:
        """The modules whose forward a round's target pass calls: `target_module`, and a family's code embedding and
        output head where they live outside it. Eager rounds pack their linear layers (`GenerationLoop.packed_weights`);
        a head read as a slice of its weight (Emu3's, Chameleon's ``lm_head``) is not one."""
        return (self.target_module,)

    #: Whether `target_module` compiles with ``fullgraph=True`` (no graph break in a round's step).
    supports_fullgraph: bool = True

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the hidden states `forward` returns: the target module's compute dtype (draft heads are cast
        to it), not an fp8 storage dtype of diffusers' layerwise casting."""
        return compute_dtype(self.target_module)

    @abc.abstractmethod
    def make_cache(self, rows: int, max_length: int) -> StaticKVCache:
        """A KV cache for ``rows`` sequences of up to ``max_length`` positions."""

    @abc.abstractmethod
    def decode_image(self, tokens: torch.Tensor) -> torch.Tensor:
        """Code grids ``(B, H, W)`` -> images ``(B, 3, h, w)`` in [-1, 1]."""
