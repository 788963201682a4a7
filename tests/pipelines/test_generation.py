"""The generation loop as one object (`GenerationLoop`): the pipeline builds it once beside its backbone adapter and
hands it the decoder, heads and diffusers' hooks per call; its settings (fixed shapes, device rounds, the sync
cadence ``max_rounds_per_sync``) are the pipeline's."""

import contextlib
import math

import pytest
import torch

from spatial_pipelines.core.sampling import SamplingConfig
from spatial_pipelines.decoders import AutoregressiveDecoder, JacobiDecoder, MedusaDecoder
from spatial_pipelines.pipelines.device_loop import MAX_ROUNDS_PER_SYNC
from spatial_pipelines.pipelines.generation import GenerationLoop, LoopHooks
from spatial_pipelines.testing import dummy_pipeline


def _gens(n):
    return [torch.Generator().manual_seed(i) for i in range(n)]


def test_the_loop_is_built_once_and_keeps_no_call_state():
    pipe = dummy_pipeline("llamagen", JacobiDecoder(window_size=3))
    loop = pipe.loop
    assert isinstance(loop, GenerationLoop) and loop.backbone is pipe.backbone
    pipe("a fox", output_type="latent")
    pipe.decoder = AutoregressiveDecoder()  # a swapped decoder is handed to the same loop
    pipe("a fox", output_type="latent")
    assert pipe.loop is loop
    assert loop.decoder is None and loop.draft_heads is None and loop.hooks.on_round is None  # nothing kept from a call


@pytest.mark.parametrize("name,bad", [("max_rounds_per_sync", 0), ("max_rounds_per_sync", 2.5),
                                      ("max_rounds_per_sync", float("nan")), ("max_rounds_per_sync", "8"),
                                      ("static_shapes", 0)])
def test_loop_settings_are_checked(name, bad):
    pipe = dummy_pipeline("llamagen")
    with pytest.raises(ValueError, match=name):
        setattr(pipe, name, bad)


def test_loop_settings_live_on_the_loop():
    pipe = dummy_pipeline("llamagen")
    assert pipe.max_rounds_per_sync == MAX_ROUNDS_PER_SYNC and not pipe.static_shapes
    pipe.max_rounds_per_sync, pipe.static_shapes = 3, True
    assert (pipe.loop.max_rounds_per_sync, pipe.loop.static_shapes) == (3, True)


def _syncs(pipe):
    """Record the syncs (host reads) of each call's device rounds: ``[(rounds, syncs)]``."""
    seen, run_device = [], pipe.loop._run_device

    def recorded(loop, on_sync):
        calls = []
        rounds = run_device(loop, lambda total: (calls.append(total), on_sync(total)))
        seen.append((rounds, len(calls)))
        return rounds

    pipe.loop._run_device = recorded
    return seen


@pytest.mark.parametrize("decoder", [JacobiDecoder(window_size=3), MedusaDecoder()], ids=["sjd", "medusa"])
def test_max_rounds_per_sync_sets_the_cadence_not_the_codes(decoder):
    """``K = 1`` reads the device after every round; a larger ``K`` reads less often; the codes and passes are the
    same at every ``K`` (the rounds after a read are the same rounds)."""
    pipe = dummy_pipeline("llamagen", decoder, "random" if decoder.heads_needed() else None, grid=(8, 8))
    seen = _syncs(pipe)
    outs = {}
    for k in (1, 4, 32):
        pipe.max_rounds_per_sync = k
        outs[k] = pipe(["a fox", "a cat"], guidance_scale=2.0, generator=_gens(2), output_type="latent")
    (rounds_1, syncs_1), (rounds_4, syncs_4), (rounds_32, syncs_32) = seen
    assert rounds_1 == rounds_4 == rounds_32
    assert syncs_1 == rounds_1 + 1  # a read before every round and one that finds every row done
    assert syncs_32 <= syncs_4 <= math.ceil(rounds_4 / 4) + 8 < syncs_1
    for k in (4, 32):
        assert torch.equal(outs[k].tokens, outs[1].tokens)
        assert outs[k].stats.num_forward_passes == outs[1].stats.num_forward_passes


def test_hooks_get_the_progress_and_every_round():
    """`LoopHooks`: the progress bar counts every code; a per-round hook sees each round (the row-group loop)."""
    pipe = dummy_pipeline("llamagen", JacobiDecoder(window_size=3))
    backbone = pipe.backbone
    prefix = backbone.encode_prompt(["a fox"], None, False, pipe.device)
    updates, steps, known = [], [], []

    class Bar:
        n = 0

        def update(self, k):
            self.n += k
            updates.append(k)

    @contextlib.contextmanager
    def bar(total):
        yield Bar()

    hooks = LoopHooks(progress_bar=bar, on_round=lambda i, batch: steps.append(i), rounds_known=known.append)
    tokens, stats = pipe.loop.generate(pipe.decoder, None, prefix, SamplingConfig(1.0, 1.0, None), _gens(1), 1, hooks)
    assert sum(updates) == backbone.layout.num_tokens and (tokens >= 0).all()
    assert steps == list(range(stats.num_forward_passes - 1)) and known[-1] == len(steps)


@pytest.mark.parametrize("compiled_ms,kept", [(10.4, True), (9.0, True), (10.6, False)], ids=["4%-slower", "faster", "6%-slower"])
def test_enable_compile_keeps_the_step_unless_its_passes_are_clearly_slower(compiled_ms, kept, monkeypatch):
    """`enable_compile` with its defaults times the eager and compiled passes (1 and 8 fed tokens) and keeps the compiled
    step unless they take more than `COMPILE_TOLERANCE` longer: the compiled round also drops the eager ops around its
    pass, which that timing does not see."""
    from spatial_pipelines.pipelines import generation

    class Timed:
        def __init__(self, backbone, rows, compiled=False, **kwargs):
            self.ms = compiled_ms if compiled else 10.0

        def measure(self, sizes):
            return {t: self.ms / 1e3 for t in sizes}

    monkeypatch.setattr(generation, "PassCost", Timed)
    assert generation.COMPILE_TOLERANCE == 0.05
    pipe = dummy_pipeline("llamagen", AutoregressiveDecoder())
    info = pipe.enable_compile(backend="eager")
    assert info["enabled"] is kept and pipe.is_compiled is kept and info["kept_by_default"] is kept
    assert info["compiled_ms"] == {1: pytest.approx(compiled_ms), 8: pytest.approx(compiled_ms)}
    forced = pipe.enable_compile(backend="eager", keep_if_slower=True)  # what the benchmark asks: kept, and it says
    assert forced["enabled"] and forced["kept_by_default"] is kept  # whether the defaults would have kept it
