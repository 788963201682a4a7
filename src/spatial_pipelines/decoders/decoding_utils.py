"""The base of every speculative decoder: weight-free, configurable, swappable like a diffusers scheduler.

A decoder never calls the backbone. It says what its round is (`SpatialDecoderMixin.plan`: a chain of drafts, a tree
its drafter drafts, or a schedule of passes; `spatial_pipelines.core.rounds`), and the pipeline's one engine runs it
on the device: the target pass, the verification on keyed noise, the commit and the KV cache are the engine's.
"""

import abc
import functools
from typing import Any, Callable, Dict, Optional

import torch
from diffusers import ConfigMixin, SchedulerMixin

from ..core.acceptance import EXACT, AcceptanceRule
from ..core.contracts import HeadsNeed, check_heads
from ..core.layout import ImageTokenLayout
from ..utils import LIBRARY, check_number, check_save_directory, subclasses

DECODER_CONFIG_NAME = "decoder_config.json"
AUTO = "auto"


def _decoder_init(init):
    """A decoder's ``__init__`` that records its class in the config (``_class_name``): a swap to another decoder starts
    from that decoder's defaults (`SpatialDecoderMixin.extract_init_dict`)."""

    @functools.wraps(init)
    def wrapped(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.register_to_config(_class_name=type(self).__name__)
        if not type(self).__module__.startswith(LIBRARY + "."):
            # diffusers loads a component only from libraries it knows: a decoder defined elsewhere is recorded as
            # ["spatial_pipelines", "<Name>"], which the package resolves among the loaded decoders (`find_registered`)
            self.__dict__["__module__"] = LIBRARY

    return wrapped


#: The most nodes one round may feed the target (the root and its drafts; end-of-row tokens not counted). A round's
#: masks grow as the square of its nodes and its logits and proposals as nodes x codes per row, so a config past this
#: is refused when the decoder is built, before anything is allocated.
MAX_FED_TOKENS = 1024


def check_draft_budget(what: str, nodes: int) -> None:
    """Raise `ValueError` when ``what`` (the arguments, as written in the message) implies a round of more than
    `MAX_FED_TOKENS` nodes."""
    if nodes > MAX_FED_TOKENS:
        raise ValueError(f"{what} implies {nodes} draft nodes per round; a round feeds at most {MAX_FED_TOKENS} (its mask "
                         "grows as nodes^2, its logits as nodes x codes per image): choose a smaller draft.")


def check_int(name: str, value, low: int = 1) -> None:
    """Raise `ValueError` naming ``name`` unless ``value`` is an int (not a bool) >= ``low``."""
    check_number(name, value, low, integer=True)


def check_draft_size(name: str, value) -> None:
    """Raise `ValueError` naming ``name`` unless ``value`` is ``None`` (the pipeline family's fixed default),
    ``"auto"`` or an int in ``[0, MAX_FED_TOKENS)`` (0: no drafts, AR's rounds)."""
    if value is None or value == AUTO:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"`{name}` must be None (the model family's default), \"auto\" (measured on the device) or an "
                         f"int >= 0 (0: no drafts), got {value!r}.")
    check_draft_budget(f"`{name}={value}`", value + 1)


class SpatialDecoderMixin(SchedulerMixin, ConfigMixin, abc.ABC):
    """Base class of the decoders. A subclass implements `plan` (what its round drafts); a decoder that drafts with
    heads says which in `heads_needed`.

    Class attributes:
        short_name (`str`): the decoder's name in `DECODERS` (the CLI's ``--decoder``, benchmark specs); a class that
            sets its own is a public decoder (`decoder_classes`), one that does not (a helper base) is not listed.
        lossless (`bool`): the method keeps the model's own distribution under exact acceptance (SSD: ``False``).
        acceptance_rule (`AcceptanceRule`): the rule candidates are accepted by; decoders that take
            ``acceptance=...`` set their own from the config (`resolve_acceptance`).
    """

    config_name = DECODER_CONFIG_NAME
    lossless: bool = True
    acceptance_rule: AcceptanceRule = EXACT
    order = 1  # diffusers scheduler attribute; unused here

    @property
    def is_exact(self) -> bool:
        """Output follows the model's own distribution exactly (greedy: token for token): a lossless method with an
        exact acceptance rule. ``False`` for SSD and for any decoder configured with a relaxed rule
        (``acceptance="lantern"``, ``"lantern++"``, ...); the benchmark labels such rows lossy."""
        return self.lossless and self.acceptance_rule.is_exact

    @property
    def supports_keyed_noise(self) -> bool:
        """Whether ``sampling_noise="keyed"`` applies: the decoder is exact, so testing each draft against the target's
        keyed sample (`keyed_sample`) keeps the model's distribution and commits AR's codes for a seed. ``False`` for a
        relaxed rule (LANTERN moves mass from neighbours a sampled point mass lacks) and SSD."""
        return self.is_exact

    @abc.abstractmethod
    def plan(self, draft_heads, layout: ImageTokenLayout, batch_size: int, device: torch.device, drawn: bool = False):
        """What the engine runs every round for this decoder (`spatial_pipelines.core.rounds`): a `ChainRound` (the
        newest code and a chain of drafts), a `TreeRound` (a tree of point-mass candidates its drafter drafts each
        round), or, for a decoder whose passes are known before the first, its schedule (`decoding_ssd.SSDSchedule`).
        The engine owns the target pass, the verification (keyed noise; ``drawn``: the drafts' own proposals are
        tested), the commit, the KV cache and the syncs.

        Args:
            draft_heads: the pipeline's draft heads (or ``None``).
            layout (`ImageTokenLayout`): the grid.
            batch_size (`int`): images per call (a drafter's buffers are per row).
            device (`torch.device`): where the rows are.
            drawn (`bool`): ``sampling_noise="drawn"``: the methods' own acceptance tests on keyed streams.
        """

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        name = cls.__dict__.get("short_name")
        known = next((c for c in subclasses(SpatialDecoderMixin) if c.__dict__.get("short_name") == name
                      and c.__qualname__ != cls.__qualname__), None) if name is not None else None
        if known is not None:
            raise ValueError(f"A decoder with the short name {name!r} exists already ({known.__qualname__}); give "
                             f"{cls.__qualname__} another `short_name`.")
        init = cls.__dict__.get("__init__")
        if init is not None:
            cls.__init__ = _decoder_init(init)

    @classmethod
    def extract_init_dict(cls, config_dict, **kwargs):
        """diffusers' config reading, where a swap starts from the new decoder's defaults: the config of *another*
        decoder (its ``_class_name`` names another `SpatialDecoderMixin` subclass) contributes none of its settings.
        ``top_k``, ``num_draft_tokens`` or ``acceptance`` mean different things in different decoders, so
        ``EagleDecoder.from_config(pipe.decoder.config, top_k=4)`` is ``EagleDecoder(top_k=4)``."""
        source = config_dict.get("_class_name")
        if source not in (None, cls.__name__) and source in {c.__name__ for c in subclasses(SpatialDecoderMixin)}:
            config_dict = {k: v for k, v in config_dict.items() if k.startswith("_") and k != "_use_default_values"}
        return super().extract_init_dict(config_dict, **kwargs)

    @classmethod
    def _get_compatibles(cls) -> list:
        """Every decoder can be built from any other decoder's config (``from_config`` swaps never warn)."""
        return subclasses(SpatialDecoderMixin)

    def save_pretrained(self, save_directory, push_to_hub: bool = False, **kwargs):
        """diffusers' ``save_pretrained`` (``decoder_config.json``); a path that is a file, or lies under one, is a
        `ValueError` naming it (diffusers raises an `AssertionError`)."""
        check_save_directory(save_directory)
        return super().save_pretrained(save_directory, push_to_hub=push_to_hub, **kwargs)

    @property
    def max_draft_tokens(self) -> int:
        """Largest number of positions one round feeds to the target (sizes the KV cache)."""
        return 1

    def max_fed_tokens(self, layout: ImageTokenLayout) -> int:
        """Most codes one round feeds the target on ``layout`` (end-of-row tokens not counted): what static-shape
        rounds pad every draft to. Default: `max_draft_tokens`; a decoder whose drafts depend on the grid overrides it."""
        return self.max_draft_tokens

    def state_bytes(self, batch_size: int, vocab_size: int) -> int:
        """Bytes of the per-row buffers a generation of ``batch_size`` images keeps over ``vocab_size`` codes (the
        pipeline's memory check, `SpatialARPipeline.memory_estimate`): by default three fp32 distributions per fed
        node (a window's ``q`` and noise, a tree's node distributions)."""
        return 3 * batch_size * self.max_draft_tokens * vocab_size * 4

    @property
    def sizes_from_pass_cost(self) -> bool:
        """Whether a draft size is ``"auto"``: the pipeline then calls `resolve_draft_size` before decoding."""
        return False

    #: The config key of this decoder's draft size (``None``: it has none). A decoder that has one sets it, with
    #: ``default_draft_size``: the size a config left at ``None`` drafts with where the pipeline family names none.
    draft_size_name: Optional[str] = None

    @property
    def sizes_from_family(self) -> bool:
        """Whether the draft size is left at ``None``: the pipeline then fixes it to its family's default
        (`SpatialARPipeline.default_draft_sizes`, the same on every machine) before decoding."""
        return False

    def use_default_size(self, size: int) -> None:
        """Draft with ``size`` where the config leaves the draft size at ``None`` (nothing happens otherwise)."""

    def resolve_draft_size(self, round_cost: Callable[[Any], float], batch_size: int = 1,
                           accepted: Optional[Dict[int, float]] = None) -> None:
        """Fix ``"auto"`` sizes from ``round_cost(tree)``, the measured seconds of a whole round per candidate tree
        (`RoundCost`: real rounds of the engine, the drafter's passes included), for calls of ``batch_size`` images;
        ``accepted`` (size -> mean accepted drafts per round, measured) replaces the acceptance prior where given."""

    def fixed_sizes(self) -> Dict[str, int]:
        """The config values that fix this decoder's ``"auto"`` sizes to the ones chosen (`resolve_draft_size`); ``{}``
        for a decoder without ``"auto"`` sizes."""
        return {}

    def heads_needed(self) -> Optional[HeadsNeed]:
        """What draft heads this decoder, as configured, drafts with (`HeadsNeed`: their kinds and offsets), or
        ``None`` when it needs none (the default)."""
        return None

    def _who(self, *names: str) -> str:
        """This decoder and the config values ``names``, for messages: ``"MedusaDecoder(num_heads=4)"``."""
        return f"{type(self).__name__}({', '.join(f'{n}={self.config[n]!r}' for n in names)})"

    def check_compatibility(self, layout: ImageTokenLayout, draft_heads=None) -> None:
        """Raise `ValueError` if this decoder cannot serve ``layout`` with ``draft_heads``: heads that do not provide
        what `heads_needed` asks for (`check_heads`). A decoder with more conditions extends it."""
        check_heads(self.heads_needed(), draft_heads)

def draft_through(backbone, decoder: SpatialDecoderMixin):
    """``backbone``, which ``decoder`` drafts through (its final norm, output head or image-token embedding); a
    `ValueError` when the caller passed none."""
    if backbone is None:
        raise ValueError(f"{type(decoder).__name__} drafts through the model's own output head: pass `backbone=` (the "
                         "family adapter, `pipe.backbone`) to what drafts, as the engine does.")
    return backbone


def decoder_classes() -> Dict[str, type]:
    """``{short name: decoder class}``: every loaded `SpatialDecoderMixin` subclass that sets its own ``short_name``
    (the CLI's ``--decoder`` choices, benchmark specs, `DECODERS`), in definition order."""
    found = {}
    for cls in subclasses(SpatialDecoderMixin):
        name = cls.__dict__.get("short_name")
        if name is not None:
            found.setdefault(name, cls)
    return found
