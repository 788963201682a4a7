"""A pipeline folder checked against itself before any weight is used (docs/checks.md, "Folders").

`check_pipeline_folder` runs in ``SpatialARPipeline.from_pretrained`` on the local folder (or the downloaded Hub
snapshot). Every finding is a `ValueError` naming the file and the key:

- every JSON file nests at most `MAX_JSON_DEPTH` levels (not a `RecursionError`);
- ``model_index.json`` names a pipeline class of this library that fits the class loading it, and every component a
  class that exists (in spatial_pipelines, transformers or diffusers) of the kind the pipeline takes there;
- ``decoder/decoder_config.json`` and ``draft_heads/config.json`` name classes that exist; where one disagrees with
  ``model_index.json`` the component's own config wins, with a warning naming both;
- each model component as `spatial_pipelines.weight_checks` checks it (what its own ``from_pretrained`` runs);
- a transformers family's grid leaves room for a prompt in the positions its model was trained for
  (`checkpoint_checks.check_trained_positions`).
"""

import importlib
import inspect
import os
import typing
from typing import Any, Dict, Optional, Tuple

from diffusers import ModelMixin
from diffusers.utils import logging

from ..decoders.decoding_utils import DECODER_CONFIG_NAME, SpatialDecoderMixin
from ..heads.heads_utils import DraftHeadsMixin
from ..utils import check_json_text, find_subclass, read_json_file, subclasses
from ..weight_checks import check_component, meta_model
from .checkpoint_checks import _generation_config, check_trained_positions
from .pipeline_utils import SpatialARPipeline


logger = logging.get_logger(__name__)

#: Libraries whose classes a ``model_index.json`` may name (nothing else is imported on a folder's word).
KNOWN_LIBRARIES = ("spatial_pipelines", "transformers", "diffusers")


def check_json_files(folder: str) -> None:
    """Every ``*.json`` in ``folder`` (and its subfolders) nests at most `MAX_JSON_DEPTH` levels."""
    for root, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in sorted(files):
            if name.endswith(".json"):
                path = os.path.join(root, name)
                with open(path, encoding="utf-8", errors="replace") as f:
                    check_json_text(f.read(), path, "JSON")


def _resolve(library, class_name, where: str):
    """The class ``library.class_name`` names in ``where``; a `ValueError` when it is not a class of a known library."""
    if not (isinstance(library, str) and isinstance(class_name, str)):
        raise ValueError(f"{where} must be [library, class name] strings, got {[library, class_name]!r}.")
    top = library.split(".")[0]
    if top not in KNOWN_LIBRARIES:
        raise ValueError(f"{where} names the library {library!r}; a pipeline folder's components come from "
                         f"{', '.join(KNOWN_LIBRARIES)} only.")
    if top == "spatial_pipelines":  # a component class of this library: read off the loaded classes (the registries)
        found = next(filter(None, (find_subclass(base, class_name) for base in (SpatialDecoderMixin, DraftHeadsMixin, ModelMixin))), None)
    else:
        try:
            found = getattr(importlib.import_module(library), class_name, None)
        except ImportError:
            found = None
    if not isinstance(found, type):
        raise ValueError(f"{where} names the class {class_name!r}, which {library} does not have.")
    return found


def _expected_types(pipeline_cls, name: str):
    """The classes the pipeline's ``__init__`` takes for component ``name`` (``None``: not known)."""
    if name == "decoder":
        return (SpatialDecoderMixin,)
    if name == "draft_heads":
        return (DraftHeadsMixin,)
    try:
        hints = typing.get_type_hints(pipeline_cls.__init__)
    except Exception:
        return None
    hint = hints.get(name)
    if hint is None:
        return None
    options = typing.get_args(hint) if typing.get_origin(hint) is typing.Union else (hint,)
    classes = tuple(o for o in options if isinstance(o, type) and o not in (type(None), typing.Any, object))
    return classes or None


def check_model_index(pipeline_cls, folder: str, index: Any) -> Tuple[type, Dict[str, type]]:
    """Check ``model_index.json``; returns the pipeline class it loads (``pipeline_cls`` or the subclass it names) and
    the class of every component it names."""
    path = os.path.join(folder, "model_index.json")
    if not isinstance(index, dict):
        raise ValueError(f"{path!r} must hold a JSON object, got {type(index).__name__}.")
    name = index.get("_class_name")
    target = find_subclass(SpatialARPipeline, name) if isinstance(name, str) else None
    if target is None or target is SpatialARPipeline:
        known = sorted(c.__name__ for c in _pipeline_classes())
        raise ValueError(f"{path!r}: `_class_name` {name!r} is not a pipeline of spatial_pipelines (one of {known}).")
    if not (issubclass(target, pipeline_cls) or issubclass(pipeline_cls, target)):
        raise ValueError(f"{path!r}: `_class_name` is {name!r}, a folder for {name}.from_pretrained, not "
                         f"{pipeline_cls.__name__}.")
    cls = pipeline_cls if issubclass(pipeline_cls, target) else target
    params = inspect.signature(cls.__init__).parameters
    classes = {}
    for key, value in index.items():
        if key.startswith("_") or key not in params:
            continue
        if not isinstance(value, (list, tuple)) or len(value) != 2:
            if isinstance(value, (list, tuple)):
                raise ValueError(f"{path!r}: `{key}` must be [library, class name], got {value!r}.")
            continue  # a config value of the pipeline (e.g. `text_encoder_package`)
        if value[0] is None and value[1] is None:
            continue
        found = _resolve(value[0], value[1], f"{path!r}: `{key}`")
        expected = _expected_types(cls, key)
        if expected is not None and not issubclass(found, expected):
            raise ValueError(f"{path!r}: `{key}` names {value[1]!r}, which is not a "
                             f"{' or '.join(e.__name__ for e in expected)} (what {cls.__name__} takes as `{key}`).")
        classes[key] = found
    return cls, classes


def _pipeline_classes():
    return [c for c in subclasses(SpatialARPipeline) if c.backbone_class is not None]


def _own_config_class(folder: str, key: str, base: type, config_name: str, index_class: type) -> Optional[type]:
    """The class the component's own config names when it differs from ``model_index.json``'s (``None``: they agree or
    there is no config)."""
    path = os.path.join(folder, key, config_name)
    if not os.path.isfile(path):
        return None
    config = read_json_file(path, f"`{key}` config")
    name = config.get("_class_name") if isinstance(config, dict) else None
    if not isinstance(config, dict) or not isinstance(name, str):
        raise ValueError(f"{path!r}: `_class_name` must name the {key} class, got {name!r}.")
    own = find_subclass(base, name)
    if own is None or own is base:
        raise ValueError(f"{path!r}: `_class_name` {name!r} is not a {base.__name__} of spatial_pipelines.")
    if own is index_class:
        return None
    logger.warning(f"model_index.json names {index_class.__name__} for `{key}`, but {key}/{config_name} is a {name} "
                   f"config: loading {name} (the component's own config wins).")
    return own


def check_model_folder(model_cls, key: str, folder: str, component_dir: str, variant: Optional[str] = None,
                       backbone_class=None) -> None:
    """One model component: its config, weights and trained facts (`check_component`), and the positions its config
    was trained for (a transformers family's ``transformer``, with the pipeline's ``backbone_class``)."""
    config, model = check_component(model_cls, key, component_dir, variant)
    if config is None or backbone_class is None or key != "transformer" or model_cls.__module__.startswith("spatial_pipelines."):
        return
    model = model if model is not None else meta_model(model_cls, config, os.path.join(component_dir, "config.json"))
    check_trained_positions(backbone_class, model.config, _generation_config(component_dir), component_dir)


def check_pipeline_folder(pipeline_cls, folder: str, variant: Optional[str] = None, passed=()) -> Dict[str, Any]:
    """Check a local pipeline folder before anything is loaded from it (this module's docstring). Returns components
    to pass to diffusers' loading: the decoder or draft heads whose own config names another class than
    ``model_index.json`` (loaded from that config, with a warning). Components named in ``passed`` (given to
    ``from_pretrained`` by the caller) are not read from the folder, so their files are not checked."""
    folder = os.fspath(folder)
    check_json_files(folder)
    index_path = os.path.join(folder, "model_index.json")
    if not os.path.isfile(index_path):
        return {}  # diffusers says what is missing
    pipeline, classes = check_model_index(pipeline_cls, folder, read_json_file(index_path, "model_index.json"))
    classes = {k: v for k, v in classes.items() if k not in passed}
    loaded = {}
    if "decoder" in classes:
        own = _own_config_class(folder, "decoder", SpatialDecoderMixin, DECODER_CONFIG_NAME, classes["decoder"])
        if own is not None:
            loaded["decoder"] = own.from_pretrained(folder, subfolder="decoder")
            classes["decoder"] = own
    if "draft_heads" in classes:
        own = _own_config_class(folder, "draft_heads", DraftHeadsMixin, "config.json", classes["draft_heads"])
        if own is not None:
            classes["draft_heads"] = own
            loaded["draft_heads"] = None  # loaded after the checks below, by the class its config names
    for key, cls in classes.items():
        component_dir = os.path.join(folder, key)
        if os.path.isdir(component_dir):
            check_model_folder(cls, key, folder, component_dir, variant, getattr(pipeline, "backbone_class", None))
    if "draft_heads" in loaded:
        loaded["draft_heads"] = DraftHeadsMixin.from_pretrained(folder, subfolder="draft_heads")
    return loaded
