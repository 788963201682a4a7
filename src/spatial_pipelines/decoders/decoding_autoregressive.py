"""Plain autoregressive decoding: one code per target pass. The reference every exact decoder must match."""

from dataclasses import dataclass
from typing import Optional

import torch
from diffusers.configuration_utils import register_to_config

from ..core.sampling import sample_from_probs, target_probs
from .decoding_utils import DecodingState, Draft, DraftKind, SpatialDecoderMixin, StepOutput


@dataclass
class AutoregressiveState(DecodingState):
    """`DecodingState` plus the one-token mask ``(1, 1)``, allocated once per generation."""

    shared_fields = ("mask",)

    mask: Optional[torch.Tensor] = None


class AutoregressiveDecoder(SpatialDecoderMixin):
    """One code per target forward; CFG rows run as one batch in the same forward.

    Takes no options; it is the baseline the speculative decoders are measured against.
    """

    short_name = "ar"  # the CLI's and benchmark specs' name (`DECODERS`)

    state_class = AutoregressiveState

    @register_to_config
    def __init__(self):
        super().__init__()

    def chain_window(self, drawn: bool = False) -> Optional[int]:
        """A chain of no drafts: one code per row per round, on the device (`spatial_pipelines.pipelines.device_chain`)."""
        return 0

    def init_state(self, layout, sampling, random, batch_size, prefix_length, device, backbone=None) -> AutoregressiveState:
        state = super().init_state(layout, sampling, random, batch_size, prefix_length, device, backbone)
        state.mask = torch.ones(1, 1, dtype=torch.bool, device=device)
        return state

    def propose(self, state: AutoregressiveState, draft_heads=None, backbone=None) -> Draft:
        index = state.num_committed - 1
        return Draft(
            input_ids=state.tokens[:, index : index + 1],  # (B, 1) a view
            position_ids=state.positions[index : index + 1],  # (1,) a view: no host-to-device copy per round
            attention_mask=state.mask,
            kind=DraftKind.CHAIN,
            depths=(0,),  # the newest committed code alone
        )

    def step(
        self,
        logits: torch.Tensor,
        hidden_states: torch.Tensor,
        draft: Optional[Draft],
        state: DecodingState,
        draft_heads=None,
        backbone=None,
    ) -> StepOutput:
        probs = target_probs(logits[:, -1], state.sampling, state.random, state.num_committed)  # (B, V)
        token = sample_from_probs(probs, state.random)  # (B,)
        state.commit(token[:, None], torch.ones_like(token))
        return StepOutput(num_accepted=1)
