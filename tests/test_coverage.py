"""Tests that cannot pass vacuously: every family has a pipeline tester, a tester that forgets an attribute fails at
collection instead of running tests that check nothing, and the diffusers checks left unported do not apply."""

import ast
from pathlib import Path

import pytest

import spatial_pipelines
from spatial_pipelines import LlamaGenPipeline, SpatialARPipeline
from spatial_pipelines.testing import FAMILIES

from helpers import PipelineTesterMixin

TESTS = Path(__file__).parent


def _tester_families():
    """``{family: [tester class names]}`` read from the test files' source (no test module is imported)."""
    found = {}
    for path in sorted(TESTS.rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(getattr(b, "id", None) == "PipelineTesterMixin" for b in node.bases):
                for item in node.body:
                    if (isinstance(item, ast.Assign) and any(getattr(t, "id", None) == "family" for t in item.targets)
                            and isinstance(item.value, ast.Constant)):
                        found.setdefault(item.value.value, []).append(f"{path.name}::{node.name}")
    return found


def test_every_family_has_a_pipeline_tester():
    testers = _tester_families()
    shipped = {f for f, cls in FAMILIES.items() if cls.__module__.startswith("spatial_pipelines.")}  # not a test module's
    assert shipped and shipped - set(testers) == set(), f"families without a PipelineTesterMixin subclass: {shipped - set(testers)}"
    assert set(testers) <= set(FAMILIES)


@pytest.mark.parametrize("forgotten", PipelineTesterMixin.REQUIRED)
def test_a_tester_that_forgets_an_attribute_fails_loudly(forgotten):
    settings = {"family": "llamagen", "pipeline_class": LlamaGenPipeline, "prompts": ["a", "b"],
                "bad_prompts": [([1, 2], "prompt")]}
    settings[forgotten] = [] if forgotten in ("prompts", "bad_prompts") else None
    with pytest.raises(TypeError, match=forgotten):
        type("TestForgetful", (PipelineTesterMixin,), settings)


def _pipeline_classes():
    classes = [getattr(spatial_pipelines, name) for name in spatial_pipelines.__all__]
    found = [c for c in classes if isinstance(c, type) and issubclass(c, SpatialARPipeline) and c is not SpatialARPipeline]
    assert found, "no public pipeline class: the check below would pass vacuously"
    return found


@pytest.mark.parametrize("pipeline_class", _pipeline_classes(), ids=lambda c: c.__name__)
def test_the_diffusers_checks_left_unported_do_not_apply(pipeline_class):
    """``helpers/diffusers_checks.py`` leaves out diffusers' ``test_StableDiffusionMixin_component`` and
    ``test_encode_prompt_works_in_isolation``: they check Stable Diffusion pipelines and pipelines with their own
    ``encode_prompt``. A pipeline that becomes one fails here until its check is ported."""
    from diffusers.pipelines.pipeline_utils import StableDiffusionMixin

    assert not issubclass(pipeline_class, StableDiffusionMixin)
    assert not hasattr(pipeline_class, "encode_prompt")
