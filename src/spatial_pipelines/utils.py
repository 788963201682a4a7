"""Small helpers shared by pipelines and heads (no model code)."""

import contextlib
import math
import numbers
import os
import shutil
import tempfile
from typing import Iterable, Iterator

import torch

SAVED_MARKERS = ("model_index.json", "config.json")


def subclasses(base: type) -> list:
    """Every loaded subclass of ``base``, at any depth (``base`` excluded)."""
    found, todo = [], [base]
    while todo:
        for sub in todo.pop().__subclasses__():
            found.append(sub)
            todo.append(sub)
    return found


def find_subclass(base: type, name) -> "type | None":
    """The loaded subclass of ``base`` (or ``base`` itself) called ``name``, or ``None``."""
    return next((c for c in [base, *subclasses(base)] if c.__name__ == name), None)


def check_number(name: str, value, low: float = None, high: float = None, *, low_open: bool = False,
                 integer: bool = False, optional: bool = False, meaning: str = "") -> None:
    """Raise `ValueError` naming ``name`` unless ``value`` is a real number (``bool`` is not one here), finite, an int
    when ``integer``, and within ``[low, high]`` (``(low, high]`` with ``low_open``); ``None`` passes when ``optional``.
    ``meaning`` ends the message (e.g. ``"0 is greedy"``)."""
    if value is None and optional:
        return
    kind = "an int" if integer else "a finite number"
    bounds = ""
    if low is not None and high is not None:
        bounds = f" in {'(' if low_open else '['}{low}, {high}]"
    elif low is not None:
        bounds = f" {'>' if low_open else '>='} {low}"
    elif high is not None:
        bounds = f" <= {high}"
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if ok and integer:
        ok = isinstance(value, numbers.Integral)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value <= high
    if not ok:
        tail = f" ({meaning})" if meaning else ""
        raise ValueError(f"`{name}` must be {'None or ' if optional else ''}{kind}{bounds}{tail}, got {value!r}.")


@contextlib.contextmanager
def atomic_directory(save_directory: str, markers: Iterable[str] = SAVED_MARKERS) -> Iterator[str]:
    """Write a folder all at once: yields a temporary sibling folder, then swaps it into place.

    If the body raises, ``save_directory`` is left exactly as it was (absent, or the previous save), so a failed
    save never leaves a half-written folder that loads. An existing non-empty folder is replaced only when it
    holds a previous save (one of ``markers``); any other non-empty folder raises `ValueError`, so unrelated
    files are never mixed with, or lost to, a save.
    """
    save_directory = os.path.abspath(os.fspath(save_directory))
    if os.path.isfile(save_directory):
        raise ValueError(f"`save_directory` {save_directory!r} is a file; pass a folder path.")
    if os.path.isdir(save_directory) and os.listdir(save_directory):
        if not any(os.path.exists(os.path.join(save_directory, m)) for m in markers):
            raise ValueError(
                f"`save_directory` {save_directory!r} is not empty and holds no previous save ({', '.join(markers)}); "
                "choose an empty or new folder so its files are neither mixed with nor replaced by this save."
            )
    parent = os.path.dirname(save_directory)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(save_directory)}.tmp-", dir=parent)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if os.path.exists(save_directory):
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(save_directory)}.old-", dir=parent)
        os.rmdir(old)
        os.rename(save_directory, old)
    os.rename(tmp, save_directory)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


class RoundTimer:
    """Wall-clock seconds spent in each named section of the generation loop, summed over rounds.

    The loop calls ``timer.section(name)`` around each part of a round; `SpatialARPipeline.profile_rounds`
    installs one. Without a timer the loop uses `NULL_TIMER`, whose sections cost one attribute lookup.

    Args:
        synchronize (`Callable`, *optional*): called before each reading of the clock (e.g.
            ``torch.cuda.synchronize`` on a GPU, where work is asynchronous); CPU work needs none.
    """

    def __init__(self, synchronize=None):
        import time

        self._clock = time.perf_counter
        self._sync = synchronize
        self.seconds = {}
        self.rounds = 0

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        if self._sync is not None:
            self._sync()
        start = self._clock()
        try:
            yield
        finally:
            if self._sync is not None:
                self._sync()
            self.seconds[name] = self.seconds.get(name, 0.0) + self._clock() - start


class _NullTimer:
    _null = contextlib.nullcontext()
    rounds = 0

    def section(self, name: str):
        return self._null


NULL_TIMER = _NullTimer()


def check_safe_serialization(safe_serialization) -> None:
    """Raise `ValueError` unless ``safe_serialization`` is true: weights are written as safetensors only, so a folder
    this library saves never holds a pickle that loading would have to execute."""
    if safe_serialization is not True:
        raise ValueError(f"`safe_serialization` must be True, got {safe_serialization!r}: spatial_pipelines saves weights as "
                         "safetensors only and never writes or loads pickles.")


def check_safetensors_file(path: str, what: str = "weights") -> None:
    """Raise `ValueError` naming ``path`` if it is not a whole safetensors file (truncated, corrupt, not safetensors);
    reads the header only."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt") as f:
            f.keys()
    except (SafetensorError, OSError) as err:
        raise ValueError(f"The {what} file {path!r} is truncated or corrupt ({err}); download or save it again.") from err


def check_weights_folder(folder: str, what: str) -> None:
    """For a local folder: every ``*.safetensors`` file in it (and its subfolders) must be whole (`check_safetensors_file`)."""
    for root, _, files in os.walk(folder):
        for name in sorted(files):
            if name.endswith(".safetensors"):
                check_safetensors_file(os.path.join(root, name), what)


def check_writable_parent(path: str, name: str, start: str) -> None:
    """Raise `ValueError` naming ``name`` (given as ``path``) unless the nearest existing path at or above ``start`` is
    a folder this process may write in (what is missing below it can be made)."""
    parent = os.path.abspath(start)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ValueError(f"`{name}` {path!r} lies under {parent!r}, which is a file, not a folder.")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"`{name}` {path!r}: the folder {parent!r} is not writable by this user.")


def check_path_or_repo_id(value, name: str) -> None:
    """Raise `ValueError` naming ``name`` unless ``value`` is an existing local path or could be a Hub repo id
    (``"name"`` or ``"org/name"``): a mistyped local path is reported as such, not as a network error."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not isinstance(value, (str, os.PathLike)):
        raise ValueError(f"`{name}` must be a folder path or a Hub repo id, got {value!r}.")
    value = os.fspath(value)
    if os.path.exists(value):
        return
    try:
        validate_repo_id(value)
    except HFValidationError:
        raise ValueError(f"`{name}` {value!r} is not an existing folder (and not a Hub repo id like 'org/name').") from None


def compute_dtype(module: torch.nn.Module) -> torch.dtype:
    """The dtype ``module`` computes in: the ``compute_dtype`` of diffusers' layerwise casting when it stores its weights
    in another dtype (``enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=...)``), else its
    parameters' dtype."""
    for sub in module.modules():
        registry = getattr(sub, "_diffusers_hook", None)
        hook = registry.get_hook("layerwise_casting") if registry is not None else None
        if hook is not None:
            return hook.compute_dtype
    return next(module.parameters()).dtype
