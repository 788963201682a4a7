"""The base of every speculative decoder: weight-free, configurable, swappable like a diffusers scheduler.

A decoder never calls the backbone. Each round the pipeline asks it for a `Draft` (what to feed the target),
runs the target forward over it, mixes CFG, and hands the logits back to `step`, which accepts tokens,
commits them to the `DecodingState` and says which fed positions stay in the KV cache.
"""

import abc
import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Tuple

import torch
from diffusers import ConfigMixin, SchedulerMixin

from ..core.acceptance import EXACT, AcceptanceLike, AcceptanceRule, fold_legacy_acceptance, resolve_acceptance
from ..core.verification import verify_tree
from ..core.layout import ImageTokenLayout
from ..core.sampling import RandomSource, SamplingConfig, logits_to_probs, sample_from_probs
from ..core.tree import DraftTree, tree_from_parents
from ..utils import check_number, subclasses

DECODER_CONFIG_NAME = "decoder_config.json"
AUTO = "auto"
#: Draft sizes ``"auto"`` chooses from (nodes after the root).
DRAFT_SIZE_CANDIDATES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64)
#: ``"auto"`` keeps the smallest draft whose predicted codes per second are within this share of the best size's.
AUTO_RATE_TOLERANCE = 0.03


def _decoder_init(init, takes_acceptance: bool):
    """A decoder's ``__init__`` that records its class in the config (``_class_name``: a swap to another decoder starts
    from that decoder's defaults, `SpatialDecoderMixin.extract_init_dict`) and, for decoders that take ``acceptance``,
    folds the earlier ``lantern_k`` / ``lantern_delta`` / ``lantern_lambda`` keywords into it (`fold_legacy_acceptance`)
    before the config is registered."""

    @functools.wraps(init)
    def wrapped(self, *args, **kwargs):
        init(self, *args, **(fold_legacy_acceptance(kwargs) if takes_acceptance else kwargs))
        self.register_to_config(_class_name=type(self).__name__)

    return wrapped


def check_int(name: str, value, low: int = 1) -> None:
    """Raise `ValueError` naming ``name`` unless ``value`` is an int (not a bool) >= ``low``."""
    check_number(name, value, low, integer=True)


def check_draft_size(name: str, value, low: int = 1) -> None:
    """Raise `ValueError` naming ``name`` unless ``value`` is ``"auto"`` or an int >= ``low``."""
    if value == AUTO:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"`{name}` must be \"auto\" or an int >= {low}, got {value!r}.")


def _fit_affine(seconds: dict) -> Callable[[int], float]:
    """``a + b * n`` (``b >= 0``) through ``{n: seconds}`` by least squares: a decoder's walk grows about linearly with
    its tree, and the fit spreads one size's timing noise over all of them."""
    n = torch.tensor(sorted(seconds), dtype=torch.float64)
    y = torch.tensor([seconds[k] for k in sorted(seconds)], dtype=torch.float64)
    slope = 0.0 if len(n) < 2 else max(0.0, float(((n - n.mean()) * (y - y.mean())).sum() / ((n - n.mean()) ** 2).sum()))
    base = float(y.mean() - slope * n.mean())
    return lambda k: base + slope * k


def node_priors(tree: DraftTree, first_rate: float, sibling_decay: float) -> List[float]:
    """Prior probability that each node lies on the accepted path: the sibling tried ``r``-th is accepted with
    ``first_rate * sibling_decay**r`` once its parent is reached and its earlier siblings failed (root: 1)."""
    parents = tree.parents.tolist()
    prior, tried, seen = [1.0] * len(parents), {}, {}
    for i in range(1, len(parents)):
        p = parents[i]
        r = seen.get(p, 0)
        seen[p] = r + 1
        rate = first_rate * sibling_decay**r
        prior[i] = prior[p] * tried.get(p, 1.0) * rate
        tried[p] = tried.get(p, 1.0) * (1.0 - rate)
    return prior


def best_subtree(tree: DraftTree, num_nodes: int, first_rate: float, sibling_decay: float) -> Tuple[DraftTree, float]:
    """The ``num_nodes`` draft nodes of ``tree`` most likely to be accepted (prefix-closed: a child is never likelier
    than its parent) and the expected number of accepted drafts under the prior of `node_priors`."""
    prior = node_priors(tree, first_rate, sibling_decay)
    keep = sorted(sorted(range(1, len(prior)), key=lambda i: (-prior[i], i))[:num_nodes])
    index = {0: 0, **{old: new + 1 for new, old in enumerate(keep)}}
    parents = [-1] + [index[tree.parents[i].item()] for i in keep]
    ranks = [-1] + [tree.ranks[i].item() for i in keep]
    return tree_from_parents(parents, ranks), sum(prior[i] for i in keep)


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
        num_committed (`int`): codes committed per row so far (host-side; rows advance together).
        accepted_lengths (`list[torch.LongTensor]`): one ``(B,)`` tensor per target pass.
        num_draft_passes (`int`): forward passes of draft heads/models.
        backbone: the family adapter (its ``final_norm``, ``output_head``, ``embed_image_tokens``, ``codebook``),
            for decoders whose drafts go through the backbone's own head; decoders never call its forward.
        fed_size (`int`, *optional*): with static shapes, the number of slots every round feeds the target (the loop
            pads drafts to it); ``None``: each round feeds what its draft holds.
        fed_slots (`int`), padded_slots (`int`): slots fed to the target by the rounds, and how many were padding.
        row_potential (`torch.Tensor`, *optional*): ``()`` codes the rows of a batch would have committed alone, summed
            over verification rounds (each row's accepted run and its bonus); ``batch_committed`` (`int`): what they
            committed together (rows advance by the shortest row's run).

    A decoder that carries more between rounds subclasses this dataclass (typed fields with defaults, set in its
    ``init_state``) and names it in its ``state_class``.
    """

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
    backbone: Any = None
    fed_size: Optional[int] = None
    fed_slots: int = 0
    padded_slots: int = 0
    row_potential: Optional[torch.Tensor] = None
    batch_committed: int = 0

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

    def commit_nothing(self) -> None:
        """Record a target pass that committed no code (a verification round of a lossy decoder)."""
        self.accepted_lengths.append(torch.zeros_like(self.tokens[:, 0]))


@dataclass
class Draft:
    """What the target verifies in one round.

    Args:
        input_ids (`torch.LongTensor` `(B, T)`): codes fed to the target (the last committed code first).
        position_ids (`torch.LongTensor` `(T,)` or `(B, T)`): their absolute sequence positions.
        attention_mask (`torch.BoolTensor` `(T, T)` or `(B, T, T)`): which fed tokens see which (causal for a
            chain, the tree mask for a tree).
        depths (`tuple[int]`, *optional*): host-side depth of each fed node when every row feeds the same nodes
            (node ``i`` is the code ``depths[i]`` raster positions after the newest committed one, which is depth 0).
            With it the loop places end-of-row tokens without reading ``position_ids`` from the device.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    depths: Optional[Tuple[int, ...]] = None


@dataclass
class StepOutput:
    """What a decoder step decided.

    Args:
        num_accepted (`int`): codes committed this round (per row; rows advance together).
        keep_indices (`torch.LongTensor` `(n,)` or `(B, n)`, *optional*): fed positions whose KV stays in the
            cache, in order (an accepted tree path). ``None`` keeps every fed position.
        keep_length (`int`, *optional*): keep only the first ``keep_length`` fed positions (a prefix: the cache
            is cropped, nothing is copied); ``0`` rolls the whole pass back. Exclusive with ``keep_indices``.
    """

    num_accepted: int
    keep_indices: Optional[torch.Tensor] = None
    keep_length: Optional[int] = None


class SpatialDecoderMixin(SchedulerMixin, ConfigMixin, abc.ABC):
    """Base class of the decoders. Subclasses implement `propose` and `step`, and may extend `init_state`.

    Class attributes:
        lossless (`bool`): the method keeps the model's own distribution under exact acceptance (SSD: ``False``).
        draft_heads_class (`str`, *optional*): name of the draft-head class the decoder needs.
        acceptance_rule (`AcceptanceRule`): the rule candidates are accepted by; decoders that take
            ``acceptance=...`` set their own from the config (`resolve_acceptance`).
    """

    config_name = DECODER_CONFIG_NAME
    state_class: type = DecodingState  # the typed state this decoder carries between rounds
    lossless: bool = True
    acceptance_rule: AcceptanceRule = EXACT
    uses_all_rows: bool = False  # `step` gets the hidden states of every row, CFG's unconditional ones included
    draft_heads_class: Optional[str] = None
    order = 1  # diffusers scheduler attribute; unused here

    @property
    def is_exact(self) -> bool:
        """Output follows the model's own distribution exactly (greedy: token for token): a lossless method with an
        exact acceptance rule. ``False`` for SSD and for any decoder configured with a relaxed rule
        (``acceptance="lantern"``, ``"lantern++"``, ...); the benchmark labels such rows lossy."""
        return self.lossless and self.acceptance_rule.is_exact

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is not None:
            cls.__init__ = _decoder_init(init, takes_acceptance="acceptance" in inspect.signature(init).parameters)

    @classmethod
    def extract_init_dict(cls, config_dict, **kwargs):
        """diffusers' config reading, with two rules of ours:

        - **A swap starts from the new decoder's defaults.** The config of *another* decoder (its ``_class_name``
          names another `SpatialDecoderMixin` subclass) contributes none of its settings: ``top_k``,
          ``num_draft_tokens`` or ``acceptance`` mean different things in different decoders, so
          ``EagleDecoder.from_config(pipe.decoder.config, top_k=4)`` is ``EagleDecoder(top_k=4)``.
        - **Earlier configs load.** The earlier ``lantern_*`` keys of a saved config fold into ``acceptance`` (with a
          `FutureWarning`): configs saved by earlier versions load the same rule.
        """
        source = config_dict.get("_class_name")
        if source not in (None, cls.__name__) and source in {c.__name__ for c in subclasses(SpatialDecoderMixin)}:
            config_dict = {k: v for k, v in config_dict.items() if k.startswith("_") and k != "_use_default_values"}
        folded = fold_legacy_acceptance(dict(config_dict))
        if folded.get("acceptance") != config_dict.get("acceptance"):  # now set by the folded keys, not a default
            folded["_use_default_values"] = [k for k in folded.get("_use_default_values", []) if k != "acceptance"]
        return super().extract_init_dict(folded, **fold_legacy_acceptance(kwargs))

    @classmethod
    def _get_compatibles(cls) -> list:
        """Every decoder can be built from any other decoder's config (``from_config`` swaps never warn)."""
        return subclasses(SpatialDecoderMixin)

    @property
    def max_draft_tokens(self) -> int:
        """Largest number of positions one round feeds to the target (sizes the KV cache)."""
        return 1

    def max_fed_tokens(self, layout: ImageTokenLayout) -> int:
        """Most codes one round feeds the target on ``layout`` (end-of-row tokens not counted): what static-shape
        rounds pad every draft to. Default: `max_draft_tokens`; a decoder whose drafts depend on the grid overrides it."""
        return self.max_draft_tokens

    @property
    def sizes_from_pass_cost(self) -> bool:
        """Whether a draft size is ``"auto"``: the pipeline then calls `resolve_draft_size` before decoding."""
        return False

    uses_drafter_passes: bool = False  # drafts with passes of a drafter model (EAGLE-2): "auto" sizes weigh their cost

    def resolve_draft_size(self, pass_cost: Callable[[int], float], draft_pass_cost: Optional[Callable[[int], float]] = None,
                           round_overhead: Optional[Callable[[Any], float]] = None) -> None:
        """Fix ``"auto"`` sizes from ``pass_cost(T)``, the measured seconds of a target pass over ``T`` fed tokens,
        and what a round costs outside it: ``round_overhead(tree)`` (`RoundOverhead`: the decoder's own work per
        candidate tree) or ``draft_pass_cost(T)`` (decoders that ``uses_drafter_passes``: a drafter pass over ``T``
        nodes)."""

    def check_compatibility(self, layout: ImageTokenLayout, draft_heads=None) -> None:
        """Raise `ValueError` if this decoder cannot serve ``layout`` with ``draft_heads``."""
        if self.draft_heads_class is not None and (
            draft_heads is None or self.draft_heads_class not in {c.__name__ for c in type(draft_heads).__mro__}
        ):  # by name: decoders never import heads (docs/design.md, "Architecture"); subclasses of the class qualify
            found = "none" if draft_heads is None else type(draft_heads).__name__
            raise ValueError(
                f"`decoder` {type(self).__name__} needs `draft_heads` of class {self.draft_heads_class}, found {found}. "
                "Load them with `pipe.load_draft_heads(path_or_repo)`."
            )

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
        """A fresh ``self.state_class`` (a `DecodingState`); subclasses fill their own fields."""
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
            backbone=backbone,
        )

    @abc.abstractmethod
    def propose(self, state: DecodingState, draft_heads=None) -> Draft:
        """The `Draft` the target verifies next round."""

    @abc.abstractmethod
    def step(
        self,
        logits: torch.Tensor,
        hidden_states: torch.Tensor,
        draft: Optional[Draft],
        state: DecodingState,
        draft_heads=None,
    ) -> StepOutput:
        """Accept tokens from the target's CFG-mixed ``logits`` ``(B, T, V)`` (fp32) over the fed positions.

        ``draft is None`` for the prefill pass: ``logits``/``hidden_states`` are those of the last prompt position.
        ``hidden_states`` ``(B, T, D)`` are the conditional rows' pre-norm last hidden states.
        """


@dataclass
class TreeState(DecodingState):
    """The state of tree decoders.

    Args:
        tree (`DraftTree`): the decoder's static tree on the generation's device (copied once per generation).
        host_depths (`tuple[int]`): its node depths on the host (`Draft.depths`).
        hidden (`torch.Tensor` `(B, D)`): pre-norm hidden state that predicted the newest committed code.
        node_tokens (`torch.LongTensor` `(B, T)`): the tree fed this round (``-1``: slot not offered).
        accepted_path (`torch.LongTensor` `(B, n)`): the fed nodes whose outputs predicted the ``n`` codes the last
            round committed (the root first).
        rows (`torch.LongTensor` `(B,)`): row indices, built once.
        slots (`torch.LongTensor` `(max_draft_tokens,)`): ``0, 1, 2, ...``, built once: a path through the first slots.
        node_depth (`torch.LongTensor` `(T - 1,)`), node_rank (`torch.LongTensor` `(T - 1,)`): the head (or pool) and
            candidate rank (or slot) of every draft node, built once.
        neighbours (`torch.Tensor` `(V, k)`, *optional*): the codebook neighbour table of a relaxed acceptance rule
            (built once per backbone and cached there).
        head_indices (`tuple`, *optional*): ``(horizontal, vertical)``: the indices of the heads the decoder runs,
            looked up on the first round.
    """

    tree: Optional[DraftTree] = None
    host_depths: Optional[Tuple[int, ...]] = None
    hidden: Optional[torch.Tensor] = None
    node_tokens: Optional[torch.Tensor] = None
    accepted_path: Optional[torch.Tensor] = None
    rows: Optional[torch.Tensor] = None
    slots: Optional[torch.Tensor] = None
    node_depth: Optional[torch.Tensor] = None
    node_rank: Optional[torch.Tensor] = None
    neighbours: Optional[torch.Tensor] = None
    head_indices: Optional[Tuple[List[int], List[int]]] = None


class TreeDecoderMixin:
    """What tree decoders share: drafting a static tree of head candidates and exact verification.

    A subclass calls ``self._set_tree(full_tree, size)`` in ``__init__``: ``full_tree`` is the largest tree it drafts,
    ``size`` an int (keep the ``size`` likeliest nodes, or all of them with ``None``) or ``"auto"``: the pipeline then
    measures the pass cost ``c(T)`` on its device and `resolve_draft_size` keeps the node count that maximises the
    expected codes per second, ``(1 + E[accepted]) / c(1 + nodes)``, under the prior `node_priors` with the class's
    ``acceptance_prior`` ``(first_rate, sibling_decay)``. Its ``state_class`` must be a `TreeState`.
    """

    state_class = TreeState
    acceptance_prior: Tuple[float, float] = (0.5, 0.5)
    distinct_siblings: bool = False  # True when the decoder never offers one code twice among siblings

    def _set_acceptance(self, acceptance: AcceptanceLike) -> None:
        """Resolve the config's acceptance rule (checked: a `ValueError` names a bad argument) and store it in the
        config as JSON (`AcceptanceRule.to_config`): a rule object saves and loads like its dict."""
        self.acceptance_rule = resolve_acceptance(acceptance)
        self.register_to_config(acceptance=self.acceptance_rule.to_config())

    def _set_tree(self, full_tree: DraftTree, size) -> None:
        self._full_tree, self._size = full_tree, size
        self._resolved_for = None
        nodes = full_tree.num_nodes - 1
        self.tree = self._subtree(nodes if size in (None, AUTO) else min(size, nodes))

    def _subtree(self, num_nodes: int) -> DraftTree:
        if num_nodes >= self._full_tree.num_nodes - 1:
            return self._full_tree
        return self._sized_tree(num_nodes)[0]

    def _sized_tree(self, num_nodes: int) -> Tuple[DraftTree, float]:
        """The tree of ``num_nodes`` draft nodes this decoder feeds, and its expected accepted drafts under the prior."""
        if num_nodes >= self._full_tree.num_nodes - 1:
            return self._full_tree, sum(node_priors(self._full_tree, *self.acceptance_prior)[1:])
        return best_subtree(self._full_tree, num_nodes, *self.acceptance_prior)

    @property
    def sizes_from_pass_cost(self) -> bool:
        return self._size == AUTO

    def resolve_draft_size(self, pass_cost: Callable[[int], float], draft_pass_cost: Optional[Callable[[int], float]] = None,
                           round_overhead: Optional[Callable[[DraftTree], float]] = None) -> None:
        resolved = self._resolved_for
        if self._size != AUTO or (resolved is not None and all(a is b for a, b in zip(resolved, (pass_cost, draft_pass_cost, round_overhead)))):
            return  # once per pipeline cost model
        candidates = [self._sized_tree(n) for n in self._draft_sizes()]  # (tree, expected accepted drafts)
        target = pass_cost
        if hasattr(pass_cost, "measure"):  # a PassCost: measure every size interleaved, in one go, and fit a curve
            sizes = sorted({tree.num_nodes for tree, _ in candidates})
            pass_cost.measure(sizes)
            target = pass_cost.fitted(sizes)  # through these sizes only: what another decoder measured changes nothing
        if round_overhead is not None:  # measured per tree: the decoder's drafting and walk
            trees = [tree for tree, _ in candidates]
            measured = round_overhead.measure(trees) if hasattr(round_overhead, "measure") else {t.num_nodes: round_overhead(t) for t in trees}
            outside = _fit_affine(measured)
            cost = [target(tree.num_nodes) + outside(tree.num_nodes) for tree in trees]
        else:
            cost = [target(tree.num_nodes) + self._drafting_seconds(tree, draft_pass_cost) for tree, _ in candidates]
        rates = [(tree, (1.0 + accepted) / seconds) for (tree, accepted), seconds in zip(candidates, cost)]  # smallest first
        best = max(rate for _, rate in rates)
        # the smallest draft within AUTO_RATE_TOLERANCE of the best: near the optimum the predicted rate is flat, so
        # the argmax would follow what timing noise is left in the fitted curves from run to run
        self.tree = next(tree for tree, rate in rates if rate >= (1.0 - AUTO_RATE_TOLERANCE) * best)
        self._resolved_for = (pass_cost, draft_pass_cost, round_overhead)

    def _drafting_seconds(self, tree: DraftTree, draft_pass_cost: Optional[Callable[[int], float]]) -> float:
        """Seconds of drafter passes a round with ``tree`` adds to the target pass (none here: head passes are a few
        small matmuls; decoders that ``uses_drafter_passes`` override this)."""
        return 0.0

    def _draft_sizes(self) -> List[int]:
        """The sizes ``"auto"`` weighs (arguments of `_sized_tree`)."""
        full = self._full_tree.num_nodes - 1
        return [c for c in DRAFT_SIZE_CANDIDATES if c < full] + [full]

    @property
    def max_draft_tokens(self) -> int:
        return self.tree.num_nodes

    def init_state(self, layout, sampling, random, batch_size, prefix_length, device, backbone=None) -> TreeState:
        state = super().init_state(layout, sampling, random, batch_size, prefix_length, device, backbone)
        if not isinstance(state, TreeState):
            raise TypeError(f"{type(self).__name__}.state_class must subclass TreeState, got {type(state).__name__}.")
        state.tree = self.tree.to(device)  # once per generation, not once per round
        state.host_depths = tuple(self.tree.depths.tolist())  # host copy, read once per generation (EOL placement)
        state.rows = torch.arange(batch_size, device=device)
        state.slots = torch.arange(self.max_draft_tokens, device=device)  # a path is at most this many nodes long
        state.node_depth, state.node_rank = state.tree.depths[1:] - 1, state.tree.ranks[1:]
        if self.acceptance_rule.num_neighbours:
            if backbone is None:
                raise ValueError(f"`acceptance={self.acceptance_rule.name!r}` needs the backbone's VQ codebook.")
            state.neighbours = backbone.code_neighbours(self.acceptance_rule.num_neighbours)
        return state

    def _heads_logits(self, state: TreeState, draft_heads):
        """Logits of the heads this decoder uses (``required_horizontal_offsets`` / ``required_vertical_offsets``,
        in that order) from the hidden state that predicted the newest committed code. Horizontal head ``i`` drafts
        depth ``i + 1``, so only the first ``tree.max_depth`` run: a shallower ("auto"-sized) tree drafts nothing
        from the others, and their weights are not read every round."""
        if state.head_indices is None:  # looked up on the first round, not every round
            h = [draft_heads.horizontal_index(o) for o in self.required_horizontal_offsets()][: state.tree.max_depth]
            v = [draft_heads.vertical_index(o) for o in self.required_vertical_offsets()]
            state.head_indices = (h, v)
        h, v = state.head_indices
        feats_h, feats_v = draft_heads(state.backbone.final_norm(state.hidden), h, v)  # (B, Hh, D), (B, Hv, D)
        state.num_draft_passes += 1
        feats = torch.cat([feats_h, feats_v], 1) if v else feats_h  # one output-head pass for both kinds (per-op cost)
        logits = state.backbone.output_head(feats)  # (B, Hh + Hv, V)
        return logits[:, : len(h)], logits[:, len(h) :]  # (B, Hh, V), (B, Hv, V)

    def _tree_draft(self, state: TreeState, node_tokens: torch.Tensor) -> Draft:
        """Feed ``node_tokens`` ``(B, T)`` (root first; ``-1`` for slots a row does not offer) at their positions
        with the tree mask."""
        tree = state.tree
        first = state.prefix_length + state.layout.sequence_offset(state.num_committed - 1)  # host int
        if state.layout.has_eol or state.num_committed - 1 + tree.max_depth >= state.layout.num_tokens:
            last = state.layout.num_tokens - 1
            index = (state.num_committed - 1 + tree.depths).clamp_max(last)  # nodes past the grid are never committed
            position_ids = state.positions[index]
        else:  # no EOL and inside the grid: positions are the root's plus the depths (one add, no gather)
            position_ids = tree.depths + first
        state.node_tokens = node_tokens
        return Draft(
            input_ids=node_tokens.clamp_min(0),  # an empty slot is fed as code 0 and never accepted
            position_ids=position_ids,
            attention_mask=tree.attention_mask,
            depths=state.host_depths if position_ids.dim() == 1 else None,
        )

    def _prefill_step(self, logits, hidden_states, state: TreeState) -> StepOutput:
        token = sample_from_probs(logits_to_probs(logits[:, -1], state.sampling), state.random)  # (B,)
        state.hidden = hidden_states[:, -1]
        state.commit(token[:, None], torch.ones_like(token))
        return StepOutput(num_accepted=1)

    def _verify_step(self, logits, hidden_states, draft, state: TreeState, q=None, probs=None) -> StepOutput:
        tokens = state.node_tokens
        probs = logits_to_probs(logits, state.sampling) if probs is None else probs  # (B, T, V)
        acc = verify_tree(state.tree, tokens, probs, state.random, q, distinct_siblings=self.distinct_siblings,
                          rule=self.acceptance_rule, neighbours=state.neighbours)
        # rows advance together: commit the shortest row's accepted run plus its bonus (a prefix of every
        # row's exact sample is exact), and never past the end of the grid
        chain = state.tree.max_children == 1
        if chain:
            shortest, prefix = int(acc.num_accepted.min()), True  # the one host read per round
        else:  # is every row's path nodes 0, 1, 2, ...? Then the KV cache is cropped, not compacted (no copy)
            if acc.path.shape[1] > state.slots.shape[0]:  # a tree grown deeper than it keeps nodes (host shapes)
                state.slots = torch.arange(acc.path.shape[1], device=acc.path.device)
            nodes = state.slots[: acc.path.shape[1]]  # (D + 1,) 0, 1, 2, ...: a view, built once
            prefix_path = ((acc.path == nodes) | (acc.path < 0)).all()
            shortest, prefix = torch.stack([acc.num_accepted.min(), prefix_path.long()]).tolist()  # the one host read
        n = min(shortest + 1, state.num_remaining)
        if state.batch_size > 1:  # what rows that accepted more drop by advancing with the shortest (no host read)
            potential = (acc.num_accepted + 1).clamp_max(state.num_remaining).sum()
            state.row_potential = potential if state.row_potential is None else state.row_potential + potential
            state.batch_committed += n * state.batch_size
        path = acc.path[:, :n]  # (B, n) root + the n - 1 accepted nodes whose KV stays
        drafted = tokens.gather(1, path)  # (B, n): column j is the code of accepted node j (all offered: >= 0)
        codes = torch.cat([drafted[:, 1:], acc.bonus[:, None]], 1)  # (B, n)
        if (state.batch_size > 1 or n <= shortest) and n <= state.tree.max_depth:
            # a row that accepted n or more drafts commits its n-th accepted node, not its bonus
            longer = acc.num_accepted[:, None] >= n
            codes[:, -1:] = torch.where(longer, tokens.gather(1, acc.path[:, n : n + 1].clamp_min(0)), codes[:, -1:])
        state.hidden = hidden_states[state.rows, path[:, -1]]  # the node that predicted the newest code
        state.accepted_path = path
        state.commit(codes, acc.bonus.new_full(acc.bonus.shape, n))
        if prefix:  # a chain, or a tree path through its first n slots: a crop (no copy)
            return StepOutput(num_accepted=n, keep_length=n)
        return StepOutput(num_accepted=n, keep_indices=path)
