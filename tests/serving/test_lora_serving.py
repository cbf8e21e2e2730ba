"""LoRA adapters in the serving engine (`jaxattn.serving.loras`): many adapters on one base, per request.

Four adapters (ranks 4, 2, 3, 4, each on its own targets and scale) in an engine of three slots of
rank 4, for MHA, GQA and MLA (MLA's q, o and MLP: its `wkv_b` has no slots): rows of three adapters and
rows of none share steps, and each request draws the greedy tokens of its adapter merged into the base
(`jaxattn.lora.merge_lora`) under `jaxattn.generate` alone; the fourth adapter waits on the host and is
swapped in at admission; every prompt and output token's log-probability is the merged model's (logits
within 1e-5). The slots run the platform's form (`jaxattn.kernels.select.lora_form`). One engine a kind runs one step at a time and overlapped (MHA, MLA), the other
several decode steps a call (GQA). The prefix cache never shares pages across adapters, nor with an
adapter removed and added again under the same name; adapters in use are not removed; loading,
removing and moving rows between adapters compile nothing.
"""

import dataclasses
import functools

import jax
import numpy as np
import pytest

import jaxattn as ja
from jaxattn.lora import LoraConfig, add_lora, merge_lora
from jaxattn.serving import Engine, EngineConfig, LoraExists, LoraInUse, RequestError, SamplingParams, UnknownLora
from tests.serving.compiles import counting_compiles
from tiny_models import drawn_params, tiny_config, with_random_b

VOCAB, CONTEXT, MAX_NEW = 32, 48, 6
ALL = ("q", "k", "v", "o", "gate", "up", "down")
MLA = ja.MLAConfig(kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4)
MODELS = {  # name: (config changes, the slots' targets, kernels, decode steps a call)
    "mha": (dict(), ALL, ja.Kernels(), None),
    "gqa": (dict(num_kv_heads=2), ALL, ja.Kernels(), 3),
    "mla": (dict(mla=MLA), ("q", "o", "gate", "up", "down"), ja.Kernels(mla="absorb"), None),
}
ADAPTERS = {"a": (4, 8.0, ALL), "b": (2, 4.0, ("q", "v", "up")), "c": (3, 3.0, ("k", "o", "down")),
            "d": (4, 4.0, ("q", "o", "gate", "down"))}  # name: (rank, alpha, targets)
ENGINE = EngineConfig(max_seqs=4, page_size=4, chunk=8, prefill_rows=2, num_pages=48, max_loras=3, max_lora_rank=4)
LOGPROB_ATOL = 2e-5  # logits within 1e-5 (float32, other summation orders), twice that after the log-sum-exp
ROW_LORAS = ("a", "b", "c", None, "d", "a", None, "d", "b", "c")


@functools.lru_cache(maxsize=None)
def model(name):
    changes, targets, kernels, _ = MODELS[name]
    config = tiny_config("mha", positions="rope", vocab_size=VOCAB, max_seq_len=CONTEXT, mlp="swiglu",
                         norm="rmsnorm", **changes)
    return config, drawn_params(config, seed=3, std=0.4), targets, kernels


@functools.lru_cache(maxsize=None)
def adapter(name, which, generation=0):
    """Adapter `which` on model `name` (its targets those the model's slots cover); another generation
    is another adapter of the same shapes."""
    config, base, targets, _ = model(name)
    rank, alpha, wanted = ADAPTERS[which]
    lora = LoraConfig(rank=rank, alpha=alpha, targets=tuple(t for t in wanted if t in targets))
    seed = 10 * generation + "abcd".index(which)
    return with_random_b(add_lora(base, config, lora, jax.random.PRNGKey(seed)), seed=seed, std=0.4)


@functools.lru_cache(maxsize=None)
def expected(name, which, prompt, generation=0):
    """`generate`'s greedy tokens for the prompt alone, on the base with adapter `which` merged (None: none)."""
    config, base, _, kernels = model(name)
    params = base if which is None else merge_lora(adapter(name, which, generation))
    out = ja.generate(params, config, np.array([prompt]), np.array([len(prompt)]), max_new_tokens=MAX_NEW,
                      rng=jax.random.PRNGKey(0), temperature=0.0, kernels=kernels)
    return out.tokens[0].tolist()


@functools.lru_cache(maxsize=None)
def engine_for(name):
    config, base, targets, kernels = model(name)
    engine = Engine(base, config, dataclasses.replace(ENGINE, lora_targets=targets, decode_steps=MODELS[name][3]),
                    kernels=kernels)
    for which in "abcd":  # three into the slots, the fourth on the host
        engine.add_lora(which, adapter(name, which))
    return engine


def prompts(seed, count=len(ROW_LORAS)):
    """Prompts of 5, 9 or 13 tokens (few lengths: the reference compiles once per length)."""
    rng = np.random.default_rng(seed)
    return [tuple(rng.integers(0, VOCAB, rng.choice((5, 9, 13))).tolist()) for _ in range(count)]


def greedy(lora=None, max_tokens=MAX_NEW):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, lora=lora)


@pytest.mark.parametrize("name", list(MODELS))
def test_each_request_draws_the_greedy_tokens_of_its_adapter_merged(name):
    engine = engine_for(name)
    asked = prompts(1)
    assert sorted(engine.lora_names) == list("abcd") and len(set(engine.loras.holder) - {None}) == 3
    requests = [engine.add_request(p, greedy(lora)) for p, lora in zip(asked, ROW_LORAS)]
    swaps = engine.loras.swaps
    engine.step()
    assert [r.sampling.lora for r in engine.running] == ["a", "b", "c", None]  # they share every step now
    slots = [r.lora_slot for r in engine.running]
    assert sorted(slots[:3]) == [0, 1, 2] and slots[3] == -1
    engine.run()
    for request, prompt, lora in zip(requests, asked, ROW_LORAS):
        assert request.output_ids == expected(name, lora, prompt), (prompt, lora)
    assert engine.loras.swaps > swaps  # "d" was written over a slot at admission
    if MODELS[name][3]:
        assert engine.stats["multi_step_calls"] > 0
    engine.allocator.check_all_free()
    # The adapters are visible: they draw other tokens than the base and one another.
    assert len({tuple(expected(name, lora, asked[0])) for lora in (None, *"abcd")}) >= 3


@pytest.mark.parametrize("name", list(MODELS))
def test_each_row_s_log_probabilities_are_its_adapter_s_merged_model_s(name):
    # Rows of three adapters and a row of none in the same steps: every prompt and output token's
    # log-probability (the raw log-softmax) is the merged model's over the whole sequence: logits within
    # 1e-5 in float32, so log-probabilities (a logit less the log-sum-exp) within twice that.
    engine, (config, base, _, kernels) = engine_for(name), model(name)
    loras = ("a", "b", "c", None)
    asked = prompts(2, count=len(loras))
    knobs = dict(temperature=0.0, max_tokens=3, logprobs=0, prompt_logprobs=0)
    requests = [engine.add_request(p, SamplingParams(lora=lora, **knobs)) for p, lora in zip(asked, loras)]
    engine.step()
    assert [r.sampling.lora for r in engine.running] == list(loras)  # one step holds all four
    engine.run()
    for request, prompt, lora in zip(requests, asked, loras):
        params = base if lora is None else merge_lora(adapter(name, lora))
        tokens = [*prompt, *request.output_ids]
        logits = ja.DecoderLM(config, kernels).apply({"params": params}, np.array([tokens]))[0]  # [T, V]
        logp = np.asarray(jax.nn.log_softmax(logits.astype(np.float32)))
        np.testing.assert_allclose(request.prompt_logprobs[1:], [logp[t - 1, tokens[t]] for t in range(1, len(prompt))],
                                   rtol=0, atol=LOGPROB_ATOL)
        np.testing.assert_allclose(request.output_logprobs, [logp[len(prompt) - 1 + i, token] for i, token in
                                                             enumerate(request.output_ids)], rtol=0, atol=LOGPROB_ATOL)
    engine.allocator.check_all_free()


def run_one(engine, prompt, lora):
    """(prompt tokens found in the prefix cache, output ids) of one request run alone."""
    request = engine.add_request(prompt, greedy(lora))
    engine.run()
    return request.num_cached_tokens, request.output_ids


def test_the_prefix_cache_never_shares_pages_across_adapters_nor_generations():
    engine, name = engine_for("mha"), "mha"
    prompt = tuple(range(1, 14))  # three full pages before its last token
    assert run_one(engine, prompt, None) == (0, expected(name, None, prompt))
    for lora in ("a", "b", "d"):  # "d" swaps in
        assert run_one(engine, prompt, lora) == (0, expected(name, lora, prompt)), lora
    for lora in (None, "a", "b", "d"):  # each finds its own pages
        assert run_one(engine, prompt, lora) == (12, expected(name, lora, prompt)), lora
    engine.remove_lora("a")
    engine.add_lora("a", adapter(name, "a", generation=1))  # another adapter under the same name
    assert run_one(engine, prompt, "a") == (0, expected(name, "a", prompt, generation=1))
    engine.remove_lora("a")
    engine.add_lora("a", adapter(name, "a"))  # the first again: a new generation, nothing shared either
    assert run_one(engine, prompt, "a") == (0, expected(name, "a", prompt))
    engine.allocator.check_all_free()


def test_an_adapter_in_use_is_not_removed_and_what_is_refused_names_it():
    engine = engine_for("mha")
    request = engine.add_request(prompts(2, 1)[0], greedy("b"))
    with pytest.raises(LoraInUse, match="lora 'b' is in use by 1 running or waiting request"):
        engine.remove_lora("b")  # waiting
    engine.step()
    with pytest.raises(LoraInUse):
        engine.remove_lora("b")  # running
    engine.run()
    assert request.finished
    engine.remove_lora("b")
    assert "b" not in engine.lora_names and "b" not in engine.loras.holder
    with pytest.raises(UnknownLora, match=r"lora 'b' is not loaded \(loaded: '[acd]', '[acd]', '[acd]'\)") as refused:
        engine.add_request([1, 2, 3], greedy("b"))
    assert isinstance(refused.value, RequestError) and refused.value.param == "lora"
    with pytest.raises(UnknownLora):
        engine.remove_lora("b")
    engine.add_lora("b", adapter("mha", "b"))
    with pytest.raises(LoraExists, match="lora 'b' is already loaded"):
        engine.add_lora("b", adapter("mha", "b"))
    config, base, _, _ = model("mha")
    wide = add_lora(base, config, LoraConfig(rank=8, targets=("q",)), jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="the adapter's rank 8 is more than the slots' max rank 4"):
        engine.add_lora("wide", wide)
    with pytest.raises(ValueError, match="adapter_params hold no LoraWeight"):
        engine.add_lora("plain", base)
    with pytest.raises(ValueError, match="name must be a non-empty str"):
        engine.add_lora("", adapter("mha", "b"))
    assert sorted(engine.lora_names) == list("abcd")
    with pytest.raises(RequestError, match="lora must be an adapter's name"):
        SamplingParams(lora=3)
    for bad in (dict(max_loras=-1), dict(max_lora_rank=0), dict(lora_targets=("experts",)), dict(lora_targets="q"),
                dict(lora_form="ragged")):
        with pytest.raises(ValueError, match="EngineConfig"):
            EngineConfig(**bad)
    with pytest.raises(ValueError, match="max_loras needs one device"):  # refused before anything is built
        Engine(base, config, ENGINE, mesh=jax.make_mesh((1,), ("tensor",)))


def test_loading_removing_and_moving_rows_between_adapters_compile_nothing():
    engine, name = engine_for("gqa"), "gqa"
    asked = prompts(3)
    for which in "cd":  # the slot writes' and clears' own small programs, once (one of them is in a slot)
        engine.remove_lora(which)
        engine.add_lora(which, adapter(name, which))
    for prompt, lora in zip(asked, ROW_LORAS):
        expected(name, lora, prompt)  # the reference's compiles happen before we count
    with counting_compiles() as compiles:
        engine.remove_lora("d")
        engine.add_lora("d", adapter(name, "d"))
        requests = [engine.add_request(p, greedy(lora)) for p, lora in zip(asked, reversed(ROW_LORAS))]
        engine.run()
    assert compiles == []
    for request, prompt, lora in zip(requests, asked, reversed(ROW_LORAS)):
        assert request.output_ids == expected(name, lora, prompt)
