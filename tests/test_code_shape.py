"""Small functions: no function in ``src/`` or ``scripts/`` is longer than `MAX_LINES` (its docstring and nested
functions counted), so each reads as the numbered steps of what it does. The allowlist names the few that are not
split yet; an entry that no longer exists, or is no longer over the limit, fails too, so the list cannot go stale."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("src", "scripts")
MAX_LINES = 60

# (file, qualified name) -> why it is still long
ALLOWED = {}  # none today


def function_lengths():
    """``{(file, qualified name): lines}`` of every function and method under `FOLDERS`."""
    lengths = {}

    def visit(node, prefix, path):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    lengths[(path, name)] = child.end_lineno - child.lineno + 1
                visit(child, f"{name}.", path)
            else:
                visit(child, prefix, path)

    for folder in FOLDERS:
        for file in sorted((ROOT / folder).rglob("*.py")):
            visit(ast.parse(file.read_text(encoding="utf-8")), "", file.relative_to(ROOT).as_posix())
    return lengths


def test_no_function_is_over_the_limit():
    lengths = function_lengths()
    assert len(lengths) > 100  # the walk found the package and the scripts
    long = {f"{path}::{name} ({n} lines)" for (path, name), n in lengths.items() if n > MAX_LINES and (path, name) not in ALLOWED}
    assert not long, f"functions over {MAX_LINES} lines (split them into the steps they take): {sorted(long)}"


def test_the_allowlist_is_not_stale():
    lengths = function_lengths()
    gone = [f"{path}::{name}" for path, name in ALLOWED if (path, name) not in lengths]
    assert not gone, f"allowed long functions that no longer exist (drop them from ALLOWED): {gone}"
    short = [f"{path}::{name}" for path, name in ALLOWED if lengths[(path, name)] <= MAX_LINES]
    assert not short, f"allowed long functions now within {MAX_LINES} lines (drop them from ALLOWED): {short}"
