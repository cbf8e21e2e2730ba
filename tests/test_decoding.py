"""Cached generation: equal to full recomputation, batch independent, compiled once, stoppable."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn import decoding, windowed
from jaxattn.config import MLAConfig, ModelConfig
from jaxattn.kernels import Kernels
from jaxattn.model import DecoderLM
from tiny_models import drawn_params

ATTENTION = {
    "mha": dict(),
    "gqa": dict(num_kv_heads=2),
    "mqa": dict(num_kv_heads=1),
    "mla": dict(mla=MLAConfig(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)),
}
POSITIONS = ("learned", "sinusoidal", "rope", "none")
# Two rows of different lengths, right-padded: per-row offsets and padding are exercised everywhere.
PROMPTS = np.array([[3, 1, 4, 1, 5, 9, 2], [6, 5, 3, 0, 0, 0, 0]], np.int32)
LENGTHS = np.array([7, 3], np.int32)
NEW = 6


def tiny_config(attention="mha", positions="learned", **changes) -> ModelConfig:
    base = dict(vocab_size=17, d_model=32, num_layers=2, num_heads=4, max_seq_len=32, positions=positions,
                **ATTENTION[attention])
    return ModelConfig(**{**base, **changes})


@functools.lru_cache(maxsize=None)
def tiny_params(config: ModelConfig):
    # std 0.2 makes the logits far from uniform, so argmax ties and float noise cannot hide a bug.
    return drawn_params(config, std=0.2)


@functools.lru_cache(maxsize=None)
def _compiled_forward(config: ModelConfig):
    return jax.jit(DecoderLM(config).apply)  # one program per config and token shape, shared by the tests


def forward(config, tokens):
    """Logits `[B, T, V]` of one full (uncached) forward pass."""
    return _compiled_forward(config)({"params": tiny_params(config)}, jnp.asarray(tokens))


def greedy(config, prompts=PROMPTS, lengths=LENGTHS, new=NEW, **kwargs):
    return decoding.generate(tiny_params(config), config, prompts, lengths, max_new_tokens=new,
                             rng=jax.random.PRNGKey(0), temperature=0.0, **kwargs)


def full_sequences(prompts, lengths, generated):
    """Each row's prompt followed by its generated tokens, `[B, max(P) + new]`, right-padded."""
    rows = [np.concatenate([p[:n], g]) for p, n, g in zip(prompts, lengths, np.asarray(generated))]
    out = np.zeros((len(rows), max(map(len, rows))), np.int32)
    for b, row in enumerate(rows):
        out[b, :len(row)] = row
    return out


# Every kind with two position schemes and every scheme with two kinds: the full cross product of
# kinds and schemes is checked one level down, on `extend` (tests/cache/test_cache.py); here the same
# exactness through `generate`'s scan loop.
PAIRS = [("mha", "learned"), ("mha", "none"), ("gqa", "rope"), ("gqa", "sinusoidal"), ("mqa", "learned"),
         ("mqa", "rope"), ("mla", "sinusoidal"), ("mla", "none")]
assert {a for a, _ in PAIRS} == set(ATTENTION) and {p for _, p in PAIRS} == set(POSITIONS)


@pytest.mark.parametrize("attention, positions", PAIRS)
def test_cached_logits_equal_full_forward_at_every_step(attention, positions):
    """Every kind and position scheme; the decode kernels alternate between the reference and XLA:CPU's."""
    config = tiny_config(attention, positions)
    decode = ("xla", "xla_cpu")[(list(ATTENTION).index(attention) + POSITIONS.index(positions)) % 2]
    out = greedy(config, return_logits=True, kernels=Kernels(decode=decode))
    chex.assert_shape(out.tokens, (2, NEW))
    chex.assert_shape(out.logits, (2, NEW, config.vocab_size))
    # One causal forward pass over prompt + generated tokens: position t's logits are those of the
    # prefix that ends at t (test_step_by_step_prefixes checks that with separate passes too).
    sequences = full_sequences(PROMPTS, LENGTHS, out.tokens)
    full = forward(config, sequences)
    for b, n in enumerate(LENGTHS):
        np.testing.assert_allclose(out.logits[b], full[b, n - 1:n - 1 + NEW], atol=2e-5, rtol=1e-5)
    np.testing.assert_array_equal(out.tokens, jnp.argmax(out.logits, -1))
    np.testing.assert_array_equal(out.counts, [NEW, NEW])


@pytest.mark.parametrize("attention, positions", [("mha", "learned"), ("mla", "rope")])
def test_greedy_tokens_equal_a_python_loop_of_full_forward_passes(attention, positions):
    config = tiny_config(attention, positions)
    out = greedy(config, return_logits=True)
    b, n = 1, LENGTHS[1]  # the padded row
    prefix = list(PROMPTS[b, :n])
    for step in range(NEW):  # a separate forward pass over each unpadded prefix
        logits = forward(config, [prefix])[0, -1]
        np.testing.assert_allclose(out.logits[b, step], logits, atol=2e-5, rtol=1e-5)
        prefix.append(int(jnp.argmax(logits)))
    np.testing.assert_array_equal(out.tokens[b], prefix[n:])


def test_cached_and_recomputed_generation_agree_when_sampling():
    config = tiny_config("mla", "rope")
    kwargs = dict(max_new_tokens=NEW, rng=jax.random.PRNGKey(3), temperature=1.3, top_k=8, top_p=0.95)
    cached = decoding.generate(tiny_params(config), config, PROMPTS, LENGTHS, **kwargs)
    recomputed = decoding.generate_without_cache(tiny_params(config), config, PROMPTS, LENGTHS, **kwargs)
    np.testing.assert_array_equal(cached.tokens, recomputed.tokens)


def test_a_row_does_not_depend_on_the_rest_of_the_batch():
    config = tiny_config("gqa", "learned")
    prompts = [[5, 1, 2], [4, 4, 8, 1, 9, 0, 3, 3, 2], [7] * 14]
    padded = np.zeros((3, 14), np.int32)
    for b, p in enumerate(prompts):
        padded[b, :len(p)] = p
    together = greedy(config, padded, np.array([3, 9, 14]), new=8)
    for b, p in enumerate(prompts):
        alone = greedy(config, np.array([p]), np.array([len(p)]), new=8)
        np.testing.assert_array_equal(together.tokens[b], alone.tokens[0])


@pytest.fixture
def traces(monkeypatch):
    """Counts how often the decoding loop is traced: `_decode` runs only while a jitted
    generation program is being traced, never when a compiled one is called."""
    count = {"n": 0}
    traced = decoding._decode

    def counting(*args, **kwargs):
        count["n"] += 1
        return traced(*args, **kwargs)
    monkeypatch.setattr(decoding, "_decode", counting)
    return count


def test_no_retrace_for_a_new_prompt_in_the_same_bucket_or_new_knobs(traces):
    config = tiny_config("mha", "rope", num_layers=1)  # a config no other test compiles
    params = tiny_params(config)
    run = functools.partial(decoding.generate, params, config, max_new_tokens=5)
    run(PROMPTS[:, :5], np.array([5, 3]), rng=jax.random.PRNGKey(0), temperature=0.7)
    assert traces["n"] == 1
    # Lengths 7 and 6 share bucket 8 with 5 and 3; every knob and the seed change.
    run(PROMPTS, np.array([7, 6]), rng=jax.random.PRNGKey(1), temperature=0.0, top_k=3, top_p=0.5, stop_token=4)
    run(PROMPTS[:, :6], np.array([2, 6]), rng=jax.random.PRNGKey(2), temperature=1.5, top_p=0.9, pad_token=1)
    assert traces["n"] == 1
    # The counter does see a new bucket (length 9 -> 16).
    run(np.ones((2, 9), np.int32), np.array([9, 9]), rng=jax.random.PRNGKey(0))
    assert traces["n"] == 2


def test_stop_token_freezes_the_row_and_pads_the_rest():
    config = tiny_config("mha", "learned")
    free = np.asarray(greedy(config, new=12).tokens)
    stop = int(free[0, 3])
    first_stop = [int(np.flatnonzero(row == stop)[0]) if (row == stop).any() else None for row in free]
    out = greedy(config, new=12, stop_token=stop, pad_token=16)
    for b, index in enumerate(first_stop):
        if index is None:
            np.testing.assert_array_equal(out.tokens[b], free[b])
            assert int(out.counts[b]) == 12
        else:
            np.testing.assert_array_equal(out.tokens[b, :index + 1], free[b, :index + 1])
            assert (np.asarray(out.tokens[b, index + 1:]) == 16).all()
            assert int(out.counts[b]) == index + 1
    assert first_stop[0] is not None and first_stop[0] <= 3


def test_stopped_row_leaves_the_other_row_unchanged():
    config = tiny_config("gqa", "rope")
    free = np.asarray(greedy(config, new=10).tokens)
    stop = int(free[1, 0])  # row 1 stops at once
    out = greedy(config, new=10, stop_token=stop)
    assert int(out.counts[1]) == 1
    row0_stop = np.flatnonzero(free[0] == stop)
    end = row0_stop[0] + 1 if row0_stop.size else 10
    np.testing.assert_array_equal(out.tokens[0, :end], free[0, :end])


def test_same_seed_same_samples_other_seed_other_samples():
    config = tiny_config("mqa", "sinusoidal")
    run = functools.partial(decoding.generate, tiny_params(config), config, PROMPTS, LENGTHS,
                            max_new_tokens=12, temperature=1.5)
    a = run(rng=jax.random.PRNGKey(7)).tokens
    b = run(rng=jax.random.PRNGKey(7)).tokens
    c = run(rng=jax.random.PRNGKey(8)).tokens
    np.testing.assert_array_equal(a, b)
    assert (np.asarray(a) != np.asarray(c)).any()


def test_top_k_one_is_greedy_at_any_temperature():
    config = tiny_config("mha", "none")
    sampled = decoding.generate(tiny_params(config), config, PROMPTS, LENGTHS, max_new_tokens=NEW,
                                rng=jax.random.PRNGKey(5), temperature=3.0, top_k=1)
    np.testing.assert_array_equal(sampled.tokens, greedy(config).tokens)


@pytest.mark.parametrize("length, bucket", [(1, 8), (8, 8), (9, 16), (33, 64), (64, 64), (65, 128), (130, 192),
                                            (200, 200)])
def test_prompt_bucket(length, bucket):
    assert decoding.prompt_bucket(length, max_len=200) == bucket


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_new_tokens=30), "exceeds the model's context"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(prompt_lengths=np.array([8, 3])), "prompt_lengths"),
    (dict(prompt_lengths=np.array([0, 3])), "prompt_lengths"),
    (dict(prompt_lengths=np.array([7])), "prompt_lengths"),
    (dict(prompt_tokens=PROMPTS + 20), "vocab_size"),
    (dict(prompt_tokens=PROMPTS[0]), "prompt_tokens"),
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), r"top_k must be >= 0 \(0 = off\), got -1"),
    (dict(stop_token=17), r"stop_token must be a token id in \[0, vocab_size=17\), got 17"),
    (dict(pad_token=-1), r"pad_token must be a token id in \[0, vocab_size=17\), got -1"),
    (dict(prompt_tokens=np.zeros((0, 5), np.int32), prompt_lengths=np.zeros((0,), np.int32)),
     r"prompt_tokens must hold at least one row, got shape \(0, 5\)"),
])
def test_bad_arguments_raise_before_tracing(kwargs, message, traces):
    config = tiny_config()
    args = dict(prompt_tokens=PROMPTS, prompt_lengths=LENGTHS, max_new_tokens=4, rng=jax.random.PRNGKey(0))
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        decoding.generate(tiny_params(config), config, **args)
    assert traces["n"] == 0
    with pytest.raises(TypeError, match="kernels must be a jaxattn.Kernels"):
        decoding.generate(tiny_params(config), config, PROMPTS, LENGTHS, max_new_tokens=2, rng=jax.random.PRNGKey(0),
                          kernels="xla")


# --------------------------------------------------------------------------------------------
# Past the context: generate_windowed


def test_windowed_generation_is_generate_within_the_first_window():
    config = tiny_config("gqa", "rope")
    params, prompt = tiny_params(config), PROMPTS[0, :5]
    for temperature in (0.0, 1.2):  # the same draws for the same rng, greedy or not
        drawn = windowed.generate_windowed(params, config, prompt, max_new_tokens=11, num_samples=2,
                                           rng=jax.random.PRNGKey(4), temperature=temperature)
        direct = decoding.generate(params, config, np.tile(prompt, (2, 1)), np.array([5, 5]), max_new_tokens=11,
                                   rng=jax.random.PRNGKey(4), temperature=temperature)
        np.testing.assert_array_equal(drawn, direct.tokens)


def test_windowed_generation_goes_past_the_context_with_half_a_context_of_history():
    config = tiny_config("mha", "learned", max_seq_len=8)  # a learned table: positions cannot exceed 8
    params = tiny_params(config)
    ids = windowed.generate_windowed(params, config, [3, 1, 4], max_new_tokens=20, rng=jax.random.PRNGKey(0),
                                     temperature=0.0)
    assert ids.shape == (1, 20)
    history = [3, 1, 4] + list(ids[0])
    first = 8 - 3  # the first window fills the context
    for n in range(first, 20):  # every later token continues the last half context (4 tokens) before it
        window = history[3 + n - 4 - (n - first) % 4:3 + n]
        logits = forward(config, [window])[0, -1]
        assert int(jnp.argmax(logits)) == history[3 + n]


def test_windowed_generation_crops_a_prompt_longer_than_the_context():
    config = tiny_config("mqa", "none", max_seq_len=8)
    params = tiny_params(config)
    long_prompt = np.arange(12) % config.vocab_size
    kwargs = dict(max_new_tokens=3, rng=jax.random.PRNGKey(1), temperature=0.0)
    np.testing.assert_array_equal(windowed.generate_windowed(params, config, long_prompt, **kwargs),
                                  windowed.generate_windowed(params, config, long_prompt[-7:], **kwargs))
    with pytest.raises(ValueError, match="non-empty prompt"):
        windowed.generate_windowed(params, config, [], **kwargs)


def test_generate_under_jit_names_the_traced_argument():
    config = tiny_config()
    params = tiny_params(config)
    run = jax.jit(lambda lengths: decoding.generate(params, config, PROMPTS, lengths, max_new_tokens=2,
                                                    rng=jax.random.PRNGKey(0)).tokens)
    with pytest.raises(TypeError, match="prompt_lengths is a traced value: generate cannot run inside jax.jit"):
        run(LENGTHS)


def test_windows_yield_generate_windowed_window_by_window_and_check_first():
    config = tiny_config("mha", "learned", max_seq_len=8)
    params, kwargs = tiny_params(config), dict(rng=jax.random.PRNGKey(2), temperature=0.7, num_samples=2)
    chunks = list(windowed.windows(params, config, [3, 1, 4], max_new_tokens=13, **kwargs))
    assert [c.shape for c in chunks] == [(2, 5), (2, 4), (2, 4)]  # the first fills the context, then half
    np.testing.assert_array_equal(np.concatenate(chunks, axis=1),
                                  windowed.generate_windowed(params, config, [3, 1, 4], max_new_tokens=13, **kwargs))
    for bad in (dict(max_new_tokens=0), dict(max_new_tokens=3, num_samples=0)):  # as generate: before any window
        with pytest.raises(ValueError, match="must be a positive int"):
            windowed.windows(params, config, [3], **{**kwargs, **bad})
