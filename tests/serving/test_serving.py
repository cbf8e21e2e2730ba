"""The continuous-batching engine (`jaxattn.serving`): exactness against `generate`, seeded draws
independent of the traffic, no page leaks, no compiles after start-up, and its refusals.

The schedules are property tests over seeds: each seed draws when requests arrive (a few per
step, or none), their prompts (some sharing a prefix with earlier ones, so the prefix cache is
hit), their lengths and `max_tokens`, and which are cancelled, waiting or mid-flight. The pool is
small enough that sequences are preempted and recomputed. After every schedule:

* every request that ran to its end drew exactly `generate`'s greedy tokens on its prompt alone,
  and a cancelled one a prefix of them;
* every page is free again (`PageAllocator.check_all_free`).
"""

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import jaxattn as ja
from jaxattn.serving import Engine, EngineConfig, PageAllocator, RequestError, SamplingParams, TextStream, page_keys
from tests.serving.compiles import counting_compiles
from tiny_models import drawn_params, tiny_config
from tests.layers.test_moe_model import EXPERTS

ROOT = Path(__file__).resolve().parents[2]
VOCAB, CONTEXT, MAX_NEW = 32, 64, 10
ENGINE = EngineConfig(max_seqs=4, page_size=4, chunk=8, prefill_rows=2, num_pages=14)
MODELS = {
    "mha": dict(),
    "gqa": dict(num_kv_heads=2),
    "mla": dict(mla=ja.MLAConfig(kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4)),
    "windows_sinks": dict(num_kv_heads=2, sliding_window=6, attn_sinks=True, attn_logits_soft_cap=5.0),
    "moe": dict(num_kv_heads=2, norm="rmsnorm", mlp="swiglu", moe=EXPERTS, dense_layers=(0,)),
}


def model(name):
    config = tiny_config("mha", positions="rope", vocab_size=VOCAB, max_seq_len=CONTEXT, **MODELS[name])
    return config, drawn_params(config, seed=3, std=0.4), ja.Kernels(mla="absorb" if name == "mla" else "naive")


@functools.lru_cache(maxsize=None)
def engine_for(name, kernels_paged="gather"):
    config, params, kernels = model(name)
    return Engine(params, config, ENGINE, kernels=kernels.replace(paged=kernels_paged))


@functools.lru_cache(maxsize=None)
def expected(name, prompt: tuple) -> list:
    """`generate`'s greedy tokens for the prompt alone."""
    config, params, kernels = model(name)
    out = ja.generate(params, config, np.array([prompt]), np.array([len(prompt)]), max_new_tokens=MAX_NEW,
                      rng=jax.random.PRNGKey(0), temperature=0.0, kernels=kernels)
    return out.tokens[0].tolist()


def draw_requests(seed, count=10):
    """Prompts of 1-30 tokens, a third extending an earlier prompt (prefix sharing), and max_tokens."""
    rng = np.random.default_rng(seed)
    prompts = []
    for _ in range(count):
        if prompts and rng.random() < 0.35:
            base = prompts[rng.integers(len(prompts))]
            prompt = base[:rng.integers(1, len(base) + 1)] + tuple(rng.integers(0, VOCAB, rng.integers(1, 6)).tolist())
        else:
            prompt = tuple(rng.integers(0, VOCAB, rng.integers(1, 31)).tolist())
        prompts.append(prompt[:CONTEXT - MAX_NEW])
    return prompts, rng.integers(1, MAX_NEW + 1, count).tolist(), rng


def run_schedule(engine, prompts, max_tokens, rng, *, cancel_rate=0.08):
    """Random arrivals and cancellations around `engine.step()`; returns [(request, cancelled)]."""
    pending, placed = list(range(len(prompts))), []
    while pending or engine.has_unfinished():
        while pending and (rng.random() < 0.5 or not engine.has_unfinished()):
            i = pending.pop(0)
            placed.append((engine.add_request(prompts[i], SamplingParams(temperature=0.0, max_tokens=max_tokens[i])),
                           i))
        live = [(r, i) for r, i in placed if not r.finished]
        if live and rng.random() < cancel_rate:
            engine.cancel(live[rng.integers(len(live))][0])
        engine.step()
    return placed


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_tokens_equal_generate_under_any_schedule_and_no_page_leaks(name):
    engine = engine_for(name)
    for seed in range(3):
        prompts, max_tokens, rng = draw_requests(seed)
        for request, i in run_schedule(engine, prompts, max_tokens, rng):
            want = expected(name, prompts[i])[:max_tokens[i]]
            if request.finish_reason == "cancelled":
                assert request.output_ids == want[:len(request.output_ids)], (seed, i)
            else:
                assert request.finish_reason == "length" and request.output_ids == want, (seed, i, request)
        engine.allocator.check_all_free()
    # The schedules did what they are for: prompts were found in the cache and sequences preempted or,
    # where a window gives pages back as it slides (and the pool soon reuses them), pages given back.
    if engine.window is None:
        assert engine.stats["prefix_hit_tokens"] > 0 and engine.stats["preemptions"] > 0, dict(engine.stats)
    else:
        assert engine.stats["pages_past_window"] > 0, dict(engine.stats)


@pytest.mark.parametrize("name, paged", [("gqa", "ragged"), ("gqa", "ragged_cpu"), ("windows_sinks", "ragged_cpu"),
                                         ("mla", "ragged_cpu")])
def test_the_ragged_kernels_give_generate_s_tokens_too(name, paged):
    """The schedule property once more with the attention read from pages by "ragged" and "ragged_cpu"
    (decoding rows in the native loop; MLA's two parts fall back to ragged)."""
    engine = engine_for(name, paged)
    prompts, max_tokens, rng = draw_requests(11)
    for request, i in run_schedule(engine, prompts, max_tokens, rng, cancel_rate=0.0):
        assert request.output_ids == expected(name, prompts[i])[:max_tokens[i]], (i, request)
    engine.allocator.check_all_free()


def test_a_sliding_window_model_gives_back_the_pages_past_its_window():
    engine = engine_for("windows_sinks")
    request = engine.add_request(list(range(30)), SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
    held = []
    while not request.finished:
        engine.step()
        held.append(sum(p >= 0 for p in request.pages))
    # Window 6 over pages of 4: at most 3 pages (the window's tokens, the page being written) ever held
    # once the prompt is in, whatever the length (40 tokens would be 10 pages).
    assert max(held[-MAX_NEW + 1:]) <= 3, held
    assert request.output_ids == expected("windows_sinks", tuple(range(30)))
    engine.allocator.check_all_free()


def test_a_seeded_request_draws_the_same_tokens_whatever_runs_beside_it():
    engine = engine_for("gqa")
    sampled = SamplingParams(temperature=0.9, top_k=12, top_p=0.95, seed=1234, max_tokens=MAX_NEW)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    alone = engine.generate([prompt], sampled)[0]
    prompts, max_tokens, rng = draw_requests(7, count=5)
    others = [engine.add_request(p, SamplingParams(temperature=1.0, max_tokens=m)) for p, m in zip(prompts, max_tokens)]
    engine.step()
    engine.step()
    beside = engine.add_request(prompt, sampled)  # arrives mid-flight, shares steps with the others
    engine.run()
    assert beside.output_ids == alone and all(r.finished for r in others)
    other_seed = engine.generate([prompt], SamplingParams(**{**sampled.__dict__, "seed": 99}))[0]
    assert other_seed != alone  # the seed is what decides
    engine.allocator.check_all_free()


def test_no_program_is_compiled_after_start_up():
    engine = engine_for("gqa")
    prompts, max_tokens, rng = draw_requests(11)
    for p in prompts:
        expected("gqa", p)  # the reference's compiles happen before we count
    with counting_compiles() as compiles:
        run_schedule(engine, prompts, max_tokens, rng)
    assert compiles == []
    assert engine.stats["steps"] > 0


def test_stop_tokens_stop_strings_and_streamed_text():
    config, params, kernels = model("gqa")
    letters = "abcdefghijklmnopqrstuvwxyzABCDEF"
    engine = Engine(params, config, ENGINE, kernels=kernels, detokenize=lambda ids: "".join(letters[i] for i in ids))
    prompt = (5, 6, 7)
    full = expected("gqa", prompt)
    text = "".join(letters[i] for i in full)
    stop_token = full[3]
    first = full.index(stop_token)
    by_token = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=MAX_NEW,
                                                        stop_token_ids=(stop_token,)))
    assert by_token[0] == full[:first + 1]
    stop = text[4:6]
    request = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, stop=(stop,)))
    streamed = ""
    while not request.finished:
        engine.step()
        streamed += request.take_new()[1]
    assert request.finish_reason == "stop" and streamed == text[:text.find(stop)]
    engine.allocator.check_all_free()


def test_text_stream_holds_back_partial_characters_and_stop_prefixes():
    pieces = [b"caf", b"\xc3", b"\xa9 ", b"ST", b"OP!"]
    stream = TextStream(lambda ids: b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace"), ("STOP",))
    released = []
    for i in range(len(pieces)):
        stopped = stream.add(i)
        released.append(stream.take())
        if stopped:
            break
    assert released == ["caf", "", "é ", "", ""] and stream.text == "café "


def test_cancelling_a_waiting_and_a_running_request_frees_everything():
    engine = engine_for("mha")
    requests = [engine.add_request(list(range(1, 20)), SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
                for _ in range(6)]  # more than max_seqs: two wait
    engine.step()
    engine.cancel(requests[0])   # running
    engine.cancel(requests[-1])  # waiting
    touched = engine.step()
    assert requests[0] in touched and requests[0].finish_reason == "cancelled"
    assert requests[-1].finish_reason == "cancelled" and requests[-1].output_ids == []
    engine.run()
    assert all(r.finish_reason == "length" for r in requests[1:-1])
    engine.allocator.check_all_free()


@pytest.mark.parametrize("prompt, sampling, message", [
    ([], SamplingParams(), "non-empty"),
    ([VOCAB], SamplingParams(), "vocab_size"),
    ([1] * 60, SamplingParams(max_tokens=10), "max_model_len"),
    ([1], SamplingParams(stop=("x",)), "detokenizer"),
    ([1], SamplingParams(stop_token_ids=(VOCAB,)), "stop_token_ids"),
])
def test_add_request_refuses_bad_input_in_one_line(prompt, sampling, message):
    with pytest.raises(ValueError, match=message):
        engine_for("mha").add_request(prompt, sampling)


def test_add_request_refusals_carry_the_parameter_and_code_the_server_answers_with():
    engine = engine_for("mha")
    with pytest.raises(RequestError) as caught:
        engine.add_request([1] * 60, SamplingParams(max_tokens=10))
    assert (caught.value.param, caught.value.code) == ("max_tokens", "context_length_exceeded")
    with pytest.raises(RequestError) as caught:  # the rest of the context: 64 tokens, more than 14 pages of 4
        engine.add_request([1] * 10, SamplingParams(max_tokens=None))
    assert caught.value.param == "max_tokens" and "pool" in str(caught.value)
    assert not engine.has_unfinished()


@pytest.mark.parametrize("changes, message", [
    (dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_k=-2), "top_k"),
    (dict(max_tokens=0), "max_tokens"), (dict(seed=1.5), "seed"),
])
def test_sampling_params_refuse_bad_values(changes, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**changes)


@pytest.mark.slow
def test_on_meshes_with_heads_split_the_tokens_equal_one_device():
    """tests/serving/serving_mesh_script.py in a fresh process with 4 host devices: tensor parallelism over heads."""
    env = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"},
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    done = subprocess.run([sys.executable, str(Path(__file__).parent / "serving_mesh_script.py"), "ragged"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    for name in ("tensor:2", "data:2,tensor:2"):
        assert result[name]["tokens"] == result["one_device"], name
        assert result[name]["pool_spec"] == ["P(None, None, 'tensor')"]  # [P, ps, K, H]: kv heads split


def test_page_allocator_refcounts_shares_and_evicts_least_recently_used():
    pages = PageAllocator(num_pages=4, page_size=2)
    keys = page_keys([1, 2, 3, 4, 5], 2)
    assert len(keys) == 2 and keys != page_keys([9, 2, 3, 4], 2)[:2]  # a chain: page 1's key depends on page 0
    assert page_keys([3, 4], 2)[0] != keys[1]  # the same tokens after another prefix are another page
    first = pages.allocate(3)
    for page, key in zip(first, keys):
        pages.register(page, key)
    assert pages.lookup(keys) == first[:2] and pages.refcount(first[0]) == 2  # shared, not copied
    pages.release(first[:2])
    pages.release(first)  # the first request ends: keyed pages are cached, the unkeyed one freed
    assert pages.in_use == 0 and pages.cached == 2 and pages.available == 4
    assert pages.lookup(keys[:1]) == first[:1]  # a hit takes a cached page back
    pages.release(first[:1])  # page 0 is now the most recently used cached page
    taken = pages.allocate(3)  # two free pages, then the least recently used cached one: page 1
    assert first[1] in taken and first[0] not in taken and pages.lookup(keys) == [first[0]]
    pages.release([first[0]])
    pages.release(taken)
    pages.check_all_free()
    with pytest.raises(RuntimeError, match="released more often"):
        pages.release([0])
