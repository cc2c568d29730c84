"""The default codec provider: every latent and key/value lego, under the versioned id ``kvshelf-cache-v1``,
plus the codecs of installed plugins (entry-point group ``kvshelf.codecs``), found lazily.

Why plugins and not imports: integrations such as ``kvshelf.mlx_lm`` depend on the core, never the reverse, and
the core must import and work without them. A plugin names a callable (or a sequence) of codecs in its package
metadata (``[project.entry-points."kvshelf.codecs"]``); the provider loads the group only when a cache or an entry
kind is not one of the core's, so a user of the core legos never pays for importing mlx-lm. A plugin whose
third-party dependency is absent (an ``ImportError`` that does not name a kvshelf module) is skipped quietly; any
other plugin failure is an ``IncompatibleFormat`` naming the plugin.

The provider id does not change when plugins register: the id versions the header vocabulary and the codecs of
existing kinds, and plugin kinds are additive (a reader without the plugin refuses their kind by name, before any
tensor is read). ``codecs`` and ``kinds`` list the core codecs; ``plugin_codecs()`` lists what plugins added.
A source checkout run without being installed also reads its own ``pyproject.toml`` declarations of the group.
"""

from __future__ import annotations

import threading
import tomllib
from collections.abc import Iterable
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import Any

from ..errors import IncompatibleFormat, WrongArgumentType
from .codec import Codec, CodecProvider
from .header import CacheEntry
from .kinds.encoded import EncodedCodec
from .kinds.kv import TOKEN_KV_CODECS
from .kinds.kv_state import STATE_KV_CODECS
from .kinds.mla import MLACodec
from .kinds.paged import PagedCodec

DEFAULT_PROVIDER_ID = "kvshelf-cache-v1"
PLUGIN_GROUP = "kvshelf.codecs"


def _dependency_absent(exc: ImportError) -> bool:
    """An ImportError that says a plugin's optional dependency is not installed (not a broken kvshelf)."""
    name = getattr(exc, "name", None)  # None: an import blocked by a finder that named nothing
    return name is None or name.split(".")[0] != "kvshelf"


def source_tree_points(group: str = PLUGIN_GROUP) -> list[EntryPoint]:
    """The group's entry points declared in the ``pyproject.toml`` beside this package: what ``pip install`` would
    register, so a source checkout that runs uninstalled (``PYTHONPATH``) finds its own plugins too."""
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    try:
        project = tomllib.loads(pyproject.read_text(encoding="utf-8")).get("project", {})
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return []
    if project.get("name") != "kvshelf":
        return []
    table = project.get("entry-points", {}).get(group, {})
    return [EntryPoint(name, value, group) for name, value in table.items() if isinstance(value, str)]


def plugin_points(group: str = PLUGIN_GROUP) -> list[EntryPoint]:
    """Installed entry points of ``group``, with this source tree's own declarations taking their names' place
    (they describe the code that is actually running), sorted by name."""
    points = {p.name: p for p in entry_points(group=group)}
    points.update({p.name: p for p in source_tree_points(group)})
    return [points[name] for name in sorted(points)]


def load_plugin_codecs(group: str = PLUGIN_GROUP) -> list[Codec]:
    """Every codec the plugins of ``group`` offer (plugins with an absent dependency skipped)."""
    found: list[Codec] = []
    for point in plugin_points(group):
        try:
            target = point.load()
            codecs = target() if callable(target) else target
            codecs = list(codecs)
        except ImportError as exc:
            if _dependency_absent(exc):
                continue
            raise IncompatibleFormat(f"codec plugin {point.name!r} ({point.value}) failed to import: {exc}") from exc
        except Exception as exc:
            raise IncompatibleFormat(f"codec plugin {point.name!r} ({point.value}) failed to load: "
                                     f"{type(exc).__name__}: {exc}") from exc
        for codec in codecs:
            if not isinstance(codec, Codec):
                raise IncompatibleFormat(f"codec plugin {point.name!r} offered {codec!r}, which is not a Codec")
        found.extend(codecs)
    return found


class PluggableProvider(CodecProvider):
    """A ``CodecProvider`` whose core codecs are extended, on first need, by the plugins of an entry-point group."""

    def __init__(self, id: str, codecs: Iterable[Codec], group: str = PLUGIN_GROUP) -> None:
        super().__init__(id, codecs)
        self.group = group
        self._plugins: tuple[Codec, ...] | None = None
        self._plugin_kinds: dict[str, Codec] = {}
        self._lock = threading.Lock()

    def plugin_codecs(self) -> tuple[Codec, ...]:
        """The plugin codecs (loading the group on first call)."""
        if self._plugins is None:
            with self._lock:
                if self._plugins is None:
                    by_kind: dict[str, Codec] = {}
                    plugins = load_plugin_codecs(self.group)
                    for codec in plugins:
                        taken = self._by_kind.get(codec.kind) or by_kind.get(codec.kind)
                        if taken is not None and type(taken) is type(codec):
                            continue  # the same codec, already given to this provider (e.g. via extended)
                        if taken is not None:
                            raise IncompatibleFormat(
                                f"codec provider {self.id!r}: a plugin codec claims kind {codec.kind!r}, already taken"
                            )
                        by_kind[codec.kind] = codec
                    self._plugin_kinds = by_kind
                    self._plugins = tuple(by_kind.values())
        return self._plugins

    def extended(self, id: str, codecs: Iterable[Codec]) -> CodecProvider:
        return PluggableProvider(id, [*self.codecs, *codecs], self.group)

    def for_cache(self, cache: Any) -> Codec:
        found = [codec for codec in self.codecs if codec.matches(cache)]
        if not found:
            found = [codec for codec in self.plugin_codecs() if codec.matches(cache)]
        if len(found) != 1:
            return super().for_cache(cache) if len(found) == 0 else self._ambiguous(cache, found)
        return found[0]

    def _ambiguous(self, cache: Any, found: list[Codec]) -> Codec:
        kinds = ", ".join(codec.kind for codec in found)
        raise IncompatibleFormat(f"codec provider {self.id!r}: {len(found)} matches for {type(cache).__name__} "
                                 f"({kinds}); expected exactly one")

    def for_entry(self, entry: Any) -> Codec:
        if not isinstance(entry, (str, CacheEntry)):
            raise WrongArgumentType(f"for_entry takes a CacheEntry or a kind name, got {type(entry).__name__}")
        kind = entry if isinstance(entry, str) else entry.kind
        if kind not in self._by_kind:
            self.plugin_codecs()
            if kind in self._plugin_kinds:
                return self._plugin_kinds[kind]
            if kind.startswith("mlx-lm.") and not any(k.startswith("mlx-lm.") for k in self._plugin_kinds):
                raise IncompatibleFormat(
                    f"codec provider {self.id!r} has no codec for cache kind {kind!r}: it was written from mlx-lm's "
                    "caches; install mlx-lm (pip install 'kvshelf[mlx-lm]') to read it"
                )
            known = ", ".join(sorted([*self._by_kind, *self._plugin_kinds]))
            raise IncompatibleFormat(f"codec provider {self.id!r} has no codec for cache kind {kind!r} (known: {known})")
        return self._by_kind[kind]


default_provider = PluggableProvider(
    DEFAULT_PROVIDER_ID, [MLACodec(dsa=False), MLACodec(dsa=True), EncodedCodec(), PagedCodec(), *TOKEN_KV_CODECS,
    *STATE_KV_CODECS]
)

__all__ = ["DEFAULT_PROVIDER_ID", "PLUGIN_GROUP", "PluggableProvider", "default_provider", "load_plugin_codecs"]
