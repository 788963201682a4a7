"""The code's shape, checked on every run:

- small functions: no function in ``src/`` or ``scripts/`` is longer than `MAX_LINES` (its docstring and nested
  functions counted), so each reads as the numbered steps of what it does. The allowlist names the few that are not
  split yet; an entry that no longer exists, or is no longer over the limit, fails too, so the list cannot go stale;
- small files: no module of the package is longer than `MAX_FILE_LINES`;
- a house without circles: no module of the package imports, through any chain of imports, itself;
- layers: nothing in ``core/``, ``decoders/`` or ``heads/`` imports ``pipelines/``, and nothing in ``core/`` imports
  ``decoders/`` or ``heads/``.

Imports are read from the source as written (`import_graph`): every ``import`` and ``from ... import`` statement,
wherever it stands (a function-level import, or one under ``if TYPE_CHECKING:``, is as much a dependency as one at the
top), and a package ``__init__`` that imports its ``<prefix>*`` modules by name (`spatial_pipelines.utils.import_modules`)
imports each of them."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("src", "scripts")
MAX_LINES = 60
SRC = ROOT / "src"
PACKAGE = "spatial_pipelines"
MAX_FILE_LINES = 600

# (file, qualified name) -> why it is still long
ALLOWED = {}  # none today

#: (importer, imported) -> why the import is still there: an import cycle through it is not reported; an entry that is
#: no longer an import fails (`test_the_import_allowances_are_not_stale`)
ALLOWED_IMPORTS = {}

#: ``{subpackage: subpackages it must not import}`` (a function-level import counts)
LOWER_LAYERS = {
    "core": ("decoders", "heads", "pipelines"),
    "decoders": ("pipelines",),
    "heads": ("pipelines",),
}


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


# -- files and imports --------------------------------------------------------------------------------------------
def package_modules(src: Path = SRC):
    """``{dotted module name: file}`` of every module of the package (a package is its ``__init__.py``)."""
    modules = {}
    for file in sorted((src / PACKAGE).rglob("*.py")):
        parts = list(file.relative_to(src).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = file
    return modules


def _imported(node, name: str, is_package: bool, modules) -> set:
    """The package modules one import statement (or `import_modules` call) of module ``name`` names."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names}
    if isinstance(node, ast.ImportFrom):
        if node.level:
            base = name.split(".") if is_package else name.split(".")[:-1]
            base = base[: len(base) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        # `from package import module` imports that module; `from module import name` the module
        return {f"{target}.{alias.name}" if f"{target}.{alias.name}" in modules else target for alias in node.names}
    if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "import_modules" and is_package
            and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)):
        prefix = f"{name}.{node.args[1].value}"
        return {m for m in modules if m.startswith(prefix) and "." not in m[len(name) + 1:]}
    return set()


def import_graph(src: Path = SRC):
    """``{module: {package modules it imports}}`` for every module of the package (the module docstring says which
    imports are read)."""
    modules = package_modules(src)
    graph = {}
    for name, file in modules.items():
        tree = ast.parse(file.read_text(encoding="utf-8"))
        targets = set()
        for node in ast.walk(tree):
            targets |= _imported(node, name, file.name == "__init__.py", modules)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def import_cycles(graph):
    """The strongly connected components of more than one module (each one at least one import cycle), sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def upward_imports(graph):
    """``importer -> imported`` for every import of a higher layer by a lower one (`LOWER_LAYERS`)."""
    found = []
    for name, targets in sorted(graph.items()):
        parts = name.split(".")
        lower = LOWER_LAYERS.get(parts[1]) if len(parts) > 1 else None
        for target in sorted(targets):
            layer = target.split(".")[1] if target.count(".") else None
            if lower and layer in lower:
                found.append(f"{name} -> {target}")
    return found


def test_no_file_is_over_the_limit():
    lengths = {file.relative_to(ROOT).as_posix(): len(file.read_text(encoding="utf-8").splitlines())
               for file in package_modules().values()}
    assert len(lengths) > 50  # the walk found the package
    long = sorted(f"{path} ({n} lines)" for path, n in lengths.items() if n > MAX_FILE_LINES)
    assert not long, f"modules over {MAX_FILE_LINES} lines (split them along what they do): {long}"


def test_no_import_cycle():
    graph = import_graph()
    assert sum(map(len, graph.values())) > 100  # the walk read the imports
    graph = {name: targets - {b for a, b in ALLOWED_IMPORTS if a == name} for name, targets in graph.items()}
    cycles = import_cycles(graph)
    described = [" <-> ".join(cycle) + ": " + "; ".join(f"{a} -> {sorted(b for b in graph[a] if b in cycle)}" for a in cycle)
                 for cycle in cycles]
    assert not cycles, "modules that import each other (through a chain of imports; move the shared thing down, or " \
                       f"pass it in):\n" + "\n".join(described)


def test_the_import_allowances_are_not_stale():
    graph = import_graph()
    gone = [f"{a} -> {b}" for a, b in ALLOWED_IMPORTS if b not in graph.get(a, ())]
    assert not gone, f"allowed imports that are gone (drop them from ALLOWED_IMPORTS): {gone}"


def test_lower_layers_do_not_import_higher_ones():
    upward = upward_imports(import_graph())
    assert not upward, f"imports of a higher layer by a lower one (move the shared thing down): {upward}"


def test_the_graph_reads_lazy_typing_and_named_imports(tmp_path):
    """The reader sees an import inside a function and under ``TYPE_CHECKING``, and a package's `import_modules`."""
    package = tmp_path / PACKAGE
    (package / "low").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "low" / "__init__.py").write_text("from ..utils import import_modules\nimport_modules(globals(), 'mod_', None)\n")
    (package / "low" / "mod_a.py").write_text("def f():\n    from ..high import thing\n")
    (package / "low" / "other.py").write_text("")
    (package / "high.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import low\n")
    (package / "utils.py").write_text("")
    graph = import_graph(tmp_path)
    assert graph[f"{PACKAGE}.low"] == {f"{PACKAGE}.utils", f"{PACKAGE}.low.mod_a"}
    assert graph[f"{PACKAGE}.low.mod_a"] == {f"{PACKAGE}.high"}
    assert import_cycles(graph) == [sorted([f"{PACKAGE}.high", f"{PACKAGE}.low", f"{PACKAGE}.low.mod_a"])]
