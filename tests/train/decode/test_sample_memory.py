"""`python -m train.sample`'s memory: the estimate's arithmetic (`train.decode.memory`), its refusal and
warning lines, and the samples drawn a few rows per call (`train.decode.calls`). The estimate against
measured peak memory is a benchmark (bench/sample_memory.py, docs/performance.md "Sampling memory"),
not a test."""

import re
from collections import namedtuple
from pathlib import Path

import flax.linen as nn
import jax
import numpy as np
import pytest
from programs import run_sample, tiny_sampling_config

from jaxattn import Kernels, decoding, generate_windowed, resolve_kernels
from jaxattn.cache.build import cache_bytes_per_token
from jaxattn.config import ModelConfig
from jaxattn.model import abstract_params
from train.cli import UsageError
from train.data.tokenizer import CharTokenizer
from train.decode import calls, memory
from train.models import fresh

GIB = 2 ** 30
CONFIG = ModelConfig(vocab_size=65, d_model=16, num_layers=2, num_heads=2, max_seq_len=16, positions="rope")
VirtualMemory = namedtuple("VirtualMemory", "total available")


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    return tiny_sampling_config(tmp_path, monkeypatch)


run = run_sample


def test_the_estimate_adds_up_what_is_held():
    # Prompt of 6 tokens in a 16-token context, 20 new ones: a first window (bucket 8, 10 new, cache 16)
    # and the later windows (history 8, bucket 8, 8 new, cache 16).
    assert memory.windows_shapes(CONFIG, 6, 20) == [(8, 16, 10), (8, 16, 8)]
    assert memory.windows_shapes(CONFIG, 6, 5) == [(8, 13, 5)]
    assert calls.warmup_tokens(CONFIG, 6, 20) == 11 and calls.warmup_tokens(CONFIG, 6, 5) == 5  # both programs
    rows = 4
    cache, logits, activations = memory.call_bytes(CONFIG, rows, 6, 20)
    assert cache == rows * 16 * cache_bytes_per_token(CONFIG)["bytes"] == rows * 16 * 2 * 2 * 2 * 8 * 4
    assert logits == 4 * rows * 8 * 65  # the prefill's [rows, 8, V] float32 logits
    per_position = (2 * 16 + 64 + 6 * 8) * 4 + 4 * 2 * 16  # activations, float32 attention scores
    assert activations == rows * 8 * per_position + 2 * 4 * rows * 10
    plan = memory.estimate_memory(CONFIG, prompt_len=6, num_samples=10, max_new_tokens=20, rows=rows,
                                  process=GIB, kernels=Kernels())  # "xla": the cache written at once
    assert (plan.rows, plan.calls, plan.ids) == (4, 3, 4 * 10 * 20)
    assert plan.compile == int(memory.COMPILE_BYTES * (1 + memory.SECOND_PROGRAM))  # two programs
    history = 4 * rows * (8 + 8) + memory.STREAM_BYTES  # between windows: 8 tokens of history, 8 of the last window
    assert plan.streams == 3 * history
    assert plan.total == GIB + cache + logits + activations + plan.compile + plan.ids + plan.streams
    unrolled = memory.estimate_memory(CONFIG, prompt_len=6, num_samples=10, max_new_tokens=5, rows=rows,
                                      process=GIB, kernels=Kernels(decode="xla_cpu"))
    assert unrolled.compile == memory.COMPILE_BYTES + memory.COMPILE_BYTES_PER_ROW_LAYER * rows * 2


@pytest.mark.parametrize("config", [CONFIG, CONFIG.replace(num_kv_heads=1, vocab_size=512, max_seq_len=64)])
def test_a_calls_estimate_is_near_what_xla_allocates(config):
    """The buffers of one call against `memory_analysis()` of its compiled programs (no timing involved)."""
    params = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), nn.unbox(abstract_params(config)))
    rows, prompt_len, new = 8, 6, 2 * config.max_seq_len
    allocated = 0
    for index, (bucket, length, num_new) in enumerate(memory.windows_shapes(config, prompt_len, new)):
        history = prompt_len if index == 0 else config.max_seq_len // 2
        prompt, lengths, knobs, cache_len = decoding._prepare(config, Kernels(), np.ones((rows, history), np.int32),
                                                              np.full(rows, history), num_new, 0.8, 20, 0.9, None, 0)
        assert (prompt.shape[1], cache_len) == (bucket, length)
        compiled = decoding._generate_cached.lower(params, prompt, lengths, jax.random.PRNGKey(0), knobs,
                                                   config=config, kernels=Kernels(), max_new_tokens=num_new,
                                                   cache_len=cache_len, return_logits=False).compile()
        stats = compiled.memory_analysis()
        allocated = max(allocated, stats.temp_size_in_bytes + stats.output_size_in_bytes)
    assert 0.7 <= sum(memory.call_bytes(config, rows, prompt_len, new)) / allocated <= 1.5


def test_fewer_rows_per_call_when_a_call_would_take_half_of_what_is_free():
    big = CONFIG.replace(max_seq_len=4096, d_model=512, num_heads=8)
    plan, warnings = memory.plan_memory(big, prompt_len=6, num_samples=64, max_new_tokens=5000, rows=16,
                                        process=GIB, available=2 * GIB, physical=8 * GIB, kernels=Kernels())
    assert plan.rows < 16 and plan.per_call + plan.compile <= GIB and warnings == []
    assert plan.calls == -(-64 // plan.rows)


def test_a_request_beyond_physical_memory_is_refused_naming_the_figure_and_a_num_samples_that_fits():
    kwargs = dict(prompt_len=6, max_new_tokens=1000, rows=16, process=GIB // 4, available=GIB // 2, physical=GIB,
                  kernels=Kernels())
    with pytest.raises(UsageError) as refused:
        memory.plan_memory(CONFIG, num_samples=10 ** 6, **kwargs)
    message = str(refused.value)
    assert message.startswith("sampling 1000000 x 1000 tokens takes about 5.13 GiB at its peak (this process now 0.25")
    assert "token ids 3.73 GiB, between windows 1.01 GiB); 16 sample(s) per call, 62,500 call(s) a window" in message
    named = re.fullmatch(r".*more than this machine's 1\.00 GiB of memory: --num-samples ([\d,]+) fits in the "
                         r"memory free with --max-new-tokens 1000", message)
    fits = int(named.group(1).replace(",", ""))
    plan, warnings = memory.plan_memory(CONFIG, num_samples=fits, **kwargs)  # what it names fits, unwarned
    assert warnings == [] and plan.total <= GIB
    _, warnings = memory.plan_memory(CONFIG, num_samples=int(fits * 1.01) + 16, **kwargs)
    assert warnings and warnings[0].startswith(f"sampling {int(fits * 1.01) + 16} x 1000 tokens takes about")
    with pytest.raises(UsageError, match="even one sample of one token does not fit"):
        memory.plan_memory(CONFIG, num_samples=1, **{**kwargs, "process": 2 * GIB})
    with pytest.raises(UsageError, match=r"--max-new-tokens ([\d,]+) fits in this machine's memory with "
                                         r"--num-samples 1$") as refused:
        memory.plan_memory(CONFIG, num_samples=1, **{**kwargs, "max_new_tokens": 3 * 10 ** 8})
    named = int(re.search(r"--max-new-tokens ([\d,]+)", str(refused.value)).group(1).replace(",", ""))
    memory.plan_memory(CONFIG, num_samples=1, **{**kwargs, "max_new_tokens": named})


def test_the_command_refuses_before_compiling_and_warns_above_most_of_the_free_memory(tiny, capsys, monkeypatch):
    # A machine of 2 GiB where this process already holds 1.7 GiB: the token ids of 10,000,000 x 20 tokens
    # (0.75 GiB) fit in the machine alone, but not beside the process, a call and, between the windows
    # of the 16-token context, what each of the 625,000 calls of 16 samples keeps (10.13 GiB).
    monkeypatch.setattr(memory.psutil, "virtual_memory", lambda: VirtualMemory(total=2 * GIB, available=GIB))
    monkeypatch.setattr(memory.psutil, "Process", lambda: namedtuple("P", "memory_info")(
        lambda: namedtuple("M", "rss")(int(1.7 * GIB))))
    code, out, err = run(capsys, "--random-init", tiny, "--prompt", "ROMEO:", "--num-samples", "10000000",
                         "--max-new-tokens", "20")
    warning, kernels, line = err.splitlines()  # nothing compiled
    assert code == 2 and out == "" and warning.endswith("take a while; Ctrl-C stops and prints what was generated")
    assert line.startswith("error: sampling 10000000 x 20 tokens takes about 12.75 GiB at its peak (this process now "
                           "1.70 GiB") and "between windows 10.13 GiB); 16 sample(s) per call, 625,000 call(s)" in line
    assert "token ids 0.75 GiB" in line and "more than this machine's 2.00 GiB of memory: --num-samples " in line
    assert line.endswith(" fits in the memory free with --max-new-tokens 20 (see python -m train.sample --help)")
    monkeypatch.undo()

    monkeypatch.setenv("JAXATTN_SHAKESPEARE", str(Path(tiny).parent / "corpus.txt"))
    free = 0.02 * GIB  # the rest fits in the machine, but not in what is free
    monkeypatch.setattr(memory.psutil, "virtual_memory", lambda: VirtualMemory(total=64 * GIB, available=free))
    code, out, err = run(capsys, "--random-init", tiny, "--prompt", "ROMEO:", "--num-samples", "3",
                         "--max-new-tokens", "4")
    assert code == 0 and out.count("ROMEO:") == 3
    warning = [line for line in err.splitlines() if line.startswith("warning: sampling 3 x 4 tokens takes about")]
    assert len(warning) == 1 and "of the 0.02 GiB free; it may swap or be killed" in warning[0]


def test_the_memory_is_reported_and_many_samples_are_drawn_a_few_per_call(tiny, capsys, monkeypatch):
    monkeypatch.setitem(memory.ROWS_PER_CALL, "cpu", 2)
    code, out, err = run(capsys, "--random-init", tiny, "--prompt", "ROMEO:", "--num-samples", "5",
                         "--max-new-tokens", "30")  # two windows of the 16-token context
    assert code == 0, err
    lines = [line for line in err.splitlines() if line.startswith("memory: about ")]
    assert len(lines) == 1 and lines[0].endswith("; 2 sample(s) per call, 3 call(s) a window")
    texts = out.rstrip("\n").split("\n---------------\n")
    assert len(texts) == 5 and all(t.startswith("ROMEO:") and len(t) == 6 + 30 for t in texts)
    assert len(set(texts)) == 5  # each call its own key
    assert "decode: 150 tokens (5 x 30)" in err


def test_samples_of_one_call_are_those_of_generate_windowed(tiny, capsys):
    """Up to ROWS_PER_CALL samples are one call with the seed's key: the tokens they always were."""
    code, out, err = run(capsys, "--random-init", tiny, "--prompt", "ROMEO:", "--num-samples", "3",
                         "--max-new-tokens", "20", "--seed", "7")
    assert code == 0, err
    params, config, tokenizer = fresh.random_init(tiny, seed=7)  # --seed also seeds the parameters
    prompt = tokenizer.encode("ROMEO:")
    kernels = resolve_kernels(Kernels.auto())[0]
    ids = generate_windowed(params, config, prompt, max_new_tokens=20, rng=jax.random.PRNGKey(7), num_samples=3,
                            temperature=0.8, top_k=200, kernels=kernels)
    assert out == "\n---------------\n".join("ROMEO:" + tokenizer.decode(row) for row in ids) + "\n"
    assert isinstance(tokenizer, CharTokenizer)
