"""Linear layers on a CPU on weights packed for a GEMM library (`PackedWeights`). Eager rounds get what inductor's
``freezing`` does inside a compiled round (`GenerationLoop.freezes_weights`); compiled rounds get oneDNN's packs as
graph constants where they are the timed kernel (inductor packs float32 for MKL only). Why: on weights as stored MKL's
GEMM leaves its few-row kernel at 4 rows and costs 2-3x as much as on packed weights from there (a 2-core Xeon,
`scripts/cpu_gemm.py`), and a speculative round feeds rows x slots rows; on an AMD EPYC (Zen 4) MKL's float32 GEMM
streams the weights at a fraction of the memory bandwidth at any row count, where oneDNN's on its packed weights takes
a half to a quarter of the time (`scripts/pack_check.py`): so each machine times the kernels (`PackedWeights.choose`)."""

import contextlib
import time
import weakref
from typing import Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

from ..utils import available_memory, tensor_stamp

#: MKL's packed buffer reserves about this much beside the weight itself (a 2-core Xeon, torch 2.13: 7.5-8 MiB per
#: matrix, mostly never touched: packing the embedded model's 43 layers, 40 MiB of weights, grew the resident memory by
#: 41 MiB); `fits_in_memory` counts it all, to stay on the safe side
PACK_OVERHEAD_BYTES = 8 << 20

#: the packed kernels: MKL's (``torch.ops.mkl._mkl_linear``, what inductor's ``freezing`` emits for float32) and
#: oneDNN's (``torch.ops.mkldnn._linear_pointwise``, what it emits for bf16)
KERNELS = ("mkl", "onednn")

#: a timed kernel replaces the default one only when its sweep over the layers is this much faster: kernels within
#: the timing noise of each other keep the default, so the choice (and the last bits of the logits) stays put
KERNEL_MARGIN = 1.25


def mkl_packing_available() -> bool:
    """Whether this torch build has MKL's packed GEMM (``torch.ops.mkl._mkl_linear``; x86 wheels do)."""
    return bool(torch._C.has_mkl) and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")


def available_kernels() -> List[str]:
    """The packed kernels of `KERNELS` this torch build has."""
    onednn = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    return [k for k, ok in zip(KERNELS, (mkl_packing_available(), onednn)) if ok]


def packable_linears(*modules: nn.Module) -> List[nn.Linear]:
    """The layers of ``modules`` whose forward `PackedWeights` may route through the packed GEMM: plain float32
    ``nn.Linear`` on the CPU (not a subclass: a quantised layer keeps its own forward) whose forward nobody replaced
    (accelerate's offload hooks set one on the instance), each once."""
    seen, linears = set(), []
    for m in (m for module in modules for m in module.modules()):
        if (type(m) is nn.Linear and "forward" not in m.__dict__ and id(m) not in seen
                and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32 and m.weight.layout == torch.strided):
            seen.add(id(m))
            linears.append(m)
    return linears


def packed_bytes(linears: List[nn.Linear]) -> int:
    """At most what packing ``linears`` holds in memory beside the weights (`PACK_OVERHEAD_BYTES` each)."""
    return sum(m.weight.nbytes + PACK_OVERHEAD_BYTES for m in linears)


def fits_in_memory(linears: List[nn.Linear]) -> bool:
    """Whether the packed copies take at most half the host memory available now (unknown: no)."""
    free = available_memory(torch.device("cpu"))
    return free is not None and 2 * packed_bytes(linears) <= free


class PackedWeights:
    """Packed copies of linear weights for one kernel (`KERNELS`; MKL's for one number of rows fed per pass, oneDNN's
    for any), kept while each weight keeps its `tensor_stamp` (a weight changed in place, by ``load_state_dict``, an
    optimiser step or a cast there and back, is packed again) and dropped when the kernel or MKL's row count changes:
    at most one packed copy of the target beside its weights (and, while `choose` times another kernel, that kernel's).

    Args:
        kernel (`str`, *optional*): ``"mkl"`` or ``"onednn"`` for every pass, at any row count; ``None`` (default):
            the fastest on this machine, timed once per row count over the layers themselves (`choose`).
    """

    def __init__(self, kernel: Optional[str] = None):
        if kernel is not None and kernel not in KERNELS:
            raise ValueError(f"`kernel` must be one of {KERNELS} or None, got {kernel!r}.")
        self.kernel = kernel
        self.rows: Optional[int] = None
        self.packed_kernel: Optional[str] = None  # the kernel of the packs held
        self.active: Optional[str] = None  # the kernel `applied` routes through while entered
        self._packs: Dict[int, Tuple[weakref.ref, int, torch.Tensor]] = {}  # id(weight) -> (weight, version, pack)
        self._forwards: Dict[int, Tuple[weakref.ref, torch.Tensor, object]] = {}  # id(layer) -> (layer, pack, forward)
        self._chosen: Dict[Tuple[int, Optional[str]], Optional[str]] = {}  # (rows, default) -> kernel (None: as stored)

    def pack(self, weight: torch.Tensor, rows: int, kernel: str = "mkl") -> torch.Tensor:
        """``weight`` ``(N, K)`` packed for ``rows`` rows and ``kernel`` (made once per weight, version, kernel and, for
        MKL's, row count)."""
        rows = rows if kernel == "mkl" else None  # oneDNN's pack serves any row count as fast as one made for it
        if rows != self.rows or kernel != self.packed_kernel:
            self.clear()
            self.rows, self.packed_kernel = rows, kernel
        known = self._packs.get(id(weight))
        if known is not None and known[0]() is weight and known[1] == tensor_stamp(weight):
            return known[2]
        packed = _packed(weight, rows, kernel)
        self._packs[id(weight)] = (weakref.ref(weight), tensor_stamp(weight), packed)
        return packed

    def clear(self) -> None:
        self._packs.clear()
        self._forwards.clear()
        self.rows = self.packed_kernel = None

    def choose(self, linears: List[nn.Linear], rows: int, default: Optional[str]) -> Optional[str]:
        """The kernel for passes of ``rows`` rows: ``kernel`` where set, else the fastest of `available_kernels` (and
        the weights as stored where ``default`` is ``None``) by `sweep_seconds` over ``linears``, timed once per row
        count and default; ``default`` unless another is `KERNEL_MARGIN` faster. Why time: which GEMM library is fastest
        depends on the CPU (MKL on a Xeon, oneDNN 2-4x faster than it on an EPYC), not on anything torch reports."""
        if self.kernel is not None:
            return self.kernel
        key = (rows, default)
        if key not in self._chosen:
            candidates = ([None] if default is None else []) + available_kernels()
            seconds = {kernel: self.sweep_seconds(linears, rows, kernel) for kernel in candidates}
            best = min(candidates, key=seconds.get)
            self._chosen[key] = best if seconds[best] * KERNEL_MARGIN < seconds[default] else default
        return self._chosen[key]

    @torch.no_grad()
    def sweep_seconds(self, linears: List[nn.Linear], rows: int, kernel: Optional[str]) -> float:
        """The fastest of three sweeps of ``rows`` rows through every layer of ``linears`` on ``kernel``'s packs
        (``None``: the weights as stored): the layers' weights stream from memory as in a pass."""
        # the held packs where they are ``kernel``'s, else a copy made for the sweep alone: timing another kernel
        # never replaces the packs (and so the frozen compiled rounds holding them) of the one in use
        held = kernel is None or (kernel == self.packed_kernel and self.rows == (rows if kernel == "mkl" else None))
        forwards = [self._forward(m, rows, kernel) if held else _packed_forward(m, _packed(m.weight, rows, kernel), rows, kernel)
                    for m in linears]
        x = {m.in_features: torch.randn(rows, m.in_features) for m in linears}
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            for m, forward in zip(linears, forwards):
                forward(x[m.in_features])
            best = min(best, time.perf_counter() - start)
        return best

    def _forward(self, layer: nn.Linear, rows: int, kernel: Optional[str]):
        if kernel is None:
            return layer.forward
        packed = self.pack(layer.weight, rows, kernel)
        known = self._forwards.get(id(layer))
        if known is None or known[0]() is not layer or known[1] is not packed:
            # the same function while the pack stands: dynamo guards a compiled round on each layer's forward
            known = self._forwards[id(layer)] = (weakref.ref(layer), packed, _packed_forward(layer, packed, rows, kernel))
        return known[2]

    @contextlib.contextmanager
    def applied(self, linears: List[nn.Linear], rows: int, kernel: str = "mkl") -> Iterator[int]:
        """While entered, ``linears`` (`packable_linears`) run on weights packed for ``rows`` rows and ``kernel`` (with
        MKL's, any other row count takes its GEMM on the weights as stored, inside the same op), and `active` is
        ``kernel``. Yields how many layers it routes."""
        for m in linears:
            m.forward = self._forward(m, rows, kernel)
        self.active = kernel
        try:
            yield len(linears)
        finally:
            self.active = None
            for m in linears:
                m.__dict__.pop("forward", None)


def _packed(weight: torch.Tensor, rows: Optional[int], kernel: str) -> torch.Tensor:
    if kernel == "mkl":
        return torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), rows)
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())  # (a row hint of 1 makes a slower pack)


def _packed_forward(layer: nn.Linear, packed: torch.Tensor, rows: int, kernel: str):
    weight, bias = layer.weight, layer.bias

    def forward(x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):  # the packed ops have no backward
            return nn.functional.linear(x, weight, bias)
        if kernel == "mkl":
            return torch.ops.mkl._mkl_linear(x, packed, weight, bias, rows)  # (..., N); other row counts: the plain GEMM
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")  # (..., N)

    return forward
