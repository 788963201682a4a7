"""What tree decoders share (Medusa, Hawk, SJD's window, EAGLE-2 and ADT-Tree): the typed `TreeState`, drafting a
static tree of candidates and verifying it exactly (`TreeDecoderMixin`), and ``"auto"`` tree sizes from the
measured round cost."""

import dataclasses
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ..core.acceptance import AcceptanceLike, resolve_acceptance
from ..core.sampling import sample_from_probs, target_probs
from ..core.tree import DraftTree, tree_from_parents
from ..core.verification import TreeAcceptance, verify_tree
from .decoding_utils import AUTO, DecodingState, Draft, DraftKind, RowsDiverged, StepOutput, check_draft_size, draft_through

#: Draft sizes ``"auto"`` chooses from (nodes after the root).
DRAFT_SIZE_CANDIDATES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64)
#: ``"auto"`` keeps the smallest draft whose predicted codes per second are within this share of the best size's:
#: near the optimum the predicted rate is flat, and the argmax followed the timing noise left in the fitted curves.
#: Chosen on the embedded model on the 2-core AMD EPYC VM (CPU, fp32; commit `eeb25e7`, docs/benchmarks/archive-cost.md,
#: '"Auto" draft sizes that hold from process to process'): sizes then repeat from process to process; a 5% margin
#: tried earlier chose 2-4 drafts and lost 0.04-0.14x (docs/archive.md).
AUTO_RATE_TOLERANCE = 0.03
#: The acceptance prior ``(first_rate, sibling_decay)`` of a tree of head candidates (Medusa, Hawk): the sibling tried
#: ``r``-th is accepted with ``first_rate * sibling_decay**r`` once its parent is reached. An assumed round value set
#: with ``"auto"`` sizes (commit `81d140f`, docs/archive.md), not fitted; on the embedded model v2 the first draft was
#: later measured at 0.58 (Hawk) to 0.67 (Medusa) (8 prompts, 2-core AMD EPYC VM, docs/benchmarks/archive-cost.md,
#: "Where SJD loses codes: the first draft").
HEADS_ACCEPTANCE_PRIOR = (0.5, 0.5)


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


class HeadDrafter:
    """Drafting a static tree on device tensors, for a round that runs whole on the device
    (`spatial_pipelines.pipelines.device_tree.HeadTreeLoop`; a decoder returns one from `device_drafter`). Called with
    the backbone, each row's pre-norm hidden state that predicted its newest code ``(B, D)`` and its committed count
    ``(B,)``, it returns the code of every draft node ``(B, T - 1)`` (``-1``: none offered), with no host read and no
    tensor built from Python values (the round is compiled whole). Buffers it keeps between rounds are in `buffers`
    (their addresses stay put).

    Args:
        tree (`DraftTree`): the tree, root first; its siblings offer distinct codes.
        device: where the rows are.
    """

    def __init__(self, tree: DraftTree, device):
        self.tree = tree.to(device)
        self.node_depth, self.node_rank = self.tree.depths[1:] - 1, self.tree.ranks[1:]  # (T - 1,) head and rank
        self.tree_depth = tree.max_depth  # host ints: the loop's shapes
        self.depth_counts = tuple(torch.bincount(tree.depths).tolist())  # nodes at each depth (the loop's EOL slots)
        self.nodes_per_depth = max(self.depth_counts)

    def __call__(self, backbone, hidden: torch.Tensor, committed: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must define `__call__`.")

    def buffers(self) -> List[torch.Tensor]:
        return []


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
        acceptance (`TreeAcceptance`, *optional*): this round's verification when it was drawn before the state was
            split by rows (`RowsDiverged`): the next step takes it instead of drawing again.
    """

    row_fields = ("hidden", "node_tokens", "accepted_path", "acceptance")
    shared_fields = ("tree", "host_depths", "rows", "slots", "node_depth", "node_rank", "neighbours", "head_indices")

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
    acceptance: Optional[TreeAcceptance] = None

    def _after_split(self, parent, index) -> None:
        super()._after_split(parent, index)
        self.rows = torch.arange(index.shape[0], device=index.device)  # row indices of this part


class TreeDecoderMixin:
    """What tree decoders share: drafting a static tree of head candidates and exact verification.

    A subclass calls ``self._set_tree(full_tree, size)`` in ``__init__``: ``full_tree`` is the largest tree it drafts,
    ``size`` an int (keep the ``size`` likeliest nodes, or all of them with ``None``) or ``"auto"``: the pipeline then
    measures the pass cost ``c(T)`` and the decoder's own work per round on its device, and `resolve_draft_size` keeps
    the node count that maximises the expected codes per second, ``(1 + E[accepted]) / (c(1 + nodes) + overhead)``.
    The costs are measured on the device; ``E[accepted]`` is not: it comes from the prior `node_priors` with the
    class's ``acceptance_prior`` ``(first_rate, sibling_decay)``, fitted on the embedded model (`HEADS_ACCEPTANCE_PRIOR`,
    `EAGLE_ACCEPTANCE_PRIOR`, the SJD priors; docs/decoders.md, "Fitted constants"), also for other checkpoints. Its
    ``state_class`` must be a `TreeState`.
    """

    state_class = TreeState
    acceptance_prior: Tuple[float, float] = HEADS_ACCEPTANCE_PRIOR
    distinct_siblings: bool = False  # True when the decoder never offers one code twice among siblings

    def _set_acceptance(self, acceptance: AcceptanceLike) -> None:
        """Resolve the config's acceptance rule (checked: a `ValueError` names a bad argument) and store it in the
        config as JSON (`AcceptanceRule.to_config`): a rule object saves and loads like its dict."""
        self.acceptance_rule = resolve_acceptance(acceptance)
        self.register_to_config(acceptance=self.acceptance_rule.to_config())

    def _set_tree(self, full_tree: DraftTree, size) -> None:
        self._full_tree, self._size = full_tree, size
        self._resolved_for, self._resolved_size = None, None
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

    @property
    def sizes_from_family(self) -> bool:
        return self.config[self.draft_size_name] is None

    def use_default_size(self, size: int) -> None:
        """Draft exactly as a config with ``draft_size_name=size`` does (built by that config, so the tree is the same
        one), keeping ``None`` in this decoder's own config. Called by the pipeline before decoding."""
        if not self.sizes_from_family or self._resolved_size == size:
            return
        check_draft_size(self.draft_size_name, size)
        built = type(self).from_config(self.config, **{self.draft_size_name: size})
        self._full_tree, self._size, self.tree = built._full_tree, built._size, built.tree
        self._resolved_size = size

    def fixed_sizes(self) -> Dict[str, int]:
        """The config values that fix this decoder's ``None`` or ``"auto"`` size to the one in use (``{}`` when it is
        fixed already, or ``"auto"`` not chosen yet): ``type(d).from_config(d.config, **d.fixed_sizes())`` is a
        decoder with fixed sizes (`SpatialARPipeline.tune_decoder`)."""
        name = self.draft_size_name
        if self.config[name] is None:
            return {name: self._resolved_size if self._resolved_size is not None else self.default_draft_size}
        if self._size != AUTO or self._resolved_for is None:
            return {}
        return {name: self._resolved_size}

    def resolve_draft_size(self, pass_cost: Callable[[int], float], draft_pass_cost: Optional[Callable[[int], float]] = None,
                           round_overhead: Optional[Callable[[DraftTree], float]] = None, batch_size: int = 1) -> None:
        resolved = self._resolved_for
        if self._size != AUTO or (resolved is not None and resolved[3] == batch_size
                                  and all(a is b for a, b in zip(resolved, (pass_cost, draft_pass_cost, round_overhead)))):
            return  # once per pipeline cost model and batch size
        sizes = self._draft_sizes()
        candidates = [self._sized_tree(n) for n in sizes]  # (tree, expected accepted drafts)
        trees = [tree for tree, _ in candidates]
        # a PassCost / RoundOverhead measures what it has not yet and returns a fitted curve (through these sizes only)
        target = pass_cost.fitted(sorted({t.num_nodes for t in trees})) if hasattr(pass_cost, "fitted") else pass_cost
        if round_overhead is not None:  # the decoder's own drafting and walk, per tree
            outside = round_overhead.fitted(trees) if hasattr(round_overhead, "fitted") else round_overhead
            cost = [target(tree.num_nodes) + outside(tree) for tree in trees]
        else:
            cost = [target(tree.num_nodes) + self._drafting_seconds(tree, draft_pass_cost) for tree in trees]
        rates = [(tree, (1.0 + accepted) / seconds) for (tree, accepted), seconds in zip(candidates, cost)]  # smallest first
        best = max(rate for _, rate in rates)
        # the smallest draft within AUTO_RATE_TOLERANCE of the best: near the optimum the predicted rate is flat, so
        # the argmax would follow what timing noise is left in the fitted curves from run to run
        self.tree, self._resolved_size = next((tree, n) for (tree, rate), n in zip(rates, sizes) if rate >= (1.0 - AUTO_RATE_TOLERANCE) * best)
        self._resolved_for = (pass_cost, draft_pass_cost, round_overhead, batch_size)

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

    def _heads_logits(self, state: TreeState, draft_heads, backbone):
        """Logits of the heads this decoder uses (the horizontal, then the vertical offsets of `heads_needed`) from the hidden state that predicted the newest committed code. Horizontal head ``i`` drafts
        depth ``i + 1``, so only the first ``tree.max_depth`` run: a shallower ("auto"-sized) tree drafts nothing
        from the others, and their weights are not read every round."""
        if state.head_indices is None:  # looked up on the first round, not every round
            need = self.heads_needed()
            h = [draft_heads.horizontal_index(o) for o in need.horizontal_offsets][: state.tree.max_depth]
            v = [draft_heads.vertical_index(o) for o in need.vertical_offsets]
            state.head_indices = (h, v)
        h, v = state.head_indices
        backbone = draft_through(backbone, self)
        feats_h, feats_v = draft_heads(backbone.final_norm(state.hidden), h, v)  # (B, Hh, D), (B, Hv, D)
        state.num_draft_passes += 1
        feats = torch.cat([feats_h, feats_v], 1) if v else feats_h  # one output-head pass for both kinds (per-op cost)
        logits = backbone.output_head(feats)  # (B, Hh + Hv, V)
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
        if tree.per_row:
            kind, depths = DraftKind.ROW_TREES, None
        else:
            kind, depths = (DraftKind.CHAIN if tree.max_children == 1 else DraftKind.TREE), state.host_depths
        return Draft(
            input_ids=node_tokens.clamp_min(0),  # an empty slot is fed as code 0 and never accepted
            position_ids=position_ids,
            attention_mask=tree.attention_mask,
            kind=kind,
            depths=depths,
        )

    def _prefill_step(self, logits, hidden_states, state: TreeState) -> StepOutput:
        probs = target_probs(logits[:, -1], state.sampling, state.random, state.num_committed)  # (B, V)
        token = sample_from_probs(probs, state.random)  # (B,)
        state.hidden = hidden_states[:, -1]
        state.commit(token[:, None], torch.ones_like(token))
        return StepOutput(num_accepted=1)

    def _verify_step(self, logits, hidden_states, draft, state: TreeState, q=None, probs=None) -> StepOutput:
        tokens = state.node_tokens
        if state.acceptance is not None:  # drawn before the state was split by rows (`RowsDiverged`)
            acc = state.acceptance
        else:
            if probs is None:  # node i's output is for grid index num_committed + depth(i)
                probs = target_probs(logits, state.sampling, state.random, state.tree.depths + state.num_committed)  # (B, T, V)
            acc = verify_tree(state.tree, tokens, probs, state.random, q, distinct_siblings=self.distinct_siblings,
                              rule=self.acceptance_rule, neighbours=state.neighbours)
        state.acceptance = None
        # one host read per round: every row's accepted run and whether every path is a prefix of the fed slots
        if acc.host is not None:  # read before the state was split
            accepted, prefix = acc.host
        elif state.tree.max_children > 1:  # is every row's path nodes 0, 1, 2, ...? Then the KV cache is cropped (no copy)
            if acc.path.shape[1] > state.slots.shape[0]:  # a tree grown deeper than it keeps nodes (host shapes)
                state.slots = torch.arange(acc.path.shape[1], device=acc.path.device)
            nodes = state.slots[: acc.path.shape[1]]  # (D + 1,) 0, 1, 2, ...: a view, built once
            prefix_path = ((acc.path == nodes) | (acc.path < 0)).all()
            *accepted, prefix = torch.cat([acc.num_accepted, prefix_path.long()[None]]).tolist()
        else:
            accepted, prefix = acc.num_accepted.tolist(), True
        runs = [min(a + 1, state.num_remaining) for a in accepted]
        if state.split_rows and len(set(runs)) > 1:  # nothing changed yet: the loop splits the rows by their runs
            raise RowsDiverged(dataclasses.replace(acc, host=(accepted, bool(prefix))), runs)
        # the rows of one state commit the same run: each row's own when the loop splits rows that diverge; in dry
        # rounds (`RoundOverhead`) the shortest row's run plus its bonus (a prefix of every row's exact sample is
        # exact), never past the end of the grid
        shortest = min(accepted)
        n = min(runs)
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
