"""Run by tests/train/run/test_optim.py in a fresh process with 4 host devices (the count is fixed when JAX
starts): trains a tiny model with Muon and the WSD schedule for 5 steps on one device and on 2x2
meshes, and prints the losses and where Muon's momentum lies as one JSON object.

XLA's CPU backend compiles without LLVM optimisations here (half the time): what is compared is
the SPMD partitioner's program against one device's, which that does not change."""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_backend_optimization_level=0"

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 4)

import numpy as np  # noqa: E402

from jaxattn import sharding  # noqa: E402
from jaxattn.axes import MeshShape  # noqa: E402
from jaxattn.config import MLAConfig, ModelConfig  # noqa: E402
from train.config import ExperimentConfig, RuntimeConfig, TrainConfig  # noqa: E402
from train.data.batches import RunBatches  # noqa: E402
from train.run import runtime as runtime_lib  # noqa: E402
from train.run.optim import ADAM, MUON  # noqa: E402
from train.run.steps import build_programs  # noqa: E402

STEPS = 5
MESHES = {"mha": ("data:1", "fsdp:2,tensor:2", "data:2,fsdp:2"),
          "mla": ("data:1", "fsdp:2,tensor:2")}
OWN_INIT = "fsdp:2,tensor:2"  # runs its own init program; the other meshes start from data:1's state
MODELS = {"mha": dict(),
          # wkv_b [latent, heads, head_dim]: one Muon matrix split over fsdp and tensor at once.
          "mla": dict(mla=MLAConfig(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                                    q_lora_rank=16), positions="rope")}
# A Muon matrix and an AdamW table of each model whose layouts the test compares.
WATCHED = {"mha": {MUON: ("blocks_0", "attn", "qkv", "kernel"), ADAM: ("wte", "embedding")},
           "mla": {MUON: ("blocks_0", "attn", "wkv_b"), ADAM: ("wte", "embedding")}}


def experiment(kind: str, mesh: str) -> ExperimentConfig:
    model = ModelConfig(vocab_size=65, d_model=32, num_layers=1, num_heads=4, max_seq_len=16, mlp_hidden=64,
                        **MODELS[kind])
    # WSD with its decay inside the 5 steps (from step 3), Muon's momentum still warming up.
    train = TrainConfig(batch_size=8, block_size=16, warmup_iters=2, lr=3e-3, min_lr=3e-4, lr_decay_iters=6,
                        schedule="wsd", decay_fraction=0.5, optimizer="muon", muon_lr=0.02,
                        muon_momentum_warmup=4, eval_iters=1)
    return ExperimentConfig(name=kind, model=model, train=train,
                            runtime=RuntimeConfig(mesh=mesh, attention="xla", matmul="xla"))


def key_name(k) -> str:
    return str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))


def spec_list(spec) -> list:
    return [list(a) if isinstance(a, tuple) else a for a in spec]


def leaf(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def moments(tree, group: str, path: tuple) -> list:
    """The leaves of the optimizer state (arrays or specs) that mirror the parameter at `path` in
    the optimizer of `group` (MUON: its momentum; ADAM: mu and nu): optax.partition keys its
    states by the group names."""
    is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)  # noqa: E731
    return [x for p, x in jax.tree_util.tree_leaves_with_path(tree, is_leaf=is_spec)
            if group in [key_name(k) for k in p] and tuple(key_name(k) for k in p[-len(path):]) == path]


def train_on(kind: str, mesh: str, corpus, initial=None) -> dict:
    config = experiment(kind, mesh)
    runtime = runtime_lib.resolve(config.runtime, config.train.batch_size, devices=MeshShape.parse(mesh).size,
                                  model=config.model)
    programs = build_programs(config, runtime)
    state = programs.init(config.train.seed) if initial is None else sharding.place(initial, programs.layout.state)
    host = jax.tree.map(np.asarray, state)
    windows = RunBatches(corpus, corpus, config.train, programs.layout.windows, programs.eval_rows).train_chunk(0, STEPS)
    state, (losses, lrs, _) = programs.train_steps(state, windows, programs.frozen)
    layout = programs.layout
    watched = {}
    for group, path in WATCHED[kind].items():
        param_spec = leaf(layout.params.specs, path)
        watched[group] = {
            "param": spec_list(param_spec),
            "param_array": spec_list(leaf(state["params"], path).sharding.spec),
            # StateLayout's specs (sharding.mirror_specs) and the arrays the steps gave back
            "state": [spec_list(s.spec) for s in moments(layout.state["opt_state"], group, path)],
            "state_arrays": [spec_list(x.sharding.spec) for x in moments(state["opt_state"], group, path)],
            "shard": list(leaf(state["params"], path).addressable_shards[0].data.shape),
            "state_shards": [list(x.addressable_shards[0].data.shape)
                             for x in moments(state["opt_state"], group, path)],
        }
    return {"losses": np.asarray(losses).tolist(), "lrs": np.asarray(lrs).tolist(), "watched": watched,
            "initial": host}


def main() -> None:
    corpus = (np.arange(4000) * 7 % 65).astype(np.int32)
    results = {}
    for kind, meshes in MESHES.items():
        runs = {"data:1": train_on(kind, "data:1", corpus)}
        initial = runs["data:1"]["initial"]
        runs.update({mesh: train_on(kind, mesh, corpus, None if mesh == OWN_INIT else initial)
                     for mesh in meshes[1:]})
        results[kind] = {mesh: {k: v for k, v in run.items() if k != "initial"} for mesh, run in runs.items()}
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
