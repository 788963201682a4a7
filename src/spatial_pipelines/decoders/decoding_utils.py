"""The base of every speculative decoder: weight-free, configurable, swappable like a diffusers scheduler.

A decoder never calls the backbone. Each round the pipeline asks it for a `Draft` (what to feed the target),
runs the target forward over it, mixes CFG, and hands the logits back to `step`, which accepts tokens,
commits them to the `DecodingState` and says which fed positions stay in the KV cache.
"""

import abc
import copy
import dataclasses
import enum
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Dict, List, Optional, Sequence, Tuple

import torch
from diffusers import ConfigMixin, SchedulerMixin

from ..core.acceptance import EXACT, AcceptanceRule
from ..core.contracts import HeadsNeed, check_heads
from ..core.layout import ImageTokenLayout
from ..core.sampling import RandomSource, SamplingConfig
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
            # diffusers records a pipeline component under its class's top-level module and loads it only from
            # libraries it knows: a decoder defined elsewhere (a user's file, a test module) is recorded as
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


def check_draft_size(name: str, value, low: int = 1) -> None:
    """Raise `ValueError` naming ``name`` unless ``value`` is ``None`` (the pipeline family's fixed default),
    ``"auto"`` or an int in ``[low, MAX_FED_TOKENS)``."""
    if value is None or value == AUTO:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"`{name}` must be None (the model family's default), \"auto\" (measured on the device) or an "
                         f"int >= {low}, got {value!r}.")
    check_draft_budget(f"`{name}={value}`", value + 1)


@dataclass
class DecodingState:
    """Everything one generation carries between rounds.

    Args:
        layout (`ImageTokenLayout`): the image grid.
        sampling (`SamplingConfig`): how logits become the target distribution ``p``.
        random (`RandomSource`): per-row random numbers.
        prefix_length (`int`): sequence positions before the first image code (same for all rows).
        positions (`torch.LongTensor` `(H*W,)`): absolute sequence position of each raster code (EOL-aware).
        tokens (`torch.LongTensor` `(B, H*W)`): committed codes in raster order, ``-1`` where not yet decoded.
        acceptance_map (`torch.LongTensor` `(B, H*W)`): accepted length of the pass that committed each code.
        num_committed (`int`): codes committed so far (host-side). A state holds the rows that advance together: one
            image in a generation (every image of a batch has its own state and advances on its own, `RowBatch`),
            or several in a decoder's dry rounds (`RoundOverhead`).
        accepted_lengths (`list[torch.LongTensor]`): one ``(B,)`` tensor per target pass.
        num_draft_passes (`int`): forward passes of draft heads/models.

    A decoder that carries more between rounds subclasses this dataclass (typed fields with defaults, set in its
    ``init_state``) and names it in its ``state_class``, and lists each new field in one of ``row_fields`` (one entry
    per image row along dim 0: split with the rows), ``cfg_row_fields`` (one per target row: the image rows, then
    with CFG their unconditional twins) or ``shared_fields`` (the same for every row: tables, host-side counters).
    `split` reads these lists (over the class hierarchy) and refuses a state with a field in none of them.
    """

    row_fields: ClassVar[Tuple[str, ...]] = ("tokens", "acceptance_map", "accepted_lengths")
    cfg_row_fields: ClassVar[Tuple[str, ...]] = ()
    shared_fields: ClassVar[Tuple[str, ...]] = ("layout", "sampling", "random", "prefix_length", "positions",
                                                "num_committed", "num_draft_passes", "split_rows")

    layout: ImageTokenLayout
    sampling: SamplingConfig
    random: RandomSource
    prefix_length: int
    positions: torch.Tensor
    tokens: torch.Tensor
    acceptance_map: torch.Tensor
    num_committed: int = 0
    accepted_lengths: List[torch.Tensor] = field(default_factory=list)
    num_draft_passes: int = 0
    split_rows: bool = False

    @classmethod
    def _declared(cls, kind: str) -> set:
        return {name for klass in cls.__mro__ for name in klass.__dict__.get(kind, ())}

    def split(self, index: Sequence[int]) -> "DecodingState":
        """The state of the rows ``index`` alone (a new state; tensors are copied): what the loop makes when the
        rows of one state accept runs of different lengths (`RowsDiverged`), so that each part advances on its own.

        Row fields are indexed along dim 0 (``cfg_row_fields`` at the rows and their unconditional twins), shared
        fields are kept (a list or dict copied, so the parts do not write into one another's), the random source
        keeps only the rows' generators (`RandomSource.split`), and `_after_split` rebuilds what depends on the
        batch size. Raises `TypeError` naming a field the state class does not declare."""
        rows, shared, twins = self._declared("row_fields"), self._declared("shared_fields"), self._declared("cfg_row_fields")
        b = self.batch_size
        idx = torch.as_tensor(list(index), dtype=torch.long, device=self.tokens.device)
        values = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in rows:
                values[f.name] = split_rows(value, idx)
            elif f.name in twins:
                values[f.name] = split_rows(value, idx, twins_after=b)
            elif f.name in shared:
                values[f.name] = copy.copy(value) if isinstance(value, (list, dict)) else value
            else:
                raise TypeError(f"{type(self).__name__}.{f.name} is in none of `row_fields`, `cfg_row_fields` and "
                                "`shared_fields`: declare it, so that the state can be split by rows.")
        values["random"] = self.random.split(list(index))
        part = type(self)(**values)
        part._after_split(self, idx)
        return part

    def _after_split(self, parent: "DecodingState", index: torch.Tensor) -> None:
        """Rebuild, after `split`, the fields that depend on the number of rows (a subclass extends it)."""

    @property
    def num_remaining(self) -> int:
        return self.layout.num_tokens - self.num_committed

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def finished(self) -> bool:
        return self.num_committed >= self.layout.num_tokens

    @property
    def last_token(self) -> torch.Tensor:
        """The newest committed code ``(B,)``: the next round feeds it to the target."""
        return self.tokens[:, self.num_committed - 1]

    def commit(self, new_tokens: torch.Tensor, accepted: torch.Tensor) -> None:
        """Append ``new_tokens`` ``(B, n)`` (``n`` known on the host) committed by one target pass whose accepted
        length per row is ``accepted`` ``(B,)``."""
        n = new_tokens.shape[1]
        end = self.num_committed + n
        self.tokens[:, self.num_committed : end] = new_tokens
        self.acceptance_map[:, self.num_committed : end] = accepted[:, None]
        self.accepted_lengths.append(accepted)
        self.num_committed = end

    def report(self) -> Dict[str, float]:
        """Statistics of the generation particular to the decoder (`DecodingStats.decoder_stats`), read once after
        the last round. A decoder's state class overrides it; the base reports nothing."""
        return {}

    def commit_nothing(self) -> None:
        """Record a target pass that committed no code (a verification round of a lossy decoder)."""
        self.accepted_lengths.append(torch.zeros_like(self.tokens[:, 0]))


def split_rows(value, index: torch.Tensor, twins_after: Optional[int] = None):
    """``value`` at the rows ``index``: a tensor along dim 0 (with ``twins_after``, and twice that many rows, the
    rows and their twins ``twins_after`` rows later), a list of them item by item, an object with ``select_rows`` by
    it, a dataclass field by field; ``None`` stays ``None``."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if twins_after is not None and value.shape[0] == 2 * twins_after:
            index = torch.cat([index, index + twins_after])
        return value.index_select(0, index.to(value.device))
    if isinstance(value, list):
        return [split_rows(v, index, twins_after) for v in value]
    if hasattr(value, "select_rows"):
        if twins_after is not None and value.num_rows == 2 * twins_after:
            index = torch.cat([index, index + twins_after])
        return value.select_rows(index)
    if dataclasses.is_dataclass(value):
        return dataclasses.replace(value, **{f.name: split_rows(getattr(value, f.name), index)
                                             for f in dataclasses.fields(value) if isinstance(getattr(value, f.name), torch.Tensor)})
    raise TypeError(f"Cannot split a {type(value).__name__} by rows.")


class RowsDiverged(Exception):
    """Raised by a decoder step, before it changes its state, when the rows of a state that may be split
    (``DecodingState.split_rows``) accepted runs of different lengths. The loop splits the state by run length
    (`DecodingState.split`) and steps each part again with the verification already drawn (``acceptance``, its
    rows indexed), so every row commits its own run and no random number is drawn twice.

    Args:
        acceptance: the verification of every row (a `TreeAcceptance`).
        runs (`list[int]`): per row, the codes its run commits (host ints).
    """

    def __init__(self, acceptance, runs: List[int]):
        super().__init__(f"rows accepted runs of different lengths: {runs}")
        self.acceptance, self.runs = acceptance, runs


class DraftKind(enum.Enum):
    """What shape a round's draft has; the loop reads it once per round (`Draft.per_row`), never a tensor's rank.

    - ``CHAIN``: a window of drafts one after another, node ``i`` at depth ``i`` (AR's single code, SJD's window,
      SSD's block), the same positions for every batch row.
    - ``TREE``: one tree shape shared by every batch row (Medusa, Hawk, SJD-PAC's candidates).
    - ``ROW_TREES``: one tree per batch row (EAGLE-2, ADT-Tree), grown on the device.
    """

    CHAIN = "chain"
    TREE = "tree"
    ROW_TREES = "row_trees"


@dataclass
class Draft:
    """What the target verifies in one round.

    Args:
        input_ids (`torch.LongTensor` `(B, T)`): codes fed to the target (the last committed code first).
        position_ids (`torch.LongTensor`): their absolute sequence positions, `(T,)` for a shared draft (``CHAIN``,
            ``TREE``), `(B, T)` for ``ROW_TREES``.
        attention_mask (`torch.BoolTensor`): which fed tokens see which (causal for a chain, the tree mask for a
            tree): `(T, T)` for a shared draft, `(B, T, T)` for ``ROW_TREES``.
        kind (`DraftKind`): the draft's shape.
        depths (`tuple[int]`): host-side depth of each fed node of a shared draft (node ``i`` is the code
            ``depths[i]`` raster positions after the newest committed one, which is depth 0), required for
            ``CHAIN`` and ``TREE``: with it the loop places end-of-row tokens without reading ``position_ids``
            from the device. ``None`` for ``ROW_TREES``.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    kind: DraftKind
    depths: Optional[Tuple[int, ...]] = None

    def __post_init__(self):
        if not isinstance(self.kind, DraftKind):
            raise TypeError(f"`Draft.kind` must be a DraftKind, got {self.kind!r}.")
        if (self.depths is None) != self.per_row:
            raise ValueError(f"A {self.kind.value} draft {'has no' if self.per_row else 'needs its'} host-side `depths`.")

    @property
    def per_row(self) -> bool:
        """Each batch row feeds its own tree: positions ``(B, T)`` and mask ``(B, T, T)``."""
        return self.kind is DraftKind.ROW_TREES

    def select_rows(self, index: torch.Tensor) -> "Draft":
        """The draft of the rows ``index`` (a group of rows split after its verification)."""
        if not self.per_row:
            return dataclasses.replace(self, input_ids=self.input_ids[index])
        return dataclasses.replace(self, input_ids=self.input_ids[index], position_ids=self.position_ids[index],
                                   attention_mask=self.attention_mask[index])


@dataclass
class StepOutput:
    """What a decoder step decided.

    Args:
        num_accepted (`int`): codes committed this round (per row of the state).
        keep_indices (`torch.LongTensor` `(B, n)`, *optional*): per row, the fed positions whose KV stays in the
            cache, in order (an accepted tree path). ``None`` keeps every fed position.
        keep_length (`int`, *optional*): keep only the first ``keep_length`` fed positions (a prefix: the cache
            is cropped, nothing is copied); ``0`` rolls the whole pass back. Exclusive with ``keep_indices``.
    """

    num_accepted: int
    keep_indices: Optional[torch.Tensor] = None
    keep_length: Optional[int] = None


class SpatialDecoderMixin(SchedulerMixin, ConfigMixin, abc.ABC):
    """Base class of the decoders. Subclasses implement `propose` and `step`, and may extend `init_state`; a decoder
    that drafts with heads says which in `heads_needed`.

    Class attributes:
        short_name (`str`): the decoder's name in `DECODERS` (the CLI's ``--decoder``, benchmark specs); a class that
            sets its own is a public decoder (`decoder_classes`), one that does not
            (a helper base, a variant) is not listed.
        lossless (`bool`): the method keeps the model's own distribution under exact acceptance (SSD: ``False``).
        acceptance_rule (`AcceptanceRule`): the rule candidates are accepted by; decoders that take
            ``acceptance=...`` set their own from the config (`resolve_acceptance`).
    """

    config_name = DECODER_CONFIG_NAME
    state_class: type = DecodingState  # the typed state this decoder carries between rounds
    lossless: bool = True
    acceptance_rule: AcceptanceRule = EXACT
    uses_all_rows: bool = False  # `step` gets the hidden states of every row, CFG's unconditional ones included
    separate_rows: bool = False  # every image keeps its own state from the start (`RowBatch`), not only once they diverge
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
        keyed sample (`target_probs`) keeps the model's distribution and commits AR's codes for a seed. ``False`` for a
        relaxed rule (LANTERN moves mass from a draft's neighbours, which a sampled point mass does not have) and for
        SSD; they draw their noise from the generators."""
        return self.is_exact

    def chain_window(self, drawn: bool = False) -> Optional[int]:
        """Drafts per row of a round that runs whole on the device (`spatial_pipelines.pipelines.device_chain`), for a
        decoder that feeds its newest code and a chain of drafts after it, commits the drafts equal to the target's
        keyed samples (``drawn``: the drafts a keyed uniform accepts against their proposals, speculative sampling),
        and redraws the rest from the pass (AR: 0). ``None`` (the default): the decoder's own `propose` and `step` run,
        in row groups."""
        return None

    def chain_drafting(self, draft_heads=None) -> Dict[str, Any]:
        """How a chain round drafts what it does not redraw (`device_chain.ChainLoop`): ``init`` (``"above"``: the code
        one row above, ``"left"``: the draft before it, ``"random"``: a keyed uniform draw, ``"heads"``: a draft head's guess) and ``anchor`` (the first
        draft pulled onto the newest code where its proposal rates it below that code) and ``continuation`` (SJD-PAC's:
        drafts that are no race of their position's noise tested anew every pass); the last two are read where
        proposals are kept (drawn noise or a relaxed rule). With ``init="heads"`` also ``guess``:
        ``guess(backbone, hidden (B, n, D), codes (B, n))`` gives the logits ``(B, n, V)`` of the codes one row below
        ``codes`` from the pre-norm hidden states that predicted them (``draft_heads``: the pipeline's)."""
        return {"init": "above", "anchor": False, "continuation": False}

    def device_drafter(self, draft_heads, layout, batch_size: int, device):
        """What drafts the tree in a round that runs whole on the device under keyed noise, for a decoder whose
        siblings are distinct codes (or ``-1``: none): a `HeadDrafter` for ``batch_size`` rows (a static tree,
        `device_tree.HeadTreeLoop`), or a drafter with ``per_row_trees`` that grows each row's tree
        (`device_tree.DynamicTreeLoop`, `EagleDrafter`); either has ``tree_depth`` and ``nodes_per_depth`` (host ints,
        at most). The pipeline asks when the acceptance is exact, or relaxed (LANTERN: the candidates are verified as
        point masses). ``None`` (the default): the decoder's own `propose` and `step` run, in row groups."""
        return None

    def device_schedule(self, layout) -> Optional[Any]:
        """For a decoder whose passes do not depend on what they accept (SSD): every target pass after the prompt's,
        known before the first (`decoding_ssd.SSDSchedule`), which a loop on the device runs in lockstep over the rows
        (`spatial_pipelines.pipelines.device_ssd.SSDLoop`). ``None`` (the default): the decoder has no such
        schedule."""
        return None

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

    uses_drafter_passes: bool = False  # drafts with passes of a drafter model (EAGLE-2): "auto" sizes weigh their cost

    def resolve_draft_size(self, pass_cost: Callable[[int], float], draft_pass_cost: Optional[Callable[[int], float]] = None,
                           round_overhead: Optional[Callable[[Any], float]] = None, batch_size: int = 1) -> None:
        """Fix ``"auto"`` sizes from ``pass_cost(T)``, the measured seconds of a target pass over ``T`` fed tokens,
        and what a round costs outside it: ``round_overhead(tree)`` (`RoundOverhead`: the decoder's own work per
        candidate tree) or ``draft_pass_cost(T)`` (decoders that ``uses_drafter_passes``: a drafter pass over ``T``
        nodes), for calls of ``batch_size`` images (each row advances on its own; the pass over all of them and every
        row's own work are what a round costs)."""

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

    def init_state(
        self,
        layout: ImageTokenLayout,
        sampling: SamplingConfig,
        random: RandomSource,
        batch_size: int,
        prefix_length: int,
        device: torch.device,
        backbone: Any = None,
    ) -> DecodingState:
        """A fresh ``self.state_class`` (a `DecodingState`); subclasses fill their own fields. ``backbone`` (the family
        adapter) is for tables built once per generation from the model (LANTERN's codebook neighbours, SJD's vocabulary
        size); the state does not keep it."""
        n = layout.num_tokens
        if not (isinstance(self.state_class, type) and issubclass(self.state_class, DecodingState)):
            raise TypeError(f"{type(self).__name__}.state_class must be a DecodingState subclass, got {self.state_class!r}.")
        return self.state_class(
            layout=layout,
            sampling=sampling,
            random=random,
            prefix_length=prefix_length,
            positions=layout.sequence_position(torch.arange(n, device=device), prefix_length),
            tokens=torch.full((batch_size, n), -1, dtype=torch.long, device=device),
            acceptance_map=torch.zeros(batch_size, n, dtype=torch.long, device=device),
        )

    @abc.abstractmethod
    def propose(self, state: DecodingState, draft_heads=None, backbone=None) -> Draft:
        """The `Draft` the target verifies next round.

        ``backbone`` is the family adapter, passed by the loop: decoders whose drafts go through the model's own
        final norm, output head or image-token embedding (`draft_through`) use those; none calls its forward."""

    @abc.abstractmethod
    def step(
        self,
        logits: torch.Tensor,
        hidden_states: torch.Tensor,
        draft: Optional[Draft],
        state: DecodingState,
        draft_heads=None,
        backbone=None,
    ) -> StepOutput:
        """Accept tokens from the target's CFG-mixed ``logits`` ``(B, T, V)`` (fp32) over the fed positions.

        ``draft is None`` for the prefill pass: ``logits``/``hidden_states`` are those of the last prompt position.
        ``hidden_states`` ``(B, T, D)`` are the conditional rows' pre-norm last hidden states. ``backbone`` as in
        `propose` (a step that drafts for the next round, SJD's ``init="heads"``, goes through its head).
        """


def draft_through(backbone, decoder: SpatialDecoderMixin):
    """``backbone``, which ``decoder`` drafts through (its final norm, output head or image-token embedding); a
    `ValueError` when the caller passed none."""
    if backbone is None:
        raise ValueError(f"{type(decoder).__name__} drafts through the model's own output head: pass `backbone=` (the "
                         "family adapter, `pipe.backbone`) to its `propose` and `step`, as the pipeline does.")
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
