"""The scripts of ``scripts/`` in the test process: run one as ``__main__`` (`run_script`), or import one to call its
functions (`load_script`).

Why: a new interpreter pays ~5 s importing torch, diffusers and transformers before the script does anything, and the
script tests start a dozen of them; the test worker has already paid it. The script still runs as ``__main__`` with its
own ``sys.argv`` (``runpy``), its exit status and its printed output come back as a ``CompletedProcess``, and the
global state a script may leave is put back afterwards: ``sys.argv``, ``sys.path``, the environment, the global RNGs
and accelerate's process-wide ``AcceleratorState``. Runs that need a process of their own (``accelerate launch``, a
fresh ``HF_HUB_OFFLINE``) still use ``subprocess``.
"""

import contextlib
import importlib.util
import io
import os
import random
import runpy
import subprocess
import sys
import traceback
from pathlib import Path

import numpy as np
import torch

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def run_script(script: str, *args, check: bool = True) -> subprocess.CompletedProcess:
    """``python scripts/<script> *args``, in this process. With ``check``, a non-zero exit or an exception fails the
    test with the script's stderr."""
    path = SCRIPTS / script
    argv = [str(path), *map(str, args)]
    out, err = io.StringIO(), io.StringIO()
    argv_before, path_before, env_before = sys.argv[:], sys.path[:], dict(os.environ)
    random_before, numpy_before, threads_before = random.getstate(), np.random.get_state(), torch.get_num_threads()
    code = 0
    with torch.random.fork_rng(devices=[]), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        sys.argv = argv
        sys.path.insert(0, str(SCRIPTS))  # what `python scripts/x.py` puts first
        try:
            runpy.run_path(str(path), run_name="__main__")
        except SystemExit as exit_:  # as the interpreter maps it: None -> 0, an int as is, anything else printed -> 1
            if exit_.code is None or isinstance(exit_.code, int):
                code = exit_.code or 0
            else:
                print(exit_.code, file=sys.stderr)
                code = 1
        except Exception:  # noqa: BLE001 - a crashing script is a non-zero exit with its traceback, as from a process
            traceback.print_exc()
            code = 1
        finally:
            sys.argv, sys.path[:] = argv_before, path_before
            os.environ.clear()
            os.environ.update(env_before)
            random.setstate(random_before)
            np.random.set_state(numpy_before)
            torch.set_num_threads(threads_before)
            _reset_accelerate()
    done = subprocess.CompletedProcess([sys.executable, *argv], code, out.getvalue(), err.getvalue())
    if check and code != 0:
        raise AssertionError(f"{script} exited with {code}:\n{done.stderr[-4000:]}")
    return done


def load_script(script: str):
    """``scripts/<script>`` imported as a module (its ``main`` is not run), to test its functions."""
    path = SCRIPTS / script
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _reset_accelerate() -> None:
    """Forget the ``AcceleratorState`` singleton a script's ``Accelerator`` created, so the next script may pick
    another precision (accelerate refuses to change an initialised state)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
