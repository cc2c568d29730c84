"""The private mlx-lm names kvshelf relies on (``kvshelf.mlx_lm.upstream.PRIVATE_NAMES``) exist with the shape kvshelf
uses: one test per name against the installed mlx-lm, and (slow) a check of the sources of the lowest and the highest
mlx-lm the pin in pyproject.toml allows, downloaded from the package index and parsed (never imported).

Why the sources: a release can drop or rename a private name at any time (``_image_parts`` is missing from 0.32.0,
which is why the pin starts at 0.32.1); only the versions the pin admits matter, and they cannot all be installed
at once. The download needs the network: without it the slow test is skipped, unless ``CI=true`` (then it fails).
"""

from __future__ import annotations

import ast
import inspect
import os
import re
import subprocess
import sys
import tomllib
import zipfile
from dataclasses import fields
from pathlib import Path

import pytest

from kvshelf.mlx_lm import upstream
from kvshelf.mlx_lm.upstream import PRIVATE_NAMES, PrivateName

ROOT = Path(__file__).resolve().parents[2]
PIN = re.compile(r"^mlx-lm>=(?P<low>[0-9.]+),<(?P<high>[0-9.]+)$")


def _owner(spec: PrivateName):
    module = __import__(spec.module, fromlist=["_"])
    return getattr(module, spec.owner) if spec.owner else module


def _instance_with(spec: PrivateName):
    """An object on which an instance attribute is set by mlx-lm's constructor."""
    from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache, RotatingKVCache

    made = {"RotatingKVCache": lambda: RotatingKVCache(max_size=4),
            "BatchKVCache": lambda: BatchKVCache(left_padding=[0]),
            "BatchRotatingKVCache": lambda: BatchRotatingKVCache(max_size=4, left_padding=[0])}
    return made[spec.owner]()


@pytest.mark.parametrize("spec", PRIVATE_NAMES, ids=lambda s: s.qualname)
def test_the_installed_mlx_lm_has_the_name(spec: PrivateName):
    owner = _owner(spec)
    if spec.kind in ("function", "method"):
        target = getattr(owner, spec.name, None)
        assert callable(target), f"{spec.qualname} is gone from mlx-lm (kvshelf uses it: {spec.why})"
        params = tuple(inspect.signature(target).parameters)
        assert params[:len(spec.params)] == spec.params, f"{spec.qualname}{params}: kvshelf passes {spec.params}"
    elif spec.owner == "GenerationContext":  # a dataclass field with a default
        assert spec.name in {f.name for f in fields(owner)}, f"{spec.qualname} is gone"
        assert getattr(owner, spec.name) is False
    else:
        assert hasattr(_instance_with(spec), spec.name), f"{spec.qualname} is gone from mlx-lm's constructor"


def test_every_private_mlx_lm_name_in_kvshelf_is_listed():
    """No module of kvshelf.mlx_lm but the adapter names an mlx-lm ``_name``: imports from mlx_lm, and ``x._name``
    uses (other than on ``self``: kvshelf's own classes) of the names the adapter lists."""
    listed = {s.name for s in PRIVATE_NAMES}
    for path in (ROOT / "kvshelf" / "mlx_lm").rglob("*.py"):
        if path.name == "upstream.py" and path.parent.name == "mlx_lm":
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mlx_lm"):
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"{path}: imports {private} from {node.module}: go through upstream.py"
            if isinstance(node, ast.FunctionDef) and node.name in listed:
                pytest.fail(f"{path}:{node.lineno}: overrides mlx-lm's {node.name}: see upstream.py")
            if isinstance(node, ast.Attribute) and node.attr in listed and not (
                    isinstance(node.value, ast.Name) and node.value.id == "self"):
                pytest.fail(f"{path}:{node.lineno}: uses mlx-lm's {node.attr}: go through kvshelf.mlx_lm.upstream")


def test_the_adapter_reads_and_sets_what_mlx_lm_keeps():
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache, RotatingKVCache

    ring = RotatingKVCache(max_size=4)
    ring.update_and_fetch(mx.zeros((1, 1, 3, 2)), mx.zeros((1, 1, 3, 2)))
    assert upstream.write_index(ring) == 3
    upstream.set_write_index(ring, 1)
    assert upstream.write_index(ring) == 1
    batch = BatchKVCache(left_padding=[0])
    assert not upstream.in_right_padded_prefill(batch)
    batch.prepare(right_padding=[1])
    assert upstream.in_right_padded_prefill(batch)
    assert list(upstream.image_parts([{"role": "user", "content": [{"type": "text", "text": "hi"}]}])) == []


# ---------------------------------------------------------------------------------------------- the pin's ends
def _pins() -> set[tuple[str, str]]:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    found = {(m["low"], m["high"]) for reqs in extras.values() for r in reqs if (m := PIN.match(r.replace(" ", "")))}
    named = [r for reqs in extras.values() for r in reqs if r.startswith("mlx-lm")]
    assert len(found) == 1 and len(named) >= 3, f"every extra pins mlx-lm the same way: {named}"
    return found


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split("."))


def _pip(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, timeout=300,
                          check=False, cwd=cwd)


def _unavailable(why: str):
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI: {why}")
    pytest.skip(why)


def _wheel_sources(version: str, where: Path) -> dict[str, str]:
    out = _pip("download", f"mlx-lm=={version}", "--no-deps", "--only-binary", ":all:", "-d", str(where))
    wheels = sorted(where.glob(f"mlx_lm-{version}-*.whl"))
    if out.returncode != 0 or not wheels:
        _unavailable(f"cannot download mlx-lm {version}: {out.stderr.strip()[-500:]}")
    with zipfile.ZipFile(wheels[0]) as z:
        return {name: z.read(name).decode() for name in z.namelist() if name.endswith(".py")}


def missing_names(sources: dict[str, str]) -> list[str]:
    """The ``PRIVATE_NAMES`` a release's sources lack (or have with other leading parameters)."""
    missing = []
    for spec in PRIVATE_NAMES:
        text = sources.get(spec.module.replace(".", "/") + ".py")
        if text is None or not _defines(ast.parse(text), spec):
            missing.append(spec.qualname)
    return missing


def _defines(tree: ast.Module, spec: PrivateName) -> bool:
    scope: list[ast.stmt] = tree.body
    if spec.owner:
        classes = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == spec.owner]
        if not classes:
            return False
        scope = classes[0].body
    if spec.kind in ("function", "method"):
        for node in scope:
            if isinstance(node, ast.FunctionDef) and node.name == spec.name:
                params = tuple(a.arg for a in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs])
                return params[:len(spec.params)] == spec.params
        return False
    for node in scope:  # a class-level field (dataclass) ...
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == spec.name:
            return True
    for node in ast.walk(ast.Module(body=scope, type_ignores=[])):  # ... or set on self by a method
        targets = node.targets if isinstance(node, ast.Assign) else []
        for t in targets:
            for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                if isinstance(el, ast.Attribute) and el.attr == spec.name and isinstance(el.value, ast.Name) \
                        and el.value.id == "self":
                    return True
    return False


def _highest_allowed(low: str, high: str) -> str:
    out = _pip("index", "versions", "mlx-lm")
    listed = re.search(r"Available versions: (.*)", out.stdout)
    if out.returncode != 0 or not listed:
        _unavailable(f"cannot list mlx-lm's versions: {out.stderr.strip()[-500:]}")
    allowed = [v for v in (v.strip() for v in listed[1].split(",")) if re.fullmatch(r"[0-9]+(\.[0-9]+)*", v)
               and _version(low) <= _version(v) < _version(high)]
    assert allowed, f"no released mlx-lm in >={low},<{high}"
    return max(allowed, key=_version)


@pytest.mark.slow
def test_the_lowest_and_highest_mlx_lm_the_pin_allows_have_every_name(tmp_path):
    ((low, high),) = _pins()
    for version in sorted({low, _highest_allowed(low, high)}, key=_version):
        where = tmp_path / version
        where.mkdir()
        missing = missing_names(_wheel_sources(version, where))
        assert not missing, f"mlx-lm {version} (allowed by the pin >={low},<{high}) lacks {missing}"


@pytest.mark.slow
def test_the_source_check_finds_a_missing_name(tmp_path):
    """Why the pin starts at 0.32.1: 0.32.0 has no ``_image_parts`` — and the check above can fail."""
    assert missing_names(_wheel_sources("0.32.0", tmp_path)) == ["mlx_lm.server._image_parts"]
