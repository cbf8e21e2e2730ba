"""`python -m train.export` and the `--hf` inputs of train.sample and train.attention_maps.

A run is a checkpoint saved in-process (as training saves it) of the default model, scaled
down, with random weights throughout, no scale 1 and no bias 0 (a swapped or transposed
tensor would show); it is exported once and reloaded by transformers and here.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from programs import CHARS, call
from safetensors.numpy import load_file, save_file

from jaxattn.config import ModelConfig
from jaxattn.model import DecoderLM
from train import attention_maps, export, sample
from train.checkpoints.store import Checkpointer
from train.config import ExperimentConfig, TrainConfig, load_config
from train.data.tokenizer import ByteTokenizer, CharTokenizer, to_hf_tokenizer

ROOT = Path(__file__).resolve().parents[2]
TEXT = "ROMEO:\nBut soft, what light through yonder window breaks?\n\nJULIET:  Ay me! 'Tis 3 o'clock; -$&.\n"
TINY = ["model.d_model=32", "model.num_layers=2", "model.num_heads=2", "model.max_seq_len=16",
        "train.block_size=16"]


def random_params(config: ModelConfig, seed: int = 0) -> dict:
    """Params of `DecoderLM(config)` drawn around 0 (norm scales around 1), in numpy: nothing compiles."""
    shapes = jax.eval_shape(lambda: DecoderLM(config).init(jax.random.PRNGKey(0), jnp.zeros((1, 2), jnp.int32)))
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map_with_path(
        lambda path, x: (rng.normal(0.0, 0.3, x.shape) + (path[-1].key == "scale")).astype(np.float32),
        nn.unbox(shapes["params"]))


def save_run(run_dir: Path, config: ExperimentConfig, tokenizer) -> dict:
    """A checkpoint of `random_params`, saved as training saves it; returns the params."""
    params = random_params(config.model)
    checkpointer = Checkpointer(run_dir)
    checkpointer.save("best", 1, {"params": params, "step": jnp.int32(1)}, config=config, tokenizer=tokenizer,
                      val_loss=2.0, best_val_loss=2.0)
    checkpointer.close()
    return params


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(run dir, model config, params) of the default model (RoPE, LayerNorm, GELU, tied), scaled down."""
    run_dir = tmp_path_factory.mktemp("run")
    config = load_config(overrides=TINY)
    return run_dir, config.model, save_run(run_dir, config, CharTokenizer(CHARS))


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "hf"
    assert export.main(["--checkpoint", str(run[0]), "--out", str(out)]) == 0
    return out


def test_the_char_tokenizer_round_trips_through_tokenizers():
    ours = CharTokenizer(CHARS)
    theirs = to_hf_tokenizer(ours)
    text = CHARS + TEXT + "  \n\n "
    assert theirs.encode(text).ids == ours.encode(text).tolist()
    assert theirs.decode(ours.encode(text).tolist()) == text
    with pytest.raises(Exception, match="UNK"):  # an unknown character is an error, as with CharTokenizer
        theirs.encode("héllo")


def test_the_byte_tokenizer_round_trips_through_tokenizers():
    ours, text = ByteTokenizer(), TEXT + "héllo wörld 日本 🙂\t"
    theirs = to_hf_tokenizer(ours)
    assert theirs.encode(text).ids == ours.encode(text).tolist() == list(text.encode())
    assert theirs.decode(list(text.encode())) == text
    assert theirs.decode(list(range(256))) == ours.decode(np.arange(256))  # broken UTF-8 replaced alike


def test_export_reports_what_it_wrote(run, tmp_path, capsys):
    code, out, err = call(capsys, export.main, "--checkpoint", str(run[0]), "--out", str(tmp_path / "hf"))
    assert code == 0, err
    assert f"wrote {tmp_path / 'hf'} as GPTNeoXForCausalLM:" in out
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json"):
        assert f"  {name}  (" in out
    assert "AutoModelForCausalLM.from_pretrained(" in out and "python -m train.sample --hf" in out
    assert "replaced" not in out


def test_transformers_loads_the_export_with_the_same_logits_and_ids(run, exported):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    _, config, params = run
    ids = CharTokenizer(CHARS).encode(TEXT[:config.max_seq_len])
    ours = np.asarray(jax.jit(DecoderLM(config).apply)({"params": params}, jnp.asarray(ids)[None]))
    model = AutoModelForCausalLM.from_pretrained(exported).eval()
    with torch.no_grad():
        theirs = model(torch.tensor(ids[None].astype(np.int64))).logits.numpy()
    assert np.abs(theirs - ours).max() <= 1e-4
    for tokenizer in (PreTrainedTokenizerFast(tokenizer_file=str(exported / "tokenizer.json")),
                      AutoTokenizer.from_pretrained(exported)):
        assert tokenizer(TEXT)["input_ids"] == CharTokenizer(CHARS).encode(TEXT).tolist()
        assert tokenizer.decode(CharTokenizer(CHARS).encode(TEXT)) == TEXT


@pytest.mark.parametrize("knobs", [["--temperature", "0"], ["--temperature", "0.8", "--top-k", "20", "--seed", "7"]])
def test_sampling_the_export_gives_the_text_of_the_run(run, exported, capsys, knobs):
    argv = ["--prompt", "ROMEO:", "--max-new-tokens", "9", "--num-samples", "2", *knobs]  # one window: one compile
    code, from_run, err = call(capsys, sample.main, "--checkpoint", str(run[0]), *argv)
    assert code == 0, err
    code, from_hf, err = call(capsys, sample.main, "--hf", str(exported), *argv)
    assert code == 0, err
    assert from_hf == from_run and from_hf.startswith("ROMEO:")


def test_sampling_stops_at_the_end_of_sequence_token(exported, tmp_path, capsys):
    assert sample.until_eos(np.array([5, 3, 0, 3, 0]), 0).tolist() == [5, 3]
    assert sample.until_eos(np.array([5, 3]), 0).tolist() == [5, 3]
    assert sample.until_eos(np.array([5, 0]), None).tolist() == [5, 0]
    argv = ["--prompt", "ROMEO:", "--max-new-tokens", "9", "--num-samples", "2", "--temperature", "0"]
    _, full, _ = call(capsys, sample.main, "--hf", str(exported), *argv)
    continuation = full.split("\n---------------\n")[0][len("ROMEO:"):]
    eos = continuation[2]  # a character the greedy continuation draws third: made the end of sequence
    stopping = tmp_path / "eos"
    shutil.copytree(exported, stopping)
    (stopping / "generation_config.json").write_text(f'{{"eos_token_id": {CHARS.index(eos)}}}')
    code, out, err = call(capsys, sample.main, "--hf", str(stopping), *argv)
    assert code == 0, err
    assert out.split("\n---------------\n")[0] == "ROMEO:" + continuation[:continuation.index(eos)]


def test_attention_maps_of_the_export(exported, tmp_path, capsys):
    png = tmp_path / "maps.png"
    code, out, err = call(capsys, attention_maps.main, "--hf", str(exported), "--text", "ROMEO:", "--out", str(png))
    assert code == png, err
    assert png.stat().st_size > 0 and f"wrote {png}" in out


def test_a_byte_level_run_exports_with_byte_ids(tmp_path):
    from transformers import AutoTokenizer
    config = ModelConfig(vocab_size=256, d_model=16, num_layers=1, num_heads=2, max_seq_len=16, positions="learned")
    save_run(tmp_path / "run", ExperimentConfig(name="bytes", model=config, train=TrainConfig(block_size=16)),
             ByteTokenizer())
    assert export.export(tmp_path / "run", tmp_path / "hf").architecture == "GPT2LMHeadModel"
    text = "héllo 日本\n"
    assert AutoTokenizer.from_pretrained(tmp_path / "hf")(text)["input_ids"] == list(text.encode())


def test_export_never_replaces_a_directory_without_overwrite(run, tmp_path, capsys):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    code, stdout, err = call(capsys, export.main, "--checkpoint", str(run[0]), "--out", str(out))
    assert code == 1 and stdout == "" and err.startswith("error: ") and err.count("\n") == 1
    assert "--overwrite" in err and [p.name for p in out.iterdir()] == ["notes.txt"]
    code, _, err = call(capsys, export.main, "--checkpoint", str(run[0]), "--out", str(out), "--overwrite")
    assert code == 0, err
    assert (out / "model.safetensors").is_file()
    code, _, err = call(capsys, export.main, "--checkpoint", str(run[0]), "--out", str(run[0]), "--overwrite")
    assert code == 1 and "holds the checkpoint being exported" in err


def _older_sharded_save(directory: Path, source: Path) -> list[str]:
    """An older save's index and two shards (the source's weights split) in `directory`; returns the shard names."""
    tensors = load_file(source / "model.safetensors")
    names = sorted(tensors)
    weight_map = {name: f"model-0000{1 + i % 2}-of-00002.safetensors" for i, name in enumerate(names)}
    for shard in set(weight_map.values()):
        save_file({n: tensors[n] for n in names if weight_map[n] == shard}, directory / shard)
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return sorted(set(weight_map.values()))


def test_overwrite_replaces_only_the_files_of_an_export(run, exported, tmp_path, capsys):
    out = tmp_path / "hf"
    shutil.copytree(exported, out)
    shards = _older_sharded_save(out, exported)
    mine = {"adapter_model.safetensors": b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ", "notes.txt": b"mine"}
    for name, content in mine.items():
        (out / name).write_bytes(content)
    code, stdout, err = call(capsys, export.main, "--checkpoint", str(run[0]), "--out", str(out), "--overwrite")
    assert code == 0, err
    assert {name: (out / name).read_bytes() for name in mine} == mine  # the user's, byte for byte
    assert not any((out / name).exists() for name in [*shards, "model.safetensors.index.json"])
    written = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    listed = [line.split()[0] for line in stdout.splitlines() if line.startswith("  ") and line.endswith("bytes)")]
    assert listed == written and sorted(p.name for p in out.iterdir()) == sorted(written + list(mine))
    replaced = next(line for line in stdout.splitlines() if line.startswith("replaced: "))
    assert all(name in replaced for name in [*shards, "model.safetensors.index.json", *written])
    assert not any(name in replaced for name in mine)


def test_export_checks_its_arguments_and_out_before_reading_the_checkpoint(tmp_path, capsys):
    code, out, err = call(capsys, export.main, "--checkpoint", str(tmp_path))
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("error: ") and "--out" in err and "see python -m train.export --help" in err
    (tmp_path / "a_file").write_text("")
    code, _, err = call(capsys, export.main, "--checkpoint", str(tmp_path / "nowhere"),
                        "--out", str(tmp_path / "a_file" / "hf"))
    assert code == 1 and err.count("\n") == 1 and err.startswith("error: --out ") and "a_file" in err


def _damage_config(**changes):
    def damage(directory: Path) -> None:
        config = json.loads((directory / "config.json").read_text()) | changes
        (directory / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v != "DELETE"}))
    return damage


def _replace_tensor(name: str, edit):
    def damage(directory: Path) -> None:
        tensors = load_file(directory / "model.safetensors")
        save_file(tensors | {name: edit(tensors[name])}, directory / "model.safetensors", metadata={"format": "pt"})
    return damage


def _with_nan(array: np.ndarray) -> np.ndarray:
    array = array.copy()
    array[1, :3] = np.nan
    return array


def _index_without_its_shards(directory: Path) -> None:
    for shard in _older_sharded_save(directory, directory):
        (directory / shard).unlink()
    (directory / "model.safetensors").unlink()


EMBED, FINAL_NORM = "gpt_neox.embed_in.weight", "gpt_neox.final_layer_norm.weight"
DAMAGED = {  # a damaged copy of the export: (damage, words the one line must hold)
    "a config key missing": (_damage_config(hidden_size="DELETE"), ["config.json: hidden_size: is missing"]),
    "a config value of the wrong type": (_damage_config(num_hidden_layers="2"),
                                         ['config.json: num_hidden_layers: expected a positive integer, got "2"']),
    "config.json not JSON": (lambda d: (d / "config.json").write_text("{"), ["config.json: is not JSON"]),
    "an empty safetensors file": (lambda d: (d / "model.safetensors").write_bytes(b""),
                                  ["model.safetensors: is empty"]),
    "a truncated safetensors file": (lambda d: (d / "model.safetensors").write_bytes(
        (d / "model.safetensors").read_bytes()[:-100]), ["model.safetensors: ", "run past the end"]),
    "an int32 tensor": (_replace_tensor(FINAL_NORM, lambda a: a.astype(np.int32)),
                        [f"model.safetensors: {FINAL_NORM}: is I32, a dtype that cannot hold weights"]),
    "a NaN tensor": (_replace_tensor(EMBED, _with_nan), [f"model.safetensors: {EMBED}: 3 of ", "(3 NaN, 0 infinite)",
                                                         "--allow-nonfinite loads them"]),
    "a corrupt tokenizer.json": (lambda d: (d / "tokenizer.json").write_text('{"model": 3}'),
                                 ["tokenizer.json: is not a tokenizer the tokenizers library reads"]),
    "an index naming missing shards": (_index_without_its_shards,
                                       ["model.safetensors.index.json: ", "which does not exist"]),
}


@pytest.mark.parametrize("name", list(DAMAGED))
def test_a_damaged_hf_directory_ends_in_one_line_naming_the_file(exported, tmp_path, capsys, name):
    damage, words = DAMAGED[name]
    broken = tmp_path / "broken"
    shutil.copytree(exported, broken)
    damage(broken)
    for main, argv in ((sample.main, ["--prompt", "A"]), (attention_maps.main, ["--out", str(tmp_path / "m.png")])):
        code, out, err = call(capsys, main, "--hf", str(broken), *argv)
        assert code == 1 and out == "" and err.count("\n") == 1, (code, out, err)
        assert err.startswith(f"error: cannot load {broken}/") and all(w in err for w in words), err
    assert not (tmp_path / "m.png").exists()


def test_allow_nonfinite_loads_a_checkpoint_holding_nan_and_sampling_says_where_it_shows(exported, tmp_path, capsys):
    broken = tmp_path / "nan"
    shutil.copytree(exported, broken)
    _replace_tensor(EMBED, _with_nan)(broken)
    argv = ["--prompt", "ROMEO:", "--max-new-tokens", "9", "--num-samples", "2", "--temperature", "0"]
    code, out, err = call(capsys, sample.main, "--hf", str(broken), "--allow-nonfinite", *argv)
    # Loaded; the embeddings are tied, so token 1's logit is NaN at every step: nothing can be drawn.
    assert code == 1 and out == "", err
    assert err.splitlines()[-1] == (
        "error: the logits that new token 1 of sample 1 would be drawn from are not finite (NaN or infinity): "
        "they first appear in the output layer, at logits; the weights holding NaN or infinity: wte/embedding "
        "(3 values)")


def test_a_model_with_no_transformers_counterpart_is_refused_before_writing(tmp_path, capsys):
    config = ModelConfig(vocab_size=65, d_model=16, num_layers=1, num_heads=2, max_seq_len=16, positions="sinusoidal")
    save_run(tmp_path / "run", ExperimentConfig(name="sin", model=config, train=TrainConfig(block_size=16)),
             CharTokenizer(CHARS))
    code, _, err = call(capsys, export.main, "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "hf"))
    assert code == 1 and err.startswith("error: cannot export") and err.count("\n") == 1
    assert "positions='sinusoidal' has no transformers counterpart" in err
    assert not (tmp_path / "hf").exists() or not any((tmp_path / "hf").iterdir())


def test_errors_of_the_hf_inputs(exported, tmp_path, capsys):
    code, _, err = call(capsys, export.main, "--checkpoint", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x"))
    assert code == 1 and "does not exist" in err and not (tmp_path / "x").exists()
    bare = tmp_path / "bare"
    shutil.copytree(exported, bare)
    (bare / "tokenizer.json").unlink()
    code, out, err = call(capsys, sample.main, "--hf", str(bare), "--prompt", "A")
    assert code == 1 and out == "" and err.startswith("error: ") and "has no tokenizer.json" in err
    code, _, err = call(capsys, attention_maps.main, "--hf", str(bare), "--out", str(tmp_path / "m.png"))
    assert code == 1 and "has no tokenizer.json" in err
    code, _, err = call(capsys, sample.main, "--hf", str(exported), "--prompt", "héllo")
    assert code == 2 and "cannot be encoded" in err
    for main in (sample.main, attention_maps.main):
        code, _, err = call(capsys, main, "--hf", str(exported), "--checkpoint", str(tmp_path), "--prompt", "A")
        assert code == 2 and "not allowed with argument" in err


@pytest.mark.slow
def test_the_real_programs_exit_with_one_line_and_no_traceback(tmp_path):
    def python(*argv):
        done = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert "Traceback" not in done.stderr
        return done.returncode, done.stderr
    code, err = python("-m", "train.export", "--checkpoint", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x"))
    assert code == 1 and err.startswith("error: ") and err.count("\n") == 1
    code, err = python("-m", "train.sample", "--hf", str(tmp_path), "--random-init", "x", "--prompt", "A")
    assert code == 2 and "not allowed with argument" in err


def test_export_refuses_quant_in_one_line(tmp_path, capsys):
    code, stdout, err = call(capsys, export.main, "--checkpoint", str(tmp_path), "--out", str(tmp_path / "hf"),
                             "--quant", "int8")
    assert code == 2 and stdout == "" and err.startswith("error: ") and len(err.splitlines()) == 1
    assert "--quant int8: quantized weights are not exported" in err and not (tmp_path / "hf").exists()
