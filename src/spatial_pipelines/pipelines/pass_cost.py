"""c(T): what one target pass over T fed tokens costs on the device a pipeline runs on, measured, not assumed.

Speculative decoders size their drafts from it (``num_draft_tokens="auto"``, ``window_size="auto"``): on a
weight-bound device a pass over 16 tokens costs about what a pass over 1 does, on a compute-bound one it does not.
"""

import contextlib
import time
from typing import Dict

import torch

from .static_shapes import eager_target


class PassCost:
    """Seconds of one target pass (CFG rows as one batch, final norm and image-code head included) over ``T`` fed
    tokens with a realistic cache (the prompt and half the image), measured on first use of each ``T``.

    Args:
        backbone: the pipeline's `SpatialBackbone`.
        rows (`int`): batch rows of a pass (2 with CFG at batch 1).
        repeats (`int`), warmup (`int`): timed and untimed passes per ``T`` (the median is kept).
        compiled (`bool`): time the compiled target when the pipeline has one (otherwise the eager forward, which
            compiles nothing per measured ``T``).
        fixed_shape (`bool`): on a fixed-shape cache (every pass attends to the whole cache), as static-shape rounds run.
    """

    def __init__(self, backbone, rows: int, repeats: int = 15, warmup: int = 2, compiled: bool = False, fixed_shape: bool = False):
        self.backbone, self.rows, self.repeats, self.warmup = backbone, rows, repeats, warmup
        self.compiled, self.fixed_shape = compiled, fixed_shape
        self.seconds: Dict[int, float] = {}
        self._cache = None

    def __call__(self, t: int) -> float:
        if t not in self.seconds:
            self.measure([t])
        return self.seconds[t]

    def measure(self, sizes) -> Dict[int, float]:
        """Measure several ``T`` at once, interleaved round by round (a slow spell of a shared machine then hits
        every ``T`` alike rather than biasing the comparison); keeps and returns the medians."""
        todo = [t for t in dict.fromkeys(sizes) if t not in self.seconds]
        times = {t: [] for t in todo}
        module = getattr(self.backbone, "target_module", None)
        with contextlib.nullcontext() if self.compiled or module is None else eager_target(module):
            for i in range(self.warmup + self.repeats):
                for t in todo:
                    seconds = self._measure(t, 1)
                    if i >= self.warmup:
                        times[t].append(seconds)
        for t in todo:
            self.seconds[t] = sorted(times[t])[len(times[t]) // 2]
        return {t: self.seconds[t] for t in sizes}

    @torch.no_grad()
    def _measure(self, t: int, passes: int) -> float:
        backbone, layout = self.backbone, self.backbone.layout
        weight = backbone.embed_image_tokens(torch.zeros(1, 1, dtype=torch.long, device=self._device()))
        device, dtype = weight.device, weight.dtype
        filled = min(layout.sequence_length // 2 + 16, layout.sequence_length)  # the prompt and half the image
        if self._cache is None or self._cache.max_length < filled + t:
            self._cache = backbone.make_cache(self.rows, filled + max(t, 64))
            self._cache.fixed_shape = self.fixed_shape
            embeds = torch.zeros(self.rows, filled, weight.shape[-1], device=device, dtype=dtype)
            with eager_target(backbone.target_module):  # filling the cache is no measured pass: no graph for it
                backbone.forward(embeds, torch.arange(filled, device=device), None, None, self._cache)
        cache = self._cache
        positions = torch.arange(filled, filled + t, device=device).clamp_max(layout.sequence_length - 1)  # inside RoPE
        mask = torch.ones(t, t, dtype=torch.bool, device=device).tril()
        ids = torch.zeros(self.rows, t, dtype=torch.long, device=device)
        length = cache.length

        def one_pass():
            backbone.image_logits(backbone.forward(backbone.embed_image_tokens(ids), positions, mask, None, cache))
            cache.crop(length)

        return self._timed(one_pass, passes, device)

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

    def _device(self):
        return self.backbone.pipe._execution_device


class DraftPassCost(PassCost):
    """Seconds of one drafter pass of an `EagleDraftHead` over ``T`` nodes (``rows`` drafter rows, the backbone's final
    norm and image-code head for logits included) with its cache holding half the image: what each expansion of
    an EAGLE-2 tree costs. ``"auto"`` tree sizes weigh it against the target pass cost (`PassCost`), because a
    deeper tree costs one more drafter pass. Measured like `PassCost` (interleaved sizes, medians).

    Args:
        draft_heads: the `EagleDraftHead`.
        backbone: the pipeline's `SpatialBackbone`.
        rows (`int`): drafter rows (2 with CFG at batch 1).
        repeats (`int`), warmup (`int`): timed and untimed passes per ``T`` (the median is kept).
    """

    def __init__(self, draft_heads, backbone, rows: int, repeats: int = 9, warmup: int = 2):
        super().__init__(backbone, rows, repeats, warmup)
        self.draft_heads = draft_heads

    @torch.no_grad()
    def _measure(self, t: int, passes: int) -> float:
        heads, layout = self.draft_heads, self.backbone.layout
        weight = next(heads.parameters())
        device, dtype, width = weight.device, weight.dtype, heads.config.hidden_size
        filled = max(layout.num_tokens // 2, 1)  # the accepted prefix: half the image
        if self._cache is None or self._cache.max_length < filled + t:
            self._cache = heads.make_cache(self.rows, filled + max(t, 64))
            prefix = torch.zeros(self.rows, filled, width, dtype=dtype, device=device)
            heads(prefix, prefix, torch.arange(filled, device=device), cache=self._cache)
        cache = self._cache
        x = torch.zeros(self.rows, t, width, dtype=dtype, device=device)
        position = torch.full((t,), min(filled, layout.num_tokens - 1), device=device)
        mask = torch.eye(t, dtype=torch.bool, device=device)  # tree nodes of one depth see themselves

        def one_pass():
            self.backbone.image_logits(heads(x, x, position, attention_mask=mask, cache=cache))
            cache.crop(filled)

        return self._timed(one_pass, passes, device)
