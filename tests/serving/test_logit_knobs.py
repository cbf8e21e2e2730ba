"""Logit bias, the penalties and min-p (`jaxattn.serving.logit_knobs`): each device function against a
NumPy reference of its definition, and the engine's draws against the whole chain (bias, penalties,
temperature, min-p, top-p; vLLM's order) computed in NumPy over the model's own logits, greedy and seeded.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.model import DecoderLM
from jaxattn.sampling import filter_logits
from jaxattn.serving import RequestError, SamplingParams, logit_knobs
from jaxattn.serving.validation import MAX_LOGIT_BIAS
from tests.serving.compiles import counting_compiles
from tests.serving.test_serving import VOCAB, engine_for, model

# -- the definitions, in NumPy ------------------------------------------------------------------


def np_bias(logits, bias: dict):
    out = logits.copy()
    for token, value in bias.items():
        out[token] += value
    return out


def np_penalties(logits, prompt, drawn, presence, frequency, repetition):
    """transformers' repetition penalty over prompt and draws, then OpenAI's presence and frequency."""
    out = logits.copy()
    for token in set(prompt) | set(drawn):
        out[token] = out[token] / repetition if out[token] > 0 else out[token] * repetition
    counts = np.bincount(np.asarray(drawn, np.int64), minlength=len(logits)).astype(np.float32)
    return out - counts * frequency - (counts > 0) * presence


def np_min_p(logits, min_p):
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    return np.where(probs >= min_p * probs.max(), logits, -np.inf)


# -- the device functions against them ----------------------------------------------------------

def test_bias_penalties_and_min_p_equal_their_definitions_row_by_row():
    rng = np.random.default_rng(0)
    M, V, L = 4, 40, 24
    logits = rng.normal(0, 3, (M, V)).astype(np.float32)
    tokens = rng.integers(0, V, (M, L)).astype(np.int32)
    position, prompt_len = np.array([24, 10, 7, 1]), np.array([5, 10, 3, 1])
    presence, frequency = np.array([0.5, -1.0, 2.0, 0.0], np.float32), np.array([0.3, 1.5, -2.0, 0.0], np.float32)
    repetition = np.array([1.3, 0.7, 1.0, 2.0], np.float32)
    got = np.asarray(logit_knobs.apply_penalties(jnp.asarray(logits), jnp.asarray(tokens), jnp.asarray(position),
                                                 jnp.asarray(prompt_len), presence, frequency, repetition))
    for m in range(M):
        seq = tokens[m, :position[m]]
        want = np_penalties(logits[m], seq[:prompt_len[m]].tolist(), seq[prompt_len[m]:].tolist(),
                            presence[m], frequency[m], repetition[m])
        np.testing.assert_allclose(got[m], want, rtol=1e-6, atol=1e-6)

    biases = [{3: 5.0, 7: -100.0}, {}, {0: 1.5, 39: 100.0, 12: -0.25}, {5: 2.0}]
    ids = np.full((M, MAX_LOGIT_BIAS), logit_knobs.NO_TOKEN, np.int32)
    values = np.zeros((M, MAX_LOGIT_BIAS), np.float32)
    for m, bias in enumerate(biases):
        ids[m, :len(bias)], values[m, :len(bias)] = list(bias), list(bias.values())
    got = np.asarray(logit_knobs.apply_logit_bias(jnp.asarray(logits), jnp.asarray(ids), jnp.asarray(values)))
    np.testing.assert_allclose(got, np.stack([np_bias(logits[m], b) for m, b in enumerate(biases)]), rtol=1e-6)

    min_p = np.array([0.0, 0.05, 0.5, 1.0], np.float32)
    got = np.asarray(logit_knobs.apply_min_p(jnp.asarray(logits), jnp.asarray(min_p)))
    want = np.stack([np_min_p(logits[m], min_p[m]) for m in range(M)])
    assert np.array_equal(np.isinf(got), np.isinf(want)) and np.isinf(got[2]).sum() > 0
    np.testing.assert_allclose(got[np.isfinite(got)], want[np.isfinite(want)])


# -- the engine against the whole chain -----------------------------------------------------------

def reference_tokens(prompt, sampling: SamplingParams, max_new: int) -> list[int]:
    """The tokens the engine must draw: the model's last logits for the sequence so far, biased,
    penalised, then (sampled) divided by the temperature, min-p and top-p filtered, and drawn with
    the key `fold_in(PRNGKey(seed), position)`; greedy takes the argmax of the penalised logits."""
    config, params, kernels = model("gqa")
    forward = jax.jit(lambda tokens: DecoderLM(config, kernels).apply({"params": params}, tokens[None])[0, -1])
    drawn = []
    for _ in range(max_new):
        sequence = list(prompt) + drawn
        logits = np.asarray(forward(jnp.asarray(sequence, jnp.int32)), np.float32)
        logits = np_bias(logits, dict(sampling.logit_bias))
        logits = np_penalties(logits, prompt, drawn, sampling.presence_penalty, sampling.frequency_penalty,
                              sampling.repetition_penalty)
        if sampling.temperature == 0:
            drawn.append(int(np.argmax(logits)))
            continue
        logits = np_min_p(logits / sampling.temperature, sampling.min_p).astype(np.float32)
        logits = np.asarray(filter_logits(jnp.asarray(logits)[None], top_p=sampling.top_p)[0])
        key = jax.random.fold_in(jax.random.PRNGKey(sampling.seed), len(sequence))
        drawn.append(int(jax.random.categorical(key, jnp.asarray(logits))))
    return drawn


PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
KNOBS = dict(presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.4,
             logit_bias={7: 3.0, 11: -100.0, 20: 1.5}, max_tokens=10)


def test_greedy_draws_feel_the_bias_and_penalties_as_defined():
    engine = engine_for("gqa")
    sampling = SamplingParams(temperature=0.0, **KNOBS)
    plain = engine.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=10))[0]
    got = engine.generate([PROMPT], sampling)[0]
    assert got == reference_tokens(PROMPT, sampling, 10)
    assert got != plain and 11 not in got  # the knobs changed the answer; the banned token never came
    engine.allocator.check_all_free()


def test_seeded_draws_with_every_knob_follow_the_chain_and_ignore_their_neighbours():
    engine = engine_for("gqa")
    sampling = SamplingParams(temperature=0.8, min_p=0.1, top_p=0.9, seed=77, **KNOBS)
    want = reference_tokens(PROMPT, sampling, 10)
    alone = engine.generate([PROMPT], sampling)[0]
    others = [engine.add_request([2 + i] * (5 + 3 * i), SamplingParams(temperature=1.0, max_tokens=8,
                                                                       frequency_penalty=-1.0 * i))
              for i in range(3)]
    engine.step()
    beside = engine.add_request(PROMPT, sampling)
    engine.run()
    assert alone == want and beside.output_ids == want and all(r.finished for r in others)
    engine.allocator.check_all_free()


@pytest.mark.parametrize("changes, param", [
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-3.0), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(min_p=1.5), "min_p"),
    (dict(logit_bias={1: 101.0}), "logit_bias"), (dict(logit_bias={"1": 1.0}), "logit_bias"),
    (dict(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}), "logit_bias"),
])
def test_knobs_out_of_range_are_refused_naming_the_field(changes, param):
    with pytest.raises(RequestError) as caught:
        SamplingParams(**changes)
    assert caught.value.param == param and param in str(caught.value)


def test_the_engine_refuses_bias_outside_its_vocabulary_and_penalties_it_cannot_keep():
    with pytest.raises(RequestError, match="vocab_size") as caught:
        engine_for("gqa").add_request([1, 2], SamplingParams(logit_bias={VOCAB: 1.0}))
    assert caught.value.param == "logit_bias"
    with pytest.raises(RequestError, match="sliding window") as caught:  # pages behind the window are given back
        engine_for("windows_sinks").add_request([1, 2], SamplingParams(presence_penalty=1.0))
    assert caught.value.param == "presence_penalty"


def test_the_knobs_compile_no_program_after_start_up():
    engine = engine_for("gqa")
    asks = [SamplingParams(temperature=0.0, **KNOBS), SamplingParams(temperature=0.7, min_p=0.2, seed=1, **KNOBS),
            SamplingParams(temperature=1.0, max_tokens=4, logit_bias={5: -3.0})]
    engine.generate([PROMPT], asks[0])  # anything the first use of the engine compiles besides its programs
    with counting_compiles() as compiles:
        requests = [engine.add_request(PROMPT, sampling) for sampling in asks]
        requests += engine.add_choices(PROMPT[:9], SamplingParams(temperature=1.0, max_tokens=3, seed=2), n=2,
                                       best_of=3)
        engine.run()
    assert compiles == [] and all(r.finish_reason == "length" for r in requests)
