"""The examples a model card or a docs page shows, checked against the library as it is: each ``python`` block's
imports from ``spatial_pipelines`` and the keyword arguments of its calls to our classes and functions, each inline
call such as ``MedusaDecoder(num_heads=4)``, and each benchmark decoder spec (``medusa:acceptance=lantern,
acceptance.delta=0.1``, in a table or a shell command) built as ``scripts/benchmark.py`` builds it. A name the library
no longer takes is a problem, named with where it was found."""

import ast
import contextlib
import inspect
import os
import re
import sys
from typing import Callable, List, Tuple

import spatial_pipelines
from spatial_pipelines.decoders import DECODERS

from .scripts import load_script

PYTHON_BLOCK = re.compile(r"```python\n(.*?)```", re.S)
SHELL_BLOCK = re.compile(r"```(?:bash|sh|console)\n(.*?)```", re.S)
INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
#: A benchmark row or argument: ``name:options``, as a row name perhaps with `` [compiled]`` or `` x4`` after it.
SPEC = re.compile(r"^(?P<name>[a-z_]+):(?P<options>\S+?)(?: \[compiled\]| x\d+)*$")


def benchmark_parse_decoder() -> Callable:
    """``scripts/benchmark.py``'s ``parse_decoder``; the environment and ``sys.path`` the import changes are put back."""
    env, path = dict(os.environ), sys.path[:]
    try:
        return load_script("benchmark.py").parse_decoder
    finally:
        os.environ.clear()
        os.environ.update(env)
        sys.path[:] = path


def _ours(obj) -> bool:
    return callable(obj) and (getattr(obj, "__module__", None) or "").startswith("spatial_pipelines")


def _target(func: ast.expr, scope: dict):
    """What a call's ``func`` names: one of our classes or functions (``Name`` or ``Class.method``), else ``None``."""
    if isinstance(func, ast.Name):
        found = scope.get(func.id, getattr(spatial_pipelines, func.id, None))
    elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        owner = scope.get(func.value.id, getattr(spatial_pipelines, func.value.id, None))
        found = getattr(owner, func.attr, None) if _ours(owner) else None
    else:
        return None
    return found if _ours(found) else None


def _calls(tree: ast.AST, scope: dict, where: str) -> Tuple[int, List[str]]:
    """How many calls to our code ``tree`` makes, and each keyword argument that their signature does not take."""
    checked, problems = 0, []
    for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
        target = _target(call.func, scope)
        if target is None:
            continue
        params = inspect.signature(target).parameters
        checked += 1
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            continue
        for keyword in call.keywords:
            if keyword.arg is not None and keyword.arg not in params:
                problems.append(f"{where}: `{ast.unparse(call)}`: {ast.unparse(call.func)} takes no `{keyword.arg}`")
    return checked, problems


def _python_block(block: str, where: str) -> Tuple[int, List[str]]:
    try:
        tree = ast.parse(block)
    except SyntaxError as error:
        return 1, [f"{where}: a python example does not parse ({error})"]
    scope, checked, problems = {}, 0, []
    for node in ast.walk(tree):
        module = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name if isinstance(node, ast.Import) else None
        if module is None or not module.startswith("spatial_pipelines"):
            continue
        checked += 1
        try:
            exec(compile(ast.Module([node], []), where, "exec"), scope)  # an import of ours: safe to run
        except ImportError as error:
            problems.append(f"{where}: `{ast.unparse(node)}`: {error}")
    more, found = _calls(tree, scope, where)
    return checked + more, problems + found


def _spec(span: str, where: str, parse_decoder: Callable) -> List[str]:
    try:
        _, cls, kwargs = parse_decoder(span.split(" ")[0])
        cls(**kwargs)
    except Exception as error:  # noqa: BLE001 - any refusal of the spec is the problem to report
        return [f"{where}: decoder spec `{span}`: {type(error).__name__}: {error}"]
    return []


def example_problems(text: str, where: str, parse_decoder: Callable) -> Tuple[int, List[str]]:
    """``(examples checked, problems)`` of a card's or page's markdown ``text``."""
    checked, problems = 0, []
    for block in PYTHON_BLOCK.findall(text):
        more, found = _python_block(block, where)
        checked, problems = checked + more, problems + found
    words = [w.strip("'\"\\") for block in SHELL_BLOCK.findall(text) for w in block.split()]
    for span in words + [s.strip() for s in INLINE.findall(text)]:
        match = SPEC.match(span)
        if match and match["name"] in DECODERS:
            checked += 1
            problems += _spec(span, where, parse_decoder)
        elif "(" in span:
            with contextlib.suppress(SyntaxError):  # prose in backticks, such as `x + SiLU(W x + b)`, is not code
                more, found = _calls(ast.parse(span, mode="eval"), {}, where)
                checked, problems = checked + more, problems + found
    return checked, problems
