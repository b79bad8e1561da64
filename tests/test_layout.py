"""The house: packages import one way, no module imports itself round a loop, docs/layout.md
names every module of the tree, and every path the docs and the notebook import resolves."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jaxgpt import PACKAGES

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "jaxgpt"
LAYERS = list(PACKAGES)  # lowest first
# Which top-level modules are the foundation and which the public faces: the map's own grouping.
_spec = importlib.util.spec_from_file_location("layout_doc", ROOT / "scripts" / "layout_doc.py")
layout_doc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(layout_doc)


def module_names() -> dict[str, Path]:
    names = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


MODULES = module_names()


def imports_of(name: str) -> set[str]:
    """Every jaxgpt module `name` imports, at its top or inside a function."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in MODULES and m != name}


def layer(name: str) -> str:
    path = MODULES[name]
    if path.parent != PACKAGE:
        return name.split(".")[1]
    if path.name in layout_doc.FOUNDATION:
        return ""
    return "public" if path.name in layout_doc.PUBLIC else path.stem


def test_every_module_has_a_layer():
    assert {layer(name) for name in MODULES} <= set(LAYERS)


def test_packages_import_one_way():
    against = [f"{name} -> {dep}" for name in MODULES for dep in sorted(imports_of(name))
               if LAYERS.index(layer(dep)) > LAYERS.index(layer(name))]
    assert not against, "imports against the packages' direction:\n" + "\n".join(against)


def test_no_import_cycle():
    graph = {name: imports_of(name) for name in MODULES}
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycles.append(" -> ".join(trail[trail.index(dep):] + [node, dep]) if dep in trail else f"{node} -> {dep}")
            elif dep not in state:
                visit(dep, trail + [node])
        state[node] = 2

    for name in MODULES:
        if name not in state:
            visit(name, [])
    assert not cycles, "\n".join(cycles)


def test_layout_doc_names_every_module():
    text = (ROOT / "docs" / "layout.md").read_text()
    listed = set(re.findall(r"^\| `(jaxgpt/[\w/]+\.py)`", text, re.M))
    on_disk = {str(path.relative_to(ROOT)) for path in MODULES.values()}
    assert listed == on_disk, f"only in docs/layout.md: {sorted(listed - on_disk)}; only in the tree: {sorted(on_disk - listed)}"
    check = subprocess.run([sys.executable, str(ROOT / "scripts" / "layout_doc.py"), "--check"], capture_output=True,
                           text=True)
    assert check.returncode == 0, check.stderr


def documented_paths() -> set[tuple[str, str | None]]:
    """(module, name) for each `from jaxgpt.X import a, b` and `jaxgpt.X.name` in the README,
    docs/ and the notebook."""
    paths = set()
    texts = [ROOT / "README.md", ROOT / "experiments" / "colab.ipynb", *sorted((ROOT / "docs").glob("*.md"))]
    for path in texts:
        text = path.read_text().replace('\\n', "\n")
        for module, names in re.findall(r"from (jaxgpt(?:\.\w+)*) import ([\w, ]+)", text):
            paths.update((module, name.strip()) for name in names.split(",") if name.strip())
        for dotted in re.findall(r"`(jaxgpt(?:\.\w+)+)", text):
            paths.add((dotted, None))
    return paths


@pytest.mark.parametrize("module, name", sorted(documented_paths(), key=str))
def test_documented_path_imports(module, name):
    if name is None:  # `jaxgpt.a.b`: a module, or a name in the module before it
        try:
            importlib.import_module(module)
        except ModuleNotFoundError:
            parent, _, attribute = module.rpartition(".")
            assert hasattr(importlib.import_module(parent), attribute), module
    else:
        assert hasattr(importlib.import_module(module), name), f"{module}.{name}"


def test_public_paths():
    from jaxgpt.checkpoint import load_run
    from jaxgpt.cli import entry
    from jaxgpt.config import load_config
    from jaxgpt.generate import generate
    from jaxgpt.kernels import choose_kernels
    from jaxgpt.model import forward, init_params
    from jaxgpt.train import train

    assert all(callable(f) for f in (load_run, entry, load_config, generate, choose_kernels, forward, init_params, train))
