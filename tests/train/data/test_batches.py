"""train.data.batches: host batches equal the device draws they replaced, shards are read across their
boundaries, each process reads only its rows, and a prepared corpus trains like its text file."""

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from train import tiny_lm
from train.config import TrainConfig, load_config
from train.data.batches import RANDINT_SPAN, TRAIN, Feed, RunBatches, ShardStream, batch_key, draw_starts
from train.data.corpus import open_corpus
from train.data.errors import DataError
from train.data.shard_format import write_shard
from train.data.shards import open_prepared
from train.data.tokenize_corpus import prepare
from train.run.experiment import run_experiment

ROOT = Path(__file__).resolve().parents[3]
ENV = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, "PYTHONPATH": str(ROOT)}
TINY = ["model.d_model=32", "model.num_layers=1", "model.num_heads=2", "model.max_seq_len=16",
        "train.batch_size=4", "train.block_size=16", "train.eval_iters=3", "train.eval_interval=5",
        "train.log_interval=1", "train.warmup_iters=2", "train.lr=3e-3", "train.lr_decay_iters=20",
        "train.sample_tokens=0", "train.plot=false", "train.steps_per_dispatch=2", "runtime.mesh=data:1",
        "runtime.attention=xla"]


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "text.txt"
    rng = np.random.default_rng(0)
    words = ["the", "king", "queen", "of", "night", "and", "day", "shall", "speak", "now"]
    path.write_text("\n".join(" ".join(rng.choice(words, 8)) for _ in range(400)) + "\n")
    return path


@pytest.fixture(scope="module")
def prepared(text_file, tmp_path_factory):
    """The text file prepared with the char tokenizer into train shards of 5000 tokens (several)."""
    out = tmp_path_factory.mktemp("prepared") / "char"
    prepare(text_file, "char", out, shard_tokens=5000)
    return out


def _one_device_windows(rows: int) -> NamedSharding:
    return NamedSharding(Mesh(np.array(jax.devices()[:1]), ("data",)), P(None, "data"))


# ------------------------------------------------------------------------- the draws

@pytest.mark.parametrize("span", [1, 7, 1000, 899_935, RANDINT_SPAN])
def test_starts_are_jax_random_randint_of_the_batch_key(span):
    got = draw_starts(1337, TRAIN, np.arange(40, 45), 6, span)
    want = [np.asarray(jax.random.randint(batch_key(1337, TRAIN, step), (6,), 0, span)) for step in range(40, 45)]
    assert got.shape == (5, 6) and got.dtype == np.int64
    np.testing.assert_array_equal(got, np.stack(want))


def test_a_corpus_beyond_int32_draws_64_bit_starts():
    span = 2**33 + 5
    got = draw_starts(7, TRAIN, np.arange(200), 8, span)
    assert got.min() >= 0 and got.max() < span and (got > RANDINT_SPAN).mean() > 0.5  # most lie past 2**31
    np.testing.assert_array_equal(got, draw_starts(7, TRAIN, np.arange(200), 8, span))  # a function of the step
    assert len(np.unique(got)) == got.size


def test_host_windows_equal_the_device_gather_they_replaced():
    """The windows of a chunk are those the jitted step used to slice on the device from (seed, step)."""
    tokens = (np.arange(3000) * 7 % 65).astype(np.int32)
    tc = TrainConfig(batch_size=4, block_size=16, seed=11)

    @jax.jit
    def device_batch(data, step):  # the former train.data.corpus.get_batch
        starts = jax.random.randint(batch_key(tc.seed, TRAIN, step), (tc.batch_size,), 0, data.shape[0] - 16)
        return jax.vmap(lambda s: jax.lax.dynamic_slice(data, (s,), (17,)))(starts)

    chunk = RunBatches(tokens, tokens, tc, _one_device_windows, 4).train_chunk(5, 9)
    assert chunk.shape == (4, 4, 17) and chunk.dtype == jnp.int32
    for i, step in enumerate(range(5, 9)):
        np.testing.assert_array_equal(chunk[i], device_batch(jnp.asarray(tokens), step))


# ------------------------------------------------------------------------- shards

def test_windows_cross_shard_boundaries(tmp_path):
    stream = np.random.default_rng(1).integers(0, 70_000, 1000)  # uint32 shards
    sizes, paths, at = [300, 1, 450, 249], [], 0
    for i, n in enumerate(sizes):
        paths.append(write_shard(tmp_path / f"train_{i:05d}.bin", stream[at:at + n], 70_000, b"h" * 16))
        at += n
    shards = ShardStream([(p, 64, n, np.dtype("<u4")) for p, n in zip(paths, sizes)])
    assert len(shards) == 1000
    starts = np.array([[0, 290, 299, 300], [301, 740, 751, 983]])  # each boundary straddled
    got = shards.windows(starts, 17)
    np.testing.assert_array_equal(got, stream[starts[..., None] + np.arange(17)])
    np.testing.assert_array_equal(shards.read(295, 460), stream[295:755])  # across three shards
    shards.close()


def test_a_prepared_corpus_reads_the_streams_of_its_shards(prepared):
    opened = open_prepared(prepared)
    corpus = open_corpus(prepared)
    assert len(opened.train) > 2 and len(corpus.train) == opened.train_tokens
    np.testing.assert_array_equal(corpus.train.read(0, len(corpus.train)), opened.stream("train"))
    np.testing.assert_array_equal(corpus.val.read(0, len(corpus.val)), opened.stream("val"))


def test_a_shard_cut_short_while_a_run_reads_it_is_one_data_error(tmp_path):
    path = write_shard(tmp_path / "train_00000.bin", np.arange(100), 100, b"h" * 16)
    stream = ShardStream([(path, 64, 100, np.dtype("<u2"))])
    np.testing.assert_array_equal(stream.read(90, 10), np.arange(90, 100))
    os.truncate(path, 64 + 2 * 50)
    with pytest.raises(DataError, match="train_00000.bin ended early: it was truncated while the run read it"):
        stream.read(90, 10)


# ------------------------------------------------------------------------- reading ahead

def test_the_feed_reads_ahead_in_order_and_counts_the_wait():
    made = []

    def make(first, last):
        time.sleep(0.05)
        made.append((first, last))
        return first

    feed = Feed(make, [(0, 2), (2, 4), (4, 6)])
    assert [feed.next() for _ in range(3)] == [0, 2, 4]
    assert made == [(0, 2), (2, 4), (4, 6)] and 0.04 < feed.waited < 1.0
    feed.close()
    time.sleep(0.2)  # ahead now: nothing to wait for
    ahead = Feed(make, [(0, 2)])
    time.sleep(0.2)
    ahead.next()
    assert ahead.waited < 0.02
    ahead.close()


def test_an_error_while_reading_ahead_is_raised_by_next_and_close_stops_the_thread():
    def make(first, last):
        if first == 2:
            raise DataError("shard gone")
        return first

    feed = Feed(make, [(0, 2), (2, 4), (4, 6)])
    assert feed.next() == 0
    with pytest.raises(DataError, match="shard gone"):
        feed.next()
    feed.close()
    endless = Feed(lambda a, b: a, ((i, i + 1) for i in range(10**9)), depth=1)
    endless.close()  # a run stopped early: the thread ends though chunks remain
    assert not any(t.name == "jaxattn-feed" and t.is_alive() for t in threading.enumerate())


# ------------------------------------------------------------------------- runs

def _losses(out: Path) -> tuple[list, list]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return ([r["loss"] for r in records if "loss" in r],
            [(r["train_loss"], r["val_loss"]) for r in records if "val_loss" in r])


def test_a_prepared_char_corpus_trains_to_the_same_losses_as_its_text_file(text_file, prepared, tmp_path):
    runs = {}
    for name, data in (("text", text_file), ("prepared", prepared)):
        config = load_config(overrides=TINY + ["train.max_iters=10", f"train.data_path='{data}'",
                                               f"train.out_dir='{tmp_path / name}'"])
        result = run_experiment(config, quiet=True)
        runs[name] = _losses(tmp_path / name)
        assert result.input_wait_s >= 0.0
    assert len(runs["text"][0]) == 10 and runs["text"][0] == runs["prepared"][0]  # bit for bit
    np.testing.assert_allclose(runs["text"][1], runs["prepared"][1], rtol=1e-12)


def test_a_resumed_run_on_a_prepared_corpus_replays_the_same_batches(prepared, tmp_path):
    common = TINY + [f"train.data_path='{prepared}'"]
    run_experiment(load_config(overrides=common + ["train.max_iters=10", f"train.out_dir='{tmp_path / 'whole'}'"]),
                   quiet=True)
    run_experiment(load_config(overrides=common + ["train.max_iters=5", f"train.out_dir='{tmp_path / 'cut'}'"]),
                   quiet=True)
    run_experiment(load_config(overrides=common + ["train.max_iters=10", f"train.out_dir='{tmp_path / 'cut'}'"]),
                   quiet=True, resume=True)
    assert _losses(tmp_path / "cut")[0] == _losses(tmp_path / "whole")[0]


def test_a_run_names_the_prepared_tokenizer_and_warns_of_the_split_it_cannot_change(prepared, tmp_path, capsys):
    config = load_config(overrides=TINY + ["train.max_iters=2", "train.val_fraction=0.2",
                                           f"train.data_path='{prepared}'", f"train.out_dir='{tmp_path}'"])
    run_experiment(config)
    out, err = capsys.readouterr()
    hash_ = open_prepared(prepared).tokenizer_hash.hex()
    assert f"(data {prepared}, prepared: char tokenizer of " in out and f"ids, hash {hash_}, " in out
    assert (f"warning: train.val_fraction=0.2 is not used: the prepared corpus {prepared} keeps its split "
            "(val_fraction 0.1, python -m train.prepare --val-fraction)") in err


def _main(*argv: str) -> int:
    """`python -m train.tiny_lm ARGV` in this process: its exit code."""
    with pytest.raises(SystemExit) as exit_:
        tiny_lm.main(list(argv))
    return exit_.value.code


def test_a_prepared_corpus_of_another_tokenizer_than_the_runs_is_one_line(prepared, tmp_path, capsys):
    code = _main("--data", str(prepared), "--out-dir", str(tmp_path / "run"), "--set", *TINY, "train.tokenizer=byte")
    err = capsys.readouterr().err
    message = "has a char tokenizer and train.tokenizer is 'byte': set train.tokenizer = \"char\""
    assert code == 1 and err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_a_bpe_tokenizer_needs_a_prepared_corpus_and_an_empty_directory_is_no_corpus(text_file, tmp_path, capsys):
    assert _main("--data", str(text_file), "--out-dir", str(tmp_path / "a"), "--set", *TINY,
                 "train.tokenizer=bpe") == 1
    assert "train.tokenizer = 'bpe' needs a prepared corpus: python -m train.prepare" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert _main("--data", str(tmp_path / "empty"), "--out-dir", str(tmp_path / "b"), "--set", *TINY) == 1
    assert "has no train shards" in capsys.readouterr().err


def test_the_bpe_config_trains_on_a_prepared_bpe_corpus_and_samples_with_its_tokenizer(text_file, tmp_path, capsys):
    from train import sample
    prepare(text_file, "bpe:300", tmp_path / "bpe")
    shrink = ["model.d_model=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1",
              "model.max_seq_len=16", "train.batch_size=4", "train.block_size=16", "train.max_iters=4",
              "train.eval_interval=4", "train.eval_iters=2", "train.warmup_iters=1", "train.lr_decay_iters=4",
              "train.steps_per_dispatch=2", "train.sample_tokens=8", "train.plot=false", "runtime.mesh=data:1"]
    config = load_config("bpe_corpus", overrides=shrink + [f"train.data_path='{tmp_path / 'bpe'}'",
                                                            f"train.out_dir='{tmp_path / 'run'}'"])
    result = run_experiment(config, quiet=True)
    tokenizer = open_prepared(tmp_path / "bpe").tokenizer
    assert result.config.model.vocab_size == tokenizer.vocab_size <= 300 and np.isfinite(result.final_val_loss)
    assert result.sample.startswith("The") and tokenizer.decode(tokenizer.encode(result.sample)) == result.sample
    code = sample.main(["--checkpoint", str(tmp_path / "run"), "--prompt", "the king", "--max-new-tokens", "5",
                        "--temperature", "0"])
    out = capsys.readouterr().out
    assert code == 0 and out.startswith("the king") and len(tokenizer.encode(out.strip())) >= 5


# ------------------------------------------------------------------------- two processes

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_read_disjoint_rows_that_make_the_global_batch(prepared):
    """Processes 0 and 1 (2 host devices each, a data:4 mesh) each read half of every batch's rows; the
    assembled array is the batch one process reads whole."""
    port = _free_port()
    processes = [subprocess.Popen([sys.executable, str(Path(__file__).parent / "batches_script.py"), f"127.0.0.1:{port}",
                                   str(i), str(prepared)], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for i in (0, 1)]
    outputs = []
    for process in processes:
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, err[-3000:]
        outputs.append(json.loads(out.strip().splitlines()[-1]))
    corpus, tc = open_corpus(prepared), TrainConfig(batch_size=8, block_size=16)
    whole = RunBatches(corpus.train, corpus.val, tc, _one_device_windows, 8).train_chunk(3, 6)  # FIRST, LAST
    starts = draw_starts(tc.seed, TRAIN, np.arange(3, 6), 8, len(corpus.train) - 16)
    read = [np.asarray(o["read_starts"]) for o in outputs]
    assert [r.shape for r in read] == [(3, 4), (3, 4)]  # each process: 4 of the 8 rows of each step
    np.testing.assert_array_equal(np.concatenate(read, axis=1), starts)  # process 0 the first rows, 1 the rest
    for o in outputs:
        np.testing.assert_array_equal(np.asarray(o["global"]), np.asarray(whole))
