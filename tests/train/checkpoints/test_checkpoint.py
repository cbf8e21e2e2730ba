import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxattn.model import DecoderLM
from train.checkpoints.meta import check_compatible, upgrade_format_1
from train.checkpoints.store import Checkpointer, CheckpointError
from train.config import load_config
from train.data.tokenizer import CharTokenizer
from train.models.runs import load_for_sampling
from train.run import crash_points

ROOT = Path(__file__).resolve().parents[3]
TINY = ["model.vocab_size=5", "model.d_model=8", "model.num_layers=1", "model.num_heads=2", "model.max_seq_len=8",
        "train.block_size=8"]  # vocabulary: CharTokenizer("abcde")


def _config(*overrides):
    return load_config(overrides=[*TINY, *overrides])


def _state(seed=0):
    """A real train state of the tiny model (the loader checks the arrays against the model)."""
    params = nn.unbox(DecoderLM(_config().model).init(jax.random.PRNGKey(seed), jnp.zeros((1, 2), jnp.int32))["params"])
    opt = optax.adamw(1e-3)
    opt_state = opt.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    _, opt_state = opt.update(grads, opt_state, params)  # non-trivial moments
    return {"params": params, "opt_state": opt_state, "step": jnp.int32(7),
            "rng": jax.random.PRNGKey(seed)}


def _assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_round_trip_latest_and_best(tmp_path):
    cfg, tok, state = _config(), CharTokenizer("abcde"), _state()
    ckpt = Checkpointer(tmp_path)
    ckpt.save("latest", 7, state, config=cfg, tokenizer=tok, val_loss=1.5, best_val_loss=1.5)
    ckpt.save("best", 7, state, config=cfg, tokenizer=tok, val_loss=1.5, best_val_loss=1.5)
    ckpt.save("latest", 9, _state(1), config=cfg, tokenizer=tok, val_loss=1.7, best_val_loss=1.5)
    restored, meta = ckpt.restore("latest", jax.eval_shape(lambda: state))
    _assert_trees_equal(restored, _state(1))
    assert type(restored["opt_state"]) is type(state["opt_state"])
    assert meta["step"] == 9 and meta["best_val_loss"] == 1.5
    assert sorted(os.listdir(tmp_path / "checkpoints" / "latest")) == ["7", "9"]  # the two newest kept
    ckpt.close()

    params, model_config, tokenizer = load_for_sampling(tmp_path)  # prefers best
    _assert_trees_equal(params, state["params"])
    assert model_config == cfg.model and tokenizer == tok


def test_arrays_that_do_not_fit_the_saved_model_are_refused(tmp_path):
    ckpt = Checkpointer(tmp_path)
    ckpt.save("best", 1, _state(), config=_config("model.d_model=16"), tokenizer=CharTokenizer("abcde"),
              val_loss=1.0, best_val_loss=1.0)
    ckpt.close()
    with pytest.raises(CheckpointError, match=r"incompatible with its model config: .*wrong shapes"):
        load_for_sampling(tmp_path)


def test_missing_and_incompatible(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_for_sampling(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no checkpoint found"):
        load_for_sampling(tmp_path / "empty")
    cfg, state = _config(), _state()
    ckpt = Checkpointer(tmp_path / "run")
    ckpt.save("latest", 1, state, config=cfg, tokenizer=CharTokenizer("abcde"), val_loss=None,
              best_val_loss=None)
    wrong = {**state, "params": {"embed": {"embedding": jnp.zeros((9, 4))}}}
    with pytest.raises(CheckpointError, match="does not match"):
        ckpt.restore("latest", jax.eval_shape(lambda: wrong))
    _, meta = ckpt.restore("latest", jax.eval_shape(lambda: state))
    with pytest.raises(CheckpointError, match="d_model"):
        check_compatible(meta, _config("model.d_model=64"))
    assert check_compatible(meta, _config("train.max_iters=10")) == []
    assert "train.seed" in check_compatible(meta, _config("train.seed=1"))[0]
    assert check_compatible(meta, _config("runtime.decode=xla")) == []  # no effect on training
    assert check_compatible(meta, _config("runtime.matmul=bfloat16")) == [
        "runtime.matmul was 'auto', now 'bfloat16'"]


# The meta.json config of a format-1 checkpoint (an MLA run with the speed options), as written before
# the model config and the runtime were separate.
FORMAT_1_CONFIG = {
    "name": "shakespeare_char_baby_mla",
    "model": {"vocab_size": 65, "d_model": 128, "num_layers": 4, "num_heads": 4, "num_kv_heads": None,
              "head_dim": None, "attention": "mla", "kv_lora_rank": 32, "q_lora_rank": None,
              "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32, "mla_path": "naive",
              "positions": "rope", "rope_theta": 10000.0, "rope_interleaved": False, "rope_scaling": None,
              "norm": "layernorm", "norm_eps": 1e-05, "mlp": "gelu", "mlp_hidden": None, "use_bias": False,
              "fused_qkv": True, "dropout": 0.0, "max_seq_len": 64, "tie_embeddings": True, "dtype": "float32",
              "param_dtype": "float32", "matmul_dtype": "bfloat16", "attention_impl": "custom_vjp",
              "init_std": 0.02},
    "train": {**load_config().to_dict()["train"], "data_parallel": 2, "xla_flags": ""},
}


def test_a_format_1_checkpoint_config_is_upgraded():
    meta = upgrade_format_1({"format": 1, "step": 5, "config": FORMAT_1_CONFIG, "tokenizer": {"kind": "byte"}})
    assert meta["format"] == 2 and meta["step"] == 5
    from train.config import ExperimentConfig
    config = ExperimentConfig.from_dict(meta["config"])
    assert config.model == load_config("shakespeare_char_baby_mla").model
    assert (config.runtime.attention, config.runtime.matmul, config.runtime.mla, str(config.runtime.mesh)) == (
        "custom_vjp", "bfloat16_cpu", "naive", "data:2,fsdp:1,tensor:1")


KILLED_SAVE = textwrap.dedent("""
    import sys
    sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r})
    from test_checkpoint import _config, _state
    from train.checkpoints.store import Checkpointer
    from train.data.tokenizer import CharTokenizer
    ckpt = Checkpointer({out!r})
    kw = dict(config=_config(), tokenizer=CharTokenizer("abcde"), val_loss=1.0, best_val_loss=1.0)
    ckpt.save("latest", 1, _state(0), **kw)
    ckpt.save("latest", 2, _state(1), **kw)  # killed: every file of step 2 written, the commit not done
""")


@pytest.mark.slow
def test_killed_save_never_leaves_a_half_valid_checkpoint(tmp_path):
    out = tmp_path / "run"
    script = KILLED_SAVE.format(root=str(ROOT), tests=str(Path(__file__).parent), out=str(out))
    killed = subprocess.run([sys.executable, "-c", script], env={**os.environ, crash_points.ENV: "save:2"},
                            timeout=300)
    assert killed.returncode == -signal.SIGKILL
    leftovers = os.listdir(out / "checkpoints" / "latest")
    assert any(name.startswith("2.") and "tmp" in name for name in leftovers)  # the killed write was under way
    ckpt = Checkpointer(out)  # a new run cleans the temporary directory up
    assert ckpt.latest_step() == 1
    restored, meta = ckpt.restore("latest", jax.eval_shape(lambda: _state(0)))
    _assert_trees_equal(restored, _state(0))
    assert os.listdir(out / "checkpoints" / "latest") == ["1"]
    params, _, _ = load_for_sampling(out / "checkpoints" / "latest")
    _assert_trees_equal(params, _state(0)["params"])


# --------------------------------------------------------------------------------------------
# Integrity: a damaged step is refused with one line naming it, and resume falls back a step.


def _data_file(step_dir: Path) -> Path:
    """The largest array-data file of a saved step."""
    return max((p for p in (step_dir / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def _flip_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(b ^ 0xFF for b in data[middle:middle + 64])
    path.write_bytes(bytes(data))


def _saved(tmp_path, steps=(1,)):
    ckpt = Checkpointer(tmp_path)
    for i, step in enumerate(steps):
        ckpt.save("latest", step, _state(i), config=_config(), tokenizer=CharTokenizer("abcde"), val_loss=1.0,
                  best_val_loss=1.0)
    ckpt.close()
    return tmp_path / "checkpoints" / "latest"


@pytest.mark.parametrize("damage", ["flipped bytes", "truncated data", "no meta.json"])
def test_a_damaged_checkpoint_is_refused_with_one_line_naming_it(tmp_path, damage):
    latest = _saved(tmp_path)
    if damage == "flipped bytes":
        _flip_bytes(_data_file(latest / "1"))
    elif damage == "truncated data":
        data = _data_file(latest / "1")
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    else:
        import shutil
        shutil.rmtree(latest / "1" / "meta")
    with pytest.raises(CheckpointError) as error:
        load_for_sampling(tmp_path)
    message = str(error.value)
    assert str(latest / "1") in message and "\n" not in message and len(message) < 600


def test_resume_falls_back_to_the_previous_valid_step_with_a_warning(tmp_path):
    latest = _saved(tmp_path, steps=(1, 2))
    _flip_bytes(_data_file(latest / "2"))
    warnings = []
    ckpt = Checkpointer(tmp_path)
    restored, meta = ckpt.restore("latest", jax.eval_shape(lambda: _state(0)), on_skip=warnings.append)
    ckpt.close()
    assert meta["step"] == 1 and len(warnings) == 1
    assert f"checkpoint {latest / '2'}" in warnings[0] and "using step 1 instead" in warnings[0]
    _assert_trees_equal(restored, _state(0))
    ckpt = Checkpointer(tmp_path)
    with pytest.raises(CheckpointError, match=f"{latest / '2'}"):  # without a fallback: refused
        ckpt.restore("latest", jax.eval_shape(lambda: _state(0)))
    ckpt.close()


def test_an_array_that_changed_on_disk_fails_its_checksum(tmp_path, monkeypatch):
    """The checksum, not only the storage layer, catches a change: here the restored numbers are altered."""
    import orbax.checkpoint as ocp
    _saved(tmp_path)
    restore = ocp.CheckpointManager.restore

    def altered(self, step, args=None):
        out = restore(self, step, args=args)
        if "state" in out:
            state = dict(out["state"])
            state["step"] = state["step"] + 1
            out = {**out, "state": state}
        return out
    monkeypatch.setattr(ocp.CheckpointManager, "restore", altered)
    ckpt = Checkpointer(tmp_path)
    with pytest.raises(CheckpointError, match=r"array step does not match its saved sha256"):
        ckpt.restore("latest", jax.eval_shape(lambda: _state(0)))
    ckpt.close()
