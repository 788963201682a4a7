"""Register spatial_pipelines with diffusers' component tables.

diffusers records a third-party component in ``model_index.json`` by its full module path and refuses it when
downloading from the Hub. Adding the top-level package to ``LOADABLE_CLASSES`` / ``ALL_IMPORTABLE_CLASSES``
makes ``model_index.json`` read ``["spatial_pipelines", "AutoregressiveDecoder"]`` and lets both local and Hub
loading resolve our classes. These are private tables of diffusers; ``tests/test_registration.py`` fails loudly
if they move.

``DiffusionPipeline.from_pretrained(folder_or_repo)`` looks the folder's ``_class_name`` up on the ``diffusers``
module; our pipeline classes are bound there (only names diffusers does not define: `bind_pipelines_on_diffusers`, which
`SpatialARPipeline` runs again for each family defined later), so after ``import spatial_pipelines`` it returns a `LlamaGenPipeline` as ``LlamaGenPipeline.from_pretrained`` would. A folder
(or Hub repo) of one of our pipelines is handed to that class's ``from_pretrained`` (`route_diffusion_pipeline_loading`),
so its folder checks run before any component is loaded.
Every pipeline is also a text-to-image entry of ``AutoPipelineForText2Image`` (its
``AUTO_TEXT2IMAGE_PIPELINES_MAPPING``, keyed ``spatial-pipelines-<class name>``: `register_auto_pipelines`), so that
loads a saved folder too.

The library's own registries are read off the loaded classes (`spatial_pipelines.utils.subclasses`), never listed,
each beside its base class: `decoder_classes` (``decoders/decoding_utils.py``: a `SpatialDecoderMixin` subclass that
sets its own ``short_name``), `family_pipelines` (``pipelines/pipeline_utils.py``: a `SpatialARPipeline` subclass that
defines its own ``dummy_components``), acceptance rules (`ACCEPTANCE_RULES`, filled as `AcceptanceRule` subclasses are
defined) and draft heads (`heads_class_for`, by ``kind``). A class defined in a user's file or a test module joins them
by being defined; `find_registered` resolves it by name (as ``spatial_pipelines.<Name>``, which is how diffusers loads
a saved folder's decoder).

This module reads the subpackages and sits above them: only the package's ``__init__`` imports it.
"""

import functools
import os
from typing import Optional

from diffusers import DiffusionPipeline
from diffusers.pipelines import pipeline_loading_utils, pipeline_utils

from .core.acceptance import AcceptanceRule
from .decoders.decoding_utils import SpatialDecoderMixin
from .heads.heads_utils import DraftHeadsMixin
from .pipelines.pipeline_utils import SpatialARPipeline, bind_pipelines_on_diffusers, register_auto_pipelines
from .utils import LIBRARY, find_subclass, read_json_file

ENTRY = {
    "ModelMixin": ["save_pretrained", "from_pretrained"],
    "SchedulerMixin": ["save_pretrained", "from_pretrained"],
    "DiffusionPipeline": ["save_pretrained", "from_pretrained"],
}


def register_with_diffusers() -> None:
    if LIBRARY not in pipeline_loading_utils.LOADABLE_CLASSES:
        pipeline_loading_utils.LOADABLE_CLASSES[LIBRARY] = dict(ENTRY)
    pipeline_loading_utils.ALL_IMPORTABLE_CLASSES.update(ENTRY)
    if LIBRARY not in pipeline_utils.LIBRARIES:
        pipeline_utils.LIBRARIES.append(LIBRARY)
    bind_pipelines_on_diffusers()
    register_auto_pipelines()
    route_diffusion_pipeline_loading()


def _named_pipeline(pretrained_model_name_or_path, kwargs) -> Optional[type]:
    """The pipeline class of this library that the folder's (or Hub repo's) ``model_index.json`` names; ``None`` for
    anything else, or where the index cannot be read (diffusers then says why)."""
    if not isinstance(pretrained_model_name_or_path, (str, os.PathLike)) or kwargs.get("custom_pipeline") is not None:
        return None
    path = os.fspath(pretrained_model_name_or_path)
    if os.path.isdir(path):
        index_path = os.path.join(path, "model_index.json")
        index = read_json_file(index_path, "model_index.json") if os.path.isfile(index_path) else None
    else:
        hub = {k: kwargs[k] for k in ("cache_dir", "force_download", "proxies", "local_files_only", "token", "revision")
               if k in kwargs}
        try:  # model_index.json alone (small, the Hub cache first), as diffusers reads it first
            index = DiffusionPipeline.load_config(path, **hub)
        except Exception:
            return None
    name = index.get("_class_name") if isinstance(index, dict) else None
    found = find_subclass(SpatialARPipeline, name) if isinstance(name, str) else None
    return found if found is not None and found.backbone_class is not None else None


def route_diffusion_pipeline_loading() -> None:
    """``DiffusionPipeline.from_pretrained(folder_or_repo)`` of a folder whose ``model_index.json`` names a pipeline of
    this library goes through that class's ``from_pretrained``, so the folder checks run before any component is
    loaded (diffusers loads the components in no fixed order); every other folder loads as diffusers loads it."""
    original = DiffusionPipeline.__dict__["from_pretrained"].__func__
    if getattr(original, "_spatial_pipelines_route", False):
        return

    @functools.wraps(original)
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        target = _named_pipeline(pretrained_model_name_or_path, kwargs) if cls is DiffusionPipeline else None
        if target is not None:
            return target.from_pretrained(pretrained_model_name_or_path, **kwargs)
        return original(cls, pretrained_model_name_or_path, **kwargs)

    from_pretrained._spatial_pipelines_route = True
    DiffusionPipeline.from_pretrained = classmethod(from_pretrained)


def find_registered(name: str) -> Optional[type]:
    """The loaded decoder, draft heads, pipeline or acceptance rule class called ``name`` (``None``: none is)."""
    bases = (SpatialDecoderMixin, SpatialARPipeline, DraftHeadsMixin, AcceptanceRule)
    return next(filter(None, (find_subclass(base, name) for base in bases)), None)
