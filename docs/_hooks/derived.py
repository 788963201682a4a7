"""mkdocs hook: the tables and reference lists that name every decoder, acceptance rule, family and draft-heads class
are written at build time from the package's registries, never by hand. A page holds a marker
``<!-- derived: NAME -->`` where one goes (`MARKERS`); the "Model families" section of the nav lists every page of
``docs/families/`` that names its pipeline in its front matter.

A family's page starts with front matter the families table reads::

    ---
    pipeline: LlamaGenPipeline
    checkpoints: original `.pt` checkpoints ...
    grid: 24x24 codes, 384 px
    status: tested on ...
    ---
"""

import re
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
FAMILY_PAGES = ROOT / "docs" / "families"
# this checkout's package (not an installed one), imported now: mkdocs restores `sys.path` once hooks are loaded, and
# mkdocstrings inspects the package already imported
sys.path.insert(0, str(ROOT / "src"))
import spatial_pipelines  # noqa: E402,F401
MARKER = re.compile(r"<!-- derived: ([a-z-]+) -->")


def _summary(cls) -> str:
    """The first paragraph of a class's docstring, on one line (pipes escaped for a table cell)."""
    doc = (cls.__doc__ or "").strip().split("\n\n")[0]
    return " ".join(line.strip() for line in doc.splitlines()).replace("|", "\\|")


def _exact(decoder) -> str:
    return "yes" if decoder.is_exact else "no (lossy by design)"


def decoder_table() -> str:
    """One row per short name in `DECODERS`: the class, its docstring's summary, whether its default configuration is
    exact, the draft heads it needs."""
    from spatial_pipelines.decoders import DECODERS
    from spatial_pipelines.heads import heads_class_for

    rows = ["| short name | class | what | exact (defaults) | draft heads |", "|---|---|---|---|---|"]
    for name, cls in sorted(DECODERS.items()):
        decoder = cls()
        need = decoder.heads_needed()
        heads = " or ".join(f"`{heads_class_for(kind).__name__}`" for kind in need.kinds) if need is not None else "-"
        rows.append(f"| `{name}` | `{cls.__name__}` | {_summary(cls)} | {_exact(decoder)} | {heads} |")
    return "\n".join(rows)


def acceptance_table() -> str:
    """One row per rule in `ACCEPTANCE_RULES`: what ``acceptance=`` names, the class, its summary, exactness."""
    from spatial_pipelines.core.acceptance import ACCEPTANCE_RULES

    rows = ["| `acceptance=` | class | what | exact |", "|---|---|---|---|"]
    for name, cls in ACCEPTANCE_RULES.items():
        rows.append(f"| `\"{name}\"` | `{cls.__name__}` | {_summary(cls)} | {'yes' if cls.is_exact else 'no (lossy by design)'} |")
    return "\n".join(rows)


def family_pages() -> dict:
    """``{pipeline class name: (page file name, front matter, title)}`` of the pages in ``docs/families/``."""
    pages = {}
    for path in sorted(FAMILY_PAGES.glob("*.md")):
        text = path.read_text(encoding="utf-8")
        match = re.match(r"---\n(.*?)\n---\n", text, re.S)
        if not match:
            continue
        meta = yaml.safe_load(match.group(1)) or {}
        title = re.search(r"^# (.+)$", text[match.end():], re.M)
        pages[meta.get("pipeline")] = (path.name, meta, title.group(1).strip() if title else path.stem)
    return pages


def family_table() -> str:
    """One row per family in `family_pipelines`, its checkpoints, grid and status from its page's front matter (``-``
    where it has no page)."""
    from spatial_pipelines import family_pipelines

    pages = family_pages()
    rows = ["| family | pipeline | `from_backbone` id | grid, pixels | status |", "|---|---|---|---|---|"]
    for family, cls in family_pipelines().items():
        page = pages.get(cls.__name__)
        name = f"[{page[2]}]({page[0]})" if page else f"`{family}`"
        meta = page[1] if page else {}
        rows.append(f"| {name} | `{cls.__name__}` | {meta.get('checkpoints', '-')} | {meta.get('grid', '-')} | "
                    f"{meta.get('status', '-')} |")
    return "\n".join(rows)


def _reference(classes, **options) -> str:
    lines = []
    for cls in classes:
        lines.append(f"::: spatial_pipelines.{cls.__name__}")
        if options:
            lines.append("    options:")
            lines += [f"      {k}: {str(v).lower() if isinstance(v, bool) else v}" for k, v in options.items()]
        lines.append("")
    return "\n".join(lines)


def _decoders():
    from spatial_pipelines import decoder_classes

    return list(decoder_classes().values())


def _families():
    from spatial_pipelines import family_pipelines

    return list(family_pipelines().values())


def _heads():
    from spatial_pipelines.heads import DraftHeadsMixin
    from spatial_pipelines.utils import subclasses

    return [c for c in subclasses(DraftHeadsMixin) if c.__dict__.get("kind") is not None]


def api_pipelines() -> str:
    from spatial_pipelines import SpatialARPipeline
    from spatial_pipelines.pipelines.call_checks import CallChecksMixin
    from spatial_pipelines.pipelines.loop_settings import LoopSettingsMixin

    # the pipeline's own methods kept in the modules it is split into (its call's checks, its loop's settings)
    split = [name for mixin in (CallChecksMixin, LoopSettingsMixin) for name in vars(mixin) if not name.startswith("_")]
    return _reference([SpatialARPipeline], inherited_members=split) + "\n" + _reference(_families())


def api_decoders() -> str:
    from spatial_pipelines import SpatialDecoderMixin

    return _reference([SpatialDecoderMixin, *_decoders()])


def api_heads() -> str:
    from spatial_pipelines import DraftHeadsMixin

    return _reference([DraftHeadsMixin, *_heads()])


def decoder_reference() -> str:
    return _reference(_decoders(), heading_level=3, members=False)


MARKERS = {
    "decoder-table": decoder_table,
    "acceptance-table": acceptance_table,
    "family-table": family_table,
    "api-pipelines": api_pipelines,
    "api-decoders": api_decoders,
    "api-heads": api_heads,
    "decoder-reference": decoder_reference,
}


def render(markdown: str) -> str:
    """``markdown`` with every marker replaced by what it derives."""
    return MARKER.sub(lambda m: MARKERS[m.group(1)](), markdown)


def family_nav() -> list:
    """The "Model families" nav section: the index, then every family page by title."""
    pages = sorted(family_pages().values(), key=lambda page: page[2].lower())
    return ["families/index.md", *({title: f"families/{name}"} for name, _, title in pages)]


def on_config(config, **kwargs):
    for item in config["nav"] or []:
        if isinstance(item, dict) and "Model families" in item:
            item["Model families"] = family_nav()
    return config


def on_page_markdown(markdown, page, config, files, **kwargs):
    return render(markdown)
