"""Plain autoregressive decoding: one code per target pass. The reference every exact decoder must match."""

from diffusers.configuration_utils import register_to_config

from ..core.rounds import ChainRound
from .decoding_utils import SpatialDecoderMixin


class AutoregressiveDecoder(SpatialDecoderMixin):
    """One code per target forward; CFG rows run as one batch in the same forward.

    Takes no options; it is the baseline the speculative decoders are measured against.
    """

    short_name = "ar"  # the CLI's and benchmark specs' name (`DECODERS`)

    @register_to_config
    def __init__(self):
        super().__init__()

    def plan(self, draft_heads, layout, batch_size: int, device, drawn: bool = False) -> ChainRound:
        """A chain of no drafts: one code per row per round."""
        return ChainRound(window=0)
