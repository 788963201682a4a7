"""`count_rounds`: host reads, eager ops and compiles per round, counted on the CPU (what a GPU round pays for)."""

import pytest
import torch

from spatial_pipelines import AutoregressiveDecoder, JacobiDecoder, MedusaDecoder
from spatial_pipelines.pipelines.round_counts import count_rounds
from spatial_pipelines.testing import dummy_pipeline

PROMPTS = ["a red fox", "x"]


def _pipe(decoder, heads=None, compiled=False):
    pipe = dummy_pipeline("llamagen", decoder, heads, grid=(4, 5))
    pipe.set_progress_bar_config(disable=True)
    if compiled:  # dynamo's guards and graphs without inductor's compile time
        pipe.enable_compile(backend="eager", keep_if_slower=True)
    pipe(PROMPTS, output_type="latent")  # the first generation compiles what it needs
    return pipe


@pytest.mark.parametrize("decoder,heads", [(AutoregressiveDecoder(), None), (JacobiDecoder(window_size=3), None),
                                           (MedusaDecoder(num_draft_tokens=4), "random")], ids=["ar", "sjd", "medusa"])
def test_eager_rounds_are_counted(decoder, heads):
    pipe = _pipe(decoder, heads)
    tolist = torch.Tensor.tolist
    with count_rounds(pipe) as counts:
        out = pipe(PROMPTS, output_type="latent")
    assert counts.rounds == out.stats.num_forward_passes - 1  # every pass but the prefill
    assert counts.eager_ops_per_round > 20 and counts.compiled_ops == 0 and counts.compiled_calls == 0
    assert counts.recompiles == 0
    assert sum(counts.eager_op_names.values()) == counts.eager_ops
    assert "_round" not in pipe.__dict__ and torch.Tensor.tolist is tolist  # nothing left patched


def test_a_read_added_to_every_round_is_counted_and_reads_outside_rounds_are_not(monkeypatch):
    """AR's rounds read the device at their syncs only; a ``.item()`` and a ``.tolist()`` added to every round are
    counted once per round each, and reads outside rounds are not."""
    from spatial_pipelines.pipelines import device_chain

    pipe = _pipe(AutoregressiveDecoder())
    with count_rounds(pipe) as counts:
        pipe(PROMPTS, output_type="latent")
    syncs = counts.host_reads
    assert 0 < syncs < counts.rounds
    chain_round = device_chain.chain_round

    def reading(loop):
        loop.state.tokens[0, 0].item()
        loop.state.tokens[:, :2].tolist()
        return chain_round(loop)

    monkeypatch.setattr(device_chain, "chain_round", reading)  # `ChainLoop.default_round` looks it up when called
    with count_rounds(pipe) as counts:
        torch.zeros(3).tolist()  # outside any round
        torch.ones(()).item()
        pipe(PROMPTS, output_type="latent")
    assert counts.host_reads == syncs + 2 * counts.rounds


def test_compiled_rounds_count_the_graph_and_what_runs_around_it():
    """With the step compiled, a second generation compiles nothing, enters one compiled region per round, and
    dispatches fewer eager ops per round than eager rounds do; a new batch size is a new graph, and is counted."""
    # the same prompts and seeds on both sides: ops per round depend on how many rounds the image takes
    def seeds():
        return [torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)]

    eager = _pipe(JacobiDecoder(window_size=3))
    with count_rounds(eager) as eager_counts:
        eager(["blue sky", "y"], output_type="latent", generator=seeds())
    pipe = _pipe(JacobiDecoder(window_size=3), compiled=True)
    with count_rounds(pipe) as counts:
        pipe(["blue sky", "y"], output_type="latent", generator=seeds())
    assert counts.recompiles == 0
    assert counts.compiled_calls == counts.rounds and counts.compiled_ops > 0
    assert 0 < counts.eager_ops_per_round < eager_counts.eager_ops_per_round
    with count_rounds(pipe) as counts:
        pipe(["blue sky", "y", "z"], output_type="latent")
    assert counts.recompiles >= 1
