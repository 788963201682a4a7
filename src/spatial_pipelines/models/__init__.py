"""Backbone models this library defines itself (families not in transformers)."""

from .transformer_llamagen import LlamaGenTransformer, LlamaGenTransformerOutput
from .vq_chameleon import ChameleonVQModel, chameleon_vq_from_hf, chameleon_vq_from_original, load_chameleon_vq, tiny_chameleon_vq
from .vq_llamagen import LlamaGenVQModel, VQEncoderOutput
from .vq_patch import PatchVQModel

__all__ = [
    "ChameleonVQModel",
    "LlamaGenTransformer",
    "LlamaGenTransformerOutput",
    "LlamaGenVQModel",
    "PatchVQModel",
    "VQEncoderOutput",
    "chameleon_vq_from_hf",
    "chameleon_vq_from_original",
    "load_chameleon_vq",
    "load_vq_model",
    "tiny_chameleon_vq",
]


VQ_MODEL_CLASSES = {cls.__name__: cls for cls in (LlamaGenVQModel, PatchVQModel)}


def load_vq_model(path: str, **kwargs):
    """Load a VQ tokenizer folder (``config.json`` + weights) with the class its config names: `LlamaGenVQModel` or
    `PatchVQModel`."""
    import os

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"{path!r} is not a VQ tokenizer folder (no config.json).")
    name = PatchVQModel.load_config(path).get("_class_name")
    if name not in VQ_MODEL_CLASSES:
        raise ValueError(f"{path!r} holds a {name!r}; the VQ tokenizers this loader knows are {sorted(VQ_MODEL_CLASSES)}.")
    return VQ_MODEL_CLASSES[name].from_pretrained(path, **kwargs)
