"""``pipe.pack_weights``: eager rounds on a CPU on linear weights packed for MKL's GEMM (`PackedWeights`): when it
applies, that codes stay the eager ones token for token, that a weight changed in place is packed again, and that the
layers get their own forward back after every call."""

import pytest
import torch

from spatial_pipelines import AutoregressiveDecoder, JacobiDecoder
from spatial_pipelines.pipelines import packed_weights
from spatial_pipelines.pipelines.generation import FREEZE_MIN_ROWS
from spatial_pipelines.pipelines.packed_weights import PackedWeights, packable_linears
from spatial_pipelines.testing import dummy_pipeline

needs_mkl = pytest.mark.skipif(not packed_weights.mkl_packing_available(),
                               reason="MKL's packed GEMM exists only in torch builds with MKL (x86 wheels)")


PACKED_OPS = ("mkl::_mkl_linear", "mkldnn::_linear_pointwise")
_timed_choose = PackedWeights.choose  # the real timing, before the fixture below replaces it


@pytest.fixture(autouse=True)
def default_kernel(monkeypatch):
    """Every test here but the timed ones: the kernel timing returns the default rule (MKL's packs from
    `FREEZE_MIN_ROWS` rows), so what is packed does not depend on which GEMM library is faster on this machine."""
    monkeypatch.setattr(PackedWeights, "choose", lambda self, linears, rows, default: self.kernel or default)


def _pipe(decoder=None):
    pipe = dummy_pipeline("llamagen", decoder or AutoregressiveDecoder(), None, grid=(3, 4))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _packed_calls(pipe, prompts, **kwargs):
    """The call's tokens and how many times a packed GEMM (MKL's or oneDNN's) ran in it."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = pipe(prompts, **kwargs)
    return out.tokens, sum(e.count for e in prof.key_averages() if e.key in PACKED_OPS)


@pytest.mark.parametrize("value", ["yes", 1, 0.0, float("nan")])
def test_pack_weights_must_be_a_bool_or_none(value):
    pipe = _pipe()
    with pytest.raises(ValueError, match="`pack_weights` must be True, False or None"):
        pipe.pack_weights = value
    assert pipe.pack_weights is None


def test_pack_weights_true_without_float32_layers_on_a_cpu_is_refused_before_any_work():
    pipe = _pipe()
    pipe.transformer.to(torch.bfloat16)
    pipe.pack_weights = True
    calls = []
    pipe.transformer.register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises(ValueError, match="pack_weights=True.*float32 linear layers on a CPU.*bfloat16"):
        pipe("a fox", output_type="latent")
    assert calls == []  # not even the prompt pass


# (setting, rows fed per pass, dtype, layers packed: "all" or 0)
PACK_CASES = [
    (None, 1, torch.float32, 0),  # AR, one image: MKL's few-row kernel is as fast
    (None, FREEZE_MIN_ROWS - 1, torch.float32, 0),
    (None, FREEZE_MIN_ROWS, torch.float32, "all"),
    (None, 18, torch.float32, "all"),  # SJD (window 8) with CFG
    (None, 18, torch.bfloat16, 0),  # packing is for float32
    (True, 1, torch.float32, "all"),
    (False, 18, torch.float32, 0),
]


@needs_mkl
@pytest.mark.parametrize("setting,rows,dtype,packed", PACK_CASES)
def test_which_eager_passes_run_on_packed_weights(setting, rows, dtype, packed):
    pipe = _pipe()
    pipe.transformer.to(dtype)
    pipe.pack_weights = setting
    layers = packable_linears(pipe.transformer)
    with pipe.loop.packed_weights(rows) as routed:
        patched = sum("forward" in m.__dict__ for m in pipe.transformer.modules())
    assert (routed or 0) == patched == (len(layers) if packed == "all" else 0)
    assert dtype != torch.float32 or len(layers) > 0  # the float32 rows test something
    assert not any("forward" in m.__dict__ for m in pipe.transformer.modules())  # every layer's own forward back


@needs_mkl
def test_no_packing_where_the_copy_would_not_fit(monkeypatch):
    pipe = _pipe()
    monkeypatch.setattr(packed_weights, "available_memory", lambda device: 1 << 20)
    with pipe.loop.packed_weights(18) as routed:
        assert routed is None
    pipe.pack_weights = True  # asked for: packed all the same
    layers = len(packable_linears(pipe.transformer))
    with pipe.loop.packed_weights(18) as routed:
        assert routed == layers > 0


@needs_mkl
def test_no_packing_on_a_compiled_target_but_onednn_packs_in_frozen_rounds():
    pipe = _pipe()
    pipe.enable_compile(backend="eager", measure=False)
    with pipe.loop.packed_weights(18) as routed:
        assert routed is None  # its rounds freeze their own weights (`freeze_weights`)
    pipe.loop.packs.kernel = "onednn"
    with pipe.loop.packed_weights(18) as routed:
        assert routed is None  # not frozen (backend "eager"): no graph could hold the packs as constants
    pipe.enable_compile(measure=False)
    linears = len(packable_linears(*pipe.loop.backbone.round_modules))  # counted before their forwards are routed
    with pipe.loop.packed_weights(18) as routed:
        assert routed == linears > 0


needs_onednn = pytest.mark.skipif("onednn" not in packed_weights.available_kernels(),
                                  reason="oneDNN's packed GEMM needs a torch build with oneDNN")


@needs_onednn
@pytest.mark.slow
def test_compiled_rounds_on_onednn_packs_give_the_eager_codes_without_recompiling():
    """Where oneDNN's packs are the kernel, inductor's rounds hold them as frozen constants (inductor packs float32
    for MKL only): greedy AR and SJD on one pipeline (2 and 8 rows a pass, one pack for both) give the eager grid token
    for token, later calls of either compile nothing and run the packed GEMMs inside the graph, and a weight changed
    in place is followed."""
    from spatial_pipelines.pipelines.round_counts import count_rounds

    ar, sjd = AutoregressiveDecoder(), JacobiDecoder(window_size=3)
    pipe = _pipe(ar)
    prompts, kwargs = ["a fox", "x"], dict(guidance_scale=2.0, temperature=0, output_type="latent")
    ref = pipe(prompts, **kwargs).tokens
    pipe.loop.packs.kernel = "onednn"
    pipe.enable_compile(measure=False)
    for decoder in (ar, sjd):
        pipe.decoder = decoder
        tokens, calls = _packed_calls(pipe, prompts, **kwargs)
        assert tokens.equal(ref) and calls > 0
    packs = dict(pipe.loop.packs._packs)
    for decoder in (ar, sjd, ar):  # the row count changes between calls: the same packs, the same graphs
        pipe.decoder = decoder
        with torch._dynamo.config.patch(error_on_recompile=True), count_rounds(pipe) as counts:
            assert pipe(["a quiet sea", "x"], **kwargs).tokens.shape == ref.shape
        assert counts.recompiles == 0 and counts.compiled_calls == counts.rounds > 0
        assert counts.eager_ops_per_round <= 10, counts.as_dict()
    assert {k: v[2] for k, v in pipe.loop.packs._packs.items()} == {k: v[2] for k, v in packs.items()}
    with torch.no_grad():  # in place, as `load_state_dict` or a merged adapter would
        head = pipe.transformer.output.weight
        head.copy_(torch.roll(head, 1, dims=0))
    changed = pipe(prompts, **kwargs).tokens
    pipe.disable_compile()
    eager = pipe(prompts, **kwargs).tokens
    assert not eager.equal(ref) and changed.equal(eager)
    assert not any("forward" in m.__dict__ for m in pipe.transformer.modules())


@needs_onednn
def test_timing_kernels_at_a_new_row_count_keeps_the_packs_in_use(monkeypatch):
    """`choose` times every kernel on packs of its own: the oneDNN packs in use (held as constants by frozen compiled
    rounds, whose graphs guard on them) stay the same tensors, so switching decoders recompiles nothing."""
    monkeypatch.setattr(PackedWeights, "choose", _timed_choose)
    packs, layers = PackedWeights(), [torch.nn.Linear(16, 32) for _ in range(3)]
    held = [packs.pack(m.weight, 2, "onednn") for m in layers]
    packs.choose(layers, 18, default="mkl" if "mkl" in packed_weights.available_kernels() else "onednn")
    assert all(packs.pack(m.weight, 18, "onednn") is h for m, h in zip(layers, held))


@needs_mkl
def test_packs_are_made_once_per_weight_version_and_row_count():
    packs, weight = PackedWeights(), torch.nn.Parameter(torch.randn(8, 6))
    first = packs.pack(weight, 5)
    assert packs.pack(weight, 5) is first
    with torch.no_grad():
        weight.mul_(2.0)  # in place: a new version
    second = packs.pack(weight, 5)
    assert second is not first and packs.pack(weight, 5) is second
    version = weight._version
    weight.data = weight.data.to(torch.bfloat16).float()  # a cast there and back: new storage, the same counter
    assert weight._version == version and packs.pack(weight, 5) is not second
    second = packs.pack(weight, 5)
    packs.pack(weight, 6)
    assert packs.rows == 6 and len(packs._packs) == 1  # another row count drops the old packs
    x = torch.randn(6, 6)
    assert torch.allclose(torch.ops.mkl._mkl_linear(x, packs.pack(weight, 6), weight, None, 6), x @ weight.T, atol=1e-5)
    if "onednn" in packed_weights.available_kernels():  # oneDNN's pack serves every row count: kept across them
        onednn = packs.pack(weight, 5, "onednn")
        assert packs.pack(weight, 6, "onednn") is onednn and packs.rows is None and len(packs._packs) == 1
        assert torch.allclose(torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], ""), x @ weight.T, atol=1e-5)


@needs_mkl
@pytest.mark.parametrize("kernel", [None, "onednn"], ids=["mkl", "onednn"])
@pytest.mark.parametrize("decoder", [AutoregressiveDecoder(), JacobiDecoder(window_size=3)], ids=["ar", "sjd"])
def test_packed_rounds_give_the_unpacked_codes_and_follow_a_changed_weight(decoder, kernel):
    """Greedy AR and SJD (4 images, 8 rows with CFG) give the same grid packed and unpacked, on MKL's packs (the
    default) and oneDNN's, the packed GEMM runs only when packing, and a weight changed in place between calls is
    packed again."""
    pipe = _pipe(decoder)
    pipe.loop.packs.kernel = kernel
    prompts, kwargs = ["a fox", "x"], dict(guidance_scale=2.0, temperature=0, output_type="latent", num_images_per_prompt=2)
    pipe.pack_weights = False
    ref, calls = _packed_calls(pipe, prompts, **kwargs)
    assert calls == 0
    pipe.pack_weights = None  # 4 images x 2 CFG rows: 8 rows or more per pass
    tokens, calls = _packed_calls(pipe, prompts, **kwargs)
    assert tokens.equal(ref) and calls > 0
    assert pipe(prompts, **kwargs).tokens.equal(ref)  # the packs kept from the call before
    with torch.no_grad():  # in place, as `load_state_dict` or a merged adapter would
        head = pipe.transformer.output.weight
        head.copy_(torch.roll(head, 1, dims=0))
    changed = pipe(prompts, **kwargs).tokens
    pipe.pack_weights = False
    eager = pipe(prompts, **kwargs).tokens
    assert not eager.equal(ref)  # the change matters, so a stale pack would show
    assert changed.equal(eager)
    assert not any("forward" in m.__dict__ for m in pipe.transformer.modules())


@needs_mkl
def test_janus_packs_its_image_head_and_aligner_beside_the_trunk():
    """Janus-Pro embeds codes through `generation_aligner` and scores them with `generation_head`, outside its text
    model: an eager round packs their layers too, and greedy SJD gives the unpacked grid."""
    pipe = dummy_pipeline("janus", JacobiDecoder(window_size=3), None)
    pipe.set_progress_bar_config(disable=True)
    model = pipe.transformer.model
    outside = packable_linears(model.generation_aligner, model.generation_head)
    assert outside and set(map(id, outside)) <= set(map(id, packable_linears(*pipe.backbone.round_modules)))
    with pipe.loop.packed_weights(18):
        assert all("forward" in m.__dict__ for m in outside)
    kwargs = dict(guidance_scale=2.0, temperature=0, output_type="latent", num_images_per_prompt=2)
    pipe.pack_weights = False
    ref = pipe(["a fox"], **kwargs).tokens
    pipe.pack_weights = True
    assert pipe(["a fox"], **kwargs).tokens.equal(ref)


@needs_mkl
def test_the_layers_get_their_forward_back_when_a_call_fails():
    pipe = _pipe(JacobiDecoder(window_size=3))
    pipe.pack_weights = True

    def fail(*args):
        if any("forward" in m.__dict__ for m in pipe.transformer.modules()):
            raise RuntimeError("inside the rounds")

    pipe.transformer.register_forward_pre_hook(fail)
    with pytest.raises(RuntimeError, match="inside the rounds"):
        pipe("a fox", output_type="latent")
    assert not any("forward" in m.__dict__ for m in pipe.transformer.modules())


def test_a_copied_pipeline_keeps_pack_weights():
    pipe = _pipe()
    pipe.pack_weights = False
    pipe.loop.backbone = None  # what a copied pipeline's new backbone does: the loop is built again
    assert pipe.pack_weights is False


# (sweep seconds per kernel, the default, the kernel chosen): another kernel must beat the default by KERNEL_MARGIN
CHOICE_CASES = [
    ({None: 1.0, "mkl": 0.9, "onednn": 0.4}, None, "onednn"),  # an EPYC's few-row passes: oneDNN 2.5x the stored GEMM
    ({None: 1.0, "mkl": 0.9, "onednn": 0.85}, None, None),  # within the margin: the weights as stored stay
    ({"mkl": 1.0, "onednn": 0.3}, "mkl", "onednn"),
    ({"mkl": 0.5, "onednn": 0.45}, "mkl", "mkl"),  # a Xeon's: MKL's packs stay
]


@pytest.mark.parametrize("seconds,default,chosen", CHOICE_CASES)
def test_a_timed_kernel_must_beat_the_default_by_the_margin(monkeypatch, seconds, default, chosen):
    monkeypatch.setattr(PackedWeights, "choose", _timed_choose)
    monkeypatch.setattr(packed_weights, "available_kernels", lambda: ["mkl", "onednn"])
    timed = []
    monkeypatch.setattr(PackedWeights, "sweep_seconds",
                        lambda self, linears, rows, kernel: timed.append(kernel) or seconds[kernel])
    packs, layers = PackedWeights(), [torch.nn.Linear(6, 8)]
    assert packs.choose(layers, 5, default) == chosen
    assert packs.choose(layers, 5, default) == chosen and sorted(map(str, timed)) == sorted(map(str, seconds))  # once
    assert PackedWeights(kernel="mkl").choose(layers, 5, None) == "mkl"  # a forced kernel is not timed
    with pytest.raises(ValueError, match="`kernel` must be one of"):
        PackedWeights(kernel="blas")


@pytest.mark.parametrize("rows", [1, 3, 9])
def test_every_kernel_computes_the_linear_layer_and_the_timing_picks_one(monkeypatch, rows):
    monkeypatch.setattr(PackedWeights, "choose", _timed_choose)
    layer = torch.nn.Linear(24, 40)
    x = torch.randn(2, rows, 24)
    packs = PackedWeights()
    for kernel in packed_weights.available_kernels():
        with torch.no_grad(), packs.applied([layer], 2 * rows, kernel):
            assert torch.allclose(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias), atol=1e-5)
    assert packs.choose([layer], 2 * rows, None) in [None] + packed_weights.available_kernels()
