"""c(T): what one target pass over T fed tokens costs on the device a pipeline runs on, measured, not assumed.

Speculative decoders size their drafts from it (``num_draft_tokens="auto"``, ``window_size="auto"``): on a
weight-bound device a pass over 16 tokens costs about what a pass over 1 does, on a compute-bound one it does not.
"""

import contextlib
import random
import statistics
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Dict, List, Optional

import numpy as np
import torch
from diffusers.utils import logging

from ..core.kv_cache import varying_length_attention
from ..core.sampling import SamplingConfig
from ..utils import check_number
from .backbone import PromptEmbeddings
from .compiled import eager_target, mark_static_cache, uses_cuda_graphs


logger = logging.get_logger(__name__)

#: Timed sweeps per cost measurement (after untimed ones): enough for "auto" sizes that repeat from process to process
#: on a noisy 2-core AMD EPYC VM (docs/benchmarks/archive-cost.md). The test suite lowers it.
SWEEPS = 15


def sweep_estimate(times: Dict[int, List[float]]) -> Dict[int, float]:
    """Seconds per size from sweeps that timed every size once (``times[size][i]``: sweep ``i``). A slow spell of a
    shared machine scales a whole sweep, so each size's shape is the median over sweeps of its time relative to its
    sweep's mean, and the level is the quietest sweep's mean (per-size medians or minimums moved the chosen sizes)."""
    sizes = list(times)
    sweeps = len(times[sizes[0]])
    means = [sum(times[t][i] for t in sizes) / len(sizes) for i in range(sweeps)]
    level = min(means)
    return {t: level * statistics.median(times[t][i] / means[i] for i in range(sweeps)) for t in sizes}


class PassCost:
    """Seconds of one target pass (CFG rows as one batch, final norm and image-code head included) over ``T`` fed
    tokens with a realistic cache (the prompt and half the image), measured on first use of each ``T``.

    Args:
        backbone: the pipeline's `SpatialBackbone`.
        rows (`int`): batch rows of a pass (2 with CFG at batch 1).
        repeats (`int`), warmup (`int`): timed (default `SWEEPS`) and untimed sweeps over the sizes (`sweep_estimate`).
        compiled (`bool`): time the compiled target when the pipeline has one (else the eager forward).
        fixed_shape (`bool`): on a fixed-shape cache (every pass attends to all of it), as static-shape rounds run.
    """

    def __init__(self, backbone, rows: int, repeats: Optional[int] = None, warmup: int = 2, compiled: bool = False,
                 fixed_shape: bool = False):
        self.backbone, self.rows, self.warmup = backbone, rows, warmup
        self.repeats = SWEEPS if repeats is None else repeats
        self.compiled, self.fixed_shape = compiled, fixed_shape
        self.seconds: Dict[int, float] = {}
        self._cache = None

    def __call__(self, t: int) -> float:
        if t not in self.seconds:
            self.measure([t])
        return self.seconds[t]

    def measure(self, sizes) -> Dict[int, float]:
        """Measure several ``T`` in sweeps, each timing every ``T`` once in a shuffled order (`sweep_estimate`). New
        sizes are timed together with every size measured so far, all replaced from the new sweeps (one curve, one
        time). Returns the seconds of ``sizes``."""
        if any(t not in self.seconds for t in sizes):
            todo = sorted(set(self.seconds) | set(sizes))
            times = {t: [] for t in todo}
            module = getattr(self.backbone, "target_module", None)
            order = random.Random(0)  # a fixed shuffle per sweep: the same in every process
            with contextlib.nullcontext() if self.compiled or module is None else eager_target(module):
                for i in range(self.warmup + self.repeats):
                    order.shuffle(todo)
                    for t in todo:
                        seconds = self._measure(t)
                        if i >= self.warmup:
                            times[t].append(seconds)
            self.seconds = sweep_estimate(times)
        return {t: self.seconds[t] for t in sizes}

    def fitted(self, sizes=None) -> "FittedCost":
        """`fit_pass_cost` through the timings of ``sizes`` (measured first if needed; default: every ``T`` so far)."""
        if sizes is not None:
            self.measure(sizes)
        return fit_pass_cost({t: self.seconds[t] for t in (self.seconds if sizes is None else sizes)})

    @torch.no_grad()
    def _measure(self, t: int) -> float:
        backbone, layout = self.backbone, self.backbone.layout
        code = torch.zeros(1, 1, dtype=torch.long, device=backbone.pipe._execution_device)
        weight = backbone.embed_image_tokens(code)
        device, dtype = weight.device, weight.dtype
        filled = min(layout.sequence_length // 2 + 16, layout.sequence_length)  # the prompt and half the image
        if self._cache is None or self._cache.max_length < filled + t:
            self._cache = backbone.make_cache(self.rows, filled + max(t, 64))
            self._cache.fixed_shape = self.fixed_shape
            # as the pipeline's own cache: marked static, or CUDA graphs would skip a step that writes into it
            mark_static_cache(self._cache, self.compiled and uses_cuda_graphs(backbone.target_module, device))
            embeds = torch.zeros(self.rows, filled, weight.shape[-1], device=device, dtype=dtype)
            with eager_target(backbone.target_module):  # filling the cache is no measured pass: no graph for it
                backbone.forward(embeds, torch.arange(filled, device=device), None, None, self._cache)
        cache = self._cache
        positions = torch.arange(filled, filled + t, device=device).clamp_max(layout.sequence_length - 1)  # inside RoPE
        mask = torch.ones(t, t, dtype=torch.bool, device=device).tril()
        ids = torch.zeros(self.rows, t, dtype=torch.long, device=device)
        length = cache.length

        def one_pass():
            with varying_length_attention(device, cache.fixed_shape):  # the kernels the loop's pass runs
                backbone.image_logits(backbone.forward(backbone.embed_image_tokens(ids), positions, mask, None, cache))
            cache.crop(length)

        return self._timed(one_pass, 1, device)

    @staticmethod
    def _timed(one_pass, passes: int, device: torch.device) -> float:
        """Mean seconds of ``passes`` calls of ``one_pass`` (a pass and the cache crop after it), synchronised on a GPU."""
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(passes):
            one_pass()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (time.perf_counter() - start) / passes


@dataclass(frozen=True)
class FittedCost:
    """A pass cost curve fitted through measured ``c(T)``: ``base + slope * T + extra_slope * max(0, T - knee)``, every
    term non-negative, so it never falls and bends up at most once (weight-bound below the knee, compute-bound above on
    a GPU). One point's timing noise moves the fit by about a fifteenth of that, so ``"auto"`` sizes repeat."""

    base: float
    slope: float
    extra_slope: float
    knee: int

    def __call__(self, t: int) -> float:
        return self.base + self.slope * t + self.extra_slope * max(0, t - self.knee)


def fit_pass_cost(seconds: Dict[int, float]) -> FittedCost:
    """Least squares (relative errors) of `FittedCost` through ``{T: seconds}``, the knee tried at every measured ``T``;
    a fit with a negative slope is refitted without that term."""
    sizes = sorted(seconds)
    if not sizes:
        raise ValueError("`seconds` is empty: measure at least one size before fitting.")
    t = np.asarray(sizes, dtype=np.float64)
    c = np.asarray([seconds[s] for s in sizes], dtype=np.float64)
    best, best_error = FittedCost(float(c.mean()), 0.0, 0.0, sizes[0]), np.inf
    for knee in sizes:
        hinge = np.maximum(0.0, t - knee)
        for columns in ((0, 1, 2), (0, 2), (0, 1), (0,)):  # the full fit first, then without a slope that went negative
            design = np.stack([np.ones_like(t), t, hinge], 1)[:, columns] / c[:, None]  # relative errors
            coef = np.linalg.lstsq(design, np.ones_like(c), rcond=None)[0]
            if (coef[1:] < 0).any() or coef[0] < 0:
                continue
            full = dict(zip(columns, coef))
            fit = FittedCost(float(full.get(0, 0.0)), float(full.get(1, 0.0)), float(full.get(2, 0.0)), knee)
            relative = (np.asarray([fit(s) for s in sizes]) - c) / c
            error = float(relative @ relative)
            if error < best_error - 1e-12:
                best, best_error = fit, error
            break
    return best


def fit_round_cost(seconds: Dict[int, float]) -> Callable[[int], float]:
    """Seconds per round by node count: `fit_pass_cost` through the drafted rounds (two nodes or more), and a round
    without drafts (one node) as timed, off the curve. Why: its pass feeds one token per row and takes other kernels
    (a 1-row GEMM, 1-query attention); on a CPU it sat 15-20% below the line through the drafted rounds (janus-25m),
    which made a 2-token window look nearly free."""
    drafted = {n: s for n, s in seconds.items() if n > 1}
    fit = fit_pass_cost(drafted) if drafted else None
    return lambda n: seconds[1] if n == 1 else fit(n)


class RoundCost:
    """Seconds of one whole round of a decoder per candidate draft tree (pass, drafting, verification, commit, KV moves,
    and a device read per two rounds), timed on real eager rounds of the engine (`GenerationLoop.start_device_loop`)
    with a zero prompt and keyed noise, in shuffled sweeps combined by `sweep_estimate`: what ``"auto"`` sizes divide
    each tree's expected codes by.

    Args:
        generation (`GenerationLoop`): the pipeline's loop (its backbone, settings and `device_plan`).
        decoder: the `TreeDecoderMixin` decoder whose candidate trees are timed (its ``tree`` is restored after).
        draft_heads: the pipeline's draft heads (or ``None``).
        sampling (`SamplingConfig`): the call's sampling settings.
        batch_size (`int`): images per round.
        prefix_length (`int`): prompt positions before the first code.
        repeats (`int`), warmup (`int`): timed (default `SWEEPS`) and untimed sweeps (each measurement also runs one
            untimed round first).
        rounds (`int`): rounds timed per candidate and sweep.
    """

    def __init__(self, generation, decoder, draft_heads, sampling, batch_size: int, prefix_length: int,
                 repeats: Optional[int] = None, warmup: int = 1, rounds: int = 2):
        self.generation, self.decoder, self.draft_heads = generation, decoder, draft_heads
        self.sampling, self.batch_size, self.prefix_length = sampling, batch_size, prefix_length
        self.repeats, self.warmup, self.rounds = SWEEPS if repeats is None else repeats, warmup, rounds
        self.seconds: Dict[int, float] = {}  # per number of tree nodes (the root included)

    def __call__(self, tree) -> float:
        if tree.num_nodes not in self.seconds:
            self.measure([tree])
        return self.seconds[tree.num_nodes]

    def fitted(self, trees) -> Callable[[Any], float]:
        """Seconds per round of a tree on the curve `fit_round_cost` draws through ``trees``' timings (by node count;
        timed first where needed): the fit keeps timing noise from moving the choice."""
        curve = fit_round_cost(self.measure(trees))
        return lambda tree: curve(tree.num_nodes)

    @torch.no_grad()
    def measure(self, trees) -> Dict[int, float]:
        """Time every tree of ``trees`` not timed yet; returns ``{num_nodes: seconds}`` of all of them."""
        todo = list({tree.num_nodes: tree for tree in trees if tree.num_nodes not in self.seconds}.values())
        if todo:
            self.seconds.update(self._sweeps(todo))
        return {tree.num_nodes: self.seconds[tree.num_nodes] for tree in trees}

    def _sweeps(self, trees) -> Dict[int, float]:
        generation, decoder = self.generation, self.decoder
        backbone, layout = generation.backbone, generation.backbone.layout
        device = backbone.pipe._execution_device
        embedding = backbone.embed_image_tokens(torch.zeros(1, 1, dtype=torch.long, device=device))  # (1, 1, D)
        rows = self.batch_size * (2 if self.sampling.do_cfg else 1)
        length = self.prefix_length if backbone.prefix_length is None else backbone.prefix_length  # as a call's prompt
        if backbone.max_sequence_length is not None:  # within the model's context
            length = max(1, min(length, backbone.max_sequence_length - layout.sequence_length))
        prefix = PromptEmbeddings(embedding.new_zeros(rows, length, embedding.shape[-1]),  # (R, P, D)
                                  torch.ones(rows, length, dtype=torch.bool, device=device))
        seeds = torch.arange(self.batch_size)  # keyed noise: one seed per image
        kept = (decoder.tree, generation.decoder, generation.draft_heads, generation.timer)
        generation.decoder, generation.draft_heads, generation.timer = decoder, self.draft_heads, None
        try:
            plans = {}
            for tree in trees:
                decoder.tree = tree
                plans[tree.num_nodes] = (tree, generation.device_plan(self.sampling, self.batch_size, device))
            fed = max(loop_class.fed_slots(layout, **kwargs) for _, (loop_class, kwargs) in plans.values())
            # one cache for every candidate, reset for each: the candidates' loops never live at once
            cache = backbone.make_cache(rows, length + layout.sequence_length + fed)
            cache.fixed_shape = generation.static_shapes
            times = {n: [] for n in plans}
            order = random.Random(0)  # a fixed shuffle per sweep: the same in every process
            with eager_target(backbone.target_module):  # one graph per candidate would be minutes of compiling
                for i in range(self.warmup + self.repeats):
                    sizes = list(plans)
                    order.shuffle(sizes)
                    for n in sizes:
                        decoder.tree, plan = plans[n]
                        seconds = self._timed_rounds(prefix, seeds, plan, cache, device)
                        if i >= self.warmup:
                            times[n].append(seconds)
        finally:
            decoder.tree, generation.decoder, generation.draft_heads, generation.timer = kept
        return sweep_estimate(times)

    def _timed_rounds(self, prefix, seeds, plan, cache, device) -> float:
        """Mean seconds of ``rounds`` rounds of a freshly prefilled loop (one untimed round first), with one read of
        the device per two rounds."""
        loop = self.generation.start_device_loop(prefix, self.sampling, seeds, plan, cache=cache, compiled=False)

        def rounds():
            for r in range(self.rounds):
                loop.step()
                if r % 2 == 1 or r == self.rounds - 1:
                    loop.sync()

        # on the weights a call's eager rounds of this size run on (`GenerationLoop.packed_weights`), packed untimed
        with self.generation.packed_weights(loop.cache.storage.shape[2] * loop.fed):
            loop.step()
            loop.sync()
            return PassCost._timed(rounds, 1, device) / self.rounds


#: Fixed draft sizes for the families whose checkpoints (1-8B parameters) run on GPUs: on an H100 (bf16,
#: `scripts/gpu_check.py`, 2026-11-26) a pass over 1 to 256 fed tokens costs one AR step, so acceptance bounds a
#: draft. SJD: the window "auto" chose there; Medusa: its default tree (4 heads x top-4); Hawk: as SJD; EAGLE-2 and
#: ADT-Tree: EAGLE-2's released 60 draft tokens. The decoders' class defaults are the same numbers.
GPU_DRAFT_SIZES: Dict[str, int] = {"JacobiDecoder": 32, "MedusaDecoder": 16, "HawkDecoder": 32, "EagleDecoder": 60}

#: Fixed draft sizes on a CPU: there every fed token past about 8 costs (a pass over 32 tokens took 2.0 AR steps on
#: Llama trunks of 5-40M parameters, 2-core AMD EPYC, fp32, 2026-11-24), so a 32-token SJD window makes a round cost
#: more than its codes repay. The sizes `tune_decoder` picked on the embedded LlamaGen model v3 there (2026-11-27,
#: `scripts/check_auto_sizes.py`): LlamaGen's fixed sizes, and the transformers families' on a CPU.
CPU_DRAFT_SIZES: Dict[str, int] = {"JacobiDecoder": 8, "MedusaDecoder": 4, "HawkDecoder": 4, "EagleDecoder": 2}


class DraftSizingMixin:
    """The pipeline side of draft sizes: the family's fixed defaults, ``"auto"`` sizes from measured costs,
    `resolve_draft_sizes` and `tune_decoder` (reads ``backbone``, ``decoder``, ``draft_heads``, ``static_shapes``)."""

    #: The family's fixed draft size per decoder class name (a subclass inherits its base's entry) for a decoder whose
    #: size is ``None`` (on a CPU unless `cpu_draft_sizes` names its own); one not named drafts with its class's
    #: ``default_draft_size``.
    default_draft_sizes: ClassVar[Dict[str, int]] = {}
    #: The family's fixed sizes when the pipeline runs on a CPU (``None``: `default_draft_sizes` there too).
    cpu_draft_sizes: ClassVar[Optional[Dict[str, int]]] = None

    def draft_size_table(self, device: Optional[torch.device] = None) -> Dict[str, int]:
        """The fixed sizes the family drafts with on ``device`` (default: the pipeline's execution device)."""
        device = torch.device(device) if device is not None else self._execution_device
        if device.type == "cpu" and self.cpu_draft_sizes is not None:
            return self.cpu_draft_sizes
        return self.default_draft_sizes

    def default_draft_size(self, decoder, device: Optional[torch.device] = None) -> int:
        """The size ``decoder`` drafts with when its config leaves it at ``None`` on ``device`` (default: the execution
        device): the family's entry for its class or nearest base (`draft_size_table`), else the class's default."""
        table = self.draft_size_table(device)
        for cls in type(decoder).__mro__:
            if cls.__name__ in table:
                return table[cls.__name__]
        return type(decoder).default_draft_size

    def pass_cost(self, rows: int) -> PassCost:
        """The measured cost ``c(T)`` of a target pass with ``rows`` batch rows on this pipeline's device and dtype,
        kept per pipeline: what ``"auto"`` draft sizes are chosen from."""
        device, dtype = self._execution_device, self.backbone.embed_image_tokens(torch.zeros(1, 1, dtype=torch.long, device=self._execution_device)).dtype
        key = (rows, str(device), str(dtype), self.static_shapes)
        costs = self.backbone.caches.pass_costs
        if key not in costs:  # measured eagerly (one graph per measured T would be minutes of compiling)
            costs[key] = PassCost(self.backbone, rows, fixed_shape=self.static_shapes)
        return costs[key]

    def resolve_draft_sizes(self, num_images: int = 1, sampling: Optional[SamplingConfig] = None, prefix_length: int = 16,
                            accepted: Optional[Dict[int, float]] = None) -> None:
        """Fix the decoder's ``"auto"`` draft sizes for calls of ``num_images`` images (a call does this before its
        first round; nothing happens for fixed sizes or sizes already chosen). Each candidate's whole round is timed on
        real rounds at up to 4 images (`RoundCost`) and fitted (`fit_pass_cost` over the tree's nodes).

        Args:
            num_images (`int`): images per call.
            sampling (`SamplingConfig`, *optional*): the calls' sampling settings (default: the backbone's defaults).
            prefix_length (`int`): prompt positions before the first code (the timed rounds' zero prompt).
            accepted (`dict`, *optional*): size -> mean accepted drafts per round, measured (`measure_acceptance`):
                weighs those sizes with it instead of the decoder's acceptance prior.
        """
        if self.decoder.sizes_from_family:  # the family's fixed size: nothing is measured
            self.decoder.use_default_size(self.default_draft_size(self.decoder))
            return
        if not self.decoder.sizes_from_pass_cost:
            return
        if sampling is None:
            sampling = SamplingConfig(self.backbone.default_guidance_scale, 1.0, self.backbone.default_top_k)
        self.decoder.resolve_draft_size(self.round_cost(min(num_images, 4), sampling, prefix_length), batch_size=num_images,
                                        accepted=accepted)

    @torch.no_grad()
    def measure_acceptance(self, decoder, prompt, batch_size: int, sampling: SamplingConfig, seed: int = 0) -> Dict[int, float]:
        """Mean accepted drafts per round (codes per pass per row, less the one a pass always commits) of ``decoder`` at
        each size it weighs (``decoder._draft_sizes()``), each from one eager generation of ``prompt`` at
        ``batch_size`` images from ``seed`` (the call's default noise: keyed for exact decoders; codes only, no image
        decoded): what this checkpoint accepts, where the decoder's prior was fitted on the embedded model. The
        pipeline's decoder is kept."""
        name, kept = decoder.draft_size_name, self.decoder
        bar = dict(getattr(self, "_progress_bar_config", {}))
        accepted = {}
        try:
            self.set_progress_bar_config(**{**bar, "disable": True})
            with eager_target(self.backbone.target_module):  # one graph per size would be minutes of compiling
                for size in decoder._draft_sizes():
                    self.decoder = type(decoder).from_config(decoder.config, **{name: size})
                    out = self(prompt, guidance_scale=sampling.guidance_scale, temperature=sampling.temperature,
                               top_k=sampling.top_k, num_images_per_prompt=batch_size, output_type="latent",
                               generator=torch.Generator().manual_seed(seed))
                    accepted[size] = out.stats.mean_accepted_length - 1.0
        finally:
            self.decoder = kept
            self._progress_bar_config = bar
        return accepted

    def tune_decoder(self, batch_size: int = 1, guidance_scale: Optional[float] = None, temperature: float = 1.0,
                     top_k: Optional[int] = None, prefix_length: int = 16, prompt=None, seed: int = 0):
        """Measure this device at ``batch_size`` images per call and return a copy of the pipeline's decoder with the
        draft size ``"auto"`` would pick (the most expected codes per second) fixed in its config, to save and reuse on
        this device. A decoder without a draft size (AR, SSD) comes back as a copy; the pipeline's decoder is kept.

        Each candidate size's whole round is timed on the device. What a size accepts comes from the decoder's prior,
        fitted on the embedded Twemoji model, unless ``prompt`` is given: then each size is also run on one real
        generation of it (eager, keyed noise, `measure_acceptance`) and weighed by what this checkpoint accepts, which
        a photographic or untrained model may put far from the prior.

        Args:
            batch_size (`int`): images per call the decoder will serve (>= 1).
            guidance_scale (`float`, *optional*), temperature (`float`), top_k (`int`, *optional*): the calls'
                sampling settings (defaults: the family's).
            prefix_length (`int`): prompt positions before the first code (the timed rounds' zero prompt).
            prompt (*optional*): a prompt (or class label) like the ones the decoder will serve: measure each size's
                acceptance on it (one generation per candidate size) rather than assume the prior.
            seed (`int`): the calibration generations' seed (keyed noise).

        Examples:

        ```py
        >>> decoder = pipe.tune_decoder(batch_size=4)  # measures the rounds here, a few seconds
        >>> decoder = pipe.tune_decoder(batch_size=4, prompt="a red barn")  # and the acceptance on this checkpoint
        >>> decoder.config.window_size  # e.g. 8
        >>> decoder.save_config("my_decoder")  # later: pipe.decoder = JacobiDecoder.from_config(...)
        >>> pipe.decoder = decoder
        ```
        """
        check_number("batch_size", batch_size, 1, integer=True, meaning="images per call")
        check_number("prefix_length", prefix_length, 1, integer=True)
        check_number("seed", seed, 0, integer=True)
        backbone = self.backbone
        sampling = SamplingConfig(backbone.default_guidance_scale if guidance_scale is None else guidance_scale, temperature,
                                  backbone.default_top_k if top_k is None else top_k)
        decoder, name = self.decoder, self.decoder.draft_size_name
        if name is None:
            return type(decoder).from_config(decoder.config)
        tuned = type(decoder).from_config(decoder.config, **{name: "auto"})  # measured on a copy: the pipeline keeps its own
        accepted = None if prompt is None else self.measure_acceptance(tuned, prompt, batch_size, sampling, seed)
        self.decoder, kept = tuned, decoder
        try:
            self.resolve_draft_sizes(batch_size, sampling, prefix_length, accepted=accepted)
        finally:
            self.decoder = kept
        fixed = tuned.fixed_sizes()
        if fixed.get(name) == 0:
            logger.warning(f"tune_decoder: on this device no {name} of {type(decoder).__name__} is expected to give more "
                           f"codes per second than rounds without drafts, so it returns {name}=0 (AR's rounds and "
                           f"codes), as `AutoregressiveDecoder` does"
                           + (": pass a `prompt` like the ones it will serve to weigh the sizes by what this checkpoint "
                              "accepts." if prompt is None else f" (acceptance measured on {prompt!r})."))
        return type(decoder).from_config(decoder.config, **fixed)

    def round_cost(self, batch_size: int, sampling: SamplingConfig, prefix_length: int) -> RoundCost:
        """The measured cost of the current decoder's whole round per candidate tree (`RoundCost`) at ``batch_size``
        images, kept per pipeline, decoder object and heads, so decoders swapped back and forth are timed once each."""
        per_decoder = self.__dict__.setdefault("_round_costs", weakref.WeakKeyDictionary())
        costs = per_decoder.setdefault(self.decoder, {})
        key = (batch_size, str(self._execution_device), self.static_shapes)
        kept = costs.get(key)
        if kept is None or kept.draft_heads is not self.draft_heads:
            costs[key] = RoundCost(self.loop, self.decoder, self.draft_heads, sampling, batch_size, prefix_length)
        return costs[key]
