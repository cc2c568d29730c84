"""Structure of measure 14 (the latent legos' decode step) at a tiny size, and that ``--only 14`` reaches it.

Nothing here checks a speed: every row carries real repetitions and a ratio against a baseline measured in the
same call, memory rows compare held bytes with the encoded planes' bytes, and the default run still lists 1-11.
"""

from __future__ import annotations

import pytest

from benchmarks import cli, decode


def test_step_rows_measure_every_lego_against_its_baseline():
    rows = decode.step_rows((96,), reps=2, steps=2)
    names = {r.name for r in rows}
    for lego in ("MLACache", "paged f32", "encoded affine8", "encoded turbo k8", "paged affine8", "paged turbo k8",
                 "encoded affine8 read buffer", "encoded turbo k8 read buffer"):
        assert f"decode step {lego} @ 96 tok" in names, lego
    for row in rows:
        assert row.measure == "14" and row.value is not None and row.baseline is not None
        assert row.ratio == pytest.approx(row.value.median / row.baseline.median)
        if row.name.startswith("decode step"):
            assert len(row.value.reps) == 2 and row.value.unit == "ms"
    memory = {r.name: r for r in rows if r.name.startswith("memory")}
    assert memory["memory encoded affine8 @ 96 tok"].check == "ratio"
    assert memory["memory encoded affine8 read buffer @ 96 tok"].check == "none"
    assert memory["memory encoded affine8 read buffer @ 96 tok"].ratio > memory["memory encoded affine8 @ 96 tok"].ratio


def test_model_rows_report_tokens_per_second():
    rows = decode.model_rows((64,), reps=1)
    assert {r.name for r in rows} == {f"synthetic model decode ({k}) @ 64 tok" for k in decode.MODEL_KINDS}
    assert all(r.value.unit == "tok/s" and r.value.median > 0 for r in rows)


def test_measure_14_runs_on_request_only():
    assert "14" not in cli.ALL and "14" in cli.KNOWN
    assert cli.parse_args(["--only", "14"]).only == {"14"}
    assert "14" not in cli.parse_args([]).only
