"""Several decode steps per program call (`jaxattn.serving.multi_step`): the same tokens as one step at a
time (greedy ones those of `generate`, seeded draws, penalties and log-probabilities those of the
single-step engine), requests that end inside a call (stop token, stop string, `max_tokens`), a
request cancelled during a call, the calls' pages, and when a step must stay one.
"""

import dataclasses
import functools

import numpy as np
import pytest

from jaxattn.serving import Engine, EngineConfig, SamplingParams
from tests.serving.compiles import counting_compiles
from tests.serving.test_serving import ENGINE, MAX_NEW, draw_requests, engine_for, expected, model, run_schedule

STEPS = 4
LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEF"


@functools.lru_cache(maxsize=None)
def multi_engine(name, kv_cache="auto"):
    """The test engine of `name`, calls of up to `STEPS` decode steps, letters as its text."""
    config, params, kernels = model(name)
    ec = dataclasses.replace(ENGINE, decode_steps=STEPS, kv_cache=kv_cache)
    return Engine(params, config, ec, kernels=kernels.replace(paged="gather"),
                  detokenize=lambda ids: "".join(LETTERS[i] for i in ids))


def all_at_once(engine, prompts, sampling):
    """Adds every prompt at once (no more than the rows: nothing waits, so the steps after the prompts
    are multi-step calls), runs to the end; returns the requests."""
    requests = [engine.add_request(p, s) for p, s in zip(prompts, sampling)]
    engine.run()
    return requests


@pytest.mark.parametrize("name, kv_cache", [("gqa", "auto"), ("mla", "auto"), ("windows_sinks", "auto"),
                                            ("gqa", "int8")])
def test_greedy_tokens_equal_generate_in_calls_of_several_steps(name, kv_cache):
    engine = multi_engine(name, kv_cache)
    calls = engine.stats["multi_step_calls"]
    prompts, max_tokens, rng = draw_requests(5, count=4)
    requests = all_at_once(engine, prompts, [SamplingParams(temperature=0.0, max_tokens=m) for m in max_tokens])
    for request, prompt, m in zip(requests, prompts, max_tokens):
        if kv_cache == "auto":  # int8 pages round the keys: equal to the single-step engine, checked below
            assert request.output_ids == expected(name, prompt)[:m], (prompt, request)
        assert request.finish_reason == "length"
    assert engine.stats["multi_step_calls"] > calls
    if kv_cache == "int8":
        config, params, kernels = model(name)
        one = Engine(params, config, dataclasses.replace(ENGINE, kv_cache="int8"), kernels=kernels.replace(paged="gather"))
        alone = all_at_once(one, prompts, [SamplingParams(temperature=0.0, max_tokens=m) for m in max_tokens])
        assert [r.output_ids for r in requests] == [r.output_ids for r in alone]
    # Random arrivals and cancellations, preemptions in a small pool: calls and single steps mixed.
    prompts, max_tokens, rng = draw_requests(2)
    for request, i in run_schedule(engine, prompts, max_tokens, rng):
        if kv_cache == "auto":
            want = expected(name, prompts[i])[:max_tokens[i]]
            assert request.output_ids == want[:len(request.output_ids)], (i, request)
            assert request.finish_reason == "cancelled" or request.output_ids == want
    engine.allocator.check_all_free()


ENDING_PROMPT = (5, 6, 7)


def ending_cases():
    """"gqa"'s greedy tokens of `ENDING_PROMPT`, their text, a stop token and a stop string met on the way, and
    four requests of it: ending on that stop token, on that stop string, at `max_tokens` 3, and whole."""
    full = expected("gqa", ENDING_PROMPT)
    text = "".join(LETTERS[i] for i in full)
    stop_token, stop = full[2], text[5:7]
    cases = [SamplingParams(temperature=0.0, max_tokens=MAX_NEW, stop_token_ids=(stop_token,)),
             SamplingParams(temperature=0.0, max_tokens=MAX_NEW, stop=(stop,)),
             SamplingParams(temperature=0.0, max_tokens=3),
             SamplingParams(temperature=0.0, max_tokens=MAX_NEW)]
    return full, text, stop_token, stop, cases


# Seeded draws with every knob, penalties, logit bias and log-probabilities, and their prompts.
SAMPLED = [SamplingParams(temperature=0.9, top_k=12, top_p=0.95, seed=1234, max_tokens=MAX_NEW, logprobs=3),
           SamplingParams(temperature=0.7, min_p=0.05, presence_penalty=0.8, frequency_penalty=0.3,
                          repetition_penalty=1.3, seed=7, max_tokens=MAX_NEW),
           SamplingParams(temperature=0.0, logit_bias={3: 5.0, 4: -100.0}, max_tokens=MAX_NEW, logprobs=2)]
SAMPLED_PROMPTS = [(3, 1, 4, 1, 5), (9, 2, 6), (5, 3, 5, 8, 9, 7)]


def test_requests_that_end_inside_a_call_end_where_one_step_at_a_time_ends():
    engine = multi_engine("gqa")
    prompt = ENDING_PROMPT
    full, text, stop_token, stop, cases = ending_cases()
    calls = engine.stats["multi_step_calls"]
    by_token, by_text, by_length, whole = all_at_once(engine, [prompt] * 4, cases)
    assert by_token.output_ids == full[:full.index(stop_token) + 1] and by_token.finish_reason == "stop"
    assert by_text.finish_reason == "stop" and by_text.text.text == text[:text.find(stop)]
    assert by_text.output_ids == full[:len(by_text.output_ids)] and len(by_text.output_ids) <= text.find(stop) + 2
    assert by_length.output_ids == full[:3] and by_length.finish_reason == "length"
    assert whole.output_ids == full
    assert engine.stats["multi_step_calls"] > calls
    engine.allocator.check_all_free()


def test_seeded_draws_penalties_and_logprobs_equal_one_step_at_a_time():
    multi = all_at_once(multi_engine("gqa"), SAMPLED_PROMPTS, SAMPLED)
    single = all_at_once(engine_for("gqa"), SAMPLED_PROMPTS, SAMPLED)
    for many, one in zip(multi, single):
        assert many.output_ids == one.output_ids
        np.testing.assert_allclose(many.output_logprobs, one.output_logprobs, rtol=1e-5, atol=1e-6)
        assert [[i for i, _ in top] for top in many.output_top_logprobs] == \
            [[i for i, _ in top] for top in one.output_top_logprobs]


def test_a_request_cancelled_during_a_call_frees_its_row_at_the_call_s_end():
    engine = multi_engine("gqa")
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    kept, victim = engine.add_request((1, 2, 3), greedy), engine.add_request((4, 5), greedy)
    while not (kept.output_ids and victim.output_ids):
        engine.step()  # the prompts, and their first tokens
    runs, cancelled_at = engine.model_runner.runs, []

    def run_then_cancel(*args):  # the caller cancels while the call runs on the device
        result = original(*args)
        cancelled_at.append(len(victim.output_ids))
        engine.cancel(victim)
        return result

    original, runs.run = runs.run, run_then_cancel
    try:
        touched = engine.step()
    finally:
        runs.run = original
    assert cancelled_at, "the step was not a multi-step call"
    assert victim in touched and victim.finish_reason == "cancelled" and victim.pages == []
    assert len(victim.output_ids) == cancelled_at[0]  # nothing of the call is handed to it
    assert engine.scheduler.running == [kept] and len(kept.output_ids) > cancelled_at[0]
    engine.run()
    assert kept.output_ids == expected("gqa", (1, 2, 3))
    engine.allocator.check_all_free()


def test_a_step_stays_one_while_a_request_waits_and_calls_reserve_their_pages():
    engine = multi_engine("gqa")
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    running = [engine.add_request((i + 1, 2), greedy) for i in range(ENGINE.max_seqs)]
    waiting = engine.add_request((7, 7), greedy)  # no row for it until one ends
    while not all(r.output_ids for r in running):
        engine.step()  # the prompts
    output = engine.scheduler.schedule()
    assert output.decode and output.turns == []  # a row may free up for the waiting request
    engine.scheduler.update(output, *engine.model_runner.execute(output)[:2])
    engine.cancel(waiting)
    engine.step()
    assert waiting.finish_reason == "cancelled"
    output = engine.scheduler.schedule()
    assert output.steps == STEPS and len(output.turns) == len(output.decode)
    for request, turns in zip(output.decode, output.turns):  # the slots of every turn have their pages
        assert len(request.pages) * ENGINE.page_size >= request.num_computed + turns
    engine.scheduler.update_run(output, *engine.model_runner.execute_run(output)[:2])
    engine.run()
    assert all(r.finish_reason == "length" for r in running)
    engine.allocator.check_all_free()


def test_no_program_is_compiled_after_start_up_with_multi_step_calls():
    engine = multi_engine("gqa")
    prompts, max_tokens, _ = draw_requests(4, count=4)
    for p in prompts:
        expected("gqa", p)
    calls = engine.stats["multi_step_calls"]
    with counting_compiles() as compiles:
        all_at_once(engine, prompts, [SamplingParams(temperature=0.0, max_tokens=m) for m in max_tokens])
    assert compiles == [] and engine.stats["multi_step_calls"] > calls


def test_steps_per_call_are_the_platform_s_unless_given():
    assert EngineConfig().steps_per_call("cpu")[0] == 1
    assert EngineConfig().steps_per_call("gpu")[0] == 8
    assert EngineConfig(decode_steps=3).steps_per_call("cpu") == (3, "decode_steps given")
    with pytest.raises(ValueError, match="decode_steps"):
        EngineConfig(decode_steps=0)
