"""Structure of measure 24 (decode on encoded latent planes) at a tiny size, and that ``--only 24`` reaches it.

Nothing here checks a speed: every step row carries real repetitions and a ratio against mlx-lm's ``KVCache``
measured in the same call; memory rows carry measured bytes against mlx-lm's held bytes or one decoded plane.
"""

from __future__ import annotations

import pytest

from benchmarks import cli, decode_planes


def test_step_rows_measure_every_face_against_mlx_lm_in_one_run():
    rows, facts = decode_planes.step_rows((64,), reps=2, steps=1)
    names = {r.name for r in rows}
    for face in decode_planes.STEP_TARGETS:
        assert f"decode step {face} @ 64 tok" in names, face
        assert f"memory held after a step {face} @ 64 tok" in names, face
    for row in rows:
        assert row.measure == "24" and row.value is not None and row.baseline is not None
        assert row.ratio == pytest.approx(row.value.median / row.baseline.median)
        if row.name.startswith("decode step"):
            assert len(row.value.reps) == 2 and row.value.unit == "ms"
    held = {r.name: r for r in rows if r.name.startswith("memory held")}
    # encoded planes hold less than mlx-lm's float32 latent, and 4-bit less than 8-bit
    four, eight = (held[f"memory held after a step affine {b} @ 64 tok"].ratio for b in (4, 8))
    assert four < eight < 1
    longest = decode_planes.longest_context_rows(facts, (64,))
    assert all(r.value.median > 0 and r.check == "ratio-min" for r in longest)


def test_measure_24_runs_on_request_only():
    assert "24" not in cli.ALL and "24" in cli.KNOWN
    assert cli.parse_args(["--only", "24"]).only == {"24"}


def test_dsa_rows_measure_each_face_against_mlx_lm_on_a_glm_moe_dsa_layer(monkeypatch):
    monkeypatch.setattr(decode_planes, "INDEX_TOPK", 16)  # a history longer than the top-k: the sparse gather runs
    rows = decode_planes.dsa_rows((64,), reps=2, steps=1)
    names = {r.name for r in rows}
    for face in ("affine 8", "affine 4", "turbo k8", "turbo k4"):
        assert f"glm_moe_dsa decode step {face} @ 64 tok" in names, face
        assert f"glm_moe_dsa peak of one step above the cache {face} @ 64 tok" in names, face
    for row in rows:
        assert row.measure == "24" and row.value is not None and row.baseline is not None
        assert row.ratio == pytest.approx(row.value.median / row.baseline.median)
