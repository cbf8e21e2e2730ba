"""Speculative decoding in the engine (`jaxattn.serving.speculation`, `jaxattn.serving.verify`): greedy tokens
equal `generate`'s (or the plain engine's) for every attention kind, int8 pages, several steps per call,
random arrivals, cancellations and preemptions; requests ending inside an accepted run (stop token, stop
string, `max_tokens`) end as the plain engine's; the token budget counts drafts; a rolled-back cache is
bit-exact; the engine's acceptance rule draws each emitted token from the target's distribution (20k
draws, chi-square at p = 0.001) for a good, a deliberately bad and a filtered-out draft and the bonus token.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxattn.serving import Engine, EngineConfig, SamplingParams
from jaxattn.serving.step import DrawKnobs
from jaxattn.serving.verify import accept_drafts, verify_inputs, widths
from jaxattn.speculative import DraftProposer, NgramSettings
from tests.serving.test_serving import ENGINE, draw_requests, expected, model, run_schedule
from tiny_models import drawn_params

K = 3
LOOKUP = NgramSettings(n_min=1, n_max=3, k=K)
LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEF"


def letters(ids) -> str:
    return "".join(LETTERS[i] for i in ids)


@functools.lru_cache(maxsize=None)
def spec_engine(name, kv_cache="auto", decode_steps=None, speculative=LOOKUP, token_budget=None):
    """The serving tests' engine of `name`, drafting by prompt lookup (None: plain), letters as its text."""
    config, params, kernels = model(name)
    ec = dataclasses.replace(ENGINE, kv_cache=kv_cache, decode_steps=decode_steps, speculative=speculative,
                             token_budget=token_budget)
    return Engine(params, config, ec, kernels=kernels.replace(paged="gather"), detokenize=letters)


def recording(engine):
    """Wraps the engine's `update_verify`: returns a list that gets, per verification step, each row's
    (request, drafts, emitted tokens, its output before them)."""
    steps, scheduler = [], engine.scheduler
    update = type(scheduler).update_verify

    def wrapped(output, tokens, finite, logprobs=None):
        steps.append([(r, list(d), list(t), len(r.output_ids)) for r, d, t in zip(output.decode, output.drafts, tokens)])
        return update(scheduler, output, tokens, finite, logprobs)

    scheduler.update_verify = wrapped
    return steps


def greedy(max_tokens, **changes):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **changes)


@pytest.mark.parametrize("name, kv_cache, decode_steps", [("mha", "auto", None), ("gqa", "auto", None),
                                                          ("mla", "auto", None), ("windows_sinks", "auto", None),
                                                          ("moe", "auto", None), ("gqa", "int8", None),
                                                          ("gqa", "auto", 4)])
def test_greedy_tokens_equal_plain_decoding_under_any_schedule(name, kv_cache, decode_steps):
    engine = spec_engine(name, kv_cache, decode_steps)
    plain = spec_engine(name, kv_cache, speculative=None) if kv_cache == "int8" else None
    steps, calls = recording(engine), engine.stats["multi_step_calls"]
    prompts, max_tokens, rng = draw_requests(3 if decode_steps else 0, count=4)  # seeds with drafts kept
    requests = [engine.add_request(p, greedy(m)) for p, m in zip(prompts, max_tokens)]
    engine.run()
    engine.allocator.check_all_free()
    assert engine.stats["multi_step_calls"] > calls or not decode_steps  # verifications and calls mixed
    want = [expected(name, p)[:m] if plain is None else plain.generate([p], greedy(m))[0]
            for p, m in zip(prompts, max_tokens)]
    assert [r.output_ids for r in requests] == want
    kept = sum(len(tokens) - 1 for step in steps for _, _, tokens, _ in step)
    assert steps and kept > 0, "no draft was kept: the equality above checked no accepted run"
    if name not in ("gqa", "mla") or plain is not None or decode_steps:
        return
    # Random arrivals, cancellations and preemptions in the small pool, verification steps among them.
    prompts, max_tokens, rng = draw_requests(2)
    for request, i in run_schedule(engine, prompts, max_tokens, rng):
        full = expected(name, prompts[i])[:max_tokens[i]]
        assert request.output_ids == full[:len(request.output_ids)], (i, request)
        assert request.finish_reason == "cancelled" or request.output_ids == full
    assert engine.stats["preemptions"] > 0
    engine.allocator.check_all_free()


@pytest.mark.parametrize("draft", ["itself", "another"])
def test_a_draft_model_gives_greedy_tokens_equal_plain_decoding(draft):
    config, params, kernels = model("gqa")
    draft_params = params if draft == "itself" else drawn_params(config, seed=9, std=0.4)
    engine = Engine(params, config, ENGINE, kernels=kernels.replace(paged="gather"),
                    draft=DraftProposer(draft_params, config, k=K, kernels=kernels))
    prompts, max_tokens, rng = draw_requests(6, count=6)  # more than the rows: draft rows are reused
    requests = [engine.add_request(p, greedy(m)) for p, m in zip(prompts, max_tokens)]
    engine.run()
    assert [r.output_ids for r in requests] == [expected("gqa", p)[:m] for p, m in zip(prompts, max_tokens)]
    metrics = engine.speculator.metrics()
    assert metrics["draft_tokens"] > 0
    if draft == "itself":  # the target drafting for itself: every draft is kept
        assert metrics["acceptance_rate"] == 1.0
    engine.allocator.check_all_free()


def ending_inside_a_run(engine, prompts):
    """From a greedy run of `prompts`: a request's prompt, a token that first appears inside a verification
    step's emitted run (not its first token), and that token's index in the output."""
    steps = recording(engine)
    requests = [engine.add_request(p, greedy(12)) for p in prompts]
    engine.run()
    for step in steps:
        for request, _, tokens, before in step:
            for i, token in enumerate(tokens[1:], 1):
                if token not in request.output_ids[:before + i]:
                    return request.prompt_ids, token, before + i
    raise AssertionError(f"no run emitted a new token after its first: {[r.output_ids for r in requests]}")


def test_requests_ending_inside_an_accepted_run_end_as_plain_decoding_does():
    engine, plain = spec_engine("gqa"), spec_engine("gqa", speculative=None)
    prompts, _, _ = draw_requests(11, count=8)
    prompt, token, index = ending_inside_a_run(engine, prompts)
    full = plain.generate([prompt], greedy(12))[0]
    stop = letters(full[index - 1:index + 1])  # the string ends on the token inside the run
    cases = [greedy(12, stop_token_ids=(token,)), greedy(12, stop=(stop,)), greedy(index + 1), greedy(12)]
    for sampling in cases:
        ours, theirs = engine.add_request(prompt, sampling), plain.add_request(prompt, sampling)
        engine.run()
        plain.run()
        assert (ours.output_ids, ours.finish_reason) == (theirs.output_ids, theirs.finish_reason), sampling
        assert ours.take_new()[1] == theirs.take_new()[1]
    assert ours.output_ids == full
    engine.allocator.check_all_free()


def test_a_verification_step_keeps_to_the_token_budget():
    engine = spec_engine("gqa", token_budget=6)
    steps = recording(engine)
    prompts, _, _ = draw_requests(3, count=4)
    requests = [engine.add_request(p, greedy(10)) for p in prompts]
    engine.run()
    assert steps
    assert all(sum(len(d) + 1 for _, d, _, _ in step) <= 6 for step in steps)
    assert [r.output_ids for r in requests] == [expected("gqa", p)[:10] for p in prompts]


def test_a_rolled_back_cache_is_bit_exact_against_the_kept_tokens_alone():
    engine = spec_engine("gqa")
    runner = engine.model_runner
    prompt = draw_requests(5, count=1)[0][0]
    full = expected("gqa", prompt)
    request = engine.add_request(prompt, greedy(len(full)))
    while not request.output_ids:
        engine.step()
    start = request.num_computed  # its last token's slot: the verification writes it and the drafts after
    engine.kv_cache_manager.reserve(request, K + 1)
    wrong = (full[1] + 1) % 32
    before = jax.tree.map(np.array, (runner.pools, runner.history))

    def verify(drafts):
        runner.pools, runner.history = jax.tree.map(jnp.asarray, before)
        programs = runner.verifies
        inputs = verify_inputs([request], [np.array(drafts, np.int32)], 1, programs.widths[-1], page_size=runner.page_size,
                               pages_per_seq=runner.pages_per_seq, num_slots=runner.num_slots,
                               vocab_size=32, lora=False)
        runner.pools, runner.history, tokens, accepted, *_ = programs.run(runner.params, runner.pools,
                                                                          runner.history, inputs)
        return int(accepted[0]), np.asarray(tokens)[0].tolist(), jax.tree.map(np.array, runner.pools)

    accepted, tokens, rolled = verify([full[1], wrong, full[2]])
    assert (accepted, tokens[:2]) == (1, full[1:3])
    _, _, kept = verify([full[1]])
    slots = [request.pages[p // 4] * 4 + p % 4 for p in range(start + 2)]  # through the kept draft
    for a, b in zip(jax.tree.leaves(rolled), jax.tree.leaves(kept)):
        flat_a, flat_b = a.reshape(-1, *a.shape[2:]), b.reshape(-1, *b.shape[2:])
        np.testing.assert_array_equal(flat_a[slots], flat_b[slots])
    engine.cancel(request)
    engine.step()
    engine.allocator.check_all_free()


V, DRAWS, ALPHA = 8, 20_000, 1e-3
LOGITS = np.log(np.array([[0.30, 0.20, 0.14, 0.11, 0.09, 0.07, 0.05, 0.04],    # p after the last token
                          [0.05, 0.05, 0.10, 0.10, 0.15, 0.15, 0.20, 0.20]]))  # p after the first draft


@functools.partial(jax.jit, static_argnames=("top_k",))
def engine_draws(draft, top_k=0):
    """20k rows of one draft `draft` each (W = 2), each with its own seed, at temperature 1: the emitted
    tokens `[DRAWS, 2]` and the drafts kept `[DRAWS]`."""
    M = DRAWS * 2
    empty = DrawKnobs.empty(M, V)
    knobs = empty.replace(temperature=jnp.ones(M), top_k=jnp.full(M, top_k, jnp.int32),
                          seed=jnp.repeat(jnp.arange(DRAWS, dtype=jnp.int32), 2),
                          position=jnp.tile(jnp.array([10, 11], jnp.int32), DRAWS))
    logits = jnp.tile(jnp.asarray(LOGITS, jnp.float32), (DRAWS, 1))
    drafts = jnp.tile(jnp.array([[draft, -1]], jnp.int32), (DRAWS, 1))
    return accept_drafts(logits, knobs, drafts, jnp.ones(DRAWS, jnp.int32))


def chi_square_pvalue(draws, p) -> float:
    counts = np.bincount(np.asarray(draws), minlength=V)
    return stats.chisquare(counts, len(draws) * np.asarray(p) / np.sum(p)).pvalue


@pytest.mark.parametrize("draft", [0, 7])  # the most likely token, and a deliberately bad draft
def test_each_emitted_token_is_distributed_as_the_target(draft):
    tokens, accepted = (np.asarray(a) for a in engine_draws(draft))
    p = np.exp(LOGITS)
    assert chi_square_pvalue(tokens[:, 0], p[0]) > ALPHA
    assert abs(accepted.mean() - p[0, draft]) < 4 * np.sqrt(p[0, draft] * (1 - p[0, draft]) / DRAWS)
    bonus = tokens[accepted == 1, 1]  # every draft kept: the bonus token, from p after the draft
    assert chi_square_pvalue(bonus, p[1]) > ALPHA


def test_a_draft_the_filters_remove_is_never_kept_and_the_draws_keep_the_filters():
    tokens, accepted = (np.asarray(a) for a in engine_draws(7, top_k=3))
    p = np.exp(LOGITS[0, :3])
    assert not accepted.any()
    assert set(np.unique(tokens[:, 0])) <= {0, 1, 2}
    assert chi_square_pvalue(tokens[:, 0], np.concatenate([p, np.zeros(V - 3)]) + 1e-12) > ALPHA


def test_a_row_without_drafts_draws_what_a_plain_step_draws():
    sampled = SamplingParams(temperature=1.0, seed=5, max_tokens=6)
    prompts, _, _ = draw_requests(4, count=2)
    engine, plain = spec_engine("gqa"), spec_engine("gqa", speculative=None)
    steps = recording(engine)
    ours = [engine.add_request(p, sampled) for p in prompts]
    engine.run()
    theirs = [plain.add_request(p, sampled) for p in prompts]
    plain.run()
    # Each row draws as a plain step until the first verification step in which it drafted.
    for request, other in zip(ours, theirs):
        drafted = [before for step in steps for r, d, _, before in step if r is request and d]
        first = min(drafted, default=len(request.output_ids))
        assert first >= 1 and request.output_ids[:first] == other.output_ids[:first]
        assert all(0 <= t < 32 for t in request.output_ids) and request.finish_reason == "length"


def test_engine_config_refuses_a_speculative_setting_it_cannot_use():
    with pytest.raises(TypeError, match="EngineConfig.speculative must be an NgramSettings"):
        EngineConfig(speculative="ngram:k=4")
    config, params, kernels = model("gqa")
    other = config.replace(vocab_size=40)
    with pytest.raises(ValueError, match=r"the draft model's vocabulary \(40\) is not the target's \(32\)"):
        Engine(params, config, ENGINE, draft=DraftProposer(drawn_params(other), other, k=2))
    with pytest.raises(ValueError, match="not both"):
        Engine(params, config, dataclasses.replace(ENGINE, speculative=LOOKUP),
               draft=DraftProposer(params, config, k=2))


def test_log_probabilities_of_kept_drafts_equal_plain_decoding_s():
    engine, plain = spec_engine("gqa"), spec_engine("gqa", speculative=None)
    steps = recording(engine)
    prompts, _, _ = draw_requests(0, count=4)
    ours = [engine.add_request(p, greedy(10, logprobs=2)) for p in prompts]
    engine.run()
    theirs = [plain.add_request(p, greedy(10, logprobs=2)) for p in prompts]
    plain.run()
    assert any(len(tokens) > 1 for step in steps for _, _, tokens, _ in step)
    for a, b in zip(ours, theirs):
        assert a.output_ids == b.output_ids
        np.testing.assert_allclose(a.output_logprobs, b.output_logprobs, atol=2e-5)
        assert [[i for i, _ in top] for top in a.output_top_logprobs] == \
            [[i for i, _ in top] for top in b.output_top_logprobs]


def test_verification_widths_follow_the_counts_an_adaptive_k_takes():
    assert [widths(k) for k in (1, 2, 3, 4, 8)] == [(2,), (2, 3), (2, 3, 4), (2, 3, 5), (2, 3, 5, 9)]
    programs = spec_engine("gqa").model_runner.verifies
    assert programs.shape(1, 1) == (1, 2) and programs.shape(2, 3) == (4, 4) and programs.shape(4, 2) == (4, 3)


def test_the_engine_times_its_decode_only_steps_into_what_drafting_costs():
    engine = spec_engine("mha", "auto", None)  # the first test's engine (the cache's key: these arguments)
    costs = engine.speculator.costs
    prompts, max_tokens, _ = draw_requests(0, count=4)
    for _ in range(2):  # the same steps twice: a shape's first timing is left out (it may have compiled)
        requests = [engine.add_request(p, greedy(m)) for p, m in zip(prompts, max_tokens)]
        engine.run()
    schedules = [r.draft_schedule for r in requests if r.draft_schedule is not None]  # those that decoded
    assert schedules and all(s.costs is costs for s in schedules)  # one machine: the requests share its costs
    widths_timed = {width for _, width in costs.timings}
    assert 1 in widths_timed and widths_timed - {1}, costs.timings  # plain steps and verifications
    assert all(0 < min(t) <= max(t) < 60 and 1 <= rows <= ENGINE.max_seqs for (rows, _), t in costs.timings.items())
    rows = next(rows for rows, width in costs.timings if width > 1 and (rows, 1) in costs.timings)
    width = next(width for r, width in costs.timings if r == rows and width > 1)
    assert costs.relative(rows, width - 1) == pytest.approx(costs.seconds(rows, width) / costs.seconds(rows, 1))
