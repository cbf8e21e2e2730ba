"""bench/quant_gpu.py in this process on JAX's default device (a CPU here): every cell prepared and
timed in turns, a cell that fails or cannot run reported beside the others, and the report."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from bench import quant, quant_gpu
from jaxattn import hf
from jaxattn.model import DecoderLM


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    config = quant.quick_config().replace(vocab_size=300, d_model=64, num_layers=1, mlp_hidden=64, max_seq_len=16)
    params = jax.jit(DecoderLM(config).init)(jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32))["params"]
    path = tmp_path_factory.mktemp("quant_gpu") / "tiny"
    hf.save_pretrained(path, config, nn.unbox(params), overwrite=True)
    return path


def spec(checkpoint, runner, weights, cache="float", batch=1):
    return {"checkpoint": str(checkpoint), "prompt_len": 4, "new_tokens": 3, "runner": runner, "weights": weights,
            "cache": cache, "batch": batch}


def test_every_cell_is_timed_and_one_that_fails_or_cannot_run_is_reported_beside_them(checkpoint, monkeypatch):
    def broken(spec):
        raise RuntimeError("out of device memory")
    monkeypatch.setitem(quant_gpu.DECODERS, "broken", broken)
    specs = [spec(checkpoint, "jax", "float32"), spec(checkpoint, "jax", "int8"), spec(checkpoint, "jax", "int8", "int8"),
             spec(checkpoint, "engine", "int4", batch=2), spec(checkpoint, "broken", "float32"),
             spec(checkpoint, "hf", "float32")]
    rows, read_gbs = quant_gpu.measure(specs, rounds=2, calls=1, stream_mb=1)
    assert read_gbs > 0
    by_name = {quant_gpu.cell_name(s): r for s, r in zip(specs, rows)}
    timed = [by_name[n] for n in ("jax float32 float b1", "jax int8 float b1", "jax int8 int8 b1", "engine int4 float b2")]
    for row in timed:
        assert row["available"] and len(row["times_s"]) == 2 and row["tokens_per_s"] > 0 and row["compile_s"] >= 0
    f32, int8 = by_name["jax float32 float b1"], by_name["jax int8 float b1"]
    assert f32["vs_float32"] == 1.0 and int8["vs_float32"] == pytest.approx(int8["tokens_per_s"] / f32["tokens_per_s"])
    assert int8["weight_bytes_per_token"] < f32["weight_bytes_per_token"] / 3
    assert int8["of_read"] == pytest.approx(int8["gb_per_s"] / read_gbs)
    assert "gb_per_s" not in by_name["engine int4 float b2"]  # a batch reads each weight once for all its rows
    assert by_name["broken float32 float b1"] == {"runner": "broken", "weights": "float32", "cache": "float", "batch": 1,
                                                  "available": False, "reason": "failed: RuntimeError: out of "
                                                  "device memory", "vs_float32": None}
    assert not by_name["hf float32 float b1"]["available"]  # torch sees no CUDA device here
    meta = {"device": "cpu (cpu)", "model": "m", "prompt_len": 4, "new_tokens": 3, "jax": jax.__version__,
            "backend": "cpu", "timed_calls": 2, "read_gb_per_s": read_gbs, "command": "python bench/quant_gpu.py"}
    text = quant_gpu.markdown({"meta": meta, "rows": rows})
    assert text.startswith("# Quantized decoding on cpu (cpu)")
    assert "| broken | float32 | float | 1 | unavailable: failed: RuntimeError: out of device memory |" in text
    assert "| jax | int8 | float | 1 | " in text and "quantized=" in text


def test_the_cells_follow_the_runners_and_weights_asked_for():
    args = quant_gpu.parse_args(["--runners", "jax,engine", "--weights", "bfloat16,int8", "--engine-batch", "8"])
    names = [quant_gpu.cell_name(s) for s in quant_gpu.cases(args, "ckpt")]
    assert names == ["jax bfloat16 float b1", "jax int8 float b1", "jax int8 int8 b1", "engine bfloat16 float b8",
                     "engine int8 float b8", "engine float32 int8 b8"]


@pytest.mark.parametrize("argv", [["--weights", "int3"], ["--runners", "llamacpp"], ["--rounds", "0"]])
def test_a_bad_flag_is_one_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as stop:
        quant_gpu.parse_args(argv)
    assert stop.value.code == 2 and "error:" in capsys.readouterr().err
