"""Training and sampling on a device mesh (data, fsdp, tensor) and across two processes.

The 8-device cases run in one fresh process (tests/mesh_script.py): the host device count
is fixed when JAX starts. The two-process case starts real `python -m train.tiny_lm`
processes that meet at a coordinator on 127.0.0.1.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxattn import axes, sharding
from jaxattn.config import ModelConfig
from jaxattn.layers.block import RESIDUAL_AXES
from jaxattn.axes import MeshShape

ROOT = Path(__file__).resolve().parent.parent
# Sharding reorders float32 sums (eps 1.2e-7); Adam's first steps divide each gradient by its own
# magnitude, which turns those last-bit differences of near-zero gradients into relative loss
# differences of up to ~4e-6 after 5 steps (seen across processes on a 16-core Intel CPU, JAX 0.11).
RTOL = 2e-5
ENV = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, "PYTHONPATH": str(ROOT)}


@pytest.fixture(scope="module")
def meshes():
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "mesh_script.py")], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mha", "gqa", "mla", "layer_kinds", "moe"])
def test_every_mesh_gives_the_one_device_losses(meshes, kind):
    one = meshes[kind]["data:1"]["losses"]
    assert len(one) == 5 and one[-1] < one[0]
    for mesh, run in meshes[kind].items():
        if mesh != "samples":  # equal up to the order of float sums
            np.testing.assert_allclose(run["losses"], one, rtol=RTOL, err_msg=f"{kind} on {mesh}")


@pytest.mark.slow
def test_moe_trains_with_its_router_losses_on_every_mesh_as_on_one_device(meshes):
    """The MoE kind's losses (cross entropy + aux_loss) are compared above; here the layer losses
    too, run by what "auto" resolves to on a CPU: "auto_cpu", grouped_cpu at these shapes."""
    from jaxattn.kernels.moe import cpu_rule
    assert cpu_rule(8 * 16, 8, 2)[0] == "grouped_cpu"  # B * T rows, 8 experts, k = 2
    one = meshes["moe"]["data:1"]["layer_losses"]
    assert sorted(one) == ["aux_loss", "load_balancing_loss", "router_z_loss"] and len(one["aux_loss"]) == 5
    assert all(1.9 < b < 2.5 for b in one["load_balancing_loss"])  # k = 2 at perfect balance
    for mesh, run in meshes["moe"].items():
        if mesh != "samples":
            assert run["moe_kernel"] == "auto_cpu", mesh
            for name, values in run["layer_losses"].items():
                np.testing.assert_allclose(values, one[name], rtol=RTOL, err_msg=f"{name} on {mesh}")


@pytest.mark.slow
def test_experts_are_split_over_fsdp_whole_and_their_hidden_units_over_tensor(meshes):
    moe = meshes["moe"]
    assert moe["fsdp:4"]["watched"]["experts_gate_up"] == {"spec": ["fsdp", None, None], "shard": [2, 32, 32]}
    for mesh in ("fsdp:2,tensor:2", "data:2,fsdp:2,tensor:2"):
        run = moe[mesh]["watched"]
        assert run["experts_gate_up"] == {"spec": ["fsdp", None, "tensor"], "shard": [4, 32, 16]}, mesh  # [E, D, 2F]
        assert run["experts_down"] == {"spec": ["fsdp", "tensor", None], "shard": [4, 8, 32]}, mesh  # [E, F, D]
        assert run["router_kernel"] == {"spec": ["fsdp", None], "shard": [16, 8]}, mesh  # embed took fsdp
        assert moe[mesh]["moments"] == [run["experts_gate_up"]] * 2, mesh
    assert moe["data:2,fsdp:2"]["watched"]["experts_down"] == {"spec": ["fsdp", None, None], "shard": [4, 16, 32]}


@pytest.mark.slow
def test_parameters_and_adam_moments_are_split_as_the_rules_say(meshes):
    mha = meshes["mha"]
    # Column-parallel QKV (heads over tensor), row-parallel MLP output, FSDP over the model width.
    assert mha["data:2,tensor:4"]["watched"]["qkv"] == {"spec": [None, "tensor"], "shard": [32, 24]}
    assert mha["data:2,tensor:4"]["watched"]["c_proj"] == {"spec": ["tensor", None], "shard": [16, 32]}
    assert mha["fsdp:4"]["watched"]["qkv"] == {"spec": ["fsdp", None], "shard": [8, 96]}
    assert mha["data:2,fsdp:2,tensor:2"]["watched"]["qkv"] == {"spec": ["fsdp", "tensor"], "shard": [16, 48]}
    assert mha["data:8"]["watched"]["qkv"] == {"spec": [None, None], "shard": [32, 96]}  # replicated
    # 65 characters do not split over tensor; the embedding width still splits over fsdp.
    assert mha["data:2,fsdp:2,tensor:2"]["watched"]["wte"] == {"spec": [None, "fsdp"], "shard": [65, 16]}
    assert any("vocab (65) is replicated over tensor" in note for note in mha["data:2,tensor:4"]["notes"])
    for mesh in ("fsdp:4", "data:2,fsdp:2,tensor:2"):  # Adam's mu and nu lie like their parameter
        run = mha[mesh]
        assert run["moments"] == [run["watched"]["qkv"]] * 2, mesh


@pytest.mark.slow
def test_gqa_kv_heads_split_only_where_the_tensor_axis_divides_them(meshes):
    gqa = meshes["gqa"]
    assert gqa["data:2,tensor:4"]["watched"]["key"] == {"spec": [None, None], "shard": [32, 16]}  # 2 kv heads
    assert gqa["data:2,tensor:4"]["watched"]["query"] == {"spec": [None, "tensor"], "shard": [32, 8]}
    assert any("kv_heads (2) is replicated over tensor (4)" in n for n in gqa["data:2,tensor:4"]["notes"])
    assert gqa["data:2,fsdp:2,tensor:2"]["watched"]["key"] == {"spec": ["fsdp", "tensor"], "shard": [16, 8]}


@pytest.mark.slow
def test_sinks_and_full_width_qk_norms_split_with_their_heads(meshes):
    run = meshes["layer_kinds"]["data:2,tensor:4"]["watched"]
    assert run["sinks"] == {"spec": ["tensor"], "shard": [1]}  # [N] = 4 heads over tensor 4
    assert run["q_norm"] == {"spec": ["tensor"], "shard": [8]}  # [N*H] = 32: each device its heads' dims
    assert run["k_norm"] == {"spec": [None], "shard": [16]}  # 2 kv heads do not split over 4: replicated


@pytest.mark.slow
def test_mla_latent_is_never_split_over_tensor(meshes):
    mla = meshes["mla"]
    assert mla["data:2,tensor:4"]["watched"]["wkv_a"]["spec"] == [None, None]
    assert mla["data:2,tensor:4"]["watched"]["wkv_b"] == {"spec": [None, "tensor", None], "shard": [16, 1, 16]}
    assert mla["data:2,fsdp:2,tensor:2"]["watched"]["wkv_b"] == {"spec": ["fsdp", "tensor", None],
                                                                 "shard": [8, 2, 16]}


@pytest.mark.slow
def test_fsdp_and_tensor_divide_the_memory_per_device(meshes):
    for kind in ("mha", "gqa", "mla", "moe"):
        one = meshes[kind]["data:1"]["bytes_per_device"]
        assert meshes[kind]["fsdp:4"]["bytes_per_device"] < 0.27 * one, kind  # 1/4, plus scalars
        assert meshes[kind]["data:2,fsdp:2,tensor:2"]["bytes_per_device"] < 0.36 * one, kind
    assert meshes["mha"]["data:8"]["bytes_per_device"] == meshes["mha"]["data:1"]["bytes_per_device"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mha", "gqa", "mla", "layer_kinds", "moe"])
def test_sampling_on_a_mesh_equals_one_device(meshes, kind):
    samples = meshes[kind]["samples"]
    one = samples.pop("data:1")
    assert samples, kind
    for mesh, got in samples.items():
        assert got["tokens"] == one["tokens"], (kind, mesh)
        np.testing.assert_allclose(got["logits"], one["logits"], rtol=1e-5, atol=1e-5, err_msg=mesh)


# ------------------------------------------------------------------------- rules without devices

def test_mesh_shapes_parse_and_say_what_is_wrong():
    assert MeshShape.parse("data:2,fsdp:2,tensor:2") == MeshShape(2, 2, 2)
    assert MeshShape.parse("tensor:4") == MeshShape(tensor=4) and str(MeshShape(tensor=4)) == "data:1,fsdp:1,tensor:4"
    for text, message in [("data:2,data:2", "names axis data twice"), ("pipe:2", "AXIS:SIZE"),
                          ("", "names no axis"), ("data:0", "positive integer size")]:
        with pytest.raises(ValueError, match=message):
            MeshShape.parse(text)
    with pytest.raises(ValueError, match=r"mesh data:4,fsdp:1,tensor:1 uses 4 device\(s\) but there are 2") as error:
        axes.make_mesh(MeshShape(data=4), devices=["a", "b"])
    assert "jax_num_cpu_devices" in str(error.value) and "--" not in str(error.value)  # a library setting, no flag


def test_a_mesh_that_does_not_divide_the_model_names_the_axis_and_size():
    config = ModelConfig(vocab_size=65, d_model=48, num_layers=1, num_heads=6, mlp_hidden=100)
    for shape, message in [(MeshShape(tensor=4), "tensor = 4 does not divide num_heads = 6"),
                           (MeshShape(tensor=3), "tensor = 3 does not divide the MLP hidden size = 100"),
                           (MeshShape(fsdp=5), "fsdp = 5 does not divide d_model = 48")]:
        with pytest.raises(ValueError, match=message):
            axes.check_mesh(config, shape)


def test_specs_replicate_what_a_mesh_axis_cannot_split():
    spec, notes = axes.spec_for(("embed", "kv_heads"), (64, 2 * 16), MeshShape(fsdp=2, tensor=4),
                                    counts={"kv_heads": 2})
    assert tuple(spec) == ("fsdp", None) and notes == ["kv_heads (2) is replicated over tensor (4), which does "
                                                       "not divide it"]
    assert tuple(sharding.batch_spec(MeshShape(data=2, fsdp=2), 8)) == (("data", "fsdp"), None)
    assert tuple(sharding.batch_spec(MeshShape(data=2, fsdp=2), 2)) == ("data", None)  # fsdp left whole
    with pytest.raises(ValueError, match="no sharding rule for the logical axis 'pipeline'"):
        axes.spec_for(("pipeline",), (4,), MeshShape())


def test_activations_and_parameters_are_laid_out_by_the_one_rules_table():
    """While tracing, Flax resolves every logical name as `spec_for` does on a mesh that divides it;
    the residual stream is split by rows and kept whole along its width, unlike the parameters' "embed"."""
    with axes.activation_rules(axes.make_mesh(MeshShape(), jax.devices()[:1])):
        assert nn.logical_to_mesh_axes(RESIDUAL_AXES) == P(("data", "fsdp"), None, None)
        assert nn.logical_to_mesh_axes((axes.ACTIVATION_VOCAB, axes.ACTIVATION_EMBED)) == P(None, None)
        for name in axes.RULES:
            expected, _ = axes.spec_for((name,), (8,), MeshShape(2, 2, 2))
            assert nn.logical_to_mesh_axes((name,)) == expected, name
    assert axes.spec_for((axes.EMBED,), (8,), MeshShape(fsdp=2))[0] == P("fsdp")
    rows = np.zeros((2, 3, 4), np.float32)
    assert nn.with_logical_constraint(rows, RESIDUAL_AXES) is rows  # outside the rules: a no-op


def test_every_parameter_names_its_axes_with_a_ruled_name():
    from train.config import load_config
    for name in ("shakespeare_char_baby", "shakespeare_char_baby_gqa", "shakespeare_char_baby_mla",
                 "shakespeare_char_baby_learned", "shakespeare_char_baby_moe"):
        names = sharding.logical_names(load_config(name).model.replace(vocab_size=65))
        leaves = jax.tree.leaves(names, is_leaf=lambda x: isinstance(x, tuple) and len(x) == 2)
        assert leaves and all(len(axis_names) == len(shape) for axis_names, shape in leaves), name
        assert {a for axis_names, _ in leaves for a in axis_names if a is not None} <= set(axes.RULES), name


# ------------------------------------------------------------------------- two processes

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


TINY = ["model.d_model=32", "model.num_layers=1", "model.num_heads=2", "model.max_seq_len=16",
        "train.batch_size=8", "train.block_size=16", "train.eval_iters=2", "train.eval_interval=5",
        "train.log_interval=1", "train.warmup_iters=2", "train.lr=3e-3", "train.lr_decay_iters=20",
        "train.plot=false", "runtime.attention=xla"]


def _cli(*args, out: Path, text: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "train.tiny_lm", "--quiet", "--data", str(text), "--out-dir", str(out), *args]
    return subprocess.Popen(command, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(process: subprocess.Popen, timeout: int = 300) -> str:
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    assert process.returncode == 0, err[-3000:]
    return out


def _losses(out: Path) -> list[float]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if "loss" in r]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_text("".join(chr(ord("a") + (i * 7) % 26) + ("\n" if i % 37 == 0 else "") for i in range(6000)))
    return path


@pytest.mark.slow
def test_two_processes_train_together_and_one_process_resumes_their_checkpoint(corpus, tmp_path):
    """2 processes x 2 host devices on a data:2,fsdp:2 mesh = the one-device losses; their checkpoint
    (parameters split over 4 devices in 2 processes) resumes in one process on one device."""
    reference = tmp_path / "one"
    _finish(_cli("--set", *TINY, "train.max_iters=6", "train.sample_tokens=0", "--mesh", "data:1",
                 out=reference, text=corpus))
    shared, port = tmp_path / "two", _free_port()
    flags = ["--set", *TINY, "train.max_iters=5", "train.sample_tokens=8", "--mesh", "data:2,fsdp:2",
             "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--join-timeout", "120"]
    processes = [_cli(*flags, "--process-id", str(i), out=shared, text=corpus) for i in (0, 1)]
    outputs = [_finish(p) for p in processes]
    assert "final: val loss" in outputs[0] and "final:" not in outputs[1]  # only process 0 prints
    np.testing.assert_allclose(_losses(shared), _losses(reference)[:5], rtol=RTOL)
    saved = json.loads((shared / "config.json").read_text())
    assert saved["runtime"]["mesh"] == "data:2,fsdp:2,tensor:1"
    assert (shared / "checkpoints" / "latest" / "5").is_dir() and (shared / "result.json").is_file()
    _finish(_cli("--set", *TINY, "train.max_iters=6", "train.sample_tokens=0", "--mesh", "data:1", "--resume",
                 out=shared, text=corpus))
    np.testing.assert_allclose(_losses(shared)[5], _losses(reference)[5], rtol=RTOL)


@pytest.mark.slow
def test_a_process_that_cannot_reach_the_coordinator_fails_within_its_timeout(corpus, tmp_path):
    port = _free_port()
    process = _cli("--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", "1",
                   "--join-timeout", "2", out=tmp_path, text=corpus)
    try:
        out, err = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    assert process.returncode == 1 and err.strip() == (
        f"error: process 1 could not reach the coordinator at 127.0.0.1:{port} within 2s "
        "(is process 0 running with the same --coordinator?)")
