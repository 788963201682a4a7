"""EAGLE-2: a one-layer drafter reads the target's features and grows a dynamic draft tree where it is confident;
the tree (one per batch row) is verified in one target pass with exact acceptance (docs/design.md, "Acceptance rules").

A round, for ``B`` images (``R = 2B`` drafter rows with CFG: the drafter drafts the unconditional rows too, and
their logits are mixed like the target's):

1. the codes the last pass committed are fed to the drafter with the target features that predicted them (its
   KV cache keeps the accepted prefix; the previous round's tree is cropped away first); its output at the newest
   code predicts the next feature, hence the depth-1 candidates;
2. ``depth - 1`` expansions: the ``top_k`` likeliest nodes of the last depth (by cumulative log-probability) are fed
   to the drafter with a tree mask, and each proposes ``top_k`` children;
3. every generated node is ranked by cumulative log-probability and the best ``num_draft_tokens`` form the tree
   (parents first, siblings best first; prefix-closed), built on the device as `RowTrees`;
4. the target verifies it (point masses: the drafter's candidates are deterministic given the context).
"""

from typing import Callable, Dict, Optional, Union

import torch
from diffusers.configuration_utils import register_to_config

from ..core.acceptance import AcceptanceLike
from ..core.contracts import DRAFTER, HeadsNeed
from ..core.rounds import TreeRound
from ..core.sampling import cfg_mix
from ..core.tree import row_trees_from_parents, tree_from_paths
from .decoding_tree import TreeDecoderMixin
from .decoding_utils import AUTO, SpatialDecoderMixin, check_draft_budget, check_draft_size, check_int

MAX_DRAFT_TOKENS = 64  # the largest tree "auto" considers
#: The acceptance prior ``(first_rate, sibling_decay)`` of EAGLE-2's and ADT-Tree's ``"auto"`` size: the drafter's top
#: candidate is accepted more often than a head's, 0.65 per kept node, measured on the embedded model v2 with its
#: shipped drafter (a 1-node tree, 50 prompts, 2-core AMD EPYC VM, CPU, fp32; commit `8f02ca7`,
#: docs/benchmarks/archive-cost.md, "The embedded model v2"); siblings as `HEADS_ACCEPTANCE_PRIOR`.
EAGLE_ACCEPTANCE_PRIOR = (0.65, 0.5)


def drafter_log_probs(backbone, predicted: torch.Tensor, guidance_scale=None) -> torch.Tensor:
    """Drafter features ``(R, n, D)`` -> log-probabilities ``(B, n, V)`` through the backbone's final norm and head,
    CFG-mixed at ``guidance_scale`` (a float or a tensor; ``None``: no CFG rows)."""
    logits = backbone.image_logits(predicted)  # (R, n, V)
    logits = cfg_mix(logits, guidance_scale) if guidance_scale is not None else logits
    return torch.log_softmax(logits.float(), dim=-1)


def expand_tree(logp: torch.Tensor, feature: torch.Tensor, depth: int, k: int, cfg: bool, expansion_pass: Callable,
                shapes: Optional[torch.Tensor] = None):
    """Grow a tree ``depth - 1`` times from the depth-1 candidates (the ``k`` likeliest codes of ``logp`` ``(B, V)``;
    ``feature`` ``(R, 1, D)``: the newest predicted feature): the ``k`` likeliest nodes of each depth (by cumulative
    log-probability) read their parent's predicted feature and propose ``k`` children each.
    ``expansion_pass(d, codes (B, k), features (R, k, D), ancestors (R, k, (d - 1) k))`` is one drafter pass over the
    frontier at depth ``d``, each node seeing the accepted prefix and its ancestors among the tree slots fed so far;
    it returns the predicted features ``(R, k, D)`` and the children's log-probabilities ``(B, k, V)``. Returns per depth
    the cumulative scores, codes and parents (global node ids, -1: the root) of every generated node, each
    ``(B, nodes at that depth)``. Every shape is fixed by ``(depth, k)``.

    ``shapes`` ``(B, 2)``, *optional*: each row's own ``(depth, k)``, at most the ones given (ADT-Tree on the device):
    the nodes a row's tree would not grow score ``-inf`` (a ``-inf`` frontier node's children too), so its kept nodes
    are those of the tree grown at its own shape."""
    b, rows_r = logp.shape[0], feature.shape[0]
    rank = torch.arange(k, device=logp.device)  # (k,)

    def grown(score: torch.Tensor, d: int) -> torch.Tensor:  # (B, ..., k) the nodes at depth d: ranks past a row's k
        if shapes is None:
            return score
        keep = (rank < shapes[:, 1, None]) & (d <= shapes[:, 0, None])  # (B, k)
        return score.masked_fill(~keep.view(b, *([1] * (score.dim() - 2)), k), float("-inf"))

    score, code = logp.topk(k, dim=-1)  # (B, k)
    score = grown(score, 1)
    all_scores, all_codes, all_parents = [score], [code], [torch.full_like(code, -1)]  # parent -1: the root
    feature = feature.expand(rows_r, k, -1)  # (R, k, D) the feature each frontier node reads
    frontier_ids = torch.arange(k, device=code.device).expand(b, k)  # global ids of the frontier nodes
    ancestors = torch.zeros(rows_r, k, 0, dtype=torch.bool, device=code.device)  # over tree slots fed so far
    for d in range(1, depth):
        predicted, child_logp = expansion_pass(d, code, feature, ancestors)
        child_score, child_code = (score[..., None] + child_logp).topk(k, dim=-1)  # (B, k, k) cumulative
        child_score = grown(child_score, d + 1)
        base = sum(s.shape[1] for s in all_scores)
        all_scores.append(child_score.flatten(1))
        all_codes.append(child_code.flatten(1))
        all_parents.append(frontier_ids[..., None].expand(b, k, k).flatten(1))
        score, code, pick, feature, ancestors = next_frontier(cfg, child_score, child_code, predicted, ancestors, k)
        score = grown(score, d + 1)  # a row's frontier: its own k best
        frontier_ids = base + pick
    return all_scores, all_codes, all_parents


def next_frontier(cfg: bool, child_score, child_code, predicted, ancestors, k: int):
    """The ``k`` children ``(B, k, k)`` by cumulative score form the next frontier. Returns its ``(scores (B, k), codes
    (B, k), picks among the k * k children (B, k), features (R, k, D), ancestor slots (R, k, slots + k))``, where
    ``slots`` is the tree slots fed before this depth (``ancestors`` ``(R, k, slots)``)."""
    rows_r, slots = predicted.shape[0], ancestors.shape[-1]
    score, pick = child_score.flatten(1).topk(k, dim=-1)  # (B, k)
    code = child_code.flatten(1).gather(1, pick)
    parent_slot = pick // k  # which frontier node each came from
    pick_r = parent_slot.repeat(2, 1) if cfg else parent_slot
    inherited = ancestors.gather(1, pick_r[..., None].expand(rows_r, k, slots))  # (R, k, slots)
    parent = pick_r[..., None] == torch.arange(k, device=pick_r.device)  # (R, k, k) the parent, among the last k slots
    feature = predicted.gather(1, pick_r[..., None].expand(rows_r, k, predicted.shape[-1]))
    return score, code, pick, feature, torch.cat([inherited, parent], -1)


class EagleDrafter:
    """EAGLE-2's drafting on device tensors (`spatial_pipelines.pipelines.device_tree.DynamicTreeLoop`): every row
    grows its own tree each round, with fixed shapes and no host read.

    Its cache (made in `start`) keeps each row's accepted prefix on the device: a round feeds every row ``D + 1``
    slots (the codes the last round committed with the features that predicted them; the row keeps as many as it
    committed, `StaticKVCache.keep_prefixes`), then ``depth - 1`` expansions of ``top_k`` slots each, never kept.

    Args:
        decoder (`EagleDecoder`): the tree's size and shape (its ``num_draft_tokens`` fixed).
        draft_heads (`EagleDraftHead`): the drafter.
    """

    per_row_trees = True  # one tree per row, grown every round (`DynamicTreeLoop`)

    def __init__(self, decoder: "EagleDecoder", draft_heads):
        self.decoder, self.heads = decoder, draft_heads
        self.max_depth, self.top_k = decoder._grown_shape(*self._widest_shape())
        grown = self.top_k + (self.max_depth - 1) * self.top_k**2  # nodes the expansions generate
        self.num_nodes = min(decoder.num_nodes, grown)  # the kept tree (`_keep_best`)
        self.tree_depth = min(self.max_depth, self.num_nodes)  # its depth at most: codes a round commits, less one
        self.nodes_per_depth = min(self.num_nodes, self.top_k ** min(self.tree_depth, 2))  # top_k, then top_k children each
        self.draft_passes = self.max_depth  # one over the committed codes, one per expansion
        self.cache = None

    def _widest_shape(self):
        """The ``(depth, top_k)`` every round grows (held to the kept node count by `EagleDecoder._grown_shape`)."""
        return self.decoder.config.depth, self.decoder.config.top_k

    def start(self, loop) -> None:
        """After the prompt pass: an empty drafter cache over the loop's cache rows, whose rows advance on the device,
        and the round's constants."""
        device, n = loop.state.tokens.device, loop.layout.num_tokens
        self.cfg, self.guidance_scale = loop.sampling.do_cfg, loop.guidance_scale
        fed, grown = self.tree_depth + 1, (self.max_depth - 1) * self.top_k  # slots of the feed, of the expansions
        self.extra = max(fed, grown)  # a row writes at most this far past its newest committed code
        self.cache = self.heads.make_cache(loop.cache.num_rows, n + self.extra, fixed_shape=True, min_attend_step=64)
        self.cache.track_rows_on_device(self.extra)
        self.code_offsets = torch.arange(fed, device=device)  # (C,)
        self.causal = torch.ones(fed, fed, dtype=torch.bool, device=device).tril()  # (C, C)
        self.eye = torch.eye(self.top_k, dtype=torch.bool, device=device)  # (k, k) each frontier node sees itself
        self.shape = torch.full((loop.batch_size, 2), self.top_k, dtype=torch.long, device=device)  # (B, 2) kept depth, k

    def set_bound(self, committed: int) -> None:
        """Before a round: no row has committed more than ``committed`` codes (a host bound)."""
        self.cache.set_bound(committed + self.extra)

    def buffers(self):
        c = self.cache
        return [c.storage, c.key_valid, c.row_starts, self.shape]

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        """Conditional rows -> every cache row (the unconditional ones read the same codes)."""
        return torch.cat([x, x]) if self.cfg else x

    def _log_probs(self, backbone, predicted: torch.Tensor) -> torch.Tensor:
        return drafter_log_probs(backbone, predicted, self.guidance_scale if self.cfg else None)  # the scale as a tensor

    def __call__(self, loop):
        """Each row's tree: its node codes ``(B, T - 1)`` (``-1``: not offered) and its `RowTrees`."""
        s, backbone, cache = loop.state, loop.backbone, self.cache
        n = loop.layout.num_tokens
        # 1. the codes the last round committed, with the features that predicted them (slots past them: not kept)
        raster = (s.committed - s.fresh)[:, None] + self.code_offsets  # (B, C) grid index of each fed code
        codes = s.tokens.gather(1, raster.clamp_max(n)).clamp_min(0)  # (B, C)
        cache.prepare_write(self.code_offsets.shape[0])
        predicted = self.heads(s.features, backbone.embed_image_tokens(self._rows(codes)), self._rows(raster.clamp_max(n - 1)),
                               attention_mask=self.causal, cache=cache)  # (R, C, D)
        fresh = self._rows(s.fresh)  # (R,)
        cache.keep_prefixes(fresh)
        newest = predicted.gather(1, (fresh - 1).clamp_min(0)[:, None, None].expand(-1, 1, predicted.shape[-1]))  # (R, 1, D)
        # 2. expand: the top_k likeliest nodes of each depth propose top_k children each
        scores, codes, parents = expand_tree(self._log_probs(backbone, newest)[:, 0], newest, self.max_depth, self.top_k,
                                             self.cfg, lambda *args: self._expansion_pass(loop, *args), self._row_shapes(loop))
        # 3. keep the num_draft_tokens best nodes, parents before children and siblings best first
        tree, nodes, offered = self.decoder._keep_best(scores, codes, parents, self.max_depth, self.top_k)
        self.shape[:, 0].copy_(torch.where(offered, tree.depths, 0).max(-1).values)  # (B,) for the report
        return nodes, tree

    def _row_shapes(self, loop) -> Optional[torch.Tensor]:
        """Each row's ``(depth, k)`` this round ``(B, 2)``, or ``None``: every row grows the drafter's shape."""
        return None

    def report(self, shapes: torch.Tensor) -> Dict[str, float]:
        """`EagleState.report`'s statistics from the rows' ``(kept depth, k)`` over their active rounds ``(M, 2)``."""
        if not shapes.numel():
            return {}
        means = shapes.float().mean(0).tolist()
        return {"mean_tree_depth": means[0], "mean_tree_width": means[1]}

    def _expansion_pass(self, loop, d: int, code: torch.Tensor, feature: torch.Tensor, ancestors: torch.Tensor):
        """`expand_tree`'s drafter pass at depth ``d``: the frontier writes ``top_k`` slots after the ``(d - 1) top_k``
        tree slots of this round, each row after its own prefix, and sees the prefix and its ancestors."""
        cache, k, rows_r = self.cache, code.shape[1], feature.shape[0]
        slots = cache.row_starts[:, None] + cache._slot_offsets[: d * k]  # (R, d k) the ancestors' slots, then its own
        cache.write_index = slots[:, (d - 1) * k :]  # (R, k)
        a = cache.attend_length
        mask = cache.key_valid[:, None, :a].expand(rows_r, k, a).clone()  # (R, k, A) the accepted prefix
        mask.scatter_(2, slots[:, None, :].expand(rows_r, k, d * k), torch.cat([ancestors, self.eye.expand(rows_r, k, k)], -1))
        raster = (loop.state.committed[:, None] - 1 + d).clamp_max(loop.layout.num_tokens - 1).expand(-1, k)  # (B, k)
        predicted = self.heads(feature, loop.backbone.embed_image_tokens(self._rows(code)), self._rows(raster), cache=cache,
                               mask=mask)  # (R, k, D)
        return predicted, self._log_probs(loop.backbone, predicted)


class EagleDecoder(TreeDecoderMixin, SpatialDecoderMixin):
    r"""EAGLE-2 dynamic draft trees with exact acceptance.

    Args:
        depth (`int`): tree depth (expansions + 1).
        top_k (`int`): children per expanded node, and nodes expanded per depth.
        num_draft_tokens (`int`, `None` or `"auto"`): nodes kept in the tree (root excluded; 0: none, AR's rounds). ``None``:
            the pipeline family's fixed size (`SpatialARPipeline.default_draft_sizes`; 60, EAGLE-2's, where the family
            names none). ``"auto"``: the count of most codes per second on the device, up to `MAX_DRAFT_TOKENS`
            (`TreeDecoderMixin`; the prior `EAGLE_ACCEPTANCE_PRIOR` on a ``top_k``-ary tree of ``depth``).
        acceptance (`str`, `dict` or `AcceptanceRule`): the acceptance rule (`resolve_acceptance`): ``"exact"``
            (default), or a lossy relaxed rule such as ``{"name": "lantern", "k": 1000}`` (`LANTERN_PRESETS`).
    """

    short_name = "eagle"  # the CLI's and benchmark specs' name (`DECODERS`)

    acceptance_prior = EAGLE_ACCEPTANCE_PRIOR  # fitted on the embedded model: "auto" uses it on any checkpoint
    draft_size_name = "num_draft_tokens"
    default_draft_size = 60  # EAGLE-2's released setting (60 draft tokens per round)

    @register_to_config
    def __init__(self, depth: int = 5, top_k: int = 8, num_draft_tokens: Union[int, str, None] = None,
                 acceptance: AcceptanceLike = "exact"):
        super().__init__()
        check_int("depth", depth)
        check_int("top_k", top_k)
        check_draft_size("num_draft_tokens", num_draft_tokens)
        check_draft_budget(f"`depth={depth}` (one node per depth at least)", 1 + depth)
        check_draft_budget(f"`top_k={top_k}` (the children of one node)", 1 + top_k)
        self._set_acceptance(acceptance)
        # the prior's stand-in for a dynamic tree: the top_k-ary tree of this depth, best nodes first
        paths, frontier = [], [()]
        for _ in range(depth):
            frontier = [p + (r,) for p in frontier for r in range(top_k)][: MAX_DRAFT_TOKENS]
            paths += frontier
        full = tree_from_paths(paths[:MAX_DRAFT_TOKENS] if num_draft_tokens == AUTO else paths)
        size = self.default_draft_size if num_draft_tokens is None else num_draft_tokens
        self._set_tree(full, size if size == AUTO else min(size, full.num_nodes - 1))

    def heads_needed(self) -> HeadsNeed:
        """A drafter (`EagleDraftHead`)."""
        return HeadsNeed((DRAFTER,), who=type(self).__name__)

    @property
    def num_nodes(self) -> int:
        """Draft nodes per tree (root excluded): ``num_draft_tokens`` or what ``"auto"`` chose."""
        return self.tree.num_nodes - 1

    @property
    def max_draft_tokens(self) -> int:
        return self.num_nodes + 1

    def plan(self, draft_heads, layout, batch_size: int, device, drawn: bool = False) -> TreeRound:
        """Each row's tree grown by the drafter (`EagleDrafter`, for the tree size in use)."""
        return TreeRound(EagleDrafter(self, draft_heads))

    # -- drafting ---------------------------------------------------------------------------------------------
    def _keep_best(self, all_scores, all_codes, all_parents, depth: int, k: int):
        """The ``num_draft_tokens`` best generated nodes as one tree per row, parents before children and siblings
        best first. Returns ``(RowTrees, each kept node's code or -1 where it is not offered (B, N), offered
        (B, N + 1))``."""
        scores = torch.cat(all_scores, 1)  # (B, M)
        codes_all = torch.cat(all_codes, 1)
        parents = torch.cat(all_parents, 1)  # (B, M) global ids, -1: the root
        depths = torch.cat([torch.full_like(s, i + 1) for i, s in enumerate(all_scores)], 1)
        b, m = scores.shape
        keep_score, keep = scores.clamp_min(-1e4).topk(min(self.num_nodes, m), dim=-1)  # (B, N) -1e4: not grown
        order = (depths.gather(1, keep) * 1e6 - keep_score).argsort(-1)  # depth first, then likeliest first
        keep = keep.gather(1, order)  # (B, N) global ids in tree order
        position = torch.full((b, m), -1, dtype=torch.long, device=keep.device)
        position.scatter_(1, keep, torch.arange(1, keep.shape[1] + 1, device=keep.device).expand_as(keep))
        parent_ids = parents.gather(1, keep)  # (B, N)
        parent_pos = torch.where(parent_ids >= 0, position.gather(1, parent_ids.clamp_min(0)), 0)  # 0: the root
        valid = (parent_pos >= 0) & (keep_score > -1e4)  # dropped: a node whose parent was not kept (a tie at the cut)
        tree_parents = torch.cat([torch.full((b, 1), -1, dtype=torch.long, device=keep.device), parent_pos.clamp_min(0)], 1)
        tree_valid = torch.cat([torch.ones(b, 1, dtype=torch.bool, device=keep.device), valid], 1)
        tree = row_trees_from_parents(tree_parents, tree_valid, min(depth, keep.shape[1]), k)  # N kept: at most N deep
        # a dropped node's descendants are unreachable: no path from the root offers them
        reachable = tree.node_paths[..., 0] == 0
        offered = tree_valid & reachable  # (B, N + 1)
        nodes = torch.where(offered[:, 1:], codes_all.gather(1, keep), -1)  # (B, N)
        return tree, nodes, offered

    def _grown_shape(self, depth: int, k: int, num_nodes: Optional[int] = None):
        """The ``(depth, top_k)`` a tree of that shape is grown to: at most the kept node count each.

        Why: a kept node's ancestors all rank above it (cumulative log-probabilities only fall along a path), so the
        ``num_draft_tokens`` best nodes lie within that depth and, per depth, among that many best: growing deeper or
        wider drafts nodes that are never kept. Same tree, fewer and smaller drafter passes (ties at the cut aside).
        """
        n = self.num_nodes if num_nodes is None else num_nodes
        return min(depth, n), min(k, n)

    # -- verification -----------------------------------------------------------------------------------------
