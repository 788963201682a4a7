"""Speculative Jacobi Decoding (SJD): training-free and exact. A window of drafts is verified in one pass;
accepted drafts are committed, the first rejection is resampled from the residual, and the drafts that were
not reached are re-drawn from this pass's distribution (which becomes their proposal ``q``)."""

from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F
from diffusers.configuration_utils import register_to_config

from ..core.sampling import logits_to_probs
from ..core.tree import chain_tree
from .decoding_utils import AUTO, Draft, check_draft_size, SpatialDecoderMixin, StepOutput, TreeDecoderMixin, TreeState

INITS = ("random", "left", "above")
ACCEPTANCE = ("exact",)
MAX_WINDOW = 32  # the largest window "auto" considers


@dataclass
class JacobiState(TreeState):
    """`TreeState` plus the window.

    Args:
        drafts (`torch.LongTensor` `(B, L)`): the current drafts after the newest committed code.
        q (`torch.Tensor` `(B, L + 1, V)`): column ``j + 1`` is the distribution draft ``j`` was drawn from
            (column 0, the root's, is never read): laid out like the fed window, so no copy per round.
        num_fresh (`int`): positions at the window's end still to initialise (host-side).
    """

    drafts: Optional[torch.Tensor] = None
    q: Optional[torch.Tensor] = None
    num_fresh: int = 0


class JacobiDecoder(TreeDecoderMixin, SpatialDecoderMixin):
    r"""Speculative Jacobi Decoding.

    Args:
        window_size (`int` or `"auto"`): drafts verified per pass (L; the paper uses 16). ``"auto"`` (default) picks
            the window that maximises expected codes per second from the target pass cost measured on the device
            (see `TreeDecoderMixin`), up to `MAX_WINDOW`.
        init (`str`): how a position entering the window is first drafted: ``"random"`` (uniform over the
            codes), ``"left"`` (a copy of its left neighbour's draft) or ``"above"`` (a copy of the committed
            code one row above; random on the first row).
        acceptance (`str`): ``"exact"`` (``min(1, p/q)`` with the residual ``norm(max(p - q, 0))``).
    """

    acceptance_prior = (0.7, 0.5)  # per-draft acceptance of SJD windows (a chain: no siblings)

    @register_to_config
    def __init__(self, window_size: Union[int, str] = AUTO, init: str = "random", acceptance: str = "exact"):
        super().__init__()
        check_draft_size("window_size", window_size)
        if init not in INITS:
            raise ValueError(f"`init` must be one of {INITS}, got {init!r}.")
        if acceptance not in ACCEPTANCE:
            raise ValueError(f"`acceptance` must be one of {ACCEPTANCE}, got {acceptance!r}.")
        self._set_tree(chain_tree(MAX_WINDOW if window_size == AUTO else window_size), window_size if window_size == AUTO else None)

    @property
    def window(self) -> int:
        """The window in use (``window_size``, or what ``"auto"`` resolved to)."""
        return self.tree.num_nodes - 1

    def init_state(self, layout, sampling, random, batch_size, prefix_length, device, backbone=None) -> JacobiState:
        state = super().init_state(layout, sampling, random, batch_size, prefix_length, device, backbone)
        v, L = backbone.num_image_codes, self.window
        state.drafts = torch.zeros(batch_size, L, dtype=torch.long, device=device)
        state.q = torch.full((batch_size, L + 1, v), 1.0 / v, device=device)
        state.num_fresh = L
        return state

    def _initialise(self, state: JacobiState) -> None:
        """Draft the ``num_fresh`` positions at the end of the window with the configured ``init``."""
        fresh, state.num_fresh = state.num_fresh, 0
        if fresh == 0:
            return
        drafts, q = state.drafts, state.q[:, 1:]  # (B, L), (B, L, V) views
        b, L, v = q.shape
        start = L - fresh
        if self.config.init == "random":  # uniform draws: q is uniform
            drafts[:, start:] = (state.random.uniform(fresh) * v).long().clamp_max(v - 1)
            q[:, start:] = 1.0 / v
            return
        if self.config.init == "left":  # copies of the left neighbour: point masses
            left = drafts[:, start - 1] if start > 0 else state.last_token
            codes = left[:, None].expand(b, fresh)
        else:  # the committed code one row above, or a uniform draw where there is none yet
            above = state.num_committed + torch.arange(start, L, device=drafts.device) - state.layout.width  # (fresh,)
            has = (above >= 0) & (above < state.num_committed)
            copied = state.tokens[:, above.clamp_min(0)]  # (B, fresh)
            drawn = (state.random.uniform(fresh) * v).long().clamp_max(v - 1)
            codes = torch.where(has, copied, drawn)
            q[:, start:] = torch.where(has[None, :, None], F.one_hot(codes, v).float(), 1.0 / v)
            drafts[:, start:] = codes
            return
        drafts[:, start:] = codes
        q[:, start:] = F.one_hot(codes, v).float()

    def propose(self, state: JacobiState, draft_heads=None) -> Draft:
        self._initialise(state)
        return self._tree_draft(state, torch.cat([state.last_token[:, None], state.drafts], 1))

    def step(self, logits, hidden_states, draft, state: JacobiState, draft_heads=None) -> StepOutput:
        if draft is None:
            return self._prefill_step(logits, hidden_states, state)
        probs = logits_to_probs(logits, state.sampling)  # (B, L + 1, V)
        out = self._verify_step(logits, hidden_states, draft, state, state.q, probs=probs)
        L = state.drafts.shape[1]
        n = out.num_accepted
        left = max(L - n, 0)  # drafts not reached (none when the whole window and its bonus were committed)
        if left:
            # they are re-drawn from this pass's p at the node before each (their new q); the window slides by n
            redrawn = probs[:, n : n + left]  # (B, left, V)
            noise = -torch.log(state.random.uniform(left, redrawn.shape[-1]))  # Exp(1)
            state.drafts[:, :left] = (redrawn / noise).argmax(-1)
            state.q[:, 1 : left + 1] = redrawn
        state.num_fresh = L - left
        return out
