"""The generation loop (pipeline_utils) and one file per backbone family."""

from .backbone import PromptEmbeddings, SpatialBackbone
from .pass_cost import GPU_DRAFT_SIZES, DraftPassCost, PassCost
from .pipeline_chameleon import AnoleBackbone, AnolePipeline, ChameleonARPipeline, ChameleonBackbone
from .pipeline_emu3 import Emu3Backbone, Emu3Pipeline
from .pipeline_janus import JanusProBackbone, JanusProPipeline
from .pipeline_llamagen import LlamaGenBackbone, LlamaGenPipeline
from .pipeline_lumina_mgpt import LuminaMGPTBackbone, LuminaMGPTPipeline
from .pipeline_output import DecodingStats, SpatialPipelineOutput
from .pipeline_utils import SpatialARPipeline

__all__ = [
    "AnoleBackbone",
    "AnolePipeline",
    "ChameleonARPipeline",
    "ChameleonBackbone",
    "DecodingStats",
    "DraftPassCost",
    "GPU_DRAFT_SIZES",
    "Emu3Backbone",
    "Emu3Pipeline",
    "JanusProBackbone",
    "JanusProPipeline",
    "LlamaGenBackbone",
    "LlamaGenPipeline",
    "LuminaMGPTBackbone",
    "LuminaMGPTPipeline",
    "PassCost",
    "PromptEmbeddings",
    "SpatialARPipeline",
    "SpatialBackbone",
    "SpatialPipelineOutput",
]
