"""The documentation site (`mkdocs.yml`, pages under `docs/`): it builds with ``mkdocs build --strict`` (a broken link,
a missing page or an unresolved reference fails), and its decoder, family, heads and API pages render every public
decoder, pipeline, heads class and `DecodingStats` field from the docstrings. A new public class that no page
renders fails here. The pages' examples (python blocks, inline calls, benchmark decoder specs) name only what the library
takes."""

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import spatial_pipelines
from spatial_pipelines import DecodingStats, DraftHeadsMixin, SpatialARPipeline, SpatialDecoderMixin

from helpers import benchmark_parse_decoder, example_problems

ROOT = Path(__file__).resolve().parents[1]


def _public(base):
    classes = [getattr(spatial_pipelines, name) for name in spatial_pipelines.__all__]
    found = sorted(c.__name__ for c in classes if isinstance(c, type) and issubclass(c, base) and c is not base)
    assert found, f"no public subclass of {base.__name__}: the check would pass vacuously"
    return found


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                          capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return out


def _page(site, path):
    return (site / path / "index.html").read_text()


def _rendered(html, qualname):
    """Whether mkdocstrings rendered ``qualname`` on the page (its heading anchor), not only mentioned it."""
    return f'id="{qualname}"' in html


def _section_text(html, qualname):
    """The text of one rendered object: from its heading to the next rendered top-level object."""
    start = html.index(f'id="{qualname}"')
    nxt = re.search(r'id="spatial_pipelines\.(?!' + re.escape(qualname.split(".")[-1]) + r'\b)[A-Za-z_]+"', html[start + 1:])
    end = start + 1 + nxt.start() if nxt else len(html)
    return re.sub(r"<[^>]+>", " ", html[start:end])


def test_the_site_builds_strictly(site):
    for page in ["index.html", "decoders/index.html", "families/index.html", "api/index.html", "heads/index.html"]:
        assert (site / page).is_file(), page


def test_decoder_page_renders_every_public_decoder(site):
    html = _page(site, "decoders")
    for name in _public(SpatialDecoderMixin):
        assert _rendered(html, f"spatial_pipelines.{name}"), name


def test_family_pages_render_every_pipeline(site):
    pages = "".join((p / "index.html").read_text() for p in (site / "families").iterdir() if p.is_dir())
    pages += _page(site, "families")
    for name in _public(SpatialARPipeline):
        assert _rendered(pages, f"spatial_pipelines.{name}"), name


def test_api_page_renders_every_public_class_and_stats_field(site):
    api, heads = _page(site, "api"), _page(site, "heads")
    for name in _public(DraftHeadsMixin):
        assert _rendered(heads, f"spatial_pipelines.{name}") and _rendered(api, f"spatial_pipelines.{name}"), name
    for name in _public(SpatialDecoderMixin) + _public(SpatialARPipeline) + ["DecodingStats", "SpatialPipelineOutput"]:
        assert _rendered(api, f"spatial_pipelines.{name}"), name
    stats = _section_text(api, "spatial_pipelines.DecodingStats")
    fields = [f.name for f in dataclasses.fields(DecodingStats)]
    assert len(fields) > 5
    for field in fields:
        assert re.search(rf"\b{field}\b", stats), f"DecodingStats.{field} is not rendered on the API page"


def test_the_pages_examples_name_only_arguments_the_library_takes():
    """Every page under docs/ and the README: the imports and keyword arguments of its python examples, its inline
    calls and its benchmark decoder specs (tables and commands) are ones the library takes now."""
    parse_decoder = benchmark_parse_decoder()
    pages = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]
    checked, problems = 0, []
    for page in pages:
        more, found = example_problems(page.read_text(encoding="utf-8"), str(page.relative_to(ROOT)), parse_decoder)
        checked, problems = checked + more, problems + found
    assert problems == []
    assert checked > 100, f"only {checked} examples found in {len(pages)} pages"
