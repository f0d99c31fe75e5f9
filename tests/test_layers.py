"""The layers import one way: core -> cost_models -> passes -> runtime -> tools and API.

Each module is imported alone in a fresh interpreter; no module of a higher layer may
appear in sys.modules afterwards (not even through an import inside a function that
ran at import time, nor through `autopar/__init__.py`, which loads lazily).
A second check reads every import statement, including those inside functions, so a
back edge that only runs when a function is called fails here too.
"""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# module prefix -> layer rank (lower ranks never import higher ones)
LAYERS = (
    ("autopar._version", 0), ("autopar._compat", 0), ("autopar.core", 0),
    ("autopar.cost_models", 1),
    ("autopar.passes", 2),
    ("autopar.runtime", 3),
    ("autopar.tools", 4), ("autopar.api", 4), ("autopar.__main__", 4),
)
SOURCE_DIRS = {"autopar": ROOT / "autopar", "autopar.passes": ROOT / "passes",
               "autopar.cost_models": ROOT / "cost_models"}


def layer_of(module: str) -> int | None:
    for prefix, rank in LAYERS:
        if module == prefix or module.startswith(prefix + "."):
            return rank
    return None


def all_modules() -> list[str]:
    out = []
    for package, folder in SOURCE_DIRS.items():
        for f in sorted(folder.rglob("*.py")):
            rel = f.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([package, *parts])
            if layer_of(name) is not None:
                out.append(name)
    return sorted(set(out))


def test_every_module_has_a_layer():
    names = all_modules()
    assert len(names) > 40
    orphans = [f for package, folder in SOURCE_DIRS.items() for f in folder.rglob("*.py")
               if layer_of(".".join([package, *[p for p in f.relative_to(folder).with_suffix("").parts
                                                 if p != "__init__"]])) is None
               and f.name != "__init__.py"]
    assert orphans == [], f"modules outside every layer (add them to a layer folder): {orphans}"


def _loaded_after_import(modules: list[str], processes: int = 2) -> dict[str, list[str]]:
    """For each module, the autopar modules loaded by importing it alone: the modules are
    shared among `processes` fresh interpreters run at once, each clearing autopar from
    sys.modules between its modules."""
    chunks = [modules[i::processes] for i in range(processes)]
    running = [subprocess.Popen([sys.executable, "-c", _import_each(chunk)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, cwd=ROOT) for chunk in chunks if chunk]
    out: dict[str, list[str]] = {}
    for proc in running:
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr
        out.update(json.loads(stdout.strip().splitlines()[-1]))
    return out


def _import_each(modules: list[str]) -> str:
    return ("import importlib, json, sys\n"
            f"out = {{}}\n"
            f"for m in {modules!r}:\n"
            "    before = set(sys.modules)\n"
            "    importlib.import_module(m)\n"
            "    out[m] = sorted(x for x in sys.modules if x.startswith('autopar'))\n"
            "    for x in [x for x in sys.modules if x.startswith('autopar')]:\n"
            "        del sys.modules[x]\n"
            "print(json.dumps(out))\n")


@pytest.fixture(scope="module")
def loaded() -> dict[str, list[str]]:
    return _loaded_after_import(all_modules())


def test_importing_a_layer_loads_nothing_above_it(loaded):
    """A fresh interpreter imports each module in turn (sys.modules cleared of autopar
    between them): what came along must sit in the same layer or below."""
    back_edges = []
    for m in all_modules():
        own = layer_of(m)
        above = [x for x in loaded[m] if (layer_of(x) or 0) > own]
        if above:
            back_edges.append(f"{m} (layer {own}) loads {above}")
    assert back_edges == [], "\n".join(back_edges)


def test_the_planner_loads_without_torch_distributed_process_groups(loaded):
    for m in ("autopar.passes.solve.solve", "autopar.passes.lower.emit"):
        assert not any(x.startswith("autopar.runtime") for x in loaded[m]), (m, loaded[m])


def _imports(path: pathlib.Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


@pytest.mark.parametrize("module", all_modules())
def test_no_import_statement_points_up(module):
    """Also imports inside functions (which the fresh-interpreter check cannot see)."""
    package = next(p for p in sorted(SOURCE_DIRS, key=len, reverse=True) if module.startswith(p))
    rel = module[len(package):].lstrip(".").replace(".", "/")
    folder = SOURCE_DIRS[package]
    path = folder / (rel + ".py") if (folder / (rel + ".py")).exists() else folder / rel / "__init__.py"
    own = layer_of(module)
    bad = []
    for line, name in _imports(path):
        if name == "autopar":
            continue
        target = layer_of(name)
        if target is not None and target > own:
            bad.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert bad == [], "\n".join(bad)


# passes/ in the order of its stages: a module imports from its own stage or earlier ones
# passes/ is a folder per stage, in the order data flows; a module imports its own stage
# and the ones before it only
PASS_STAGES = ("trace", "rules", "strategies", "solve", "plan", "lower")
# imports a function may make: optional dependencies, and torch subsystems loaded only
# where used (version shims in _compat, checkpointing, DTensor, export's serialiser)
FUNCTION_IMPORTS_ALLOWED = (
    "transformers", "safetensors", "matplotlib",
    "pulp",  # the CBC fallback where HiGHS is missing: 0.4 s to import, so only then
    "torch",
)


def _stage_of(module: str) -> int:
    return PASS_STAGES.index(module[len("autopar.passes."):].split(".")[0])


def _pass_files() -> list[tuple[str, pathlib.Path]]:
    folder = SOURCE_DIRS["autopar.passes"]
    return [(".".join(["autopar.passes", *[p for p in f.relative_to(folder).with_suffix("").parts if p != "__init__"]]),
             f) for f in sorted(folder.rglob("*.py")) if f.relative_to(folder).as_posix() != "__init__.py"]


def test_every_pass_is_in_a_stage_folder():
    folder = SOURCE_DIRS["autopar.passes"]
    outside = [f.relative_to(folder).as_posix() for f in sorted(folder.rglob("*.py"))
               if f.relative_to(folder).parts[0] not in PASS_STAGES and f.relative_to(folder).as_posix() != "__init__.py"]
    assert outside == [], f"move these into the folder of their stage ({', '.join(PASS_STAGES)}): {outside}"
    assert sorted(p.name for p in folder.iterdir() if p.is_dir() and p.name != "__pycache__") == sorted(PASS_STAGES)


def test_passes_import_in_stage_order():
    bad = []
    for module, path in _pass_files():
        own = _stage_of(module)
        for line, name in _imports(path):
            if name.startswith("autopar.passes.") and _stage_of(name) > own:
                bad.append(f"{path.relative_to(ROOT)}:{line} ({PASS_STAGES[own]}) imports {name} "
                           f"({PASS_STAGES[_stage_of(name)]})")
    assert bad == [], "\n".join(bad)


def _function_imports(path: pathlib.Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.Import):
                    out += [(node.lineno, a.name) for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    out.append((node.lineno, node.module or "." * node.level))
    return out


def test_no_function_imports_what_the_module_could():
    """An import inside a function hides a layer's or a stage's back edge, or a cycle;
    only optional dependencies and torch's subsystems may load late."""
    bad = []
    for folder in SOURCE_DIRS.values():
        for path in sorted(folder.rglob("*.py")):
            for line, name in _function_imports(path):
                if not any(name == a or name.startswith(a + ".") for a in FUNCTION_IMPORTS_ALLOWED):
                    bad.append(f"{path.relative_to(ROOT)}:{line} imports {name} inside a function")
    assert bad == [], "\n".join(bad)


MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def test_modules_and_functions_stay_small():
    """Small modules with one job each, functions that fit on a screen (../shared/STYLE.md)."""
    big = []
    for folder in SOURCE_DIRS.values():
        for path in sorted(folder.rglob("*.py")):
            text = path.read_text()
            if len(text.splitlines()) > MAX_MODULE_LINES:
                big.append(f"{path.relative_to(ROOT)}: {len(text.splitlines())} lines (at most {MAX_MODULE_LINES})")
            for fn in ast.walk(ast.parse(text)):
                if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    length = fn.end_lineno - fn.lineno + 1
                    if length > MAX_FUNCTION_LINES:
                        big.append(f"{path.relative_to(ROOT)}:{fn.lineno} {fn.name}: {length} lines "
                                   f"(at most {MAX_FUNCTION_LINES})")
    assert big == [], "\n".join(big)
