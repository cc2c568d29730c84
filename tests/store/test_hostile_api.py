"""The public API walked with hostile arguments: every refusal is a ``KvShelfError`` of the documented class, raised
before anything is written, and the store keeps serving what it held (issue 12: "never a raw error").

Each case here escaped as a raw error before ``kvshelf.store.inputs`` (``lmdb.BadValsizeError`` for a 480-1,100 byte
session id, ``UnicodeEncodeError`` for a lone surrogate, ``ValueError`` from ``bytes.fromhex``, ``TypeError``...).
"""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tools_data import MODEL, make_caches, same_reads

from kvshelf import Identity, open_store
from kvshelf.codecs import load_snapshot, read_header, save_snapshot
from kvshelf.errors import (
    CorruptData,
    FileAccessError,
    FileMissing,
    IncompatibleFormat,
    InvalidCacheState,
    KvShelfError,
    SnapshotNotFound,
    WrongArgumentType,
)
from kvshelf.store import PrefixHit
from kvshelf.store.inputs import (
    MAX_NAMESPACE_BYTES,
    MAX_SESSION_ID_BYTES,
    TOKEN_ID_LIMIT,
)

N = 24
TOKENS = list(range(500, 500 + N))


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile") / "store"
    with open_store(root, identity=MODEL, chunk_tokens=8) as s:
        s.save("keep", TOKENS, make_caches("mla", N, 1))
        yield s


def still_serving(store) -> None:
    """The session saved at the start restores exactly and nothing else appeared."""
    assert sorted((i.namespace, i.session_id) for i in store.sessions()) == [("", "keep")]
    r = store.restore("keep")
    assert r.tokens == TOKENS and same_reads(r.caches, make_caches("mla", N, 1))


def utf8_of_length(n: int) -> str:
    """A session id of exactly ``n`` UTF-8 bytes made of 2-byte characters (plus one ASCII byte when odd)."""
    return "é" * (n // 2) + "x" * (n % 2)


BAD_SESSION_IDS = [
    pytest.param(utf8_of_length(MAX_SESSION_ID_BYTES + 1), InvalidCacheState, id="449-bytes"),
    pytest.param(utf8_of_length(480), InvalidCacheState, id="480-bytes"),
    pytest.param(utf8_of_length(777), InvalidCacheState, id="777-bytes"),
    pytest.param("x" * 1100, InvalidCacheState, id="1100-ascii"),
    pytest.param("a\ud800b", InvalidCacheState, id="lone-surrogate"),
    pytest.param("a\x00b", InvalidCacheState, id="nul"),
    pytest.param("", InvalidCacheState, id="empty"),
    pytest.param(3, WrongArgumentType, id="int"),
    pytest.param(None, WrongArgumentType, id="none"),
    pytest.param(b"keep", WrongArgumentType, id="bytes"),
    pytest.param(["keep"], WrongArgumentType, id="list"),
]


@pytest.mark.parametrize("session_id, error", BAD_SESSION_IDS)
def test_hostile_session_ids_are_refused_by_every_call(store, session_id, error) -> None:
    caches = make_caches("mla", N, 2)
    calls = {
        "save": lambda: store.save(session_id, TOKENS, caches),
        "save_async": lambda: store.save_async(session_id, TOKENS, caches),
        "restore": lambda: store.restore(session_id),
        "delete": lambda: store.delete(session_id),
        "restore_batch": lambda: store.restore_batch([session_id]),
        "restore_batch_pair": lambda: store.restore_batch([(session_id, "")]),
    }
    for name, call in calls.items():
        with pytest.raises(error) as info:
            call()
        assert "session_id" in str(info.value), name
    store.flush()
    still_serving(store)


def test_the_longest_session_id_and_namespace_round_trip(tmp_path) -> None:
    sid, ns = utf8_of_length(MAX_SESSION_ID_BYTES), "ñ" * (MAX_NAMESPACE_BYTES // 2)
    with open_store(tmp_path / "s", identity=MODEL, chunk_tokens=8) as s:
        s.save(sid, TOKENS, make_caches("mla", N, 3), namespace=ns)
        assert s.lookup([*TOKENS, 9], namespace=ns).session_id == sid
        r = s.restore(sid, namespace=ns)
        assert r.tokens == TOKENS and same_reads(r.caches, make_caches("mla", N, 3))
        assert [(i.session_id, i.namespace) for i in s.sessions(namespace=ns)] == [(sid, ns)]
        s.delete(sid, namespace=ns)
        assert s.sessions() == []


BAD_NAMESPACES = [
    pytest.param("n" * (MAX_NAMESPACE_BYTES + 1), InvalidCacheState, id="257-bytes"),
    pytest.param("n" * 1100, InvalidCacheState, id="1100"),
    pytest.param("\udcff", InvalidCacheState, id="lone-surrogate"),
    pytest.param("\x00", InvalidCacheState, id="nul"),
    pytest.param(3, WrongArgumentType, id="int"),
    pytest.param(b"", WrongArgumentType, id="bytes"),
]


@pytest.mark.parametrize("namespace, error", BAD_NAMESPACES)
def test_hostile_namespaces_are_refused_by_every_call(store, namespace, error) -> None:
    caches = make_caches("mla", N, 2)
    for call in (lambda: store.save("s", TOKENS, caches, namespace=namespace),
                 lambda: store.save_async("s", TOKENS, caches, namespace=namespace),
                 lambda: store.restore("keep", namespace=namespace),
                 lambda: store.lookup(TOKENS, namespace=namespace),
                 lambda: store.restore_prefix(TOKENS, namespace=namespace),
                 lambda: store.delete("keep", namespace=namespace),
                 lambda: store.sessions(namespace=namespace),
                 lambda: store.restore_batch([("keep", namespace)])):
        with pytest.raises(error, match="namespace"):
            call()
    store.flush()
    still_serving(store)


BAD_TOKENS = [
    pytest.param([*TOKENS[:-1], TOKEN_ID_LIMIT], InvalidCacheState, id="2**31"),
    pytest.param([*TOKENS[:-1], 2**62], InvalidCacheState, id="2**62"),
    pytest.param([*TOKENS[:-1], 2**64], InvalidCacheState, id="2**64"),
    pytest.param([-1, *TOKENS[1:]], InvalidCacheState, id="negative"),
    pytest.param([*TOKENS[:-1], 1.0], WrongArgumentType, id="float"),
    pytest.param([*TOKENS[:-1], "7"], WrongArgumentType, id="str-item"),
    pytest.param(np.array(TOKENS, dtype=np.float32), InvalidCacheState, id="float-array"),
    pytest.param(np.array([TOKENS]), InvalidCacheState, id="2-D-array"),
    pytest.param(mx.array([TOKENS]), InvalidCacheState, id="2-D-mx"),
    pytest.param(mx.array(TOKENS, dtype=mx.float16), InvalidCacheState, id="mx-float"),
    pytest.param(np.array([*TOKENS[:-1], TOKEN_ID_LIMIT], dtype=np.int64), InvalidCacheState, id="np-2**31"),
    pytest.param(np.array([*TOKENS[:-1], 2**63], dtype=np.uint64), InvalidCacheState, id="np-uint64"),
    pytest.param(np.array([True] * N), InvalidCacheState, id="bool-array"),
    pytest.param("abc", WrongArgumentType, id="str"),
    pytest.param(None, WrongArgumentType, id="none"),
    pytest.param(7, WrongArgumentType, id="int"),
    pytest.param({1, 2}, WrongArgumentType, id="set"),
]


@pytest.mark.parametrize("tokens, error", BAD_TOKENS)
def test_hostile_tokens_are_refused_before_anything_is_written(store, tmp_path, tokens, error) -> None:
    caches = make_caches("mla", N, 2)
    with pytest.raises(error, match="tokens"):
        store.save("new", tokens, caches)
    with pytest.raises(error, match="tokens"):
        store.save_async("new", tokens, caches)
    with pytest.raises(error, match="tokens"):
        save_snapshot(tmp_path / "never-written.safetensors", tokens, caches)
    assert list(tmp_path.iterdir()) == []
    store.flush()
    still_serving(store)


def test_the_largest_token_id_round_trips(tmp_path) -> None:
    tokens = [*TOKENS[:-1], TOKEN_ID_LIMIT - 1]
    with open_store(tmp_path / "s", identity=MODEL, chunk_tokens=8) as s:
        s.save("big", np.array(tokens, dtype=np.uint32), make_caches("mla", N, 4))
        assert s.restore("big").tokens == tokens
        assert s.lookup([*tokens, 1]).length == N


@pytest.mark.parametrize("prompt", [np.array([TOKENS]), mx.array([TOKENS]), np.array(TOKENS, dtype=np.float64),
                                    "abc", None, 5, [1.5, 2.5, 3.5], [-1, 2, 3], np.array([-1, 2, 3])])
def test_hostile_prompts_are_refused_by_lookup_and_restore_prefix(store, prompt) -> None:
    for call in (store.lookup, store.restore_prefix):
        with pytest.raises(InvalidCacheState, match="tokens"):
            call(prompt)
    still_serving(store)


def test_snapshot_ids_lengths_and_batch_requests(store) -> None:
    sid = store.sessions()[0].snapshot_id
    with pytest.raises(InvalidCacheState, match="snapshot_id"):
        store.restore_snapshot("zz")
    with pytest.raises(InvalidCacheState, match="snapshot_id"):
        store.restore_snapshot("g" * 32)
    with pytest.raises(WrongArgumentType):
        store.restore_snapshot(3)
    with pytest.raises(SnapshotNotFound):
        store.restore_snapshot("0" * 32)
    assert store.restore_snapshot(sid.upper()).tokens == TOKENS  # hex is case-insensitive
    for length, error in (("3", WrongArgumentType), (2.0, WrongArgumentType), (True, WrongArgumentType),
                          (-1, InvalidCacheState), (N + 1, InvalidCacheState)):
        with pytest.raises(error):
            store.restore_snapshot(sid, length)
    with pytest.raises(InvalidCacheState, match="session_id"):
        store.restore("")
    with pytest.raises(WrongArgumentType, match="namespace"):
        store.lookup(TOKENS, namespace=3)
    for requests, error in (([("a",)], InvalidCacheState), ([("a", "", "b")], InvalidCacheState),
                            ([], InvalidCacheState), ("keep", WrongArgumentType), (None, WrongArgumentType),
                            ([3], WrongArgumentType), ([PrefixHit("keep", "zz", 3)], InvalidCacheState),
                            ([PrefixHit("keep", sid, "3")], WrongArgumentType), ([("keep", None)], WrongArgumentType)):
        with pytest.raises(error):
            store.restore_batch(requests)
    with pytest.raises(SnapshotNotFound):
        store.restore_batch(["keep", "missing"])
    with pytest.raises(InvalidCacheState, match="snapshot_id"):
        store.admin.manifest("zz")
    still_serving(store)


@pytest.mark.parametrize("caches, error", [
    ([object()], IncompatibleFormat), ([3, 4], IncompatibleFormat), ("abc", InvalidCacheState),
    ([], InvalidCacheState), (None, InvalidCacheState), (7, InvalidCacheState),
])
def test_wrong_cache_objects(store, tmp_path, caches, error) -> None:
    with pytest.raises(error):
        store.save("new", TOKENS, caches)
    with pytest.raises(KvShelfError):
        save_snapshot(tmp_path / "c.safetensors", TOKENS, caches if caches != [] else [object()])
    assert not (tmp_path / "c.safetensors").exists()
    still_serving(store)


def test_mismatched_and_batched_caches(store) -> None:
    with pytest.raises(InvalidCacheState, match="positions"):
        store.save("new", TOKENS[:-1], make_caches("mla", N, 2))
    batched = []
    for row in make_caches("mla", N, 2):
        batch = row.make_empty_batch()
        batch.merge_rows([row, row])
        batched.append(batch)
    with pytest.raises(InvalidCacheState):
        store.save("new", TOKENS, batched)
    still_serving(store)


@pytest.mark.parametrize("fields, error", [
    ((3,), WrongArgumentType), ((None,), WrongArgumentType), (("m", 3), WrongArgumentType),
    (("a\x00",), InvalidCacheState), (("\ud800",), InvalidCacheState), (("m", "", "\udfff"), InvalidCacheState),
    (("x" * 1025,), InvalidCacheState), (("é" * 513,), InvalidCacheState),
])
def test_identity_with_hostile_fields(fields, error) -> None:
    with pytest.raises(error, match="Identity"):
        Identity(*fields)
    with pytest.raises(TypeError if error is WrongArgumentType else ValueError):  # the builtin mixins still hold
        Identity(*fields)


def test_open_store_with_hostile_options(tmp_path) -> None:
    with pytest.raises(WrongArgumentType, match="identity"):
        open_store(tmp_path / "s")
    with pytest.raises(WrongArgumentType, match="identity"):
        open_store(tmp_path / "s", identity="model")
    for options in ({"chunk_tokens": 0}, {"chunk_tokens": "8"}, {"max_bytes": -1}, {"max_bytes": "1"}):
        with pytest.raises(InvalidCacheState):
            open_store(tmp_path / "s", identity=MODEL, **options)


def test_snapshot_files_on_hostile_paths(tmp_path) -> None:
    caches = make_caches("mla", N, 5)
    for path, error in ((3, WrongArgumentType), (None, WrongArgumentType), (b"/tmp/x", WrongArgumentType),
                        ("", InvalidCacheState), ("a\x00b", InvalidCacheState)):
        for call in (save_snapshot, load_snapshot, read_header):
            with pytest.raises(error):
                call(path, TOKENS, caches) if call is save_snapshot else call(path)
    missing = tmp_path / "nope" / "s.safetensors"
    for call in (lambda: save_snapshot(missing, TOKENS, caches), lambda: load_snapshot(missing),
                 lambda: read_header(missing)):
        with pytest.raises(FileMissing) as info:
            call()
        assert isinstance(info.value, FileNotFoundError)  # watchers that catch FileNotFoundError keep working
    (tmp_path / "plain").write_bytes(b"x")
    with pytest.raises(FileAccessError):
        save_snapshot(tmp_path / "plain" / "s.safetensors", TOKENS, caches)  # a file where a directory should be
    for call in (load_snapshot, read_header):
        with pytest.raises(CorruptData, match="regular file"):
            call(tmp_path)  # a directory
        with pytest.raises(CorruptData, match="regular file"):
            call(os.devnull)
        fifo = tmp_path / "fifo.safetensors"
        if not fifo.exists():
            os.mkfifo(fifo)
        with pytest.raises(CorruptData, match="regular file"):  # refused without blocking on the open
            call(fifo)


@pytest.mark.parametrize("content", [b"", b"\x00" * 7, b"\xff" * 64, (2**63).to_bytes(8, "little") + b"{}",
                                     (2).to_bytes(8, "little") + b"{}", (5).to_bytes(8, "little") + b"[1,2]",
                                     (12).to_bytes(8, "little") + b'{"a": "\xff\xfe"}'])
def test_snapshot_files_with_hostile_contents(tmp_path, content) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    for call in (load_snapshot, read_header):
        with pytest.raises(CorruptData):
            call(path)


# -- properties: any argument of these shapes gives success or a KvShelfError, never anything else -------------

HOSTILE = st.one_of(
    st.text(max_size=40), st.text(min_size=440, max_size=600), st.binary(max_size=40),
    st.integers(min_value=-(2**70), max_value=2**70), st.none(),
    st.lists(st.integers(min_value=-(2**64), max_value=2**64), max_size=40),
    st.lists(st.one_of(st.text(max_size=5), st.floats(), st.none()), max_size=5),
    st.tuples(st.text(max_size=5)), st.tuples(st.text(max_size=5), st.integers()),
)


@pytest.fixture(scope="module")
def fuzz_store(tmp_path_factory):
    with open_store(tmp_path_factory.mktemp("fuzz") / "store", identity=MODEL, chunk_tokens=8) as s:
        s.save("keep", TOKENS, make_caches("mla", N, 1))
        yield s


def _only_kvshelf_errors(call) -> None:
    try:
        call()
    except KvShelfError:
        pass


@settings(max_examples=60)
@given(a=HOSTILE, b=HOSTILE, c=HOSTILE)
def test_any_argument_gives_success_or_a_kvshelf_error(fuzz_store, a, b, c) -> None:
    store = fuzz_store
    caches = make_caches("mla", 4, 6, layers=1)
    for call in (
        lambda: store.save(a, b, caches, namespace=c), lambda: store.save("p", a, caches, namespace=b),
        lambda: store.restore(a, namespace=b), lambda: store.restore_snapshot(a, b),
        lambda: store.lookup(a, namespace=b), lambda: store.restore_prefix(a, namespace=b),
        lambda: store.restore_batch(a), lambda: store.restore_batch([a, b]), lambda: store.delete(a, namespace=b),
        lambda: store.sessions(a), lambda: Identity(a, b, c), lambda: store.admin.manifest(a),
    ):
        _only_kvshelf_errors(call)
    store.flush()


@settings(max_examples=40)
@given(a=HOSTILE, b=HOSTILE)
def test_any_argument_to_snapshot_files_gives_success_or_a_kvshelf_error(tmp_path_factory, a, b) -> None:
    target = tmp_path_factory.mktemp("fuzz") / "f.safetensors"
    caches = make_caches("mla", 4, 6, layers=1)
    _only_kvshelf_errors(lambda: save_snapshot(target, a, caches, identity=b))
    _only_kvshelf_errors(lambda: save_snapshot(target, [1, 2, 3, 4], caches, identity={"model_id": a}))
    if isinstance(a, str) and not os.path.isabs(a):  # relative paths: looked up in the empty fuzz directory
        a = str(target.parent / a)
    for call in (lambda: load_snapshot(a, expect=b), lambda: read_header(a)):
        _only_kvshelf_errors(call)


@settings(max_examples=60)
@given(a=HOSTILE, b=HOSTILE)
def test_any_argument_to_the_codecs_gives_success_or_a_kvshelf_error(a, b) -> None:
    from kvshelf.codecs import default_provider
    from kvshelf.codecs.header import decode_entry, decode_header, decode_header_json

    calls = [lambda: default_provider.for_cache(a), lambda: default_provider.for_entry(a),
             lambda: default_provider.load(a, b), lambda: default_provider.validate_header(a),
             lambda: default_provider.snapshot(a), lambda: decode_header(a), lambda: decode_header_json(a),
             lambda: decode_entry(a), lambda: default_provider.check_provider(a)]
    for kind in default_provider.kinds:
        codec = default_provider.for_entry(kind)
        calls += [lambda c=codec: c.load(a, b), lambda c=codec: c.load_batch(a, b), lambda c=codec: c.validate(a),
                  lambda c=codec: c.header_trimmable(a), lambda c=codec: c.prefix_entry(a, b),
                  lambda c=codec: c.snapshot(a), lambda c=codec: c.matches(a)]
        if hasattr(codec, "batch_plan"):
            calls += [lambda c=codec: c.batch_plan(a), lambda c=codec: c.adopt_batch(a, b)]
    for call in calls:
        _only_kvshelf_errors(call)


def test_tools_refuse_hostile_arguments(tmp_path) -> None:
    from kvshelf.tools import admin, transfer

    root = tmp_path / "s"
    with open_store(root, identity=MODEL, chunk_tokens=8) as s:
        s.save("keep", TOKENS, make_caches("mla", N, 1))
    out = tmp_path / "x.safetensors"
    calls = [lambda: transfer.import_file(root, 3), lambda: transfer.import_file(3, out),
             lambda: transfer.import_file(root, tmp_path, session_id=3), lambda: transfer.export_session(root, 3, out),
             lambda: transfer.export_session(root, "keep", 3), lambda: transfer.export_session(None, "keep", out),
             lambda: transfer.session_id_for(3), lambda: admin.rebuild_index(3), lambda: transfer.watch_inbox(root, 3),
             lambda: open_store(3, admin=True), lambda: open_store(b"/tmp/s", admin=True),
             lambda: admin.open_admin(None).__enter__()]
    with admin.open_admin(root) as store:
        calls += [lambda: admin.show(store, 3), lambda: admin.find_session(store, None)]
        for call in calls:
            with pytest.raises(KvShelfError):
                call()
    assert not out.exists()
