"""What tree decoders share (Medusa, Hawk, SJD's window, EAGLE-2 and ADT-Tree): the typed `TreeState`, drafting a
static tree of candidates and verifying it exactly (`TreeDecoderMixin`), and ``"auto"`` tree sizes from the
measured round cost."""

from typing import Callable, Dict, List, Optional, Tuple

import torch

from ..core.acceptance import AcceptanceLike, resolve_acceptance
from ..core.tree import DraftTree, tree_from_parents
from .decoding_utils import AUTO, check_draft_size

#: Draft sizes ``"auto"`` chooses from (nodes after the root).
DRAFT_SIZE_CANDIDATES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64)
#: ``"auto"`` keeps the smallest draft whose predicted codes per second are within this share of the best size's:
#: near the optimum the predicted rate is flat, and the argmax followed the timing noise left in the fitted curves.
#: Chosen on the embedded model on the 2-core AMD EPYC VM (CPU, fp32; commit `eeb25e7`, docs/benchmarks/archive-cost.md,
#: '"Auto" draft sizes that hold from process to process'): sizes then repeat from process to process; a 5% margin
#: tried earlier chose 2-4 drafts and lost 0.04-0.14x (docs/archive.md).
AUTO_RATE_TOLERANCE = 0.03
#: ``"auto"`` drafts at all (size 0, rounds without drafts, is a candidate) only when the best size's
#: predicted rate beats theirs by more than this share: the best of ~14 noisy estimates sits above its true rate. On
#: janus-25m (CPU, eager) one generation's acceptance at window 6 was 0.37-0.49 drafts per round from seed to seed, and
#: timed rounds scatter 3-9% about their curve (docs/benchmarks/archive-peers.md, "What `tune_decoder` weighs
#: there"): with 3% the pick moved between window 0 and 6, which ran at 0.82x rounds without drafts.
NO_DRAFT_MARGIN = 0.06
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
    (`spatial_pipelines.pipelines.device_tree.HeadTreeLoop`; a decoder's `plan` returns one in a `TreeRound`). Called with
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


class TreeDecoderMixin:
    """What tree decoders share: drafting a static tree of head candidates and exact verification.

    A subclass calls ``self._set_tree(full_tree, size)`` in ``__init__``: ``full_tree`` is the largest tree it drafts,
    ``size`` an int (keep the ``size`` likeliest nodes, or all of them with ``None``) or ``"auto"``: the pipeline then
    times each candidate's whole round on real rounds of the engine on its device (a drafter model's decoder: the pass
    cost ``c(T)`` and its drafter's passes), and `resolve_draft_size` keeps the node count that maximises the expected
    codes per second, ``(1 + E[accepted]) / (seconds per round)``.
    The costs are measured on the device; ``E[accepted]`` comes from the prior `node_priors` with the class's
    ``acceptance_prior`` ``(first_rate, sibling_decay)``, fitted on the embedded model (`HEADS_ACCEPTANCE_PRIOR`,
    `EAGLE_ACCEPTANCE_PRIOR`, the SJD priors; docs/decoders.md, "Fitted constants"), unless measured:
    `SpatialARPipeline.tune_decoder` measures ahead, once (with a ``prompt``: each size's acceptance on real
    generations of this checkpoint, passed as ``accepted``), and returns a decoder of fixed sizes.
    """

    acceptance_prior: Tuple[float, float] = HEADS_ACCEPTANCE_PRIOR

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

    def resolve_draft_size(self, round_cost: Callable[[DraftTree], float], batch_size: int = 1,
                           accepted: Optional[Dict[int, float]] = None) -> None:
        resolved = self._resolved_for
        if self._size != AUTO or (resolved is not None and resolved[0] is round_cost and resolved[1] == batch_size):
            return  # once per pipeline cost model and batch size
        sizes = self._draft_sizes()
        if accepted is not None:  # measured on real generations: those sizes only, each with its own acceptance
            sizes = [n for n in sizes if n in accepted]
            if not sizes:
                raise ValueError(f"`accepted` names none of the sizes {self._draft_sizes()} this decoder weighs.")
        candidates = [self._sized_tree(n) for n in sizes]  # (tree, expected accepted drafts under the prior)
        if accepted is not None:
            candidates = [(tree, accepted[n]) for (tree, _), n in zip(candidates, sizes)]
        trees = [tree for tree, _ in candidates]
        # a RoundCost times what it has not yet and returns its fitted curve (through these trees only)
        seconds = round_cost.fitted(trees) if hasattr(round_cost, "fitted") else round_cost
        cost = [seconds(tree) for tree in trees]
        rates = [(tree, (1.0 + accepted) / seconds) for (tree, accepted), seconds in zip(candidates, cost)]  # smallest first
        best = max(rate for _, rate in rates)
        # the smallest draft within AUTO_RATE_TOLERANCE of the best (near the optimum the rate is flat), and no drafts
        # unless drafting wins by NO_DRAFT_MARGIN
        chosen = next(i for i, (_, rate) in enumerate(rates) if rate >= (1.0 - AUTO_RATE_TOLERANCE) * best)
        if sizes[0] == 0 and best < (1.0 + NO_DRAFT_MARGIN) * rates[0][1]:
            chosen = 0
        self.tree, self._resolved_size = rates[chosen][0], sizes[chosen]
        self._resolved_for = (round_cost, batch_size)

    def _draft_sizes(self) -> List[int]:
        """The sizes ``"auto"`` weighs (arguments of `_sized_tree`); 0: rounds without drafts, AR's (where heads or a
        drafter this checkpoint's codes defeat, or a device where a drafted slot costs, make no tree pay)."""
        full = self._full_tree.num_nodes - 1
        return [0] + [c for c in DRAFT_SIZE_CANDIDATES if c < full] + [full]

    @property
    def max_draft_tokens(self) -> int:
        return self.tree.num_nodes
