"""Where an engine step's time goes (`jaxattn.serving.step_clock`): every step that schedules rows is
counted once, its phases add up to its wall time, and the per-step figures are those sums over the steps."""

import time

import pytest

from jaxattn.serving import Engine, EngineConfig, SamplingParams
from jaxattn.serving.step_clock import PHASES, StepClock
from tiny_models import drawn_params, tiny_config

CONFIG = tiny_config("gqa", positions="rope", vocab_size=48, max_seq_len=64)


def test_the_per_step_figures_are_the_phases_sums_over_the_steps():
    clock = StepClock()
    assert clock.per_step_ms() == {}
    clock.steps = 4
    clock.seconds.update(schedule=0.004, inputs=0.008, device=0.4, update=0.004)
    got = clock.per_step_ms()
    assert got["schedule"] == pytest.approx(1.0) and got["device"] == pytest.approx(100.0)
    assert got["host"] == pytest.approx(4.0) and got["total"] == pytest.approx(104.0)
    with clock.phase("outputs"):
        time.sleep(0.01)
    assert clock.seconds["outputs"] >= 0.01
    clock.reset()
    assert clock.steps == 0 and set(clock.seconds) == set(PHASES) and not any(clock.seconds.values())


def test_the_engine_counts_each_step_that_runs_and_its_phases_add_up_to_its_time():
    engine = Engine(drawn_params(CONFIG, seed=5, std=0.4), CONFIG, EngineConfig(max_seqs=4, page_size=4, chunk=8,
                                                                                prefill_rows=2, num_pages=40))
    engine.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=2))  # compiled and warm
    engine.clock.reset()
    for seed in range(3):
        engine.add_request([seed + 1] * (5 + seed), SamplingParams(temperature=0.0, max_tokens=6))
    steps, started = 0, time.perf_counter()
    while engine.has_unfinished():  # prompts within one chunk: every step that runs hands out a token
        steps += bool(engine.step())
    wall = time.perf_counter() - started
    clock = engine.clock
    assert clock.steps == steps > 0
    assert all(clock.seconds[name] > 0 for name in PHASES)
    assert sum(clock.seconds.values()) <= wall  # the phases are parts of the steps' time
    per_step = clock.per_step_ms()
    assert per_step["total"] == pytest.approx(per_step["host"] + per_step["device"])
