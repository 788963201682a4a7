"""Speculative Jacobi Decoding (SJD): training-free and exact. A window of drafts is verified in one pass;
accepted drafts are committed, the first rejection is resampled from the residual, and the drafts that were
not reached are re-drawn from this pass's distribution (which becomes their proposal ``q``).

Options that keep it exact: coupled redraws (MC-SJD, arXiv 2510.24211: a redraw stays the same code when its
distribution barely moved), continued verification (SJD-PAC's adaptive continuation, arXiv 2603.18599: drafts
after the first rejection are still tested against this pass's ``p`` and kept when they pass) and a spatial first
draft (``init="heads"``: the code a vertical draft head predicted for this position when the row above was
committed) and a left anchor (``anchor="left"``: the window's first draft is pulled onto the code just committed,
with its proposal adjusted to match). A relaxed acceptance rule (LANTERN) makes it lossy.
"""

from typing import List, Optional, Union

import torch
from diffusers.configuration_utils import register_to_config

from ..core.acceptance import AcceptanceLike
from ..core.contracts import LATENT, OFFSET_LOGITS, HeadsNeed
from ..core.rounds import ChainRound
from ..core.tree import DraftTree, chain_tree, tree_from_paths
from ..utils import check_choice
from .decoding_tree import DRAFT_SIZE_CANDIDATES, TreeDecoderMixin
from .decoding_utils import AUTO, MAX_FED_TOKENS, SpatialDecoderMixin, check_draft_budget, check_draft_size, check_int, draft_through

INITS = ("random", "left", "above", "heads")
COUPLINGS = ("none", "gumbel")
ANCHORS = ("none", "left")
MAX_WINDOW = 32  # the largest window "auto" considers
# The two-rate priors of "auto" windows: ``(first, later)`` = P(draft 1 accepted), P(draft d accepted | drafts 1..d-1
# were), d > 1. Fitted on the embedded model, CPU (2-core AMD EPYC VM, fp32), and used for every checkpoint.
#: Plain SJD: measured on the embedded model v1 with a 32-draft window, 4 prompts (first draft 0.31; the later rate
#: rises from about 0.7 at the second draft to 0.85-0.95 after the fourth). Commit `4c80c36`, docs/archive.md
#: ("auto" draft sizes).
SJD_ACCEPTANCE_PRIOR = (0.3, 0.85)
#: With coupling, continuation or ``init="heads"``: the same probe, first draft 0.36-0.39.
SJD_SETTLED_PRIOR = (0.37, 0.9)
#: The first draft's rate with ``anchor="left"`` (0.35 without): embedded model v2, 40 captions, a 16-token window.
#: Commit `0e5fd09`, docs/benchmarks/archive-cost.md ("Where SJD loses codes: the first draft").
SJD_ANCHORED_FIRST_RATE = 0.42


def proactive_nodes(window: int, width: int, depth: int) -> int:
    """Fed nodes of `proactive_tree` (the root included), counted without building it: ``width + width^2 + ...`` over
    the first ``depth`` positions, then one per position (stops counting past `MAX_FED_TOKENS`)."""
    levels, level, nodes = min(depth, window), 1, 1
    for _ in range(levels):
        level *= width
        nodes += level
        if nodes > MAX_FED_TOKENS:
            return nodes
    return nodes + window - levels


def proactive_tree(window: int, width: int, depth: int) -> DraftTree:
    """SJD-PAC's window: ``width`` candidates at each of the first ``depth`` positions (their Cartesian product, a
    ``width``-ary tree), then one draft per position up to ``window`` positions, continuing the path of first
    candidates. ``width=1`` is the plain chain."""
    if width == 1:
        return chain_tree(window)
    levels, paths, tree_paths = min(depth, window), [()], []
    for _ in range(levels):
        paths = [p + (r,) for p in paths for r in range(width)]
        tree_paths += paths
    tree_paths += [(0,) * d for d in range(levels + 1, window + 1)]
    return tree_from_paths(tree_paths)


def descent_table(tree: DraftTree) -> torch.Tensor:
    """``(T, D + 1)``: for every node, the node at each depth along its first-child descent (its ancestors above it),
    continued by the path of first candidates where the descent ends early: the fed slots whose outputs redraw the
    positions after a node."""
    parents, children, depths = tree.parents.tolist(), tree.children[:, 0].tolist(), tree.depths.tolist()
    d_max = tree.max_depth
    main = [0]
    while len(main) <= d_max and children[main[-1]] >= 0:
        main.append(children[main[-1]])
    table = []
    for node in range(len(parents)):
        row, cur = [0] * (d_max + 1), node
        while cur >= 0:  # ancestors
            row[depths[cur]] = cur
            cur = parents[cur]
        cur, d = node, depths[node]
        while d < d_max:
            cur = children[cur] if cur >= 0 and children[cur] >= 0 else -1
            d += 1
            row[d] = cur if cur >= 0 else main[d]
        table.append(row)
    return torch.tensor(table, dtype=torch.long)


class JacobiDecoder(TreeDecoderMixin, SpatialDecoderMixin):
    r"""Speculative Jacobi Decoding.

    Every option is exact: a redraw follows ``p`` given everything the next verification sees, and becomes its own
    ``q``.

    Args:
        window_size (`int`, `None` or `"auto"`): drafts verified per pass (L; the paper uses 16). ``None``
            (default): the pipeline family's fixed window (`SpatialARPipeline.default_draft_sizes`; 32 where the family
            names none). ``"auto"``: the window of most codes per second on the device, up to `MAX_WINDOW`
            (`TreeDecoderMixin`, `SJD_ACCEPTANCE_PRIOR`); ``0`` drafts nothing (one code per row per round, AR's
            rounds and codes), which ``"auto"`` and `tune_decoder` pick where no window is expected to beat it.
        init (`str`): how a position entering the window is first drafted: ``"above"`` (default: a copy of the
            committed code one row above; training-free, and the fastest measured on the embedded model),
            ``"random"`` (uniform over the codes: the SJD paper's), ``"left"`` (a copy of its left neighbour's draft)
            or ``"heads"`` (the code the vertical draft head at offset 1 of `SpatialDraftHeads` or `LatentDraftHeads`
            predicted for it from the row above). ``"above"`` and ``"heads"`` fall back to a uniform draw on the first
            row. Copies and head predictions are point masses.
        coupling (`str`): how drafts not reached are redrawn from this pass's ``p``: ``"gumbel"`` (default: MC-SJD's
            Gumbel coupling: every position keeps one noise draw from entering the window until it is committed, so a
            redraw whose distribution barely moved stays the same code) or ``"none"`` (fresh randomness every time:
            the SJD paper's). ``JacobiDecoder(init="random", coupling="none", anchor="none")`` is the paper's SJD.
        continuation (`bool`): SJD-PAC's adaptive continuation: verification goes on after the first rejection;
            every later draft ``x`` is tested against this pass's ``p`` (computed after the rejected draft) and kept
            with probability ``min(1, p(x) / q(x))``, else replaced by a draw from ``norm(max(p - q, 0))``. Nothing
            more is committed this pass; the outcome is the next pass's draft, with ``q = p`` (a maximal coupling of
            the old draft and the redraw: the draft survives with probability ``1 - TV(p, q)``). With
            ``coupling="gumbel"`` a draft that is the race of its own noise is redrawn by the race, and a copied or
            head-made first draft (``init`` left, above, heads) by continuation.
        proactive_width (`int`): SJD-PAC's proactive drafting: ``K`` candidates at each of the first
            ``proactive_depth`` positions of the window, verified as a ``K``-ary tree (the later positions keep one
            draft, after the path of first candidates). The first candidate is the position's draft; the others are
            drawn without replacement from its ``q`` and verified by recursive rejection sampling (each against ``q``
            less the earlier candidates, the residual carried from sibling to sibling). ``1`` (default): off.
        proactive_depth (`int`): positions with ``K`` candidates (SJD-PAC: 2, with ``K = 3``).
        anchor (`str`): ``"left"`` (default): the window's first draft after a pass, redrawn from a distribution
            ``q`` that did not know the code just committed before it, becomes a copy of that code whenever ``q``
            rates the draft below the copy; ``q`` becomes the law of that choice (its mass below the copy moved onto
            the copy), so the draft is still verified exactly. Image codes come in runs, which the stale ``q``
            underrates. ``"none"``: the draft is kept (the SJD paper's).
        acceptance (`str`, `dict` or `AcceptanceRule`): the acceptance rule (`resolve_acceptance`): ``"exact"``
            (default), or a lossy relaxed rule such as ``{"name": "lantern", "k": 1000}`` (`LANTERN_PRESETS`).
    """

    short_name = "sjd"  # the CLI's and benchmark specs' name (`DECODERS`)

    draft_size_name = "window_size"
    # what "auto" chose on one H100 (bf16, embedded model, 2026-11-26: 33 slots): a pass over 1-256 tokens costs one
    # AR step there, so the window is bounded by what acceptance still gains, not by the pass
    default_draft_size = 32
    # the first draft is a guess, the later ones have had passes to settle (fitted on the embedded model)
    acceptance_prior = SJD_ACCEPTANCE_PRIOR
    settled_prior = SJD_SETTLED_PRIOR  # with coupling, continuation or init="heads"
    anchored_first_rate = SJD_ANCHORED_FIRST_RATE  # the first draft's with anchor="left"

    @register_to_config
    def __init__(self, window_size: Union[int, str, None] = None, init: str = "above", coupling: str = "gumbel",
                 continuation: bool = False, proactive_width: int = 1, proactive_depth: int = 2, anchor: str = "left",
                 acceptance: AcceptanceLike = "exact"):
        super().__init__()
        check_draft_size("window_size", window_size)
        if window_size == 0 and proactive_width > 1:
            raise ValueError(f"`window_size=0` drafts nothing, so it has no candidates to widen: `proactive_width` must "
                             f"be 1 with it, got {proactive_width}.")
        check_choice("init", init, INITS)
        check_choice("coupling", coupling, COUPLINGS)
        check_choice("anchor", anchor, ANCHORS)
        if not isinstance(continuation, bool):
            raise ValueError(f"`continuation` must be True or False, got {continuation!r}.")
        check_int("proactive_width", proactive_width)
        check_int("proactive_depth", proactive_depth)
        self._set_acceptance(acceptance)
        window = MAX_WINDOW if window_size == AUTO else self.default_draft_size if window_size is None else window_size
        check_draft_budget(f"`proactive_width={proactive_width}`, `proactive_depth={proactive_depth}` (a window of {window})",
                           proactive_nodes(window, proactive_width, proactive_depth))
        self._set_tree(proactive_tree(window, proactive_width, proactive_depth), window_size if window_size == AUTO else None)

    def _prior(self):
        """The two-rate prior ``(first, later)`` of this configuration: `SJD_ACCEPTANCE_PRIOR`, `SJD_SETTLED_PRIOR` with
        coupling, continuation or ``init="heads"``, the first rate at least `SJD_ANCHORED_FIRST_RATE` with the left
        anchor (proactive candidates raise the first rate to ``1 - (1 - r1)^K``)."""
        c = self.config
        settled = c.coupling != "none" or c.continuation or c.init == "heads"
        first, later = self.settled_prior if settled else self.acceptance_prior
        if c.anchor == "left":
            first = max(first, self.anchored_first_rate)
        if c.proactive_width > 1:
            first = 1 - (1 - first) ** c.proactive_width
        return first, later

    def _sized_tree(self, window: int):
        """A window of ``window`` positions; expected accepted ``r1 (1 - r^n) / (1 - r)`` under the two-rate prior."""
        c = self.config
        first, later = self._prior()
        return proactive_tree(window, c.proactive_width, c.proactive_depth), first * (1 - later**window) / (1 - later)

    def _draft_sizes(self) -> List[int]:
        # 0: rounds of no drafts, as AR's, where no window is expected to beat them (an untrained or photographic
        # checkpoint on a CPU, where a drafted slot costs); proactive candidates need a window to widen
        none = [0] if self.config.proactive_width == 1 else []
        return none + [c for c in DRAFT_SIZE_CANDIDATES if c < MAX_WINDOW] + [MAX_WINDOW]

    @property
    def window(self) -> int:
        """The window in use (``window_size``, or what ``"auto"`` resolved to): drafted positions."""
        return self.tree.max_depth

    def plan(self, draft_heads, layout, batch_size: int, device, drawn: bool = False) -> ChainRound:
        """The window as a chain (`core.rounds.ChainRound`): one draft per position, ``init`` where a position has no
        sample of its own yet. Under keyed noise every redraw is the pass's own sample, so ``coupling``,
        ``continuation`` and ``anchor`` change no image there under exact acceptance. Under drawn noise (``drawn``) or
        a relaxed rule (LANTERN) each draft is the keyed sample of its proposal ``q``, kept and tested with a keyed
        uniform of its own against ``p(x) / q(x)`` (``p~(x) / q(x)``), the left anchor applied to ``q`` and
        ``continuation`` testing every draft that is no race anew. Keyed per position, every redraw of one position
        races the same noise, as ``coupling="gumbel"`` does (``"none"`` draws the same codes there). ``init="heads"``
        guesses with the vertical head inside the round (`vertical_logits`; point masses). Proactive drafting
        (``proactive_width > 1``) makes the window a static tree of candidates."""
        c = self.config
        guess = None
        if c.init == "heads":  # the vertical head's guesses, from the hidden states that predicted the committed codes
            guess = lambda backbone, hidden, codes: self.vertical_logits(draft_heads, backbone, hidden, codes)  # noqa: E731
        width, depth = (c.proactive_width, c.proactive_depth) if c.proactive_width > 1 else (1, 0)
        return ChainRound(self.window, c.init, c.anchor == "left", c.continuation, guess, width, depth)

    def vertical_logits(self, draft_heads, backbone, hidden: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """``init="heads"``: the vertical head's logits ``(B, n, V)`` for the codes one row below ``codes`` ``(B, n)``,
        from the pre-norm hidden states that predicted them ``(B, n, D)`` (token-logit heads: the head at vertical
        offset 1 through the model's norm and output head; latent heads: their one-row-down prediction)."""
        backbone = draft_through(backbone, self)
        if draft_heads.kind == LATENT:  # predict the hidden state one row down
            return draft_heads.draft_logits(backbone, hidden, codes, "vertical", 1)[:, :, 0]
        _, feats = draft_heads(backbone.final_norm(hidden.flatten(0, 1)), [], [draft_heads.vertical_index(1)])  # (B*n, 1, D)
        return backbone.output_head(feats[:, 0]).unflatten(0, hidden.shape[:2])  # (B, n, V)

    def heads_needed(self) -> Optional[HeadsNeed]:
        """``init="heads"``: token-logit or latent heads with the vertical offset 1 (one row down); otherwise none."""
        if self.config.init != "heads":
            return None
        return HeadsNeed((OFFSET_LOGITS, LATENT), (), (1,), self._who("init"))
