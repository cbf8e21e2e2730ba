"""Log-probabilities in the engine (`SamplingParams.logprobs`, `prompt_logprobs`): each equals the
model's own float32 log-softmax (`DecoderLM.apply` on the whole sequence) to 1e-5, whatever the
prompt's chunks, the rows beside it, the prefix cache or the sampling knobs (the numbers are before
temperature and filters); `max_tokens` 0 only scores; the refusals name their field.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.model import DecoderLM
from jaxattn.serving import Engine, EngineConfig, RequestError, SamplingParams
from tiny_models import drawn_params, tiny_config

VOCAB, CONTEXT, K = 48, 64, 20
# Chunks of 8 in two rows: a prompt of 19 tokens is computed over two steps, three rows.
ENGINE = EngineConfig(max_seqs=4, page_size=4, chunk=8, prefill_rows=2, num_pages=40)
CONFIG = tiny_config("gqa", positions="rope", vocab_size=VOCAB, max_seq_len=CONTEXT)
PARAMS = drawn_params(CONFIG, seed=5, std=0.4)


@pytest.fixture(scope="module")
def engine():
    return Engine(PARAMS, CONFIG, ENGINE)


def reference(ids) -> np.ndarray:
    """`[T, V]` float32 log-softmax of the model's logits on `ids` (position t predicts token t + 1)."""
    logits = DecoderLM(CONFIG).apply({"params": PARAMS}, jnp.asarray([ids], jnp.int32))[0]
    return np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32)))


def check_top(top, row: np.ndarray, k: int):
    """`top` is the k most likely (id, logprob) of `row`, most likely first."""
    assert len(top) == k
    ids = [i for i, _ in top]
    np.testing.assert_allclose([v for _, v in top], row[ids], atol=1e-5)
    np.testing.assert_allclose([v for _, v in top], np.sort(row)[::-1][:k], atol=1e-5)


def prompt(seed: int, length: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, length).tolist()


@pytest.mark.parametrize("knobs", [dict(temperature=0.0), dict(temperature=0.7, top_k=5, top_p=0.8, seed=3)])
def test_output_logprobs_are_the_models_log_softmax(engine, knobs):
    """Each drawn token's log-probability and the top 7, before temperature and filters, beside a row
    that asks for nothing."""
    ids = prompt(0, 19)
    asked = engine.add_request(ids, SamplingParams(max_tokens=6, logprobs=7, **knobs))
    plain = engine.add_request(prompt(1, 11), SamplingParams(max_tokens=6, **knobs))
    engine.run()
    expected = reference(ids + asked.output_ids)[len(ids) - 1:-1]  # the rows that drew each output token
    assert len(asked.output_logprobs) == len(asked.output_ids) == 6
    np.testing.assert_allclose(asked.output_logprobs, expected[np.arange(6), asked.output_ids], atol=1e-5)
    for top, row in zip(asked.output_top_logprobs, expected):
        check_top(top, row, 7)
    assert plain.output_logprobs == [] and plain.output_top_logprobs == [] and plain.prompt_logprobs == []


@pytest.mark.parametrize("length", [27, 4])
def test_prompt_logprobs_over_chunks_and_steps(engine, length):
    """A prompt of 27 tokens (chunks of 8 over two steps) or of 4 (the short prefill shape, one row of 4)
    beside a decoding row: each token's log-probability given those before it (the first None), and its
    top 3."""
    engine.add_request(prompt(2, 5), SamplingParams(max_tokens=12, temperature=0.0))
    engine.step()
    ids = prompt(3, length)
    request = engine.add_request(ids, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3, logprobs=0))
    engine.run()
    expected = reference(ids + request.output_ids)
    assert request.prompt_logprobs[0] is None and request.prompt_top_logprobs[0] is None
    assert len(request.prompt_logprobs) == length
    np.testing.assert_allclose(request.prompt_logprobs[1:], expected[np.arange(length - 1), ids[1:]], atol=1e-5)
    for top, row in zip(request.prompt_top_logprobs[1:], expected):
        check_top(top, row, 3)
    assert request.output_top_logprobs == [(), ()]  # logprobs 0: the drawn token's alone
    np.testing.assert_allclose(request.output_logprobs, expected[[length - 1, length], request.output_ids], atol=1e-5)


def test_max_tokens_zero_only_scores_even_on_a_cached_prefix(engine):
    """max_tokens 0 draws nothing and ends ("length"); a prompt whose pages the prefix cache holds is
    still scored whole (such a request does not look the cache up)."""
    ids = prompt(4, 21)
    engine.generate([ids], SamplingParams(max_tokens=1, temperature=0.0))  # its pages are in the cache now
    hits = engine.stats["prefix_hit_tokens"]
    request = engine.add_request(ids, SamplingParams(max_tokens=0, prompt_logprobs=1))
    engine.run()
    assert request.output_ids == [] and request.finish_reason == "length"
    assert engine.stats["prefix_hit_tokens"] == hits
    np.testing.assert_allclose(request.prompt_logprobs[1:], reference(ids)[np.arange(20), ids[1:]], atol=1e-5)
    one = engine.add_request(ids[:1], SamplingParams(max_tokens=0, prompt_logprobs=2))  # a prompt of one token
    engine.run()
    assert one.prompt_logprobs == [None] and one.output_ids == [] and one.finish_reason == "length"
    engine.allocator.check_all_free()


@pytest.mark.parametrize("field, value", [("logprobs", 21), ("logprobs", -1), ("prompt_logprobs", 21),
                                          ("logprobs", True), ("max_tokens", 0), ("max_tokens", -1)])
def test_bad_values_name_their_field(field, value):
    with pytest.raises(RequestError) as caught:
        SamplingParams(**{field: value})
    assert caught.value.param == field


def test_no_more_programs_and_no_logprobs_when_none_asks(engine):
    """The programs are those of the shapes (one each), and a step where nobody asks reads nothing back."""
    assert len(engine.programs.programs) == len(engine.programs.shapes)
    engine.add_request(prompt(6, 9), SamplingParams(max_tokens=2))
    output = engine.scheduler.schedule()
    tokens, finite, logprobs = engine.model_runner.execute(output)
    assert logprobs is None
    engine.scheduler.update(output, tokens, finite, logprobs)
    engine.run()
