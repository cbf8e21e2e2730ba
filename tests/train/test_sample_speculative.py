"""`python -m train.sample --speculative SPEC`: greedy samples equal the plain ones, with prompt lookup and with a
draft model read from a run directory; the drafts' statistics on stderr; bad specs and misfits in one line."""

import re

import jax
import jax.numpy as jnp
import pytest
from programs import CHARS, run_sample, tiny_sampling_config

from jaxattn.config import ModelConfig
from jaxattn.model import DecoderLM
from train.checkpoints.store import Checkpointer
from train.config import ExperimentConfig, TrainConfig
from train.data.tokenizer import CharTokenizer

GREEDY = ("--prompt", "ROMEO:", "--max-new-tokens", "9", "--temperature", "0")
STATS = re.compile(r"speculative: (.+): (\d+) verification steps, acceptance (\d\.\d\d) \((\d+) of (\d+) drafts\), "
                   r"\d+\.\d\d drafts kept per step, by position( (\d\.\d\d|-))+; drafting \d+\.\d+ s")


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    return tiny_sampling_config(tmp_path, monkeypatch)


def test_prompt_lookup_samples_the_greedy_tokens_and_reports_its_drafts(tiny, capsys):
    code, plain, err = run_sample(capsys, "--random-init", tiny, *GREEDY)
    assert code == 0, err
    code, out, err = run_sample(capsys, "--random-init", tiny, *GREEDY, "--speculative", "ngram:k=4")
    assert code == 0, err
    assert out == plain and len(out) == len("ROMEO:") + 9 + 1
    stats = STATS.search(err)
    assert stats and stats.group(1) == "ngram k=4 n=1..3", err
    assert "decode: 9 tokens (1 x up to 9)" in err


@pytest.mark.parametrize("argv, message", [
    (["--speculative", "ngram:k=0"], "argument --speculative: speculative decoding 'ngram:k=0': k='0' must be a "
                                     "positive integer (accepted: ngram, "),
    (["--speculative", "eagle"], "unknown method 'eagle'"),
    (["--speculative", "draft"], "draft needs the draft model's path, draft:DIR"),
    (["--speculative", "ngram", "--mesh", "data:1"], "--speculative does not go with --mesh"),
    (["--speculative", "ngram", "--max-new-tokens", "11"], "--speculative decodes within the model's context, "
                                                           "max_seq_len=16: the prompt's 6 tokens and --max-new-tokens "
                                                           "11 do not fit (at most 10 new tokens"),
])
def test_a_bad_spec_or_a_misfit_is_one_usage_line(tiny, capsys, argv, message):
    code, out, err = run_sample(capsys, "--random-init", tiny, "--prompt", "ROMEO:", *argv)
    assert code == 2 and out == "" and message in err
    assert err.splitlines()[-1].startswith("error: ") and err.count("error: ") == 1


def _save_run(run_dir, config: ModelConfig, seed: int = 1):
    params = jax.jit(DecoderLM(config).init)(jax.random.PRNGKey(seed), jnp.zeros((1, 2), jnp.int32))["params"]
    checkpointer = Checkpointer(run_dir)
    experiment = ExperimentConfig(name="tiny", model=config, train=TrainConfig(block_size=config.max_seq_len))
    checkpointer.save("best", 1, {"params": params, "step": jnp.int32(1)}, config=experiment,
                      tokenizer=CharTokenizer(CHARS), val_loss=2.0, best_val_loss=2.0)
    checkpointer.close()


def test_a_run_as_its_own_draft_samples_the_greedy_tokens(tmp_path, capsys):
    config = ModelConfig(vocab_size=65, d_model=16, num_layers=1, num_heads=2, max_seq_len=16, init_std=0.2)
    _save_run(tmp_path / "run", config)
    _save_run(tmp_path / "other", config.replace(vocab_size=64))
    target = ("--checkpoint", str(tmp_path / "run"), *GREEDY)
    code, plain, err = run_sample(capsys, *target)
    assert code == 0, err
    code, out, err = run_sample(capsys, *target, "--speculative", f"draft:{tmp_path / 'run'},k=2")
    assert code == 0, err
    stats = STATS.search(err)
    assert out == plain and stats and stats.group(1) == f"draft {tmp_path / 'run'} k=2", err
    assert int(stats.group(4)) > 0  # the model agrees with itself
    code, out, err = run_sample(capsys, *target, "--speculative", f"draft:{tmp_path / 'other'}")
    assert code == 2 and out == "" and err.count("error: ") == 1
    assert (f"error: --speculative draft {tmp_path / 'other'}: its vocabulary has 64 tokens and the model's 65: a "
            "draft must share the model's tokenizer") in err
    code, _, err = run_sample(capsys, *target, "--speculative", f"draft:{tmp_path / 'nowhere'}")
    assert code == 1 and err.count("error: ") == 1
    assert err.splitlines()[-1] == (f"error: --speculative draft {tmp_path / 'nowhere'}: checkpoint directory "
                                    f"'{tmp_path / 'nowhere'}' does not exist")


def test_a_draft_path_is_read_as_a_gguf_file_a_transformers_directory_or_a_run(tmp_path):
    from train.decode.speculative import draft_source
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "tokenizer.json").write_text("{}")
    assert draft_source(str(tmp_path / "hf")).kind == "hf"
    assert draft_source("models/small-Q8_0.gguf").kind == "gguf"
    assert draft_source(str(tmp_path)).kind == "checkpoint"
