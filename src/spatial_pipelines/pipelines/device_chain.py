"""A chain decoder's rounds run whole on the device (`ChainLoop`: AR and SJD; shared parts: `device_loop.DeviceLoop`).

Each row feeds its newest code and ``L`` drafts (``L = 0``: AR) and commits the longest prefix of drafts equal to the
target's keyed samples, plus the sample after it. Under keyed noise (`keyed_sample`) that needs no random draw, so a
round (`chain_round`) is a function of device tensors with fixed shapes:

1. feed every row ``[last code, drafts]`` at its own positions (``(B, L + 1)``; a finished row too, keeping nothing);
2. one target pass, each cache row writing at its own filled slots (`StaticKVCache.track_rows_on_device`);
3. CFG mix, then each slot's keyed sample ``s`` (slot ``k`` predicts grid index ``n + k``);
4. accepted count ``a = 1 + cumprod(draft == s).sum()`` per row (``0`` once finished, never past the grid); under a
   relaxed rule (LANTERN, LANTERN++) a draft is tested against ``p~(x) / q(x)`` on a keyed stream (`relaxed_chain`);
5. commit ``s[:a]`` to the grid and the acceptance map (slots past ``a`` write a spare column: no duplicate index);
6. the next drafts: this pass's samples after the commit (SJD's redraw), then fresh ones by ``init``;
7. each cache row keeps its first ``a`` fed slots (a prefix: nothing moves)."""

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..core.acceptance import EXACT, AcceptanceRule
from ..core.kv_cache import StaticKVCache
from ..core.rounds import ChainRound
from ..core.sampling import (ACCEPT_STREAM, CONTINUE_STREAM, INIT_STREAM, RESIDUAL_STREAM, SamplingConfig, keyed_sample,
                             keyed_integer, keyed_uniform, logits_to_probs, one_hot)
from .backbone import PromptEmbeddings, SpatialBackbone
from .device_loop import DeviceLoop, DeviceState, commit_run, record_progress


#: What a draw from an already-filtered distribution samples with: its log as the logits, at temperature 1
UNIT_SAMPLING = SamplingConfig()


@dataclass
class ChainState(DeviceState):
    """`DeviceState` plus each row's drafts and what the loop's options keep beside them (``None`` where unused).

    Args:
        drafts (`torch.LongTensor` `(B, L)`): each row's drafts for the ``L`` positions after its newest code.
        q (`torch.Tensor` `(B, L, V)`, *optional*): the law each draft was drawn from (a point mass for a copy), where
            drafts are tested against their proposals (`relaxed_chain`).
        raced (`torch.BoolTensor` `(B, L)`, *optional*): the draft is its proposal's keyed sample (`continue_drafts`).
        above (`torch.LongTensor` `(B, N + 1)`, *optional*): ``init="heads"``: the head's guess for each position, made
            when the code above it was committed (``-1``: none yet; column ``N`` a spare).
    """

    drafts: torch.Tensor
    q: Optional[torch.Tensor] = None
    raced: Optional[torch.Tensor] = None
    above: Optional[torch.Tensor] = None


class ChainDrafts:
    """What a loop drafting a window of ``L`` positions keeps (`ChainLoop`, `device_proactive.ProactiveLoop`)."""

    def setup_drafts(self, backbone: SpatialBackbone, window: int, rule: AcceptanceRule, init: str, anchor: bool,
                     continuation: bool, proposals: bool, guess: Optional[Callable], device: torch.device) -> None:
        ChainRound(0, init, guess=guess)  # checks ``init`` (``"heads"`` with its ``guess``) as a plan's are checked
        self.window, self.init, self.guess = window, init, guess
        self.draft_passes_per_round = int(guess is not None)  # the head's
        self.proposals = (proposals and window > 0) or rule.relaxes  # AR tests no draft
        self.anchor, self.continuation = anchor and self.proposals, continuation and self.proposals
        self.num_codes = v = backbone.num_image_codes
        # random drafts' proposal, built once (a round allocates nothing it could keep)
        self.uniform_q = torch.full((v,), 1.0 / v, device=device)
        self.draft_offsets = torch.arange(window, device=device)  # (L,)

    def draft_fields(self, tokens: torch.Tensor) -> dict:
        """`ChainState`'s own fields, for a state whose grids are ``tokens`` ``(B, N + 1)``."""
        b, device = self.batch_size, tokens.device
        drafts = torch.zeros(b, self.window, dtype=torch.long, device=device)
        q = torch.zeros(b, self.window, self.num_codes, device=device) if self.proposals else None
        raced = torch.zeros_like(drafts, dtype=torch.bool) if self.continuation else None  # the first drafts are copies
        above = torch.full_like(tokens, -1) if self.guess is not None else None
        return {"drafts": drafts, "q": q, "raced": raced, "above": above}

    def start_rows(self, first: torch.Tensor, hidden: torch.Tensor) -> None:
        s = self.state
        if self.guess is not None:  # the prompt's last output predicted the first code: guess the one below it
            predict_above(self, hidden[: self.batch_size, None], first[:, None], torch.ones_like(first), s.committed - 1)
        index = 1 + self.draft_offsets.expand_as(s.drafts)  # (B, L) the grid index of each draft
        codes, q = fresh_drafts(self, index, s.committed, first, s.drafts)  # the first row has nothing above
        s.drafts.copy_(codes)
        if self.proposals:
            s.q.copy_(q)


class ChainLoop(ChainDrafts, DeviceLoop):
    """A chain decoder's generation (a `ChainRound` plan): `chain_round`, steps 1-7 of the module docstring.

    Args:
        window (`int`): drafts per row per round (``0``: AR).
        init (`str`): how a position entering the window is drafted (`ChainRound.init`): ``"above"`` (the code one row
            above; the newest code where none), ``"left"`` (the draft before it), ``"random"`` (a keyed uniform draw,
            `INIT_STREAM`) or ``"heads"`` (``guess``'s code).
        guess (`Callable`, *optional*): ``init="heads"``: ``guess(backbone, hidden, codes)``, the logits of the codes
            one row below ``codes`` ``(B, n)`` from the hidden states that predicted them (`predict_above`).
        anchor (`bool`), continuation (`bool`): the left anchor (`anchor_left`) and SJD-PAC's continuation
            (`continue_drafts`), where proposals are kept.
        proposals (`bool`): keep each draft's proposal ``q`` and accept a draft when a keyed uniform is below
            ``p(x) / q(x)`` (drawn noise; a relaxed rule always does), not when it equals the target's keyed sample.
        The other arguments are `DeviceLoop`'s.
    """

    def __init__(self, backbone: SpatialBackbone, window: int, sampling: SamplingConfig, seeds: torch.Tensor,
                 prefix: PromptEmbeddings, cache: StaticKVCache, round_fn: Optional[Callable] = None,
                 rule: AcceptanceRule = EXACT, neighbours: Optional[torch.Tensor] = None, init: str = "above",
                 anchor: bool = False, continuation: bool = False, proposals: bool = False, guess: Optional[Callable] = None):
        device = prefix.embeds.device
        self.setup_drafts(backbone, window, rule, init, anchor, continuation, proposals, guess, device)
        self.fed, self.max_codes = fed_slots(backbone.layout, window), window + 1
        super().__init__(backbone, sampling, seeds, prefix, cache, round_fn, rule, neighbours)
        self.mask = torch.ones(self.fed, self.fed, dtype=torch.bool, device=device).tril()  # (T, T) causal chain

    @staticmethod
    def fed_slots(layout, window: int, **_) -> int:
        """Slots a round feeds per row, before the loop is made (the cache's size)."""
        return fed_slots(layout, window)

    def new_state(self, **common) -> ChainState:
        return ChainState(**self.draft_fields(common["tokens"]), **common)

    @classmethod
    def default_round(cls) -> Callable:
        return chain_round


def fed_slots(layout, window: int) -> int:
    """Slots a chain round feeds per row: the newest code, ``window`` drafts and the end-of-row tokens among them."""
    return window + 1 + (-(-(window + 1) // layout.width) if layout.has_eol else 0)


def chain_round(loop: ChainLoop) -> None:
    """One round of a chain decoder, steps 1-7 of the module docstring, on device tensors only."""
    s, sampling, layout, cache, timer = loop.state, loop.sampling, loop.layout, loop.cache, loop.timer
    n, window = layout.num_tokens, loop.window
    active = s.committed < n  # (B,)
    codes = s.committed[:, None] + loop.code_offsets  # (B, L + 1) the grid index each code slot predicts
    start = layout.sequence_offset(s.committed - 1)  # (B,) sequence offset of the newest code
    with timer.section("forward"):  # `profile_rounds` in an eager round (a compiled round keeps no sections)
        hidden, logits = chain_forward(loop, start, codes)  # (R, L + 1, D), (R, L + 1, V) fp32
    with timer.section("accept"):
        # 3. CFG mix and every code slot's keyed sample
        logits = loop.guided(logits)  # (B, L + 1, V)
        samples = keyed_sample(logits, sampling, s.seeds, codes.clamp_max(n - 1))  # (B, L + 1)
        # 4. the accepted count: the first sample, then one more per leading draft equal to the sample at its position
        #    (with proposals, speculative sampling: each draft tested against its proposal, `relaxed_chain`)
        probs = logits_to_probs(logits, sampling) if loop.proposals else None  # (B, L + 1, V)
        if probs is not None:
            commit, matches = relaxed_chain(loop, probs, codes.clamp_max(n - 1))  # (B, L + 1), (B,)
        else:
            commit, matches = samples, (s.drafts == samples[:, :window]).long().cumprod(1).sum(1)  # (B,)
        # 5. commit the run (0 once finished)
        accepted = commit_run(loop, commit, matches, active)  # (B,)
        committed = s.committed + accepted  # (B,)
    # 6. the next drafts: this pass's samples after the run, then fresh ones by the decoder's init
    if window:
        with timer.section("draft"):
            if loop.guess is not None:  # the head guesses the codes one row below the run
                predict_above(loop, hidden[: loop.batch_size], commit, accepted, s.committed)
            next_drafts(loop, samples, accepted, committed, probs)
    # 7. each cache row keeps the fed slots up to its newest code (a prefix), its CFG twin the same
    kept = (layout.sequence_offset(committed - 1) - start) * active  # (B,) = accepted without EOLs
    s.committed.copy_(committed)
    record_progress(s)
    with timer.section("kv"):
        cache.keep_prefixes(kept.repeat(2) if sampling.do_cfg else kept)


def chain_forward(loop: ChainLoop, start: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Steps 1-2 of a chain round: every row's newest code and drafts fed from sequence offset ``start`` ``(B,)``, one
    target pass. Returns, for the slot predicting each code slot ``codes`` ``(B, L + 1)`` (grid indices), the hidden
    states ``(R, L + 1, D)`` and the logits ``(R, L + 1, V)`` fp32."""
    s, backbone, sampling, layout, cache = loop.state, loop.backbone, loop.sampling, loop.layout, loop.cache
    n, width, window = layout.num_tokens, layout.width, loop.window
    # 1. feed the newest code and the drafts at each row's own positions (with end-of-row tokens: every sequence
    #    position from the newest code's on, an EOL where a row ends; past the grid, positions are clamped)
    offset = start[:, None] + loop.slots  # (B, T) sequence offset of every fed slot
    position_ids = loop.first_position + offset.clamp_max(layout.sequence_length - 1)  # (B, T)
    if layout.has_eol:
        row, column = offset // layout.row_stride, offset % layout.row_stride
        is_eol = column == width  # (B, T)
        draft = row * width + column.clamp_max(width - 1) - s.committed[:, None]  # (B, T) which draft a slot feeds
        fed = torch.cat([s.last[:, None], s.drafts, s.last[:, None]], 1).gather(1, (draft + 1).clamp(0, window + 1))
        predicting = (layout.sequence_offset(codes.clamp_max(n - 1)) - 1 - start[:, None]).clamp(0, loop.fed - 1)
    else:
        fed = torch.cat([s.last[:, None], s.drafts], 1)  # (B, T)
    embeds = backbone.embed_image_tokens(fed.repeat(2, 1) if sampling.do_cfg else fed)  # (R, T, D)
    if layout.has_eol:
        eol = is_eol.repeat(2, 1) if sampling.do_cfg else is_eol
        embeds = torch.where(eol[..., None], backbone.eol_embedding.to(embeds.dtype), embeds)
    # 2. one target pass, each cache row writing after its own filled slots (the CFG rows verify the same drafts)
    position_ids = position_ids.repeat(2, 1) if sampling.do_cfg else position_ids  # (R, T)
    hidden = backbone.forward(embeds, position_ids, loop.mask, None, cache)  # (R, T, D)
    if layout.has_eol:  # the slot before each code predicts it (after a row's end: the EOL's slot)
        rows = predicting.repeat(2, 1) if sampling.do_cfg else predicting  # (R, L + 1)
        hidden = hidden.gather(1, rows[..., None].expand(-1, -1, hidden.shape[-1]))  # (R, L + 1, D)
    return hidden, backbone.image_logits(hidden)  # (R, L + 1, D), (R, L + 1, V) fp32


def predict_above(loop: ChainLoop, hidden: torch.Tensor, codes: torch.Tensor, accepted: torch.Tensor,
                  first: torch.Tensor) -> None:
    """``init="heads"``: the head's guess for the code one row below each of the first ``accepted`` ``(B,)`` of the
    codes ``codes`` ``(B, C)`` committed from grid index ``first`` ``(B,)`` on, from the hidden states that predicted
    them ``(B, C, D)`` (the rest write the spare column)."""
    s, n = loop.state, loop.layout.num_tokens
    offsets = loop.code_offsets[: codes.shape[1]]  # (C,)
    guess = loop.guess(loop.backbone, hidden, codes).argmax(-1)  # (B, C)
    below = first[:, None] + offsets + loop.layout.width  # (B, C) the grid index one row below each code
    ok = (offsets < accepted[:, None]) & (below < n)
    s.above.scatter_(1, torch.where(ok, below, n), torch.where(ok, guess, -1))


def next_drafts(loop: ChainLoop, samples: torch.Tensor, accepted: torch.Tensor, committed: torch.Tensor,
                probs: Optional[torch.Tensor]) -> None:
    """Step 6 of a chain round: each row's next drafts are this pass's samples ``(B, L + 1)`` after its ``accepted``
    codes (with ``probs`` ``(B, L + 1, V)``, their ``p`` as proposals), then fresh drafts (`place_drafts`)."""
    s, window = loop.state, loop.window
    source = accepted[:, None] + loop.draft_offsets  # (B, L) code slot whose sample is the draft's
    redrawn = samples.gather(1, source.clamp_max(window))  # (B, L)
    # the draft before the first fresh one: the last redraw, or the newest code when every draft was accepted
    before = torch.where(accepted <= window, samples[:, window], s.last)  # (B,)
    drawn_from = None
    if probs is not None:
        drawn_from = probs.gather(1, source.clamp_max(window)[..., None].expand(-1, -1, probs.shape[-1]))  # (B, L, V)
    place_drafts(loop, redrawn, drawn_from, source, committed, before)


def place_drafts(loop: ChainLoop, redrawn: torch.Tensor, drawn_from: Optional[torch.Tensor], source: torch.Tensor,
                 committed: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    """The next drafts: where the predicting slot ``source`` ``(B, L)`` lies in the window, the redraw ``redrawn``
    (with kept proposals ``drawn_from`` ``(B, L, V)``, continued: `continue_drafts`), else a fresh draft after the
    ``committed`` ``(B,)`` codes and the draft ``before``; then the left anchor. Returns the grid indices ``(B, L)``."""
    s = loop.state
    here = source <= loop.window  # (B, L)
    index = committed[:, None] + loop.draft_offsets  # (B, L) the grid index of each next draft
    fresh, q = fresh_drafts(loop, index, committed, before, s.drafts)  # (B, L), (B, L, V) or None
    if drawn_from is not None:
        if loop.continuation:  # before the drafts and proposals move: the old ones are tested
            redrawn = continue_drafts(loop, redrawn, drawn_from, source, index)
        s.q.copy_(torch.where(here[..., None], drawn_from, q))
    s.drafts.copy_(torch.where(here, redrawn, fresh))
    if loop.anchor:
        anchor_left(s)
    return index


def fresh_drafts(loop: ChainLoop, index: torch.Tensor, committed: torch.Tensor, before: torch.Tensor, spare: torch.Tensor):
    """Drafts by the loop's ``init`` for grid indices ``index`` ``(B, L)``: the code one row above (the newest code
    where none of the ``committed`` ``(B,)`` is), ``before`` ``(B,)``, a keyed uniform draw, or the head's guess.
    Returns the codes (``spare``'s shape) and, where proposals are kept, their law ``(B, L, V)`` (else ``None``)."""
    s, n, v = loop.state, loop.layout.num_tokens, loop.num_codes
    if loop.init == "random":
        codes = keyed_integer(s.seeds ^ INIT_STREAM, index.clamp_max(n - 1), v)  # (B, L)
        return codes, (loop.uniform_q.expand(*codes.shape, v) if loop.proposals else None)
    if loop.init == "left":
        codes = before[:, None].expand_as(spare)
    elif loop.init == "heads":  # the head's guess, where the code above was committed; the newest code where not
        guess = s.above.gather(1, index.clamp_max(n))  # (B, L)
        codes = torch.where(guess >= 0, guess, s.last[:, None])
    else:
        above = index - loop.layout.width  # (B, L) grid index one row above each draft
        known = (above >= 0) & (above < committed[:, None])
        codes = torch.where(known, s.tokens.gather(1, above.clamp(0, n)), s.last[:, None])  # (B, L)
    return codes, (one_hot(codes, v) if loop.proposals else None)


def anchor_left(s: ChainState) -> None:
    """``anchor="left"`` on the first draft ``x ~ q``: it becomes ``c``, the newest committed code, where
    ``q(x) <= q(c)``; its proposal becomes the law of that choice, ``q`` on the codes it rates above ``c`` and the rest
    of its mass on ``c`` (``c`` is known before ``x`` is drawn, so the draft is still verified exactly)."""
    left = s.last[:, None]  # (B, 1) the code just committed
    q = s.q[:, 0]  # (B, V)
    x = s.drafts[:, :1]  # (B, 1)
    above = q > q.gather(-1, left)  # (B, V) codes rated above the copy: they stay themselves
    moved = q.masked_fill(above, 0.0).sum(-1, keepdim=True)  # (B, 1) the rest's mass, onto the copy
    kept = above.gather(-1, x)  # (B, 1)
    s.drafts[:, :1] = torch.where(kept, x, left)
    s.q[:, 0] = q.masked_fill(~above, 0.0).scatter(-1, left, moved)
    if s.raced is not None:  # a copy is not the race of the position's noise
        s.raced[:, :1] &= kept


def continue_drafts(loop: ChainLoop, redrawn: torch.Tensor, p: torch.Tensor, source: torch.Tensor, index: torch.Tensor):
    """SJD-PAC's continuation, step 6 with kept proposals: a next draft (grid indices ``index`` ``(B, L)``) whose code
    slot ``source`` fed an old draft ``x ~ q`` that is no race of its position's noise is kept when a keyed uniform
    ``u < p(x) / q(x)`` (``p`` ``(B, L, V)``: this pass's), else replaced by a keyed draw from ``norm(max(p - q, 0))``:
    a maximal coupling, so the outcome follows ``p``. Races keep the redraw ``redrawn``. Keyed by position and round
    (`CONTINUE_STREAM`): a position may be continued in many rounds. Redraws become raced; the rest not."""
    s, window, n = loop.state, loop.window, loop.layout.num_tokens
    old = source.clamp_max(window - 1)  # (B, L) the old draft at each position (where source < L)
    tested = (source < window) & ~s.raced.gather(1, old)  # (B, L) an old draft that is no race
    x = s.drafts.gather(1, old)  # (B, L)
    q_old = s.q.gather(1, old[..., None].expand_as(p))  # (B, L, V)
    px, qx = p.gather(-1, x[..., None])[..., 0], q_old.gather(-1, x[..., None])[..., 0]  # (B, L)
    key = index.clamp_max(n - 1) * (n + 1) + s.rounds.clamp_max(n)  # (B, L) one key per position and round
    u = keyed_uniform(s.seeds ^ CONTINUE_STREAM, key)  # (B, L)
    rest = (p - q_old).clamp_min(0)
    rest = torch.where(rest.sum(-1, keepdim=True) > 0, rest, p)  # p == q: never rejected anyway
    drawn = keyed_sample(rest.log(), UNIT_SAMPLING, s.seeds ^ CONTINUE_STREAM ^ RESIDUAL_STREAM, key)  # (B, L)
    continued = torch.where(u * qx < px, x, drawn)  # u < min(1, p/q) without dividing
    s.raced.copy_((source <= window) & ~tested)  # the redraws; fresh drafts are copies or draws of their own
    return torch.where(tested, continued, redrawn)


def relaxed_chain(loop: ChainLoop, probs: torch.Tensor, index: torch.Tensor):
    """Step 4 under a relaxed rule (LANTERN, LANTERN++): draft ``x ~ q`` is accepted when a keyed uniform
    ``u < p~_x(x) / q(x)``; the first rejected position takes a keyed draw from ``norm(max(p~_x - q, 0))``, a row that
    accepts every draft a draw from the next position's ``p``: speculative sampling of the relaxed target ``p~``. The
    streams are their own (`ACCEPT_STREAM`, `RESIDUAL_STREAM`): a draft was drawn with its position's target noise, and
    a test on that same noise would couple the two and move more than the rule allows.

    Args:
        probs (`torch.Tensor` `(B, L + 1, V)`): the pass's ``p`` at every code slot.
        index (`torch.LongTensor` `(B, L + 1)`): the grid index each slot predicts (clamped to the grid).

    Returns the codes each slot commits ``(B, L + 1)`` (the drafts, then the draw) and the accepted drafts ``(B,)``."""
    s, rule, window = loop.state, loop.rule, loop.window
    relaxed = rule.relax(probs[:, :window], s.drafts, loop.neighbours)  # (B, L) the drafts' claims
    qx = s.q.gather(2, s.drafts[..., None])[..., 0]  # (B, L)
    u = keyed_uniform(s.seeds ^ ACCEPT_STREAM, index[:, :window])  # (B, L)
    matches = (u * qx < relaxed.mass).long().cumprod(1).sum(1)  # (B,) u < min(1, p~/q) without dividing
    rest = (relaxed.target(probs[:, :window], s.drafts) - s.q).clamp_min(0)  # (B, L, V)
    rest = torch.where(rest.sum(-1, keepdim=True) > 0, rest, probs[:, :window])  # p~ == q: never rejected anyway
    rest = torch.cat([rest, probs[:, window:]], 1)  # (B, L + 1, V) past the window: the next position's p
    left = rest.gather(1, matches[:, None, None].expand(-1, 1, rest.shape[-1]))  # (B, 1, V)
    drawn = keyed_sample(left.log(), UNIT_SAMPLING, s.seeds ^ RESIDUAL_STREAM, index.gather(1, matches[:, None]))  # (B, 1)
    commit = torch.cat([s.drafts, drawn], 1)  # (B, L + 1)
    return torch.where(loop.code_offsets < matches[:, None], commit, drawn), matches
