"""Register spatial_pipelines with diffusers' component tables.

diffusers records a third-party component in ``model_index.json`` by its full module path and refuses it when
downloading from the Hub. Adding the top-level package to ``LOADABLE_CLASSES`` / ``ALL_IMPORTABLE_CLASSES``
makes ``model_index.json`` read ``["spatial_pipelines", "AutoregressiveDecoder"]`` and lets both local and Hub
loading resolve our classes. These are private tables of diffusers; ``tests/test_registration.py`` fails loudly
if they move.

``DiffusionPipeline.from_pretrained(folder_or_repo)`` looks the folder's ``_class_name`` up on the ``diffusers``
module; our pipeline classes are bound there (only names diffusers does not define), so after
``import spatial_pipelines`` it returns a `LlamaGenPipeline` as ``LlamaGenPipeline.from_pretrained`` would.
Every pipeline is also a text-to-image entry of ``AutoPipelineForText2Image`` (its
``AUTO_TEXT2IMAGE_PIPELINES_MAPPING``, keyed ``spatial-pipelines-<class name>``), so that loads a saved folder too.
"""

LIBRARY = "spatial_pipelines"
ENTRY = {
    "ModelMixin": ["save_pretrained", "from_pretrained"],
    "SchedulerMixin": ["save_pretrained", "from_pretrained"],
    "DiffusionPipeline": ["save_pretrained", "from_pretrained"],
}


def register_with_diffusers() -> None:
    from diffusers.pipelines import pipeline_loading_utils, pipeline_utils

    if LIBRARY not in pipeline_loading_utils.LOADABLE_CLASSES:
        pipeline_loading_utils.LOADABLE_CLASSES[LIBRARY] = dict(ENTRY)
    pipeline_loading_utils.ALL_IMPORTABLE_CLASSES.update(ENTRY)
    if LIBRARY not in pipeline_utils.LIBRARIES:
        pipeline_utils.LIBRARIES.append(LIBRARY)
    bind_pipelines_on_diffusers()
    register_auto_pipelines()


def register_auto_pipelines() -> None:
    """Make ``AutoPipelineForText2Image.from_pretrained`` resolve every `SpatialARPipeline` subclass by the
    ``_class_name`` of a saved folder (diffusers matches the class name against its text-to-image table)."""
    from diffusers.pipelines import auto_pipeline

    from .pipelines.pipeline_utils import SpatialARPipeline
    from .utils import subclasses

    for cls in subclasses(SpatialARPipeline):
        auto_pipeline.AUTO_TEXT2IMAGE_PIPELINES_MAPPING.setdefault(f"spatial-pipelines-{cls.__name__}", cls)


def bind_pipelines_on_diffusers() -> None:
    """Make every `SpatialARPipeline` subclass resolvable as ``diffusers.<ClassName>`` (never replacing a diffusers name)."""
    import diffusers

    from .pipelines.pipeline_utils import SpatialARPipeline
    from .utils import subclasses

    for cls in subclasses(SpatialARPipeline):
        try:
            getattr(diffusers, cls.__name__)  # a diffusers name (lazily importable too) is never replaced
        except AttributeError:
            setattr(diffusers, cls.__name__, cls)
