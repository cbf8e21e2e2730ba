"""The switches of the speedrun recipe: the relu² MLP, zero-initialised output
projections, the whole-split validation loss, the target loss and the training seconds of a run."""

import json
import math
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.config import MLAConfig, ModelConfig
from jaxattn.layers.primitives import MLP
from jaxattn.model import DecoderLM
from train.config import ExperimentConfig, RuntimeConfig, TrainConfig, load_config
from train.data.batches import RunBatches, target_weights, whole_split_windows
from train.run import runtime as runtime_lib
from train.run.experiment import run_experiment
from train.run.metrics import RunResult, first_at_or_below
from train.run.steps import build_programs
from train.tiny_lm import final_line, target_part

TINY = dict(vocab_size=65, d_model=32, num_layers=2, num_heads=4, max_seq_len=16)
T = 16


def _flat(tree) -> dict:
    return {"/".join(str(getattr(k, "key", k)) for k in path): np.asarray(x)
            for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _init(config: ModelConfig, seed: int = 0):
    model = DecoderLM(config)
    return model, nn.unbox(jax.jit(model.init)(jax.random.PRNGKey(seed), jnp.zeros((1, T), jnp.int32))["params"])


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = logits - logits.max(-1, keepdims=True)
    return logits - np.log(np.exp(logits).sum(-1, keepdims=True))


# ------------------------------------------------------------------------- relu² MLP

def test_relu2_mlp_is_c_proj_of_relu_squared_of_c_fc():
    config = ModelConfig(**TINY, mlp="relu2", use_bias=True)
    mlp = MLP(config)
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 5, config.d_model))
    params = nn.unbox(mlp.init(jax.random.PRNGKey(2), x)["params"])
    rng = np.random.default_rng(3)  # biases away from their zero init, kernels large enough to matter
    params = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape) * 0.3, p.dtype), params)
    assert set(_flat(params)) == {"c_fc/kernel", "c_fc/bias", "c_proj/kernel", "c_proj/bias"}
    got = np.asarray(mlp.apply({"params": params}, x))
    p = {k: v.astype(np.float64) for k, v in _flat(params).items()}
    hidden = np.asarray(x, np.float64) @ p["c_fc/kernel"] + p["c_fc/bias"]
    assert (hidden < 0).mean() > 0.2  # relu cuts something
    expected = np.maximum(hidden, 0.0) ** 2 @ p["c_proj/kernel"] + p["c_proj/bias"]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------- zero_init_out

ZERO_INIT = {  # model -> (config changes, the kernels zero_init_out zeroes, the other matrices)
    "mha_gelu": (dict(positions="learned"),
                 {"attn/out/kernel", "mlp/c_proj/kernel"},
                 {"attn/qkv/kernel", "mlp/c_fc/kernel"}),
    "mla_swiglu": (dict(positions="rope", mlp="swiglu",
                        mla=MLAConfig(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                                      q_lora_rank=16)),
                   {"attn/wo/kernel", "mlp/down/kernel"},
                   {"attn/wq_a/kernel", "attn/wq_b/kernel", "attn/wkv_a/kernel", "attn/wkv_b", "mlp/gate_up/kernel"}),
}


def _blocks(names) -> set:
    return {f"blocks_{i}/{n}" for i in range(TINY["num_layers"]) for n in names}


def _matrices(flat: dict) -> set:
    return {name for name, value in flat.items() if value.ndim >= 2}


@pytest.mark.parametrize("kind", list(ZERO_INIT))
def test_zero_init_out_zeroes_what_writes_into_the_residual_stream(kind):
    changes, zeroed, others = ZERO_INIT[kind]
    config = ModelConfig(**TINY, **changes, zero_init_out=True, tie_embeddings=False)
    model, params = _init(config)
    flat = _flat(params)
    zero = _blocks(zeroed) | {"lm_head/kernel"}
    tables = {"wte/embedding"} | ({"wpe/embedding"} if config.positions == "learned" else set())
    assert _matrices(flat) == zero | _blocks(others) | tables
    for name in zero:
        assert np.all(flat[name] == 0), name
    for name in _matrices(flat) - zero:
        assert np.std(flat[name]) > 0.5 * config.init_std, name  # initialised as without the switch
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 65, (2, T)), jnp.int32)
    logits = np.asarray(jax.jit(model.apply)({"params": params}, tokens))
    assert logits.shape == (2, T, 65) and np.all(logits == 0)  # the first prediction is uniform


def test_zero_init_out_keeps_a_tied_embedding_and_is_a_switch():
    changes, zeroed, _ = ZERO_INIT["mha_gelu"]
    tied = ModelConfig(**TINY, **changes, zero_init_out=True, tie_embeddings=True)
    flat = _flat(_init(tied)[1])
    assert "lm_head/kernel" not in flat and np.std(flat["wte/embedding"]) > 0.5 * tied.init_std  # it is the head
    assert all(np.all(flat[name] == 0) for name in _blocks(zeroed))  # the blocks still start as the identity
    flat = _flat(_init(tied.replace(zero_init_out=False, tie_embeddings=False))[1])
    for name in _blocks(zeroed) | {"lm_head/kernel"}:  # without the switch: the residual and normal inits
        assert np.std(flat[name]) > 0, name


# ------------------------------------------------------------------------- whole-split windows

@pytest.mark.parametrize("num_tokens,block_size,rows", [
    (33, 16, 4),  # num_tokens - 1 = 32 divisible by T: two whole windows, no tail
    (17, 16, 1),  # exactly one window
    (18, 16, 2),  # one window and a tail of one target
    (40, 16, 3),
    (101, 10, 4),  # 100 targets in 10 whole windows, padded to 12
    (250, 16, 8),
    (23, 7, 5),
])
def test_whole_split_windows_count_every_target_once(num_tokens, block_size, rows):
    starts, counted_from = whole_split_windows(num_tokens, block_size, rows)
    weights = target_weights(counted_from, block_size)
    assert starts.dtype == np.int64 and weights.dtype == np.float32
    batches = starts.shape[0]
    assert starts.shape == (batches, rows) and weights.shape == (batches, rows, block_size)
    starts, weights = starts.reshape(-1), weights.reshape(-1, block_size)
    assert np.isin(weights, (0.0, 1.0)).all()
    assert np.all((starts >= 0) & (starts + block_size <= num_tokens - 1))  # each window + its target fits
    counts = np.zeros(num_tokens, int)
    for start, weight in zip(starts, weights):
        counts[start + 1 + np.flatnonzero(weight)] += 1  # window position t predicts token start + t + 1
    assert counts[0] == 0 and np.all(counts[1:] == 1)
    used = weights.sum(-1) > 0
    windows = math.ceil((num_tokens - 1) / block_size)
    assert used.sum() == windows and used[:windows].all()  # real windows first, then padding
    assert batches == math.ceil(windows / rows)  # no whole batch of padding


@pytest.mark.parametrize("num_tokens", [16, 3])
def test_whole_split_windows_need_a_window_and_its_target(num_tokens):
    with pytest.raises(ValueError, match=f"a split of {num_tokens} tokens has no window of block_size=16"):
        whole_split_windows(num_tokens, 16, 4)


def _programs(tc: TrainConfig, model: ModelConfig):
    config = ExperimentConfig(name="tiny", model=model, train=tc,
                              runtime=RuntimeConfig(mesh="data:1", attention="xla", matmul="xla"))
    runtime = runtime_lib.resolve(config.runtime, tc.batch_size, devices=1, model=model)
    return build_programs(config, runtime)


def test_whole_split_evaluation_equals_the_loss_of_every_val_token():
    # A wide init makes every token's loss different (at the default init all are about log 65).
    model = ModelConfig(**TINY, positions="learned", init_std=0.5)
    tc = TrainConfig(batch_size=4, block_size=T, eval_whole_val=True, eval_iters=2)
    programs = _programs(tc, model)
    params = programs.init(tc.seed)["params"]
    rng = np.random.default_rng(0)
    train_data = rng.integers(0, 65, 300).astype(np.int32)
    # 262 whole windows and a tail of 7 targets: two scanned batches of 256 windows (eval_rows), padded.
    val = rng.integers(0, 65, T * 262 + 8).astype(np.int32)
    got = RunBatches(train_data, val, tc, programs.layout.windows, programs.eval_rows).evaluate(
        lambda windows, weights: programs.evaluate(params, windows, weights, programs.frozen))

    # Directly: windows at 0, T, 2T, ... and one ending at the split's end for the targets left.
    n = len(val)
    starts = list(range(0, n - T, T))
    tail = n - 1 - (starts[-1] + T)
    assert tail == 7
    windows = np.stack([val[s:s + T + 1] for s in starts + [n - 1 - T]])
    assert len(windows) == 263
    logits = np.asarray(jax.jit(DecoderLM(model).apply)({"params": params}, windows[:, :-1]), np.float64)
    losses = -np.take_along_axis(_log_softmax(logits), windows[:, 1:, None], -1)[..., 0]  # [windows, T]
    counted = np.concatenate([losses[:-1].reshape(-1), losses[-1, T - tail:]])
    assert counted.size == n - 1 and counted.std() > 0.5
    np.testing.assert_allclose(float(got["val"]), counted.mean(), rtol=1e-5)
    assert abs(float(got["train"]) - counted.mean()) > 1e-3  # the train loss is not the val split's


# ------------------------------------------------------------------------- the target loss

def _eval(step, val, seconds):
    return {"step": step, "train_loss": val + 0.1, "val_loss": val, "train_seconds": seconds}


def test_first_at_or_below_finds_the_first_evaluation_that_reaches_the_target():
    records = [_eval(0, 4.2, 0.0), {"step": 5, "loss": 1.0, "lr": 1e-3},  # a training loss never counts
               _eval(10, 2.5, 1.5), _eval(20, 1.8857, 3.25), _eval(30, 1.7, 4.0), _eval(40, 1.9, 5.0)]
    assert first_at_or_below(records, 1.8857) == {"step": 20, "val_loss": 1.8857, "train_seconds": 3.25}  # at
    assert first_at_or_below(records, 2.0) == {"step": 20, "val_loss": 1.8857, "train_seconds": 3.25}
    assert first_at_or_below(records, 1.75) == {"step": 30, "val_loss": 1.7, "train_seconds": 4.0}
    assert first_at_or_below(records, 5.0)["step"] == 0
    assert first_at_or_below(records, 1.5) is None and first_at_or_below([], 1.0) is None


def _result(**changes) -> RunResult:
    figures = dict(final_val_loss=1.7930, final_train_loss=1.6, best_val_loss=1.7930, steps=2000,
                   median_tokens_per_s=16616.0, median_ms_per_iter=46.2, fastest_ms_per_iter=40.0, compile_s=3.0,
                   wall_s=120.0, train_seconds=92.4, peak_rss_gib=0.61, device_peak_gib=None, num_params=800_000,
                   sample="", out_dir="runs/x")
    return RunResult(**{**figures, **changes})


def test_the_final_line_says_when_the_target_was_reached():
    reached = _result(target_loss=1.8857, target_reached={"step": 750, "val_loss": 1.88, "train_seconds": 21.34})
    expected = " | val loss 1.8857 first reached at iter 750 after 21.3s of training (compile and evaluation excluded)"
    assert target_part(reached) == expected
    line = final_line(reached)
    assert line.startswith("final: val loss 1.7930 at iter 2000 | 16,616 tokens/s median") and line.endswith(expected)
    missed = _result(target_loss=1.5)
    assert target_part(missed) == " | val loss 1.5000 not reached in 2000 iters"
    assert final_line(missed).endswith(" | peak memory 0.61 GiB RSS | val loss 1.5000 not reached in 2000 iters")
    assert target_part(_result()) == "" and final_line(_result()).endswith("peak memory 0.61 GiB RSS")


# ------------------------------------------------------------------------- a whole run

RECIPE = ["model.d_model=32", "model.num_layers=2", "model.num_heads=2", "model.max_seq_len=16",
          "model.mlp='relu2'", "model.zero_init_out=true", "model.tie_embeddings=false",
          "train.batch_size=4", "train.block_size=16", "train.eval_iters=4", "train.eval_interval=10",
          "train.log_interval=5", "train.steps_per_dispatch=10", "train.warmup_iters=2", "train.lr=3e-3",
          "train.min_lr=3e-4", "train.lr_decay_iters=30", "train.optimizer='muon'", "train.schedule='wsd'",
          "train.muon_momentum_warmup=5", "train.eval_whole_val=true", "train.sample_tokens=0",
          "train.plot=false", "runtime.mesh='data:1'"]


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "text.txt"
    path.write_text("To be, or not to be, that is the question.\n" * 150)
    return path


def _vocab(text_file) -> int:
    return len(set(text_file.read_text()))


def _records(out) -> list[dict]:
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def _config(text_file, out, *extra):
    return load_config(overrides=RECIPE + [f"train.data_path='{text_file}'", f"train.out_dir='{out}'", *extra])


@pytest.fixture(scope="module")
def run(text_file, tmp_path_factory):
    """20 steps of the recipe, then resumed to 30: (out dir, first result, its records, resumed result)."""
    out = tmp_path_factory.mktemp("run")
    target = math.log(_vocab(text_file)) - 0.5  # the zero-initialised head starts at exactly log V
    first = run_experiment(_config(text_file, out, "train.max_iters=20", f"train.target_loss={target}"), quiet=True)
    records = _records(out)
    resumed = run_experiment(_config(text_file, out, "train.max_iters=30", f"train.target_loss={target}"), resume=True,
                             quiet=True)
    return out, first, records, resumed


def test_evaluations_carry_cumulative_training_seconds(run):
    _, first, records, _ = run
    evals = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in evals] == [0, 10, 20]
    seconds = [r["train_seconds"] for r in evals]
    assert seconds[0] == 0.0 and seconds[1] > 0, seconds
    assert all(a <= b for a, b in zip(seconds, seconds[1:])), seconds
    assert seconds[-1] == round(first.train_seconds, 3) and first.train_seconds < first.wall_s
    # The whole-split val loss of the zero-initialised, untied head at step 0: uniform over the vocabulary.
    assert evals[0]["val_loss"] == pytest.approx(math.log(first.config.model.vocab_size), abs=1e-5)


def test_the_result_names_the_first_evaluation_at_or_below_the_target(run):
    out, first, records, _ = run
    target = first.target_loss
    assert target == pytest.approx(math.log(first.config.model.vocab_size) - 0.5)
    hit = next(r for r in records if "val_loss" in r and r["val_loss"] <= target)
    assert hit["step"] > 0  # training got there
    assert first.target_reached == {"step": hit["step"], "val_loss": hit["val_loss"],
                                    "train_seconds": hit["train_seconds"]}
    saved = json.loads((Path(out) / "result.json").read_text())  # the resumed run's: the same first evaluation
    assert saved["target_loss"] == target and saved["target_reached"] == first.target_reached
    line = final_line(first)
    assert line.endswith(target_part(first)) and f"first reached at iter {hit['step']} after" in line


def test_a_resumed_run_keeps_counting_training_seconds(run):
    out, first, before, resumed = run
    evals = {r["step"]: r for r in _records(out) if "val_loss" in r}
    assert sorted(evals) == [0, 10, 20, 30]
    # Step 20 is evaluated again from the checkpoint, with the seconds it saved; then they go on.
    assert evals[20]["train_seconds"] == [r for r in before if r.get("step") == 20 and "val_loss" in r][0][
        "train_seconds"]
    assert evals[30]["train_seconds"] > evals[20]["train_seconds"]
    assert resumed.train_seconds > first.train_seconds
    assert resumed.train_seconds == pytest.approx(evals[30]["train_seconds"], abs=1e-3)


# ------------------------------------------------------------------------- value embeddings

# GQA: N = 4 query heads, K = 2 kv heads of H = 8, so a table row is K*H = 16 wide (not N*H = 32).
VALUES = dict(vocab_size=32, d_model=32, num_layers=4, num_heads=4, num_kv_heads=2, max_seq_len=16)
K, H = VALUES["num_kv_heads"], VALUES["d_model"] // VALUES["num_heads"]


def _tokens(shape=(2, T), seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, VALUES["vocab_size"], shape), jnp.int32)


def _lambdas(params, value) -> dict:
    """`params` with every layer's `value_lambdas` set to `value` ([2])."""
    return {name: ({**sub, "attn": {**sub["attn"], "value_lambdas": jnp.asarray(value, jnp.float32)}}
                   if "value_lambdas" in sub.get("attn", {}) else sub) for name, sub in params.items()}


@pytest.mark.parametrize("num_layers,E,tables", [
    (4, 0, [None] * 4), (4, 1, [0, None, None, 0]), (4, 2, [0, 1, 0, 1]),
    (6, 2, [0, 1, None, None, 0, 1]), (7, 3, [0, 1, 2, None, 0, 1, 2]), (2, 1, [0, 0]),
])
def test_value_embedding_tables_are_shared_by_the_first_and_last_layers(num_layers, E, tables):
    config = ModelConfig(**{**VALUES, "num_layers": num_layers}, value_embeddings=E)
    assert [config.value_embedding_table(i) for i in range(num_layers)] == tables
    with pytest.raises(ValueError, match="layer must be an integer"):
        config.value_embedding_table(num_layers)


@pytest.mark.parametrize("E,with_table", [(1, [0, 3]), (2, [0, 1, 2, 3])])
def test_value_embedding_params_are_tables_of_kv_width_and_lambdas_where_used(E, with_table):
    config = ModelConfig(**VALUES, value_embeddings=E)
    flat = _flat(_init(config)[1])
    tables = {name for name in flat if name.startswith("value_embed")}
    assert tables == {f"value_embed_{j}/embedding" for j in range(E)}
    for name in tables:  # [V, K*H], initialised like wte
        assert flat[name].shape == (32, K * H) and 0.5 * config.init_std < np.std(flat[name]) < 2 * config.init_std
    lambdas = {name for name in flat if name.endswith("value_lambdas")}
    assert lambdas == {f"blocks_{i}/attn/value_lambdas" for i in with_table}
    assert all(np.array_equal(flat[name], [0.5, 0.5]) for name in lambdas)
    off = _flat(_init(config.replace(value_embeddings=0))[1])  # the switch adds exactly these
    assert set(flat) - set(off) == tables | lambdas and set(off) <= set(flat)


def test_value_embeddings_with_lambdas_one_zero_are_the_model_without_them():
    config = ModelConfig(**VALUES, value_embeddings=2, positions="rope")
    model, params = _init(config)
    plain = {name: ({**sub, "attn": {k: v for k, v in sub["attn"].items() if k != "value_lambdas"}}
                    if name.startswith("blocks_") else sub)
             for name, sub in params.items() if not name.startswith("value_embed")}
    tokens = _tokens()
    expected = jax.jit(DecoderLM(config.replace(value_embeddings=0)).apply)({"params": plain}, tokens)
    apply = jax.jit(model.apply)
    np.testing.assert_allclose(apply({"params": _lambdas(params, [1.0, 0.0])}, tokens), expected, atol=1e-6)
    assert np.abs(apply({"params": params}, tokens) - expected).max() > 1e-3  # at their init they matter


def _steps(model, variables, tokens) -> dict:
    """Every attention layer's outputs of `project` and `mix_values` (Flax's captured intermediates)."""
    capture = lambda module, method: method in ("project", "mix_values")  # noqa: E731
    apply = jax.jit(lambda v, t: model.apply(v, t, capture_intermediates=capture, mutable=["intermediates"]))
    return apply(variables, tokens)[1]["intermediates"]


def test_value_embeddings_mix_each_layers_table_row_of_its_token_into_the_values():
    """Every layer's values after `mix_values` are 0.5 v + 0.5 table[token] of its own table (layers 0 and 4
    table 0, 1 and 5 table 1, 2 and 3 none); layer 0's v by hand from the embeddings, the others' from
    `project`. The tables are drawn far apart (std 1), so a wrong table, layer or token fails."""
    config = ModelConfig(**{**VALUES, "num_layers": 6}, value_embeddings=2)
    model, params = _init(config)
    params = {name: ({"embedding": jax.random.normal(jax.random.PRNGKey(9 + int(name[-1])), sub["embedding"].shape)}
                     if name.startswith("value_embed") else sub) for name, sub in params.items()}
    tokens = _tokens(seed=1)
    found = _steps(model, {"params": params}, tokens)
    rows = lambda j: np.asarray(params[f"value_embed_{j}"]["embedding"])[np.asarray(tokens)]  # noqa: E731
    tables = [rows(j).reshape(2, T, K, H) for j in range(2)]  # [B, T, K*H] -> [B, T, K, H]
    for i, j in enumerate([0, 1, None, None, 0, 1]):
        (_, (k, v)), = found[f"blocks_{i}"]["attn"]["project"]
        (mixed_k, mixed_v), = found[f"blocks_{i}"]["attn"]["mix_values"]
        np.testing.assert_array_equal(mixed_k, k)
        expected = np.asarray(v) if j is None else 0.5 * np.asarray(v) + 0.5 * tables[j]
        np.testing.assert_allclose(mixed_v, expected, atol=1e-6, err_msg=f"layer {i}")
    # Layer 0's v by hand: LayerNorm (scale 1 at init, no bias) of wte + wpe, then the V columns of qkv.
    x = np.asarray(params["wte"]["embedding"])[np.asarray(tokens)] + np.asarray(params["wpe"]["embedding"])[:T]
    x = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + config.norm_eps)
    v0 = (x @ np.asarray(params["blocks_0"]["attn"]["qkv"]["kernel"])[:, (4 + K) * H:]).reshape(2, T, K, H)
    np.testing.assert_allclose(found["blocks_0"]["attn"]["mix_values"][0][1], 0.5 * v0 + 0.5 * tables[0],
                               atol=1e-5)


@pytest.mark.parametrize("positions", ["rope", "learned"])
def test_cached_decoding_with_value_embeddings_equals_the_full_forward(positions):
    from jaxattn.cache.build import init_cache
    config = ModelConfig(**VALUES, value_embeddings=2, positions=positions)
    model, params = _init(config)
    params = _lambdas(params, [0.7, 1.3])  # away from the init: a cache of unmixed values would differ
    tokens = _tokens()
    expected = jax.jit(model.apply)({"params": params}, tokens)
    extend = jax.jit(lambda p, t, cache: model.apply({"params": p}, t, cache, method=DecoderLM.extend))
    prefill = 5
    logits, cache = extend(params, tokens[:, :prefill], init_cache(config, 2, T))
    np.testing.assert_allclose(logits, expected[:, :prefill], atol=2e-5, rtol=1e-5)
    for t in range(prefill, T):
        logits, cache = extend(params, tokens[:, t:t + 1], cache)
        np.testing.assert_allclose(logits[:, 0], expected[:, t], atol=2e-5, rtol=1e-5)
    from jaxattn.model import attention_weights
    weighed, weights = attention_weights(model, {"params": params}, tokens)
    np.testing.assert_allclose(weighed, expected, atol=1e-6)
    assert len(weights) == config.num_layers and weights[0].shape == (2, 4, T, T)


@pytest.mark.parametrize("changes", [dict(value_embeddings=3), dict(value_embeddings=-1),
                                     dict(value_embeddings=1.5), dict(value_embeddings=True),
                                     dict(value_embeddings=1, positions="rope", num_kv_heads=None,
                                          mla=MLAConfig(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                                                        v_head_dim=8))])
def test_value_embeddings_config_errors_name_the_field(changes):
    with pytest.raises(ValueError, match="ModelConfig.value_embeddings") as error:
        ModelConfig(**{**VALUES, **changes})
    assert ("MLA (mla is set" in str(error.value)) == ("mla" in changes)
    assert ModelConfig(**VALUES, value_embeddings=2).value_embeddings == 2  # 2E = L is allowed


def test_a_value_embedding_is_refused_with_a_context_a_wrong_shape_or_no_table():
    from jaxattn.layers.gqa import Attention
    config = ModelConfig(**VALUES, value_embeddings=1)
    x, ve = jnp.ones((2, 5, 32)), jnp.ones((2, 5, K, H))
    layer = Attention(config, layer=0)
    params = layer.init(jax.random.PRNGKey(0), x, value_embedding=ve)
    with pytest.raises(ValueError, match="value_embedding applies to self-attention"):
        layer.apply(params, x, jnp.ones((2, 3, 32)), value_embedding=ve)
    with pytest.raises(ValueError, match=r"value_embedding must be \[B, S, K, H\]"):
        layer.apply(params, x, value_embedding=jnp.ones((2, 5, 4, H)))  # N heads, not K
    with pytest.raises(ValueError, match="value_embedding: layer 1 has no value-embedding table"):
        Attention(config, layer=1).init(jax.random.PRNGKey(0), x, value_embedding=ve)


def test_value_embedding_tables_and_lambdas_go_to_adamw():
    from jaxattn.sharding import logical_names
    from train.run.optim import param_groups
    config = ModelConfig(**VALUES, value_embeddings=1)
    names, groups = logical_names(config), param_groups(logical_names(config))
    assert names["value_embed_0"]["embedding"] == (("vocab", "kv_heads"), (32, K * H))
    assert groups["value_embed_0"]["embedding"] == "adam" and groups["wte"]["embedding"] == "adam"
    assert groups["blocks_0"]["attn"]["value_lambdas"] == groups["blocks_3"]["attn"]["value_lambdas"] == "adam"
    assert groups["blocks_0"]["attn"]["qkv"]["kernel"] == "muon"  # the matrices are Muon's as before


def test_hf_export_refuses_value_embeddings(tmp_path):
    from jaxattn import hf
    from jaxattn.hf.export import export_family
    llama = ModelConfig(**VALUES, positions="rope", norm="rmsnorm", mlp="swiglu")
    assert export_family(llama).architecture == "LlamaForCausalLM"  # without them it exports
    config = llama.replace(value_embeddings=1)
    with pytest.raises(hf.UnsupportedCheckpoint, match="ModelConfig.value_embeddings=1 has no transformers"):
        hf.save_pretrained(tmp_path / "out", config, _init(config)[1])
    assert not (tmp_path / "out").exists()
