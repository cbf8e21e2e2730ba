"""train.prepare and what it runs (train.data.tokenize_corpus, shards, shard_format): prepared token shards
round-trip, split as load_corpus does, fail in one line."""

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from train.data import shard_format, text_chunks
from train.data.corpus import load_corpus
from train.data.errors import DataError
from train.data.shard_format import open_shard, read_header, write_shard
from train.data.shards import open_prepared
from train.data.tokenize_corpus import prepare
from train.prepare import main

ROOT = Path(__file__).resolve().parents[3]
WORDS = ["the", "king", "queen", "ROMEO:", "Juliet", "o'er", "thou'rt", "42", "1.5", "--", "é", "naïve", "?!"]


def make_text(n_lines: int = 120, seed: int = 0) -> str:
    """Lines of words with varied spacing: runs of spaces, blank lines, tabs, trailing blanks."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        words = [rng.choice(WORDS) for _ in range(rng.randint(0, 9))]
        sep = rng.choice([" ", " ", "  ", "\t"])
        lines.append(sep.join(words) + rng.choice(["", "", " ", "  "]))
    return "\n".join(lines) + "\n"


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8", newline="")
    return path


def hf_tokenizer_dir(path: Path, text: str) -> Path:
    """A directory with a tokenizer.json of a small byte-level BPE trained on `text`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=280, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path.mkdir(parents=True)
    (path / "tokenizer.json").write_text(tok.to_str(pretty=True), encoding="utf-8")
    return path


def call(capsys, *argv):
    try:
        code = main(list(argv))
    except SystemExit as stop:
        code = stop.code
    out, err = capsys.readouterr()
    return code, out, err


def test_char_streams_equal_load_corpus(tmp_path):
    text = make_text().replace("\n", "\r\n", 5)  # CRLF becomes LF in both readers
    file = write(tmp_path / "corpus.txt", text)
    manifest = prepare(file, "char", tmp_path / "out")
    corpus, prepared = load_corpus(file), open_prepared(tmp_path / "out")
    np.testing.assert_array_equal(prepared.stream("train"), corpus.train)
    np.testing.assert_array_equal(prepared.stream("val"), corpus.val)
    assert prepared.tokenizer == corpus.tokenizer and prepared.tokenizer_kind == "char"
    assert prepared.vocab_size == corpus.tokenizer.vocab_size
    assert all(s.dtype == np.uint16 and isinstance(s, np.memmap) for s in prepared.train + prepared.val)
    assert manifest["train"]["tokens"] == len(corpus.train) and manifest["dtype"] == "uint16"
    assert json.loads((tmp_path / "out" / "prepared.json").read_text())["tokenizer"]["hash"] == prepared.tokenizer_hash.hex()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "prepared.json", "tokenizer.json", "train_00000.bin", "val_00000.bin"]


def test_byte_round_trip(tmp_path):
    text = make_text() + "emoji 🙂 and ß\n"
    prepare(write(tmp_path / "c.txt", text), "byte", tmp_path / "out")
    prepared = open_prepared(tmp_path / "out")
    ids = np.concatenate([prepared.stream("train"), prepared.stream("val")])
    np.testing.assert_array_equal(ids, np.frombuffer(text.encode("utf-8"), np.uint8))
    assert prepared.vocab_size == 256 and prepared.tokenizer.decode(ids) == text


def test_bpe_round_trip_and_chunks_equal_encoding_the_whole_file(tmp_path, monkeypatch):
    monkeypatch.setattr(text_chunks, "CHUNK_CHARS", 64)  # many chunk cuts in a small file
    monkeypatch.setattr(text_chunks, "READ_BYTES", 50)
    text = make_text(300)
    manifest = prepare(write(tmp_path / "c.txt", text), "bpe:300", tmp_path / "out")
    prepared = open_prepared(tmp_path / "out")
    assert prepared.tokenizer_kind == "bpe" and 256 < prepared.vocab_size <= 300
    assert manifest["tokenizer"]["spec"] == "bpe:300"
    ids = np.concatenate([prepared.stream("train"), prepared.stream("val")])
    whole = prepared.tokenizer.encode(text)
    np.testing.assert_array_equal(ids, whole)
    assert len(ids) < len(text.encode()) and prepared.tokenizer.decode(ids) == text
    n_train = int(len(whole) * 0.9)
    assert prepared.train_tokens == n_train and prepared.val_tokens == len(whole) - n_train


def test_chunks_are_cut_only_where_gpt2_pre_tokenization_splits(tmp_path, monkeypatch):
    from tokenizers import pre_tokenizers
    monkeypatch.setattr(text_chunks, "CHUNK_CHARS", 40)
    monkeypatch.setattr(text_chunks, "READ_BYTES", 30)
    lines = make_text(300, seed=4).split("\n")  # every third line indented, every fifth with a trailing blank
    text = "\n".join(("  " if i % 3 == 1 else "") + line + (" " if i % 5 == 2 else "") for i, line in enumerate(lines))
    chunks = list(text_chunks.read_chunks(write(tmp_path / "c.txt", text)))
    assert len(chunks) > 20 and "".join(chunks) == text
    pieces = lambda t: [p for p, _ in pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str(t)]
    assert [p for c in chunks for p in pieces(c)] == pieces(text)


def test_hf_tokenizer_is_copied_and_used(tmp_path, monkeypatch):
    monkeypatch.setattr(text_chunks, "CHUNK_CHARS", 100)
    monkeypatch.setattr(text_chunks, "READ_BYTES", 64)
    text = make_text(200, seed=1)
    source = hf_tokenizer_dir(tmp_path / "tok", text)
    prepare(write(tmp_path / "c.txt", text), f"hf:{source}", tmp_path / "out")
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()
    prepared = open_prepared(tmp_path / "out")
    assert prepared.tokenizer_kind == "hf" and prepared.vocab_size == 280
    ids = np.concatenate([prepared.stream("train"), prepared.stream("val")])
    np.testing.assert_array_equal(ids, prepared.tokenizer.encode(text))
    assert prepared.tokenizer_hash == shard_format.tokenizer_hash((source / "tokenizer.json").read_text())


def test_an_hf_tokenizer_that_cannot_encode_the_corpus_is_one_line(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers
    words = Tokenizer(models.WordLevel({"to": 0, "be": 1}, unk_token=None))  # no unknown token
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text(words.to_str())
    code, out, err = call(capsys, "--data", str(write(tmp_path / "c.txt", "to be or not to be\n")), "--tokenizer",
                          f"hf:{tmp_path / 'tok'}", "--out", str(tmp_path / "out"))
    assert code == 1 and err.startswith(f"error: the hf tokenizer cannot encode {tmp_path / 'c.txt'}: ")
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


@pytest.mark.parametrize("vocab, dtype", [(1, np.uint16), (65536, np.uint16), (65537, np.uint32), (2 ** 20, np.uint32)])
def test_uint16_while_the_vocabulary_fits(tmp_path, vocab, dtype):
    tokens = np.array([0, vocab - 1, vocab // 2], np.int64)
    path = write_shard(tmp_path / "train_00000.bin", tokens, vocab, bytes(16))
    header = read_header(path)
    assert header.dtype == dtype and header.count == 3 and header.vocab_size == vocab
    assert path.stat().st_size == shard_format.HEADER_SIZE + 3 * np.dtype(dtype).itemsize
    np.testing.assert_array_equal(open_shard(path), tokens)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        write_shard(tmp_path / "x.bin", [vocab], vocab, bytes(16))


def test_sharding_concatenates_to_the_stream(tmp_path):
    file = write(tmp_path / "c.txt", make_text())
    prepare(file, "char", tmp_path / "one")
    manifest = prepare(file, "char", tmp_path / "many", shard_tokens=97)
    one, many = open_prepared(tmp_path / "one"), open_prepared(tmp_path / "many")
    assert len(many.train) > 3 and len(many.val) > 1 and len(manifest["train"]["shards"]) == len(many.train)
    assert all(len(s) == 97 for s in many.train[:-1] + many.val[:-1])
    for split in ("train", "val"):
        np.testing.assert_array_equal(many.stream(split), one.stream(split))


def test_a_directory_splits_each_file_and_reads_txt_in_name_order(tmp_path):
    a, b = make_text(50, seed=2), make_text(70, seed=3)
    write(tmp_path / "in" / "b.txt", b), write(tmp_path / "in" / "a.txt", a), write(tmp_path / "in" / "skip.md", "zzz")
    manifest = prepare(tmp_path / "in", "byte", tmp_path / "out", val_fraction=0.25)
    prepared = open_prepared(tmp_path / "out")
    ids = [np.frombuffer(t.encode(), np.uint8) for t in (a, b)]
    cut = [int(len(i) * 0.75) for i in ids]
    np.testing.assert_array_equal(prepared.stream("train"), np.concatenate([ids[0][:cut[0]], ids[1][:cut[1]]]))
    np.testing.assert_array_equal(prepared.stream("val"), np.concatenate([ids[0][cut[0]:], ids[1][cut[1]:]]))
    assert [s["file"] for s in manifest["sources"]] == ["a.txt", "b.txt"]


@pytest.fixture
def prepared_dir(tmp_path):
    prepare(write(tmp_path / "c.txt", make_text()), "char", tmp_path / "out", shard_tokens=500)
    return tmp_path / "out"


def test_a_truncated_shard_names_the_file_and_both_sizes(prepared_dir):
    shard = prepared_dir / "train_00001.bin"
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size - 3)
    with pytest.raises(DataError, match=rf"train_00001.bin is truncated: {size - 3} bytes.*needs {size} bytes"):
        open_prepared(prepared_dir)
    with pytest.raises(DataError, match="truncated"):
        open_shard(shard)


def test_another_tokenizers_shard_or_tokenizer_is_refused(prepared_dir):
    good = open_prepared(prepared_dir)
    with pytest.raises(DataError, match="made with another tokenizer"):
        open_prepared(prepared_dir, expected_tokenizer_hash=bytes(16))
    assert open_prepared(prepared_dir, expected_tokenizer_hash=good.tokenizer_hash.hex()).vocab_size == good.vocab_size
    val = prepared_dir / "val_00000.bin"
    write_shard(val, np.asarray(open_shard(val)), good.vocab_size, b"x" * 16)
    with pytest.raises(DataError, match="mixes tokenizers: val_00000.bin has tokenizer hash 7878"):
        open_prepared(prepared_dir)


def test_a_tokenizer_json_from_elsewhere_is_refused(prepared_dir):
    (prepared_dir / "tokenizer.json").write_text('{"kind": "char", "chars": "abc"}')
    with pytest.raises(DataError, match="written with another tokenizer"):
        open_prepared(prepared_dir)


def test_no_shards_or_a_gap_is_refused(tmp_path, prepared_dir):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="has no train shards"):
        open_prepared(tmp_path / "empty")
    with pytest.raises(DataError, match="is not a directory"):
        open_prepared(tmp_path / "nowhere")
    (prepared_dir / "train_00001.bin").unlink()
    with pytest.raises(DataError, match="train_00001.bin is missing"):
        open_prepared(prepared_dir)


def test_not_a_shard_and_a_wrong_count_are_refused(prepared_dir):
    (prepared_dir / "val_00001.bin").write_bytes(b"hello")
    with pytest.raises(DataError, match="val_00001.bin is not a token shard"):
        open_prepared(prepared_dir)
    (prepared_dir / "val_00001.bin").unlink()
    manifest = json.loads((prepared_dir / "prepared.json").read_text())
    manifest["val"]["tokens"] += 1
    (prepared_dir / "prepared.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match="val shards hold .* tokens, prepared.json says"):
        open_prepared(prepared_dir)


def test_an_empty_or_too_short_corpus_is_refused_and_out_is_left_alone(tmp_path):
    empty = write(tmp_path / "e.txt", "")
    with pytest.raises(DataError, match="empty corpus"):
        prepare(empty, "char", tmp_path / "out")
    write(tmp_path / "dir" / "a.txt", ""), write(tmp_path / "dir" / "b.txt", "")
    with pytest.raises(DataError, match="empty corpus"):
        prepare(tmp_path / "dir", "bpe:300", tmp_path / "out")
    with pytest.raises(DataError, match="too short"):
        prepare(write(tmp_path / "s.txt", "abc"), "char", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("tokenizer", ["char", "byte", "bpe:300"])
def test_text_that_is_not_utf8_names_the_file_and_byte(tmp_path, tokenizer):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"abc\n\xff def\n")
    with pytest.raises(DataError, match=r"bad.txt is not UTF-8 text \(near byte 4\)"):
        prepare(bad, tokenizer, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_cli_ends_in_one_line_with_its_exit_code(tmp_path, capsys):
    file = write(tmp_path / "c.txt", make_text())
    out = tmp_path / "out"
    for argv, code_, words in [
            (["--tokenizer", "bpe:12"], 2, "--tokenizer 'bpe:12': expected char, byte, bpe:VOCAB"),
            (["--tokenizer", "word"], 2, "expected char, byte"),
            (["--tokenizer", "char", "--val-fraction", "1.5"], 2, "--val-fraction must be in (0, 1)"),
            (["--tokenizer", "char", "--shard-tokens", "0"], 2, "--shard-tokens must be at least 1"),
            (["--tokenizer", f"hf:{tmp_path}"], 1, "tokenizer.json cannot be read")]:
        code, stdout, err = call(capsys, "--data", str(file), "--out", str(out), *argv)
        assert (code, stdout, err.count("\n")) == (code_, "", 1) and err.startswith("error: ") and words in err
    code, _, err = call(capsys, "--data", str(tmp_path / "missing.txt"), "--tokenizer", "char", "--out", str(out))
    assert code == 1 and "missing.txt does not exist" in err and err.count("\n") == 1
    code, _, err = call(capsys, "--data", str(write(tmp_path / "e.txt", "")), "--tokenizer", "char", "--out", str(out))
    assert code == 1 and "empty corpus" in err and err.count("\n") == 1
    code, stdout, err = call(capsys, "--data", str(file), "--tokenizer", "char", "--out", str(out))
    assert code == 0 and stdout.startswith(f"prepared {out}: tokenizer char") and err == ""
    write(out / "notes.md", "mine")
    code, _, err = call(capsys, "--data", str(file), "--tokenizer", "byte", "--out", str(out))
    assert code == 1 and "is not empty: pass --overwrite" in err and open_prepared(out).tokenizer_kind == "char"
    code, _, err = call(capsys, "--data", str(file), "--tokenizer", "byte", "--out", str(out), "--overwrite",
                        "--shard-tokens", "100000")
    assert code == 0 and open_prepared(out).tokenizer_kind == "byte" and (out / "notes.md").read_text() == "mine"
    assert sorted(p.name for p in out.iterdir()) == ["notes.md", "prepared.json", "tokenizer.json",
                                                     "train_00000.bin", "val_00000.bin"]


@pytest.mark.slow
def test_the_real_program_has_no_traceback(tmp_path):
    done = subprocess.run([sys.executable, "-m", "train.prepare", "--data", str(tmp_path / "none"),
                           "--tokenizer", "char", "--out", str(tmp_path / "o")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and done.stderr.startswith("error: ") and done.stderr.count("\n") == 1
