"""One model component's files checked against each other before any weight is read (docs/checks.md, "Folders"), at
every door a component comes through: a pipeline folder (`pipelines.folder_checks`), an original transformers
checkpoint (`pipelines.checkpoint_checks`) and the component class's own ``from_pretrained`` (`CheckedLoadMixin`, what
``DiffusionPipeline.from_pretrained`` calls). Every finding is a `ValueError` naming the file and the key:

- a config has the types and ranges its class takes (ints within [1 or 0, `MAX_CONFIG_INT`]);
- weights are whole safetensors files (a pickle is never loaded; pickles alone are refused, saying how to convert);
- the weights hold exactly the tensors, of the shapes, that the config builds (on the ``meta`` device; a transformers
  model's names through its renaming);
- facts a model recorded in its weights' metadata (`SAVED_FACTS_KEY`: grid, prefix) equal its config's.

`load_tensor_checkpoint` reads an original-format ``.pt`` / ``.ckpt`` file with torch's restricted unpickler.
"""

import collections.abc
import copy
import inspect
import json
import math
import numbers
import os
import pickle
import re
import typing
from typing import Any, Dict, Optional

import torch
from diffusers import ModelMixin
from diffusers.utils import _add_variant as _variant  # ``model.safetensors`` -> ``model.<variant>.safetensors``

from .utils import PICKLE_SUFFIXES, SAVED_FACTS_KEY, read_json_file, safetensors_header

#: The largest int a model config may hold (sizes, counts); past it no model of these families exists and building
#: one would exhaust memory before its weights are compared.
MAX_CONFIG_INT = 2**20


#: transformers' names for a checkpoint's weights: the safetensors it loads, the pickles it would fall back to.
SAFE_WEIGHTS_NAMES = ("model.safetensors", "model.safetensors.index.json")
PICKLE_WEIGHTS_NAMES = ("pytorch_model.bin", "pytorch_model.bin.index.json")
#: diffusers' names for a model's safetensors weights.
DIFFUSERS_WEIGHTS_NAMES = ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.safetensors.index.json")
#: ``from_pretrained`` arguments that say where a checkpoint's files are, as transformers reads them.
HUB_FILE_KWARGS = ("revision", "cache_dir", "token", "local_files_only", "force_download", "proxies", "subfolder")


class HubCheckpoint:
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


def weights_files(component_dir: str):
    """The safetensors files of a component folder, and the pickles beside them."""
    names = sorted(os.listdir(component_dir))
    safe = [os.path.join(component_dir, n) for n in names if n.endswith(".safetensors")]
    pickles = [n for n in names if n.endswith(PICKLE_SUFFIXES)]
    return safe, pickles


def pickle_refusal(where: str, pickles, folder: str, safe_name: str) -> str:
    """The message refusing pickled weights (never loaded): names them and how to convert one where it is trusted."""
    first = os.path.join(folder, pickles[0])
    return (f"{where} holds pickled weights ({', '.join(pickles)}) and no safetensors: pickles are refused here, "
            "because loading one can run any code, so nothing was loaded. Where you trust them, convert them to "
            f"safetensors: `safetensors.torch.save_file(torch.load({first!r}, weights_only=True), "
            f"{os.path.join(folder, safe_name)!r})`.")


def refuse_pickles(use_safetensors) -> None:
    """``use_safetensors=False`` is a `ValueError`: the weights are loaded as safetensors only, never a pickle."""
    if use_safetensors is False:
        raise ValueError("`use_safetensors=False` asks for pickled weights: pickles are refused here, because loading "
                         "one can run any code.")


def check_weights(key: str, component_dir: str, variant: Optional[str] = None,
                  safe_name: str = "diffusion_pytorch_model.safetensors") -> Dict[str, dict]:
    """The headers of a component's safetensors files (each checked whole: `safetensors_header`); a `ValueError` when
    there are none but pickles (never loaded)."""
    safe, pickles = weights_files(component_dir)
    if variant is not None:
        safe = [p for p in safe if f".{variant}." in os.path.basename(p)] or safe
    if not safe and pickles:
        raise ValueError(pickle_refusal(f"The `{key}` folder {component_dir!r}", pickles, component_dir, safe_name))
    return {p: safetensors_header(p, f"`{key}` weights") for p in safe}


def meta_model(model_cls, config, path: str):
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


def checked_classes(model_cls):
    """``(own, transformers)``: whether ``model_cls`` is a model of this library (config checked against its
    constructor, weights compared strictly) or a transformers model (compared as transformers loads it)."""
    own = issubclass(model_cls, ModelMixin) and model_cls.__module__.startswith("spatial_pipelines.")
    is_transformers = not own and hasattr(model_cls, "config_class") and hasattr(model_cls, "_from_config")
    return own, is_transformers


def check_component(model_cls, key: str, component_dir: str, variant: Optional[str] = None):
    """One model component's folder: config types and ranges, whole safetensors weights (pickles refused), their
    names and shapes, its trained facts. Returns ``(config, meta model or None)``; ``(None, None)`` where there is
    nothing this library checks (no ``config.json``, or a class that is neither ours nor a transformers model)."""
    config_path = os.path.join(component_dir, "config.json")
    own, is_transformers = checked_classes(model_cls)
    if not os.path.isfile(config_path) or not (own or is_transformers):
        return None, None
    config = read_json_file(config_path, f"`{key}` config", json_object=True)
    if own:
        check_model_config(model_cls, config, config_path)
    headers = check_weights(key, component_dir, variant, "diffusion_pytorch_model.safetensors" if own else "model.safetensors")
    model = None
    if headers:
        check_trained_facts(headers, config, component_dir)
        model = meta_model(model_cls, config, config_path)
        check_shapes(model, headers, component_dir, strict=own)
    return config, model


# -- the component class's own door ---------------------------------------------------------------------------
def _hub_component_dir(repo_id: str, kwargs: Dict[str, Any]) -> Optional[str]:
    """The Hub cache folder of a component repo (``subfolder``, ``revision``, ``cache_dir`` as ``from_pretrained`` takes
    them), its config fetched as diffusers would (it is small); ``None`` where the config cannot be had (diffusers then
    says what is missing). Online, a repo whose weights are not cached yet and are pickles alone is a `ValueError`
    before any weight is downloaded."""
    hub = HubCheckpoint(repo_id, kwargs)
    config = hub.small_file("config.json")
    if config is None:
        return None
    folder = os.path.dirname(config)
    if hub.offline or any(weights_files(folder)):
        return folder  # what the cache holds is checked where it is
    safe = [_variant(n, hub.variant) for n in DIFFUSERS_WEIGHTS_NAMES]
    if not any(hub.has(n) for n in safe):
        pickles = [n for n in (_variant("diffusion_pytorch_model.bin", hub.variant),) if hub.has(n)]
        if pickles:
            raise ValueError(pickle_refusal(f"The Hub repo {hub.where} (`{hub.subfolder or 'weights'}`)", pickles, folder,
                                            safe[0]))
    return folder


def check_component_source(model_cls, pretrained_model_name_or_path, kwargs: Dict[str, Any]) -> None:
    """What a component class's ``from_pretrained`` checks before diffusers reads a weight: the folder (or, for a Hub id,
    its files in the Hub cache) as `check_component` checks a pipeline's component; ``use_safetensors=False`` is
    refused (pickles are never loaded)."""
    refuse_pickles(kwargs.get("use_safetensors"))
    path = os.fspath(pretrained_model_name_or_path)
    subfolder = kwargs.get("subfolder") or ""
    if os.path.isdir(path):
        folder = os.path.join(path, subfolder) if subfolder else path
    elif isinstance(pretrained_model_name_or_path, str):
        folder = _hub_component_dir(path, kwargs)
    else:
        folder = None
    if folder is None or not os.path.isdir(folder):
        return
    key = os.path.basename(os.path.normpath(folder)) or model_cls.__name__
    check_component(model_cls, key, folder, kwargs.get("variant"))


class CheckedLoadMixin:
    """For model classes: ``from_pretrained`` (a folder, ``subfolder`` of one, or a Hub id: also what
    ``DiffusionPipeline.from_pretrained`` calls for the component) checks the component's files first
    (`check_component_source`) and loads safetensors only."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        check_component_source(cls, pretrained_model_name_or_path, kwargs)
        kwargs["use_safetensors"] = True  # never a pickled .bin in place of a missing safetensors file
        return super().from_pretrained(pretrained_model_name_or_path, **kwargs)


# -- original-format checkpoints ------------------------------------------------------------------------------
_UNSUPPORTED = re.compile(r"Unsupported global: GLOBAL ([\w.]+)")


def load_tensor_checkpoint(path, argument: str):
    """The contents of an original-format checkpoint (``.pt``, ``.ckpt``: ``torch.save`` files) read with torch's
    restricted unpickler (``weights_only=True``: tensors and plain containers only). A file that holds other objects
    is a `ValueError` naming the file, ``argument`` and the first such object, and saying how to re-save its tensors
    where it is trusted; a file that is not a checkpoint (truncated, another format) is one too."""
    shown = os.fspath(path)
    try:
        return torch.load(shown, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        found = _UNSUPPORTED.search(str(err))
        what = f" (`{found.group(1)}`)" if found else ""
        allow = f"torch.serialization.safe_globals([{found.group(1)}])" if found else "torch.serialization.safe_globals([...])"
        raise ValueError(
            f"`{argument}` {shown!r} holds objects other than tensors{what}: spatial_pipelines will not unpickle them, "
            "because unpickling can run any code. Where you trust the file, re-save its tensors alone and pass that "
            f"file: `with {allow}: ckpt = torch.load({shown!r}, weights_only=True)`, then "
            "`torch.save(ckpt['model'], 'tensors.pt')` (the state dict of tensors it holds).") from None
    except (RuntimeError, EOFError, OSError, ValueError) as err:
        raise ValueError(f"`{argument}` {shown!r} is not a readable torch.save checkpoint (truncated or corrupt?): "
                         f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}") from None
