"""What a decoding round does outside the model, counted: host reads, eager ops and compiles per round.

On a GPU a round is fast only when it runs on the device whole: every tensor-to-Python read is a device sync, and
every aten op dispatched eagerly around a compiled (CUDA-graph) step costs a kernel launch and its Python overhead.
Neither needs a GPU to be counted, so `count_rounds` counts them on any device:

    with count_rounds(pipe) as counts:
        pipe("a red heart", output_type="latent")
    print(counts.host_reads_per_round, counts.eager_ops_per_round, counts.recompiles)

- **host reads**: ``aten._local_scalar_dense`` (``item()``, ``int()``, ``bool()``), ``nonzero``, ``is_nonzero``,
  ``equal`` and ``masked_select`` dispatched inside a round outside a compiled region (the reads inside ops count:
  `F.one_hot` reads its codes' range), plus ``Tensor.tolist`` calls (on a CPU tensor it reaches no dispatcher);
- **eager ops**: top-level aten ops inside a round and outside any compiled region (an op called by another op, as
  ``aten::mm`` under ``aten::matmul``, is not counted again), from the profiler's event tree;
- **compiled ops**: aten ops the profiler saw inside a compiled region (``backend="eager"`` graphs show theirs;
  inductor's fused kernels show none);
- **recompiles**: graphs dynamo compiled while counting (``torch._dynamo.utils.counters["stats"]["unique_graphs"]``).

Rounds are the rounds of the pipeline's loop (`generation.GenerationLoop._run_device`: a `device_loop.DeviceLoop`'s),
whose syncs (the host reads between rounds) count as part of the rounds; the prefill pass is not a round.
"""

import contextlib
from dataclasses import dataclass, field
from typing import Dict, Iterator

import torch

#: Dispatcher-level ops that read a tensor's value to the host (on a GPU each waits for the device).
HOST_READ_OPS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::is_nonzero", "aten::equal", "aten::masked_select")
#: Python-level reads that reach no dispatcher on a CPU tensor.
PYTHON_HOST_READS = ("tolist",)
ROUND_EVENT = "spatial_pipelines.round"


@dataclass
class RoundCounts:
    """What the rounds of the calls inside `count_rounds` did.

    Args:
        rounds (`int`): rounds run.
        host_reads (`int`): tensor-to-Python reads inside rounds (see the module docstring).
        eager_ops (`int`): top-level aten ops dispatched inside rounds, outside compiled regions.
        compiled_ops (`int`): aten ops seen inside compiled regions during rounds.
        compiled_calls (`int`): compiled regions entered during rounds.
        recompiles (`int`): graphs dynamo compiled while counting.
        eager_op_names (`dict`): ``eager_ops`` by op name (where the eager work is).
    """

    rounds: int = 0
    host_reads: int = 0
    eager_ops: int = 0
    compiled_ops: int = 0
    compiled_calls: int = 0
    recompiles: int = 0
    eager_op_names: Dict[str, int] = field(default_factory=dict)

    def per_round(self, count: int) -> float:
        return count / self.rounds if self.rounds else 0.0

    @property
    def host_reads_per_round(self) -> float:
        return self.per_round(self.host_reads)

    @property
    def eager_ops_per_round(self) -> float:
        return self.per_round(self.eager_ops)

    def as_dict(self) -> dict:
        return {"rounds": self.rounds, "host_reads_per_round": self.host_reads_per_round,
                "eager_ops_per_round": self.eager_ops_per_round, "compiled_ops_per_round": self.per_round(self.compiled_ops),
                "compiled_calls_per_round": self.per_round(self.compiled_calls), "recompiles": self.recompiles,
                "top_eager_ops": dict(sorted(self.eager_op_names.items(), key=lambda kv: -kv[1])[:10])}


def _is_compiled_region(name: str) -> bool:
    return name.startswith("Torch-Compiled Region") or name == "CompiledFunction"


def _unique_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


@contextlib.contextmanager
def _python_reads(flag: Dict[str, int]) -> Iterator[None]:
    """Count ``Tensor.tolist`` calls made while ``flag["inside"]`` (a round is running)."""
    originals = {name: getattr(torch.Tensor, name) for name in PYTHON_HOST_READS}

    def counting(original):
        def counted(self, *args, **kwargs):
            if flag["inside"] and not torch.compiler.is_compiling():
                flag["reads"] += 1
            return original(self, *args, **kwargs)

        return counted

    try:
        for name, original in originals.items():
            setattr(torch.Tensor, name, counting(original))
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def _tally(events, counts: RoundCounts) -> None:
    """Walk the profiler's events once: attribute every aten op to a round, inside or outside a compiled region."""
    for event in events:
        name = event.name
        if name == ROUND_EVENT:
            continue
        in_round = in_compiled = under_op = False
        parent = event.cpu_parent
        while parent is not None:
            in_round |= parent.name == ROUND_EVENT
            in_compiled |= _is_compiled_region(parent.name)
            under_op |= parent.name.startswith("aten::")
            parent = parent.cpu_parent
        if not in_round:
            continue
        if _is_compiled_region(name):
            counts.compiled_calls += 1
        elif not name.startswith("aten::"):
            continue
        elif in_compiled:
            counts.compiled_ops += 1
        else:
            counts.host_reads += name in HOST_READ_OPS
            if not under_op:
                counts.eager_ops += 1
                counts.eager_op_names[name] = counts.eager_op_names.get(name, 0) + 1


@contextlib.contextmanager
def count_rounds(pipe) -> Iterator[RoundCounts]:
    """Count host reads, eager ops and compiles of the rounds of ``pipe``'s calls inside the block (`RoundCounts`,
    filled when the block ends). The profiler runs while counting, so do not time calls made inside it."""
    counts = RoundCounts()
    flag = {"inside": False, "reads": 0}
    loop = pipe.loop
    run_device = loop._run_device  # the bound method; an instance attribute while counting

    def counted_device(device_loop, *args, **kwargs):
        flag["inside"] = True
        try:
            with torch.profiler.record_function(ROUND_EVENT):
                return run_device(device_loop, *args, **kwargs)
        finally:
            flag["inside"] = False
            counts.rounds += device_loop.num_rounds

    graphs = _unique_graphs()
    loop.__dict__["_run_device"] = counted_device
    try:
        with _python_reads(flag), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
            yield counts
    finally:
        loop.__dict__.pop("_run_device", None)
    counts.recompiles = _unique_graphs() - graphs
    _tally(profiler.events(), counts)
    counts.host_reads += flag["reads"]
