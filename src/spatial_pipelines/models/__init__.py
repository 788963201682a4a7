"""Backbone models this library defines itself (families not in transformers)."""

from .transformer_llamagen import LlamaGenTransformer, LlamaGenTransformerOutput
from .vq_chameleon import ChameleonVQModel, chameleon_vq_from_hf, chameleon_vq_from_original, load_chameleon_vq, tiny_chameleon_vq
from .vq_llamagen import LlamaGenVQModel, VQEncoderOutput

__all__ = [
    "ChameleonVQModel",
    "LlamaGenTransformer",
    "LlamaGenTransformerOutput",
    "LlamaGenVQModel",
    "VQEncoderOutput",
    "chameleon_vq_from_hf",
    "chameleon_vq_from_original",
    "load_chameleon_vq",
    "tiny_chameleon_vq",
]
