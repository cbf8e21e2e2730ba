"""Run by tests/test_mesh.py in a fresh process with 8 host devices (the count is fixed when JAX
starts): trains tiny MHA, GQA, MLA and mixture-of-experts models for 5 steps on one device and
on four meshes, samples on two meshes, and prints what the test compares as one JSON object.
The MoE model runs the experts as "auto" resolves on a CPU ("auto_cpu": "grouped_cpu" for
8 experts, k = 2), its experts split over fsdp (expert parallelism)."""

import json
import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402

from jaxattn import sharding  # noqa: E402
from jaxattn.axes import MeshShape  # noqa: E402
from jaxattn.config import LayerKind, MLAConfig, ModelConfig  # noqa: E402
from jaxattn.config.moe import MoEConfig  # noqa: E402
from jaxattn.decoding import generate  # noqa: E402
from train.config import ExperimentConfig, RuntimeConfig, TrainConfig  # noqa: E402
from train.data.batches import RunBatches  # noqa: E402
from train.run import runtime as runtime_lib  # noqa: E402
from train.run.steps import build_programs  # noqa: E402

STEPS = 5
# Pure data parallelism replicates every parameter, whatever the attention: MHA alone covers it.
MESHES = {"mha": ("data:1", "data:8", "data:2,tensor:4", "fsdp:4", "data:2,fsdp:2,tensor:2"),
          "gqa": ("data:1", "data:2,tensor:4", "fsdp:4", "data:2,fsdp:2,tensor:2"),
          "mla": ("data:1", "data:2,tensor:4", "fsdp:4", "data:2,fsdp:2,tensor:2"),
          "layer_kinds": ("data:1", "data:2,tensor:4", "data:2,fsdp:2,tensor:2"),
          "moe": ("data:1", "data:2,fsdp:2", "fsdp:4", "fsdp:2,tensor:2", "data:2,fsdp:2,tensor:2")}
SAMPLED = {"mha": ("data:2,fsdp:2,tensor:2",), "gqa": ("data:2,tensor:4", "data:2,fsdp:2,tensor:2"),
           "mla": ("data:2,fsdp:2,tensor:2",), "layer_kinds": ("data:2,fsdp:2,tensor:2",),
           "moe": ("data:2,fsdp:2,tensor:2",)}
MODELS = {
    "mha": dict(),
    "gqa": dict(num_kv_heads=2, fused_qkv=False),  # 2 kv heads: replicated on a tensor axis of 4
    "mla": dict(mla=MLAConfig(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                              q_lora_rank=16), positions="rope"),
    # The newer models' parameters on a mesh: sinks [N] and the full-width q/k norms split over tensor with the
    # heads, sandwich norms, a local and a global layer.
    "layer_kinds": dict(num_layers=2, num_kv_heads=2, positions="rope", norm="rmsnorm", sliding_window=4,
                        layer_pattern=(LayerKind(local=True, rope_theta=100.0), LayerKind()), attn_sinks=True,
                        attn_logits_soft_cap=5.0, final_logits_soft_cap=10.0, qk_norm="full",
                        norm_placement="sandwich", norm_unit_offset=True, embed_multiplier=2.0),
    # Layer 0 dense, layer 1 routes to 2 of 8 experts; the training loss adds the router losses.
    "moe": dict(num_layers=2, dense_layers=(0,), moe=MoEConfig(num_experts=8, experts_per_token=2, expert_hidden=16,
                                                               aux_loss_coef=0.01, z_loss_coef=0.001)),
}
# Arrays whose layout the test checks: model -> name -> path in the params.
WATCHED = {"mha": {"qkv": ("blocks_0", "attn", "qkv", "kernel"), "c_proj": ("blocks_0", "mlp", "c_proj", "kernel"),
                   "wte": ("wte", "embedding")},
           "gqa": {"key": ("blocks_0", "attn", "key", "kernel"), "query": ("blocks_0", "attn", "query", "kernel")},
           "mla": {"wkv_a": ("blocks_0", "attn", "wkv_a", "kernel"), "wkv_b": ("blocks_0", "attn", "wkv_b")},
           "layer_kinds": {"sinks": ("blocks_0", "attn", "sinks"), "q_norm": ("blocks_0", "attn", "q_norm", "scale"),
                           "k_norm": ("blocks_0", "attn", "k_norm", "scale")},
           "moe": {"experts_gate_up": ("blocks_1", "mlp", "experts_gate_up"),
                   "experts_down": ("blocks_1", "mlp", "experts_down"),
                   "router_kernel": ("blocks_1", "mlp", "router_kernel")}}


def experiment(kind: str, mesh: str) -> ExperimentConfig:
    model = ModelConfig(vocab_size=65, d_model=32, num_heads=4, max_seq_len=16, mlp_hidden=64,
                        **{"positions": "learned", "num_layers": 1, **MODELS[kind]})
    train = TrainConfig(batch_size=8, block_size=16, warmup_iters=2, lr=3e-3, lr_decay_iters=20, eval_iters=1)
    return ExperimentConfig(name=kind, model=model, train=train,
                            runtime=RuntimeConfig(mesh=mesh, attention="xla", matmul="xla"))


def leaf(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def layout_of(array) -> dict:
    return {"spec": [list(a) if isinstance(a, tuple) else a for a in array.sharding.spec],
            "shard": list(array.addressable_shards[0].data.shape)}


def adam_moments_of(opt_state, path) -> list:
    """The optimizer-state arrays that mirror the parameter at `path` (Adam's mu and nu)."""
    return [x for p, x in jax.tree_util.tree_leaves_with_path(opt_state)
            if tuple(str(getattr(k, "key", "")) for k in p[-len(path):]) == path]


def train_on(kind: str, mesh: str, corpus, initial=None) -> dict:
    """5 steps on `mesh` from `initial` (host arrays, laid out by the mesh's rules), else from the
    mesh's own init program."""
    config = experiment(kind, mesh)
    devices = MeshShape.parse(mesh).size
    runtime = runtime_lib.resolve(config.runtime, config.train.batch_size, devices=devices, model=config.model)
    programs = build_programs(config, runtime)
    state = programs.init(config.train.seed) if initial is None else sharding.place(initial, programs.layout.state)
    host = jax.tree.map(np.asarray, state)
    held = sharding.per_device_bytes((state["params"], state["opt_state"]))
    windows = RunBatches(corpus, corpus, config.train, programs.layout.windows, programs.eval_rows).train_chunk(0, STEPS)
    state, (losses, _, layer_losses) = programs.train_steps(state, windows, programs.frozen)  # the losses the layers sowed
    watched = {name: layout_of(leaf(state["params"], path)) for name, path in WATCHED[kind].items()}
    first = next(iter(WATCHED[kind].values()))
    return {"losses": np.asarray(losses).tolist(), "watched": watched, "bytes_per_device": held,
            "layer_losses": {name: np.asarray(v).tolist() for name, v in layer_losses.items()},
            "moe_kernel": runtime.kernels.moe,
            "moments": [layout_of(x) for x in adam_moments_of(state["opt_state"], first)],
            "notes": list(programs.layout.params.notes), "params": state["params"], "mesh": programs.layout.mesh,
            "initial": host}


def sample_on(config, params, mesh) -> dict:
    prompt = np.array([[1, 2, 3, 4], [5, 6, 7, 0], [8, 9, 0, 0], [10, 0, 0, 0]], np.int32)
    out = generate(params, config.model, prompt, np.array([4, 3, 2, 1]), max_new_tokens=6,
                   rng=jax.random.PRNGKey(0), temperature=1.0, mesh=mesh, return_logits=True)
    return {"tokens": np.asarray(out.tokens).tolist(), "logits": np.asarray(out.logits).tolist()}


def main() -> None:
    corpus = (np.arange(4000) * 7 % 65).astype(np.int32)
    results = {}
    for kind in MODELS:
        runs = {"data:1": train_on(kind, "data:1", corpus)}
        initial = runs["data:1"]["initial"]  # the 2x2x2 mesh runs its own init program; the others start here
        runs.update({mesh: train_on(kind, mesh, corpus, None if mesh == "data:2,fsdp:2,tensor:2" else initial)
                     for mesh in MESHES[kind][1:]})
        params = runs["data:1"]["params"]  # the same parameters sampled on one device and on meshes
        samples = {"data:1": sample_on(experiment(kind, "data:1"), params, None)}
        samples.update({mesh: sample_on(experiment(kind, mesh), params, runs[mesh]["mesh"]) for mesh in SAMPLED[kind]})
        results[kind] = {mesh: {k: v for k, v in run.items() if k not in ("params", "mesh", "initial")}
                         for mesh, run in runs.items()}
        results[kind]["samples"] = samples
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
