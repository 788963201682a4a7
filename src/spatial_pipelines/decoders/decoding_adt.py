"""ADT-Tree: EAGLE-2's dynamic draft tree (`EagleDecoder`) whose depth and width adapt to the image region: each
raster position remembers the shape of the tree that committed it, a new tree starts from a neighbour's shape and
moves by the previous tree's acceptance rate (bisectional adaptation). The tree is verified as EAGLE-2's is."""

from typing import Union

import torch
from diffusers.configuration_utils import register_to_config

from ..core.acceptance import AcceptanceLike
from ..core.rounds import TreeRound
from ..core.sampling import SHAPE_STREAM, keyed_integer
from ..utils import check_choice, check_number
from .decoding_eagle import EagleDecoder, EagleDrafter
from .decoding_utils import check_draft_budget, check_int

__all__ = ["ADT_PRESETS", "ADTTreeDecoder"]  # what `spatial_pipelines.decoders` exports from this file

ADT_INITS = ("horizontal", "vertical", "random")
#: The paper's settings per family (``beta``, steps and ranges), to pass as kwargs: ``ADTTreeDecoder(**ADT_PRESETS["llamagen"])``.
ADT_PRESETS = {
    "llamagen": {"beta": 1.0, "depth_step": 1, "width_step": 10, "depth_range": (1, 10), "width_range": (3, 40)},
    "anole": {"beta": 1.0, "depth_step": 1, "width_step": 3, "depth_range": (1, 10), "width_range": (3, 14)},
}


class ADTDrafter(EagleDrafter):
    """ADT-Tree's drafting on device tensors (`device_tree.DynamicTreeLoop`): every row keeps its own shape memory
    ``(N + 1, 2)`` and acceptance rate, and grows its tree at its own ``(depth, top_k)`` (`ADTTreeDecoder`'s rule, per
    row: no row shares another's shape). The expansions run at the deepest, widest shape the ranges allow (held to the
    kept node count, `EagleDecoder._grown_shape`), and the nodes a row's own shape does not grow score ``-inf``
    (`expand_tree`), so a row keeps the tree it grows alone, at the cost of the widest drafter passes every round."""

    def _widest_shape(self):
        """The deepest, widest shape the ranges allow (``k`` never past the codebook)."""
        c = self.decoder.config
        self.widest = min(c.width_range[1], self.heads.config.num_image_codes)
        return c.depth_range[1], self.widest

    def start(self, loop) -> None:
        super().start(loop)
        b, device = loop.batch_size, loop.state.tokens.device
        self.memory = torch.full((b, loop.layout.num_tokens + 1, 2), -1, dtype=torch.long, device=device)  # -1: none yet
        self.last = torch.zeros(b, 2, dtype=torch.long, device=device)  # (B, 2) the last round's (depth, k), unclamped
        self.grown = torch.zeros(b, 2, dtype=torch.long, device=device)  # (B, 2) the shape it was grown at
        self.adapted = torch.zeros(b, dtype=torch.bool, device=device)  # a tree was verified: adapt from its rate
        c = self.decoder.config  # the rule's constants, built once
        self.first_shape = torch.tensor([c.depth, c.top_k], device=device)
        self.range_low = torch.tensor([c.depth_range[0], c.width_range[0]], device=device)  # ``tree_init="random"``
        self.range_span = torch.tensor([c.depth_range[1], c.width_range[1]], device=device) - self.range_low + 1
        self.pair = torch.arange(2, device=device)  # a depth draw and a width draw
        self.step = torch.tensor([c.depth_step, -c.width_step], device=device)  # deeper, narrower when alpha >= beta

    def buffers(self):
        return super().buffers() + [self.memory, self.last, self.grown, self.adapted]

    def _row_shapes(self, loop) -> torch.Tensor:
        """Each row's tree shape this round (`ADTTreeDecoder`'s rule: the neighbour's shape, moved by the last tree's
        acceptance rate), on device tensors."""
        c, s, width = self.decoder.config, loop.state, loop.layout.width
        n = loop.layout.num_tokens
        # the codes the last tree committed remember its shape; its acceptance rate is accepted drafts / grown depth
        first = s.committed - s.fresh  # (B,)
        offsets = self.code_offsets[None]  # (1, C)
        target = torch.where((offsets < s.fresh[:, None]) & self.adapted[:, None], first[:, None] + offsets, n)  # (B, C)
        self.memory.scatter_(1, target[..., None].expand(-1, -1, 2), self.last[:, None].expand(-1, target.shape[1], 2))
        alpha = (s.fresh - 1).float() / self.grown[:, 0].clamp_min(1)  # (B,)
        # a neighbour's shape (the one above, or the left one), else the configured one
        left = (s.committed - 1).clamp_min(0)
        above = s.committed - width
        index = torch.where(above >= 0, above, left) if c.tree_init == "vertical" else left  # (B,)
        neighbour = self.memory.gather(1, index[:, None, None].expand(-1, 1, 2))[:, 0]  # (B, 2)
        shape = torch.where(neighbour[:, :1] >= 0, neighbour, self.first_shape)  # (B, 2)
        if c.tree_init == "random":  # a uniform draw in the ranges, keyed by the row's seed and its newest code
            drawn = keyed_integer(s.seeds ^ SHAPE_STREAM, 2 * s.committed[:, None] + self.pair, self.range_span)  # (B, 2)
            shape = self.range_low + drawn
        move = torch.where(alpha >= c.beta, 1, -1)[:, None] * self.step  # (B, 2)
        shape = torch.where(self.adapted[:, None], shape + move, shape)
        depth = shape[:, 0].clamp(c.depth_range[0], c.depth_range[1])
        k = shape[:, 1].clamp(c.width_range[0], c.width_range[1]).clamp_max(self.widest)
        self.last.copy_(torch.stack([depth, k], 1))
        self.grown.copy_(self.last.clamp_max(self.decoder.num_nodes))  # `_grown_shape`
        self.adapted.fill_(True)
        self.shape[:, 1].copy_(self.grown[:, 1])  # the report's width
        return self.grown


class ADTTreeDecoder(EagleDecoder):
    r"""ADT-Tree: EAGLE-2's dynamic tree whose depth and width adapt to the image region (implemented from the
    paper; its public code has no adaptive rule).

    Every raster position remembers the ``(depth, top_k)`` of the tree that committed it. A new tree starts from a
    neighbour's: the left one (``tree_init="horizontal"``, the paper's choice), the one above (``"vertical"``; the left
    one on the first row) or a uniform draw in the ranges (``"random"``). Bisectional adaptation then moves it by the
    previous tree's acceptance rate ``alpha = accepted drafts / depth``: ``alpha >= beta`` gives a deeper, narrower
    tree (``depth + depth_step``, ``top_k - width_step``), otherwise a shallower, wider one; both clamped to their
    ranges, per row.

    Args:
        depth (`int`), top_k (`int`): the first tree's shape (before any neighbour exists), held to the ranges like
            every later one.
        num_draft_tokens (`int`, `None` or `"auto"`): nodes kept per tree, as `EagleDecoder`.
        tree_init (`str`): ``"horizontal"``, ``"vertical"`` or ``"random"`` (named apart from `JacobiDecoder`'s
            ``init``, so either decoder still builds from the other's config).
        beta (`float`): the acceptance-rate threshold.
        depth_step (`int`), width_step (`int`): adaptation steps ``l_d``, ``l_k``.
        depth_range (`tuple[int, int]`), width_range (`tuple[int, int]`): inclusive bounds (``ADT_PRESETS`` has the
            paper's per family; its depth range ``(0, 10)`` starts at 1 here: a tree of depth 0 drafts nothing).
        acceptance: as `EagleDecoder`.
    """

    short_name = "adt"  # the CLI's and benchmark specs' name (`DECODERS`)

    @register_to_config
    def __init__(self, depth: int = 5, top_k: int = 8, num_draft_tokens: Union[int, str, None] = None,
                 tree_init: str = "horizontal", beta: float = 1.0, depth_step: int = 1, width_step: int = 10,
                 depth_range: tuple = (1, 10), width_range: tuple = (3, 40), acceptance: AcceptanceLike = "exact"):
        check_choice("tree_init", tree_init, ADT_INITS)
        check_number("beta", beta, 0)
        check_int("depth_step", depth_step, 0)
        check_int("width_step", width_step, 0)
        for name, pair in (("depth_range", depth_range), ("width_range", width_range)):
            if (not isinstance(pair, (tuple, list)) or len(pair) != 2 or any(not isinstance(v, int) or isinstance(v, bool) for v in pair)
                    or not 1 <= pair[0] <= pair[1]):
                raise ValueError(f"`{name}` must be two ints (low, high) with 1 <= low <= high, got {pair!r}.")
        check_draft_budget(f"`depth_range={list(depth_range)}` (one node per depth at the deepest)", 1 + depth_range[1])
        check_draft_budget(f"`width_range={list(width_range)}` (the children of one node at the widest)", 1 + width_range[1])
        check_draft_budget(f"`depth_range={list(depth_range)}` with `width_range={list(width_range)}` (the nodes grown "
                           "before the best are kept)", 1 + (depth_range[1] - 1) * width_range[1])
        super().__init__(depth=depth, top_k=top_k, num_draft_tokens=num_draft_tokens, acceptance=acceptance)
        self.register_to_config(depth_range=list(depth_range), width_range=list(width_range))  # as JSON saves them

    def plan(self, draft_heads, layout, batch_size: int, device, drawn: bool = False) -> TreeRound:
        """Each row's tree grown at its own shape (`ADTDrafter`; ``tree_init="random"``: keyed uniform draws of a
        stream of the row's own, `SHAPE_STREAM`)."""
        return TreeRound(ADTDrafter(self, draft_heads))
