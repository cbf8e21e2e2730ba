"""Timing for the benchmarks: candidates called in turns, medians, and ratios of medians taken side by side.

A shared machine's speed drifts over minutes, so a ratio means something only between candidates timed
in the same minutes: `in_turns` warms every candidate up (compiling it), then calls each once a round,
the order reversed every other round, so that drift falls on all of them alike. A call's result is
waited for (`jax.block_until_ready` where JAX is loaded) before its clock stops.

Needs only the standard library (JAX is used only where the caller has imported it): the peers'
processes run it under an interpreter that may have torch and no JAX.
"""

from __future__ import annotations

import functools
import statistics
import sys
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any, Callable, Hashable, Iterable


@dataclass(frozen=True)
class Timing:
    """One candidate's seconds: its warm-up call (compilation included; None without one), then each timed call."""

    first_s: float | None
    times_s: list[float] = field(default_factory=list)

    @property
    def median_s(self) -> float:
        return statistics.median(self.times_s)

    @property
    def compile_s(self) -> float:
        """The warm-up call less a steady one (0 where the warm-up was as fast, or did not run)."""
        return max(self.first_s - self.median_s, 0.0) if self.first_s is not None else 0.0


def wait_for(result: Any) -> Any:
    """`result` once computed: JAX dispatches asynchronously, so its arrays are waited for."""
    jax = sys.modules.get("jax")  # never imported here: a torch-only process has none
    return jax.block_until_ready(result) if jax is not None else result


def seconds(call: Callable[[], Any]) -> tuple[Any, float]:
    """(what `call()` returns, once ready; the wall seconds it took)."""
    start = perf_counter()
    result = wait_for(call())
    return result, perf_counter() - start


def best_seconds(call: Callable[[], Any], budget_s: float = 0.2, most: int = 20) -> tuple[Any, float]:
    """(the last result, the fewest seconds of `call()`): called again while the calls so far took under
    `budget_s` (at most `most` times), as `timeit` ranges. A call of milliseconds is then timed as the least
    of many, which the machine's noise does not reach; a call of seconds is timed once, as by `seconds`."""
    result, best = seconds(call)
    spent, calls = best, 1
    while spent < budget_s and calls < most:
        result, took = seconds(call)
        best, spent, calls = min(best, took), spent + took, calls + 1
    return result, best


def in_turns(calls: dict[Hashable, Callable[[], Any]], repeats: int,
             warmup: bool = True) -> dict[Hashable, Timing]:
    """Each zero-argument call timed `repeats` times, one call of each per round, the order reversed every
    other round; with `warmup`, each is called once first (in order), untimed but recorded as `first_s`."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    first = {name: seconds(call)[1] if warmup else None for name, call in calls.items()}
    times: dict[str, list[float]] = {name: [] for name in calls}
    order = list(calls)
    for round_index in range(repeats):
        for name in order if round_index % 2 == 0 else order[::-1]:
            times[name].append(seconds(calls[name])[1])
    return {name: Timing(first[name], times[name]) for name in calls}


def time_call(call: Callable[[], Any], repeats: int, warmup: bool = True) -> Timing:
    """One candidate alone: `in_turns` with nobody else."""
    return in_turns({"call": call}, repeats, warmup)["call"]


def time_compiled(programs: dict[str, tuple[Callable, tuple]], repeats: int, warmup: bool = True) -> dict:
    """Each jitted function of `programs` ({name: (function, arguments)}) compiled for its arguments, then
    the compiled programs timed `in_turns`. Per name: {"compile_s", "xla_bytes" (the memory XLA plans:
    temporaries, arguments and outputs), "times_s", "median_s"}."""
    results, calls = {}, {}
    for name, (function, arguments) in programs.items():
        start = perf_counter()
        compiled = function.lower(*arguments).compile()
        memory = compiled.memory_analysis()
        results[name] = {"compile_s": perf_counter() - start,
                         "xla_bytes": memory.temp_size_in_bytes + memory.argument_size_in_bytes
                         + memory.output_size_in_bytes}
        calls[name] = functools.partial(compiled, *arguments)
    for name, timing in in_turns(calls, repeats, warmup).items():
        results[name].update(times_s=timing.times_s, median_s=timing.median_s)
    return results


def median(values: Iterable[float | None]) -> float | None:
    """The median of the values that are not None; None where none is left."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, or None where either is missing or zero (a case that did not run)."""
    return numerator / denominator if numerator and denominator else None


# -- reading results kept as {"results": {name: {"median_s": ...}}, "skipped": {name: why}} (attention, moe)

def median_of(row: dict, name: str) -> float | None:
    """`name`'s median seconds in a row of results; None where it did not run or failed."""
    return row["results"].get(name, {}).get("median_s")


def milliseconds_cell(row: dict, name: str, spec: str = ",.0f") -> str:
    """`name`'s median in milliseconds as a table cell: "–" where skipped, "error" where it failed."""
    if name in row.get("skipped", {}):
        return "–"
    seconds = median_of(row, name)
    return "error" if seconds is None else format(seconds * 1e3, spec)


def times_cell(value: float | None, spec: str = ".2f", none: str = "–") -> str:
    """A ratio as a table cell ("1.25x"), `none` where it is missing."""
    return none if value is None else f"{value:{spec}}x"
