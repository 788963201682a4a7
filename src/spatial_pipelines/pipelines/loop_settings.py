"""The generation loop's settings on the pipeline (`LoopSettingsMixin`): the loop it builds once over its backbone
adapter (`generation.GenerationLoop`), fixed shapes, syncs and compile."""

from typing import Any, Callable, Dict, Optional

from .generation import GenerationLoop, check_rounds_per_sync


class LoopSettingsMixin:
    """`SpatialARPipeline`'s generation loop (built once over ``self.backbone``) and its settings, read and set on the
    pipeline."""

    @property
    def loop(self) -> GenerationLoop:
        """The generation loop (`GenerationLoop`); a copied pipeline builds its own with the same settings."""
        loop = self.__dict__.get("_loop")
        backbone = self.backbone
        if loop is None or loop.backbone is not backbone:
            settings = loop.settings() if loop is not None else {}
            loop = self.__dict__["_loop"] = GenerationLoop(backbone)
            for name, value in settings.items():
                setattr(loop, name, value)
        return loop

    @property
    def static_shapes(self) -> bool:
        """Whether every round runs the target with a few fixed shapes: the KV cache (its length rounded up) attended
        over one of at most ``attend_buckets`` fixed lengths and every draft padded to the decoder's largest. On by
        default when the target is compiled (`enable_compile`), off otherwise; ``True``/``False`` to choose, ``None``
        for the default. Outputs are the same either way."""
        return self.loop.static_shapes

    @static_shapes.setter
    def static_shapes(self, value: Optional[bool]) -> None:
        self.loop.static_shapes_setting = _check_optional_bool("static_shapes", value, "the default: on when compiled")

    @property
    def pack_weights(self) -> Optional[bool]:
        """Whether eager rounds on a CPU run the target's float32 linear layers on weights packed for MKL's or oneDNN's
        GEMM at the pass's row count (rows x slots), as a compiled round does with ``freeze_weights`` (`enable_compile`).
        ``None`` (default): MKL's packs for passes of `FREEZE_MIN_ROWS` (4) rows or more (its GEMM on the weights as
        stored costs 2-3x as much there on a 2-core Xeon) and the weights as stored below, unless another kernel is
        timed at least 1.25x faster on this machine, once per row count (`PackedWeights.choose`: oneDNN's on an AMD
        EPYC, at every row count), while the packed copy fits in half the free memory;
        ``True``: every eager round (a `ValueError` at the call where the target has no float32 linear layer on a CPU);
        ``False``: never. The packed copy (about the target's float32 size resident; MKL reserves 8 MiB more a
        layer, mostly never touched) is kept for the next call of the same row count and packed again once a weight
        changes in place. Greedy codes are the same either way (tested); logits may differ in the last bits."""
        return self.loop.pack_weights_setting

    @pack_weights.setter
    def pack_weights(self, value: Optional[bool]) -> None:
        self.loop.pack_weights_setting = _check_optional_bool("pack_weights", value, "the default: eager CPU float32 passes of 4 or more rows")
        if value is False:
            self.loop.packs.clear()

    @property
    def max_rounds_per_sync(self) -> int:
        """Rounds on the device run between two host reads at most (``K``; default `MAX_ROUNDS_PER_SYNC`, 8): a larger
        ``K`` reads less often, and between reads each pass attends to up to ``K`` rounds of slots no row has filled."""
        return self.loop.max_rounds_per_sync

    @max_rounds_per_sync.setter
    def max_rounds_per_sync(self, value: int) -> None:
        self.loop.max_rounds_per_sync = check_rounds_per_sync(value)

    @property
    def is_compiled(self) -> bool:
        return self.loop.is_compiled

    def enable_compile(self, mode: Optional[str] = None, dynamic: bool = False, fullgraph: Optional[bool] = None,
                       backend: str = "inductor", keep_if_slower: bool = False, measure: bool = True,
                       freeze_weights: Optional[bool] = None, **kwargs) -> Dict[str, Any]:
        """Compile the round's target step once per shape, and keep it unless it measures slower.

        With the target compiled, `static_shapes` is on: every round feeds the same number of slots and attends to one
        of a few fixed lengths (`StaticKVCache`'s ``attend_buckets``), so a handful of graphs serve the whole generation
        and every later one of the same batch, draft size and cache size; a new prompt length compiles nothing (the
        prefill runs eagerly). A round that runs whole on the device is compiled whole with the same options. The first
        round of each new shape compiles (tens of seconds with inductor on a CPU). Dynamo's recompile limit is raised to
        at least `RECOMPILE_LIMIT` (64), since swapping decoders adds graphs.

        Args:
            mode (`str`, *optional*): ``torch.compile``'s mode; default ``"reduce-overhead"`` (CUDA graphs) on a GPU
                with inductor, none otherwise.
            dynamic (`bool`): ``False`` (the default): static shapes, one graph per shape.
            fullgraph (`bool`, *optional*): no graph breaks allowed; default: the backbone's ``supports_fullgraph``.
            backend (`str`): ``"inductor"``, or ``"eager"`` / ``"aot_eager"`` to check graphs and recompiles quickly.
            keep_if_slower (`bool`): keep the compiled step even when its passes take more than `COMPILE_TOLERANCE`
                (5%) longer than the eager ones (dropped by default).
            measure (`bool`): time the eager and compiled passes (one fed token and eight, CFG rows, after warming
                up); ``False`` keeps the compiled step unmeasured.
            freeze_weights (`bool`, *optional*): fold the weights into the compiled rounds as constants (inductor's
                ``freezing``, which on a CPU packs them for MKL's GEMM: a linear layer fed 4-9 rows costs a half to a
                third as much on a 2-core Xeon). ``None`` (default): on a CPU, for float32 rounds whose pass feeds at least
                `FREEZE_MIN_ROWS` (4) rows (rows x slots), where packing pays; ``True``: every round on a CPU;
                ``False``: never. Each frozen graph keeps its own packed copy of the weights, and a weight changed in
                place makes the rounds compile again at the next call.
            kwargs: further ``torch.compile`` options.

        Returns:
            ``{"eager_ms": {T: ms}, "compiled_ms": {T: ms}, "enabled": bool, "kept_by_default": bool, "options":
            {...}, "freeze_weights": ...}``: ``kept_by_default`` says whether the measured rule alone keeps it (no timings when
            ``measure=False``).
        """
        freeze_weights = _check_optional_bool("freeze_weights", freeze_weights, "the default: on a CPU, for float32 passes of 4 or more rows")
        return self.loop.compile(self._execution_device, mode=mode, dynamic=dynamic, fullgraph=fullgraph,
                                 backend=backend, keep_if_slower=keep_if_slower, measure=measure,
                                 freeze_weights=freeze_weights, **kwargs)

    def disable_compile(self) -> None:
        """Undo `enable_compile`: the target forward runs eagerly again."""
        self.loop.disable_compile()

    def profile_rounds(self, synchronize: Optional[Callable[[], None]] = None):
        """Time the rounds of the calls made inside the block (``scripts/bench_cost.py``).

        Yields a `RoundTimer`: ``seconds`` per section summed over ``rounds``: ``round`` (each whole round), ``sync``
        (the host's reads) and, for an eager round, its parts ``draft``, ``eol``, ``forward``, ``accept`` and ``kv``
        (a compiled round is one graph, timed whole). On a GPU pass ``synchronize=torch.cuda.synchronize``.
        """
        return self.loop.profile_rounds(synchronize)


def _check_optional_bool(name: str, value, none_means: str) -> Optional[bool]:
    """A loop setting that is True, False or None (``none_means``); anything else is a `ValueError` naming it."""
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"`{name}` must be True, False or None ({none_means}), got {value!r}.")
    return value

