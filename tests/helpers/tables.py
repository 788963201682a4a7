"""The parameter tables every decoder and family runs through: a new decoder adds rows to `DECODER_CASES`, a new
family a row to `FAMILY_CASES` (docs/design.md, "Adding a decoder")."""

import pytest

from spatial_pipelines import (
    ADTTreeDecoder,
    AutoregressiveDecoder,
    EagleDecoder,
    HawkDecoder,
    JacobiDecoder,
    MedusaDecoder,
    SSDDecoder,
)
from spatial_pipelines.testing import dummy_pipeline

# (decoder class, config kwargs, draft heads for dummy_pipeline)
DECODER_CASES = [
    pytest.param(AutoregressiveDecoder, {}, None, id="ar"),
    pytest.param(MedusaDecoder, {}, "random", id="medusa"),
    pytest.param(MedusaDecoder, {"num_heads": 3, "tree_paths": [[0], [0, 0], [0, 0, 0], [1], [1, 0], [1, 1], [2]]}, "random", id="medusa-paths"),
    pytest.param(HawkDecoder, {}, "random", id="hawk"),
    pytest.param(HawkDecoder, {"num_horizontal_heads": 2, "vertical_speculation_depth": 1, "top_k": 1, "num_draft_tokens": 4}, "random", id="hawk-small"),
    pytest.param(JacobiDecoder, {}, None, id="sjd-default"),  # init="above", coupling="gumbel", anchor="left"
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
    pytest.param(EagleDecoder, {"depth": 3, "top_k": 2, "num_draft_tokens": 5}, "random", id="eagle"),
    pytest.param(EagleDecoder, {"depth": 4, "top_k": 3}, "random", id="eagle-default"),
    pytest.param(ADTTreeDecoder, {"depth": 2, "top_k": 2, "depth_range": (1, 4), "width_range": (1, 4), "width_step": 1, "beta": 0.5}, "random", id="adt"),
    pytest.param(ADTTreeDecoder, {"depth": 3, "top_k": 3, "tree_init": "vertical", "num_draft_tokens": 6, "width_range": (2, 5), "width_step": 2}, "random", id="adt-vertical"),
    pytest.param(ADTTreeDecoder, {"depth": 2, "top_k": 3, "tree_init": "random", "depth_range": (1, 3), "width_range": (1, 3), "width_step": 1}, "random", id="adt-random"),
    pytest.param(SSDDecoder, {}, "random", id="ssd"),
    pytest.param(SSDDecoder, {"num_vertical_rows": 2, "staged_base_rounds": 2, "staged_incremental_rounds": 1, "draft": "sample"}, "random", id="ssd-staged"),
]


EXACT_CASES = [c for c in DECODER_CASES if c.values[0](**c.values[1]).is_exact]  # of the configured instance


FAMILY_CASES = [
    pytest.param("llamagen", {"condition_type": "text"}, ["a red fox", "blue sky", "x"], id="llamagen-t2i"),
    pytest.param("llamagen", {"condition_type": "class"}, [3, 7, 1], id="llamagen-c2i"),
    pytest.param("llamagen", {"end_of_row": True}, ["a red fox", "blue sky", "x"], id="llamagen-eol"),
    pytest.param("janus", {}, ["a red fox", "blue sky", "x"], id="janus"),
    pytest.param("emu3", {}, ["a red fox", "blue sky", "x"], id="emu3"),
    pytest.param("anole", {}, ["a red fox", "blue sky", "x"], id="anole"),
    pytest.param("lumina_mgpt", {}, ["a red fox", "blue sky", "x"], id="lumina_mgpt"),
]


def make(decoder_cls, kwargs, heads, family="llamagen", **dummy):
    return dummy_pipeline(family, decoder_cls(**kwargs), heads, **dummy)
