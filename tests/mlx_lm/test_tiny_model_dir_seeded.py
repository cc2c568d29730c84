"""The tiny model directories the serving tests build are the same bytes in every process (issue 22): qwen3_next's
constructor draws ``A_log`` from MLX's global generator, so without a seed a server and its reference — separate
processes — loaded different models. Here the global generator is left in two different states before two builds."""

from __future__ import annotations

import pytest

import mlx.core as mx
from tiny_model_dir import make_model_dir


@pytest.mark.parametrize("arch", ["qwen3_next", "mamba2"])
def test_a_model_dir_does_not_depend_on_the_global_random_state(tmp_path, arch) -> None:
    mx.random.seed(1)
    a = make_model_dir(tmp_path / "a", arch, seed=3)
    mx.random.seed(2)
    mx.random.normal((7,))
    b = make_model_dir(tmp_path / "b", arch, seed=3)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
