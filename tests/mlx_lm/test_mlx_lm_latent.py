"""kvshelf's latent legos inside mlx-lm's MLA models (``kvshelf.mlx_lm.make_prompt_cache``) on tiny deepseek_v3 and
glm_moe_dsa models built from mlx-lm's own classes.

float32 latents are bit-identical to mlx-lm's caches over prefill and greedy decode; every scheme saved to a real
store and restored in a fresh process continues bit-identically to the uninterrupted run on the same legos;
batches and BatchGenerator work on restored rows. The KL table of the compressed schemes against f32 is printed
with the test output (run with ``-s`` to see it in context).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as lm_cache
from mlx_lm_latent_cases import log_probs, provider
from mlx_lm_models import (
    MLA_NAMES,
    PROMPT,
    build,
    continue_greedy,
    forward,
    greedy,
    same,
    same_run,
)

from kvshelf import Identity, open_store
from kvshelf.errors import CacheRangeError, InvalidCacheState
from kvshelf.latent_legos import KvScheme
from kvshelf.latent_legos.latent.mla import MLACache
from kvshelf.latent_legos.latent.paged import PagedLatentCache
from kvshelf.mlx_lm import make_prompt_cache
from kvshelf.mlx_lm.latent.cache import DSALatentCache, MLALatentCache

HERE = Path(__file__).parent
STEPS = 4
SCHEMES = {
    "f32": (None, None),
    "affine4": (KvScheme.affine(4, 32), None),
    "turbo8@12": (KvScheme.turbo(8, 3, quantized_kv_start=12), None),  # converts mid-decode, f32 before
    "paged-f32": (None, 4),
    "paged-affine8": (KvScheme.affine(8, 32), 8),
}


@pytest.mark.parametrize("name", [*MLA_NAMES, "glm4_moe_lite"])
@pytest.mark.parametrize("paged", [None, 4])
def test_f32_latents_are_bit_identical_to_mlx_lm_caches(name, paged):
    model = build(name)
    caches = make_prompt_cache(model, paged_block_size=paged)
    adapter = DSALatentCache if name == "glm_moe_dsa" else MLALatentCache
    assert all(type(c) is adapter for c in caches)
    assert all(type(c.lego) is (PagedLatentCache if paged else MLACache) for c in caches)
    ours = greedy(model, PROMPT, caches, steps=6)
    assert same_run(ours, greedy(model, PROMPT, lm_cache.make_prompt_cache(model), steps=6))
    assert caches[0].offset == len(PROMPT) + 6 and lm_cache.can_trim_prompt_cache(caches)
    assert lm_cache.trim_prompt_cache(caches, 3) == 3 and caches[0].offset == len(PROMPT) + 3


def test_non_mla_models_get_mlx_lm_caches_and_bad_arguments_are_refused():
    assert [type(c) for c in make_prompt_cache(build("llama"))] == [lm_cache.KVCache] * 2
    assert [type(c) for c in make_prompt_cache(build("qwen3"), max_kv_size=8)] == [lm_cache.RotatingKVCache] * 2
    assert [type(c) for c in make_prompt_cache(build("qwen3_next"))] == [lm_cache.ArraysCache, lm_cache.KVCache]
    with pytest.raises(InvalidCacheState, match="KvScheme"):
        make_prompt_cache(build("deepseek_v3"), scheme="affine")


def test_max_kv_size_caps_an_mla_layer_with_a_clear_error():
    model = build("deepseek_v3")
    caches = make_prompt_cache(model, max_kv_size=12)
    greedy(model, PROMPT, caches, steps=2)
    with pytest.raises(CacheRangeError):
        forward(model, [1], caches)


def test_a_dsa_step_without_its_indexer_keys_is_refused():
    model = build("glm_moe_dsa")
    cache = make_prompt_cache(model, scheme=KvScheme.affine(8, 32))[0]
    g = cache.lego.geometry
    cache[0].update_and_fetch(mx.zeros((1, 1, 3, g.kv_lora_rank)), mx.zeros((1, 1, 3, g.rope_head_dim)))
    assert cache[1].offset == 0  # the indexer ropes its keys at the positions before the step
    again = (mx.zeros((1, 1, 1, g.kv_lora_rank)), mx.zeros((1, 1, 1, g.rope_head_dim)))
    for call in (lambda: cache.state, lambda: cache.trim(1), lambda: cache.extract(0),
                 lambda: cache[0].update_and_fetch(*again)):
        with pytest.raises(InvalidCacheState, match="indexer keys have not arrived"):
            call()
    keys, _ = cache[1].update_and_fetch(mx.ones((1, 1, 3, g.index_head_dim)), mx.ones((1, 1, 3, g.index_head_dim)))
    assert keys.shape == (1, 1, 3, g.index_head_dim) and cache.offset == 3 and len(cache.state) > 0
    with pytest.raises(InvalidCacheState, match="arrive after its latent"):
        cache[1].update_and_fetch(mx.ones((1, 1, 1, g.index_head_dim)), mx.ones((1, 1, 1, g.index_head_dim)))


def teacher_forced(model, caches, tokens, prompt):
    """Logits of every position: ``prompt`` tokens in one forward, then one token per step."""
    outs = [model(tokens[:, :prompt], cache=caches)]
    for i in range(prompt, tokens.shape[1]):
        outs.append(model(tokens[:, i : i + 1], cache=caches))
    logits = mx.concatenate(outs, axis=1).astype(mx.float32)
    mx.eval(logits)
    return logits


def mean_kl(reference, other):
    lp, lq = log_probs(reference), log_probs(other)
    return mx.mean(mx.sum(mx.exp(lp) * (lp - lq), axis=-1)).item()


def test_logits_kl_table_of_compressed_latents_against_f32(capsys):
    prompt, total = 32, 48
    tokens = mx.random.randint(0, 96, (1, total), key=mx.random.key(7))
    formats = {"affine 8/32": KvScheme.affine(8, 32), "affine 4/32": KvScheme.affine(4, 32),
               "turbo k8": KvScheme.turbo(8, 3), "turbo k4": KvScheme.turbo(4, 3)}
    table = {}
    for name in MLA_NAMES:
        model = build(name)
        reference = teacher_forced(model, lm_cache.make_prompt_cache(model), tokens, prompt)
        assert same(reference, teacher_forced(model, make_prompt_cache(model), tokens, prompt))
        for label, scheme in formats.items():
            got = teacher_forced(model, make_prompt_cache(model, scheme), tokens, prompt)
            paged = teacher_forced(model, make_prompt_cache(model, scheme, paged_block_size=16), tokens, prompt)
            table[name, label] = (mean_kl(reference[:, :prompt], got[:, :prompt]),
                                  mean_kl(reference[:, prompt:], got[:, prompt:]), mean_kl(reference, paged))
    with capsys.disabled():
        print(f"\nlogits KL vs mlx-lm's f32 caches ({prompt}-token prompt + {total - prompt} decode steps, "
              "tiny mlx-lm models, 2 layers)")
        print(f"{'model':<12} {'format':<12} {'encoded prefill':>16} {'encoded decode':>15} {'paged (all)':>12}")
        for (name, label), (pre, dec, pag) in table.items():
            print(f"{name:<12} {label:<12} {pre:>16.3e} {dec:>15.3e} {pag:>12.3e}")
    for (name, label), (pre, dec, pag) in table.items():
        assert pre == 0.0, (name, label)  # f32 first: the prompt reads float32, exactly the reference
        assert math.isfinite(dec) and math.isfinite(pag) and dec > 0 and pag > 0
    for name in MLA_NAMES:
        for column in (1, 2):
            assert table[name, "affine 8/32"][column] < table[name, "affine 4/32"][column]
            assert table[name, "turbo k8"][column] < table[name, "turbo k4"][column]
    assert table["deepseek_v3", "affine 8/32"][1] < 1e-2 and table["deepseek_v3", "turbo k8"][1] < 1e-2


CHILD = """
import json, sys
import numpy as np
from mlx_lm_models import build, continue_greedy
from kvshelf import Identity, open_store
from mlx_lm_latent_cases import provider
name, path, steps, sessions = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
model = build(name)
out = {}
with open_store(path, identity=Identity(name), provider=provider()) as store:
    for session, first in sessions.items():
        restored = store.restore(session)
        tokens, logits = continue_greedy(model, first, restored.caches, steps)
        out[session] = {"kinds": [type(c).__name__ for c in restored.caches], "tokens": tokens,
                        "bits": [np.array(l).view(np.uint32).tolist() for l in logits]}
print(json.dumps(out))
"""


def in_fresh_process(*args) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent / "helpers"), str(HERE.parents[1]),
                                                  os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", CHILD, *map(str, args)], env=env, capture_output=True, text=True,
                         check=False,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", MLA_NAMES)
def test_saved_latents_restore_in_a_fresh_process_and_continue_bit_identically(tmp_path, name):
    model = build(name)
    path = tmp_path / "store"
    expected = {}
    with open_store(path, identity=Identity(name), provider=provider()) as store:
        for label, (scheme, paged) in SCHEMES.items():
            caches = make_prompt_cache(model, scheme, paged)
            tokens, _ = greedy(model, PROMPT, caches, steps=2)
            info = store.save(label, PROMPT + tokens[:2], caches)
            assert info.length == len(PROMPT) + 2
            expected[label] = (tokens[2], continue_greedy(model, tokens[2], caches, STEPS))  # uninterrupted
    restored = in_fresh_process(name, path, STEPS, json.dumps({label: first for label, (first, _) in expected.items()}))
    for label, (_, (want_tokens, want_logits)) in expected.items():
        got = restored[label]
        adapter = "DSALatentCache" if name == "glm_moe_dsa" else "MLALatentCache"
        assert got["kinds"] == [adapter] * 2, label
        assert got["tokens"] == want_tokens, label
        assert got["bits"] == [np.array(w).view(np.uint32).tolist() for w in want_logits], label


@pytest.mark.parametrize("name", MLA_NAMES)
def test_restore_prefix_cuts_latents_inside_the_session(tmp_path, name):
    model = build(name)
    with open_store(tmp_path / "store", identity=Identity(name), provider=provider()) as store:
        caches = make_prompt_cache(model, KvScheme.affine(8, 32))
        forward(model, PROMPT, caches)
        store.save("s", PROMPT, caches)
        prompt = PROMPT[:6] + [3, 3]  # diverges after 6 tokens
        hit = store.restore_prefix(prompt)
        assert hit is not None and hit.length == 6 and hit.caches[0].offset == 6
        resumed = continue_greedy(model, prompt[6], hit.caches, 2)
        fresh = make_prompt_cache(model, KvScheme.affine(8, 32))
        forward(model, PROMPT[:6], fresh)
        assert same_run(resumed, continue_greedy(model, prompt[6], fresh, 2))


@pytest.mark.parametrize("scheme", [KvScheme.bf16(), KvScheme.affine(4, 32, quantized_kv_start=7),
                                    KvScheme.turbo(8, 3)], ids=["f32", "affine4@7", "turbo8"])
@pytest.mark.parametrize("on_planes", [False, True], ids=["decoded", "planes"])
def test_dsa_two_call_steps_read_and_store_what_one_append_would(scheme, on_planes):
    """The latent call and the indexer call of each step give the reads, and leave the state, of one append of all
    three families — on batched rows converting at different steps too (f32-first). On the planes, a step whose
    rows all read planes hands the column placeholder as the latent (attention gathers codes from it) and the
    same RoPE and index reads."""
    from kvshelf.latent_legos.latent.geometry import LatentGeometry
    from kvshelf.latent_legos.latent.scheme import composed_latent_cache

    g = LatentGeometry(kv_lora_rank=64, rope_head_dim=32, index_head_dim=32)
    rows_a, rows_b = composed_latent_cache(scheme, None, 0, g), composed_latent_cache(scheme, None, 0, g)
    key = iter(mx.random.split(mx.random.key(5), 64))

    def families(batch, n):
        return [mx.random.normal((batch, n, w), key=next(key)) for w in g.widths]

    first, second = families(1, 5), families(1, 2)
    prefill_reads = [rows_a.append_latent(*first), rows_b.append_latent(*second)]
    reference = rows_a.make_empty_batch()
    reference.merge_rows([rows_a, rows_b])
    ours_a, ours_b = DSALatentCache(composed_latent_cache(scheme, None, 0, g)), DSALatentCache(
        composed_latent_cache(scheme, None, 0, g))
    for cache, fam, want in zip((ours_a, ours_b), (first, second), prefill_reads):
        latent, rope = cache[0].update_and_fetch(fam[0][:, None], fam[1][:, None])
        index, _ = cache[1].update_and_fetch(fam[2][:, None], fam[2][:, None])
        assert same(latent[:, 0], want.latent) and same(index[:, 0], want.index_keys)
    ours = ours_a.merge([ours_a, ours_b])
    ours.attend_on_planes = on_planes
    placeholders = 0
    for step in range(4):  # rows hold 5+s and 2+s positions: start 7 converts them at different steps
        fam = families(2, 1)
        want = reference.append_latent(*fam)
        converted = getattr(ours.lego, "converted", [False])
        latent, rope = ours[0].update_and_fetch(fam[0][:, None], fam[1][:, None])
        index, _ = ours[1].update_and_fetch(fam[2][:, None], fam[2][:, None])
        if on_planes and all(converted):
            columns = mx.broadcast_to(mx.arange(want.latent.shape[1], dtype=mx.int32)[None, None, :, None],
                                      (2, 1, want.latent.shape[1], 1))
            assert latent.dtype == mx.int32 and same(latent, columns), step
            placeholders += 1
        else:
            assert same(latent[:, 0], want.latent), step
        assert same(rope[:, 0], want.rope), step
        assert same(index[:, 0], want.index_keys), step
    assert ours.lego.row_offsets == reference.row_offsets
    assert all(same(a, b) for a, b in zip(ours.lego.state, reference.state))
    assert placeholders == (4 if on_planes and scheme.kind == "turbo" else 0)  # affine4@7: row b never converts


def test_bfloat16_model_reads_are_bit_identical_to_mlx_lm_kv_cache():
    """Real MLA checkpoints run in bfloat16: the float32 lego holds them exactly and hands them back in bfloat16."""
    face, reference = make_prompt_cache(build("deepseek_v3"))[0], lm_cache.KVCache()
    key = iter(mx.random.split(mx.random.key(3), 16))
    for n in (5, 1, 1, 3):
        keys = mx.random.normal((2, 1, n, 64), key=next(key)).astype(mx.bfloat16)
        values = mx.random.normal((2, 1, n, 32), key=next(key)).astype(mx.bfloat16)
        got, want = face.update_and_fetch(keys, values), reference.update_and_fetch(keys, values)
        assert all(same(a, b) for a, b in zip(got, want))
    assert face.dtype == mx.bfloat16 and face.meta_state == ("kv:mla:target", "bfloat16")


def test_snapshot_files_carry_latent_adapters_and_malformed_adapter_entries_are_refused(tmp_path):
    import msgspec

    from kvshelf.codecs import load_snapshot, save_snapshot
    from kvshelf.errors import IncompatibleFormat

    model = build("glm_moe_dsa")
    caches = make_prompt_cache(model, KvScheme.turbo(8, 3))
    tokens, _ = greedy(model, PROMPT, caches, steps=1)
    save_snapshot(tmp_path / "s.safetensors", PROMPT + tokens[:1], caches, provider=provider())
    snap = load_snapshot(tmp_path / "s.safetensors", provider=provider())
    assert [type(c) for c in snap.caches] == [DSALatentCache] * 2 and snap.caches[0].dtype == mx.float32
    assert same_run(continue_greedy(model, tokens[1], snap.caches, 3), continue_greedy(model, tokens[1], caches, 3))
    entry, _ = provider().snapshot(caches[0])
    assert entry.kind == "mlx-lm.latent-dsa" and entry.extra["mlx-lm.inner"] == "latent-encoded"
    codec = provider().for_entry(entry)
    for extra in ({**entry.extra, "mlx-lm.inner": "mlx-lm.latent"}, {**entry.extra, "mlx-lm.inner": "nope"},
                  {**entry.extra, "mlx-lm.dtype": "int8"},
                  {k: v for k, v in entry.extra.items() if k != "mlx-lm.inner"}):
        with pytest.raises(IncompatibleFormat):
            codec.validate(msgspec.structs.replace(entry, extra=extra))
    mla_entry, _ = provider().snapshot(make_prompt_cache(build("deepseek_v3"))[0])
    with pytest.raises(IncompatibleFormat):  # a DSA adapter kind over a lego without index keys
        codec.validate(msgspec.structs.replace(mla_entry, kind="mlx-lm.latent-dsa"))


@pytest.mark.parametrize("name", MLA_NAMES)
def test_generate_step_runs_on_the_faces_like_on_mlx_lm_caches(name):
    from mlx_lm.generate import generate_step

    model = build(name)

    def run(cache):
        steps = generate_step(mx.array(PROMPT), model, max_tokens=5, prompt_cache=cache, prefill_step_size=4)
        return [(token, lp) for token, lp in steps]

    ours, theirs = run(make_prompt_cache(model)), run(lm_cache.make_prompt_cache(model))
    assert [t for t, _ in ours] == [t for t, _ in theirs]
    assert all(same(a, b) for (_, a), (_, b) in zip(ours, theirs))
