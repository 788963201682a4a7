"""A decoder, an acceptance rule and a family defined in this module alone (no other file names them) are found
everywhere the library lists decoders, rules and families: the pipeline (a decoder swap, ``from_pretrained`` of a
saved folder), `dummy_pipeline`, the CLI's and benchmark specs' short names, the tables of the docs and the test
tables. The package derives every such list from its registries (`spatial_pipelines._registration`)."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from diffusers import DiffusionPipeline

import spatial_pipelines
from spatial_pipelines import AutoregressiveDecoder, JacobiDecoder, LlamaGenPipeline
from spatial_pipelines.cli import build_parser, main
from spatial_pipelines.core.acceptance import ACCEPTANCE_RULES, AcceptanceRule, resolve_acceptance
from spatial_pipelines.decoders import DECODERS
from spatial_pipelines.pipelines import LlamaGenBackbone
from spatial_pipelines.testing import FAMILIES, dummy_pipeline

from helpers import benchmark_parse_decoder, gen
from helpers.tables import decoder_cases, family_cases

ROOT = Path(__file__).resolve().parents[1]


class ToyExactAcceptance(AcceptanceRule):
    """Toy rule: the exact rule under a name of its own."""

    name = "toy-exact"


class ToyDecoder(AutoregressiveDecoder):
    """Toy decoder: one code per target pass, under a short name of its own."""

    short_name = "toy"


class ToyBackbone(LlamaGenBackbone):
    family = "toy_family"


class ToyPipeline(LlamaGenPipeline):
    """Toy family: LlamaGen's components under a family of its own."""

    backbone_class = ToyBackbone

    @classmethod
    def dummy_components(cls, grid=(4, 4), num_codes: int = 16):
        return LlamaGenPipeline.dummy_components(grid, num_codes)


def _docs_hook():
    spec = importlib.util.spec_from_file_location("docs_derived", ROOT / "docs" / "_hooks" / "derived.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_registries_hold_the_classes_defined_here():
    assert DECODERS["toy"] is ToyDecoder and "toy" in DECODERS
    assert ACCEPTANCE_RULES["toy-exact"] is ToyExactAcceptance
    assert FAMILIES["toy_family"] is ToyPipeline
    for cls in (ToyDecoder, ToyExactAcceptance, ToyPipeline):
        assert getattr(spatial_pipelines, cls.__name__) is cls  # how diffusers resolves a saved component
    assert "ToyDecoder" not in spatial_pipelines.__all__  # the public exports are the package's own classes


def test_the_pipeline_runs_and_reloads_them(tmp_path):
    pipe = dummy_pipeline("toy_family", "toy")
    assert type(pipe) is ToyPipeline and type(pipe.decoder) is ToyDecoder
    ref = pipe("a fox", temperature=0, output_type="latent").tokens
    pipe.decoder = JacobiDecoder(window_size=3, acceptance="toy-exact")
    assert type(pipe.decoder.acceptance_rule) is ToyExactAcceptance
    assert torch.equal(pipe("a fox", temperature=0, output_type="latent").tokens, ref)

    pipe.decoder = ToyDecoder()
    pipe.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "model_index.json").read_text())["decoder"] == ["spatial_pipelines", "ToyDecoder"]
    loaded = ToyPipeline.from_pretrained(tmp_path)
    assert type(loaded) is ToyPipeline and type(loaded.decoder) is ToyDecoder
    assert type(DiffusionPipeline.from_pretrained(tmp_path)) is ToyPipeline  # found as diffusers finds its own
    assert torch.equal(loaded("a fox", temperature=0, output_type="latent").tokens, ref)
    saved = JacobiDecoder(acceptance="toy-exact")
    saved.save_pretrained(tmp_path / "sjd")
    assert JacobiDecoder.from_pretrained(tmp_path / "sjd").acceptance_rule == resolve_acceptance("toy-exact")


def test_the_cli_and_benchmark_specs_take_the_short_name(tmp_path):
    args = build_parser().parse_args(["generate", "fox", "--decoder", "toy"])
    assert args.decoder == "toy"
    dummy_pipeline("toy_family").save_pretrained(tmp_path / "model")
    out = tmp_path / "fox.png"
    assert main(["generate", "fox", "--model", str(tmp_path / "model"), "--decoder", "toy", "--out", str(out)]) == 0
    assert out.is_file()
    spec, cls, kwargs = benchmark_parse_decoder()("sjd:acceptance=toy-exact")
    assert cls is JacobiDecoder and resolve_acceptance(kwargs["acceptance"]) == ToyExactAcceptance()
    assert benchmark_parse_decoder()("toy")[1] is ToyDecoder


def test_the_docs_tables_list_them():
    hook = _docs_hook()
    assert "| `toy` | `ToyDecoder` | Toy decoder: one code per target pass" in hook.decoder_table()
    assert '| `"toy-exact"` | `ToyExactAcceptance` | Toy rule' in hook.acceptance_table()
    assert "| `toy_family` | `ToyPipeline` |" in hook.family_table()
    for marker, name in (("api-decoders", "ToyDecoder"), ("decoder-reference", "ToyDecoder"), ("api-pipelines", "ToyPipeline")):
        assert f"::: spatial_pipelines.{name}" in hook.render(f"<!-- derived: {marker} -->")


def test_the_test_tables_list_them():
    rows = {row.id: row.values for row in decoder_cases()}
    assert rows["toy"] == (ToyDecoder, {}, None)
    assert {row.id: row.values for row in family_cases()}["toy_family"][0] == "toy_family"


@pytest.mark.parametrize("cls,kwargs,heads", [r for r in decoder_cases() if r.values[0] is ToyDecoder])
def test_a_derived_row_runs(cls, kwargs, heads):
    pipe = dummy_pipeline("toy_family", cls(**kwargs), heads)
    assert pipe("a fox", generator=gen(0), output_type="latent").tokens.shape == (1, 4, 4)
