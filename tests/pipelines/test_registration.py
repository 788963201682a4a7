"""spatial_pipelines registers itself in diffusers' private component tables: these tests fail loudly if
diffusers moves them (then `_registration.py` must follow)."""

import json

import torch

from diffusers.pipelines import pipeline_loading_utils, pipeline_utils

import spatial_pipelines
from spatial_pipelines.testing import dummy_pipeline


def test_private_tables_exist_and_hold_us():
    assert isinstance(pipeline_loading_utils.LOADABLE_CLASSES, dict)
    assert "spatial_pipelines" in pipeline_loading_utils.LOADABLE_CLASSES
    assert pipeline_utils.LOADABLE_CLASSES is pipeline_loading_utils.LOADABLE_CLASSES
    assert {"ModelMixin", "SchedulerMixin"} <= set(pipeline_loading_utils.ALL_IMPORTABLE_CLASSES)
    assert "spatial_pipelines" in pipeline_utils.LIBRARIES


def test_base_class_names_are_bound_on_the_package():
    # diffusers resolves a component's base class by name on the library it is recorded under
    for name in pipeline_loading_utils.LOADABLE_CLASSES["spatial_pipelines"]:
        assert getattr(spatial_pipelines, name) is not None


def test_model_index_records_the_package(tmp_path):
    pipe = dummy_pipeline("llamagen")
    pipe.save_pretrained(tmp_path)
    index = json.loads((tmp_path / "model_index.json").read_text())
    assert index["_class_name"] == "LlamaGenPipeline"
    assert index["decoder"] == ["spatial_pipelines", "AutoregressiveDecoder"]
    assert index["transformer"] == ["spatial_pipelines", "LlamaGenTransformer"]
    assert index["vqvae"] == ["spatial_pipelines", "LlamaGenVQModel"]


def test_registration_is_idempotent():
    before = dict(pipeline_loading_utils.LOADABLE_CLASSES["spatial_pipelines"])
    spatial_pipelines.register_with_diffusers()
    assert pipeline_loading_utils.LOADABLE_CLASSES["spatial_pipelines"] == before
    assert pipeline_utils.LIBRARIES.count("spatial_pipelines") == 1


def test_auto_pipeline_for_text2image_loads_a_saved_pipeline(tmp_path):
    """diffusers' `AutoPipelineForText2Image` finds our pipelines in its (private) text-to-image table."""
    from diffusers import AutoPipelineForText2Image
    from diffusers.pipelines import auto_pipeline

    assert auto_pipeline.AUTO_TEXT2IMAGE_PIPELINES_MAPPING["spatial-pipelines-LlamaGenPipeline"] is spatial_pipelines.LlamaGenPipeline
    pipe = dummy_pipeline("llamagen")
    pipe.save_pretrained(tmp_path)
    loaded = AutoPipelineForText2Image.from_pretrained(tmp_path)
    assert type(loaded) is spatial_pipelines.LlamaGenPipeline
    for name, param in pipe.transformer.state_dict().items():
        assert torch.equal(param, loaded.transformer.state_dict()[name]), name
