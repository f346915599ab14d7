"""The one-way package rule: lora_core <- replicas <- cluster.

lora_core imports no ray, fastapi, starlette, replicas or cluster; replicas
imports no ray, fastapi, starlette or cluster. Checked twice: statically, by
parsing every .py file of the package (so an import hidden in a function or
behind TYPE_CHECKING counts too), and dynamically, by importing the package
and every submodule in a fresh interpreter and looking at sys.modules (so a
forbidden module pulled in through a third-party dependency counts too).
A package directory that does not exist yet, or holds no module, passes.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

FORBIDDEN: dict[str, frozenset[str]] = {
    "lora_core": frozenset({"ray", "fastapi", "starlette", "replicas", "cluster"}),
    "replicas": frozenset({"ray", "fastapi", "starlette", "cluster"}),
}

_DYNAMIC_IMPORTERS = {("importlib", "import_module"), (None, "import_module"), (None, "__import__")}


def _module_name(path: Path, root: Path) -> str:
    """'lora_core/punica/wrapper.py' -> 'lora_core.punica.wrapper' ('__init__' names the package)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve_relative(module: str | None, level: int, importer: str, is_package: bool) -> str:
    """The absolute module a ``from .x import ...`` in ``importer`` refers to (best effort)."""
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[: max(0, len(base) - (level - 1))]
    return ".".join([*base, *([module] if module else [])])


def _call_target(func: ast.expr) -> tuple[str | None, str] | None:
    if isinstance(func, ast.Name):
        return None, func.id
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        return func.value.id, func.attr
    return None


def imported_modules(source: str, importer: str = "", is_package: bool = False) -> list[tuple[int, str]]:
    """Every (line, absolute module name) ``source`` imports, wherever the statement sits.

    ``from a import b`` yields both ``a`` and ``a.b`` (b may be a submodule);
    importlib.import_module / __import__ with a literal name count as imports.
    """
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = _resolve_relative(node.module, node.level, importer, is_package)
            if base:
                found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{a.name}" if base else a.name) for a in node.names if a.name != "*"]
        elif isinstance(node, ast.Call) and _call_target(node.func) in _DYNAMIC_IMPORTERS and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                found.append((node.lineno, arg.value))
    return found


def forbidden_imports(source: str, forbidden: frozenset[str], importer: str = "",
                      is_package: bool = False) -> list[tuple[int, str]]:
    """The imports of ``source`` whose top-level package is in ``forbidden``."""
    return sorted({(line, name) for line, name in imported_modules(source, importer, is_package)
                   if name.split(".")[0] in forbidden})


def package_violations(root: Path, package: str, forbidden: frozenset[str]) -> list[str]:
    """'path:line imports name' for every forbidden import under root/package."""
    problems = []
    for path in sorted((root / package).rglob("*.py")):
        importer = _module_name(path, root)
        source = path.read_text(encoding="utf-8")
        for line, name in forbidden_imports(source, forbidden, importer, path.name == "__init__.py"):
            problems.append(f"{path.relative_to(root)}:{line} imports {name}")
    return problems


_IMPORT_ALL = textwrap.dedent("""
    import importlib, json, pkgutil, sys
    package, forbidden = sys.argv[1], set(sys.argv[2].split(","))
    mod = importlib.import_module(package)
    names = [package]
    for info in pkgutil.walk_packages(getattr(mod, "__path__", []), package + "."):
        try:
            importlib.import_module(info.name)
        except ModuleNotFoundError as exc:
            if exc.name != "triton":  # optional off Linux; its importers are still parsed statically
                raise
            continue
        names.append(info.name)
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in forbidden)
    print(json.dumps({"imported": names, "loaded": loaded}))
""")


def import_all(package: str, forbidden: frozenset[str], path: Path = REPO) -> dict[str, list[str]]:
    """Import ``package`` and all its submodules in a fresh interpreter with ``path`` first on sys.path.

    Returns {"imported": module names, "loaded": forbidden modules found in sys.modules}.
    """
    proc = subprocess.run([sys.executable, "-c", _IMPORT_ALL, package, ",".join(sorted(forbidden))],
                          cwd=path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(path)})
    assert proc.returncode == 0, f"importing {package} failed:\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _has_modules(package: str) -> bool:
    return any((REPO / package).rglob("*.py"))


# ---- the rule on the real tree ---------------------------------------------------------------


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_forbidden_import_statement(package):
    problems = package_violations(REPO, package, FORBIDDEN[package])
    assert not problems, f"{package} breaks the one-way package rule:\n" + "\n".join(problems)


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_importing_package_loads_no_forbidden_module(package):
    if not _has_modules(package):
        return  # nothing to import yet; the static test above covers the files when they appear
    result = import_all(package, FORBIDDEN[package])
    assert result["loaded"] == [], (f"importing {package} (modules {result['imported']}) "
                                    f"loaded {result['loaded']}")


def test_lora_core_import_covers_every_submodule():
    """walk_packages found every file, so a forbidden import in any of them is seen."""
    imported = set(import_all("lora_core", FORBIDDEN["lora_core"])["imported"])
    on_disk = {_module_name(p, REPO) for p in (REPO / "lora_core").rglob("*.py")}
    assert on_disk <= imported, f"not imported: {sorted(on_disk - imported)}"


# ---- the checker itself catches violations ---------------------------------------------------

BAD_SOURCES = [
    ("import ray", "ray"),
    ("import ray.serve as serve", "ray.serve"),
    ("from ray import serve", "ray"),
    ("from fastapi.responses import JSONResponse", "fastapi.responses"),
    ("import os, starlette", "starlette"),
    ("def f():\n    import cluster.router\n", "cluster.router"),
    ("try:\n    from replicas.engine import Engine\nexcept ImportError:\n    pass\n", "replicas.engine"),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from replicas import engine\n", "replicas"),
    ("import importlib\nray = importlib.import_module('ray')", "ray"),
    ("serve = __import__('ray.serve')", "ray.serve"),
]


@pytest.mark.parametrize("source,module", BAD_SOURCES, ids=[s for s, _ in BAD_SOURCES])
def test_checker_flags_forbidden_import(source, module):
    assert module in [name for _, name in forbidden_imports(source, FORBIDDEN["lora_core"], "lora_core.x")]


def test_checker_resolves_relative_imports():
    # replicas/engine.py: "from .. import cluster" climbs out of replicas to the top-level cluster.
    assert forbidden_imports("from .. import cluster", FORBIDDEN["replicas"], "replicas.engine") == \
        [(1, "cluster")]
    # two levels up from replicas.layers.lora is replicas itself: that is replicas.cluster, allowed
    assert forbidden_imports("from ..cluster import app", FORBIDDEN["replicas"], "replicas.layers.lora") == []
    assert forbidden_imports("from ...cluster import app", FORBIDDEN["replicas"], "replicas.layers.lora") == \
        [(1, "cluster"), (1, "cluster.app")]
    # in a package's __init__, one dot is the package itself
    assert forbidden_imports("from .. import ray", FORBIDDEN["lora_core"], "lora_core", is_package=True) == \
        [(1, "ray")]


@pytest.mark.parametrize("source", [
    "import raylib",                     # only the top-level name counts
    "from lora_core.punica import PunicaWrapper",
    "from . import cluster",             # lora_core.cluster, a submodule, not the cluster package
    "x = 'import ray'",
    "from __future__ import annotations",
])
def test_checker_allows(source):
    assert forbidden_imports(source, FORBIDDEN["lora_core"], "lora_core.x") == []


def test_replicas_may_import_lora_core():
    assert forbidden_imports("from lora_core.punica import PunicaWrapper", FORBIDDEN["replicas"], "replicas.x") == []
    assert forbidden_imports("import replicas.engine", FORBIDDEN["replicas"], "replicas.x") == []


def test_package_scan_reports_file_and_line(tmp_path):
    pkg = tmp_path / "replicas" / "layers"
    pkg.mkdir(parents=True)
    (tmp_path / "replicas" / "__init__.py").write_text("")
    (pkg / "ok.py").write_text("import torch\nfrom lora_core import LoRAMapping\n")
    (pkg / "bad.py").write_text("import torch\n\n\ndef serve():\n    from ray import serve\n")
    assert package_violations(tmp_path, "replicas", FORBIDDEN["replicas"]) == \
        ["replicas/layers/bad.py:5 imports ray", "replicas/layers/bad.py:5 imports ray.serve"]
    assert package_violations(tmp_path, "cluster", frozenset({"x"})) == []  # absent package: nothing to scan


def test_import_check_sees_modules_loaded_indirectly(tmp_path):
    """A submodule importing a forbidden package through another library is caught at import time."""
    (tmp_path / "fakepkg" / "sub").mkdir(parents=True)
    (tmp_path / "fakepkg" / "__init__.py").write_text("")
    (tmp_path / "fakepkg" / "sub" / "__init__.py").write_text("")
    (tmp_path / "fakepkg" / "sub" / "deep.py").write_text("import fakedep\n")
    (tmp_path / "fakedep.py").write_text("import fakeray.serve\n")
    (tmp_path / "fakeray").mkdir()
    (tmp_path / "fakeray" / "__init__.py").write_text("")
    (tmp_path / "fakeray" / "serve.py").write_text("")
    result = import_all("fakepkg", frozenset({"fakeray"}), tmp_path)
    assert "fakepkg.sub.deep" in result["imported"]
    assert result["loaded"] == ["fakeray", "fakeray.serve"]
