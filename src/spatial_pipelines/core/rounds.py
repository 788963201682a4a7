"""What a decoder's round is (`SpatialDecoderMixin.plan`), for the one engine that runs every round on the device
(`spatial_pipelines.pipelines.generation.GenerationLoop`).

The engine owns everything a round shares: the prompt pass, the target pass (positions, end-of-row slots, the tree
mask, CFG mix, temperature), the verification on keyed noise streams, the commit, the KV cache and the syncs. A
decoder says only what it drafts, as one of these plans (SSD, whose passes are known before the first, returns its
schedule, `decoding_ssd.SSDSchedule`):

- `ChainRound`: the newest code and a chain of ``window`` drafts after it (AR: none; SJD), each the target's own
  sample from the last pass where it had one, else drafted by ``init``; SJD-PAC's proactive candidates make it a
  static tree (``width`` candidates at each of the first ``depth`` positions).
- `TreeRound`: a tree of distinct point-mass candidates a ``drafter`` drafts each round from the hidden state that
  predicted each row's newest code: a static tree (`decoding_tree.HeadDrafter`: Medusa, Hawk) or one tree per row
  grown by a drafter with a cache of its own (``per_row_trees``: EAGLE-2, ADT-Tree).
"""

from dataclasses import dataclass
from typing import Any, Callable, Optional

INITS = ("random", "left", "above", "heads")


@dataclass
class ChainRound:
    """A chain of drafts after each row's newest code.

    Args:
        window (`int`): drafts per row (0: AR).
        init (`str`): what a position with no sample of its own yet is drafted with: ``"above"`` (the code one row
            up), ``"left"`` (the draft before it), ``"random"`` (a keyed uniform draw) or ``"heads"`` (``guess``).
        anchor (`bool`): the first draft is pulled onto the newest code where its proposal rates it below that code
            (read where proposals are kept: drawn noise or a relaxed rule).
        continuation (`bool`): drafts that are no race of their position's noise are tested anew every pass (read
            where proposals are kept).
        guess (`Callable`, *optional*): ``init="heads"``: ``guess(backbone, hidden (B, n, D), codes (B, n))``, the
            logits ``(B, n, V)`` of the codes one row below ``codes`` from the hidden states that predicted them.
        width (`int`): SJD-PAC's proactive candidates per position (1: none): ``width`` candidates at each of the
            first ``depth`` positions, verified as a static tree.
        depth (`int`): positions with ``width`` candidates.
    """

    window: int
    init: str = "above"
    anchor: bool = False
    continuation: bool = False
    guess: Optional[Callable] = None
    width: int = 1
    depth: int = 0

    def __post_init__(self):
        if self.init not in INITS or (self.init == "heads") != (self.guess is not None):
            raise ValueError(f"`init` must be one of {INITS} (\"heads\" with a `guess`), got {self.init!r}.")


@dataclass
class TreeRound:
    """A tree of distinct point-mass candidates per round.

    Args:
        drafter: a `decoding_tree.HeadDrafter` (a static tree: its ``tree``, ``tree_depth`` and ``depth_counts``; called
            with the backbone, each row's hidden state that predicted its newest code ``(B, D)`` and committed count
            ``(B,)``, it returns the nodes' codes ``(B, T - 1)``, ``-1``: none offered), or a drafter with
            ``per_row_trees`` that grows each row's own tree (`decoding_eagle.EagleDrafter`). Its buffers are device
            tensors it owns (``buffers()``).
    """

    drafter: Any
