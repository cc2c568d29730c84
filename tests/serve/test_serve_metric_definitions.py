"""Every ``/metrics`` family comes from one table (``METRICS``): what the exposition holds is exactly what the table
defines, with its help text and labels, and every counted series exists from the start. In process: the families are
built from the table, so no server is needed to check that correspondence (tests/serve/test_serve_metrics.py
scrapes real servers)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from kvshelf.mlx_lm.serve.metrics import METRICS, ServeMetrics
from kvshelf.mlx_lm.serve.prompt_cache import FetchOutcome


def families(metrics: ServeMetrics) -> dict:
    """The families by name; the ``<name>_created`` gauges the text format adds for a counted series are not
    families of their own (prometheus_client writes them so)."""
    counted = {d.name for d in METRICS if d.read is None}
    return {f.name: f for f in text_string_to_metric_families(metrics.exposition().decode())
            if not (f.name.endswith("_created") and f.name.removesuffix("_created") in counted)}


def test_the_exposition_is_the_table():
    m = ServeMetrics(lambda: {"stores": [], "pending_writes": 2, "generations": {"checkpoints_durable": 3}})
    m.observe_fetch(FetchOutcome("disk", 10, 20, 0, None, 0.004, 1.0, prefix_checkpoint=True))
    got = families(m)
    assert set(got) == {d.name for d in METRICS}  # the parser drops a counter's _total: the definitions' names
    for d in METRICS:
        family = got[d.name]
        assert (family.type, family.documentation) == (d.kind, d.help)
        for sample in family.samples:
            assert set(sample.labels) - {"le"} == set(d.labels), (d.name, sample)
        for labels in d.series:
            assert any(tuple(s.labels[k] for k in d.labels) == labels for s in family.samples), (d.name, labels)
    value = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in got.values() for s in f.samples}
    assert value[("kvshelf_checkpoint_hits_total", ())] == 1
    assert value[("kvshelf_restore_seconds_bucket", (("le", "0.005"), ("tier", "disk")))] == 1
    assert value[("kvshelf_restore_seconds_bucket", (("le", "0.0025"), ("tier", "disk")))] == 0
    assert value[("kvshelf_write_queue_depth", ())] == 2
    assert value[("kvshelf_generation_checkpoints_total", (("outcome", "durable"),))] == 3
