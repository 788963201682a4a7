"""Backbone models this library defines itself (families not in transformers)."""

from .transformer_llamagen import LlamaGenTransformer, LlamaGenTransformerOutput
from .vq_llamagen import LlamaGenVQModel, VQEncoderOutput

__all__ = ["LlamaGenTransformer", "LlamaGenTransformerOutput", "LlamaGenVQModel", "VQEncoderOutput"]
