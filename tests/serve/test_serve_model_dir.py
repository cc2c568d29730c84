"""The tiny model directory is a real model (plain mlx_lm.server serves it), and its identity is computed from the
files that define it: config.json, the safetensors headers, the tokenizer files, and the weights' content
(``test_serve_identity_moves.py``: copies, other weights, the sidecar)."""

from __future__ import annotations

import json
import shutil
import struct

import pytest

from serve_harness import Server, conversation
from tiny_model_dir import make_model_dir, words

from kvshelf.errors import CorruptData, KvShelfError
from kvshelf.mlx_lm.serve.model_identity import ModelFilesError, model_id_of, model_identity, safetensors_header


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("tiny") / "llama", "llama", seed=0)


def test_plain_mlx_lm_server_serves_the_tiny_model_dir(model_dir, tmp_path):
    with Server(model_dir, None, tmp_path / "plain.log") as server:
        a = server.chat(conversation(words(30), ["hello world"], []), max_tokens=6)
        b = server.chat(conversation(words(30), ["hello world"], []), max_tokens=6)
    assert a["completion_tokens"] == 6 and a["text"].strip()
    assert a["text"] == b["text"]  # temperature 0: deterministic
    assert b["cached_tokens"] > 0  # mlx-lm's own RAM cache served the repeat


def _copy(model_dir, dst):
    shutil.copytree(model_dir, dst)
    return dst


def test_identity_is_stable_and_names_the_weights_not_the_directory(model_dir):
    a, b = model_identity(model_dir), model_identity(str(model_dir) + "/")
    assert a == b and a.model_id.startswith("weights:") and len(a.model_id) == len("weights:") + 32
    assert len(a.config_fingerprint) == 64 and len(a.tokenizer_hash) == 64


def test_the_config_fingerprint_reads_only_headers(model_dir, tmp_path):
    """Same header, other weight bytes (here: the data region overwritten) -> the same config fingerprint (the
    model id, a content hash, tells them apart); the fingerprint reads each file only up to its header."""
    other = _copy(model_dir, tmp_path / "other")
    weights = other / "model.safetensors"
    n = struct.unpack("<Q", weights.read_bytes()[:8])[0]
    with open(weights, "r+b") as f:
        f.seek(8 + n)
        f.write(b"\x7f" * 4096)
    assert model_identity(other).config_fingerprint == model_identity(model_dir).config_fingerprint
    assert model_identity(other).model_id != model_identity(model_dir).model_id
    with open(weights, "r+b") as f:  # and a file cut right after its header still fingerprints (no data read)
        f.truncate(8 + n)
    assert model_identity(other).config_fingerprint == model_identity(model_dir).config_fingerprint


def test_config_header_tokenizer_template_and_kv_settings_change_the_identity(model_dir, tmp_path):
    base = model_identity(model_dir)
    cfg = _copy(model_dir, tmp_path / "cfg")
    config = json.loads((cfg / "config.json").read_text())
    config["rms_norm_eps"] = 1e-6
    (cfg / "config.json").write_text(json.dumps(config))
    assert model_identity(cfg).config_fingerprint != model_identity(_copy(model_dir, tmp_path / "same"))\
        .config_fingerprint

    tpl = _copy(model_dir, tmp_path / "tpl")
    tc = json.loads((tpl / "tokenizer_config.json").read_text())
    tc["chat_template"] = tc["chat_template"].replace("<|end|>", "<|end|> ")
    (tpl / "tokenizer_config.json").write_text(json.dumps(tc))
    assert model_identity(tpl).tokenizer_hash != model_identity(tmp_path / "same").tokenizer_hash
    assert model_identity(model_dir, chat_template="{{ x }}").tokenizer_hash != base.tokenizer_hash
    quant = model_identity(model_dir, cache_settings={"kv_bits": 8, "kv_group_size": 32, "quantized_kv_start": 0})
    assert quant.config_fingerprint != base.config_fingerprint and quant.model_id == base.model_id

    seeded = make_model_dir(tmp_path / "seed1", "llama", seed=1)  # same shapes, other values: told apart by content
    assert model_identity(seeded).config_fingerprint == base.config_fingerprint
    assert model_identity(seeded) != base


def test_hub_snapshot_paths_name_repo_and_revision(tmp_path):
    snap = tmp_path / "hub" / "models--org--tiny-model" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    assert model_id_of("org/tiny-model", snap) == "org/tiny-model@abc123"


def test_bad_model_files_are_clear_errors(model_dir, tmp_path):
    with pytest.raises(ModelFilesError) as exc:
        model_identity(tmp_path / "no-such-model")
    assert isinstance(exc.value, KvShelfError) and isinstance(exc.value, FileNotFoundError)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelFilesError, match="config.json"):
        model_identity(empty)
    bad = _copy(model_dir, tmp_path / "bad")
    (bad / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(CorruptData, match="header length"):
        model_identity(bad)
    (bad / "model.safetensors").write_bytes(struct.pack("<Q", 10) + b"{not json}")
    with pytest.raises(CorruptData, match="not JSON"):
        safetensors_header(bad / "model.safetensors")


def test_serve_cli_usage_errors_and_help(tmp_path):
    from serve_harness import kvshelf_cli

    missing = kvshelf_cli("serve", "--model", str(tmp_path))
    assert missing.returncode == 2 and "--store" in missing.stderr
    unknown = kvshelf_cli("serve", "--store", str(tmp_path / "s"), "--no-such-option")
    assert unknown.returncode == 2 and "--no-such-option" in unknown.stderr
    shown = kvshelf_cli("serve", "--help")
    assert shown.returncode == 0
    assert "--cache-namespace" in shown.stdout and "--prompt-cache-size" in shown.stdout  # ours and mlx-lm's


def test_serve_without_mlx_lm_is_a_clear_usage_error_and_the_core_cli_still_works(tmp_path):
    """A sitecustomize that makes ``import mlx_lm`` fail stands in for an environment without mlx-lm."""
    import subprocess
    import sys

    from serve_harness import server_env

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys\nsys.modules['mlx_lm'] = None\n")
    env = server_env()
    env["PYTHONPATH"] = f"{site}:{env['PYTHONPATH']}"

    def run(*args):
        return subprocess.run([sys.executable, "-m", "kvshelf.tools.cli", *args], env=env, capture_output=True,
                              text=True, timeout=120, check=False)

    serve = run("serve", "--model", str(tmp_path), "--store", str(tmp_path / "s"))
    assert serve.returncode == 2 and "needs mlx-lm" in serve.stderr
    from kvshelf import Identity, open_store

    open_store(tmp_path / "s", identity=Identity("m")).close()
    listing = run("ls", "--store", str(tmp_path / "s"), "--json")
    assert listing.returncode == 0, listing.stderr


def test_a_taken_port_ends_kvshelf_serve_instead_of_hanging(model_dir, tmp_path):
    import socket
    import subprocess
    import sys

    from serve_harness import server_env

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "kvshelf.tools.cli", "serve", "--store", str(tmp_path / "s"),
                               "--model", str(model_dir), "--port", str(port)], env=server_env(),
                              capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 1 and "the server failed" in proc.stderr  # plain mlx_lm.server hangs here


def test_adapter_and_draft_model_are_part_of_the_identity(model_dir, tmp_path):
    import mlx.core as mx

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"fine_tune_type": "lora", "num_layers": 2}))
    mx.save_safetensors(str(adapter / "adapters.safetensors"), {"a": mx.zeros((2, 2))})
    base = model_identity(model_dir)
    tuned = model_identity(model_dir, adapter_path=adapter)
    assert tuned.model_id.startswith(base.model_id + "+adapter:") and tuned.config_fingerprint != base.config_fingerprint
    draft = make_model_dir(tmp_path / "draft", "llama", seed=2)
    assert model_identity(model_dir, draft_model=draft).config_fingerprint != base.config_fingerprint
