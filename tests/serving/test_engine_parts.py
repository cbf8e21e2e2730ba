"""The engine's parts without a model: the scheduler's admission, queue limit, budget and preemption over
the KV-cache manager's pages (`jaxattn.serving.scheduler`, `jaxattn.serving.kv_cache_manager`), and every
check of a request in its one place (`jaxattn.serving.validation`), each naming its parameter.

A step is played by hand: `schedule()`, then `update()` with tokens the test makes up, as the model
runner's would be; nothing is compiled.
"""

import collections

import pytest

from jaxattn.serving import (EngineConfig, KVCacheManager, QueueFull, Request, RequestError, RequestLimits,
                             SamplingParams, Scheduler)
from jaxattn.serving.validation import CONTEXT_LENGTH_EXCEEDED, check_request, check_text

PAGE = 4


def parts(*, max_seqs=2, num_pages=8, max_waiting=None, chunk=8, prefill_rows=2, token_budget=None):
    """A scheduler over a KV-cache manager of `num_pages` pages of 4 slots; no model."""
    stats = collections.Counter()
    kv = KVCacheManager(num_pages, PAGE, prefix_caching=True, window=None, stats=stats)
    config = EngineConfig(max_seqs=max_seqs, page_size=PAGE, chunk=chunk, prefill_rows=prefill_rows,
                          max_waiting=max_waiting, token_budget=token_budget)
    return Scheduler(config, kv, max_model_len=64, stats=stats), kv


def request(length, max_tokens=4, first=1):
    return Request(tuple(range(first, first + length)), SamplingParams(temperature=0.0, max_tokens=max_tokens), 0,
                   None)


def play(scheduler, token=7):
    """One step: schedule, and every row draws `token`. The step's output."""
    output = scheduler.schedule()
    rows = len(output.decode) + len(output.prefill)
    scheduler.update(output, [token] * rows, [True] * rows)
    return output


def test_admission_is_first_come_first_served_within_the_rows():
    scheduler, kv = parts(max_seqs=2)
    first, second, third = request(5), request(3, first=10), request(2, first=20)
    for r in (first, second, third):
        scheduler.add(r)
    output = scheduler.schedule()
    assert scheduler.running == [first, second] and list(scheduler.waiting) == [third]
    assert [(c.request, c.start, c.count) for c in output.prefill] == [(first, 0, 5), (second, 0, 3)]
    assert output.decode == [] and first.pages and second.pages and not third.pages


def test_a_request_whose_pages_cannot_be_had_holds_back_the_ones_behind_it():
    scheduler, kv = parts(max_seqs=4, num_pages=4)
    big, small = request(13), request(1, first=30)  # 4 pages: the whole pool; then 1 page
    running = request(2, first=40)
    scheduler.add(running)
    scheduler.schedule()  # takes a page
    scheduler.add(big)
    scheduler.add(small)
    scheduler.schedule()
    assert scheduler.running == [running] and list(scheduler.waiting) == [big, small]  # small waits behind big


def test_the_queue_limit_counts_the_requests_no_free_row_will_take():
    scheduler, _ = parts(max_seqs=2, max_waiting=2)
    for i in range(4):  # two for the free rows, two queued
        scheduler.check_room()
        scheduler.add(request(2, first=i * 3 + 1))
    with pytest.raises(QueueFull, match=r"2 requests are waiting for a row, .*max_waiting=2"):
        scheduler.check_room()
    scheduler.schedule()  # two admitted: two wait, none of them past a free row
    with pytest.raises(QueueFull):
        scheduler.check_room()
    scheduler, _ = parts(max_seqs=2, max_waiting=2)
    scheduler.check_room(4)  # n choices: two rows free, two queued
    with pytest.raises(QueueFull, match="this request is 5 sequences"):
        scheduler.check_room(5)
    parts(max_seqs=2)[0].check_room()  # no limit: never full


def test_a_sibling_choice_waits_for_its_leader_s_prompt_pages_then_shares_them():
    scheduler, kv = parts(max_seqs=3, num_pages=16, chunk=4, prefill_rows=1)
    leader, sibling, behind = request(13), request(13), request(2, first=40)  # 3 full pages and 1 token
    sibling.leader = leader
    for r in (leader, sibling, behind):
        scheduler.add(r)
    for _ in range(2):  # the leader computes 8 of its 12 tokens in full pages: the sibling and those behind wait
        play(scheduler)
        assert scheduler.running == [leader] and list(scheduler.waiting) == [sibling, behind]
    play(scheduler)  # the third page is keyed
    play(scheduler)
    assert scheduler.running == [leader, sibling, behind]
    assert sibling.pages[:3] == leader.pages[:3] and sibling.num_cached_tokens == 12
    assert all(kv.allocator.refcount(p) == 2 for p in leader.pages[:3])


def test_the_token_budget_splits_a_long_prompt_over_steps_beside_decoding_rows():
    scheduler, kv = parts(max_seqs=2, num_pages=16, chunk=4, prefill_rows=2, token_budget=6)
    short, long = request(2), request(20, first=3)
    scheduler.add(short)
    play(scheduler)  # short's prompt; it draws its first token
    scheduler.add(long)
    output = play(scheduler)
    assert output.decode == [short]  # decoding first, one token
    assert [(c.start, c.count) for c in output.prefill] == [(0, 4), (4, 1)]  # the rest of the budget of 6
    assert long.num_computed == 5 and long.output_ids == []  # no draw before the prompt's end


def test_update_ends_requests_at_max_tokens_and_gives_their_pages_back():
    scheduler, kv = parts()
    scheduler.add(request(3, max_tokens=3))
    touched = []
    while scheduler.has_unfinished():
        touched += play(scheduler, token=5).decode
    (ended,) = set(touched)
    assert ended.output_ids == [5, 5, 5] and ended.finish_reason == "length"
    assert scheduler.stats["generated_tokens"] == 3 and scheduler.stats["steps"] == 3
    kv.allocator.check_all_free()


def test_a_decoding_request_without_a_page_preempts_the_newest():
    scheduler, kv = parts(max_seqs=2, num_pages=2)
    older, newer = request(4, max_tokens=8), request(3, max_tokens=8, first=10)
    scheduler.add(older)
    scheduler.add(newer)
    play(scheduler)  # both prompts: one page each, the pool is empty; older's next slot needs a second page
    output = play(scheduler)
    assert newer.num_preemptions == 1 and list(scheduler.waiting) == [newer] and newer.pages == []
    assert output.decode == [older] and len(older.pages) == 2
    cancelled = [older, newer]
    for r in cancelled:
        scheduler.cancel(r)
    assert set(scheduler.schedule().ended) == set(cancelled)
    kv.allocator.check_all_free()


def test_cancelled_requests_end_at_the_next_schedule():
    scheduler, kv = parts(max_seqs=1)
    running, waiting = request(2), request(2, first=5)
    scheduler.add(running)
    scheduler.add(waiting)
    play(scheduler)
    scheduler.cancel(running)
    scheduler.cancel(waiting)
    output = scheduler.schedule()
    assert output.ended == [running, waiting] and output.empty
    assert running.finish_reason == waiting.finish_reason == "cancelled" and not scheduler.has_unfinished()
    kv.allocator.check_all_free()


# -- validation: one place, each refusal naming its parameter --------------------------------------

LIMITS = RequestLimits(vocab_size=32, max_model_len=64, num_pages=10, page_size=4, detokenizer=False)


@pytest.mark.parametrize("prompt, sampling, param, code, message", [
    ([], SamplingParams(), "prompt", None, "non-empty"),
    ([3, 32], SamplingParams(), "prompt", None, r"vocab_size=32\), got \[32\]"),
    ([1] * 60, SamplingParams(max_tokens=10), "max_tokens", CONTEXT_LENGTH_EXCEEDED, "max_model_len=64"),
    ([1] * 64, SamplingParams(max_tokens=None), "prompt", CONTEXT_LENGTH_EXCEEDED, "no room for an answer"),
    ([1] * 30, SamplingParams(max_tokens=20), "max_tokens", None, r"more pages than the pool holds \(10 of 4"),
    ([1], SamplingParams(stop=("x",)), "stop", None, "detokenizer"),
    ([1], SamplingParams(stop_token_ids=(32,)), "stop_token_ids", None, "stop_token_ids"),
])
def test_a_request_refused_names_its_parameter_and_code(prompt, sampling, param, code, message):
    with pytest.raises(RequestError, match=message) as caught:
        check_request(prompt, sampling, LIMITS)
    assert isinstance(caught.value, ValueError) and (caught.value.param, caught.value.code) == (param, code)


def test_max_tokens_none_is_the_rest_of_the_context():
    small = RequestLimits(vocab_size=32, max_model_len=16, num_pages=10, page_size=4, detokenizer=True)
    assert check_request([1, 2, 3], SamplingParams(max_tokens=None, stop=("x",)), small) == ((1, 2, 3), 13)
    assert check_request([1, 2, 3], SamplingParams(max_tokens=5), small) == ((1, 2, 3), 5)


@pytest.mark.parametrize("changes, param", [
    (dict(temperature=-1.0), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=True), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"), (dict(max_tokens=0), "max_tokens"), (dict(seed=1.5), "seed"),
    (dict(stop=("",)), "stop"), (dict(stop_token_ids=(1.5,)), "stop_token_ids"),
])
def test_sampling_params_refusals_name_the_field(changes, param):
    with pytest.raises(RequestError) as caught:
        SamplingParams(**changes)
    assert caught.value.param == param


def test_an_empty_text_prompt_is_refused_before_a_tokenizer_adds_to_it():
    with pytest.raises(RequestError, match="messages is empty") as caught:
        check_text("", "messages")
    assert caught.value.param == "messages"
    check_text(" ")
