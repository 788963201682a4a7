"""Speculative Jacobi Decoding (SJD): training-free and exact. A window of drafts is verified in one pass;
accepted drafts are committed, the first rejection is resampled from the residual, and the drafts that were
not reached are re-drawn from this pass's distribution (which becomes their proposal ``q``)."""

import torch
import torch.nn.functional as F
from diffusers.configuration_utils import register_to_config

from ..core.sampling import logits_to_probs
from ..core.tree import chain_tree
from .decoding_utils import DecodingState, Draft, SpatialDecoderMixin, StepOutput, TreeDecoderMixin

INITS = ("random", "left", "above")
ACCEPTANCE = ("exact",)


class JacobiDecoder(TreeDecoderMixin, SpatialDecoderMixin):
    r"""Speculative Jacobi Decoding.

    Args:
        window_size (`int`): drafts verified per pass (L; the paper uses 16).
        init (`str`): how a position entering the window is first drafted: ``"random"`` (uniform over the
            codes), ``"left"`` (a copy of its left neighbour's draft) or ``"above"`` (a copy of the committed
            code one row above; random on the first row).
        acceptance (`str`): ``"exact"`` (``min(1, p/q)`` with the residual ``norm(max(p - q, 0))``).
    """

    @register_to_config
    def __init__(self, window_size: int = 16, init: str = "random", acceptance: str = "exact"):
        super().__init__()
        if window_size < 1:
            raise ValueError(f"`window_size` must be >= 1, got {window_size}.")
        if init not in INITS:
            raise ValueError(f"`init` must be one of {INITS}, got {init!r}.")
        if acceptance not in ACCEPTANCE:
            raise ValueError(f"`acceptance` must be one of {ACCEPTANCE}, got {acceptance!r}.")
        self.tree = chain_tree(window_size)

    @property
    def max_draft_tokens(self) -> int:
        return self.config.window_size + 1

    def init_state(self, layout, sampling, random, batch_size, prefix_length, device, backbone=None) -> DecodingState:
        state = super().init_state(layout, sampling, random, batch_size, prefix_length, device, backbone)
        v = backbone.num_image_codes
        state.extras["drafts"] = torch.zeros(batch_size, self.config.window_size, dtype=torch.long, device=device)
        state.extras["q"] = torch.full((batch_size, self.config.window_size, v), 1.0 / v, device=device)
        state.extras["num_fresh"] = self.config.window_size  # positions at the window's end still to initialise
        return state

    def _initialise(self, state: DecodingState) -> None:
        """Draft the ``num_fresh`` positions at the end of the window with the configured ``init``."""
        fresh = state.extras.pop("num_fresh")
        if fresh == 0:
            return
        drafts, q = state.extras["drafts"], state.extras["q"]
        b, L, v = q.shape
        start = L - fresh
        uniform = torch.full((b, fresh, v), 1.0 / v, device=q.device)
        random_codes = (uniform / state.random.exponential(fresh, v)).argmax(-1)  # (B, fresh) uniform draws
        if self.config.init == "random":
            drafts[:, start:], q[:, start:] = random_codes, uniform
            return
        for j in range(start, L):  # copies are point masses: their q is one-hot
            if self.config.init == "left":
                left = drafts[:, j - 1] if j > 0 else state.last_token
                code = left
            else:
                above = state.num_committed + j - state.layout.width
                code = state.tokens[:, above] if 0 <= above < state.num_committed else random_codes[:, j - start]
            drafts[:, j] = code
            q[:, j] = F.one_hot(code, v).float()

    def propose(self, state: DecodingState, draft_heads=None) -> Draft:
        self._initialise(state)
        tree = self._device_tree(state)
        return self._tree_draft(state, tree, torch.cat([state.last_token[:, None], state.extras["drafts"]], 1))

    def step(self, logits, hidden_states, draft, state, draft_heads=None) -> StepOutput:
        if draft is None:
            return self._prefill_step(logits, hidden_states, state)
        q_drafts = state.extras["q"]
        q = torch.cat([q_drafts[:, :1], q_drafts], 1)  # (B, L + 1, V): the root's q is never read
        out = self._verify_step(logits, hidden_states, draft, state, q)
        L = self.config.window_size
        n = out.num_accepted
        left = max(L - n, 0)  # drafts not reached (none when the whole window and its bonus were committed)
        # they are re-drawn from this pass's p at the node before each (their new q); the window slides by n
        probs = logits_to_probs(logits, state.sampling)[:, n : n + left]  # (B, left, V)
        redraw = (probs / state.random.exponential(left, probs.shape[-1])).argmax(-1)  # (B, left)
        drafts, q_new = torch.zeros_like(state.extras["drafts"]), torch.zeros_like(q_drafts)
        drafts[:, :left], q_new[:, :left] = redraw, probs
        state.extras["drafts"], state.extras["q"] = drafts, q_new
        state.extras["num_fresh"] = L - left
        return out
