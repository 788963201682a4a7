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
  pickle is never loaded) holding exactly the tensors, of the shapes, that the config builds (the model is built on
  the ``meta`` device to know them: nothing is allocated; a transformers model's checkpoint names go through the
  renaming transformers applies when it loads them, and a tied weight may be saved once);
- a transformer that records what it was trained for (``SAVED_FACTS_KEY`` in its safetensors metadata: grid and
  prefix positions; the embedded model's weights record it too) is loaded with that config, not a larger grid;
- a transformers family's grid (``image_grid`` in its generation config; Janus: ``vision_config.num_image_tokens``)
  leaves room for a prompt in the positions its config says the model was trained for (``max_position_embeddings``).

`check_backbone_checkpoint` gives ``from_backbone`` the same weights and grid checks on an original transformers
checkpoint, a local folder or a Hub id (its config, index and weights' headers resolved as transformers resolves them,
before any weight is downloaded); `precheck_backbone` checks its JSON files before transformers parses them.
"""

import collections.abc
import copy
import importlib
import inspect
import json
import math
import numbers
import os
import re
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


def _index_pipeline_class(pipeline_cls, index: Dict[str, Any]):
    """The pipeline class a checked ``model_index.json`` loads: ``pipeline_cls`` or the subclass the index names."""
    from .pipeline_utils import SpatialARPipeline

    target = find_subclass(SpatialARPipeline, index.get("_class_name"))
    return pipeline_cls if target is None or issubclass(pipeline_cls, target) else target


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


def _meta_model(model_cls, config, path: str):
    """``model_cls`` built from ``config`` (a dict, or a transformers config object) on the meta device (no memory);
    its constructor's own checks name the file."""
    try:
        with torch.device("meta"):
            if issubclass(model_cls, ModelMixin):
                init, _, _ = model_cls.extract_init_dict(config)
                return model_cls(**init)
            config_obj = copy.deepcopy(config) if not isinstance(config, dict) else model_cls.config_class.from_dict(config)
            return model_cls._from_config(config_obj)
    except ValueError as err:
        raise ValueError(f"{path!r}: {err}") from None
    except (TypeError, RuntimeError, AttributeError, KeyError, OverflowError) as err:
        raise ValueError(f"{path!r} does not build a {model_cls.__name__}: {type(err).__name__}: {err}") from None


def _transformers_renamer(model):
    """``rename(name) -> (model name, converted)``: the name transformers gives the checkpoint tensor ``name`` when it
    loads ``model`` (its conversion mapping: an original checkpoint's names, e.g. Emu3's ``text_model.model.*``, become
    the model's), and whether a converter (not a plain renaming) produced it, so its shape may differ. Names go
    through unchanged where this transformers has no such mapping."""
    expected = model.state_dict()
    prefix = getattr(model, "base_model_prefix", "") or ""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

        mapping = get_model_conversion_mapping(model)
        renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
        converters = [m for m in mapping if isinstance(m, WeightConverter)]
    except Exception:  # a transformers without conversion mappings: names as they are, the base-model prefix aside
        def rename(name):
            stripped = name[len(prefix) + 1:] if prefix and name.startswith(prefix + ".") else name
            for candidate in (name, f"{prefix}.{name}" if prefix else name, stripped):
                if candidate in expected:
                    return candidate, False
            return name, False
        return rename

    def rename(name):
        target, pattern = rename_source_key(name, renamings, converters, prefix, expected)
        if target not in expected and name in expected:  # as transformers: a name the model has is not renamed
            target, pattern = rename_source_key(name, [], [], prefix, expected)
        return target, pattern is not None
    return rename


def _ignored(patterns, name: str) -> bool:
    return any(re.search(p, name) for p in patterns or ())


def check_shapes(model, headers: Dict[str, dict], component_dir: str, strict: bool = True) -> None:
    """The weights' tensor names and shapes against those ``model`` (built from the config) has: a `ValueError` naming
    the config, the weights file and the first mismatch, missing or extra tensor. Every tensor the config builds must
    be there, and nothing else. A transformers model (``strict=False``) is compared as transformers loads it: the
    checkpoint's names through its conversion mapping, a tied weight saved once (``lm_head`` tied to the embeddings),
    and the names its class says to ignore on loading or saving (old ``rotary_emb.inv_freq`` buffers ...)."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    rename = (lambda name: (name, False)) if strict else _transformers_renamer(model)
    config = os.path.join(component_dir, "config.json")
    matched, unexpected = {}, []
    for path, header in headers.items():
        for name, info in header.items():
            if name == "__metadata__":
                continue
            target, converted = rename(name)
            if target not in expected:
                unexpected.append((name, path))
                continue
            matched[target] = path
            if not converted and tuple(info["shape"]) != expected[target]:
                shown = f"`{name}`" if name == target else f"`{name}` (the model's `{target}`)"
                raise ValueError(f"{config!r} does not match the weights: {shown} is {list(info['shape'])} in "
                                 f"{os.path.basename(path)} but the config builds {list(expected[target])}.")
    ignore_missing, ignore_unexpected = (), ()
    if not strict:
        for target, source in (getattr(model, "all_tied_weights_keys", None) or {}).items():
            if target in matched or source in matched:  # a tied pair is saved once, under either name
                matched.setdefault(target, None)
                matched.setdefault(source, None)
        ignore_missing = [*(getattr(model, "_keys_to_ignore_on_load_missing", None) or ()),
                          *(f"^{re.escape(k)}$" for k in getattr(model, "_keys_to_ignore_on_save", None) or ())]
        ignore_unexpected = list(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
        buffers = [name for name, _ in model.named_buffers()]
        if any(b.endswith("rotary_emb.inv_freq") for b in buffers):
            ignore_unexpected.append(r"rotary_emb\.inv_freq")
        if any(b.endswith("position_ids") for b in buffers):
            ignore_unexpected.append(r"(^|\.)position_ids$")
    missing = [k for k in expected if k not in matched and not _ignored(ignore_missing, k)]
    unexpected = [(n, p) for n, p in unexpected if not _ignored(ignore_unexpected, n)]
    files = ", ".join(sorted({os.path.basename(p) for p in headers}))
    if missing:
        raise ValueError(f"{config!r} does not match the weights: the config builds `{missing[0]}` ({len(missing)} "
                         f"tensors in all) that the weights ({files}) do not have (a config with more layers or modules "
                         "than were trained, or a weights file that lost some?).")
    if unexpected:
        raise ValueError(f"{config!r} does not match the weights: they hold `{unexpected[0][0]}` in "
                         f"{os.path.basename(unexpected[0][1])} ({len(unexpected)} tensors in all) that the config does "
                         "not build (a config with fewer layers or modules than were trained, or a weights file of "
                         "another model?).")


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


def check_trained_positions(backbone_class, config, generation_config: Dict[str, Any], grid_where: str,
                            limit_where: str, grid_file: Optional[str] = None) -> None:
    """A transformers family's grid (`TransformersBackbone.grid_from_configs`, from the transformers ``config`` and
    the generation config) against the positions its model was trained for (the text config's
    ``max_position_embeddings``): a grid whose image leaves no position for a prompt is a `ValueError` naming
    ``grid_where`` (the file and key, or the argument, that set it); a grid that is not one names ``grid_file``."""
    from .transformers_utils import check_image_fits_context

    if backbone_class is None or not hasattr(backbone_class, "grid_from_configs"):
        return
    if backbone_class.grid_file == "generation_config.json" and "image_grid" not in generation_config:
        return  # the family's default grid: checked at every call (`TransformersBackbone.check_image_positions`)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    limit = getattr(text_config, "max_position_embeddings", None)
    try:
        grid = backbone_class.grid_from_configs(config, generation_config)
    except (ValueError, AttributeError, TypeError) as err:
        raise ValueError(f"{grid_file!r}: {err}" if grid_file else str(err)) from None
    if isinstance(limit, int) and not isinstance(limit, bool):
        check_image_fits_context(grid, backbone_class.image_positions(grid), limit, grid_where, limit_where)


def _generation_config(component_dir: str) -> Dict[str, Any]:
    path = os.path.join(component_dir, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    generation = read_json_file(path, "generation config")
    if not isinstance(generation, dict):
        raise ValueError(f"{path!r} must hold a JSON object, got {type(generation).__name__}.")
    return generation


def check_model_folder(model_cls, key: str, folder: str, component_dir: str, variant: Optional[str] = None,
                       backbone_class=None) -> None:
    """One model component: config types and ranges, whole safetensors weights, their names and shapes, its trained
    facts: the grid and prefix its weights' metadata records (our models), the positions its config was trained for
    (a transformers family's ``transformer``, with the pipeline's ``backbone_class``)."""
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
    model = None
    if headers:
        check_trained_facts(headers, config, component_dir)
        model = _meta_model(model_cls, config, config_path)
        check_shapes(model, headers, component_dir, strict=own)
    if is_transformers and backbone_class is not None and key == "transformer":
        model = model if model is not None else _meta_model(model_cls, config, config_path)
        grid_file = os.path.join(component_dir, getattr(backbone_class, "grid_file", "config.json"))
        check_trained_positions(backbone_class, model.config, _generation_config(component_dir),
                                f"{grid_file!r}: `{getattr(backbone_class, 'grid_key', 'image_grid')}`",
                                f"{config_path!r}: `max_position_embeddings`", grid_file)


#: transformers' names for a checkpoint's weights: the safetensors it loads, the pickles it would fall back to.
SAFE_WEIGHTS_NAMES = ("model.safetensors", "model.safetensors.index.json")
PICKLE_WEIGHTS_NAMES = ("pytorch_model.bin", "pytorch_model.bin.index.json")
#: ``from_pretrained`` arguments that say where a checkpoint's files are, as transformers reads them.
HUB_FILE_KWARGS = ("revision", "cache_dir", "token", "local_files_only", "force_download", "proxies", "subfolder")


def _variant(name: str, variant: Optional[str]) -> str:
    """transformers' ``_add_variant``: ``model.safetensors`` -> ``model.<variant>.safetensors``."""
    if variant is None:
        return name
    stem, ext = name.rsplit(".", 1)
    return f"{stem}.{variant}.{ext}"


class _HubCheckpoint:
    """A Hub repo's checkpoint files found as transformers finds them (`transformers.utils.hub.cached_file` and
    ``has_file``: the cache first; ``HF_HUB_OFFLINE`` / ``local_files_only``, ``cache_dir``, ``revision``, ``token``,
    ``subfolder`` and ``variant`` as ``from_pretrained`` takes them). Only small files (configs, the safetensors
    index) are downloaded; a weights file is read from the cache when it is there, else by its header alone."""

    def __init__(self, repo_id: str, kwargs: Dict[str, Any]):
        from transformers.utils.hub import is_offline_mode

        self.repo_id = repo_id
        self.opts = {k: v for k, v in kwargs.items() if k in HUB_FILE_KWARGS and v is not None}
        self.subfolder = self.opts.pop("subfolder", "") or ""
        self.variant = kwargs.get("variant")
        self.offline = bool(self.opts.get("local_files_only")) or is_offline_mode()
        self.where = repo_id + (f" (revision {self.opts['revision']!r})" if self.opts.get("revision") else "")

    def path(self, name: str) -> str:
        return f"{self.subfolder.strip('/')}/{name}" if self.subfolder else name

    def small_file(self, name: str) -> Optional[str]:
        """The local path of the small file ``name`` (downloaded unless cached); ``None`` when the repo has none."""
        from transformers.utils.hub import cached_file

        return cached_file(self.repo_id, name, subfolder=self.subfolder, _raise_exceptions_for_missing_entries=False,
                           _raise_exceptions_for_connection_errors=False, **self.opts)

    def has(self, name: str) -> bool:
        """Whether the repo holds ``name``, never downloading it (a HEAD request, or the cache when offline)."""
        from transformers.utils.hub import has_file

        return has_file(self.repo_id, self.path(name), revision=self.opts.get("revision"),
                        proxies=self.opts.get("proxies"), token=self.opts.get("token"), local_files_only=self.offline,
                        cache_dir=self.opts.get("cache_dir"))

    def cached(self, name: str) -> Optional[str]:
        """The cached copy of ``name`` at this revision, if any (``force_download`` trusts none)."""
        from huggingface_hub import try_to_load_from_cache

        if self.opts.get("force_download"):
            return None
        found = try_to_load_from_cache(self.repo_id, self.path(name), cache_dir=self.opts.get("cache_dir"),
                                       revision=self.opts.get("revision"))
        return found if isinstance(found, str) else None

    def remote_header(self, name: str) -> dict:
        """The header of the weights file ``name`` on the Hub (``get_safetensors_metadata``'s ranged reads: no tensor
        is downloaded), in `safetensors_header`'s form."""
        from huggingface_hub import HfApi
        from huggingface_hub.errors import SafetensorsParsingError

        try:
            meta = HfApi(token=self.opts.get("token")).parse_safetensors_file_metadata(
                self.repo_id, self.path(name), revision=self.opts.get("revision"))
        except SafetensorsParsingError as err:
            raise ValueError(f"The checkpoint weights file {self.path(name)!r} of {self.where} is not a safetensors "
                             f"file (a pickle or a corrupt file?): {str(err).rstrip('.')}. Pickles are refused here, "
                             "because loading one can run any code.") from None
        except RecursionError:
            raise ValueError(f"The checkpoint weights file {self.path(name)!r} of {self.where} has a header nested too "
                             "deep to be a safetensors header.") from None
        except Exception as err:
            raise OSError(f"Cannot read the header of the checkpoint weights file {self.path(name)!r} of {self.where} "
                          f"to check it before loading: {type(err).__name__}: {err}") from err
        header = {"__metadata__": dict(meta.metadata or {})}
        for tensor, info in meta.tensors.items():
            header[tensor] = {"dtype": info.dtype, "shape": list(info.shape), "data_offsets": list(info.data_offsets)}
        return header


def _index_shards(index_path: str) -> list:
    """The shard files a ``model.safetensors.index.json`` names (``weight_map``'s values): plain safetensors file
    names beside it, or a `ValueError` naming the file and key."""
    index = read_json_file(index_path, "safetensors index")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index_path!r}: `weight_map` must be an object of tensor names to safetensors files, got "
                         f"{type(weight_map).__name__}.")
    shards = []
    for tensor, shard in weight_map.items():
        if not (isinstance(shard, str) and shard.endswith(".safetensors") and "/" not in shard and "\\" not in shard
                and shard not in (".", "..")):
            raise ValueError(f"{index_path!r}: `weight_map` maps {tensor!r} to {shard!r}, not a safetensors file "
                             "beside the index.")
        shards.append(shard)
    return sorted(set(shards))


def _weights_names(raw, variant: Optional[str]):
    """``(single file, index)``: the safetensors names transformers looks for, in that order (the config's
    ``transformers_weights`` where it names one; ``None`` for the kind it does not name)."""
    explicit = raw.get("transformers_weights") if isinstance(raw, dict) else None
    if isinstance(explicit, str) and explicit.endswith(".safetensors.index.json"):
        return None, explicit
    if isinstance(explicit, str) and explicit.endswith(".safetensors"):
        return explicit, None
    return tuple(_variant(n, variant) for n in SAFE_WEIGHTS_NAMES)


def _local_headers(folder: str, config_path: str, variant: Optional[str]) -> Dict[str, dict]:
    """The headers of a local checkpoint's safetensors, the files transformers would load (``model.safetensors``, else
    the shards its index names; else every safetensors file there); pickles alone are a `ValueError`."""
    single, index = _weights_names(read_json_file(config_path, "model config"), variant)
    if single is not None and os.path.isfile(os.path.join(folder, single)):
        files = [os.path.join(folder, single)]
    elif index is not None and os.path.isfile(os.path.join(folder, index)):
        index_path = os.path.join(folder, index)
        files = [os.path.join(folder, shard) for shard in _index_shards(index_path)]
        for path in files:
            if not os.path.isfile(path):
                raise ValueError(f"{index_path!r}: `weight_map` names {os.path.basename(path)!r}, which is not in "
                                 f"{folder!r} (an incomplete download or copy?).")
    else:
        files, pickles = _weights_files(folder)
        if not files and pickles:
            raise ValueError(f"The checkpoint folder {folder!r} holds pickled weights ({', '.join(pickles)}) and no "
                             "safetensors: pickles are refused here, because loading one can run any code. Convert "
                             "them to safetensors where you trust them.")
    return {p: safetensors_header(p, "checkpoint weights") for p in files}


def _hub_checkpoint(repo_id: str, kwargs: Dict[str, Any]):
    """``(config path, headers or None)`` of a Hub checkpoint, its small files in the cache: ``None`` headers where the
    weights cannot be read without downloading them and the Hub is offline (transformers then says they are not in
    the cache). A repo with pickled weights and no safetensors is a `ValueError` (nothing downloaded)."""
    hub = _HubCheckpoint(repo_id, kwargs)
    config_path = hub.small_file("config.json")
    if config_path is None:
        return None, None  # transformers' AutoConfig has said what is missing
    folder = os.path.dirname(config_path)
    hub.small_file("generation_config.json")  # beside the config, for the grid check
    single, index = _weights_names(read_json_file(config_path, "model config"), hub.variant)
    shards = []
    if single is not None and hub.has(single):
        shards = [single]
    elif index is not None:
        index_path = hub.small_file(index)
        if index_path is not None:
            shards = _index_shards(index_path)
    if not shards:
        pickles = [n for n in (_variant(p, hub.variant) for p in PICKLE_WEIGHTS_NAMES) if hub.has(n)]
        if pickles:
            raise ValueError(f"The Hub checkpoint {hub.where} holds pickled weights ({', '.join(pickles)}) and no "
                             f"safetensors ({' or '.join(n for n in (single, index) if n)}): pickles are refused here, "
                             "because loading one can run any code; nothing was downloaded. Convert them to "
                             "safetensors where you trust them.")
        return config_path, None  # transformers says that no weights file is there
    headers = {}
    for shard in shards:
        shown = os.path.join(folder, shard)
        cached = hub.cached(shard)
        if cached is not None:
            headers[shown] = safetensors_header(cached, "checkpoint weights")
        elif hub.offline:
            return config_path, None  # not in the cache, and the Hub is offline: transformers says so
        else:
            headers[shown] = hub.remote_header(shard)
    return config_path, headers


def _checkpoint_folder(repo_or_path, subfolder: Optional[str]) -> Optional[str]:
    path = os.fspath(repo_or_path)
    return os.path.join(path, subfolder or "") if os.path.isdir(path) else None


def precheck_backbone(repo_or_path, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """What a family's ``from_backbone`` checks before transformers reads even the config: ``config.json`` and
    ``generation_config.json`` (of the local folder, or of the Hub repo, downloaded into the cache as transformers
    would: they are small) nest at most `MAX_JSON_DEPTH` levels (a `ValueError` naming the file, not a
    `RecursionError`); ``use_safetensors=False`` is refused (the model is loaded with ``use_safetensors=True``: never
    a pickle). Returns ``kwargs`` without ``use_safetensors``."""
    kwargs = dict(kwargs)
    if kwargs.pop("use_safetensors", None) is False:
        raise ValueError("`use_safetensors=False` asks for pickled weights: pickles are refused here, because loading "
                         "one can run any code.")
    folder = _checkpoint_folder(repo_or_path, kwargs.get("subfolder"))
    hub = None if folder is not None else _HubCheckpoint(os.fspath(repo_or_path), kwargs)
    for name in ("config.json", "generation_config.json"):
        path = os.path.join(folder, name) if folder is not None else hub.small_file(name)
        if path is not None and os.path.isfile(path):
            with open(path, encoding="utf-8", errors="replace") as f:
                check_json_text(f.read(), path, "model config" if name == "config.json" else "generation config")
    return kwargs


def check_backbone_checkpoint(backbone_class, model_cls, repo_or_path, config=None, image_grid=None,
                              subfolder: Optional[str] = None, hub_kwargs: Optional[Dict[str, Any]] = None) -> None:
    """What a family's ``from_backbone`` reads, checked before transformers reads a weight. ``image_grid`` (the
    argument) against the positions the model was trained for (``config``: its transformers config, read first and
    completed as the family completes it; the model is built from it on the meta device); and the checkpoint (the
    original transformers layout: ``config.json`` + safetensors) as a pipeline folder's ``transformer`` is: every
    tensor its config builds is in its safetensors files, of that shape, and nothing else (`check_shapes`), and the
    grid its generation config asks for fits those positions. Pickled weights without safetensors are refused.

    A local folder is read where it is. A Hub id is resolved as transformers resolves it (``hub_kwargs``: ``revision``,
    ``cache_dir``, ``token``, ``local_files_only``, ``variant``; ``HF_HUB_OFFLINE`` honoured): its ``config.json``,
    ``generation_config.json`` and ``model.safetensors.index.json`` are downloaded into the Hub cache (small), its
    weights' headers are read from the cached files, or from the Hub by ranged reads when they are not cached; no
    weight is downloaded before the checks pass. ``subfolder``: where in ``repo_or_path`` the checkpoint is."""
    hub_kwargs = {**(hub_kwargs or {}), **({"subfolder": subfolder} if subfolder else {})}
    folder = _checkpoint_folder(repo_or_path, subfolder)
    if folder is not None:
        config_path = os.path.join(folder, "config.json")
        headers = None
        if os.path.isfile(config_path):
            headers = _local_headers(folder, config_path, hub_kwargs.get("variant"))
        else:
            config_path = None
    else:
        config_path, headers = _hub_checkpoint(os.fspath(repo_or_path), hub_kwargs)
        folder = os.path.dirname(config_path) if config_path is not None else None
    if config_path is not None:
        raw = read_json_file(config_path, "model config")
        if not isinstance(raw, dict):
            raise ValueError(f"{config_path!r} must hold a JSON object, got {type(raw).__name__}.")
        if headers:
            model = _meta_model(model_cls, config if config is not None else raw, config_path)
            check_shapes(model, headers, folder, strict=False)
    if config is None:
        return
    known = config_path is not None
    generation = _generation_config(folder) if known else {}
    grid_file = os.path.join(folder, backbone_class.grid_file) if known else None
    grid_where = f"{grid_file!r}: `{backbone_class.grid_key}`" if known else f"the checkpoint's `{backbone_class.grid_key}`"
    if image_grid is not None:
        generation = {**generation, "image_grid": list(image_grid) if isinstance(image_grid, (list, tuple)) else image_grid}
        grid_where, grid_file = "`image_grid`", None
    limit_where = f"{config_path!r}: `max_position_embeddings`" if known else "the config's `max_position_embeddings`"
    check_trained_positions(backbone_class, config, generation, grid_where, limit_where, grid_file)


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
    pipeline = _index_pipeline_class(pipeline_cls, read_json_file(index_path, "model_index.json"))
    for key, cls in classes.items():
        component_dir = os.path.join(folder, key)
        if os.path.isdir(component_dir):
            check_model_folder(cls, key, folder, component_dir, variant, getattr(pipeline, "backbone_class", None))
    if "draft_heads" in loaded:
        loaded["draft_heads"] = DraftHeadsMixin.from_pretrained(folder, subfolder="draft_heads")
    return loaded
