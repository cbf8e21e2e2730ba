import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from train.checkpoint import CheckpointError, Checkpointer, check_compatible, load_for_sampling
from train.config import load_config
from train.tokenizer import CharTokenizer

ROOT = Path(__file__).resolve().parent.parent


def _state(seed=0):
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    params = {"embed": {"embedding": jax.random.normal(k1, (5, 4))},
              "block": {"kernel": jax.random.normal(k2, (4, 4)), "scale": jnp.ones(4)}}
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
    cfg, tok, state = load_config(), CharTokenizer("abcde"), _state()
    ckpt = Checkpointer(tmp_path)
    ckpt.save("latest", 7, state, config=cfg, tokenizer=tok, val_loss=1.5, best_val_loss=1.5)
    ckpt.save("best", 7, state, config=cfg, tokenizer=tok, val_loss=1.5, best_val_loss=1.5)
    ckpt.save("latest", 9, _state(1), config=cfg, tokenizer=tok, val_loss=1.7, best_val_loss=1.5)
    restored, meta = ckpt.restore("latest", jax.eval_shape(lambda: state))
    _assert_trees_equal(restored, _state(1))
    assert type(restored["opt_state"]) is type(state["opt_state"])
    assert meta["step"] == 9 and meta["best_val_loss"] == 1.5
    assert sorted(os.listdir(tmp_path / "checkpoints" / "latest")) == ["9"]  # only the newest kept
    ckpt.close()

    params, model_config, tokenizer = load_for_sampling(tmp_path)  # prefers best
    _assert_trees_equal(params, state["params"])
    assert model_config == cfg.model and tokenizer == tok


def test_missing_and_incompatible(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_for_sampling(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no checkpoint found"):
        load_for_sampling(tmp_path / "empty")
    cfg, state = load_config(), _state()
    ckpt = Checkpointer(tmp_path / "run")
    ckpt.save("latest", 1, state, config=cfg, tokenizer=CharTokenizer("abcde"), val_loss=None,
              best_val_loss=None)
    wrong = {**state, "params": {"embed": {"embedding": jnp.zeros((9, 4))}}}
    with pytest.raises(CheckpointError, match="does not match"):
        ckpt.restore("latest", jax.eval_shape(lambda: wrong))
    _, meta = ckpt.restore("latest", jax.eval_shape(lambda: state))
    with pytest.raises(CheckpointError, match="d_model"):
        check_compatible(meta, load_config(overrides=["model.d_model=64"]))
    assert check_compatible(meta, load_config(overrides=["train.max_iters=10"])) == []
    assert "train.seed" in check_compatible(meta, load_config(overrides=["train.seed=1"]))[0]


KILLED_SAVE = textwrap.dedent("""
    import asyncio, sys, time, pathlib
    sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r})
    from orbax.checkpoint._src.path import atomicity
    from test_checkpoint import _state
    from train.checkpoint import Checkpointer
    from train.config import load_config
    from train.tokenizer import CharTokenizer
    ckpt = Checkpointer({out!r})
    kw = dict(config=load_config(), tokenizer=CharTokenizer("abc"), val_loss=1.0, best_val_loss=1.0)
    ckpt.save("latest", 1, _state(0), **kw)

    async def hang(self, *args, **kwargs):  # every file of step 2 is written; the commit never comes
        pathlib.Path({marker!r}).write_text("writing")
        time.sleep(600)
    atomicity.AtomicRenameTemporaryPath.finalize = hang
    ckpt.save("latest", 2, _state(1), **kw)
""")


def test_killed_save_never_leaves_a_half_valid_checkpoint(tmp_path):
    out, marker = tmp_path / "run", tmp_path / "marker"
    script = KILLED_SAVE.format(root=str(ROOT), tests=str(ROOT / "tests"), out=str(out), marker=str(marker))
    proc = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.time() + 120
        while not marker.exists():
            assert proc.poll() is None, "the saving process exited before the commit"
            assert time.time() < deadline
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    leftovers = os.listdir(out / "checkpoints" / "latest")
    assert any("tmp" in name for name in leftovers)  # the killed write was really under way
    ckpt = Checkpointer(out)  # a new run cleans the temporary directory up
    assert ckpt.latest_step() == 1
    restored, meta = ckpt.restore("latest", jax.eval_shape(lambda: _state(0)))
    _assert_trees_equal(restored, _state(0))
    assert os.listdir(out / "checkpoints" / "latest") == ["1"]
    params, _, _ = load_for_sampling(out / "checkpoints" / "latest")
    _assert_trees_equal(params, _state(0)["params"])
