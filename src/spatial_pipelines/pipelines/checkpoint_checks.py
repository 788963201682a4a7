"""An original transformers checkpoint checked before ``from_backbone`` reads a weight (docs/checks.md, "Folders").

`read_backbone_config` and `load_checked_model` are a transformers family's ``from_backbone``: its JSON files checked
before transformers parses them (`precheck_backbone`), then the weights and grid checks a pipeline folder's
``transformer`` gets (`check_backbone_checkpoint`, a local folder or a Hub id resolved as transformers resolves it,
before any weight is downloaded), the grid against the positions the model was trained for
(`check_trained_positions`).
"""

import os
from typing import Any, Dict, Optional

from ..utils import check_json_text, read_json_file, safetensors_header
from ..weight_checks import (HUB_FILE_KWARGS, PICKLE_WEIGHTS_NAMES, SAFE_WEIGHTS_NAMES, HubCheckpoint, _variant,
                             check_shapes, meta_model, pickle_refusal, refuse_pickles, weights_files)
from .transformers_utils import TREE_MASK_ATTENTION, check_device_map, check_image_fits_context


def check_trained_positions(backbone_class, config, generation_config: Dict[str, Any], folder: Optional[str],
                            image_grid=None) -> None:
    """A transformers family's grid (`TransformersBackbone.grid_from_configs`, from the transformers ``config`` and
    the generation config, or the ``image_grid`` argument) against the positions its model was trained for (the text
    config's ``max_position_embeddings``): a grid whose image leaves no position for a prompt is a `ValueError` naming
    what set it (a file of the checkpoint ``folder``, ``None`` where it was not found, or the argument)."""
    if backbone_class is None or not hasattr(backbone_class, "grid_from_configs"):
        return
    if image_grid is not None:
        generation_config = {**generation_config,
                             "image_grid": list(image_grid) if isinstance(image_grid, (list, tuple)) else image_grid}
    if backbone_class.grid_file == "generation_config.json" and "image_grid" not in generation_config:
        return  # the family's default grid: checked at every call (`TransformersBackbone.check_image_positions`)
    key = backbone_class.grid_key
    grid_file = os.path.join(folder, backbone_class.grid_file) if folder is not None and image_grid is None else None
    grid_where = "`image_grid`" if image_grid is not None else (f"{grid_file!r}: `{key}`" if grid_file else
                                                                f"the checkpoint's `{key}`")
    limit_where = (f"{os.path.join(folder, 'config.json')!r}: `max_position_embeddings`" if folder is not None
                   else "the config's `max_position_embeddings`")
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
    return read_json_file(path, "generation config", json_object=True) if os.path.isfile(path) else {}


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
        files, pickles = weights_files(folder)
        if not files and pickles:
            raise ValueError(pickle_refusal(f"The checkpoint folder {folder!r}", pickles, folder, "model.safetensors"))
    return {p: safetensors_header(p, "checkpoint weights") for p in files}


def _hub_checkpoint(repo_id: str, kwargs: Dict[str, Any]):
    """``(config path, headers or None)`` of a Hub checkpoint, its small files in the cache: ``None`` headers where the
    weights cannot be read without downloading them and the Hub is offline (transformers then says they are not in
    the cache). A repo with pickled weights and no safetensors is a `ValueError` (nothing downloaded)."""
    hub = HubCheckpoint(repo_id, kwargs)
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
    `RecursionError`); ``use_safetensors=False`` is refused (`refuse_pickles`). Returns ``kwargs`` without
    ``use_safetensors``."""
    kwargs = dict(kwargs)
    refuse_pickles(kwargs.pop("use_safetensors", None))
    folder = _checkpoint_folder(repo_or_path, kwargs.get("subfolder"))
    hub = None if folder is not None else HubCheckpoint(os.fspath(repo_or_path), kwargs)
    for name in ("config.json", "generation_config.json"):
        path = os.path.join(folder, name) if folder is not None else hub.small_file(name)
        if path is not None and os.path.isfile(path):
            with open(path, encoding="utf-8", errors="replace") as f:
                check_json_text(f.read(), path, "model config" if name == "config.json" else "generation config")
    return kwargs


def check_backbone_checkpoint(backbone_class, model_cls, repo_or_path, config, image_grid,
                              hub_kwargs: Dict[str, Any]) -> None:
    """What a family's ``from_backbone`` reads, checked before transformers reads a weight: the original transformers
    checkpoint (``config.json`` + safetensors) as a pipeline folder's ``transformer`` is (every tensor ``config``, the
    family's completed transformers config, builds on the meta device is in its safetensors, of that shape, and
    nothing else: `check_shapes`; pickles alone are refused), and the grid (the ``image_grid`` argument, else its
    generation config's) against the positions the model was trained for.

    A local folder is read where it is. A Hub id is resolved as transformers resolves it (``hub_kwargs``: ``revision``,
    ``cache_dir``, ``token``, ``local_files_only``, ``variant``, ``subfolder``; ``HF_HUB_OFFLINE`` honoured): its small
    files are downloaded into the Hub cache, its weights' headers read from the cache or by ranged reads; no weight is
    downloaded before the checks pass."""
    folder = _checkpoint_folder(repo_or_path, hub_kwargs.get("subfolder"))
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
        read_json_file(config_path, "model config", json_object=True)
        if headers:
            check_shapes(meta_model(model_cls, config, config_path), headers, folder, strict=False)
    known = config_path is not None
    check_trained_positions(backbone_class, config, _generation_config(folder) if known else {},
                            folder if known else None, image_grid)

def read_backbone_config(repo_or_path, kwargs: Dict[str, Any], model_type: str, what: str, attn_implementation: str,
                         torch_dtype, dtype, hub_only: bool = False):
    """A family's ``from_backbone`` up to its transformers config: ``attn_implementation`` must take tree masks and
    ``torch_dtype`` / ``dtype`` agree; the JSON files are checked (`precheck_backbone`), the config read (with
    ``kwargs``, or only their `HUB_FILE_KWARGS` where ``hub_only``) and its ``model_type`` checked (``what``: the
    checkpoint the error names). Returns ``(weights dtype or None, kwargs without use_safetensors, config)``."""
    from transformers import AutoConfig

    if attn_implementation not in TREE_MASK_ATTENTION:
        raise ValueError(f"`attn_implementation` must be one of {TREE_MASK_ATTENTION} (draft trees need an arbitrary "
                         f"attention mask), got {attn_implementation!r}.")
    if torch_dtype is not None and dtype is not None and torch_dtype != dtype:
        raise ValueError(f"`torch_dtype` ({torch_dtype}) and `dtype` ({dtype}) disagree; pass one.")
    kwargs = precheck_backbone(repo_or_path, kwargs)
    config_kwargs = {k: v for k, v in kwargs.items() if k in HUB_FILE_KWARGS} if hub_only else kwargs
    config = AutoConfig.from_pretrained(repo_or_path, **config_kwargs)
    if config.model_type != model_type:
        raise ValueError(f"`repo_or_path` {os.fspath(repo_or_path)!r} holds a {config.model_type!r} model, not {what}.")
    return (dtype if dtype is not None else torch_dtype), kwargs, config


def load_checked_model(backbone_class, model_cls, repo_or_path, config, kwargs: Dict[str, Any],
                       attn_implementation: str, weights_dtype, device_map, image_grid=None, pass_config: bool = False):
    """``model_cls.from_pretrained`` (safetensors only, in eval mode; built from ``config`` where ``pass_config``) once
    `check_backbone_checkpoint` passed; a model transformers spread over several accelerators is refused
    (`check_device_map`)."""
    check_backbone_checkpoint(backbone_class, model_cls, repo_or_path, config, image_grid, kwargs)
    extra = {**({"device_map": device_map} if device_map is not None else {}),
             **({"config": config} if pass_config else {})}
    model = model_cls.from_pretrained(
        repo_or_path, attn_implementation=attn_implementation, use_safetensors=True,
        dtype=weights_dtype if weights_dtype is not None else "auto", **extra, **kwargs).eval()
    check_device_map(model)
    return model
