"""Medusa (1-D multi-token prediction): heads draft the next codes along the raster; a static tree of their
top-k candidates is verified in one target pass with a tree attention mask; exact acceptance."""

from typing import List, Optional, Sequence, Tuple, Union

import torch
from diffusers.configuration_utils import register_to_config

from ..core.acceptance import AcceptanceLike
from ..core.contracts import OFFSET_LOGITS, HeadsNeed
from ..core.rounds import TreeRound
from ..core.tree import tree_from_paths
from .decoding_tree import HeadDrafter, TreeDecoderMixin
from .decoding_utils import SpatialDecoderMixin, check_draft_budget, check_draft_size, check_int


def check_tree_paths(tree_paths, num_heads: int) -> List[Tuple[int, ...]]:
    """``tree_paths`` as tuples, or a `ValueError`: a non-empty list of distinct, non-empty paths of candidate ranks
    (ints >= 0), no deeper than ``num_heads``, prefix-closed (every path's parent path is listed too)."""
    if isinstance(tree_paths, (str, bytes)) or not hasattr(tree_paths, "__iter__"):
        raise ValueError(f"`tree_paths` must be a list of paths (lists of candidate ranks), got {tree_paths!r}.")
    paths = []
    for p in tree_paths:
        if isinstance(p, (str, bytes)) or not hasattr(p, "__iter__"):
            raise ValueError(f"`tree_paths` entries must be lists of candidate ranks, got {p!r}.")
        p = tuple(p)
        if not p or any(not isinstance(r, int) or isinstance(r, bool) or r < 0 for r in p):
            raise ValueError(f"`tree_paths` entries must be non-empty lists of ints >= 0, got {list(p)!r}.")
        paths.append(p)
    if not paths or max(len(p) for p in paths) > num_heads:
        raise ValueError(f"`tree_paths` must be non-empty and no deeper than `num_heads` ({num_heads}).")
    if len(set(paths)) != len(paths):
        raise ValueError("`tree_paths` lists a path twice.")
    listed = set(paths)
    orphans = [list(p) for p in paths if len(p) > 1 and p[:-1] not in listed]
    if orphans:
        raise ValueError(f"`tree_paths` must be prefix-closed: the parents of {orphans} are not listed (add {[list(p[:-1]) for p in map(tuple, orphans)]}).")
    return paths


class MedusaDrafter(HeadDrafter):
    """Medusa's drafting on device tensors (`device_tree.HeadTreeLoop`): node ``i`` is the ``r_i``-th likeliest code
    of the horizontal head at offset ``d_i`` (its depth)."""

    def __init__(self, decoder: "MedusaDecoder", draft_heads, device):
        super().__init__(decoder.tree, device)
        index = [draft_heads.horizontal_index(d) for d in range(1, self.tree.max_depth + 1)]  # host ints, once
        self.heads = draft_heads.frozen(index, [])  # weights looked up once, outside the compiled round
        self.num_ranks = decoder._num_ranks  # candidates per head the tree reads (a host int)

    def __call__(self, backbone, hidden: torch.Tensor, committed: torch.Tensor) -> torch.Tensor:
        feats, _ = self.heads(backbone.final_norm(hidden))  # (B, D_tree, H)
        top = backbone.output_head(feats).topk(self.num_ranks, dim=-1).indices  # (B, D_tree, k)
        return top[:, self.node_depth, self.node_rank]  # (B, T - 1)


def caterpillar_paths(depth: int, top_k: int) -> List[Tuple[int, ...]]:
    """The default tree: the chain of top-1 candidates, with the top-``k`` alternatives at every depth."""
    return [(0,) * d + (r,) for d in range(depth) for r in range(top_k)]


class MedusaDecoder(TreeDecoderMixin, SpatialDecoderMixin):
    r"""Medusa / 1D multi-token prediction with a static tree and exact acceptance.

    Args:
        num_heads (`int`): horizontal heads used (offsets ``1..num_heads``); also the tree depth.
        top_k (`int`): candidates per head in the default tree.
        tree_paths (`list[list[int]]`, *optional*): the tree as candidate-rank paths, one per node and
            prefix-closed as Medusa's ``medusa_choices`` (``[[0], [0, 0], [1]]``); overrides the default caterpillar
            tree of ``num_heads`` x ``top_k``.
        num_draft_tokens (`int`, `None` or `"auto"`): draft nodes fed per pass: the likeliest nodes of that tree (an
            int at least its size feeds all of it; 0: none, AR's rounds). ``None`` (default): the pipeline family's
            fixed size (`SpatialARPipeline.default_draft_sizes`; 16, the whole default tree, where the family names none).
            ``"auto"``: the count of most codes per second on the device (`TreeDecoderMixin`, `HEADS_ACCEPTANCE_PRIOR`).
        acceptance (`str`, `dict` or `AcceptanceRule`): the acceptance rule (`resolve_acceptance`): ``"exact"``
            (default), or a lossy relaxed rule such as ``{"name": "lantern", "k": 1000}`` (`LANTERN_PRESETS`).
    """

    short_name = "medusa"  # the CLI's and benchmark specs' name (`DECODERS`)

    draft_size_name = "num_draft_tokens"
    default_draft_size = 16  # the whole default tree (4 heads x top-4): on a GPU a 17-token pass costs one AR step

    @register_to_config
    def __init__(self, num_heads: int = 4, top_k: int = 4, tree_paths: Optional[Sequence[Sequence[int]]] = None,
                 num_draft_tokens: Union[int, str, None] = None, acceptance: AcceptanceLike = "exact"):
        super().__init__()
        self._set_acceptance(acceptance)
        check_draft_size("num_draft_tokens", num_draft_tokens)
        check_int("num_heads", num_heads)
        check_int("top_k", top_k)
        if tree_paths is None:  # counted before the tree is built
            check_draft_budget(f"`num_heads={num_heads}` x `top_k={top_k}` (the default tree)", 1 + num_heads * top_k)
            paths = caterpillar_paths(num_heads, top_k)
        else:
            check_draft_budget(f"`num_heads={num_heads}` (the tree depth)", 1 + num_heads)
            paths = check_tree_paths(tree_paths, num_heads)
            check_draft_budget(f"`tree_paths` ({len(paths)} paths)", 1 + len(paths))
        self._set_tree(tree_from_paths(paths), self.default_draft_size if num_draft_tokens is None else num_draft_tokens)
        self._num_ranks = 1 + max(r for p in paths for r in p)  # candidates needed per head (host int)

    def heads_needed(self) -> HeadsNeed:
        """Token-logit heads at the horizontal offsets ``1..num_heads``."""
        return HeadsNeed((OFFSET_LOGITS,), tuple(range(1, self.config.num_heads + 1)), (), self._who("num_heads"))

    def check_compatibility(self, layout, draft_heads=None) -> None:
        super().check_compatibility(layout, draft_heads)
        if self._num_ranks > draft_heads.config.num_image_codes:
            raise ValueError(f"`top_k`/`tree_paths` ask for more candidates than the {draft_heads.config.num_image_codes} image codes.")

    def plan(self, draft_heads, layout, batch_size: int, device, drawn: bool = False) -> TreeRound:
        """The static tree of the heads' top-k candidates (`MedusaDrafter`, over the tree in use)."""
        return TreeRound(MedusaDrafter(self, draft_heads, device))
