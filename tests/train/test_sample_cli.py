"""`python -m train.sample`: output, timing report, windows beyond the context, and its error messages."""

import io
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from programs import CHARS, TINY_TOML, run_sample, tiny_sampling_config

from jaxattn import decoding
from jaxattn.config import ModelConfig
from jaxattn.kernels import quant_matmul
from jaxattn.model import DecoderLM
from train.checkpoints.store import Checkpointer
from train.config import ExperimentConfig, TrainConfig
from train.data.tokenizer import CharTokenizer


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    return tiny_sampling_config(tmp_path, monkeypatch)


run = run_sample


def test_random_init_prints_samples_and_reports_compile_time_and_speed(tiny, capsys):
    code, out, err = run(capsys, "--random-init", tiny, "--prompt", "ROMEO:", "--max-new-tokens", "9",
                         "--num-samples", "2", "--seed", "3")
    assert code == 0, err
    texts = out.rstrip("\n").split("\n---------------\n")
    assert len(texts) == 2
    for text in texts:
        assert text.startswith("ROMEO:") and len(text) == len("ROMEO:") + 9
    assert "compile:" in err and "tokens/s" in err and "2 x 9" in err


def test_generation_continues_past_the_context_in_windows(tiny, capsys):
    # max_seq_len 16: the prompt plus 40 tokens need several windows.
    code, out, err = run(capsys, "--random-init", tiny, "--prompt", "KING:", "--max-new-tokens", "40")
    assert code == 0, err
    assert out.startswith("KING:") and len(out) == len("KING:") + 40 + 1  # print's newline


def test_prompt_from_stdin(tiny, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("JULIET:\n"))
    code, out, err = run(capsys, "--random-init", tiny, "--max-new-tokens", "3")
    assert code == 0, err
    assert out.startswith("JULIET:\n")


def test_a_prompt_longer_than_the_context_is_cropped_with_a_note(tiny, capsys):
    code, out, err = run(capsys, "--random-init", tiny, "--prompt", "AB" * 12, "--max-new-tokens", "5",
                         "--temperature", "0")
    assert code == 0, err
    assert "note: the prompt is 24 tokens and the model's context 16: it sees the last 15" in err
    assert out.startswith("AB" * 12) and len(out) == 24 + 5 + 1
    _, cropped, _ = run(capsys, "--random-init", tiny, "--prompt", ("AB" * 12)[-15:], "--max-new-tokens", "5",
                        "--temperature", "0")
    assert out[24:] == cropped[15:]  # the same continuation as the last 15 characters alone


def test_the_kernels_are_reported(tiny, capsys):
    from jaxattn import resolve_kernels
    code, _, err = run(capsys, "--random-init", tiny, "--prompt", "A", "--max-new-tokens", "2")
    assert code == 0 and f"kernels: decode {resolve_kernels()[0].decode!r}" in err


@pytest.mark.parametrize("argv, message", [
    (["--prompt", "héllo"], "cannot be encoded"),
    (["--prompt", ""], "prompt is empty"),
    (["--prompt", "A", "--temperature", "-1"], "--temperature"),
    (["--prompt", "A", "--top-p", "0"], "--top-p"),
    (["--prompt", "A", "--temperature", "nan"], "--temperature"),
    (["--prompt", "A", "--top-k", "-1"], "--top-k must be >= 0"),
    (["--prompt", "A", "--seed", str(2 ** 64)], "--seed must be in [0, 2**63)"),
    (["--prompt", "A", "--kv-cache", "int4"], "--kv-cache: invalid choice: 'int4'"),
])
def test_bad_prompts_and_knobs_give_clear_errors(tiny, capsys, argv, message):
    code, out, err = run(capsys, "--random-init", tiny, *argv)
    assert code == 2 and out == ""
    assert message in err and err.startswith("error: ") and err.endswith("(see python -m train.sample --help)\n")
    assert len(err.splitlines()) == 1


def test_an_int8_kv_cache_samples_as_many_tokens(tiny, capsys):
    code, out, err = run(capsys, "--random-init", tiny, "--prompt", "ROMEO:", "--max-new-tokens", "9",
                         "--temperature", "0", "--kv-cache", "int8")
    assert code == 0, err
    assert out.startswith("ROMEO:") and len(out) == len("ROMEO:") + 9 + 1


def test_unknown_config_name(capsys):
    code, _, err = run(capsys, "--random-init", "no_such_config", "--prompt", "A")
    assert code == 2 and "not found" in err


def test_missing_checkpoint(tmp_path, capsys):
    code, _, err = run(capsys, "--checkpoint", str(tmp_path / "nowhere"), "--prompt", "A")
    assert code == 1 and "does not exist" in err and len(err.splitlines()) == 1


def test_directory_without_a_checkpoint(tmp_path, capsys):
    code, _, err = run(capsys, "--checkpoint", str(tmp_path), "--prompt", "A")
    assert code == 1 and "no checkpoint found" in err


def _save(run_dir, config: ModelConfig, params):
    checkpointer = Checkpointer(run_dir)
    experiment = ExperimentConfig(name="tiny", model=config, train=TrainConfig(block_size=config.max_seq_len))
    checkpointer.save("best", 1, {"params": params, "step": jnp.int32(1)}, config=experiment,
                      tokenizer=CharTokenizer(CHARS), val_loss=2.0, best_val_loss=2.0)
    checkpointer.close()


def _init(config):
    return jax.jit(DecoderLM(config).init)(jax.random.PRNGKey(1), jnp.zeros((1, 2), jnp.int32))["params"]


def test_checkpoint_round_trip_samples_what_the_params_say(tmp_path, capsys):
    config = ModelConfig(vocab_size=65, d_model=16, num_layers=1, num_heads=2, max_seq_len=16, init_std=0.2)
    params = _init(config)
    _save(tmp_path, config, params)
    code, out, err = run(capsys, "--checkpoint", str(tmp_path), "--prompt", "ROMEO:", "--max-new-tokens", "8",
                         "--temperature", "0")
    assert code == 0, err
    tokenizer = CharTokenizer(CHARS)
    prompt = tokenizer.encode("ROMEO:")
    expected = decoding.generate(params, config, prompt[None], np.array([len(prompt)]), max_new_tokens=8,
                                 rng=jax.random.PRNGKey(0), temperature=0.0)
    assert out == "ROMEO:" + tokenizer.decode(expected.tokens[0]) + "\n"


def test_an_unrolled_checkpoint_samples_the_same_with_scanned_layers(tmp_path, capsys):
    """A checkpoint saved layer by layer (as every run before `scan_layers`) loads stacked."""
    config = ModelConfig(vocab_size=65, d_model=16, num_layers=3, num_heads=2, max_seq_len=16, init_std=0.2)
    _save(tmp_path, config, _init(config))
    argv = ("--checkpoint", str(tmp_path), "--prompt", "ROMEO:", "--max-new-tokens", "8", "--temperature", "0")
    unrolled, scanned = run(capsys, *argv), run(capsys, *argv, "--scan-layers")
    assert unrolled[0] == scanned[0] == 0, scanned[2]
    assert scanned[1] == unrolled[1] and len(unrolled[1]) > len("ROMEO:\n")


def test_checkpoint_whose_params_do_not_fit_its_config(tmp_path, capsys):
    saved = ModelConfig(vocab_size=65, d_model=16, num_layers=1, num_heads=2, max_seq_len=16)
    _save(tmp_path, saved.replace(d_model=32), _init(saved))
    code, _, err = run(capsys, "--checkpoint", str(tmp_path), "--prompt", "A")
    assert code == 1 and "incompatible" in err


@pytest.mark.slow
def test_sampling_on_a_mesh_prints_the_one_device_samples(tiny, capsys):
    """--cpu-devices 4 --mesh data:2,tensor:2 in a fresh process (the device count is fixed when JAX starts)."""
    import os
    import subprocess
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    argv = ["--random-init", tiny, "--prompt", "ROMEO:", "--max-new-tokens", "12", "--num-samples", "2"]
    done = subprocess.run([sys.executable, "-m", "train.sample", *argv, "--cpu-devices", "4", "--mesh",
                           "data:2,tensor:2"], cwd=root, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "mesh data:2,fsdp:1,tensor:2" in done.stderr
    code, out, _ = run(capsys, *argv)
    assert code == 0 and done.stdout == out and out.count("ROMEO:") == 2
    code, _, err = run(capsys, *argv, "--mesh", "tensor:3")
    assert code == 2 and "tensor = 3 does not divide num_heads = 2" in err


@pytest.mark.slow
def test_ctrl_c_prints_what_was_generated_and_exits_130(tiny, tmp_path):
    """A real process: the signal comes once the warm-up has compiled, in the middle of 200,000 tokens."""
    import os
    import re
    import signal
    import subprocess
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-m", "train.sample", "--random-init", tiny, "--prompt", "ROMEO:",
                             "--max-new-tokens", "200000"], cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(root)})
    for line in proc.stderr:
        if line.startswith("compile:"):
            break
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in err
    stopped = re.fullmatch(r"stopped: SIGINT after 0 of 1 samples \((\d+) of 200000 new tokens\): what was "
                           r"generated is printed above", err.strip().splitlines()[-1])
    assert stopped and 0 < int(stopped.group(1)) < 200000, err[-500:]
    assert out.startswith("ROMEO:") and len(out) == len("ROMEO:") + int(stopped.group(1)) + 1


@pytest.mark.slow
def test_ctrl_c_among_many_samples_keeps_those_drawn_and_makes_up_none(tiny, tmp_path):
    """200,000 samples of 50 tokens, the signal once the first call's samples are out: they and every sample
    drawn since are printed whole, none holding only its prompt (every sample did, and a window spanning
    all 12,500 calls kept nothing)."""
    import os
    import re
    import signal
    import subprocess
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-m", "train.sample", "--random-init", tiny, "--prompt", "ROMEO:",
                             "--max-new-tokens", "50", "--num-samples", "200000"], cwd=root, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(root)})
    first = proc.stdout.readline()  # the first call's samples are printed as soon as they are drawn
    proc.send_signal(signal.SIGINT)
    rest, err = proc.stdout.read(), proc.stderr.read()  # the rest of what readline buffered, then the end
    proc.wait(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in err
    line = err.strip().splitlines()[-1]
    stopped = re.fullmatch(r"stopped: SIGINT after (\d+) of 200000 samples(?: and (\d+) cut at (\d+) of 50 new "
                           r"tokens)?: what was generated is printed above; the others were never drawn", line)
    assert stopped, line
    complete, cut, cut_at = (int(g or 0) for g in stopped.groups())
    samples = (first + rest).rstrip("\n").split("\n---------------\n")  # the call in hand may be cut short
    assert 0 < complete < 200000 and len(samples) == complete + cut
    assert all(s.startswith("ROMEO:") and len(s) == len("ROMEO:") + 50 for s in samples[:complete]), [
        (len(s), s) for s in samples[:complete] if len(s) != 56][:3]
    assert all(len(s) == len("ROMEO:") + cut_at for s in samples[complete:])


@pytest.mark.parametrize("argv, message", [
    (["--cpu-devices", "4"], "--cpu-devices 4 makes host devices for a --mesh of that size: pass --mesh too"),
    (["--cpu-devices", "4", "--mesh", "data:2"], "runtime.mesh='data:2,fsdp:1,tensor:1' uses 2 device(s) but "
                                                  "runtime.cpu_devices=4 makes 4"),
    (["--data", "x.txt"], "--data goes with --random-init"),
    (["--allow-nonfinite"], "--allow-nonfinite goes with --hf"),
    (["--max-new-tokens", str(10 ** 13)], "10,000,000,000,000 tokens (1 x 10000000000000) take about"),
])
def test_flags_that_cannot_work_are_usage_errors(tmp_path, capsys, argv, message):
    code, out, err = run(capsys, "--checkpoint", str(tmp_path), "--prompt", "A", *argv)
    assert code == 2 and message in err and len(err.splitlines()) == 1 and out == ""


def test_a_big_request_is_announced(tmp_path, capsys):
    code, _, err = run(capsys, "--checkpoint", str(tmp_path / "none"), "--prompt", "A", "--max-new-tokens", "2000000")
    assert code == 1 and err.splitlines()[0] == (  # the memory comes once the model is known (test_sample_memory.py)
        "warning: 2,000,000 tokens (1 x 2000000) take a while; Ctrl-C stops and prints what was generated")


def test_random_init_takes_its_characters_from_data(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("JAXATTN_SHAKESPEARE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # nothing cached, and no download below
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("abc")
    config = tmp_path / "tiny.toml"
    config.write_text(TINY_TOML.replace("vocab_size = 65", "vocab_size = 3"))
    code, out, err = run(capsys, "--random-init", str(config), "--data", str(corpus), "--prompt", "ab",
                         "--max-new-tokens", "4")
    assert code == 0 and set(out.strip()) <= set("abc") and len(out) == 2 + 4 + 1
    code, _, err = run(capsys, "--random-init", str(config), "--data", str(tmp_path / "missing.txt"), "--prompt", "a")
    assert code == 1 and err == f"error: data file '{tmp_path / 'missing.txt'}' (from --data / train.data_path) " \
                                "does not exist\n"


def test_quant_int8_samples_with_quantized_weights_and_says_so(tiny, capsys):
    code, out, err = run(capsys, "--random-init", tiny, "--prompt", "ROMEO:", "--max-new-tokens", "4", "--quant",
                         "int8:channel", "--temperature", "0")  # d_model 16: per channel (int8 is groups of 32)
    assert code == 0, err
    assert out.startswith("ROMEO:") and len(out) == len("ROMEO:") + 4 + 1
    assert "weights int8:channel, quantized '" in err
    if "quantized 'native" in err:  # the native loop names the instruction-set path it was compiled to
        assert f"', {quant_matmul.native_path()} path (" in err


@pytest.mark.parametrize("argv, message", [
    (["--quant", "int4"], "--quant int4: blocks_0/attn/"),  # d_model 16: no whole group of 32 rows
    (["--quant", "int8"], "--quant int8: blocks_0/attn/"),  # int8 is in groups of 32 too (llama.cpp's Q8_0)
    (["--quant", "int3"], "argument --quant: invalid choice: 'int3'"),
    (["--quant", "int8", "--mesh", "data:1"], "--quant does not go with --mesh"),
])
def test_quant_that_cannot_work_is_a_usage_error(tiny, capsys, argv, message):
    code, out, err = run(capsys, "--random-init", tiny, "--prompt", "A", "--max-new-tokens", "2", *argv)
    assert code == 2 and out == "" and message in err and err.startswith("error: ") and len(err.splitlines()) == 1


def test_serve_takes_quant_as_sample_does(tiny):
    from jaxattn.quantization import QuantizedWeight
    from train import serve
    from train.cli import UsageError
    from train.models.load import load_model
    params = load_model(serve.parse_args(["--random-init", tiny, "--quant", "int8:channel"]).model_source).params
    assert all(isinstance(layer["kernel"], QuantizedWeight) for layer in params["blocks_0"]["attn"].values())
    assert isinstance(params["tied_head"], QuantizedWeight)
    with pytest.raises(UsageError, match="--quant does not go with --mesh"):
        serve.parse_args(["--random-init", tiny, "--quant", "int4:64", "--mesh", "tensor:1"])
