"""Eager rounds on a CPU with the target's linear layers on weights packed for MKL's GEMM (`PackedWeights`): what
inductor's ``freezing`` does inside a compiled round (`GenerationLoop.freezes_weights`), for the rounds that run
eagerly. Why: on weights as stored MKL's GEMM leaves its few-row kernel at 4 rows and costs 2-3x as much as on packed
weights from there (a 2-core Xeon, `scripts/cpu_gemm.py`), and a speculative round feeds rows x slots rows."""

import contextlib
import weakref
from typing import Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

from ..utils import available_memory, tensor_stamp

#: MKL's packed buffer reserves about this much beside the weight itself (a 2-core Xeon, torch 2.13: 7.5-8 MiB per
#: matrix, mostly never touched: packing the embedded model's 43 layers, 40 MiB of weights, grew the resident memory by
#: 41 MiB); `fits_in_memory` counts it all, to stay on the safe side
PACK_OVERHEAD_BYTES = 8 << 20


def mkl_packing_available() -> bool:
    """Whether this torch build has MKL's packed GEMM (``torch.ops.mkl._mkl_linear``; x86 wheels do)."""
    return bool(torch._C.has_mkl) and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")


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
    """MKL-packed copies of linear weights for one number of rows fed per pass, kept while each weight keeps its
    `tensor_stamp` (a weight changed in place, by ``load_state_dict``, an optimiser step or a cast there and back, is
    packed again) and dropped when the row count changes: at most one packed copy of the target beside its weights."""

    def __init__(self):
        self.rows: Optional[int] = None
        self._packs: Dict[int, Tuple[weakref.ref, int, torch.Tensor]] = {}  # id(weight) -> (weight, version, pack)

    def pack(self, weight: torch.Tensor, rows: int) -> torch.Tensor:
        """``weight`` ``(N, K)`` packed for ``rows`` rows (made once per weight, version and row count)."""
        if rows != self.rows:
            self._packs.clear()
            self.rows = rows
        known = self._packs.get(id(weight))
        if known is not None and known[0]() is weight and known[1] == tensor_stamp(weight):
            return known[2]
        packed = torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), rows)
        self._packs[id(weight)] = (weakref.ref(weight), tensor_stamp(weight), packed)
        return packed

    def clear(self) -> None:
        self._packs.clear()
        self.rows = None

    @contextlib.contextmanager
    def applied(self, linears: List[nn.Linear], rows: int) -> Iterator[int]:
        """While entered, ``linears`` (`packable_linears`) run on weights packed for ``rows`` rows (any other row
        count takes MKL's GEMM on the weights as stored, inside the same op). Yields how many layers it routes."""
        for m in linears:
            m.forward = _packed_forward(m, self.pack(m.weight, rows), rows)
        try:
            yield len(linears)
        finally:
            for m in linears:
                m.__dict__.pop("forward", None)


def _packed_forward(layer: nn.Linear, packed: torch.Tensor, rows: int):
    weight, bias = layer.weight, layer.bias

    def forward(x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):  # the packed op has no backward
            return nn.functional.linear(x, weight, bias)
        return torch.ops.mkl._mkl_linear(x, packed, weight, bias, rows)  # (..., N); other row counts: the plain GEMM

    return forward
