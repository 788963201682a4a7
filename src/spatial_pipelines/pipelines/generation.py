"""The engine (`GenerationLoop`): from the encoded prompts to the token grids, for every family and decoder: the KV
cache, the prompt pass, the rounds (whole on the device, `device_loop`), fixed shapes (`static_shapes`), the compiled
round and how often the host reads the device. The pipeline (`SpatialARPipeline`) checks the inputs, encodes the
prompts, VQ-decodes the grids and runs diffusers' progress bar and callbacks (`LoopHooks`). One call::

    3. the decoder's plan and its loop, one noise seed per image, the KV cache
    4. the prompt pass: its keyed sample is each row's first code
    5. rounds until every grid is full, each on device tensors only:
       a. draft  b. one target forward (end-of-row slots, the tree mask, CFG rows)  c. CFG mix, temperature
       d. verify on keyed noise and commit each row's run  e. keep each row's accepted slots in the cache"""

import contextlib
import itertools
import weakref
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Dict, Iterator, Optional, Tuple

import torch

from ..core.kv_cache import StaticKVCache
from ..core.rounds import ChainRound, TreeRound
from ..core.sampling import SamplingConfig, draw_seeds
from ..decoders.decoding_ssd import SSDSchedule
from ..decoders.decoding_utils import SpatialDecoderMixin
from ..utils import RoundTimer, check_number, tensor_stamp
from .backbone import PromptEmbeddings, SpatialBackbone
from .compiled import mark_static_cache, uses_cuda_graphs
from .device_chain import ChainLoop
from .device_loop import MAX_ROUNDS_PER_SYNC, CompiledRound, DeviceLoop, RoundView, compile_round
from .device_proactive import ProactiveLoop
from .device_ssd import SSDLoop
from .device_tree import DynamicTreeLoop, HeadTreeLoop
from .packed_weights import PackedWeights, available_kernels, fits_in_memory, mkl_packing_available, packable_linears
from .pass_cost import PassCost
from .pipeline_output import DecodingStats
from .static_shapes import RECOMPILE_LIMIT, static_cache_length

#: `GenerationLoop.compile` keeps the compiled step unless its passes (1 and 8 fed tokens) take this much longer than
#: the eager ones: a compiled round also drops the eager ops between passes (1.07-1.31x faster per image on a CPU)
COMPILE_TOLERANCE = 0.05

#: ``freeze_weights=None``: a compiled float32 round on a CPU folds the weights into its graph (inductor's ``freezing``,
#: which packs them for MKL's GEMM) when its pass feeds at least this many rows (rows x slots). Why: on unpacked
#: weights MKL's GEMM leaves its few-row kernel at 4 rows and costs 2-3x as much as packed from there (a 2-core Xeon,
#: `scripts/cpu_gemm.py`); at 1-3 rows packing gains nothing (it costs more at 2-3).
FREEZE_MIN_ROWS = 4


class _NoProgressBar:
    n = 0

    def update(self, k: int) -> None:
        self.n += k


@dataclass
class LoopHooks:
    """What the pipeline runs inside a generation: diffusers' progress bar and callback contract.

    Args:
        progress_bar (`Callable`): ``progress_bar(total=...)``, a context manager yielding a bar with ``update(k)`` and
            ``n`` (`DiffusionPipeline.progress_bar`); it counts codes over the batch.
        on_round (`Callable`, *optional*): ``on_round(step_index, view)`` after every round (``callback_on_step_end``;
            ``view``: `device_loop.RoundView`); the host reads the device after every round while it is set.
        interrupted (`Callable`): ``interrupted()`` is checked after every sync (``pipe.interrupt``).
        rounds_known (`Callable`): ``rounds_known(n)``: the rounds run, plus one while a grid is not full
            (``pipe.num_timesteps``).
    """

    progress_bar: Callable[..., ContextManager] = lambda total=0: contextlib.nullcontext(_NoProgressBar())
    on_round: Optional[Callable[[int, Any], None]] = None
    interrupted: Callable[[], bool] = lambda: False
    rounds_known: Callable[[int], None] = lambda n: None


class GenerationLoop:
    r"""Prefill, rounds, KV cache, fixed shapes, compile and sync cadence of a pipeline's generations: built once per
    pipeline over its backbone adapter (`SpatialARPipeline.loop`); the decoder and heads come with each call.

    Args:
        backbone (`SpatialBackbone`): the family adapter.
    """

    def __init__(self, backbone: SpatialBackbone):
        self.backbone = backbone
        self.static_shapes_setting: Optional[bool] = None  # None: on when compiled
        self.pack_weights_setting: Optional[bool] = None  # None: eager CPU float32 passes of FREEZE_MIN_ROWS rows or more
        self.packs = PackedWeights()  # the eager rounds' packed weights (`packed_weights`)
        self.max_rounds_per_sync: int = MAX_ROUNDS_PER_SYNC
        self.timer: Optional[RoundTimer] = None  # a RoundTimer while `profile_rounds` is active
        # what one call runs with (`generate` sets them)
        self.decoder: Optional[SpatialDecoderMixin] = None
        self.draft_heads = None
        self.hooks = LoopHooks()

    def settings(self) -> Dict[str, Any]:
        """The user's settings, carried over when a copied pipeline builds its own loop."""
        return {"static_shapes_setting": self.static_shapes_setting, "max_rounds_per_sync": self.max_rounds_per_sync,
                "pack_weights_setting": self.pack_weights_setting}

    @property
    def static_shapes(self) -> bool:
        return self.is_compiled if self.static_shapes_setting is None else self.static_shapes_setting

    # -- one generation -----------------------------------------------------------------------------------
    def generate(self, decoder: SpatialDecoderMixin, draft_heads, prefix: PromptEmbeddings, sampling: SamplingConfig,
                 generator, batch_size: int, hooks: Optional[LoopHooks] = None) -> Tuple[torch.Tensor, DecodingStats]:
        """Steps 3-5 for ``batch_size`` images of the prompt rows ``prefix`` ``(R, P, D)`` by the loop of the decoder's
        plan (`device_plan`), the host reading the device once per sync. Returns the grids ``(B, N)`` in raster order
        and the `DecodingStats` (read from the device after the last round)."""
        self.decoder, self.draft_heads, self.hooks = decoder, draft_heads, hooks or LoopHooks()
        try:
            self.check_pack_weights()
            plan = self.device_plan(sampling, batch_size, prefix.embeds.device)
            # 3. one noise seed per image, the KV cache, the round (compiled whole when the step is); 4. the prompt pass
            seeds = torch.zeros(batch_size, dtype=torch.long) if sampling.greedy else draw_seeds(generator, batch_size)
            loop = self.start_device_loop(prefix, sampling, seeds, plan)
            # 5. rounds, the host reading the device once per sync (after every round while a step callback is set)
            with self.hooks.progress_bar(total=self.backbone.layout.num_tokens * batch_size) as progress_bar:
                rounds = self._run_device(loop, lambda done: progress_bar.update(done - progress_bar.n))
            if self.timer is not None:
                self.timer.rounds += rounds
            self.hooks.rounds_known(rounds)
            return loop.grid_tokens(), self._device_stats(loop, rounds, batch_size)
        finally:
            self.decoder, self.draft_heads, self.hooks = None, None, LoopHooks()

    def device_plan(self, sampling: SamplingConfig, batch_size: int, device: torch.device) -> Tuple[type, Dict[str, Any]]:
        """The loop that runs the decoder's rounds on the device and its arguments, from the decoder's plan
        (`SpatialDecoderMixin.plan`): a chain (`ChainRound`: `ChainLoop`; with proactive candidates `ProactiveLoop`), a
        tree of point-mass candidates (`TreeRound`: `HeadTreeLoop`, or `DynamicTreeLoop` for trees grown per row), or
        SSD's schedule (`SSDLoop`), under the decoder's acceptance rule. Under drawn noise a chain keeps its drafts'
        proposals and accepts by speculative sampling on keyed streams of the rows' seeds."""
        decoder, layout = self.decoder, self.backbone.layout
        drawn = not (sampling.keyed or sampling.greedy)  # speculative sampling on keyed streams of the rows' seeds
        tree = getattr(decoder, "tree", None)  # a tree decoder sized to no drafts (0, or what "auto" chose): AR's round
        no_drafts = tree is not None and tree.num_nodes == 1
        plan = ChainRound(window=0) if no_drafts else decoder.plan(self.draft_heads, layout, batch_size, device, drawn)
        if isinstance(plan, SSDSchedule):  # passes known before the first (SSD): the rows run them in lockstep
            return SSDLoop, {"schedule": plan, "draft_heads": self.draft_heads}
        rule = decoder.acceptance_rule
        acceptance = {}
        if rule.relaxes:  # LANTERN, LANTERN++: the codebook neighbours their claims read
            acceptance = {"rule": rule, "neighbours": self.backbone.code_neighbours(rule.num_neighbours) if rule.num_neighbours else None}
        if isinstance(plan, ChainRound):
            chain = {"window": plan.window, "init": plan.init, "anchor": plan.anchor, "continuation": plan.continuation,
                     "guess": plan.guess, "proposals": drawn, **acceptance}
            if plan.width > 1:  # SJD-PAC's candidates: a static tree
                return ProactiveLoop, {**chain, "width": plan.width, "depth": plan.depth}
            return ChainLoop, chain
        if isinstance(plan, TreeRound):
            loop_class = DynamicTreeLoop if getattr(plan.drafter, "per_row_trees", False) else HeadTreeLoop
            return loop_class, {"drafter": plan.drafter, **acceptance}
        raise TypeError(f"{type(decoder).__name__}.plan returned {plan!r}: a decoder's round is a `ChainRound`, a "
                        "`TreeRound` (spatial_pipelines.core.rounds) or a schedule (docs/contributing.md, \"Adding a "
                        "decoder\").")

    # -- rounds on the device -------------------------------------------------------------------------------
    def start_device_loop(self, prefix: PromptEmbeddings, sampling: SamplingConfig, seeds: torch.Tensor,
                          plan: Tuple[type, Dict[str, Any]], cache: Optional[StaticKVCache] = None,
                          compiled: bool = True) -> DeviceLoop:
        """Steps 3-4 of a `device_plan`: the KV cache (``cache``: the caller's, reset here), the loop with its round
        (compiled whole when the step is and ``compiled``) and the prompt pass, one noise seed per image (``seeds``)."""
        loop_class, kwargs = plan
        backbone = self.backbone
        layout, rows = backbone.layout, prefix.embeds.shape[0]
        if cache is None:
            fed = loop_class.fed_slots(layout, **kwargs)
            cache = self.make_cache(rows, prefix.embeds.shape[1] + layout.sequence_length + fed, prefix.embeds.device)
        else:
            cache.reset()
        round_fn = self._compiled_device_round(loop_class.default_round()) if compiled else None
        loop = loop_class(backbone, sampling=sampling, seeds=seeds, prefix=prefix, cache=cache, round_fn=round_fn, **kwargs)
        loop.max_rounds_per_sync = self.max_rounds_per_sync
        if self.timer is not None:  # `profile_rounds`: the parts of an eager round, every round and read
            loop.host_timer, loop.timer = self.timer, (self.timer if round_fn is None else loop.timer)
        loop.prefill(prefix)
        return loop

    def _run_device(self, loop: DeviceLoop, on_sync: Callable[[int], None]) -> int:
        """Step 5 (`DeviceLoop.run`) with the call's hooks (a step callback sees every round: `RoundView`); returns the
        rounds run."""
        hooks = self.hooks
        on_round = None
        if hooks.on_round is not None:
            def on_round(index: int, slowest: int) -> None:
                view = RoundView(loop, slowest)
                hooks.rounds_known(index + 1 + (0 if view.finished else 1))
                hooks.on_round(index, view)
        rows = loop.cache.storage.shape[2] * loop.fed  # storage (2, L, R, S, ...): R rows, each feeding `loop.fed` slots
        with self.round_weights(rows, isinstance(loop.round_fn, CompiledRound), self.freezes_weights(rows, loop.cache.storage.dtype)):
            return loop.run(on_sync, on_round, hooks.interrupted)

    @contextlib.contextmanager
    def round_weights(self, rows: int, compiled: bool, freeze: bool) -> Iterator[None]:
        """While entered, passes of ``rows`` rows run on the weights `packed_weights` gives them; compiled ones fold
        the weights into their graphs where ``freeze`` says so or where oneDNN's packs are routed (they are graph
        constants only there). Inductor reads `freezing` when it compiles a graph, which any round of a new shape may
        do: so it is set for the whole call."""
        on_cpu = next(self.backbone.target_module.parameters()).device.type == "cpu"
        with self.packed_weights(rows) if on_cpu else contextlib.nullcontext():
            frozen = compiled and (freeze or self.packs.active == "onednn")
            with torch._inductor.config.patch(freezing=True) if frozen else contextlib.nullcontext():
                yield

    def freezes_weights(self, rows: int, dtype: Optional[torch.dtype] = None) -> bool:
        """Whether compiled rounds of ``rows`` rows a pass in ``dtype`` (default: the target's) fold the weights into
        their graphs (`compile`'s ``freeze_weights``; `round_weights` adds the rounds on oneDNN's packs)."""
        module = self.backbone.target_module
        setting = getattr(module, "_spatial_freeze_weights", False)
        if setting is not None:
            return bool(setting)
        param = next(module.parameters())
        return param.device.type == "cpu" and (dtype or param.dtype) == torch.float32 and rows >= FREEZE_MIN_ROWS

    def check_pack_weights(self) -> None:
        """`pack_weights=True` where nothing can be packed is a `ValueError`, before any work."""
        if self.pack_weights_setting is True and not (available_kernels() and packable_linears(*self.backbone.round_modules)):
            param = next(self.backbone.target_module.parameters())
            raise ValueError(f"`pack_weights=True` runs float32 linear layers on a CPU on weights packed for MKL's or oneDNN's GEMM; "
                             f"this target runs on {param.device.type} in {param.dtype}"
                             f"{'' if available_kernels() else ' and this torch build has neither MKL nor oneDNN'}: leave it None.")

    def packed_weights(self, rows: int) -> ContextManager:
        """While entered, the eager target's (and a drafter's) float32 linear layers on a CPU run on weights packed for
        MKL's or oneDNN's GEMM at ``rows`` rows per pass (`PackedWeights`, the kernel timed on this machine): where `pack_weights` is
        ``True``, or ``None`` and the packed copy fits in half the free memory and the timed kernel beats the default
        (MKL's packs from `FREEZE_MIN_ROWS` rows, the weights as stored below). On a compiled target only oneDNN's packs,
        which its frozen rounds hold as constants (`round_weights`), and not with ``freeze_weights=False``: inductor's
        ``freezing`` packs float32 for MKL itself."""
        setting = self.pack_weights_setting
        module = self.backbone.target_module
        if setting is False or not available_kernels() or (self.is_compiled and getattr(module, "_spatial_freeze_weights", False) is False):
            return contextlib.nullcontext()
        heads = [self.draft_heads] if isinstance(self.draft_heads, torch.nn.Module) else []  # EAGLE-2's drafter block
        linears = packable_linears(*self.backbone.round_modules, *heads)  # none off the CPU or below float32
        if not linears or (setting is None and self.packs.rows != rows and not fits_in_memory(linears)):
            self.packs.clear()
            return contextlib.nullcontext()
        kernel = self.pack_kernel(linears, rows)
        routed = kernel == "onednn" or (kernel is not None and not self.is_compiled)
        return self.packs.applied(linears, rows, kernel) if routed else contextlib.nullcontext()

    def pack_kernel(self, linears: list, rows: int) -> Optional[str]:
        """The kernel eager passes of ``rows`` rows run ``linears`` on (``None``: the weights as stored): the measured
        Xeon rule (MKL's packs from `FREEZE_MIN_ROWS` rows, or at any row count with ``pack_weights=True``) unless
        `PackedWeights.choose` times another faster on this machine."""
        unpacked = self.pack_weights_setting is None and rows < FREEZE_MIN_ROWS
        return self.packs.choose(linears, rows, None if unpacked else "mkl" if mkl_packing_available() else "onednn")

    def _device_stats(self, loop: DeviceLoop, rounds: int, batch_size: int) -> DecodingStats:
        """What a device generation cost: one host read of the per-pass accepted lengths, after the last round."""
        layout = self.backbone.layout
        accepted = loop.accepted_lengths()  # (passes, B)
        row_passes = loop.row_passes(accepted)
        fed = rounds * batch_size * loop.fed
        return DecodingStats(
            num_forward_passes=1 + rounds, num_draft_passes=loop.draft_passes(rounds),
            num_tokens=batch_size * layout.num_tokens,
            mean_accepted_length=accepted.sum().item() / max(sum(row_passes), 1), accepted_lengths=accepted.cpu(),
            acceptance_map=layout.grid(loop.state.acceptance_map[:, :-1]).cpu(), wall_time_s=0.0,
            padded_fraction=1 - sum(p - 1 for p in row_passes) * loop.fed / fed if fed else None,  # finished rows' slots
            row_forward_passes=row_passes, decoder_stats=loop.report())

    # -- the cache, fixed shapes and the target pass ----------------------------------------------------------
    def make_cache(self, rows: int, needed: int, device: torch.device) -> StaticKVCache:
        """Step 3's KV cache. With static shapes its length is rounded up and the cache kept for the next call of the
        same size (`BackboneCaches.kv_cache`): its tensors keep their address, which CUDA graphs replay."""
        backbone = self.backbone
        if not self.static_shapes:
            return backbone.make_cache(rows, needed)
        length = static_cache_length(needed)
        cache = backbone.caches.kv_cache
        if (cache is None or cache.max_length != length or cache.storage.shape[2] != rows
                or cache.storage.dtype != backbone.dtype or cache.storage.device != torch.device(device)):
            cache = backbone.make_cache(rows, length)
            cache.fixed_shape = True
            backbone.caches.kv_cache = cache
        cache.reset()
        mark_static_cache(cache, uses_cuda_graphs(backbone.target_module, cache.storage.device))
        return cache

    # -- compile --------------------------------------------------------------------------------------------
    @property
    def is_compiled(self) -> bool:
        return getattr(self.backbone.target_module, "_compiled_call_impl", None) is not None

    def compile(self, device: torch.device, mode: Optional[str] = None, dynamic: bool = False,
                fullgraph: Optional[bool] = None, backend: str = "inductor", keep_if_slower: bool = False,
                measure: bool = True, freeze_weights: Optional[bool] = None, **kwargs) -> Dict[str, Any]:
        """`SpatialARPipeline.enable_compile` on ``device``: compile the target step, keep it where it measures faster
        (the device rounds compile with the same options on first use)."""
        backbone = self.backbone
        module = backbone.target_module
        if freeze_weights and (torch.device(device).type != "cpu" or backend != "inductor"):
            raise ValueError(f"`freeze_weights=True` packs the weights for a CPU's GEMM (inductor's `freezing`); this "
                             f"pipeline runs on {torch.device(device).type} with backend {backend!r}: leave it None.")
        if mode is None and device.type == "cuda" and backend == "inductor":
            mode = "reduce-overhead"
        options = dict(backend=backend, dynamic=dynamic, fullgraph=backbone.supports_fullgraph if fullgraph is None else fullgraph,
                       **({} if mode is None else {"mode": mode}), **kwargs)
        rows, sizes = (2 if backbone.default_guidance_scale != 1.0 else 1), [1, 8]
        self.disable_compile()
        # a graph per fed size and attended length (`attend_buckets`): swapping decoders passes dynamo's default of 8
        # graphs per function, past which it would fail (fullgraph) or run eagerly without a word
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        eager = {}
        for size in sizes if measure else ():  # on the weights eager rounds of that size run on (`packed_weights`)
            with self.packed_weights(rows * size):
                eager.update(PassCost(backbone, rows, repeats=5, warmup=1).measure([size]))
        module.compile(**options)
        module._spatial_compile_mode = mode  # read by `uses_cuda_graphs`
        module._spatial_compile_options = options  # device rounds compile with the same (`_compiled_device_round`)
        module._spatial_freeze_weights = freeze_weights if backend == "inductor" else False  # read by `freezes_weights`
        compiled = {}
        for size in sizes if measure else ():  # on the weights compiled rounds of that size run on (`round_weights`)
            with self.round_weights(rows * size, compiled=True, freeze=False):
                compiled.update(PassCost(backbone, rows, repeats=5, warmup=2, compiled=True, fixed_shape=True).measure([size]))
        # the passes alone: a compiled round also drops the eager ops around its pass, which this does not time
        kept_by_default = not measure or sum(compiled.values()) <= (1 + COMPILE_TOLERANCE) * sum(eager.values())
        enabled = keep_if_slower or kept_by_default
        if not enabled:
            self.disable_compile()
        backbone.caches.pass_costs.clear()  # "auto" sizes are chosen again for the forward that runs now
        return {"eager_ms": {t: 1e3 * s for t, s in eager.items()}, "compiled_ms": {t: 1e3 * s for t, s in compiled.items()},
                "enabled": enabled, "kept_by_default": kept_by_default,
                "options": {k: v for k, v in options.items() if isinstance(v, (str, bool, int, float, type(None)))},
                "freeze_weights": freeze_weights}

    def disable_compile(self) -> None:
        """Undo `compile`: the target forward runs eagerly again."""
        module = self.backbone.target_module
        module._compiled_call_impl = None  # what nn.Module.compile sets
        module._spatial_compile_mode = None
        module._spatial_compile_options = None
        module._spatial_freeze_weights = False
        module.__dict__.pop("_spatial_device_rounds", None)
        self.backbone.caches.pass_costs.clear()
        self.backbone.caches.kv_cache = None

    def _compiled_device_round(self, round_fn):
        """With the target compiled: ``round_fn`` compiled whole with the same options (`device_loop.compile_round`),
        made once per function and compile (and again once a weight changed in place, where graphs may hold frozen
        weights: `weights_changed`); ``None`` when eager."""
        if not self.is_compiled:
            return None
        module = self.backbone.target_module
        rounds = module.__dict__.setdefault("_spatial_device_rounds", {})  # dropped with the compiled step
        setting = getattr(module, "_spatial_freeze_weights", False)
        # only where a graph may hold frozen weights (`freezes_weights`: never off a CPU unless forced) are they watched
        freezing = setting is True or (setting is None and next(module.parameters()).device.type == "cpu")
        compiled = rounds.get(round_fn.__name__)
        if compiled is None or (freezing and self.weights_changed(compiled.weights_seen)):
            options = dict(getattr(module, "_spatial_compile_options", None) or {})
            options["fullgraph"] = self.backbone.supports_fullgraph
            compiled = rounds[round_fn.__name__] = compile_round(round_fn, **options)
            if freezing:
                self.weights_changed(compiled.weights_seen)  # what its graphs will be compiled on
        return compiled

    def weights_changed(self, seen: Dict[int, Tuple[Any, tuple]]) -> bool:
        """Whether a weight a round may read (any of the pipeline's modules': the trunk, a head outside it as Emu3's
        ``lm_head``, the draft heads) changed since ``seen`` (``{id: (weakref, tensor_stamp)}``) recorded it; records
        the ones not seen yet. A frozen graph holds copies of the weights, so a change in place (``load_state_dict``, an
        optimiser step, a merged adapter, a cast there and back) must compile the round again; other weights (heads
        swapped in) are new graph constants dynamo's guards already tell apart. Read once per call."""
        components = self.backbone.pipe.components.values()
        modules = [m for m in components if isinstance(m, torch.nn.Module)] + ([self.draft_heads] if isinstance(self.draft_heads, torch.nn.Module) else [])
        changed = False
        for t in itertools.chain.from_iterable(itertools.chain(m.parameters(), m.buffers()) for m in modules):
            known = seen.get(id(t))
            if known is None or known[0]() is not t:
                seen[id(t)] = (weakref.ref(t), tensor_stamp(t))
            elif known[1] != tensor_stamp(t):
                changed = True
        return changed

    @contextlib.contextmanager
    def profile_rounds(self, synchronize: Optional[Callable[[], None]] = None):
        """`SpatialARPipeline.profile_rounds`: a `RoundTimer` over the rounds run inside the block."""
        timer = RoundTimer(synchronize)
        self.timer = timer
        try:
            yield timer
        finally:
            self.timer = None


def check_rounds_per_sync(value) -> int:
    """``max_rounds_per_sync``: an int >= 1."""
    check_number("max_rounds_per_sync", value, 1, integer=True, meaning="rounds run between two reads of the device")
    return int(value)

