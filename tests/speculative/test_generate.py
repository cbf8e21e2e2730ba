"""speculative_generate: greedy output equals generate's, for both proposers and every attention kind; stops
inside a kept run; the cache after a rollback is the cache of a plain run; bad settings named."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn as ja
from jaxattn.config import MLAConfig, ModelConfig
from jaxattn.decoding import SamplingKnobs
from jaxattn.kernels import Kernels
from jaxattn.model import DecoderLM
from jaxattn.speculative import DraftProposer, NgramProposer, NgramSettings, speculative_generate, verify
from tiny_models import drawn_params

# Two rows of different lengths, right-padded, as tests/test_decoding.py's.
PROMPTS = np.array([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8], [6, 5, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0]], np.int32)
LENGTHS = np.array([12, 3], np.int32)
NEW = 24
KINDS = {
    "mha_learned": dict(),
    "gqa_rope": dict(num_kv_heads=2, positions="rope"),
    "mqa_sinusoidal": dict(num_kv_heads=1, positions="sinusoidal"),
    "mla_rope": dict(mla=MLAConfig(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8),
                     positions="rope"),
    "gqa_sliding_window": dict(num_kv_heads=2, positions="rope", sliding_window=4),
}


def tiny_config(kind="mha_learned") -> ModelConfig:
    return ModelConfig(vocab_size=17, d_model=32, num_layers=2, num_heads=4, max_seq_len=64, **KINDS[kind])


@functools.lru_cache(maxsize=None)
def params_of(config: ModelConfig, seed: int = 5):
    # std 0.2: logits far from uniform, so the rounding of a wider forward pass cannot flip an argmax.
    return drawn_params(config, seed=seed, std=0.2)


@functools.lru_cache(maxsize=None)
def greedy_reference(config: ModelConfig, kv_cache="auto", stop_token=None, new=NEW):
    out = ja.generate(params_of(config), config, PROMPTS, LENGTHS, max_new_tokens=new, rng=jax.random.PRNGKey(0),
                      temperature=0.0, kv_cache=kv_cache, stop_token=stop_token)
    return np.asarray(out.tokens), np.asarray(out.counts)


def speculative(config, proposer, kv_cache="auto", stop_token=None, new=NEW, **kwargs):
    return speculative_generate(params_of(config), config, PROMPTS, LENGTHS, max_new_tokens=new,
                                rng=jax.random.PRNGKey(0), proposer=proposer, temperature=0.0, kv_cache=kv_cache,
                                stop_token=stop_token, **kwargs)


# One small random draft model of the same vocabulary for every target (its programs compiled once): a
# draft of another kind and depth than its target, as a real draft is.
RANDOM_DRAFT = ModelConfig(vocab_size=17, d_model=32, num_layers=1, num_heads=4, max_seq_len=64)


def proposers(config):
    """The prompt lookup, a random draft model, and the target as its own draft."""
    return {"ngram": NgramProposer(NgramSettings(n_min=1, n_max=3, k=4)),
            "random_draft": DraftProposer(params_of(RANDOM_DRAFT, seed=1), RANDOM_DRAFT, k=4, kernels=Kernels()),
            "self_draft": DraftProposer(params_of(config), config, k=4, kernels=Kernels())}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_greedy_output_equals_generate_for_every_proposer(kind):
    config = tiny_config(kind)
    tokens, counts = greedy_reference(config)
    for name, proposer in proposers(config).items():
        out = speculative(config, proposer, kernels=Kernels())
        np.testing.assert_array_equal(out.tokens, tokens, err_msg=name)
        np.testing.assert_array_equal(out.counts, counts, err_msg=name)
        if name == "self_draft":  # the target's own greedy drafts are always right
            assert out.stats.acceptance_rate == 1.0 and out.stats.steps < NEW // 2
    assert out.stats.proposed > 0


def test_greedy_output_equals_generate_with_an_int8_cache():
    config = tiny_config("gqa_rope")
    tokens, _ = greedy_reference(config, kv_cache="int8")
    for name, proposer in proposers(config).items():
        out = speculative(config, proposer, kv_cache="int8", kernels=Kernels())
        np.testing.assert_array_equal(out.tokens, tokens, err_msg=name)


@pytest.mark.parametrize("stop_at", [2, 5, 9])
def test_a_stop_token_inside_a_kept_run_ends_the_row_as_generate_does(stop_at):
    config = tiny_config()
    free, _ = greedy_reference(config)
    stop = int(free[0, stop_at])  # a token the first row emits mid-run (its first occurrence may be earlier)
    tokens, counts = greedy_reference(config, stop_token=stop)
    out = speculative(config, proposers(config)["self_draft"], stop_token=stop, kernels=Kernels())
    np.testing.assert_array_equal(out.tokens, tokens)
    np.testing.assert_array_equal(out.counts, counts)
    assert counts[0] <= stop_at + 1 and out.stats.mean_accepted > 1


@pytest.mark.parametrize("new", [1, 2, 7])
def test_max_new_tokens_inside_a_kept_run_truncates_as_generate_does(new):
    config = tiny_config()
    tokens, counts = greedy_reference(config, new=new)
    out = speculative(config, proposers(config)["self_draft"], new=new, kernels=Kernels(), adaptive=False)
    np.testing.assert_array_equal(out.tokens, tokens)
    np.testing.assert_array_equal(out.counts, counts)


def test_sampled_generation_gives_valid_tokens_and_counts():
    config = tiny_config()
    out = speculative_generate(params_of(config), config, PROMPTS, LENGTHS, max_new_tokens=NEW,
                               rng=jax.random.PRNGKey(3), proposer=proposers(config)["self_draft"], temperature=0.8,
                               top_k=5, top_p=0.9, kernels=Kernels(), adaptive=False)
    assert out.tokens.shape == (2, NEW) and out.tokens.min() >= 0 and out.tokens.max() < config.vocab_size
    np.testing.assert_array_equal(out.counts, [NEW, NEW])
    assert 0 < out.stats.acceptance_rate <= 1


# ---------------------------------------------------------------- the rollback


def _knobs():
    return SamplingKnobs(temperature=jnp.float32(0), top_k=jnp.int32(0), top_p=jnp.float32(1),
                         stop_token=jnp.int32(-1), pad_token=jnp.int32(0))


@functools.lru_cache(maxsize=None)
def _extend_program(config):
    def extend(params, tokens, cache, num_new):
        return DecoderLM(config).apply({"params": params}, tokens, cache, num_new=num_new, method=DecoderLM.extend)
    return jax.jit(extend)


def _extend(config, cache, tokens, num_new=None):
    tokens = jnp.asarray(tokens, jnp.int32)
    num_new = jnp.full(tokens.shape[:1], tokens.shape[1], jnp.int32) if num_new is None else num_new
    return _extend_program(config)(params_of(config), tokens, cache, num_new)


def _verify(config, cache, tokens, num_proposed):
    return verify.verify_step(params_of(config), jax.tree.map(jnp.copy, cache), jnp.array([tokens]),
                              jnp.array([num_proposed]), jnp.array([True]), jax.random.PRNGKey(0), jnp.int32(0),
                              _knobs(), config=config, kernels=Kernels())


def _slots(cache, kept):
    """Every cache array's first `kept` slots of row 0 (dense layout: the slot axis is the one of the
    cache's length, 2 of `[B, K, L, H]`, 1 of `[B, L, R]`)."""
    out = []
    for leaf in jax.tree.leaves(cache.layers):
        axis = list(leaf.shape).index(cache.num_slots)
        out.append(np.take(np.asarray(leaf), np.arange(kept), axis=axis))
    return out


@pytest.mark.parametrize("kind, kv_cache", [("mha_learned", "auto"), ("mla_rope", "auto"), ("gqa_rope", "int8")])
def test_the_cache_after_a_rollback_is_the_cache_of_a_plain_run(kind, kv_cache):
    """Drafts [g1, g2, wrong, x]: two kept, the cache rolled back to the pending token and g1, g2. Bit for bit
    it is the cache of the same pass given only g1, g2 as drafts (nothing of the rejected ones is left where
    it is read), and a next step reads the same from both though the rejected drafts' slots still hold
    them; against one-token steps it agrees to float rounding (a wider matmul rounds differently)."""
    config = tiny_config(kind)
    first, cache = verify.prefill(params_of(config), jnp.asarray(PROMPTS[:1, :8]), jnp.array([8]),
                                  jax.random.PRNGKey(0), _knobs(), config=config, kernels=Kernels(), cache_len=32,
                                  kv_cache=kv_cache)
    stepped, greedy = cache, [int(first[0])]
    for _ in range(3):  # the plain run: one token at a time
        logits, stepped = _extend(config, stepped, [[greedy[-1]]])
        greedy.append(int(jnp.argmax(logits[0, 0])))
    wrong = (greedy[3] + 1) % config.vocab_size
    accepted, next_token, rolled = _verify(config, cache, [greedy[0], greedy[1], greedy[2], wrong, 7], 4)
    assert int(accepted[0]) == 2 and int(next_token[0]) == greedy[3] and int(rolled.lengths[0]) == 8 + 3
    accepted, next_token, plain = _verify(config, cache, [greedy[0], greedy[1], greedy[2], 0, 0], 2)
    assert int(accepted[0]) == 2 and int(next_token[0]) == greedy[3] and int(plain.lengths[0]) == 8 + 3
    for a, b in zip(_slots(rolled, 11), _slots(plain, 11)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(_slots(rolled, 11), _slots(stepped, 11)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=1e-5)
    assert not all(np.array_equal(a, b) for a, b in zip(_slots(rolled, 13), _slots(plain, 13)))  # stale slots differ
    after_rolled, _ = _extend(config, rolled, [[greedy[3], 2]])
    after_plain, _ = _extend(config, plain, [[greedy[3], 2]])
    np.testing.assert_array_equal(after_rolled, after_plain)


# ---------------------------------------------------------------- errors


def test_bad_settings_are_named_before_anything_runs():
    config = tiny_config()
    run = functools.partial(speculative_generate, params_of(config), config, PROMPTS, LENGTHS, max_new_tokens=4,
                            rng=jax.random.PRNGKey(0), temperature=0.0)
    ngram = NgramProposer()
    with pytest.raises(TypeError, match="proposer must be"):
        run(proposer="ngram")
    with pytest.raises(ValueError, match="vocabulary"):
        other = ModelConfig(vocab_size=19, d_model=32, num_layers=1, num_heads=4, max_seq_len=64)
        run(proposer=DraftProposer(params_of(other), other, k=2, kernels=Kernels()))
    with pytest.raises(ValueError, match="kv_cache"):
        run(proposer=ngram, kv_cache="fp4")
    with pytest.raises(ValueError, match="max_new_tokens"):
        run(proposer=ngram, max_new_tokens=0)
    with pytest.raises(ValueError, match="max_seq_len"):
        run(proposer=ngram, max_new_tokens=60)
    with pytest.raises(ValueError, match="stop_token"):
        run(proposer=ngram, stop_token=17)
    with pytest.raises(ValueError, match="probe_after"):
        run(proposer=ngram, probe_after=-1)
    with pytest.raises(ValueError, match="k must be"):
        DraftProposer(params_of(config), config, k=0)
    with pytest.raises(ValueError, match="max_seq_len=8"):
        short = ModelConfig(vocab_size=17, d_model=32, num_layers=1, num_heads=4, max_seq_len=8)
        run(proposer=DraftProposer(params_of(short), short, k=2, kernels=Kernels()))
