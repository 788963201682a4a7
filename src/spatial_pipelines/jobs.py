"""Prompt-file jobs: many images from one model load, resumable, spread over processes.

    spatial-pipelines generate --prompts-file prompts.txt --out images/            # one process
    torchrun --nproc_per_node 2 -m spatial_pipelines.cli generate --prompts-file prompts.txt --out images/
    accelerate launch -m spatial_pipelines.cli generate --prompts-file prompts.jsonl --out images/

A job folder holds:

- ``job.json``: the settings every image depends on (model, decoder and its config, heads, dtype, seed, sampling,
  images per prompt, the prompt rows' digest). Running a job in a folder that holds another job's settings is refused,
  naming the first setting that differs.
- ``{row:06d}_{k}.png``: image ``k`` of prompt row ``row``, written under a temporary name and renamed when complete.
- ``manifest.jsonl``: one line per image, appended (under a file lock, so processes share it) only after its PNG is in
  place: row, prompt, seed, decoder and config, file, passes, codes per pass, seconds.
- ``summary.json``: totals when the job is complete.

Seeds: row ``i`` uses ``seed + i`` (or the row's own ``seed`` field); its image ``k`` uses that seed for ``k = 0`` and
a seed derived from ``(seed, k)`` otherwise (`image_seed`). So an image does not depend on how the rows are split
between processes or batched into calls, and a killed job run again makes exactly the images it had not recorded.
"""

import csv
import dataclasses
import hashlib
import json
import os
import time
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional, Sequence

import numpy as np

from .utils import check_writable_parent

MANIFEST = "manifest.jsonl"
SETTINGS = "job.json"
SUMMARY = "summary.json"
TMP_SUFFIX = ".tmp.png"
MAX_SEED = 2**63 - 1


@dataclasses.dataclass(frozen=True)
class PromptRow:
    """One line of a prompt file: its index in the file (0-based, blank-free), its prompt and its own seed if given."""

    index: int
    prompt: str
    seed: Optional[int] = None


def read_prompts(path: str) -> List[PromptRow]:
    """Read a prompt file: ``.txt`` (one prompt per line), ``.jsonl`` (objects with ``prompt`` and an optional int
    ``seed``) or ``.csv`` (a header with a ``prompt`` column and an optional ``seed`` column).

    Raises `ValueError` naming the file and the line for an unknown extension, an empty prompt, a line without a
    prompt, a seed that is not a non-negative int, or a file with no prompt. Nothing is skipped silently (a final
    newline is not a line).
    """
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".txt", ".jsonl", ".csv"):
        raise ValueError(f"`--prompts-file` {path!r} must end with .txt, .jsonl or .csv.")
    if not os.path.isfile(path):
        raise ValueError(f"`--prompts-file` {path!r} does not exist or is not a file.")
    with open(path, encoding="utf-8", newline="") as f:
        if ext == ".csv":
            reader = csv.DictReader(f)
            if reader.fieldnames is None or "prompt" not in reader.fieldnames:
                raise ValueError(f"`--prompts-file` {path!r}: the CSV header must have a `prompt` column, got {reader.fieldnames}.")
            raw = [(reader.line_num, dict(r)) for r in reader]
        else:
            raw = []
            for line_num, line in enumerate(f.read().splitlines(), start=1):
                if ext == ".txt":
                    raw.append((line_num, {"prompt": line}))
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"`--prompts-file` {path!r} line {line_num} is not JSON: {err}") from None
                if not isinstance(obj, dict) or "prompt" not in obj:
                    raise ValueError(f"`--prompts-file` {path!r} line {line_num} must be an object with a `prompt` field.")
                raw.append((line_num, obj))
    rows = []
    for line_num, obj in raw:
        prompt = obj["prompt"]
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(f"`--prompts-file` {path!r} line {line_num}: the prompt is empty (remove the line).")
        seed = obj.get("seed")
        if seed in ("", None):
            seed = None
        else:
            if isinstance(seed, str) and seed.strip().isdigit():
                seed = int(seed)
            if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= MAX_SEED:
                raise ValueError(f"`--prompts-file` {path!r} line {line_num}: `seed` must be an int in [0, {MAX_SEED}], got {obj.get('seed')!r}.")
        rows.append(PromptRow(len(rows), prompt, seed))
    if not rows:
        raise ValueError(f"`--prompts-file` {path!r} holds no prompt.")
    return rows


def row_seed(row: PromptRow, seed: int) -> int:
    """The seed of a row: its own, else ``seed + row.index``."""
    return row.seed if row.seed is not None else seed + row.index


def image_seed(seed: int, k: int) -> int:
    """The seed of image ``k`` of a row whose seed is ``seed``: the row's seed for ``k = 0``, else one drawn from
    ``(seed, k)`` by NumPy's `SeedSequence` (image ``k`` of row ``i`` does not repeat image 0 of row ``i + k``)."""
    if k == 0:
        return seed
    return int(np.random.SeedSequence([seed, k]).generate_state(2, np.uint64)[0] >> np.uint64(1))


def image_name(index: int, k: int) -> str:
    return f"{index:06d}_{k}.png"


def rows_digest(rows: Sequence[PromptRow]) -> str:
    """sha256 of the rows (prompts and own seeds): a job's prompt file may not change under it."""
    h = hashlib.sha256()
    for r in rows:
        h.update(json.dumps([r.index, r.prompt, r.seed]).encode())
    return h.hexdigest()


@contextmanager
def locked(path: str) -> Iterator[None]:
    """An exclusive lock on the hidden file ``.NAME.lock`` beside ``path`` (POSIX ``flock``): processes of one job append to one manifest."""
    import fcntl

    folder, name = os.path.split(path)
    with open(os.path.join(folder, f".{name}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


class JobFolder:
    """The files of one job (`job.json`, images, `manifest.jsonl`, `summary.json`) under ``folder``.

    Args:
        folder (`str`): the job's folder (made if missing).
        settings (`dict`): what every image depends on, keyed by the CLI option that sets it (``"--decoder"``, ...).
    """

    def __init__(self, folder: str, settings: Dict[str, Any]):
        self.folder = folder
        self.settings = settings
        self.manifest = os.path.join(folder, MANIFEST)

    def _error(self, what: str, err: OSError) -> ValueError:
        return ValueError(f"`--out` {self.folder!r}: could not write {what}: {err.strerror or err}. "
                          "The images and manifest lines written so far are kept; free space or fix the folder, then "
                          "run the same command again.")

    def check_writable(self) -> None:
        """Refuse a folder that cannot hold the job, before the model loads."""
        if os.path.exists(self.folder) and not os.path.isdir(self.folder):
            raise ValueError(f"`--out` {self.folder!r} is a file; a prompt-file job writes into a folder.")
        check_writable_parent(self.folder, "--out", start=self.folder)

    def open(self, overwrite: bool = False) -> None:
        """Create the folder and its ``job.json``, or check that the job already in it has the same settings (the
        first differing one is named). ``overwrite``: remove this job's files first (nothing else in the folder)."""
        try:
            os.makedirs(self.folder, exist_ok=True)
            path = os.path.join(self.folder, SETTINGS)
            if overwrite:
                self.remove_job_files()
            if os.path.exists(path):
                with open(path) as f:
                    saved = json.load(f)
                for key in sorted(set(saved) | set(self.settings)):
                    if saved.get(key) != self.settings.get(key):
                        raise ValueError(
                            f"`--out` {self.folder!r} holds a job made with other settings: `{key}` was "
                            f"{saved.get(key)!r}, now {self.settings.get(key)!r}. Use another folder, the same settings, "
                            "or `--overwrite` to start afresh.")
            else:
                tmp = path + ".tmp"
                with open(tmp, "w") as f:
                    json.dump(self.settings, f, indent=2)
                os.replace(tmp, path)
        except OSError as err:
            raise self._error("job.json", err) from None

    def remove_job_files(self) -> None:
        """Remove this library's job files from the folder: settings, manifest, summary, images the manifest or the
        naming scheme names, temporary files. Other files are left alone."""
        for name in os.listdir(self.folder):
            if (name in (SETTINGS, MANIFEST, f".{MANIFEST}.lock", SUMMARY) or name.endswith(TMP_SUFFIX)
                    or (name.endswith(".png") and name[:6].isdigit() and "_" in name)):
                os.remove(os.path.join(self.folder, name))

    def recorded(self) -> Dict[tuple, dict]:
        """The images the manifest records, keyed by ``(row, k)``. A last line cut by a kill is not a record (and is
        removed when the next line is appended)."""
        if not os.path.exists(self.manifest):
            return {}
        done = {}
        with open(self.manifest, encoding="utf-8") as f:
            for line in f:
                if not line.endswith("\n"):
                    break  # cut by a kill
                entry = json.loads(line)
                if os.path.exists(os.path.join(self.folder, entry["file"])):
                    done[(entry["row"], entry["k"])] = entry
        return done

    def count_recorded(self) -> int:
        """How many whole manifest lines there are (the progress bar's count; `recorded` also parses and checks them)."""
        if not os.path.exists(self.manifest):
            return 0
        with open(self.manifest, "rb") as f:
            return f.read().count(b"\n")

    def clean_temporary(self) -> None:
        """Remove temporary image files a killed process left (called while no process writes)."""
        for name in os.listdir(self.folder):
            if name.endswith(TMP_SUFFIX):
                os.remove(os.path.join(self.folder, name))

    def write_image(self, image, name: str, tmp_tag: str) -> None:
        """Save ``image`` as ``name``: to a temporary file first, renamed when complete (a kill leaves no partial PNG
        under a real name)."""
        final = os.path.join(self.folder, name)
        tmp = os.path.join(self.folder, f".{name}.{tmp_tag}{TMP_SUFFIX}")
        try:
            image.save(tmp, format="PNG")
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except OSError as err:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise self._error(final, err) from None

    def record(self, entries: List[dict]) -> None:
        """Append manifest lines (after their images are in place), under the lock; a line cut by an earlier kill is
        dropped first so every line stays whole."""
        text = "".join(json.dumps(e) + "\n" for e in entries)
        try:
            with locked(self.manifest):
                with open(self.manifest, "a+b") as f:
                    size = f.seek(0, os.SEEK_END)
                    if size:
                        f.seek(size - 1)
                        if f.read(1) != b"\n":  # a line cut by a kill (rare): drop it; appends go to the end
                            f.seek(0)
                            f.truncate(f.read().rfind(b"\n") + 1)
                    f.write(text.encode("utf-8"))
                    f.flush()
                    os.fsync(f.fileno())
        except OSError as err:
            raise self._error(self.manifest, err) from None

    def write_summary(self, rows: Sequence[PromptRow], images_per_prompt: int, made: int, wall_s: float) -> dict:
        """``summary.json`` from the manifest: images and rows; this run's images, wall-clock and images per second
        (all processes together); images per second of one process (over the images' own seconds); mean codes per
        pass, and the decoder's speed-up in target passes against one pass per code."""
        entries = list(self.recorded().values())
        seconds = sum(e["seconds"] for e in entries)
        summary = {
            "rows": len(rows), "images": len(entries), "complete": len(entries) == len(rows) * images_per_prompt,
            "run_images": made, "run_wall_s": wall_s, "images_per_s": made / wall_s if wall_s > 0 else None,
            "images_per_s_per_process": len(entries) / seconds if seconds else None,
            "codes_per_pass": float(np.mean([e["codes_per_pass"] for e in entries])) if entries else None,
            "passes_per_image": float(np.mean([e["passes"] for e in entries])) if entries else None,
            "pass_speedup_vs_ar": float(np.mean([e["codes"] / e["passes"] for e in entries])) if entries else None,
            "settings": self.settings,
        }
        try:
            tmp = os.path.join(self.folder, SUMMARY + ".tmp")
            with open(tmp, "w") as f:
                json.dump(summary, f, indent=2)
            os.replace(tmp, os.path.join(self.folder, SUMMARY))
        except OSError as err:
            raise self._error(SUMMARY, err) from None
        return summary


def generate_batches(pipe, rows: Sequence[PromptRow], *, seed: int, images_per_prompt: int = 1, batch_size: int = 1,
                     call_kwargs: Optional[dict] = None, skip=()) -> Iterator[tuple]:
    """The one prompt loop of jobs, `scripts/benchmark.py` and `scripts/evaluate.py`: ``rows`` in calls of
    ``batch_size`` rows, one seeded generator per image (`row_seed`, `image_seed`), images in ``skip`` (``(row, k)``
    keys) left out.

    Yields:
        ``(keys, out, seconds)`` per call: ``keys`` a list of ``(row, k, seed)`` (one per image, in the output's
        order), the pipeline's output, and the call's wall-clock seconds.
    """
    import torch

    for start in range(0, len(rows), batch_size):
        prompts, generators, keys = [], [], []
        for r in rows[start:start + batch_size]:
            for k in range(images_per_prompt):
                if (r.index, k) in skip:
                    continue
                s = image_seed(row_seed(r, seed), k)
                prompts.append(pipe.backbone.prompt_from_text(r.prompt) if isinstance(r.prompt, str) else r.prompt)
                generators.append(torch.Generator().manual_seed(s))
                keys.append((r, k, s))
        if not keys:
            continue
        t0 = time.perf_counter()
        out = pipe(prompts, num_images_per_prompt=1, generator=generators, **(call_kwargs or {}))
        yield keys, out, time.perf_counter() - t0


def run_job(pipe, rows: Sequence[PromptRow], folder: JobFolder, *, seed: int, images_per_prompt: int = 1,
            batch_size: int = 1, call_kwargs: Optional[dict] = None, state=None, progress: bool = True,
            record_extra: Optional[dict] = None) -> Optional[dict]:
    """Generate every image of ``rows`` not yet recorded in ``folder``, this process's share of them.

    Args:
        pipe: a `SpatialARPipeline` (loaded once per process).
        rows: the job's prompt rows (`read_prompts`).
        folder (`JobFolder`): opened (`JobFolder.open`).
        seed (`int`): row ``i`` uses ``seed + i`` unless it has its own.
        images_per_prompt (`int`): images per row.
        batch_size (`int`): rows per pipeline call.
        call_kwargs (`dict`): further pipeline call arguments (``guidance_scale``, ``temperature``, ...).
        state: accelerate's `PartialState` (one process when ``None``): the rows left are split between its processes.
        progress (`bool`): a progress bar over the whole job on the main process.
        record_extra (`dict`): fields added to every manifest line (the decoder's name and config).

    Returns:
        the summary (main process, when the job is complete), else ``None``.
    """
    from tqdm.auto import tqdm

    started = time.perf_counter()
    main = state is None or state.is_main_process
    done = folder.recorded()
    if main:
        folder.clean_temporary()
    if state is not None:
        state.wait_for_everyone()  # temporary files are cleaned before any process writes
    todo = [r for r in rows if any((r.index, k) not in done for k in range(images_per_prompt))]
    if state is not None:
        with state.split_between_processes(todo) as share:
            todo = list(share)
    tag = f"{os.getpid()}"
    total = len(rows) * images_per_prompt
    bar = tqdm(total=total, initial=len(done), unit="img", disable=not (progress and main), desc="images")
    for keys, out, seconds in generate_batches(pipe, todo, seed=seed, images_per_prompt=images_per_prompt,
                                               batch_size=batch_size, call_kwargs=call_kwargs, skip=done):
        passes, codes = out.stats.num_forward_passes, out.stats.num_tokens // len(keys)
        entries = []
        for (r, k, s), image in zip(keys, out.images):
            name = image_name(r.index, k)
            folder.write_image(image, name, tag)
            entries.append({"row": r.index, "k": k, "prompt": r.prompt, "seed": s, **(record_extra or {}), "file": name,
                            "passes": passes, "codes": codes, "codes_per_pass": codes / passes,
                            "seconds": seconds / len(keys)})
        folder.record(entries)
        bar.n = folder.count_recorded() if state is not None else bar.n + len(entries)  # other processes' too
        bar.refresh()
    bar.close()
    if state is not None:
        state.wait_for_everyone()
    if main:
        recorded = len(folder.recorded())
        if recorded == total:
            return folder.write_summary(rows, images_per_prompt, recorded - len(done), time.perf_counter() - started)
    return None
