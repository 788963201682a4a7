"""spatial_pipelines: diffusers-style pipelines that make autoregressive image models fast with (spatial)
speculative decoding."""

# diffusers looks these names up on the library a component is recorded under: bind them here.
from diffusers import DiffusionPipeline, ModelMixin, SchedulerMixin

from ._registration import register_with_diffusers
from .core import ImageTokenLayout, SamplingConfig
from .decoders import DECODERS, AutoregressiveDecoder, HawkDecoder, JacobiDecoder, MedusaDecoder, SpatialDecoderMixin, SSDDecoder
from .heads import DraftHeadsMixin, LatentDraftHeads, SpatialDraftHeads
from .models import LlamaGenTransformer, LlamaGenVQModel
from .pipelines import (
    DecodingStats,
    LlamaGenPipeline,
    SpatialARPipeline,
    SpatialBackbone,
    SpatialPipelineOutput,
)

register_with_diffusers()

__version__ = "0.1.0"

__all__ = [
    "DECODERS",
    "AutoregressiveDecoder",
    "DecodingStats",
    "DiffusionPipeline",
    "DraftHeadsMixin",
    "HawkDecoder",
    "JacobiDecoder",
    "LatentDraftHeads",
    "ImageTokenLayout",
    "LlamaGenPipeline",
    "LlamaGenTransformer",
    "LlamaGenVQModel",
    "MedusaDecoder",
    "ModelMixin",
    "SamplingConfig",
    "SchedulerMixin",
    "SpatialARPipeline",
    "SpatialBackbone",
    "SpatialDecoderMixin",
    "SpatialDraftHeads",
    "SpatialPipelineOutput",
    "SSDDecoder",
]
