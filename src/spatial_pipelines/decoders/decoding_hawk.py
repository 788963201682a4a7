"""Hawk: horizontal and vertical draft heads, a vertical speculation cache, and per-depth candidate pools
that merge horizontal candidates with vertical ones made from the rows above; the tree is the bounded
Cartesian product of the pools; exact verification."""

from typing import List, Union

import torch
from diffusers.configuration_utils import register_to_config

from ..core.acceptance import AcceptanceLike
from ..core.contracts import OFFSET_LOGITS, HeadsNeed
from ..core.rounds import TreeRound
from ..core.tree import DraftTree, tree_from_paths
from .decoding_tree import HeadDrafter, TreeDecoderMixin
from .decoding_utils import AUTO, SpatialDecoderMixin, check_draft_budget, check_draft_size, check_int

MAX_DRAFT_TOKENS = 64  # the largest tree "auto" considers


def draft_pools(horizontal: torch.Tensor, cached: torch.Tensor, earlier_slot: torch.Tensor) -> torch.Tensor:
    """Hawk's candidate pool per depth: rank ``r`` of [horizontal, cached vertical from ``1..VSD`` rows above],
    ``r = 0..k-1``, with duplicates (of an earlier slot) and empty slots offered as ``-1``.

    Args:
        horizontal (`torch.LongTensor` `(B, n_h, k)`): the horizontal heads' top-k per depth.
        cached (`torch.LongTensor` `(B, n_h, VSD, k)`): the vertical predictions cached for each depth's position.
        earlier_slot (`torch.BoolTensor` `(S, S)`): ``[i, j]`` when pool slot ``j`` comes before slot ``i``.

    Returns: `torch.LongTensor` `(B, n_h, S)`, ``S = k * (1 + VSD)``.
    """
    b, size = horizontal.shape[0], earlier_slot.shape[0]
    pool = torch.cat([horizontal[:, :, None], cached], 2).transpose(2, 3).reshape(b, -1, size)  # (B, n_h, S)
    same = pool[..., :, None] == pool[..., None, :]  # (B, n_h, S, S)
    return pool.masked_fill((same & earlier_slot).any(-1) | (pool < 0), -1)


class HawkDrafter(HeadDrafter):
    """Hawk's drafting on device tensors (`device_tree.HeadTreeLoop`): each row's vertical speculation cache, its
    per-depth pools, and the tree's nodes from them, with each row's own newest code.

    Args:
        decoder (`HawkDecoder`), draft_heads (`SpatialDraftHeads`), layout: the decoder and what it drafts for.
        batch_size (`int`), device: the rows.
    """

    def __init__(self, decoder: "HawkDecoder", draft_heads, layout, batch_size: int, device):
        super().__init__(decoder.tree, device)
        c = decoder.config
        self.vsd, self.k, self.pool_size = c.vertical_speculation_depth, c.top_k, decoder.pool_size
        self.num_tokens = layout.num_tokens
        depth = self.tree.max_depth
        horizontal = [draft_heads.horizontal_index(o) for o in range(1, depth + 1)]
        vertical = [draft_heads.vertical_index(o) for o in range(1, self.vsd + 1)]
        self.heads = draft_heads.frozen(horizontal, vertical)  # weights looked up once, outside the compiled round
        # row N is a spare that predictions landing past the grid are written to
        self.vertical_cache = torch.full((batch_size, layout.num_tokens + 1, max(self.vsd, 1), self.k), -1,
                                         dtype=torch.long, device=device)  # (B, N + 1, VSD, k)
        self.depth_offsets = torch.arange(1, depth + 1, device=device)  # (n_h,)
        self.row_offsets = torch.arange(1, self.vsd + 1, device=device) * layout.width  # (VSD,) d rows below
        self.distance = torch.arange(self.vsd, device=device)  # (VSD,) cache slot of each distance
        self.rows = torch.arange(batch_size, device=device)[:, None]  # (B, 1)
        self.earlier_slot = torch.ones(self.pool_size, self.pool_size, dtype=torch.bool, device=device).tril(-1)

    def buffers(self) -> List[torch.Tensor]:
        return [self.vertical_cache]

    def __call__(self, backbone, hidden: torch.Tensor, committed: torch.Tensor) -> torch.Tensor:
        n, cache = self.num_tokens, self.vertical_cache
        root = committed - 1  # (B,) raster index of each row's newest code
        feats_h, feats_v = self.heads(backbone.final_norm(hidden))  # (B, n_h, H), (B, VSD, H)
        logits = backbone.output_head(torch.cat([feats_h, feats_v], 1))  # (B, n_h + VSD, V): one output-head pass
        top = logits.topk(self.k, dim=-1).indices  # (B, n_h + VSD, k)
        horizontal, vertical = top[:, : feats_h.shape[1]], top[:, feats_h.shape[1]:]  # (B, n_h, k), (B, VSD, k)
        if self.vsd:  # the prediction d rows below lands d * W codes later (past the grid: the spare row)
            below = root[:, None] + self.row_offsets  # (B, VSD)
            cache[self.rows, torch.where(below < n, below, n), self.distance] = vertical
        cached = cache[:, :, : self.vsd][self.rows, (root[:, None] + self.depth_offsets).clamp_max(n - 1)]  # (B, n_h, VSD, k)
        pool = draft_pools(horizontal, cached, self.earlier_slot)  # (B, n_h, S)
        return pool[:, self.node_depth, self.node_rank]  # (B, T - 1)


def bounded_product_paths(depth: int, pool_size: int, num_nodes: int) -> List[tuple]:
    """The first ``num_nodes`` nodes of the Cartesian product of ``depth`` pools of ``pool_size`` slots, taken in
    order of summed slot rank (then depth): prefix-closed, best-ranked candidates first."""
    frontier, out = [()], []
    while frontier and len(out) < num_nodes:
        frontier.sort(key=lambda p: (sum(p), len(p), p))
        path = frontier.pop(0)
        if path:
            out.append(path)
        if len(path) < depth:
            frontier.extend(path + (s,) for s in range(pool_size))
    return out


class HawkDecoder(TreeDecoderMixin, SpatialDecoderMixin):
    r"""Hawk speculative decoding (exact).

    Args:
        num_horizontal_heads (`int`): horizontal heads (offsets ``1..n``); the tree depth.
        vertical_speculation_depth (`int`): VSD, vertical heads at ``1..VSD`` rows below.
        top_k (`int`): candidates each head contributes to a pool (vertical: per cached prediction).
        num_draft_tokens (`int`, `None` or `"auto"`): bound on the tree's draft nodes (root excluded; 0: AR's rounds). ``None``
            (default): the pipeline family's fixed bound (`SpatialARPipeline.default_draft_sizes`; 32 where the family
            names none). ``"auto"``: the bound of most codes per second on the device, up to `MAX_DRAFT_TOKENS`
            (`TreeDecoderMixin`, `HEADS_ACCEPTANCE_PRIOR`).
        acceptance (`str`, `dict` or `AcceptanceRule`): the acceptance rule (`resolve_acceptance`): ``"exact"``
            (default), or a lossy relaxed rule such as ``{"name": "lantern", "k": 1000}`` (`LANTERN_PRESETS`).
    """

    short_name = "hawk"  # the CLI's and benchmark specs' name (`DECODERS`)

    draft_size_name = "num_draft_tokens"
    default_draft_size = 32  # on a GPU a pass over 1-256 tokens costs one AR step (docs/performance.md)

    @register_to_config
    def __init__(self, num_horizontal_heads: int = 4, vertical_speculation_depth: int = 2, top_k: int = 2,
                 num_draft_tokens: Union[int, str, None] = None, acceptance: AcceptanceLike = "exact"):
        super().__init__()
        self._set_acceptance(acceptance)
        for name, value, low in (("num_horizontal_heads", num_horizontal_heads, 1), ("vertical_speculation_depth", vertical_speculation_depth, 0),
                                 ("top_k", top_k, 1)):
            check_int(name, value, low)
        check_draft_size("num_draft_tokens", num_draft_tokens)
        check_draft_budget(f"`num_horizontal_heads={num_horizontal_heads}` (the tree depth)", 1 + num_horizontal_heads)
        check_draft_budget(f"`top_k={top_k}` x (1 + `vertical_speculation_depth={vertical_speculation_depth}`) (the candidates "
                           "of one depth)", 1 + top_k * (1 + vertical_speculation_depth))
        self.pool_size = top_k * (1 + vertical_speculation_depth)  # slots: rank r of [horizontal, vertical 1..VSD]
        bound = MAX_DRAFT_TOKENS if num_draft_tokens == AUTO else self.default_draft_size if num_draft_tokens is None else num_draft_tokens
        full: DraftTree = tree_from_paths(bounded_product_paths(num_horizontal_heads, self.pool_size, bound))
        self._set_tree(full, num_draft_tokens if num_draft_tokens == AUTO else None)

    def heads_needed(self) -> HeadsNeed:
        """Token-logit heads at the horizontal offsets ``1..num_horizontal_heads`` and the vertical offsets
        ``1..vertical_speculation_depth``."""
        c = self.config
        return HeadsNeed((OFFSET_LOGITS,), tuple(range(1, c.num_horizontal_heads + 1)), tuple(range(1, c.vertical_speculation_depth + 1)),
                         self._who("num_horizontal_heads", "vertical_speculation_depth"))

    def check_compatibility(self, layout, draft_heads=None) -> None:
        super().check_compatibility(layout, draft_heads)
        if self.config.top_k > draft_heads.config.num_image_codes:
            raise ValueError(f"`top_k` ({self.config.top_k}) exceeds the {draft_heads.config.num_image_codes} image codes.")

    def plan(self, draft_heads, layout, batch_size: int, device, drawn: bool = False) -> TreeRound:
        """The static tree of pools (`HawkDrafter`, over the tree in use)."""
        return TreeRound(HawkDrafter(self, draft_heads, layout, batch_size, device))
