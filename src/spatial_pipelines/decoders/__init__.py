"""Decoders: one algorithm per file, weight-free, swappable with ``Decoder.from_config(pipe.decoder.config)``."""

from .decoding_autoregressive import AutoregressiveDecoder
from .decoding_adt import ADT_PRESETS, ADTTreeDecoder
from .decoding_eagle import EagleDecoder
from .decoding_hawk import HawkDecoder
from .decoding_jacobi import JacobiDecoder
from .decoding_medusa import MedusaDecoder
from .decoding_ssd import SSD_PRESETS, SSDDecoder
from .decoding_tree import TreeDecoderMixin, TreeState
from .decoding_utils import DecodingState, Draft, DraftKind, SpatialDecoderMixin, StepOutput

#: Short names used by the CLI and benchmarks.
DECODERS = {
    "ar": AutoregressiveDecoder,
    "medusa": MedusaDecoder,
    "hawk": HawkDecoder,
    "sjd": JacobiDecoder,
    "ssd": SSDDecoder,
    "eagle": EagleDecoder,
    "adt": ADTTreeDecoder,
}

__all__ = ["ADT_PRESETS", "ADTTreeDecoder", "DECODERS", "SSD_PRESETS", "SSDDecoder", "AutoregressiveDecoder", "EagleDecoder", "HawkDecoder", "JacobiDecoder", "MedusaDecoder", "TreeDecoderMixin", "TreeState", "DecodingState", "Draft", "DraftKind", "SpatialDecoderMixin", "StepOutput"]
