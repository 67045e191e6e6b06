"""The package layers hold (docs/layout.md): read with `ast` from the product sources, so every import counts, at
module level, inside a function or under `TYPE_CHECKING`.

    core.compat <- data <- core.recipe <- core.models, core.launch, core.report <- core.engine <- core.export
        <- pretrain, finetune <- core.entry

A package imports only packages of lower layers (LAYERS), never one of its own layer or above. Beside that:
core.compat imports nothing of ours outside itself; data imports only core.compat; core imports no stage but in
core.entry (the `mimpipe` command, launch.sh's check and the stages' `python -m` start, above the stages), which
nothing imports but a stage's `__main__` (the process's entry point, of core.entry's layer); the recipe schema
imports no model code (nor timm, whose package import loads all its models); only core.compat and core.engine import
deepspeed; no module outside core.compat imports a module it names at run time (`importlib.import_module`), which this
graph could not follow. No two modules import each other, directly or through others.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from timm.data.constants import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

from core.recipe.config import IMAGENET_MEAN, IMAGENET_STD

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("core", "data", "pretrain", "finetune")
DYNAMIC = "<a module named at run time>"
STAGES = ("pretrain", "finetune")
# Bottom first. A module of our packages imports, outside its own package, only modules of a lower layer.
LAYERS = (
    ("core.compat",),
    ("data",),
    ("core.recipe",),
    ("core.models", "core.launch", "core.report"),
    ("core.engine",),
    ("core.export",),
    STAGES,
    ("core.entry",),
)
LEVEL = {package: level for level, packages in enumerate(LAYERS) for package in packages}


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def product_modules(root: Path = ROOT) -> dict[str, Path]:
    return {module_name(p, root): p for package in PACKAGES for p in sorted((root / package).rglob("*.py"))}


def imported(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """Every module `path` imports: ours resolved to the module file (`from core.engine import preempt` is
    core.engine.preempt), others by their top-level name (deepspeed, timm)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base]).strip(".")
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module":
            constant = node.args and isinstance(node.args[0], ast.Constant)
            found.add(node.args[0].value if constant else DYNAMIC)
    return {m if m in modules or m.split(".")[0] in PACKAGES or m == DYNAMIC else m.split(".")[0] for m in found}


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    modules = product_modules(root)
    return {name: imported(path, name, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in graph:
                continue
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while (top := stack.pop()) != node:
                component.append(top)
            component.append(node)
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def in_package(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def breaches(graph: dict[str, set[str]]) -> list[str]:
    """Every import against the layer rule, as `importer -> imported (rule)`."""
    out = []
    for importer, targets in sorted(graph.items()):
        for target in sorted(targets):
            top = target.split(".")[0]
            if in_package(importer, "core.compat") and top in PACKAGES and not in_package(target, "core.compat"):
                out.append(f"{importer} -> {target} (core.compat imports nothing of ours)")
            elif in_package(importer, "data") and top in PACKAGES and not in_package(target, "core.compat"):
                if not in_package(target, "data"):
                    out.append(f"{importer} -> {target} (data imports only core.compat of ours)")
            elif (
                in_package(importer, "core")
                and top in ("pretrain", "finetune")
                and not in_package(importer, "core.entry")
            ):
                out.append(f"{importer} -> {target} (core imports no stage)")
            elif in_package(target, "core.entry") and package_of(importer) != "core.entry":
                out.append(f"{importer} -> {target} (nothing imports core.entry, the top)")
            if in_package(importer, "core.recipe") and (in_package(target, "core.models") or top == "timm"):
                out.append(f"{importer} -> {target} (the recipe schema imports no model code)")
            if target == DYNAMIC and not in_package(importer, "core.compat"):
                out.append(f"{importer} -> {target} (imports are written out, so that this graph sees them)")
            if top == "deepspeed" and not (in_package(importer, "core.compat") or in_package(importer, "core.engine")):
                out.append(f"{importer} -> {target} (only core.compat and core.engine import deepspeed)")
    return out


def package_of(module: str) -> str | None:
    """The LAYERS package `module` belongs to; None for a module of no layer (core/__init__.py, not ours). A stage's
    `__main__` (`python -m pretrain`), which nothing imports, is an entry point: of core.entry's layer."""
    parts = module.split(".")
    if parts[0] in STAGES and parts[-1] == "__main__":
        return "core.entry"
    return next((p for p in (".".join(parts[:2]), parts[0]) if p in LEVEL), None)


def layer_breaches(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a package of the same layer or a higher one, as `importer -> imported (why)`."""
    out = []
    for importer, targets in sorted(graph.items()):
        mine = package_of(importer)
        for target in sorted(targets):
            theirs = package_of(target)
            if mine and theirs and mine != theirs and LEVEL[theirs] >= LEVEL[mine]:
                out.append(f"{importer} -> {target} ({theirs} is not below {mine})")
    return out


def test_every_product_module_has_a_layer():
    assert [module for module in product_modules() if module != "core" and package_of(module) is None] == []


def test_packages_import_only_lower_layers():
    assert layer_breaches(import_graph()) == []


def test_a_layer_breach_is_found():
    graph = {
        "core.engine.gather": {"core.export.folder", "core.engine.fp16", "core.recipe.config", "torch"},
        "core.launch.preflight": {"core.report.logging"},
        "core.export.read": {"finetune.best"},
    }
    assert layer_breaches(graph) == [
        "core.engine.gather -> core.export.folder (core.export is not below core.engine)",
        "core.export.read -> finetune.best (finetune is not below core.export)",
        "core.launch.preflight -> core.report.logging (core.report is not below core.launch)",
    ]


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def test_layer_rule_holds():
    assert breaches(import_graph()) == []


def test_the_graph_sees_every_kind_of_import(tmp_path):
    """The checks bite: a cycle through a function-level import, a data -> engine import, a stage imported by core
    outside core.entry and a deepspeed import in a stage are all found in a small tree."""
    sources = {
        "core/__init__.py": "",
        "core/engine/__init__.py": "",
        "core/engine/loop.py": "from core.engine import meter\n",
        "core/engine/meter.py": "def f():\n    from core.engine.loop import g\n",
        "data/__init__.py": "",
        "data/pipeline.py": "from core.engine.loop import g\n",
        "core/engine/plan.py": "import importlib\n\ndef f(stage):\n    importlib.import_module(f'{stage}.preflight')\n",
        "pretrain/__init__.py": "",
        "pretrain/export.py": "def f():\n    import deepspeed.utils\n",
        "finetune/__init__.py": "",
        "finetune/preflight.py": "",
        "core/launch/rundir.py": "from finetune import preflight\n",
        "core/entry/__init__.py": "",
        "core/entry/launch_check.py": "def f():\n    from finetune import preflight\n",
    }
    for rel, text in sources.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    graph = import_graph(tmp_path)
    assert cycles(graph) == [["core.engine.loop", "core.engine.meter"]]
    assert breaches(graph) == [
        f"core.engine.plan -> {DYNAMIC} (imports are written out, so that this graph sees them)",
        "core.launch.rundir -> finetune.preflight (core imports no stage)",
        "data.pipeline -> core.engine.loop (data imports only core.compat of ours)",
        "pretrain.export -> deepspeed (only core.compat and core.engine import deepspeed)",
    ]


@pytest.mark.parametrize(
    ("ours", "timms"), [(IMAGENET_MEAN, IMAGENET_DEFAULT_MEAN), (IMAGENET_STD, IMAGENET_DEFAULT_STD)]
)
def test_schema_imagenet_statistics_are_timms(ours, timms):
    """The schema writes timm's ImageNet mean and std out (importing timm would load its models with every recipe)."""
    assert ours == timms


def test_pyproject_installs_every_product_package():
    """An installed (or editable) mimpipe holds every package of the tree: each folder of ours is a package with an
    __init__.py, and pyproject lists them all by name."""
    folders = [
        d for p in PACKAGES for d in [ROOT / p, *(ROOT / p).rglob("*")] if d.is_dir() and d.name != "__pycache__"
    ]
    assert [str(d.relative_to(ROOT)) for d in folders if not (d / "__init__.py").is_file()] == []
    # (tomllib is Python 3.11's; the list is a plain literal)
    listed = ast.literal_eval(
        re.search(r"^packages = (\[.*?\])$", (ROOT / "pyproject.toml").read_text(), re.M | re.S)[1]
    )
    assert sorted(listed) == sorted(module_name(d / "__init__.py", ROOT) for d in folders)
