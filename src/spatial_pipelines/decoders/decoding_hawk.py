"""Hawk: horizontal and vertical draft heads, a vertical speculation cache, and per-depth candidate pools
that merge horizontal candidates with vertical ones made from the rows above; the tree is the bounded
Cartesian product of the pools; exact verification."""

from typing import List

import torch
from diffusers.configuration_utils import register_to_config

from ..core.tree import DraftTree, tree_from_paths
from .decoding_utils import DecodingState, Draft, SpatialDecoderMixin, StepOutput, TreeDecoderMixin


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
        num_draft_tokens (`int`): bound on the tree's draft nodes (root excluded).
    """

    draft_heads_class = "SpatialDraftHeads"

    @register_to_config
    def __init__(
        self, num_horizontal_heads: int = 4, vertical_speculation_depth: int = 2, top_k: int = 2, num_draft_tokens: int = 32
    ):
        super().__init__()
        for name, value, low in (("num_horizontal_heads", num_horizontal_heads, 1), ("vertical_speculation_depth", vertical_speculation_depth, 0),
                                 ("top_k", top_k, 1), ("num_draft_tokens", num_draft_tokens, 1)):
            if value < low:
                raise ValueError(f"`{name}` must be >= {low}, got {value}.")
        self.pool_size = top_k * (1 + vertical_speculation_depth)  # slots: rank r of [horizontal, vertical 1..VSD]
        paths = bounded_product_paths(num_horizontal_heads, self.pool_size, num_draft_tokens)
        self.tree: DraftTree = tree_from_paths(paths)

    @property
    def max_draft_tokens(self) -> int:
        return self.tree.num_nodes

    def required_horizontal_offsets(self) -> List[int]:
        return list(range(1, self.config.num_horizontal_heads + 1))

    def required_vertical_offsets(self) -> List[int]:
        return list(range(1, self.config.vertical_speculation_depth + 1))

    def check_compatibility(self, layout, draft_heads=None) -> None:
        super().check_compatibility(layout, draft_heads)
        for kind, need, have in (("horizontal", self.required_horizontal_offsets(), draft_heads.config.horizontal_offsets),
                                 ("vertical", self.required_vertical_offsets(), draft_heads.config.vertical_offsets)):
            missing = set(need) - set(have)
            if missing:
                raise ValueError(f"`draft_heads` lack the {kind} offsets {sorted(missing)} this HawkDecoder needs.")
        if self.config.top_k > draft_heads.config.num_image_codes:
            raise ValueError(f"`top_k` ({self.config.top_k}) exceeds the {draft_heads.config.num_image_codes} image codes.")

    def init_state(self, layout, sampling, random, batch_size, prefix_length, device, backbone=None) -> DecodingState:
        state = super().init_state(layout, sampling, random, batch_size, prefix_length, device, backbone)
        vsd, k = self.config.vertical_speculation_depth, self.config.top_k
        # vertical speculation cache: candidates for each raster code, one slot per "rows above" distance
        state.extras["vertical_cache"] = torch.full((batch_size, layout.num_tokens, max(vsd, 1), k), -1, dtype=torch.long, device=device)
        return state

    def propose(self, state: DecodingState, draft_heads=None) -> Draft:
        c = self.config
        n_h, vsd, k = c.num_horizontal_heads, c.vertical_speculation_depth, c.top_k
        tree = self._device_tree(state)
        b, n = state.tokens.shape
        width = state.layout.width
        root = state.num_committed - 1  # raster index of the newest committed code
        logits_h, logits_v = self._heads_logits(state, draft_heads)
        h_idx = [draft_heads.horizontal_index(o) for o in self.required_horizontal_offsets()]
        horizontal = logits_h[:, h_idx].topk(k, dim=-1).indices  # (B, n_h, k)
        cache = state.extras["vertical_cache"]  # (B, N, VSD, k)
        if vsd:
            v_idx = [draft_heads.vertical_index(o) for o in self.required_vertical_offsets()]
            vertical = logits_v[:, v_idx].topk(k, dim=-1).indices  # (B, VSD, k)
            for d in range(1, vsd + 1):  # cache the prediction d rows below for when decoding gets there
                if root + d * width < n:
                    cache[:, root + d * width, d - 1] = vertical[:, d - 1]
        # pool per depth: rank r of [horizontal, cached vertical from 1..VSD rows above], r = 0..k-1
        targets = (root + torch.arange(1, n_h + 1, device=cache.device)).clamp_max(n - 1)  # (n_h,)
        cached = cache[:, targets, :vsd]  # (B, n_h, VSD, k)
        pool = torch.cat([horizontal[:, :, None], cached], 2).transpose(2, 3).reshape(b, n_h, self.pool_size)  # (B, n_h, S)
        same = pool[..., :, None] == pool[..., None, :]  # (B, n_h, S, S)
        earlier = torch.ones(self.pool_size, self.pool_size, dtype=torch.bool, device=pool.device).tril(-1)
        pool = pool.masked_fill((same & earlier).any(-1) | (pool < 0), -1)  # duplicates and empty slots offer nothing
        depth = tree.depths[1:] - 1
        nodes = pool[:, depth, tree.ranks[1:]]  # (B, T - 1)
        return self._tree_draft(state, tree, torch.cat([state.last_token[:, None], nodes], 1))

    def step(self, logits, hidden_states, draft, state, draft_heads=None) -> StepOutput:
        if draft is None:
            return self._prefill_step(logits, hidden_states, state)
        return self._verify_step(logits, hidden_states, draft, state)
