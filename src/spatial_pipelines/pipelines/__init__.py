"""The generation loop (pipeline_utils) and one file per backbone family."""

from .pipeline_llamagen import LlamaGenBackbone, LlamaGenPipeline
from .pass_cost import PassCost
from .pipeline_utils import DecodingStats, PromptEmbeddings, SpatialARPipeline, SpatialBackbone, SpatialPipelineOutput

__all__ = [
    "DecodingStats",
    "LlamaGenBackbone",
    "LlamaGenPipeline",
    "PromptEmbeddings",
    "SpatialARPipeline",
    "SpatialBackbone",
    "SpatialPipelineOutput",
]
