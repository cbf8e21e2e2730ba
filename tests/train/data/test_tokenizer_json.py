"""`train.data.tokenizer.JSONTokenizer`: a prepared corpus's BPE or Hugging Face tokenizer.json as a run's tokenizer.

The tokenizers are made here: a byte-level BPE trained by `train.prepare` on a small text
(`bpe:300`), and a word-level one without an unknown token (kind hf) that cannot encode every
text. They go where a run's tokenizer goes: a prepared directory, a checkpoint's meta, the
--resume check, an export read back by transformers, and `train.sample --random-init --data DIR`.
"""

import json
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.model import DecoderLM
from train import export, sample
from train.checkpoints.meta import check_tokenizer
from train.checkpoints.store import Checkpointer, CheckpointError
from train.cli import UsageError
from train.config import load_config
from train.data import shard_format, shards
from train.data.tokenizer import (
    ByteTokenizer,
    CharTokenizer,
    JSONTokenizer,
    from_dict,
    from_json,
    to_hf_tokenizer,
    to_json,
)
from train.models import pretrained
from train.models.fresh import random_init
from train.models.runs import load_for_sampling
from train.data.tokenize_corpus import prepare

pytest.importorskip("tokenizers")

LINES = ["ROMEO: But soft, what light through yonder window breaks?", "JULIET: Ay me!",
         "  Thou art the sun, and I the moon; naïve café 1.5 --", "\tthe king, the queen, the king's men"]
TEXT = "\n".join(f"{LINES[i % 4]} {i}" for i in range(60)) + "\n"
TINY = ["model.d_model=16", "model.num_layers=1", "model.num_heads=2", "model.max_seq_len=16", "train.block_size=16"]
WORDS = {"to": 0, "be": 1, "or": 2, "not": 3}


def _prepared(tmp: Path, spec: str, text: str = TEXT) -> Path:
    (tmp / "corpus.txt").write_text(text, encoding="utf-8")
    prepare(tmp / "corpus.txt", spec, tmp / "out")
    return tmp / "out"


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory) -> Path:
    return _prepared(tmp_path_factory.mktemp("bpe"), "bpe:300")


@pytest.fixture(scope="module")
def bpe(bpe_dir) -> JSONTokenizer:
    return shards.open_prepared(bpe_dir).tokenizer


@pytest.fixture(scope="module")
def other_bpe(tmp_path_factory) -> JSONTokenizer:
    """A BPE of another vocabulary, trained on the same text."""
    return shards.open_prepared(_prepared(tmp_path_factory.mktemp("bpe280"), "bpe:280")).tokenizer


def word_level_json() -> str:
    """A word-level tokenizer.json without an unknown token: a word outside WORDS cannot be encoded."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    hf = Tokenizer(models.WordLevel(WORDS, unk_token=None))
    hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # no decoder: decoding joins the words with spaces
    return hf.to_str()


def test_a_prepared_bpe_corpus_gives_a_json_tokenizer_that_round_trips(bpe_dir, bpe):
    prepared = shards.open_prepared(bpe_dir)
    assert isinstance(bpe, JSONTokenizer) and bpe.kind == prepared.tokenizer_kind == "bpe"
    assert bpe.vocab_size == prepared.vocab_size == prepared.manifest["tokenizer"]["vocab_size"]
    assert 256 < bpe.vocab_size <= 300 and bpe.eos_token_id is None
    assert bpe.json == (bpe_dir / "tokenizer.json").read_text(encoding="utf-8")
    ids = bpe.encode(TEXT)
    assert ids.dtype == np.int32 and ids.ndim == 1 and len(ids) < len(TEXT.encode("utf-8"))  # merges happened
    np.testing.assert_array_equal(ids, np.concatenate([prepared.stream("train"), prepared.stream("val")]))
    for form in (ids, ids.tolist(), jnp.asarray(ids)):
        assert bpe.decode(form) == TEXT
    unseen = "Zwölf Boxkämpfer jagen Viktor 漢字 🙂\r\n"  # not in the corpus: byte-level still encodes it
    assert bpe.decode(bpe.encode(unseen)) == unseen
    assert bpe.encode("").shape == (0,) and bpe.decode([]) == ""


def test_to_dict_from_dict_and_equality(bpe, other_bpe):
    values = bpe.to_dict()
    assert values == {"kind": "bpe", "tokenizer_json": bpe.json}
    assert from_dict(values) == bpe and from_json(to_json(bpe)) == bpe
    np.testing.assert_array_equal(from_dict(json.loads(json.dumps(values))).encode(TEXT), bpe.encode(TEXT))
    reindented = json.dumps(json.loads(bpe.json), indent=4, sort_keys=False)
    assert reindented != bpe.json and JSONTokenizer("bpe", reindented) == bpe  # the same JSON, other spacing
    assert other_bpe.vocab_size != bpe.vocab_size and other_bpe != bpe
    assert JSONTokenizer("hf", bpe.json) != bpe  # same file, other kind
    assert bpe != CharTokenizer("abc") and bpe != ByteTokenizer() and CharTokenizer("abc") != bpe


def test_bad_arguments_are_one_clear_error(bpe):
    with pytest.raises(ValueError, match=r"kind must be one of \('bpe', 'hf'\), got 'char'"):
        JSONTokenizer("char", bpe.json)
    with pytest.raises(ValueError, match="tokenizer_json is not a tokenizer.json the tokenizers library reads"):
        JSONTokenizer("bpe", '{"kind": "char", "chars": "abc"}')
    with pytest.raises(TypeError, match="tokenizer_json must be the text of a tokenizer.json, got dict"):
        JSONTokenizer("bpe", json.loads(bpe.json))
    with pytest.raises(ValueError, match=r"a hf tokenizer needs its tokenizer.json text under 'tokenizer_json'"):
        from_dict({"kind": "hf"})
    with pytest.raises(TypeError, match="text must be a str, got bytes"):
        bpe.encode(b"abc")
    with pytest.raises(ValueError, match=rf"token ids must be in \[0, {bpe.vocab_size}\), got 3..{bpe.vocab_size}"):
        bpe.decode([3, bpe.vocab_size])
    with pytest.raises(ValueError, match=r"ids must be a 1-D sequence of integers, got int64 of shape \(1, 2\)"):
        bpe.decode(np.array([[1, 2]]))


def test_a_text_an_hf_tokenizer_cannot_encode_names_the_pieces(tmp_path):
    directory = tmp_path / "words"
    directory.mkdir()
    (directory / "tokenizer.json").write_text(word_level_json(), encoding="utf-8")
    prepared = shards.open_prepared(_prepared(tmp_path, f"hf:{directory}", "to be or not to be\n" * 20))
    tok = prepared.tokenizer
    assert isinstance(tok, JSONTokenizer) and tok.kind == "hf" and tok.vocab_size == len(WORDS)
    np.testing.assert_array_equal(tok.encode("to be\nnot"), [0, 1, 3])
    assert tok.decode([0, 1, 3]) == "to be not"
    with pytest.raises(ValueError, match=r"this hf tokenizer cannot encode the text: \['die', 'now'\] are not in "
                                         r"its vocabulary of 4 ids; .*Missing \[UNK\] token"):
        tok.encode("to be or die now or die")


def test_check_tokenizer_refuses_another_bpe_naming_its_size_and_hash(bpe, other_bpe):
    meta = {"tokenizer": bpe.to_dict(), "config": {"train": {"data_path": "data/bpe"}}}
    check_tokenizer(meta, from_dict(bpe.to_dict()), "data/bpe")  # the same tokenizer: nothing raised
    then, now = shard_format.tokenizer_hash(bpe.json).hex(), shard_format.tokenizer_hash(other_bpe.json).hex()
    assert then != now and len(then) == 32
    with pytest.raises(CheckpointError) as err:
        check_tokenizer(meta, other_bpe, "data/bpe280")
    assert str(err.value) == (
        f"--resume: the corpus data/bpe280 does not give the run's tokenizer: it is another bpe tokenizer "
        f"({bpe.vocab_size} ids then, {other_bpe.vocab_size} now; hash (prepared.json's tokenizer.hash) {then} "
        f"then, {now} now), so every token id would mean something else. Resume with the run's corpus "
        "(data/bpe), or start a new run in another --out-dir")
    with pytest.raises(CheckpointError, match="it is a char tokenizer and the run's is a bpe tokenizer"):
        check_tokenizer(meta, CharTokenizer("abc"), "chars.txt")


def test_to_hf_tokenizer_gives_the_same_ids_and_text(bpe):
    hf = to_hf_tokenizer(bpe)
    assert hf.encode(TEXT, add_special_tokens=False).ids == bpe.encode(TEXT).tolist()
    assert hf.decode(bpe.encode(TEXT).tolist()) == TEXT
    assert hf.get_vocab_size(with_added_tokens=True) == bpe.vocab_size
    assert to_hf_tokenizer(bpe) is not hf  # a fresh object each call: the tokenizer's own stays untouched


def _params(config, seed=0) -> dict:
    """Random params of `DecoderLM(config)` in numpy (nothing compiles), norm scales around 1."""
    shapes = jax.eval_shape(lambda: DecoderLM(config).init(jax.random.PRNGKey(0), jnp.zeros((1, 2), jnp.int32)))
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map_with_path(
        lambda path, x: (rng.normal(0.0, 0.3, x.shape) + (path[-1].key == "scale")).astype(np.float32),
        nn.unbox(shapes["params"]))


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory, bpe):
    """A run directory whose best checkpoint carries the BPE tokenizer (saved as training saves it)."""
    run_dir = tmp_path_factory.mktemp("run")
    config = load_config(overrides=[*TINY, f"model.vocab_size={bpe.vocab_size}"])
    checkpointer = Checkpointer(run_dir)
    checkpointer.save("best", 1, {"params": _params(config.model), "step": jnp.int32(1)}, config=config,
                      tokenizer=bpe, val_loss=2.0, best_val_loss=2.0)
    checkpointer.close()
    return run_dir


def test_a_checkpoint_carries_the_json_tokenizer(bpe_run, bpe, other_bpe):
    params, config, tokenizer = load_for_sampling(bpe_run)
    assert isinstance(tokenizer, JSONTokenizer) and tokenizer == bpe and tokenizer.json == bpe.json
    assert config.vocab_size == bpe.vocab_size and params["wte"]["embedding"].shape[0] == bpe.vocab_size
    checkpointer = Checkpointer(bpe_run)
    try:
        with pytest.raises(CheckpointError, match="it is another bpe tokenizer"):
            checkpointer.restore("best", None, check=lambda meta: check_tokenizer(meta, other_bpe, "other"))
        _, meta = checkpointer.restore("best", None, check=lambda meta: check_tokenizer(meta, bpe, "same"))
    finally:
        checkpointer.close()
    assert meta["tokenizer"] == bpe.to_dict()


def test_an_export_writes_the_tokenizer_json_transformers_and_sample_read(bpe_run, bpe, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "hf"
    saved = export.export(bpe_run, out)
    assert out / "tokenizer.json" in saved.written
    ids = bpe.encode(TEXT).tolist()
    for loaded in (transformers.AutoTokenizer.from_pretrained(out),
                   transformers.PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"))):
        assert loaded(TEXT, add_special_tokens=False)["input_ids"] == ids
        assert loaded.decode(ids) == TEXT
    _, config, tokenizer = pretrained.load_hf(out)
    assert config.vocab_size == bpe.vocab_size and tokenizer.encode(TEXT, add_special_tokens=False) == ids
    code = sample.main(["--hf", str(out), "--prompt", "ROMEO:", "--max-new-tokens", "3", "--temperature", "0"])
    printed, report = capsys.readouterr()
    assert code == 0 and printed.startswith("ROMEO:") and "decode: 3 tokens (1 x 3)" in report, report


def test_random_init_takes_the_tokenizer_of_a_prepared_directory(bpe_dir, bpe, tmp_path, capsys):
    config = tmp_path / "tiny.toml"
    config.write_text(f"[model]\nvocab_size = {bpe.vocab_size}\nd_model = 16\nnum_layers = 1\nnum_heads = 2\n"
                      "max_seq_len = 16\n\n[train]\nblock_size = 16\n")
    params, model, tokenizer = random_init(str(config), seed=1, data=str(bpe_dir))
    assert isinstance(tokenizer, JSONTokenizer) and tokenizer == bpe
    assert model.vocab_size == bpe.vocab_size and nn.unbox(params)["wte"]["embedding"].shape == (bpe.vocab_size, 16)
    code = sample.main(["--random-init", str(config), "--data", str(bpe_dir), "--prompt", "JULIET:",
                        "--max-new-tokens", "2"])
    out, err = capsys.readouterr()
    assert code == 0 and out.startswith("JULIET:") and "Traceback" not in err, err
    config.write_text(config.read_text().replace(f"vocab_size = {bpe.vocab_size}", "vocab_size = 65"))
    with pytest.raises(UsageError, match=rf"has vocab_size 65, but the tokenizer of the prepared corpus --data "
                                         rf"{bpe_dir} has {bpe.vocab_size} ids"):
        random_init(str(config), data=str(bpe_dir))
