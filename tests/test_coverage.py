"""Tests that cannot pass vacuously: every family has a pipeline tester, and a tester that forgets an attribute
fails at collection instead of running tests that check nothing."""

import ast
from pathlib import Path

import pytest

from spatial_pipelines import LlamaGenPipeline
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
    assert set(FAMILIES) - set(testers) == set(), f"families without a PipelineTesterMixin subclass: {set(FAMILIES) - set(testers)}"
    assert set(testers) <= set(FAMILIES)


@pytest.mark.parametrize("forgotten", PipelineTesterMixin.REQUIRED)
def test_a_tester_that_forgets_an_attribute_fails_loudly(forgotten):
    settings = {"family": "llamagen", "pipeline_class": LlamaGenPipeline, "prompts": ["a", "b"],
                "bad_prompts": [([1, 2], "prompt")]}
    settings[forgotten] = [] if forgotten in ("prompts", "bad_prompts") else None
    with pytest.raises(TypeError, match=forgotten):
        type("TestForgetful", (PipelineTesterMixin,), settings)
