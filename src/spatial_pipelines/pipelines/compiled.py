"""What compiled code needs around it: running a compiled module eagerly for a pass whose shape varies, whether it
replays CUDA graphs, and telling CUDA graphs which tensors keep their address. Used by the static-shape rounds
(`static_shapes`), the device rounds (`device_loop`) and the pass-cost measurements (`pass_cost`)."""

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def eager_target(module: torch.nn.Module) -> Iterator[None]:
    """Run ``module`` eagerly inside the block even when ``nn.Module.compile`` compiled it (passes whose shapes vary
    by design: the prefill, the start-up cost measurements)."""
    compiled = getattr(module, "_compiled_call_impl", None)
    module._compiled_call_impl = None
    try:
        yield
    finally:
        module._compiled_call_impl = compiled


def uses_cuda_graphs(module: torch.nn.Module, device: torch.device) -> bool:
    """Whether ``module`` was compiled with CUDA graphs (``mode="reduce-overhead"``) for ``device``."""
    return device.type == "cuda" and getattr(module, "_spatial_compile_mode", None) in ("reduce-overhead", "max-autotune")


def mark_static_cache(cache, enabled: bool) -> None:
    """Tell CUDA graphs the cache's tensors keep their address between replays (they are written in place every
    round, so a graph must not copy them in as fresh inputs). Once per cache; a no-op unless ``enabled``."""
    if not enabled or getattr(cache, "_marked_static", False):
        return
    torch._dynamo.mark_static_address(cache.storage)
    torch._dynamo.mark_static_address(cache.key_valid)
    cache._marked_static = True
