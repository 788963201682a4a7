"""spatial_pipelines: diffusers-style pipelines that make autoregressive image models fast with (spatial)
speculative decoding."""

# diffusers looks these names up on the library a component is recorded under: bind them here.
from diffusers import DiffusionPipeline, ModelMixin, SchedulerMixin

from ._registration import register_with_diffusers
from .core import ImageTokenLayout, SamplingConfig
from .decoders import DECODERS, ADTTreeDecoder, AutoregressiveDecoder, EagleDecoder, HawkDecoder, JacobiDecoder, MedusaDecoder, SpatialDecoderMixin, SSDDecoder
from .heads import DraftHeadsMixin, EagleDraftHead, LatentDraftHeads, SpatialDraftHeads
from .models import ChameleonVQModel, LlamaGenTransformer, LlamaGenVQModel, PatchVQModel
from .pipelines import (
    AnolePipeline,
    DecodingStats,
    Emu3Pipeline,
    JanusProPipeline,
    LlamaGenPipeline,
    LuminaMGPTPipeline,
    SpatialARPipeline,
    SpatialBackbone,
    SpatialPipelineOutput,
)

register_with_diffusers()

__version__ = "0.1.0"

__all__ = [
    "DECODERS",
    "ADTTreeDecoder",
    "AnolePipeline",
    "AutoregressiveDecoder",
    "ChameleonVQModel",
    "EagleDecoder",
    "DecodingStats",
    "DiffusionPipeline",
    "DraftHeadsMixin",
    "EagleDraftHead",
    "Emu3Pipeline",
    "HawkDecoder",
    "JacobiDecoder",
    "LatentDraftHeads",
    "ImageTokenLayout",
    "JanusProPipeline",
    "LlamaGenPipeline",
    "LlamaGenTransformer",
    "LlamaGenVQModel",
    "PatchVQModel",
    "LuminaMGPTPipeline",
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
