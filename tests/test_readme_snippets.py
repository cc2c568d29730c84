"""Every python snippet of README.md runs as written, as a new user would paste it.

Why: the README is the first code a newcomer runs; a snippet that leaves out its imports or saves the wrong tokens
fails on the first try (the mlx-lm one once did). So the snippets are not copies kept in a test, they are read out of the
README itself: each ```python block runs in its own Python process, in a fresh temporary working directory (the
snippets open their store at ``./kvshelf-store``), with nothing but text substitutions for the placeholders the
README documents — ``path/to/model`` becomes a tiny seeded llama directory and ``path/to/mla-model`` a tiny seeded
deepseek_v3 directory, both built offline (no download: ``HF_HUB_OFFLINE=1``). A snippet that raises, or leaves a
store that does not list its session or does not verify clean, fails the test.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tiny_model_dir import VOCAB, make_model_dir, write_tokenizer

from kvshelf import open_store


def _repo_root() -> Path:
    here = Path(__file__).resolve().parent
    while not (here / "pyproject.toml").is_file():
        if here.parent == here:
            raise RuntimeError("no pyproject.toml above the tests")
        here = here.parent
    return here


ROOT = _repo_root()
README = ROOT / "README.md"
PLACEHOLDERS = ("path/to/model", "path/to/mla-model")
STORE_DIR = "kvshelf-store"


def python_blocks(text: str) -> list[tuple[str, str]]:
    """(the heading above it, the body) of each ```python fenced block, in order."""
    blocks = []
    for match in re.finditer(r"^```python\n(.*?)^```$", text, flags=re.MULTILINE | re.DOTALL):
        headings = re.findall(r"^#+ (.*)$", text[:match.start()], flags=re.MULTILINE)
        blocks.append((headings[-1] if headings else "top", match.group(1)))
    return blocks


NAMED_BLOCKS = python_blocks(README.read_text(encoding="utf-8"))
BLOCKS = [body for _, body in NAMED_BLOCKS]


# Small MLA widths (multiples of 32, so the affine and TurboQuant latent formats apply), as the mlx-lm tests use.
_DEEPSEEK_V3 = dict(  # noqa: C408
    model_type="deepseek_v3", vocab_size=len(VOCAB), hidden_size=48, intermediate_size=64, moe_intermediate_size=32,
    num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1, n_routed_experts=4,
    routed_scaling_factor=1.0, kv_lora_rank=64, q_lora_rank=24, qk_rope_head_dim=32, v_head_dim=16,
    qk_nope_head_dim=16, topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True, n_group=1, topk_group=1,
    num_experts_per_tok=2, moe_layer_freq=1, first_k_dense_replace=1, max_position_embeddings=512, rms_norm_eps=1e-6,
    attention_bias=False, rope_theta=10000.0, eos_token_id=VOCAB.index("<|end|>"), bos_token_id=VOCAB.index("<s>"),
)


def _mla_model_dir(path: Path) -> Path:
    """A loadable tiny deepseek_v3 directory: config.json, seeded float32 weights, the tiny tokenizer."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import deepseek_v3

    path.mkdir(parents=True)
    mx.random.seed(20261201)
    model = deepseek_v3.Model(deepseek_v3.ModelArgs.from_dict(_DEEPSEEK_V3))
    model.set_dtype(mx.float32)
    weights = dict(tree_flatten(model.parameters()))
    mx.eval(list(weights.values()))
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(_DEEPSEEK_V3, indent=1, sort_keys=True))
    write_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("readme-models")
    return {"path/to/model": make_model_dir(base / "llama", arch="llama", seed=0),
            "path/to/mla-model": _mla_model_dir(base / "deepseek_v3")}


def test_the_readme_has_its_snippets():
    """The mlx-lm quick start, the MLA quick start and kvshelf's own caches; and no placeholder the test misses."""
    assert len(BLOCKS) >= 3, f"README.md has {len(BLOCKS)} python blocks"
    assert any('"path/to/model"' in b for b in BLOCKS)
    assert any('"path/to/mla-model"' in b for b in BLOCKS)
    for block in BLOCKS:
        for placeholder in re.findall(r'"(path/to/[^"]*)"', block):
            assert placeholder in PLACEHOLDERS, f"unknown placeholder {placeholder!r}: teach this test to fill it"


def test_the_mlx_lm_snippet_saves_the_prompt_plus_the_generated_tokens():
    """The quick start says what `tokens` are: the prompt plus every generated token fed back (the cache offset)."""
    mlx_lm_block = next(b for b in BLOCKS if '"path/to/model"' in b)
    assert "tokens = prompt + generated" in mlx_lm_block
    assert "len(tokens) == cache[0].offset" in mlx_lm_block
    assert re.search(r"^from mlx_lm import load$", mlx_lm_block, flags=re.MULTILINE)


@pytest.mark.parametrize("block", BLOCKS, ids=[re.sub(r"\W+", "-", name).strip("-") for name, _ in NAMED_BLOCKS])
def test_snippet_runs_as_written(block: str, model_dirs: dict[str, Path], tmp_path: Path):
    source = block
    for placeholder, directory in model_dirs.items():
        source = source.replace(f'"{placeholder}"', json.dumps(str(directory)))
    script = tmp_path / "snippet.py"
    script.write_text(source, encoding="utf-8")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", KVSHELF_STORE=str(tmp_path / STORE_DIR),
               PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, (f"README snippet failed (exit {done.returncode}):\n{source}\n"
                                  f"--- stderr ---\n{done.stderr}")

    store_dir = tmp_path / STORE_DIR
    if "open_store(" in block:
        with open_store(store_dir, admin=True) as store:
            assert [s.session_id for s in store.admin.summaries().values()] == ["chat-1"]
            assert store.verify(deep=True) == []
