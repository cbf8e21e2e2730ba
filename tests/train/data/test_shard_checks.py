"""A prepared corpus is checked, not trusted: its manifest pins each shard's name, size and sha256, a run
verifies them (in full when it starts, the ends of each shard when it resumes), every window read is
checked against the vocabulary, and each failure is one line naming the shard. `train.prepare` cleans
up after itself when it was killed, reads text without newlines in chunks, and names what --data is."""

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from train import prepare as prepare_lib
from train import tiny_lm
from train.data import shard_format, staging, text_chunks, tokenize_corpus
from train.data.corpus import open_corpus
from train.data.errors import DataError
from train.data.shard_format import HEADER_SIZE, write_shard
from train.data.shards import open_prepared
from train.data.tokenize_corpus import prepare

ROOT = Path(__file__).resolve().parents[3]
TINY = ["model.d_model=16", "model.num_layers=1", "model.num_heads=2", "model.max_seq_len=16",
        "train.batch_size=4", "train.block_size=16", "train.eval_iters=2", "train.eval_interval=2",
        "train.log_interval=1", "train.warmup_iters=1", "train.lr_decay_iters=4", "train.sample_tokens=0",
        "train.plot=false", "train.steps_per_dispatch=2", "runtime.mesh=data:1", "runtime.attention=xla"]


def lines(n: int = 300, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    words = ["the", "king", "queen", "of", "night", "and", "day", "shall", "speak", "now"]
    return "\n".join(" ".join(rng.choice(words, 8)) for _ in range(n)) + "\n"


@pytest.fixture
def corpus(tmp_path):
    """A char corpus of several train shards of 2000 tokens (the last fewer) and one val shard."""
    (tmp_path / "c.txt").write_text(lines())
    prepare(tmp_path / "c.txt", "char", tmp_path / "prepared", shard_tokens=2000)
    return tmp_path / "prepared"


def body(path: Path) -> np.ndarray:
    return np.fromfile(path, np.uint16, offset=HEADER_SIZE)


def put_body(path: Path, ids: np.ndarray) -> None:
    """Writes `ids` over the body of the shard at `path`, in place (its header and size stay)."""
    with open(path, "r+b") as f:
        f.seek(HEADER_SIZE)
        f.write(np.asarray(ids, np.uint16).tobytes())


def as_old_manifest(directory: Path) -> None:
    """prepared.json as prepare wrote it before the checksums: each split names its shards only."""
    manifest = json.loads((directory / "prepared.json").read_text())
    manifest.pop("checksums", None)
    for split in ("train", "val"):
        manifest[split]["shards"] = [entry if isinstance(entry, str) else entry["name"]
                                     for entry in manifest[split]["shards"]]
    (directory / "prepared.json").write_text(json.dumps(manifest, indent=2))


def train(capsys, *argv: str) -> tuple[int, str]:
    """`python -m train.tiny_lm ARGV` in this process: (exit code, stderr)."""
    try:
        tiny_lm.main(list(argv))
        code = 0
    except SystemExit as stop:
        code = stop.code
    return code, capsys.readouterr().err


def call(capsys, *argv: str) -> tuple[int, str, str]:
    """`python -m train.prepare ARGV` in this process: (exit code, stdout, stderr)."""
    try:
        code = prepare_lib.main(list(argv))
    except SystemExit as stop:
        code = stop.code
    out, err = capsys.readouterr()
    return code, out, err


def one_error(err: str) -> str:
    """The one `error:` line of a program's stderr (asserting it is one line)."""
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


# ------------------------------------------------------------------------- the manifest pins each shard

def test_the_manifest_pins_each_shards_name_size_and_sha256(corpus):
    manifest = json.loads((corpus / "prepared.json").read_text())
    assert manifest["checksums"]["algorithm"] == "sha256" and len(manifest["train"]["shards"]) > 2
    for split in ("train", "val"):
        names = sorted(p.name for p in corpus.glob(f"{split}_*.bin"))
        assert [entry["name"] for entry in manifest[split]["shards"]] == names
        for entry in manifest[split]["shards"]:
            raw = (corpus / entry["name"]).read_bytes()
            assert entry["bytes"] == len(raw) and entry["tokens"] == (len(raw) - HEADER_SIZE) // 2
            assert entry["sha256"] == hashlib.sha256(raw[HEADER_SIZE:]).hexdigest()


def test_a_flipped_bit_is_one_line_naming_the_shard_before_anything_is_written(corpus, tmp_path, capsys):
    shard = corpus / "train_00001.bin"
    ids = body(shard)
    ids[1000] ^= 1  # still an id of the vocabulary: it would train, silently, on another text
    put_body(shard, ids)
    code, err = train(capsys, "--data", str(corpus), "--out-dir", str(tmp_path / "run"), "--set", *TINY,
                      "train.max_iters=2")
    line = one_error(err)
    assert code == 1 and line.startswith(f"error: shard {shard} is not the one prepared.json pins: the sha256 "
                                         "of its tokens is ")
    assert "prepare the corpus again: python -m train.prepare --data " in line
    assert not (tmp_path / "run").exists()


def test_a_body_of_0xff_is_named_not_blamed_on_the_learning_rate(corpus, tmp_path, capsys):
    shard = corpus / "train_00000.bin"
    put_body(shard, np.full(len(body(shard)), 0xFFFF))
    code, err = train(capsys, "--data", str(corpus), "--out-dir", str(tmp_path / "run"), "--set", *TINY,
                      "train.max_iters=2")
    assert code == 1 and one_error(err).startswith(f"error: shard {shard} is not the one prepared.json pins")
    assert "learning rate" not in err and "diverged" not in err


def test_every_window_read_is_checked_against_the_vocabulary(corpus):
    """Ids past the vocabulary that no checksum stands in front of (a shard changed after the run
    verified it, or a corpus prepared before the checksums) are found in the windows read."""
    opened = open_corpus(corpus)
    vocab = opened.tokenizer.vocab_size
    shard = corpus / "train_00002.bin"
    ids = body(shard)
    ids[7] = vocab + 3
    put_body(shard, ids)
    assert opened.train.read(0, 4000).max() < vocab  # the shards before it are as they were
    with pytest.raises(DataError, match=rf"^shard {shard} holds token id {vocab + 3} \(token 7 of the shard\), "
                                        rf"past its vocabulary of {vocab} ids: the shard is damaged"):
        opened.train.read(3990, 30)


def test_an_unverified_corpus_with_ids_past_the_vocabulary_stops_at_the_first_window(corpus, tmp_path, capsys):
    as_old_manifest(corpus)
    for shard in corpus.glob("train_*.bin"):  # every window the run reads holds ids past the vocabulary
        put_body(shard, np.full(len(body(shard)), 0xFFFF))
    code, err = train(capsys, "--data", str(corpus), "--out-dir", str(tmp_path / "run"), "--set", *TINY,
                      "train.max_iters=2")
    assert code == 1 and "warning: the prepared corpus" in err
    line = one_error(err)
    assert line.startswith("error: shard ") and "holds token id 65535" in line and "past its vocabulary" in line


# ------------------------------------------------------------------------- renamed, swapped, reordered

def swap(a: Path, b: Path) -> None:
    a.rename(a.with_name("swapping"))
    b.rename(a)
    a.with_name("swapping").rename(b)


def test_swapped_shards_are_named_as_swapped(corpus):
    swap(corpus / "train_00000.bin", corpus / "train_00001.bin")  # the same size: only their bytes differ
    with pytest.raises(DataError, match=r"prepared corpus .*: train_00000.bin holds what prepared.json says "
                                        r"train_00001.bin holds: its shards were renamed or swapped"):
        open_corpus(corpus)


def test_a_shard_of_another_size_is_refused_by_its_pinned_size(corpus):
    last = sorted(p.name for p in corpus.glob("train_*.bin"))[-1]
    swap(corpus / "train_00000.bin", corpus / last)  # and the counts of the split still add up
    with pytest.raises(DataError, match=rf"train_00000.bin holds what prepared.json says {last} holds"):
        open_prepared(corpus)


def test_a_shard_the_manifest_does_not_name_is_refused(corpus, tmp_path):
    val = corpus / "val_00000.bin"
    ids = body(val)
    write_shard(tmp_path / "val_00001.bin", ids[:5], open_prepared(corpus).vocab_size,
                open_prepared(corpus).tokenizer_hash)
    manifest = json.loads((corpus / "prepared.json").read_text())
    manifest["val"]["tokens"] += 5  # the counts agree: only the list of shards tells
    (corpus / "prepared.json").write_text(json.dumps(manifest))
    (tmp_path / "val_00001.bin").rename(corpus / "val_00001.bin")
    with pytest.raises(DataError, match=r"does not hold the val shards prepared.json names: val_00001.bin is not "
                                        r"one of the val shards it names \(val_00000.bin\)"):
        open_prepared(corpus)


def test_resuming_after_the_shards_were_reordered_in_place_is_refused(corpus, tmp_path, capsys):
    run = tmp_path / "run"
    code, _ = train(capsys, "--data", str(corpus), "--out-dir", str(run), "--set", *TINY, "train.max_iters=2")
    assert code == 0 and (run / "checkpoints").is_dir()
    saved = sorted(p.relative_to(run) for p in run.rglob("*"))
    swap(corpus / "train_00001.bin", corpus / "train_00002.bin")
    code, err = train(capsys, "--data", str(corpus), "--out-dir", str(run), "--resume", "--set", *TINY,
                      "train.max_iters=4")
    assert code == 1 and one_error(err).startswith(
        f"error: prepared corpus {corpus}: train_00001.bin holds what prepared.json says train_00002.bin holds")
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == saved  # nothing written, nothing set aside


def test_a_run_verifies_in_full_when_it_starts_and_the_ends_of_each_shard_when_it_resumes(monkeypatch):
    from train.data.corpus import ENV_VERIFY, verify_mode
    monkeypatch.delenv(ENV_VERIFY, raising=False)
    assert (verify_mode(resume=False), verify_mode(resume=True)) == ("full", "quick")
    for value in ("full", "quick"):
        monkeypatch.setenv(ENV_VERIFY, value)
        assert verify_mode(resume=False) == verify_mode(resume=True) == value


def test_the_quick_check_finds_a_swap_but_not_a_bit_in_the_middle(corpus, monkeypatch):
    monkeypatch.setattr(shard_format, "ENDS_BYTES", 64)  # the ends are 64 bytes: the middle of a shard is unread
    prepare(corpus.parent / "c.txt", "char", corpus, shard_tokens=2000, overwrite=True)
    shard = corpus / "train_00001.bin"
    ids = body(shard)
    ids[1000] ^= 1
    put_body(shard, ids)
    assert len(open_corpus(corpus, verify="quick").train) > 0
    with pytest.raises(DataError, match="train_00001.bin is not the one prepared.json pins"):
        open_corpus(corpus, verify="full")
    swap(corpus / "train_00000.bin", shard)
    with pytest.raises(DataError, match="train_00000.bin holds what prepared.json says train_00001.bin holds"):
        open_corpus(corpus, verify="quick")


def test_a_bad_verify_setting_is_a_usage_error(corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("JAXATTN_VERIFY_SHARDS", "fast")
    code, err = train(capsys, "--data", str(corpus), "--out-dir", str(tmp_path / "run"), "--set", *TINY,
                      "train.max_iters=2")
    assert code == 2 and one_error(err).startswith("error: JAXATTN_VERIFY_SHARDS='fast': expected full")


# ------------------------------------------------------------------------- the manifest against the headers

def test_a_manifest_whose_vocabulary_contradicts_the_headers_is_named_as_the_wrong_one(corpus):
    vocab = open_prepared(corpus).vocab_size
    manifest = json.loads((corpus / "prepared.json").read_text())
    manifest["tokenizer"]["vocab_size"] = vocab + 7
    (corpus / "prepared.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=rf"prepared.json is wrong: its tokenizer.vocab_size is {vocab + 7}, but "
                                        rf"tokenizer.json and every shard header say {vocab}"):
        open_prepared(corpus)


def test_a_manifest_whose_dtype_contradicts_the_headers_is_named_as_the_wrong_one(corpus):
    manifest = json.loads((corpus / "prepared.json").read_text())
    manifest["dtype"] = "uint32"
    (corpus / "prepared.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=r"prepared.json is wrong: its dtype is 'uint32', but every shard header "
                                        r"says uint16"):
        open_prepared(corpus)


def test_headers_whose_vocabulary_contradicts_the_manifest_and_tokenizer_are_named_as_the_wrong_ones(corpus):
    opened = open_prepared(corpus)
    for path in sorted(corpus.glob("*_*.bin")):
        write_shard(path, body(path), opened.vocab_size + 1, opened.tokenizer_hash)
    with pytest.raises(DataError, match=rf"have a vocabulary of {opened.vocab_size + 1}, tokenizer.json one of "
                                        rf"{opened.vocab_size}; prepared.json says {opened.vocab_size}: the shards' "
                                        "headers are the wrong ones"):
        open_prepared(corpus)


# ------------------------------------------------------------------------- prepared before the checksums

def test_a_corpus_prepared_before_the_checksums_trains_with_one_warning(corpus, tmp_path, capsys):
    as_old_manifest(corpus)
    code, err = train(capsys, "--data", str(corpus), "--out-dir", str(tmp_path / "run"), "--set", *TINY,
                      "train.max_iters=2")
    warnings = [line for line in err.splitlines() if "no shard checksums" in line]
    assert code == 0 and warnings == [
        f"warning: the prepared corpus {corpus} has no shard checksums (prepared.json was written by an older "
        "jaxattn): its shards are not verified, only the ids of the windows a run reads; to verify them, prepare "
        f"it again: python -m train.prepare --data {corpus.parent / 'c.txt'} --tokenizer char --out {corpus} "
        "--shard-tokens 2000 --overwrite"]


# ------------------------------------------------------------------------- prepare's own leftovers

def _killed_prepare(data: Path, out: Path, monkeypatch) -> Path:
    """A prepare into `out` stopped where SIGKILL would stop it: its temporary folder left behind."""
    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # with the clean-up below made a no-op: nothing runs after a SIGKILL

    with monkeypatch.context() as patch:
        patch.setattr(tokenize_corpus, "_split_file", killed)
        patch.setattr(tokenize_corpus.shutil, "rmtree", lambda *a, **k: None)
        with pytest.raises(KeyboardInterrupt):
            prepare(data, "char", out, overwrite=True)
    left = [p for p in out.iterdir() if p.name.startswith(".prepare-")]
    assert len(left) == 1
    return left[0]


def test_a_rerun_removes_the_temporary_folder_of_a_killed_prepare(tmp_path, capsys, monkeypatch):
    data, out = tmp_path / "c.txt", tmp_path / "out"
    data.write_text(lines(50))
    left = _killed_prepare(data, out, monkeypatch)
    assert sorted(p.name for p in out.iterdir()) == [left.name]  # --out holds only the temporary folder
    code, stdout, err = call(capsys, "--data", str(data), "--tokenizer", "char", "--out", str(out))
    assert code == 0 and stdout.startswith(f"prepared {out}")
    assert err == f"note: removed {left}, the temporary folder of a python -m train.prepare into {out} that was " \
                  "killed before it finished\n"
    assert sorted(p.name for p in out.iterdir()) == ["prepared.json", "tokenizer.json", "train_00000.bin",
                                                     "val_00000.bin"]


def test_overwrite_removes_a_killed_prepares_folder_and_keeps_the_users_files(tmp_path, capsys, monkeypatch):
    data, out = tmp_path / "c.txt", tmp_path / "out"
    data.write_text(lines(50))
    prepare(data, "char", out)
    (out / "notes.md").write_text("mine")
    left = _killed_prepare(data, out, monkeypatch)
    code, _, err = call(capsys, "--data", str(data), "--tokenizer", "byte", "--out", str(out))
    assert code == 1 and "is not empty: pass --overwrite" in one_error(err) and left.is_dir()  # refused: untouched
    code, _, err = call(capsys, "--data", str(data), "--tokenizer", "byte", "--out", str(out), "--overwrite")
    assert code == 0 and f"note: removed {left}," in err and not left.exists()
    assert sorted(p.name for p in out.iterdir()) == ["notes.md", "prepared.json", "tokenizer.json",
                                                     "train_00000.bin", "val_00000.bin"]


@pytest.mark.parametrize("what", ["no marker", "a file of the user's", "a marker of another program"])
def test_a_folder_prepare_did_not_make_is_never_removed(tmp_path, capsys, monkeypatch, what):
    data, out = tmp_path / "c.txt", tmp_path / "out"
    data.write_text(lines(50))
    if what == "no marker":
        (out / ".prepare-abcd1234").mkdir(parents=True)
        (out / ".prepare-abcd1234" / "tokenizer.json").write_text("{}")
        folder = out / ".prepare-abcd1234"
    else:
        folder = _killed_prepare(data, out, monkeypatch)
        if what == "a file of the user's":
            (folder / "draft.txt").write_text("mine")
        else:
            (folder / "PREPARING").write_text("something else's")
    code, _, err = call(capsys, "--data", str(data), "--tokenizer", "char", "--out", str(out))
    assert code == 1 and f"error: --out {out} is not empty" in one_error(err) and folder.is_dir()


def test_the_folder_of_a_prepare_still_running_is_not_a_leftover(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    folder, lock = staging.make_temp(out)  # as a running prepare holds it
    try:
        assert staging.leftover(folder) is False
    finally:
        staging.release(lock)
    held = staging.leftover(folder)
    assert held is not False
    staging.release(held)


@pytest.mark.slow
def test_a_prepare_killed_by_sigkill_leaves_nothing_a_rerun_refuses(tmp_path):
    data, out = tmp_path / "c.txt", tmp_path / "out"
    data.write_text(lines(50))
    kill = ("import os, signal, sys\nfrom train import prepare\nfrom train.data import tokenize_corpus\n"
            "tokenize_corpus._split_file = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)\n"
            "prepare.main(sys.argv[1:])\n")
    argv = ["--data", str(data), "--tokenizer", "char", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    killed = subprocess.run([sys.executable, "-c", kill, *argv], cwd=ROOT, env=env, capture_output=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL and [p.name[:9] for p in out.iterdir()] == [".prepare-"]
    again = subprocess.run([sys.executable, "-m", "train.prepare", *argv], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=120)
    assert again.returncode == 0 and again.stderr.startswith("note: removed "), again.stderr
    assert sorted(p.name for p in out.iterdir()) == ["prepared.json", "tokenizer.json", "train_00000.bin",
                                                     "val_00000.bin"]


# ------------------------------------------------------------------------- reading text and naming --data

def test_text_without_newlines_is_encoded_in_chunks_with_the_ids_of_the_whole(tmp_path, monkeypatch):
    from tokenizers import pre_tokenizers
    monkeypatch.setattr(text_chunks, "CHUNK_CHARS", 64)
    monkeypatch.setattr(text_chunks, "READ_BYTES", 50)
    text = lines(100, seed=5).replace("\n", " ").replace("king and", "king\tand").replace("of the", "of  the")
    file = tmp_path / "one_line.txt"
    file.write_text(text)
    chunks = list(text_chunks.read_chunks(file))
    assert "".join(chunks) == text and len(chunks) > 40 and max(map(len, chunks)) <= 128
    pieces = lambda t: [p for p, _ in pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str(t)]
    assert [p for c in chunks for p in pieces(c)] == pieces(text)
    prepare(file, "bpe:300", tmp_path / "out")
    prepared = open_prepared(tmp_path / "out")
    np.testing.assert_array_equal(np.concatenate([prepared.stream("train"), prepared.stream("val")]),
                                  prepared.tokenizer.encode(text))


def test_text_without_any_whitespace_is_cut_where_a_chunk_is_full(tmp_path, monkeypatch):
    monkeypatch.setattr(text_chunks, "CHUNK_CHARS", 64)
    monkeypatch.setattr(text_chunks, "READ_BYTES", 50)
    file = tmp_path / "word.txt"
    file.write_text("abcdefghij" * 300)
    chunks = list(text_chunks.read_chunks(file))
    assert "".join(chunks) == "abcdefghij" * 300 and max(map(len, chunks)) == 128


def test_data_that_is_a_device_or_a_pipe_is_named_as_what_it_is(tmp_path, capsys):
    code, out, err = call(capsys, "--data", os.devnull, "--tokenizer", "char", "--out", str(tmp_path / "o"))
    assert (code, out, err) == (1, "", f"error: --data {os.devnull} is a character device, not a text file or a "
                                       "directory\n")
    os.mkfifo(tmp_path / "pipe")
    code, out, err = call(capsys, "--data", str(tmp_path / "pipe"), "--tokenizer", "char", "--out", str(tmp_path / "o"))
    assert (code, err) == (1, f"error: --data {tmp_path / 'pipe'} is a named pipe (FIFO), not a text file or a "
                              "directory\n")
    assert not (tmp_path / "o").exists()
