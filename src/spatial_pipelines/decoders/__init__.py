"""Decoders: one algorithm per file, weight-free, swappable with ``Decoder.from_config(pipe.decoder.config)``."""

from .decoding_autoregressive import AutoregressiveDecoder
from .decoding_utils import DecodingState, Draft, SpatialDecoderMixin, StepOutput

#: Short names used by the CLI and benchmarks.
DECODERS = {
    "ar": AutoregressiveDecoder,
}

__all__ = ["DECODERS", "AutoregressiveDecoder", "DecodingState", "Draft", "SpatialDecoderMixin", "StepOutput"]
