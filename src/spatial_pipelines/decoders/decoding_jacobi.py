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

from dataclasses import dataclass
from typing import List, Optional, Union

import torch
from diffusers.configuration_utils import register_to_config

from ..core.acceptance import AcceptanceLike
from ..core.contracts import LATENT, OFFSET_LOGITS, HeadsNeed
from ..core.sampling import logits_to_probs, one_hot, target_probs
from ..core.tree import DraftTree, chain_tree, tree_from_paths
from .decoding_tree import DRAFT_SIZE_CANDIDATES, TreeDecoderMixin, TreeState
from .decoding_utils import AUTO, MAX_FED_TOKENS, Draft, SpatialDecoderMixin, StepOutput, check_draft_budget, check_draft_size, check_int, draft_through

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
    levels = min(depth, window)
    paths = [()]
    tree_paths = []
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


@dataclass
class JacobiState(TreeState):
    """`TreeState` plus the window.

    Args:
        drafts (`torch.LongTensor` `(B, L)`): the current drafts after the newest committed code.
        q (`torch.Tensor` `(B, L + 1, V)`): column ``j + 1`` is the distribution draft ``j`` was drawn from
            (column 0, the root's, is never read): laid out like the fed window, so no copy per round.
        num_fresh (`int`): positions at the window's end still to initialise (host-side).
        noise (`torch.Tensor` `(B, L, V)`, *optional*): ``coupling="gumbel"``: the Exp(1) noise of each window
            position (``-log`` of it is a Gumbel), drawn when the position enters the window and kept until it is
            committed, so every redraw of one position races the same noise.
        raced (`torch.BoolTensor` `(B, L)`, *optional*): ``coupling="gumbel"``: the draft is the race of its own
            noise (not a copy, a head's guess or a continuation outcome).
        alternatives (`torch.LongTensor` `(B, P, K - 1)`, *optional*): proactive drafting: the other candidates of
            the first ``P`` positions, drawn without replacement from the position's ``q`` after its draft (``-1``:
            none, e.g. behind a point mass).
        descent (`torch.LongTensor` `(T, L + 1)`, *optional*): `descent_table` of the window's tree.
        candidates (`torch.LongTensor` `(B, L, K)`, *optional*): proactive drafting's buffer (allocated once) of
            every position's candidates.
        node_q (`torch.Tensor` `(B, T, V)`, *optional*): proactive drafting's buffer of every node's ``q``.
        earlier_rank (`torch.BoolTensor` `(T - 1, K)`, *optional*): proactive drafting's buffer of which ranks come
            before each node's.
        above (`torch.LongTensor` `(B, N)`, *optional*): ``init="heads"``: the code the vertical head predicted for
            each raster position when the row above was committed (``-1``: none yet).
    """

    row_fields = ("drafts", "q", "noise", "raced", "above", "alternatives", "candidates", "node_q")
    shared_fields = ("num_fresh", "descent", "earlier_rank")

    drafts: Optional[torch.Tensor] = None
    q: Optional[torch.Tensor] = None
    num_fresh: int = 0
    noise: Optional[torch.Tensor] = None
    raced: Optional[torch.Tensor] = None
    above: Optional[torch.Tensor] = None
    alternatives: Optional[torch.Tensor] = None
    descent: Optional[torch.Tensor] = None
    candidates: Optional[torch.Tensor] = None
    node_q: Optional[torch.Tensor] = None
    earlier_rank: Optional[torch.Tensor] = None


class JacobiDecoder(TreeDecoderMixin, SpatialDecoderMixin):
    r"""Speculative Jacobi Decoding.

    Every option is exact: a redraw follows ``p`` given everything the next verification sees, and becomes its own
    ``q``.

    Args:
        window_size (`int`, `None` or `"auto"`): drafts verified per pass (L; the paper uses 16). ``None``
            (default): the pipeline family's fixed window (`SpatialARPipeline.default_draft_sizes`; 32 where the family
            names none). ``"auto"`` picks the window that maximises expected codes per second from the target pass
            cost the pipeline measures on the device in the first call and the acceptance prior (`SJD_ACCEPTANCE_PRIOR`,
            fitted on the embedded model; see `TreeDecoderMixin`), up to `MAX_WINDOW`;
            `SpatialARPipeline.tune_decoder` does that measurement ahead, once, and returns a fixed window.
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
            (default), or a lossy relaxed rule such as ``{"name": "lantern", "k": 1000, "delta": 0.1}`` (paper
            settings in `LANTERN_PRESETS`).
    """

    short_name = "sjd"  # the CLI's and benchmark specs' name (`DECODERS`)

    state_class = JacobiState
    draft_size_name = "window_size"
    # what "auto" chose on one H100 (bf16, embedded model, 2026-11-26: 33 slots): a pass over 1-256 tokens costs one
    # AR step there, so the window is bounded by what acceptance still gains, not by the pass
    default_draft_size = 32
    # the first draft is a guess, the later ones have had passes to settle (fitted on the embedded model)
    acceptance_prior = SJD_ACCEPTANCE_PRIOR
    settled_prior = SJD_SETTLED_PRIOR  # with coupling, continuation or init="heads"
    anchored_first_rate = SJD_ANCHORED_FIRST_RATE  # the first draft's with anchor="left"

    @register_to_config
    def __init__(
        self,
        window_size: Union[int, str, None] = None,
        init: str = "above",
        coupling: str = "gumbel",
        continuation: bool = False,
        proactive_width: int = 1,
        proactive_depth: int = 2,
        anchor: str = "left",
        acceptance: AcceptanceLike = "exact",
    ):
        super().__init__()
        check_draft_size("window_size", window_size)
        if init not in INITS:
            raise ValueError(f"`init` must be one of {INITS}, got {init!r}.")
        if coupling not in COUPLINGS:
            raise ValueError(f"`coupling` must be one of {COUPLINGS}, got {coupling!r}.")
        if anchor not in ANCHORS:
            raise ValueError(f"`anchor` must be one of {ANCHORS}, got {anchor!r}.")
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
        return [c for c in DRAFT_SIZE_CANDIDATES if c < MAX_WINDOW] + [MAX_WINDOW]

    @property
    def window(self) -> int:
        """The window in use (``window_size``, or what ``"auto"`` resolved to): drafted positions."""
        return self.tree.max_depth

    def chain_window(self, drawn: bool = False) -> Optional[int]:
        """The window, for a round run whole on the device (`spatial_pipelines.pipelines.device_chain`): one draft per
        position and ``init`` above, left or random (`chain_drafting`). Under keyed noise every redraw is the pass's own
        sample, so ``coupling``, ``continuation`` and ``anchor`` change no image there under exact acceptance. Under
        drawn noise (``drawn``) or a relaxed rule (LANTERN) each draft is the keyed sample of its proposal ``q``, kept
        in the state and tested with a keyed uniform of its own against ``p(x) / q(x)`` (``p~(x) / q(x)``:
        `device_chain.relaxed_chain`), the left anchor applied to ``q`` and ``continuation`` testing every draft that is
        no race anew (`device_chain.continue_drafts`). Keyed per position, every redraw of one position there races the
        same noise, as ``coupling="gumbel"`` does (``"none"`` draws the same codes there). ``init="heads"`` guesses in
        the round (`device_chain.predict_above`; point masses). Proactive drafting (``proactive_width > 1``) runs the
        window as its static tree of candidates (`device_proactive.ProactiveLoop`: `chain_drafting` names ``width`` and
        ``depth``)."""
        rule = self.acceptance_rule
        if not (rule.is_exact or rule.relaxes) or not self.lossless or self.tree is None:
            return None
        return self.window

    def chain_drafting(self, draft_heads=None):
        c = self.config
        drafting = {"init": c.init, "anchor": c.anchor == "left", "continuation": c.continuation}
        if c.proactive_width > 1:  # the window's first positions hold K candidates each
            drafting.update(width=c.proactive_width, depth=c.proactive_depth)
        if c.init == "heads":  # the vertical head's guesses, from the hidden states that predicted the committed codes
            drafting["guess"] = lambda backbone, hidden, codes: self.vertical_logits(draft_heads, backbone, hidden, codes)
        return drafting

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

    def init_state(self, layout, sampling, random, batch_size, prefix_length, device, backbone=None) -> JacobiState:
        state = super().init_state(layout, sampling, random, batch_size, prefix_length, device, backbone)
        v, L = backbone.num_image_codes, self.window
        state.drafts = torch.zeros(batch_size, L, dtype=torch.long, device=device)
        state.q = torch.full((batch_size, L + 1, v), 1.0 / v, device=device)
        state.num_fresh = L
        if self.config.coupling == "gumbel":
            state.noise = torch.empty(batch_size, L, v, device=device)
            state.raced = torch.zeros(batch_size, L, dtype=torch.bool, device=device)
        if self.config.init == "heads":
            state.above = torch.full((batch_size, layout.num_tokens), -1, dtype=torch.long, device=device)
        k = self.config.proactive_width
        if k > 1:
            levels = min(self.config.proactive_depth, L)
            state.alternatives = torch.full((batch_size, levels, k - 1), -1, dtype=torch.long, device=device)
            state.descent = descent_table(state.tree).to(device)
            state.node_q = torch.empty(batch_size, state.tree.num_nodes, v, device=device)
            state.candidates = torch.full((batch_size, L, k), -1, dtype=torch.long, device=device)
            state.earlier_rank = torch.arange(k, device=device)[None] < state.node_rank[:, None]  # (T-1, K)
        return state

    def _draw_alternatives(self, state: JacobiState, q: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
        """``K - 1`` more candidates per position, without replacement from ``q`` ``(B, m, V)`` less ``first``
        ``(B, m)`` (exponential race: the top ``K - 1`` of ``q / E`` are a draw without replacement, in order);
        ``-1`` where ``q`` has nothing left."""
        rest = q.scatter(-1, first[..., None], 0.0)
        noise = -torch.log(state.random.uniform(*q.shape[1:]))  # (B, m, V) Exp(1)
        top = (rest / noise).topk(self.config.proactive_width - 1, dim=-1)
        return torch.where(top.values > 0, top.indices, -1)  # (B, m, K - 1)

    def _initialise(self, state: JacobiState) -> None:
        """Draft the ``num_fresh`` positions at the end of the window with the configured ``init``."""
        fresh, state.num_fresh = state.num_fresh, 0
        if fresh == 0:
            return
        drafts, q = state.drafts, state.q[:, 1:]  # (B, L), (B, L, V) views
        b, L, v = q.shape
        start = L - fresh
        init = self.config.init
        if state.noise is not None:  # the noise these positions keep until they are committed
            state.noise[:, start:] = -torch.log(state.random.uniform(fresh, v))  # (B, fresh, V) Exp(1)
            state.raced[:, start:] = init == "random"
        if init == "random":  # uniform draws: q is uniform
            if state.noise is not None:  # the race over a flat p: a uniform draw, coupled to the later redraws
                drafts[:, start:] = state.noise[:, start:].argmin(-1)
            else:
                drafts[:, start:] = (state.random.uniform(fresh) * v).long().clamp_max(v - 1)
            q[:, start:] = 1.0 / v
            return
        if init == "left":  # copies of the left neighbour: point masses
            left = drafts[:, start - 1] if start > 0 else state.last_token
            codes = left[:, None].expand(b, fresh)
            drafts[:, start:] = codes
            q[:, start:] = one_hot(codes, v)
            return
        # the committed code one row above, or the head's prediction for this position; a uniform draw where none
        index = (state.num_committed + torch.arange(start, L, device=drafts.device)).clamp_max(state.layout.num_tokens - 1)
        if init == "above":
            above = index - state.layout.width  # (fresh,)
            has = ((above >= 0) & (above < state.num_committed))[None].expand(b, fresh)
            guess = state.tokens[:, above.clamp_min(0)]  # (B, fresh)
        else:
            guess = state.above[:, index]  # (B, fresh)
            has = guess >= 0
        drawn = (state.random.uniform(fresh) * v).long().clamp_max(v - 1)
        codes = torch.where(has, guess, drawn)
        q[:, start:] = torch.where(has[..., None], one_hot(codes, v), 1.0 / v)
        drafts[:, start:] = codes

    @staticmethod
    def _anchor_left(state: JacobiState) -> None:
        """``anchor="left"``: the first draft ``x ~ q`` becomes ``c``, the newest committed code, where
        ``q(x) <= q(c)``. The result follows ``q'``: ``q`` on the codes ``q`` rates above ``c``, and the rest of the
        mass on ``c`` (``c`` is known before ``x`` is drawn, so ``q'`` is the draft's law given everything the next
        verification sees)."""
        left = state.last_token[:, None]  # (B, 1) the code just committed
        q = state.q[:, 1]  # (B, V) the first draft's proposal (a view)
        x = state.drafts[:, :1]  # (B, 1)
        above = q > q.gather(-1, left)  # (B, V) codes rated above the copy: they stay themselves
        moved = q.masked_fill(above, 0.0).sum(-1, keepdim=True)  # (B, 1) mass of the rest, onto the copy
        kept = above.gather(-1, x)  # (B, 1)
        state.drafts[:, :1] = torch.where(kept, x, left)
        q.masked_fill_(~above, 0.0).scatter_(-1, left, moved)
        if state.raced is not None:  # a copy is not the race of the position's noise
            state.raced[:, :1] &= kept

    def _initialise_alternatives(self, state: JacobiState, start: int) -> None:
        """Proactive candidates of the fresh positions from ``start`` that fall among the first ``P``."""
        levels = state.alternatives.shape[1]
        if start < levels:
            state.alternatives[:, start:] = self._draw_alternatives(state, state.q[:, 1 + start : 1 + levels], state.drafts[:, start:levels])

    def _predict_above(self, state: JacobiState, hidden: torch.Tensor, first: int, draft_heads, backbone) -> None:
        """``init="heads"``: the vertical head's guess for the codes one row below the ``n`` codes just committed
        from raster index ``first``, from the hidden states that predicted them ``(B, n, D)``."""
        n = hidden.shape[1]
        end = min(first + n + state.layout.width, state.layout.num_tokens)
        if first + state.layout.width >= end:  # nothing lands in the grid
            return
        logits = self.vertical_logits(draft_heads, backbone, hidden, state.tokens[:, first : first + n])  # (B, n, V)
        state.num_draft_passes += 1
        count = end - first - state.layout.width
        state.above[:, first + state.layout.width : end] = logits[:, :count].argmax(-1)

    def propose(self, state: JacobiState, draft_heads=None, backbone=None) -> Draft:
        fresh_from = state.drafts.shape[1] - state.num_fresh
        self._initialise(state)
        if state.alternatives is None:
            return self._tree_draft(state, torch.cat([state.last_token[:, None], state.drafts], 1))
        self._initialise_alternatives(state, fresh_from)
        # every node's code: candidate ``rank`` of its position (the tree is the product of the candidate lists)
        cands, levels = state.candidates, state.alternatives.shape[1]  # (B, L, K)
        cands[:, :, 0] = state.drafts
        cands[:, :levels, 1:] = state.alternatives
        pos, rank = state.node_depth, state.node_rank  # (T-1,)
        nodes = cands[:, pos, rank]  # (B, T-1)
        # each node's q: its position's q less the candidates tried before it (sampling without replacement)
        node_q = state.node_q
        node_q[:, 1:] = state.q[:, pos + 1]  # (B, T-1, V)
        earlier = torch.where(state.earlier_rank, cands[:, pos], -1)  # (B, T-1, K)
        hit = torch.zeros_like(node_q[:, 1:]).scatter_add_(-1, earlier.clamp_min(0), (earlier >= 0).float()) > 0  # add: -1s map to 0 too
        rest = node_q[:, 1:].masked_fill(hit, 0.0)
        total = rest.sum(-1, keepdim=True)
        node_q[:, 1:] = torch.where(total > 0, rest / total.clamp_min(1e-30), rest)
        return self._tree_draft(state, torch.cat([state.last_token[:, None], nodes], 1))

    def step(self, logits, hidden_states, draft, state: JacobiState, draft_heads=None, backbone=None) -> StepOutput:
        first = state.num_committed
        if draft is None:
            out = self._prefill_step(logits, hidden_states, state)
            if state.above is not None:
                self._predict_above(state, hidden_states[:, -1:], first, draft_heads, backbone)
            return out
        probs = target_probs(logits, state.sampling, state.random, state.tree.depths + first)  # (B, L + 1, V)
        continuation = self.config.continuation
        old = state.drafts.clone() if continuation else None
        proactive = state.alternatives is not None
        # proactive candidates are drawn without replacement from the pass's own distribution, which keyed noise
        # reduces to its sample: keep p itself as the proposal (verification reads only the keyed point mass)
        real = logits_to_probs(logits, state.sampling) if proactive and state.random.keyed else probs
        out = self._verify_step(logits, hidden_states, draft, state, state.node_q if proactive else state.q, probs=probs)
        n = out.num_accepted
        if state.above is not None:  # the fed slots on the accepted path predicted the n committed codes
            hidden = hidden_states[state.rows[:, None], state.accepted_path] if proactive else hidden_states[:, :n]  # (B, n, D)
            self._predict_above(state, hidden, first, draft_heads, backbone)
        L = state.drafts.shape[1]
        left = max(L - n, 0)  # drafts not reached (none when the whole window and its bonus were committed)
        if left:
            # they are re-drawn from this pass's p at the node before each (their new q); the window slides by n
            if proactive:  # from the fed slots along the first-candidate descent below the last accepted node
                slots = state.descent[state.accepted_path[:, n - 1], n : n + left]  # (B, left)
                redrawn, proposal = probs[state.rows[:, None], slots], real[state.rows[:, None], slots]  # (B, left, V)
            else:
                redrawn = proposal = probs[:, n : n + left]  # (B, left, V)
            gumbel = state.noise is not None
            if gumbel:  # the same noise as every earlier draw of these positions (the window slides by n)
                state.noise[:, :left] = state.noise[:, n : n + left].clone()
                state.raced[:, :left] = state.raced[:, n : n + left].clone()
                codes = (redrawn / state.noise[:, :left]).argmax(-1)  # (B, left)
            if continuation or not gumbel:
                fresh = -torch.log(state.random.uniform(left, redrawn.shape[-1]))  # (B, left, V) Exp(1)
            if not gumbel:
                codes = (redrawn / fresh).argmax(-1)
            if continuation:  # keep the old draft x with min(1, p(x)/q(x)), else draw from the residual
                x, q_old = old[:, n : n + left], state.q[:, n + 1 : n + 1 + left]  # (B, left), (B, left, V)
                px = redrawn.gather(-1, x[..., None]).squeeze(-1)
                qx = q_old.gather(-1, x[..., None]).squeeze(-1)
                keep = state.random.uniform(left) * qx < px  # (B, left) u < min(1, p/q) without dividing
                rest = (redrawn - q_old).clamp_min(0)
                rest = torch.where(rest.sum(-1, keepdim=True) > 0, rest, redrawn)  # p == q: never rejected anyway
                continued = torch.where(keep, x, (rest / fresh).argmax(-1))
                if gumbel:  # a raced draft stays with its race; copies and head guesses are continued
                    codes = torch.where(state.raced[:, :left], codes, continued)
                else:
                    codes = continued
            elif gumbel:  # every redraw is now the race of its position's noise
                state.raced[:, :left] = True
            state.drafts[:, :left] = codes
            state.q[:, 1 : left + 1] = proposal
            if self.config.anchor == "left":
                self._anchor_left(state)
            if proactive:
                m = min(left, state.alternatives.shape[1])
                state.alternatives[:, :m] = self._draw_alternatives(state, state.q[:, 1 : m + 1], state.drafts[:, :m])  # after any anchoring
        state.num_fresh = L - left
        return out
