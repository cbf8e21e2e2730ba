"""bench/timing.py: candidates in turns (warm-up first, the order reversed every other round, results waited
for), medians that skip what did not run, ratios, and the cells of the attention and MoE tables."""

import jax
import jax.numpy as jnp
import pytest

from bench import timing


class Clock:
    """A stand-in for time.perf_counter that each candidate advances by its own cost."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = Clock()
    monkeypatch.setattr(timing, "perf_counter", fake)
    return fake


def test_best_seconds_repeats_a_short_call_and_keeps_the_least(clock):
    costs = iter([0.05, 0.03, 0.08, 0.06, 0.04])

    def call():
        clock.now += next(costs)
        return clock.now
    last, best = timing.best_seconds(call, budget_s=0.2)
    assert best == pytest.approx(0.03) and last == pytest.approx(0.22)  # 4 calls: 0.22 s spent, past 0.2


def test_best_seconds_times_a_long_call_once(clock):
    calls = []

    def call():
        clock.now += 1.5
        calls.append(1)
    assert timing.best_seconds(call, budget_s=0.2)[1] == 1.5 and len(calls) == 1

def test_candidates_take_turns_after_one_warm_up_each(clock):
    order = []

    def candidate(name, cost, first_cost):
        def call():
            clock.now += first_cost if name not in order else cost
            order.append(name)
        return call
    timings = timing.in_turns({"a": candidate("a", 1.0, 5.0), "b": candidate("b", 2.0, 3.0)}, repeats=3)
    assert order == ["a", "b", "a", "b", "b", "a", "a", "b"]  # warm-ups, then forward, reversed, forward
    assert timings["a"].first_s == 5.0 and timings["a"].times_s == [1.0, 1.0, 1.0]
    assert timings["b"].median_s == 2.0 and timings["b"].compile_s == 1.0  # 3 s first less a 2 s steady call


def test_without_a_warm_up_every_call_is_timed_and_nothing_is_compile_time(clock):
    calls = []
    result = timing.time_call(lambda: calls.append(1), repeats=2, warmup=False)
    assert len(calls) == 2 and result.first_s is None and result.compile_s == 0.0


def test_a_jax_result_is_waited_for_before_the_clock_stops(monkeypatch):
    waited = []
    monkeypatch.setattr(jax, "block_until_ready", lambda x: waited.append(x) or x)
    x = jnp.ones(3)
    assert timing.seconds(lambda: x)[0] is x and waited == [x]


def test_repeats_must_be_positive():
    with pytest.raises(ValueError, match="repeats"):
        timing.in_turns({"a": lambda: None}, repeats=0)


def test_compiled_programs_are_timed_with_the_memory_xla_plans():
    x = jnp.ones((64, 64))
    results = timing.time_compiled({"matmul": (jax.jit(lambda a: a @ a), (x,))}, repeats=2)
    r = results["matmul"]
    assert len(r["times_s"]) == 2 and r["median_s"] > 0 and r["compile_s"] > 0
    assert r["xla_bytes"] >= 2 * x.nbytes  # at least its argument and its output


def test_medians_skip_missing_values_and_ratios_need_both_sides():
    assert timing.median([3.0, None, 1.0, 2.0]) == 2.0
    assert timing.median([None]) is None
    assert timing.ratio(6.0, 3.0) == 2.0
    assert timing.ratio(None, 3.0) is None and timing.ratio(6.0, 0.0) is None


def test_table_cells_tell_skipped_from_failed():
    row = {"results": {"auto": {"median_s": 0.0123}, "xla": {"error": "exited with status 1"}},
           "skipped": {"chunked": "auto runs this program here"}}
    assert timing.milliseconds_cell(row, "auto") == "12"
    assert timing.milliseconds_cell(row, "auto", ",.1f") == "12.3"
    assert timing.milliseconds_cell(row, "xla") == "error"
    assert timing.milliseconds_cell(row, "chunked") == "–"
    assert timing.times_cell(timing.ratio(timing.median_of(row, "auto"), 0.00615)) == "2.00x"
    assert timing.times_cell(timing.ratio(timing.median_of(row, "xla"), 1.0)) == "–"
