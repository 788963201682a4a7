"""`enable_compile(freeze_weights=...)`: inductor's ``freezing`` on the compiled rounds (weights packed for the CPU's
GEMM): when it applies, that it keeps exact decoders exact, and that a weight changed in place is never left behind."""

import pytest
import torch

from spatial_pipelines import AutoregressiveDecoder, JacobiDecoder
from spatial_pipelines.pipelines.generation import FREEZE_MIN_ROWS
from spatial_pipelines.testing import dummy_pipeline


@pytest.mark.parametrize("value", ["yes", 1, 0.5, float("nan")])
def test_freeze_weights_must_be_a_bool_or_none(value):
    pipe = dummy_pipeline("llamagen", AutoregressiveDecoder(), None, grid=(3, 4))
    with pytest.raises(ValueError, match="`freeze_weights` must be True, False or None"):
        pipe.enable_compile(freeze_weights=value, measure=False)
    assert not pipe.is_compiled


def test_freeze_weights_true_needs_inductor():
    pipe = dummy_pipeline("llamagen", AutoregressiveDecoder(), None, grid=(3, 4))
    with pytest.raises(ValueError, match="freeze_weights=True.*backend 'eager'"):
        pipe.enable_compile(backend="eager", freeze_weights=True, measure=False)
    assert not pipe.is_compiled


# (setting, rows, slots fed per row, dtype, frozen)
FREEZE_CASES = [
    (None, 1, 1, torch.float32, False),  # AR, one image: MKL's few-row kernel is as fast
    (None, 2, 1, torch.float32, False),  # AR with CFG
    (None, 1, FREEZE_MIN_ROWS, torch.float32, True),  # a draft of 3 and the code it follows
    (None, 2, 9, torch.float32, True),  # SJD with CFG
    (None, 4, 1, torch.float32, True),  # AR, 4 images
    (None, 2, 9, torch.bfloat16, False),  # packing measured for float32 only
    (True, 1, 1, torch.float32, True),
    (False, 2, 9, torch.float32, False),
]


@pytest.mark.parametrize("setting,rows,fed,dtype,frozen", FREEZE_CASES)
def test_which_rounds_freeze_their_weights(setting, rows, fed, dtype, frozen):
    pipe = dummy_pipeline("llamagen", AutoregressiveDecoder(), None, grid=(3, 4))
    pipe.enable_compile(measure=False, freeze_weights=setting)  # inductor compiles lazily: nothing is compiled here
    assert pipe.loop.freezes_weights(rows * fed, dtype) is frozen
    pipe.disable_compile()
    assert pipe.loop.freezes_weights(rows * fed, dtype) is False  # eager: nothing to freeze


def _packed_calls(pipe, prompts, **kwargs):
    """The tokens and the packed GEMM calls of a call: MKL's (what inductor's ``freezing`` emits) or oneDNN's (the
    packs `round_weights` routes where they are the timed kernel)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = pipe(prompts, **kwargs)
    return out.tokens, sum(e.count for e in prof.key_averages() if e.key in ("mkl::_mkl_linear", "mkldnn::_linear_pointwise"))


@pytest.mark.slow
@pytest.mark.skipif(not torch._C.has_mkl, reason="inductor packs float32 weights for MKL's GEMM only where torch has MKL")
def test_frozen_rounds_keep_exact_decoders_exact_and_see_a_changed_weight():
    """With ``freeze_weights=True`` (inductor) the rounds run on packed weights (MKL's packed GEMM is called), greedy AR
    and SJD give the eager grid token for token, and after a weight is changed in place the next call compiles again
    and follows the new weight instead of the frozen copy."""
    pipe = dummy_pipeline("llamagen", AutoregressiveDecoder(), None, grid=(3, 4))
    pipe.set_progress_bar_config(disable=True)
    prompts, kwargs = ["a fox", "x"], dict(guidance_scale=2.0, temperature=0, output_type="latent")
    ref = pipe(prompts, **kwargs).tokens
    pipe.enable_compile(measure=False, freeze_weights=True)
    tokens, packed = _packed_calls(pipe, prompts, **kwargs)
    assert tokens.equal(ref) and packed > 0
    pipe.decoder = JacobiDecoder(window_size=3)
    assert pipe(prompts, **kwargs).tokens.equal(ref)
    with torch.no_grad():  # in place, as `load_state_dict` or a merged adapter would
        head = pipe.transformer.output.weight
        head.copy_(torch.roll(head, 1, dims=0))
    changed = pipe(prompts, **kwargs).tokens
    pipe.disable_compile()
    eager = pipe(prompts, **kwargs).tokens
    assert not eager.equal(ref)  # the change matters, so a frozen copy would show
    assert changed.equal(eager)


def test_the_compiled_round_is_made_again_only_when_a_weight_changes_in_place():
    """Where rounds may be frozen, a weight changed in place makes a new compiled round (its graphs would hold the old
    values); heads swapped in do not (dynamo's guards tell their graphs apart), nor anything when nothing is frozen."""
    from spatial_pipelines.pipelines.device_chain import ChainLoop

    pipe = dummy_pipeline("llamagen", AutoregressiveDecoder(), None, grid=(3, 4))
    pipe.enable_compile(measure=False)  # inductor compiles lazily: nothing is compiled here
    loop, round_fn = pipe.loop, ChainLoop.default_round()
    first = loop._compiled_device_round(round_fn)
    assert loop._compiled_device_round(round_fn) is first
    loop.draft_heads = torch.nn.Linear(2, 2)  # other heads
    assert loop._compiled_device_round(round_fn) is first
    with torch.no_grad():
        loop.draft_heads.weight.add_(1.0)  # the heads changed in place
    second = loop._compiled_device_round(round_fn)
    assert second is not first and loop._compiled_device_round(round_fn) is second
    with torch.no_grad():
        pipe.transformer.output.weight.mul_(2.0)  # the target changed in place
    assert loop._compiled_device_round(round_fn) is not second
    third = loop._compiled_device_round(round_fn)
    pipe.to(dtype=torch.bfloat16).to(dtype=torch.float32)  # rounded there and back: new storage, the same counters
    assert loop._compiled_device_round(round_fn) is not third
    pipe.enable_compile(measure=False, freeze_weights=False)
    third = loop._compiled_device_round(round_fn)
    with torch.no_grad():
        pipe.transformer.output.weight.mul_(2.0)
    assert loop._compiled_device_round(round_fn) is third  # nothing frozen: the graphs read the weights as they are


@pytest.mark.parametrize("family", ["janus", "emu3"])
def test_a_change_to_a_head_outside_the_trunk_makes_the_round_again(family):
    """Janus-Pro's image head and code aligner and Emu3's ``lm_head`` (read as a slice of its weight) run in the round
    outside the text model: frozen graphs would hold their old values too, so a change in place makes a new round."""
    from spatial_pipelines.pipelines.device_chain import ChainLoop

    pipe = dummy_pipeline(family, AutoregressiveDecoder(), None)
    pipe.enable_compile(measure=False)
    loop, round_fn, model = pipe.loop, ChainLoop.default_round(), pipe.transformer
    first = loop._compiled_device_round(round_fn)
    heads = (model.model.generation_head, model.model.generation_aligner) if family == "janus" else (model.lm_head,)
    for module in heads:
        with torch.no_grad():
            next(module.parameters()).mul_(2.0)
        again = loop._compiled_device_round(round_fn)
        assert again is not first and loop._compiled_device_round(round_fn) is again
        first = again
