"""A pipeline folder checked against itself before any weight is used (docs/checks.md, "Folders").

`check_pipeline_folder` runs in ``SpatialARPipeline.from_pretrained`` on the local folder (or the Hub snapshot once it
is downloaded). Every finding is a `ValueError` naming the file and the key:

- every JSON file nests at most `MAX_JSON_DEPTH` levels (a 200,000-deep config is refused, not a `RecursionError`);
- ``model_index.json`` names a pipeline class of this library that fits the class loading it, and every component a
  class that exists (in spatial_pipelines, transformers or diffusers) of the kind the pipeline takes there (a model
  class is not a decoder);
- ``decoder/decoder_config.json`` and ``draft_heads/config.json`` name classes that exist; where one disagrees with
  ``model_index.json`` the component's own config wins, with a warning naming both;
- a component's config has the types and ranges its class takes, and its weights are whole safetensors files (a
  pickle is never loaded) whose tensor names and shapes are those the config builds (the model is built on the
  ``meta`` device to know them: nothing is allocated);
- a transformer that records what it was trained for (``SAVED_FACTS_KEY`` in its safetensors metadata: grid and
  prefix positions) is loaded with that config, not a larger grid.
"""

import collections.abc
import importlib
import inspect
import json
import math
import numbers
import os
import typing
from typing import Any, Dict, Optional

import torch
from diffusers import ModelMixin
from diffusers.utils import logging

from ..decoders.decoding_utils import DECODER_CONFIG_NAME, SpatialDecoderMixin
from ..heads.heads_utils import DraftHeadsMixin
from ..utils import PICKLE_SUFFIXES, SAVED_FACTS_KEY, check_json_text, find_subclass, read_json_file, safetensors_header

logger = logging.get_logger(__name__)

#: Libraries whose classes a ``model_index.json`` may name (nothing else is imported on a folder's word).
KNOWN_LIBRARIES = ("spatial_pipelines", "transformers", "diffusers")
#: The largest int a model config may hold (sizes, counts); past it no model of these families exists and building
#: one would exhaust memory before its weights are compared.
MAX_CONFIG_INT = 2**20


def _rel(folder: str, path: str) -> str:
    return os.path.relpath(path, folder)


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
    if top == "spatial_pipelines":
        import spatial_pipelines

        found = getattr(spatial_pipelines, class_name, None)
        if found is None:
            for base in (SpatialDecoderMixin, DraftHeadsMixin, ModelMixin):
                found = find_subclass(base, class_name)
                if found is not None:
                    break
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


def check_model_index(pipeline_cls, folder: str, index: Any) -> Dict[str, type]:
    """Check ``model_index.json``; returns the class of every component it names."""
    path = os.path.join(folder, "model_index.json")
    if not isinstance(index, dict):
        raise ValueError(f"{path!r} must hold a JSON object, got {type(index).__name__}.")
    from .pipeline_utils import SpatialARPipeline

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
    return classes


def _pipeline_classes():
    from ..utils import subclasses
    from .pipeline_utils import SpatialARPipeline

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


# -- one model component -----------------------------------------------------------------------------------------
def _check_value(path: str, key: str, value, annotation, default) -> None:
    """One config value against its constructor parameter's annotation (ints also within [1 or 0, MAX_CONFIG_INT])."""
    options = typing.get_args(annotation) if typing.get_origin(annotation) is typing.Union else (annotation,)
    if value is None:
        if type(None) in options or default is None:
            return
        raise ValueError(f"{path!r}: `{key}` must not be null (expected {annotation}).")
    kinds = [o for o in options if o is not type(None)]
    if not kinds:
        return
    kind = kinds[0]
    where = f"{path!r}: `{key}`"
    if kind is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{where} must be true or false, got {value!r}.")
    elif kind is int:
        low = 0 if default == 0 else 1
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= MAX_CONFIG_INT:
            raise ValueError(f"{where} must be an int in [{low}, {MAX_CONFIG_INT}], got {value!r}.")
    elif kind is float:
        if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{where} must be a finite number >= 0, got {value!r}.")
    elif kind is str:
        if not isinstance(value, str):
            raise ValueError(f"{where} must be a string, got {value!r}.")
    elif typing.get_origin(kind) in (tuple, list, collections.abc.Sequence):
        args = [a for a in typing.get_args(kind) if a is not Ellipsis]
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{where} must be a list, got {value!r}.")
        if args and all(a is int for a in args):
            if any(not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_CONFIG_INT for v in value):
                raise ValueError(f"{where} must be a list of ints in [0, {MAX_CONFIG_INT}], got {value!r}.")


def check_model_config(model_cls, config: Dict[str, Any], path: str) -> None:
    """Types and ranges of ``config`` (from ``path``) against ``model_cls``'s constructor: a `ValueError` naming the
    file and the first bad key."""
    if not isinstance(config, dict):
        raise ValueError(f"{path!r} must hold a JSON object, got {type(config).__name__}.")
    try:
        hints = typing.get_type_hints(model_cls.__init__)
    except Exception:
        hints = {}
    for key, param in inspect.signature(model_cls.__init__).parameters.items():
        if key in config and key in hints:
            _check_value(path, key, config[key], hints[key], param.default)


def _weights_files(component_dir: str):
    """The safetensors files of a component folder, and the pickles beside them."""
    names = sorted(os.listdir(component_dir))
    safe = [os.path.join(component_dir, n) for n in names if n.endswith(".safetensors")]
    pickles = [n for n in names if n.endswith(PICKLE_SUFFIXES)]
    return safe, pickles


def check_weights(folder: str, key: str, component_dir: str, variant: Optional[str] = None) -> Dict[str, dict]:
    """The headers of a component's safetensors files (each checked whole); a `ValueError` when there are none but
    pickles (never loaded)."""
    safe, pickles = _weights_files(component_dir)
    if variant is not None:
        safe = [p for p in safe if f".{variant}." in os.path.basename(p)] or safe
    if not safe and pickles:
        raise ValueError(f"The `{key}` folder {component_dir!r} holds pickled weights ({', '.join(pickles)}) and no "
                         "safetensors: pickles are refused here, because loading one can run any code. Convert them to "
                         "safetensors where you trust them.")
    return {p: safetensors_header(p, f"`{key}` weights") for p in safe}


def _meta_model(model_cls, config: Dict[str, Any], path: str):
    """``model_cls`` built from ``config`` on the meta device (no memory); its constructor's own checks name the file."""
    try:
        with torch.device("meta"):
            if issubclass(model_cls, ModelMixin):
                init, _, _ = model_cls.extract_init_dict(config)
                return model_cls(**init)
            config_obj = model_cls.config_class.from_dict(config)
            return model_cls._from_config(config_obj)
    except ValueError as err:
        raise ValueError(f"{path!r}: {err}") from None
    except (TypeError, RuntimeError, AttributeError, KeyError, OverflowError) as err:
        raise ValueError(f"{path!r} does not build a {model_cls.__name__}: {type(err).__name__}: {err}") from None


def check_shapes(model, headers: Dict[str, dict], component_dir: str, strict: bool) -> None:
    """The weights' tensor names and shapes against those ``model`` (built from the config) has: a `ValueError` naming
    the first mismatch. ``strict``: every tensor must be there and nothing else (our own models); otherwise only the
    tensors both have are compared (transformers models rename keys when loading)."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    found = {}
    for path, header in headers.items():
        for name, info in header.items():
            if name != "__metadata__":
                found[name] = (tuple(info["shape"]), path)
    config = os.path.join(component_dir, "config.json")
    for name, shape in expected.items():
        if name in found and found[name][0] != shape:
            raise ValueError(f"{config!r} does not match the weights: `{name}` is {list(found[name][0])} in "
                             f"{os.path.basename(found[name][1])} but the config builds {list(shape)}.")
    if not strict:
        return
    missing = [k for k in expected if k not in found]
    unexpected = [k for k in found if k not in expected]
    if missing:
        raise ValueError(f"{config!r} does not match the weights: the config builds `{missing[0]}` ({len(missing)} "
                         "tensors in all) that the weights do not have (a config with more layers or modules than "
                         "were trained?).")
    if unexpected:
        raise ValueError(f"{config!r} does not match the weights: they hold `{unexpected[0]}` ({len(unexpected)} "
                         "tensors in all) that the config does not build (a config with fewer layers or modules than "
                         "were trained?).")


def check_trained_facts(headers: Dict[str, dict], config: Dict[str, Any], component_dir: str) -> None:
    """Facts a model recorded in its weights' metadata (`SAVED_FACTS_KEY`) must equal its config's."""
    for path, header in headers.items():
        raw = (header.get("__metadata__") or {}).get(SAVED_FACTS_KEY)
        if raw is None:
            continue
        try:
            facts = json.loads(raw)
        except (TypeError, json.JSONDecodeError):
            raise ValueError(f"The weights file {path!r}: its `{SAVED_FACTS_KEY}` metadata is not JSON.") from None
        for key, value in (facts.items() if isinstance(facts, dict) else ()):
            if key in config and config[key] != value:
                raise ValueError(f"{os.path.join(component_dir, 'config.json')!r}: `{key}` is {config[key]!r}, but the "
                                 f"weights were trained with {key}={value!r} ({os.path.basename(path)}): positions past "
                                 "what the model was trained for give no image. Restore the config.")


def check_model_folder(model_cls, key: str, folder: str, component_dir: str, variant: Optional[str] = None) -> None:
    """One model component: config types and ranges, whole safetensors weights, their names and shapes, its trained
    facts."""
    config_path = os.path.join(component_dir, "config.json")
    own = issubclass(model_cls, ModelMixin) and model_cls.__module__.startswith("spatial_pipelines.")
    is_transformers = not own and hasattr(model_cls, "config_class") and hasattr(model_cls, "_from_config")
    if not os.path.isfile(config_path) or not (own or is_transformers):
        return
    config = read_json_file(config_path, f"`{key}` config")
    if own:
        check_model_config(model_cls, config, config_path)
    elif not isinstance(config, dict):
        raise ValueError(f"{config_path!r} must hold a JSON object, got {type(config).__name__}.")
    headers = check_weights(folder, key, component_dir, variant)
    if not headers:
        return
    check_trained_facts(headers, config, component_dir)
    check_shapes(_meta_model(model_cls, config, config_path), headers, component_dir, strict=own)


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
    classes = check_model_index(pipeline_cls, folder, read_json_file(index_path, "model_index.json"))
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
            check_model_folder(cls, key, folder, component_dir, variant)
    if "draft_heads" in loaded:
        loaded["draft_heads"] = DraftHeadsMixin.from_pretrained(folder, subfolder="draft_heads")
    return loaded
