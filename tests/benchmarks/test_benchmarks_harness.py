"""The harness's two promises that every measure relies on: kvshelf and its baseline are timed interleaved (one
warm-up of each, then A B A B …), and only an absent optional dependency may pass as "not available"."""

from __future__ import annotations

from benchmarks.harness import MissingDependency, Timed, absent_dependency, failure_row, time_interleaved


def test_sides_are_interleaved_after_a_warm_up_of_each():
    calls: list[str] = []

    def side(name: str) -> Timed:
        return Timed(lambda arg: calls.append(f"{name}:{arg}"), setup=lambda: name.upper(),
                     teardown=lambda arg: calls.append(f"{name}-done"))

    got = time_interleaved({"a": side("a"), "b": side("b")}, reps=3, collect=False)
    runs = [c for c in calls if not c.endswith("-done")]
    assert runs == ["a:A", "b:B"] + ["a:A", "b:B"] * 3
    assert calls.count("a-done") == calls.count("b-done") == 4  # teardown after every run, warm-up included
    assert [len(s.reps) for s in got.values()] == [3, 3]  # the warm-up is not a repetition
    assert all(s.unit == "ms" and s.min <= s.median for s in got.values())


def test_a_plain_callable_is_a_side_without_setup():
    seen = []
    got = time_interleaved({"x": seen.append}, reps=2, warmup=0, collect=False)
    assert seen == [None, None] and len(got["x"].reps) == 2


def test_only_an_absent_optional_package_or_binary_is_not_available():
    assert absent_dependency(ModuleNotFoundError("No module named 'mlx_lm'", name="mlx_lm")) == \
        "mlx_lm is not installed"
    assert absent_dependency(ModuleNotFoundError("x", name="redis.cluster")) == "redis is not installed"
    assert absent_dependency(MissingDependency("redis-server not on the PATH")) == "redis-server not on the PATH"
    # a name missing from an installed package, kvshelf's own modules and any other error are failures
    assert absent_dependency(ImportError("cannot import name 'KVCache'", name="mlx_lm.models.cache")) is None
    assert absent_dependency(ModuleNotFoundError("x", name="kvshelf.store.gone")) is None
    assert absent_dependency(ModuleNotFoundError("x", name="numpy")) is None
    assert absent_dependency(RuntimeError("boom")) is None


def test_failure_row_says_failed_with_the_exception_or_not_available():
    row = failure_row("8", "bytes on disk", RuntimeError("open_store broken"))
    assert row.failed == "RuntimeError: open_store broken" and row.unavailable is None and row.met is None
    row = failure_row("31", "serve", ModuleNotFoundError("no", name="prometheus_client"))
    assert row.unavailable == "prometheus_client is not installed" and row.failed is None
