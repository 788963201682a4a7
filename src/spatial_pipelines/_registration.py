"""Register spatial_pipelines with diffusers' component tables.

diffusers records a third-party component in ``model_index.json`` by its full module path and refuses it when
downloading from the Hub. Adding the top-level package to ``LOADABLE_CLASSES`` / ``ALL_IMPORTABLE_CLASSES``
makes ``model_index.json`` read ``["spatial_pipelines", "AutoregressiveDecoder"]`` and lets both local and Hub
loading resolve our classes. These are private tables of diffusers; ``tests/test_registration.py`` fails loudly
if they move.
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
