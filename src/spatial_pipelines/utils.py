"""Small helpers shared by pipelines and heads (no model code)."""

import contextlib
import json
import math
import numbers
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from typing import Callable, Dict, Iterable, Iterator, Optional

import torch

#: The package's name: the library diffusers records its components under (``["spatial_pipelines", "<Name>"]``).
LIBRARY = "spatial_pipelines"
SAVED_MARKERS = ("model_index.json", "config.json")


def tensor_stamp(t: torch.Tensor) -> tuple:
    """What tells that a tensor's values may have changed without reading them: its version counter (in-place
    writes) and its storage address (``.to()`` and ``.data =`` give the same parameter new storage, keeping the
    counter). Caches of values derived from weights (packed, stacked, frozen into a graph) compare stamps."""
    return t._version, t.data_ptr()


def subclasses(base: type) -> list:
    """Every loaded subclass of ``base``, at any depth (``base`` excluded)."""
    found, todo = [], [base]
    while todo:
        for sub in todo.pop().__subclasses__():
            found.append(sub)
            todo.append(sub)
    return found


class DerivedMapping(Mapping):
    """A read-only mapping computed again at every access from ``derive()`` (a registry read off the loaded classes):
    a class defined after import, in a user's file or a test module, is in it as soon as it is defined."""

    def __init__(self, derive: Callable[[], Dict], doc: str = ""):
        self._derive = derive
        self.__doc__ = doc or derive.__doc__

    def __getitem__(self, key):
        return self._derive()[key]

    def __iter__(self):
        return iter(self._derive())

    def __len__(self) -> int:
        return len(self._derive())

    def __repr__(self) -> str:
        return repr(self._derive())


def import_modules(package: dict, prefix: str, defines: Callable[[type], bool]) -> list:
    """Import every module of a package (``package``: its ``globals()``) whose name starts with ``prefix``, bind what
    each exports in the package and return those names: the module's ``__all__``, or where it has none, the classes it
    defines for which ``defines(cls)`` holds. A new file is then a new export, with no list to edit."""
    import importlib
    import pkgutil

    names = []
    for info in pkgutil.iter_modules(package["__path__"]):
        if not info.name.startswith(prefix):
            continue
        module = importlib.import_module(f"{package['__name__']}.{info.name}")
        own = getattr(module, "__all__", None)
        if own is None:
            own = [name for name, value in vars(module).items()
                   if isinstance(value, type) and value.__module__ == module.__name__ and defines(value)]
        for name in own:
            package[name] = getattr(module, name)
        names += [name for name in own if name not in names]
    return names


def package_file(module: str, *parts: str, hint: str) -> str:
    """The path ``parts`` inside the installed package ``module``, found without importing it; `ImportError` with the
    install command ``hint`` when it is missing."""
    import importlib.util

    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"The optional package `{module}` is missing; install it with: {hint}")
    return os.path.join(list(spec.submodule_search_locations)[0], *parts)


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


def check_choice(name: str, value, choices) -> None:
    """Raise `ValueError` naming ``name`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"`{name}` must be one of {choices}, got {value!r}.")


@contextlib.contextmanager
def atomic_directory(save_directory: str, markers: Iterable[str] = SAVED_MARKERS) -> Iterator[str]:
    """Write a folder all at once: yields a temporary sibling folder, then swaps it into place.

    If the body raises, ``save_directory`` is left exactly as it was (absent, or the previous save), so a failed
    save never leaves a half-written folder that loads. An existing non-empty folder is replaced only when it
    holds a previous save (one of ``markers``); any other non-empty folder raises `ValueError`, so unrelated
    files are never mixed with, or lost to, a save.
    """
    save_directory = check_save_directory(save_directory)
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


#: How deep a JSON file this library reads may nest (its configs nest a few levels; Python's parser overflows the stack
#: near 1,000). Deeper files are refused before they are parsed.
MAX_JSON_DEPTH = 64
#: Pickle and torch.save formats: never loaded. A file of these names in a weights folder is named, not read.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_JSON_BRACKET = re.compile(r"[\[\]{}]")


def json_depth(text: str) -> int:
    """How deep ``text`` (JSON) nests objects and arrays, counted without parsing it (no recursion)."""
    depth = deepest = 0
    for match in _JSON_BRACKET.finditer(_JSON_STRING.sub("", text)):
        if match.group() in "[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


def read_json_file(path: str, what: str = "config", json_object: bool = False):
    """The JSON in ``path``, after checking it is readable UTF-8 JSON that nests at most `MAX_JSON_DEPTH` levels (and
    with ``json_object``, that it is an object); anything else is a `ValueError` naming the file (never a
    `RecursionError` or `UnicodeDecodeError`)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as err:
        raise ValueError(f"The {what} file {path!r} is not UTF-8 text ({err.reason} at byte {err.start}).") from None
    check_json_text(text, path, what)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"The {what} file {path!r} is not valid JSON: {err}.") from None
    if json_object and not isinstance(value, dict):
        raise ValueError(f"{path!r} must hold a JSON object, got {type(value).__name__}.")
    return value


def check_json_text(text: str, path: str, what: str = "config") -> None:
    """Raise `ValueError` naming ``path`` when the JSON ``text`` nests deeper than `MAX_JSON_DEPTH`."""
    depth = json_depth(text)
    if depth > MAX_JSON_DEPTH:
        raise ValueError(f"The {what} file {path!r} nests {depth} levels deep; at most {MAX_JSON_DEPTH} are read (a config "
                         "nests a few): it is not a config this library wrote.")


def _is_pickle(head: bytes) -> bool:
    """Whether a file starting with ``head`` (its first 9 bytes) is a pickle (protocol 2+) or a torch.save zip archive
    rather than safetensors (whose 9th byte opens its JSON header)."""
    pickled = head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05")
    return head[8:9] != b"{" and (pickled or head[:4] == b"PK\x03\x04")


def safetensors_header(path: str, what: str = "weights") -> dict:
    """The header of the safetensors file ``path`` (tensor name -> dtype, shape, data_offsets; ``__metadata__``),
    read without reading any tensor, after checking the file is whole.

    Raises `ValueError` naming the file and why: a pickle or torch.save archive (pickles are refused here: loading one
    can run code), a file too short for its own header (truncated), a header that is not safetensors JSON, or tensor
    data that ends past the end of the file (truncated).
    """
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(9)
            if _is_pickle(head):
                raise ValueError(f"The {what} file {path!r} is a pickle (torch.save format), not safetensors: pickles are "
                                 "refused here, because loading one can run any code. Convert it to safetensors where "
                                 "you trust it (`safetensors.torch.save_file(torch.load(f, weights_only=True), ...)`).")
            if len(head) < 9:
                raise ValueError(f"The {what} file {path!r} is truncated or corrupt: {size} bytes, too short for a "
                                 "safetensors header; download or save it again.")
            length = int.from_bytes(head[:8], "little")
            if length > min(size - 8, 100 * 2**20):
                raise ValueError(f"The {what} file {path!r} is truncated or corrupt: its header claims {length} bytes but "
                                 f"the file holds {size}{' (it is not a safetensors file)' if length > 100 * 2**20 else ''}; "
                                 "download or save it again.")
            raw = head[8:] + f.read(length - 1) if length >= 1 else b""
    except OSError as err:
        raise ValueError(f"The {what} file {path!r} cannot be read: {err}.") from err
    try:
        text = raw.decode("utf-8")
        check_json_text(text, path, what)
        header = json.loads(text)
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
        end = 0
        for name, info in header.items():
            if name == "__metadata__":
                continue
            _, stop = info["data_offsets"]
            if not (isinstance(info["shape"], list) and all(isinstance(d, int) and d >= 0 for d in info["shape"])):
                raise ValueError(f"tensor {name!r} has the shape {info['shape']!r}")
            end = max(end, int(stop))
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        raise ValueError(f"The {what} file {path!r} is truncated or corrupt: its header is not a safetensors header "
                         f"({err}); download or save it again.") from None
    if 8 + length + end > size:
        raise ValueError(f"The {what} file {path!r} is truncated or corrupt: it holds {size} bytes but its header lists "
                         f"tensors up to byte {8 + length + end} (the file was cut short); download or save it again.")
    return header


def check_weights_folder(folder: str, what: str) -> None:
    """For a local folder: every ``*.safetensors`` file in it (and its subfolders) must be whole
    (`safetensors_header`)."""
    for root, _, files in os.walk(folder):
        for name in sorted(files):
            if name.endswith(".safetensors"):
                safetensors_header(os.path.join(root, name), what)


#: Metadata key of a safetensors file where a model records the facts it was trained with (a JSON object): a config
#: edited past them (a larger grid) is refused when the folder loads.
SAVED_FACTS_KEY = "spatial_pipelines.trained"


def stamp_safetensors_metadata(path: str, metadata: dict) -> None:
    """Add ``metadata`` (str -> str) to the header of the safetensors file ``path``; the tensor bytes are copied as
    they are (no tensor is read into memory)."""
    header = safetensors_header(path)
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        f.seek(8 + length)
        header["__metadata__"] = {**(header.get("__metadata__") or {}), **metadata}
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)  # safetensors aligns the data to 8 bytes
        tmp = path + ".tmp"
        with open(tmp, "wb") as out:
            out.write(len(raw).to_bytes(8, "little"))
            out.write(raw)
            shutil.copyfileobj(f, out, 16 * 2**20)
    os.replace(tmp, path)


class CheckedSaveMixin:
    """For model classes: ``save_pretrained`` onto a file is a `ValueError` naming the path (diffusers logs and writes
    nothing), and the config values named in ``trained_facts`` are recorded in the weights' metadata
    (`SAVED_FACTS_KEY`), so a folder whose config is later edited past them is refused when it loads."""

    trained_facts: tuple = ()

    def save_pretrained(self, save_directory, is_main_process: bool = True, save_function=None,
                        safe_serialization: bool = True, variant=None, max_shard_size="10GB", push_to_hub: bool = False,
                        **kwargs):
        # the arguments diffusers' pipeline save looks for in the signature (`variant`, ...) are named here
        path = check_save_directory(save_directory)
        out = super().save_pretrained(save_directory, is_main_process=is_main_process, save_function=save_function,
                                      safe_serialization=safe_serialization, variant=variant,
                                      max_shard_size=max_shard_size, push_to_hub=push_to_hub, **kwargs)
        if self.trained_facts and os.path.isdir(path):
            facts = json.dumps({k: self.config[k] for k in self.trained_facts})
            for name in sorted(os.listdir(path)):
                if name.endswith(".safetensors"):
                    stamp_safetensors_metadata(os.path.join(path, name), {SAVED_FACTS_KEY: facts})
        return out


def check_save_directory(save_directory, name: str = "save_directory") -> str:
    """``save_directory`` as a path, after checking it can be a folder: a `ValueError` naming it when it is an existing
    file, or lies under one (diffusers would raise an `AssertionError` or log and write nothing)."""
    if not isinstance(save_directory, (str, os.PathLike)) or not os.fspath(save_directory):
        raise ValueError(f"`{name}` must be a folder path, got {save_directory!r}.")
    path = os.path.abspath(os.fspath(save_directory))
    if os.path.isfile(path):
        raise ValueError(f"`{name}` {path!r} is a file; pass a folder path.")
    parent = os.path.dirname(path)
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if parent and not os.path.isdir(parent):
        raise ValueError(f"`{name}` {path!r} lies under {parent!r}, which is a file, not a folder.")
    return path


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
    try:  # and a real write: `os.access` lets root through a read-only mount or /proc
        os.rmdir(tempfile.mkdtemp(prefix=".write-check-", dir=parent))
    except OSError as err:
        raise ValueError(f"`{name}` {path!r}: nothing can be written in the folder {parent!r} "
                         f"({err.strerror or err}).") from None


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


def available_memory(device: torch.device) -> Optional[int]:
    """Free bytes on ``device``: CUDA's free memory, or the host's available memory for ``cpu`` (Linux
    ``MemAvailable``, else ``os.sysconf``); ``None`` where it cannot be read."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
