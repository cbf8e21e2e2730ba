"""Overlap (`EngineConfig.overlap`, `Scheduler.schedule_ahead`): the next plain decode step queued before a
step's tokens are read, fed them on the device. The same tokens as an engine that reads every step back
first (greedy ones those of `generate`; seeded draws, penalties and log-probabilities those of the engine
without overlap), requests ending on the token fed ahead (stop token, stop string, `max_tokens`), a request
cancelled while a step is queued ahead, and when the next step must wait for the host.
"""

import dataclasses
import functools

import numpy as np

from jaxattn.serving import Engine, SamplingParams
from tests.serving.compiles import counting_compiles
from tests.serving.test_multi_step import (ENDING_PROMPT, LETTERS, SAMPLED, SAMPLED_PROMPTS, all_at_once,
                                           ending_cases)
from tests.serving.test_serving import ENGINE, MAX_NEW, engine_for, expected, model


@functools.lru_cache(maxsize=None)
def engine(overlap: bool):
    """The "gqa" test engine with or without overlap, letters as its text."""
    config, params, kernels = model("gqa")
    return Engine(params, config, dataclasses.replace(ENGINE, overlap=overlap), kernels=kernels.replace(paged="gather"),
                  detokenize=lambda ids: "".join(LETTERS[i] for i in ids))


def test_the_engine_overlaps_by_default_and_its_greedy_tokens_are_generate_s():
    on = engine_for("gqa")  # the test engines of tests/serving/test_serving.py: overlap on, as by default
    assert on.engine_config.overlap
    overlapped = on.stats["overlapped_steps"]
    prompts = [(1, 2, 3), (4, 5), (6, 7, 8, 9), (10,)]
    requests = all_at_once(on, prompts, [SamplingParams(temperature=0.0, max_tokens=MAX_NEW)] * 4)
    assert [r.output_ids for r in requests] == [expected("gqa", p) for p in prompts]
    assert on.stats["overlapped_steps"] - overlapped >= MAX_NEW - 2  # every decode step but the ends'
    assert not on.has_unfinished() and on._in_flight is None
    on.allocator.check_all_free()


def test_requests_ending_on_the_token_fed_ahead_end_as_without_overlap():
    prompt = ENDING_PROMPT
    full, _, stop_token, _, cases = ending_cases()
    on, off = engine(True), engine(False)
    overlapped = on.stats["overlapped_steps"]
    ahead, plain = all_at_once(on, [prompt] * 4, cases), all_at_once(off, [prompt] * 4, cases)
    for a, b in zip(ahead, plain):
        assert (a.output_ids, a.finish_reason) == (b.output_ids, b.finish_reason)
        assert a.text.text == b.text.text
    assert ahead[0].output_ids == full[:full.index(stop_token) + 1] and ahead[0].finish_reason == "stop"
    assert ahead[2].output_ids == full[:3] and ahead[3].output_ids == full
    assert on.stats["overlapped_steps"] > overlapped and off.stats["overlapped_steps"] == 0
    on.allocator.check_all_free()
    # The rows that ended took no token of the step fed ahead of their end.
    assert on.stats["generated_tokens"] - off.stats["generated_tokens"] == 0


def test_seeded_draws_penalties_and_logprobs_equal_the_engine_without_overlap():
    ahead = all_at_once(engine(True), SAMPLED_PROMPTS, SAMPLED)
    plain = all_at_once(engine(False), SAMPLED_PROMPTS, SAMPLED)
    for a, b in zip(ahead, plain):
        assert a.output_ids == b.output_ids
        np.testing.assert_allclose(a.output_logprobs, b.output_logprobs, rtol=1e-6, atol=1e-7)
        assert [[i for i, _ in top] for top in a.output_top_logprobs] == \
            [[i for i, _ in top] for top in b.output_top_logprobs]


def test_a_request_cancelled_while_a_step_is_queued_ahead_takes_none_of_its_tokens():
    on = engine(True)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    kept, victim = on.add_request((1, 2, 3), greedy), on.add_request((4, 5), greedy)
    while on._in_flight is None:
        on.step()  # the prompts, then a decode step with its successor queued
    runner, cancelled_at = on.model_runner, []

    def cancel_then_collect(*args):  # the caller cancels after the next step is queued, before it reads this one
        cancelled_at.append(len(victim.output_ids))
        on.cancel(victim)
        return original(*args)

    original, runner.collect = runner.collect, cancel_then_collect
    try:
        touched = on.step()
    finally:
        del runner.collect
    assert on._in_flight is not None and victim in on._in_flight.output.decode  # queued before the cancel
    # As without overlap, it takes the token of the step that ran when it was cancelled, and ends.
    assert victim in touched and victim.finish_reason == "cancelled" and victim.pages == []
    assert len(victim.output_ids) == cancelled_at[0] + 1
    on.step()  # the step queued ahead: its row of the cancelled request is dropped
    assert len(victim.output_ids) == cancelled_at[0] + 1 and on.scheduler.running == [kept]
    on.run()
    assert kept.output_ids == expected("gqa", (1, 2, 3))
    on.allocator.check_all_free()


def test_nothing_is_queued_ahead_while_a_request_waits_for_a_row():
    on = engine(True)
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    running = [on.add_request((i + 1, 2), greedy) for i in range(ENGINE.max_seqs)]
    while not all(r.output_ids for r in running):
        on.step()
    waiting = on.add_request((7, 7), greedy)  # no row for it until one ends
    on.step()
    assert on._in_flight is None  # its admission may change the rows
    on.run()
    assert waiting.output_ids == expected("gqa", (7, 7))[:4]
    on.allocator.check_all_free()


def test_no_program_is_compiled_after_start_up_with_overlap():
    on = engine(True)
    prompts = [(2, 3), (4, 4, 1), (9,)]
    for p in prompts:
        expected("gqa", p)
    overlapped = on.stats["overlapped_steps"]
    with counting_compiles() as compiles:
        all_at_once(on, prompts, [SamplingParams(temperature=0.0, max_tokens=MAX_NEW)] * 3)
    assert compiles == [] and on.stats["overlapped_steps"] > overlapped
