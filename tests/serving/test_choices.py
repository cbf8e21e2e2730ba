"""Several choices of one prompt (`Engine.add_choices`): each seeded choice equals a solo request with
its seed, the prompt's full pages are computed once (the engine's counters), and best_of ranks the
sequences by their tokens' raw log-probabilities, summed.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.model import DecoderLM
from jaxattn.serving import RequestError, SamplingParams
from jaxattn.serving.validation import MAX_CHOICES
from tests.serving.test_serving import ENGINE, engine_for, model

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8]  # 19 tokens: 4 full pages of 4 and a tail of 3
SAMPLED = SamplingParams(temperature=1.0, top_k=20, seed=500, max_tokens=6, presence_penalty=0.5)


def test_each_seeded_choice_equals_a_solo_request_with_its_seed():
    engine = engine_for("gqa")
    choices = engine.add_choices(PROMPT, SAMPLED, n=3)
    engine.run()
    solo = [engine.generate([PROMPT], SamplingParams(**{**SAMPLED.__dict__, "seed": 500 + i}))[0] for i in range(3)]
    assert [c.output_ids for c in choices] == solo
    assert len({tuple(s) for s in solo}) == 3  # the seeds differ, so do the choices
    engine.allocator.check_all_free()


def prompt_tokens_computed(engine, add) -> int:
    """The prompt tokens the engine computed for the requests `add()` queues (every token computed, less
    the drawn ones computed to draw the next), with no preemption."""
    before = {k: engine.stats[k] for k in ("prefill_tokens", "decode_tokens", "preemptions")}
    requests = add()
    engine.run()
    engine.allocator.check_all_free()
    assert engine.stats["preemptions"] == before["preemptions"]
    computed = sum(engine.stats[k] - before[k] for k in ("prefill_tokens", "decode_tokens"))
    return computed - sum(len(r.output_ids) - 1 for r in requests)


def test_n_choices_compute_the_prompt_s_full_pages_once():
    engine = engine_for("gqa")
    ps, n, P = ENGINE.page_size, 2, len(PROMPT)  # two apart fill the test engine's pool without preemption
    short = SamplingParams(**{**SAMPLED.__dict__, "max_tokens": 3})
    first, second = ([v + 20, *PROMPT[1:]] for v in (1, 2))  # prompts no earlier test left in the prefix cache
    shared = prompt_tokens_computed(engine, lambda: engine.add_choices(first, short, n=n))
    apart = prompt_tokens_computed(engine, lambda: [engine.add_request(second, short) for _ in range(n)])
    tail = P - (P - 1) // ps * ps  # the last, partial page's tokens (and the token before the first draw)
    assert shared == P + (n - 1) * tail and apart == n * P, (shared, apart)


def raw_logprob_sum(prompt, output) -> float:
    config, params, kernels = model("gqa")
    sequence = jnp.asarray([list(prompt) + list(output)], jnp.int32)
    logits = np.asarray(DecoderLM(config, kernels).apply({"params": params}, sequence)[0], np.float64)
    logprobs = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    return float(sum(logprobs[len(prompt) - 1 + i, token] for i, token in enumerate(output)))


def test_best_of_ranks_the_sequences_by_their_raw_log_probability():
    engine = engine_for("gqa")
    sequences = engine.add_choices(PROMPT, SAMPLED, n=2, best_of=5)
    engine.run()
    for request in sequences:
        assert request.cumulative_logprob == pytest.approx(raw_logprob_sum(PROMPT, request.output_ids), abs=1e-4)
    best = engine.best(sequences, 2)
    assert [r.cumulative_logprob for r in best] == sorted((r.cumulative_logprob for r in sequences), reverse=True)[:2]
    plain = engine.add_choices(PROMPT, SAMPLED, n=2)
    engine.run()
    assert all(r.cumulative_logprob == 0.0 for r in plain)  # nobody asked: the step computed none


@pytest.mark.parametrize("n, best_of, param", [(0, None, "n"), (MAX_CHOICES + 1, None, "n"), (2, 1, "best_of"),
                                               (1, MAX_CHOICES + 1, "best_of")])
def test_choices_out_of_range_are_refused_naming_the_field(n, best_of, param):
    engine = engine_for("gqa")
    with pytest.raises(RequestError) as caught:
        engine.add_choices(PROMPT, SAMPLED, n=n, best_of=best_of)
    assert caught.value.param == param and not engine.has_unfinished()
