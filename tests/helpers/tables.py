"""The parameter tables every decoder and family runs through, derived from the package's registries: every decoder
(`DECODERS`) gets a row of its defaults, id its short name, and every family (`FAMILIES`) a row of its defaults, id its
family name. A class that needs specific settings in every test replaces its default row with one of the same id in
`DECODER_ROWS` / `FAMILY_ROWS`; more rows there add configurations. A new decoder or family needs no edit here unless
it needs settings (docs/contributing.md)."""

import pytest

from spatial_pipelines import (
    ADTTreeDecoder,
    EagleDecoder,
    HawkDecoder,
    JacobiDecoder,
    MedusaDecoder,
    SSDDecoder,
)
from spatial_pipelines.decoders import DECODERS
from spatial_pipelines.testing import FAMILIES, dummy_pipeline

# (decoder class, config kwargs, draft heads for dummy_pipeline): rows beyond each decoder's default row
DECODER_ROWS = [
    pytest.param(MedusaDecoder, {"num_heads": 3, "tree_paths": [[0], [0, 0], [0, 0, 0], [1], [1, 0], [1, 1], [2]]}, "random", id="medusa-paths"),
    pytest.param(HawkDecoder, {"num_horizontal_heads": 2, "vertical_speculation_depth": 1, "top_k": 1, "num_draft_tokens": 4}, "random", id="hawk-small"),
    # the default row `sjd` is init="above", coupling="gumbel", anchor="left"
    pytest.param(JacobiDecoder, {"init": "random", "coupling": "none", "anchor": "none"}, None, id="sjd-random"),
    pytest.param(JacobiDecoder, {"window_size": 4, "init": "left", "coupling": "none", "anchor": "none"}, None, id="sjd-left"),
    pytest.param(JacobiDecoder, {"window_size": 3, "init": "above", "coupling": "none", "anchor": "none"}, None, id="sjd-above"),
    pytest.param(JacobiDecoder, {"window_size": 4, "init": "random", "coupling": "gumbel", "anchor": "none"}, None, id="sjd-gumbel"),
    pytest.param(JacobiDecoder, {"window_size": 4, "init": "random", "coupling": "none", "continuation": True, "anchor": "none"}, None, id="sjd-continuation"),
    pytest.param(JacobiDecoder, {"window_size": 4, "init": "heads", "coupling": "none", "anchor": "none"}, "random", id="sjd-heads"),
    pytest.param(JacobiDecoder, {"window_size": 4, "init": "random", "coupling": "none", "proactive_width": 2, "anchor": "none"}, None, id="sjd-proactive"),
    pytest.param(JacobiDecoder, {"window_size": 4, "init": "random", "coupling": "none", "anchor": "left"}, None, id="sjd-anchor"),  # each option alone from the paper's setting (anchor="none" in the rows above)
    pytest.param(JacobiDecoder, {"window_size": 5, "init": "heads", "coupling": "gumbel", "continuation": True, "proactive_width": 3,
                                 "anchor": "left"}, "random", id="sjd-heads-gumbel-continuation-proactive-anchor"),
    # EAGLE-2's and ADT-Tree's defaults draft trees too large for the tiny models: their rows replace the default rows
    pytest.param(EagleDecoder, {"depth": 3, "top_k": 2, "num_draft_tokens": 5}, "random", id="eagle"),
    pytest.param(EagleDecoder, {"depth": 4, "top_k": 3}, "random", id="eagle-default"),
    pytest.param(ADTTreeDecoder, {"depth": 2, "top_k": 2, "depth_range": (1, 4), "width_range": (1, 4), "width_step": 1, "beta": 0.5}, "random", id="adt"),
    pytest.param(ADTTreeDecoder, {"depth": 3, "top_k": 3, "tree_init": "vertical", "num_draft_tokens": 6, "width_range": (2, 5), "width_step": 2}, "random", id="adt-vertical"),
    pytest.param(ADTTreeDecoder, {"depth": 2, "top_k": 3, "tree_init": "random", "depth_range": (1, 3), "width_range": (1, 3), "width_step": 1}, "random", id="adt-random"),
    pytest.param(SSDDecoder, {"num_vertical_rows": 2, "staged_base_rounds": 2, "staged_incremental_rounds": 1, "draft": "sample"}, "random", id="ssd-staged"),
]

PROMPTS = ["a red fox", "blue sky", "x"]

# (family, dummy_pipeline options, prompts): rows beyond each family's default row (LlamaGen's: text-to-image)
FAMILY_ROWS = [
    pytest.param("llamagen", {"condition_type": "class"}, [3, 7, 1], id="llamagen-c2i"),
    pytest.param("llamagen", {"end_of_row": True}, PROMPTS, id="llamagen-eol"),
]


def _with_defaults(defaults, rows, cls_of):
    """``defaults`` (one row per registered class, id its name), each replaced by the row of the same id in ``rows``
    where there is one, and followed by that class's other rows."""
    table = []
    for default in defaults:
        own = [r for r in rows if cls_of(r) == cls_of(default)]
        replaced = any(r.id == default.id for r in own)
        table += own if replaced else [default, *own]
    return table


def decoder_cases(decoders=None) -> list:
    """One default row per decoder in ``decoders`` (default: `DECODERS` as it is now), id its short name, draft heads
    ``"random"`` where its default config drafts with heads, then its rows in `DECODER_ROWS`."""
    decoders = dict(DECODERS) if decoders is None else decoders
    defaults = [pytest.param(cls, {}, "random" if cls().heads_needed() is not None else None, id=name)
                for name, cls in decoders.items()]
    return _with_defaults(defaults, DECODER_ROWS, lambda row: row.values[0])


def family_cases(families=None) -> list:
    """One default row per family in ``families`` (default: `FAMILIES` as it is now), id the family, then its rows in
    `FAMILY_ROWS`."""
    families = list(FAMILIES) if families is None else families
    return _with_defaults([pytest.param(f, {}, PROMPTS, id=f) for f in families], FAMILY_ROWS, lambda row: row.values[0])


def _package(classes: dict) -> dict:
    return {k: v for k, v in classes.items() if v.__module__.startswith("spatial_pipelines.")}


# the package's own decoders and families (a test module's are added by the tests that define them)
DECODER_CASES = decoder_cases(_package(dict(DECODERS)))
EXACT_CASES = [c for c in DECODER_CASES if c.values[0](**c.values[1]).is_exact]  # of the configured instance


FAMILY_CASES = family_cases([f for f, cls in FAMILIES.items() if cls.__module__.startswith("spatial_pipelines.")])


def make(decoder_cls, kwargs, heads, family="llamagen", **dummy):
    return dummy_pipeline(family, decoder_cls(**kwargs), heads, **dummy)
