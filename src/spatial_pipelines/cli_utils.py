"""What the command line (`spatial_pipelines.cli`) and the browser demo (`spatial_pipelines.demo`) share: loading a
saved pipeline by folder or Hub repo id, the embedded model's heads of a kind, and a grid of images."""

import math
import os
from typing import Optional

import torch
from diffusers import DiffusionPipeline
from diffusers.utils import make_image_grid
from PIL import Image

from .core.contracts import DRAFTER, LATENT, OFFSET_LOGITS
from .embedded import default_eagle_head_path, default_heads_path, default_ssd_heads_path
from .pipelines import SpatialARPipeline
from .utils import check_path_or_repo_id, find_subclass, read_json_file

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def load_pipeline(model: str, torch_dtype: torch.dtype = torch.float32, revision: Optional[str] = None):
    """Load a saved pipeline (a folder, or a Hub repo id through the Hub cache) with the pipeline class its
    ``model_index.json`` names, through that class's ``from_pretrained`` (the folder checks of docs/checks.md run
    before any weight is read). Raises `ValueError` naming ``model`` when it cannot."""
    check_path_or_repo_id(model, "--model")
    offline = " (HF_HUB_OFFLINE is set: only the Hub cache is read)" if os.environ.get("HF_HUB_OFFLINE") else ""
    if os.path.exists(model):
        index_path = os.path.join(model, "model_index.json")
        if not os.path.isfile(index_path):
            raise ValueError(f"`--model` {model!r} is not a pipeline folder (no model_index.json).")
        if revision is not None:
            raise ValueError(f"`--revision` applies to Hub repo ids; `--model` {model!r} is a local folder.")
        index = read_json_file(index_path, "model_index.json")
    else:
        try:  # model_index.json alone (small), from the Hub cache first
            index = DiffusionPipeline.load_config(model, revision=revision)
        except (OSError, ValueError) as err:  # not in the cache when offline, unknown repo or revision
            raise ValueError(f"`--model` {model!r} could not be loaded{offline}: {err}") from err
    name = index.get("_class_name") if isinstance(index, dict) else None
    cls = find_subclass(SpatialARPipeline, name) if isinstance(name, str) else None
    if cls is None or cls.backbone_class is None:
        raise ValueError(f"`--model` {model!r} holds a {name or 'folder'}, which is not a spatial_pipelines pipeline.")
    try:
        return cls.from_pretrained(model, revision=revision, dtype=torch_dtype)
    except (OSError, AttributeError) as err:  # not in the cache when offline, unknown repo, unknown class
        raise ValueError(f"`--model` {model!r} could not be loaded{offline}: {err}") from err


def grid_image(images):
    """One image, or the images on a near-square grid (blank cells filled white)."""
    if len(images) == 1:
        return images[0]
    cols = math.ceil(math.sqrt(len(images)))
    rows = math.ceil(len(images) / cols)
    blank = Image.new("RGB", images[0].size, "white")
    return make_image_grid(list(images) + [blank] * (rows * cols - len(images)), rows=rows, cols=cols)


def embedded_heads_path(kind: str) -> str:
    """The heads of ``kind`` (one of `HEADS_KINDS`: ``"offset_logits"``, ``"latent"``, ``"drafter"``) shipped with the
    embedded model: the ``kinds[0]`` of a decoder's ``heads_needed()``.

    Args:
        kind (`str`): the kind of heads.
    """
    paths = {OFFSET_LOGITS: default_heads_path, LATENT: default_ssd_heads_path, DRAFTER: default_eagle_head_path}
    if kind not in paths:
        raise ValueError(f"`kind` must be one of {tuple(paths)}, got {kind!r}.")
    return paths[kind]()
