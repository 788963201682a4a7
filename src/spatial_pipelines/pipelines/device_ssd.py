"""SSD's passes run whole on the device (`SSDLoop`; shared parts: `device_loop.DeviceLoop`).

SSD's passes do not depend on what they accept: every row takes the same passes (`SSDDecoder.plan`, written out
before the first, like a diffusers scheduler's timesteps), so the rows run them in lockstep and the host knows what
a pass feeds and where. A pass (`ssd_round`) is a function of device tensors with fixed shapes:

1. the first pass of a block drafts it (`draft_block`): a first-row chunk from the newest code through the heads'
   horizontal offsets, later rows from the row above through their vertical offsets; the heads' argmax, or
   (``draft="sample"``) a keyed draw from their ``q`` (`DRAFT_STREAM`);
2. every row feeds its newest code and the block's first codes at its own positions; one target pass (`ssd_forward`);
3. a verification pass (`repair_block`) tests every block code on its own: ``x`` stays when a keyed uniform
   ``u < p(x) / q(x)``, else becomes a keyed draw from ``norm(max(p - q, 0))`` (greedy: the argmax); ``q`` becomes
   ``p``; the cache keeps none of its slots;
4. a commit pass (`commit_block`) commits the fed codes, on the first row also the keyed sample of its last output,
   and keeps their hidden states for later drafts; the cache keeps the fed slots before the new newest code.

Passes of one shape (`SSDPass.shape`) run one graph, reading it from the current phase's host ints (`SSDPhase`)."""

from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch

from ..core.kv_cache import StaticKVCache
from ..core.sampling import (ACCEPT_STREAM, DRAFT_STREAM, RESIDUAL_STREAM, SamplingConfig, keyed_sample, keyed_uniform,
                             logits_to_probs, one_hot)
from ..decoders.decoding_ssd import SSDPass, SSDSchedule
from .backbone import PromptEmbeddings, SpatialBackbone
from .device_chain import UNIT_SAMPLING
from .device_loop import DeviceLoop, DeviceState, record_progress


@dataclass
class SSDState(DeviceState):
    """`DeviceState` plus the block being repaired and what drafts it.

    Args:
        hidden (`torch.Tensor` `(B, N, D)`): ``h_j``, the pre-norm hidden state whose logits drew code ``j``.
        block (`torch.LongTensor` `(B, L)`): the drafted codes being repaired (code ``k``: index ``committed + k``).
        q (`torch.Tensor` `(B, L, V)`, *optional*): the law each block code follows (a point mass for an argmax draft);
            ``None`` when greedy.
    """

    hidden: torch.Tensor
    block: torch.Tensor
    q: Optional[torch.Tensor] = None


@dataclass
class SSDPhase:
    """The host ints a pass's graph is made for: one object per `SSDPass.shape`.

    Args:
        fed (`int`), commit (`bool`), bonus (`bool`), draft (`str`, *optional*), drafted (`int`), block (`int`): as
            in `SSDPass`.
        slots (`int`): slots the pass feeds per row: the newest code, ``fed`` codes and the end-of-row tokens.
    """

    fed: int
    commit: bool
    bonus: bool
    draft: Optional[str]
    drafted: int
    block: int
    slots: int

    @property
    def codes(self) -> int:
        """Codes the pass judges (a verification pass) or commits (a commit pass)."""
        return self.fed + int(self.bonus)


def pass_slots(layout, p: SSDPass) -> int:
    """Slots the pass ``p`` feeds per row: the sequence positions from its newest code's to its last fed code's, and
    the end-of-row token after that one where it ends a row."""
    newest = p.committed - 1
    last = newest + p.fed
    trailing = int(layout.has_eol and (last + 1) % layout.width == 0)
    return layout.sequence_offset(last) - layout.sequence_offset(newest) + 1 + trailing


class SSDLoop(DeviceLoop):
    """SSD's generation on the device: `ssd_round`, pass after pass of the schedule.

    Args:
        schedule (`SSDSchedule`): the passes after the prompt's and how drafts are made.
        draft_heads (`LatentDraftHeads`): the heads (`draft_logits`).
        The other arguments are `DeviceLoop`'s.
    """

    def __init__(self, backbone: SpatialBackbone, schedule: SSDSchedule, sampling: SamplingConfig, seeds: torch.Tensor,
                 prefix: PromptEmbeddings, cache: StaticKVCache, round_fn: Optional[Callable] = None, draft_heads=None):
        layout = backbone.layout
        self.draft_heads, self.sample_drafts = draft_heads, schedule.sample_drafts
        shapes = {}
        self.plan: List[Tuple[int, SSDPhase]] = []  # (codes committed before the pass, its phase), in order
        for p in schedule.passes:
            slots = pass_slots(layout, p)
            phase = shapes.get(p.shape + (slots,))
            if phase is None:
                phase = shapes[p.shape + (slots,)] = SSDPhase(p.fed, p.commit, p.bonus, p.draft, p.drafted, p.block, slots)
            self.plan.append((p.committed, phase))
        self.phases = list(shapes.values())
        self.fed = self.fed_slots(layout, schedule)
        self.max_codes = max([ph.codes for ph in self.phases if ph.commit], default=1)
        self.block_length = max([ph.block for ph in self.phases], default=0)
        self.num_codes = backbone.num_image_codes
        self.hidden_size, self.hidden_dtype = prefix.embeds.shape[-1], prefix.embeds.dtype
        self.phase = self.plan[0][1] if self.plan else None  # the pass about to run (`write_bound` moves it)
        super().__init__(backbone, sampling, seeds, prefix, cache, round_fn)
        device = prefix.embeds.device
        # constants of every pass, built once: nothing is made from Python values inside a round
        self.mask = torch.ones(self.fed, self.fed, dtype=torch.bool, device=device).tril()  # (T, T) causal chain
        self.offsets = torch.arange(max(self.block_length, self.max_codes, layout.width), device=device)  # (C,)
        self.key_stride = len(self.plan) + 1  # a keyed draw's key: grid index * stride + pass

    @staticmethod
    def fed_slots(layout, schedule: SSDSchedule, **_) -> int:
        """Slots the widest pass feeds per row, before the loop is made (the cache's size)."""
        return max([pass_slots(layout, p) for p in schedule.passes], default=1)

    def new_state(self, **common) -> SSDState:
        b, device = self.batch_size, common["tokens"].device
        common["accepted"] = torch.zeros(len(self.plan) + 1, b, dtype=torch.long, device=device)  # one row per pass
        hidden = torch.zeros(b, self.layout.num_tokens, self.hidden_size, dtype=self.hidden_dtype, device=device)
        block = torch.zeros(b, max(self.block_length, 1), dtype=torch.long, device=device)
        q = None if self.sampling.greedy else torch.zeros(*block.shape, self.num_codes, device=device)
        return SSDState(hidden=hidden, block=block, q=q, **common)

    @classmethod
    def default_round(cls) -> Callable:
        return ssd_round

    def start_rows(self, first: torch.Tensor, hidden: torch.Tensor) -> None:
        self.state.hidden[:, 0] = hidden[: self.batch_size].to(self.hidden_dtype)  # h_0 drew code 0

    def write_bound(self) -> int:
        """Makes the next pass's phase current and returns where its writes end: the rows run in lockstep, so the host
        knows every row's filled slots (the prompt, and the codes and end-of-row tokens before the newest code)."""
        committed, self.phase = self.plan[self.num_rounds]
        return self.prefix_length + self.layout.sequence_offset(committed - 1) + self.phase.slots

    def rounds_needed(self, slowest: int) -> int:
        return len(self.plan) - self.num_rounds

    def row_passes(self, accepted: torch.Tensor) -> List[int]:
        return [accepted.shape[0]] * self.batch_size  # every row takes every pass, verification passes included

    def draft_passes(self, rounds: int) -> int:
        return sum(1 for _, phase in self.plan[:rounds] if phase.draft is not None)


def ssd_round(loop: SSDLoop) -> None:
    """One pass of SSD's schedule, steps 1-4 of the module docstring, on device tensors only."""
    phase, timer = loop.phase, loop.timer
    if phase.draft is not None:
        with timer.section("draft"):  # `profile_rounds` in an eager round (a compiled round keeps no sections)
            draft_block(loop, phase)
    with timer.section("forward"):
        index, start, hidden, logits = ssd_forward(loop, phase)
    with timer.section("accept"):
        if phase.commit:
            commit_block(loop, phase, index, start, hidden, logits)
        else:
            repair_block(loop, phase, index, logits)
    record_progress(loop.state)


def draft_block(loop: SSDLoop, phase: SSDPhase) -> None:
    """Step 1: the block's ``phase.block`` codes drafted from the committed ones (the rows share their cursor): a
    first-row chunk from the newest code (``phase.drafted`` horizontal offsets), or ``phase.drafted`` rows, one code
    per column, from the completed row above; the heads' argmax, or keyed draws from their ``q``."""
    s, layout, sampling = loop.state, loop.layout, loop.sampling
    cursor = s.committed[:1]  # (1,) the rows run in lockstep
    if phase.draft == "horizontal":
        source = cursor - 1  # (1,) the newest code
    else:
        source = cursor - layout.width + loop.offsets[: layout.width]  # (W,) the row above
    logits = loop.draft_heads.draft_logits(loop.backbone, s.hidden[:, source], s.tokens[:, source], phase.draft,
                                           phase.drafted, source)  # (B, n, K, V) fp32
    logits = logits[:, 0] if phase.draft == "horizontal" else logits.transpose(1, 2).flatten(1, 2)  # (B, L, V) row-major
    if loop.sample_drafts and not sampling.greedy:
        logits = logits / loop.temperature if loop.temperature is not None else logits
        index = s.committed[:, None] + loop.offsets[: phase.block]  # (B, L) the grid index of each draft
        codes = keyed_sample(logits, sampling, s.seeds ^ DRAFT_STREAM, index)  # (B, L) a draw from q
        q = logits_to_probs(logits, sampling)  # (B, L, V)
    else:
        codes = logits.argmax(-1)  # (B, L)
        q = one_hot(codes, loop.num_codes) if s.q is not None else None  # point masses
    s.block[:, : phase.block] = codes
    if s.q is not None:
        s.q[:, : phase.block] = q


def ssd_forward(loop: SSDLoop, phase: SSDPhase):
    """Step 2: every row's newest code and its block's first ``phase.fed`` codes fed at its own positions, one target
    pass. Returns the grid index of each code the pass judges or commits ``(B, C)``, the newest code's sequence offset
    ``(B,)``, and the hidden states ``(R, C, D)`` and CFG-mixed logits ``(B, C, V)`` (fp32) that predict those codes."""
    s, backbone, sampling, layout, cache = loop.state, loop.backbone, loop.sampling, loop.layout, loop.cache
    n, t = phase.fed, phase.slots
    start = layout.sequence_offset(s.committed - 1)  # (B,) sequence offset of the newest code
    offset = start[:, None] + loop.slots[:t]  # (B, T) sequence offset of every fed slot
    fed = torch.cat([s.last[:, None], s.block[:, :n]], 1)  # (B, 1 + n)
    if layout.has_eol:  # every sequence position from the newest code's on, an EOL where a row ends
        row, column = offset // layout.row_stride, offset % layout.row_stride
        is_eol = column == layout.width  # (B, T)
        code = row * layout.width + column.clamp_max(layout.width - 1) - s.committed[:, None]  # (B, T) -1: the newest
        fed = fed.gather(1, (code + 1).clamp(0, n))  # (B, T)
    embeds = backbone.embed_image_tokens(fed.repeat(2, 1) if sampling.do_cfg else fed)  # (R, T, D)
    if layout.has_eol:
        eol = is_eol.repeat(2, 1) if sampling.do_cfg else is_eol
        embeds = torch.where(eol[..., None], backbone.eol_embedding.to(embeds.dtype), embeds)
    position_ids = loop.first_position + offset  # (B, T)
    position_ids = position_ids.repeat(2, 1) if sampling.do_cfg else position_ids  # (R, T)
    hidden = backbone.forward(embeds, position_ids, loop.mask[:t, :t], None, cache)  # (R, T, D)
    index = s.committed[:, None] + loop.offsets[: phase.codes]  # (B, C) grid index of each judged code
    if layout.has_eol:  # the slot before each code predicts it (a row's first code: the EOL before it)
        slots = layout.sequence_offset(index) - 1 - start[:, None]  # (B, C)
        slots = slots.repeat(2, 1) if sampling.do_cfg else slots  # (R, C)
        hidden = hidden.gather(1, slots[..., None].expand(-1, -1, hidden.shape[-1]))  # (R, C, D)
    else:
        hidden = hidden[:, : phase.codes]  # (R, C, D)
    logits = loop.guided(backbone.image_logits(hidden))  # (B, C, V)
    return index, start, hidden, logits


def repair_block(loop: SSDLoop, phase: SSDPhase, index: torch.Tensor, logits: torch.Tensor) -> None:
    """Step 3, a verification pass: every block code tested on its own against this pass's ``p`` ``logits``
    ``(B, n, V)`` at grid indices ``index`` ``(B, n)`` (`accept_independently` on keyed streams); nothing is committed
    and the cache keeps nothing (the fed slots were never made valid)."""
    s, sampling, n = loop.state, loop.sampling, phase.fed
    x = s.block[:, :n]  # (B, n)
    if s.q is None:  # greedy: p is a point mass on the argmax, which every test lands on
        repaired = logits.argmax(-1)  # (B, n)
    else:
        p, q = logits_to_probs(logits, sampling), s.q[:, :n]  # (B, n, V)
        px, qx = p.gather(-1, x[..., None])[..., 0], q.gather(-1, x[..., None])[..., 0]  # (B, n)
        key = index * loop.key_stride + s.rounds  # (B, n) one key per position and pass: tested in many passes
        u = keyed_uniform(s.seeds ^ ACCEPT_STREAM, key)  # (B, n)
        rest = (p - q).clamp_min(0)
        rest = torch.where(rest.sum(-1, keepdim=True) > 0, rest, p)  # p == q: never rejected anyway
        drawn = keyed_sample(rest.log(), UNIT_SAMPLING, s.seeds ^ RESIDUAL_STREAM, key)  # (B, n) from norm(max(p - q, 0))
        repaired = torch.where(u * qx < px, x, drawn)  # u < min(1, p/q) without dividing
        s.q[:, :n] = p  # every code now follows this pass's p: the next pass tests against it
    s.block[:, :n] = repaired
    s.rounds.add_(1)  # the pass's row of `accepted` stays 0


def commit_block(loop: SSDLoop, phase: SSDPhase, index: torch.Tensor, start: torch.Tensor, hidden: torch.Tensor,
                 logits: torch.Tensor) -> None:
    """Step 4, a commit pass: the fed codes (and with ``phase.bonus`` the keyed sample of the last output) committed at
    grid indices ``index`` ``(B, C)``, with the hidden states that drew them ``(R, C, D)``; the cache keeps the fed slots
    before the new newest code (fed first next pass)."""
    s, layout, m, b = loop.state, loop.layout, phase.fed, loop.batch_size
    codes = s.block[:, :m]  # (B, m)
    if phase.bonus:  # the code after the chunk, drawn exactly from the pass's last output
        bonus = keyed_sample(logits[:, m], loop.sampling, s.seeds, index[:, m])  # (B,)
        codes = torch.cat([codes, bonus[:, None]], 1)  # (B, C)
    accepted = index[:, -1] + 1 - s.committed  # (B,) = C, from the state: no tensor made from a host int
    s.tokens.scatter_(1, index, codes)
    s.acceptance_map.scatter_(1, index, accepted[:, None].expand_as(index))
    s.hidden.scatter_(1, index[..., None].expand(-1, -1, s.hidden.shape[-1]), hidden[:b].to(s.hidden.dtype))
    s.rounds.add_(1)
    s.accepted.index_copy_(0, s.rounds[None], accepted[None])
    s.last.copy_(codes[:, -1])
    s.committed.add_(accepted)
    if phase.block > m:  # staged: the rows left move to the front, their q with them
        rest = phase.block - m
        s.block[:, :rest] = s.block[:, m : phase.block].clone()  # a copy first: the two ranges overlap
        if s.q is not None:
            s.q[:, :rest] = s.q[:, m : phase.block].clone()
    with loop.timer.section("kv"):  # the fed slots up to the new newest code (a prefix), its CFG twin the same
        kept = layout.sequence_offset(index[:, -1]) - start  # (B,)
        loop.cache.keep_prefixes(kept.repeat(2) if loop.sampling.do_cfg else kept)
