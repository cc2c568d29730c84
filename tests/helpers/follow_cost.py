"""How much of the store a reader must open to follow one call, and how far each collaborator reaches.

Two figures (issue 28's report), measured the same way before and after a restructuring:

* **files followed**: the distinct ``kvshelf`` source files whose functions run during ``Store.save`` /
  ``Store.restore_prefix`` / ``Store.verify`` on a small real store (``sys.setprofile``), i.e. what a reader
  stepping through the call has to open. Import-time code is excluded (the store is opened before tracing).
* **static reach**: for every module of ``kvshelf.store``, how many of the store's own modules it reaches through its
  imports, transitively (every ``import`` statement in the module, parsed with ``ast``; a package import reaches its
  ``__init__``, not the parents Python also runs). Printed as min / median / max over the store's collaborator modules, and for ``context``.

Run: ``python -m tests.helpers.follow_cost`` (add ``--json``).
"""
from __future__ import annotations

import ast
import json
import os
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PKG = os.path.join(ROOT, "kvshelf")


def _modules() -> dict[str, str]:
    found = {}
    for dirpath, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                found[rel[:-9] if rel.endswith(".__init__") else rel] = path
    return found


def _imports(name: str, path: str, mods: dict[str, str]) -> set[str]:
    tree = ast.parse(open(path).read())
    is_pkg = path.endswith("__init__.py")
    base = name if is_pkg else name.rpartition(".")[0]
    out: set[str] = set()

    def add(target: str) -> None:
        while target and target not in mods:
            target = target.rpartition(".")[0]
        if target:
            out.add(target)  # the module itself; its parents' __init__ are not counted (what a reader opens)

    skip = set()  # imports under ``if TYPE_CHECKING:`` are annotations, not arrows (import-linter agrees)
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for n in ast.walk(node))
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("kvshelf"):
                    add(a.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                pkg = base
                for _ in range(node.level - 1):
                    pkg = pkg.rpartition(".")[0]
                mod = f"{pkg}.{node.module}" if node.module else pkg
            else:
                mod = node.module or ""
            if not mod.startswith("kvshelf"):
                continue
            for a in node.names:
                sub = f"{mod}.{a.name}"
                add(sub if sub in mods else mod)
    out.discard(name)
    return out


def static_reach() -> dict[str, int]:
    mods = _modules()
    graph = {m: _imports(m, p, mods) for m, p in mods.items()}
    reach = {}
    for m in mods:
        if not m.startswith("kvshelf.store"):
            continue
        seen, todo = set(), [m]
        while todo:
            for n in graph[todo.pop()]:
                if n not in seen and n != m:
                    seen.add(n)
                    todo.append(n)
        reach[m] = len([n for n in seen if n.startswith("kvshelf.store")])  # of the store's own modules
    return reach


def files_followed() -> dict[str, int]:
    import mlx.core as mx
    from kvshelf import open_store, Identity
    from kvshelf.latent_legos import KvScheme, SyntheticMLAModel

    model = SyntheticMLAModel(num_layers=2, seed=0)
    caches = model.make_caches(KvScheme.bf16())
    prompt = [t % 256 for t in range(1, 600)]  # ids of its 256-token vocabulary
    model(mx.array([prompt], dtype=mx.int32), caches)
    out, seen = {}, {}
    with tempfile.TemporaryDirectory() as d, open_store(d, identity=Identity("m")) as store:
        store.save("warm", prompt, caches)  # first calls import lazily: not counted
        store.restore_prefix(prompt + [1])
        store.verify()
        for what, call in (("save", lambda: store.save("chat", prompt, caches)),
                           ("restore_prefix", lambda: store.restore_prefix(prompt[:300] + [7])),
                           ("verify", lambda: store.verify())):
            files: set[str] = set()

            def prof(frame, event, arg):
                if event == "call":
                    fn = frame.f_code.co_filename
                    if fn.startswith(PKG):
                        files.add(fn)

            sys.setprofile(prof)
            import threading
            threading.setprofile(prof)
            try:
                call()
            finally:
                sys.setprofile(None)
                threading.setprofile(None)
            out[what] = len(files)
            seen[what] = sorted(files)
    for what, files in seen.items():  # the store's own files among them (codecs and cache code excluded)
        out[what + " (store)"] = sum(1 for f in files if f.startswith(os.path.join(PKG, "store")))
    return out


def main() -> None:
    reach = static_reach()
    collab = {m: n for m, n in reach.items() if m.count(".") >= 3 and not m.endswith(".__init__")}
    vals = sorted(collab.values())
    report = {"files_followed": files_followed(),
              "static_reach": {"context": reach.get("kvshelf.store.context"),
                               "min": vals[0], "median": statistics.median(vals), "max": vals[-1],
                               "store_modules": len([m for m in reach if m.startswith("kvshelf.store")])}}
    if "--json" in sys.argv:
        print(json.dumps(report, indent=1))
    else:
        for k, v in report.items():
            print(k, v)
        if "-v" in sys.argv:
            for m, n in sorted(collab.items(), key=lambda kv: -kv[1]):
                print(f"  {n:3d} {m}")


if __name__ == "__main__":
    main()
