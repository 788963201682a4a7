import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never download
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

if os.environ.get("PYTEST_XDIST_WORKER"):  # `pytest -n 2`: one torch thread per worker, so workers do not oversubscribe the cores
    import torch

    torch.set_num_threads(1)

import spatial_pipelines.pipelines.pass_cost  # noqa: E402

# "auto" draft sizes time c(T) and each decoder's round in sweeps; 3 instead of 15 on the tiny test models, whose
# chosen sizes only the cost tests check (tests/decoders/test_round_cost.py, tests/scripts/test_check_auto_sizes.py)
spatial_pipelines.pipelines.pass_cost.SWEEPS = 3

import pytest  # noqa: E402

from spatial_pipelines.pipelines.device_tree import TreeLoop  # noqa: E402
from spatial_pipelines.pipelines.generation import GenerationLoop  # noqa: E402


def row_group_reason(loop: GenerationLoop, batch_size: int, device):
    """Why a generation may run in row groups, or ``None``: the configurations the device rounds do not run yet (each
    named), a test's own decoder with only `propose` and `step`, and ``device_rounds=False`` (a test that compares
    the two engines)."""
    decoder, layout = loop.decoder, loop.backbone.layout
    if loop.device_rounds is False:
        return "device_rounds=False"
    if not type(decoder).__module__.startswith("spatial_pipelines."):
        return "a decoder written outside the library (only `propose` and `step`)"
    if type(decoder).__name__ == "JacobiDecoder" and decoder.config.proactive_width > 1:
        return "SJD's proactive tree"
    rule = decoder.acceptance_rule
    if rule.relaxes and not rule.claims_neighbours and decoder.chain_window() is None:
        return "a relaxed rule whose claim names no codes, on a tree"
    drafter = decoder.device_drafter(loop.draft_heads, layout, batch_size, device)
    if drafter is not None and not TreeLoop.fits(layout, drafter.tree_depth):
        return "a tree crossing two row ends"
    return None


@pytest.fixture(autouse=True)
def generations_stay_on_the_engine(monkeypatch):
    """The oracle's guard: a generation that leaves the device rounds fails the test, unless `row_group_reason`
    names why it may (the list shrinks as configurations move onto the engine)."""
    groups = GenerationLoop._generate_groups

    def guarded(self, prefix, sampling, generator, batch_size):
        if row_group_reason(self, batch_size, prefix.embeds.device) is None:
            pytest.fail(f"{type(self.decoder).__name__}({dict(self.decoder.config)}) left the device rounds "
                        f"(sampling {sampling}): the row-group loop ran it.")
        return groups(self, prefix, sampling, generator, batch_size)

    monkeypatch.setattr(GenerationLoop, "_generate_groups", guarded)
