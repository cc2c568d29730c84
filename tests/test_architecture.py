"""The house rules as code: the import contract in pyproject.toml holds, a broken rule fails it, the façade only
delegates, the store's top level stays small, nothing outside the store reaches into a room's modules, and every
room's docstring says what the contract says.

Why tests and not prose: rules that live only in docstrings drift (before this check, four rooms broke their own).
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STORE = ROOT / "kvshelf" / "store"
LINT = Path(sys.executable).with_name("lint-imports")


def _lint(cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(cwd)}
    return subprocess.run([str(LINT), "--no-cache"], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_the_import_contract_holds() -> None:
    assert LINT.exists(), "import-linter is a test dependency (pip install -e '.[test]')"
    run = _lint(ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 broken" in run.stdout


@pytest.mark.parametrize("module, bad_import", [
    ("kvshelf/store/index/keys.py", "from ..save import saver as _saver  # a lower room reaching up"),
    ("kvshelf/store/objects/pack.py", "from ..index import keys as _keys  # objects know nothing of the index"),
    ("kvshelf/codecs/checksum.py", "from ..store import results as _results  # a package reaching up"),
])
def test_a_broken_room_rule_fails_the_contract(tmp_path: Path, module: str, bad_import: str) -> None:
    """The check can fail: the same tree with one forbidden import added is BROKEN, naming the import."""
    shutil.copytree(ROOT / "kvshelf", tmp_path / "kvshelf", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / module
    text = target.read_text()
    cut = text.index("\nfrom ") + 1  # after the module docstring and __future__, before its first import
    target.write_text(text[:cut] + bad_import + "\n" + text[cut:])
    run = _lint(tmp_path)
    assert run.returncode != 0 and "BROKEN" in run.stdout, run.stdout + run.stderr
    mod = module[:-3].replace("/", ".")
    assert mod in run.stdout, run.stdout


def test_the_facade_only_delegates() -> None:
    source = (STORE / "store.py").read_text()
    assert len(source.splitlines()) <= 300
    assert "setattr" not in source
    tree = ast.parse(source)
    store = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Store")
    for fn in store.body:
        if not isinstance(fn, ast.FunctionDef) or fn.name.startswith("__"):
            continue
        body = fn.body[1:] if ast.get_docstring(fn) else fn.body
        assert ast.get_docstring(fn) or fn.decorator_list, f"Store.{fn.name} says what it does"
        assert len(body) == 1, f"Store.{fn.name} is one delegation, not {len(body)} statements"


def test_the_store_top_level_holds_at_most_eight_modules() -> None:
    modules = sorted(p.name for p in STORE.glob("*.py"))
    assert len(modules) <= 8, modules


def _imports(path: Path, package: str) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found += [(node.lineno, name)] + [(node.lineno, f"{name}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
    return found


def test_nothing_outside_the_store_imports_a_rooms_own_modules() -> None:
    """Outside ``kvshelf/store`` a module imports ``kvshelf.store``, a room's package (its ``__init__`` names what it
    offers) or one of the store's top-level modules — never a module inside a room."""
    rooms = {p.name for p in STORE.iterdir() if (p / "__init__.py").exists()}
    offenders = []
    for path in (ROOT / "kvshelf").rglob("*.py"):
        if STORE in path.parents:
            continue
        rel = path.relative_to(ROOT).with_suffix("")
        package = ".".join(rel.parts[:-1] if path.name != "__init__.py" else rel.parts[:-1])
        for line, name in _imports(path, package):
            parts = name.split(".")
            if parts[:2] == ["kvshelf", "store"] and len(parts) >= 4 and parts[2] in rooms:
                module = STORE / parts[2] / f"{parts[3]}.py"
                if module.exists():
                    offenders.append(f"{rel}.py:{line} imports {name}")
    assert offenders == []


def _room_layers() -> list[tuple[int, str]]:
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contract = next(c for c in cfg["tool"]["importlinter"]["contracts"] if c.get("containers") == ["kvshelf.store"])
    return [(i, part.strip()) for i, layer in enumerate(contract["layers"]) for part in layer.split("|")]


@pytest.mark.parametrize("room", sorted(p.name for p in STORE.iterdir() if (p / "__init__.py").exists()))
def test_every_room_docstring_says_what_the_contract_says(room: str) -> None:
    layers = _room_layers()
    assert room in [name for _, name in layers], f"room {room} is missing from the contract in pyproject.toml"
    level = next(i for i, name in layers if name == room)
    below = {name for i, name in layers if i > level}
    doc = ast.get_docstring(ast.parse((STORE / room / "__init__.py").read_text())) or ""
    said = re.search(r"May import.*?(?=\n\n|\Z)", doc, re.S)
    assert said, f"store/{room}/__init__.py says what it may import"
    named = set(re.findall(r"``store\.(\w+)``", said.group(0)))
    assert named == below, f"store/{room}: docstring names {sorted(named)}, the contract allows {sorted(below)}"
