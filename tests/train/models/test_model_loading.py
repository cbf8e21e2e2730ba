"""`train.models.load.load_model`, the one loader of the programs, and the model-source flags defined once
(`train.models.source`): every source loads the same model, every program says the flags' usage errors
alike, and a fine-tuning run's `train.init_from` reads a checkpoint as the programs do."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from programs import CHARS, TINY_TOML, tiny_sampling_config

from jaxattn.model import DecoderLM
from jaxattn.quantization import QuantizedWeight
from train import attention_maps, export, sample, serve
from train.checkpoints import init_from
from train.checkpoints.meta import CheckpointError
from train.checkpoints.store import Checkpointer
from train.cli import UsageError
from train.config import ExperimentConfig, TrainConfig
from train.data.tokenizer import CharTokenizer
from train.models import fresh
from train.models.load import load_model, read_chat
from train.models.source import ModelSource, SourceFlags

TOKENS = np.array([[3, 14, 15, 9, 26, 5]], np.int32)
TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    return tiny_sampling_config(tmp_path, monkeypatch)


def logits(loaded) -> np.ndarray:
    return np.asarray(DecoderLM(loaded.config).apply({"params": loaded.params}, jnp.asarray(TOKENS)))


def save_run(run_dir, params, config) -> None:
    """`params` saved as a training run's best checkpoint, as training saves one."""
    checkpointer = Checkpointer(run_dir)
    experiment = ExperimentConfig(name="tiny", model=config, train=TrainConfig(block_size=config.max_seq_len))
    checkpointer.save("best", 1, {"params": params, "step": jnp.int32(1)}, config=experiment,
                      tokenizer=CharTokenizer(CHARS), val_loss=2.0, best_val_loss=2.0)
    checkpointer.close()


def test_a_source_names_exactly_one_model_and_its_name():
    with pytest.raises(ValueError, match="exactly one of checkpoint, hf, gguf, random_init"):
        ModelSource()
    with pytest.raises(ValueError, match="exactly one"):
        ModelSource(hf="a", gguf="b.gguf")
    assert ModelSource(gguf="models/tiny-Q8_0.gguf").name == "tiny-Q8_0"
    assert ModelSource(random_init="configs/baby.toml").name == "baby"
    assert ModelSource(hf="exports/baby/").name == "baby"
    source = ModelSource(checkpoint="runs/x")
    assert (source.kind, source.path) == ("checkpoint", "runs/x") and read_chat(source) == (None, {})


def test_every_source_loads_the_same_model(tiny, tmp_path):
    """A random config saved as a run, the run exported as a transformers directory: the three load as one
    model, and a fine-tuning run's `train.init_from` reads the directory as `--hf` does."""
    params, config, tokenizer = fresh.random_init(tiny, seed=3)
    random = load_model(ModelSource(random_init=tiny, seed=3))
    assert random.tokenizer == tokenizer and random.name == "tiny" and random.quant is None and not random.notes
    save_run(tmp_path / "run", params, config)
    run = load_model(ModelSource(checkpoint=str(tmp_path / "run")))
    export.export(tmp_path / "run", tmp_path / "hf")
    (tmp_path / "hf" / "chat_template.jinja").write_text(TEMPLATE)
    directory = load_model(ModelSource(hf=str(tmp_path / "hf")))
    reference = logits(random)
    for loaded in (run, directory):
        np.testing.assert_allclose(logits(loaded), reference, rtol=1e-5, atol=1e-5)
        assert loaded.tokenizer.decode(loaded.tokenizer.encode("ROMEO:")) == "ROMEO:"
    assert directory.read_chat()[0] == TEMPLATE and directory.name == "hf"
    initial = init_from.load(f"hf:{tmp_path / 'hf'}")  # the same reader: the same weights, config, template
    as_saved = load_model(ModelSource(hf=str(tmp_path / "hf"), as_saved=True))
    assert initial.config == as_saved.config and initial.chat_template.source == TEMPLATE
    jax.tree.map(np.testing.assert_array_equal, initial.params, jax.tree.map(np.asarray, as_saved.params))


def test_the_weights_are_quantized_and_relaid_as_asked(tiny):
    quantized = load_model(ModelSource(random_init=tiny, quant="int8:channel"))  # d_model 16: no groups of 32
    assert quantized.quant == "int8:channel" and isinstance(quantized.params["tied_head"], QuantizedWeight)
    deep = Path(tiny).with_name("deep.toml")
    deep.write_text(TINY_TOML.replace("num_layers = 1", "num_layers = 3"))
    unrolled = load_model(ModelSource(random_init=str(deep)))
    scanned = load_model(ModelSource(random_init=str(deep), scan_layers=True))
    assert scanned.config.scan_layers and not unrolled.config.scan_layers
    assert jax.tree.structure(scanned.params) != jax.tree.structure(unrolled.params)  # the layers stacked
    np.testing.assert_allclose(logits(scanned), logits(unrolled), atol=1e-6)
    with pytest.raises(UsageError, match="--quant int4: "):
        load_model(ModelSource(random_init=tiny, quant="int4"))  # d_model 16: no whole group of 32 rows


def test_a_fresh_model_takes_its_tokenizer_as_the_program_asks(tiny, tmp_path):
    corpus = tmp_path / "abc.txt"
    corpus.write_text("abcabc")
    with pytest.raises(UsageError, match=r"has vocab_size 65, but the tokenizer of the characters of --data .* has 3"):
        load_model(ModelSource(random_init=tiny, data=str(corpus)))
    fitted = load_model(ModelSource(random_init=tiny, data=str(corpus), fit_vocab=True))  # attention_maps'
    assert fitted.config.vocab_size == 3 and fitted.params["wte"]["embedding"].shape[0] == 3
    with pytest.raises(UsageError, match="--random-init: config 'no_such_config' not found"):
        load_model(ModelSource(random_init="no_such_config"))


def test_a_source_that_cannot_be_read_is_one_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(ModelSource(checkpoint=str(tmp_path / "nowhere")))
    with pytest.raises(CheckpointError, match="is not a directory"):
        load_model(ModelSource(hf=str(tmp_path / "nowhere")))
    with pytest.raises(CheckpointError, match="cannot load"):
        load_model(ModelSource(gguf=str(tmp_path / "nowhere.gguf")))


@pytest.mark.parametrize("parse, argv, message", [
    (sample.parse_args, ["--checkpoint", "d", "--data", "x"], "--data goes with --random-init (a checkpoint carries"),
    (serve.parse_args, ["--checkpoint", "d", "--data", "x"], "--data goes with --random-init (a checkpoint carries"),
    (attention_maps.parse_args, ["--checkpoint", "d", "--data", "x"], "--data goes with --random-init"),
    (sample.parse_args, ["--random-init", "c", "--allow-nonfinite"], "--allow-nonfinite goes with --hf or --gguf"),
    (serve.parse_args, ["--random-init", "c", "--allow-nonfinite"], "--allow-nonfinite goes with --hf or --gguf"),
    (attention_maps.parse_args, ["--checkpoint", "d", "--allow-nonfinite"], "--allow-nonfinite goes with --hf$"),
    (sample.parse_args, ["--random-init", "c", "--quant", "int8", "--mesh", "data:1"], "--quant does not go with"),
    (serve.parse_args, ["--random-init", "c", "--quant", "int8", "--mesh", "data:1"], "--quant does not go with"),
    (attention_maps.parse_args, ["--hf", "d", "--seed", "1"], "--seed goes with --random-init"),
    (attention_maps.parse_args, ["--hf", "d", "--gguf", "f"], "unrecognized arguments: --gguf"),
])
def test_every_program_says_the_flags_usage_errors_alike(parse, argv, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(")):
        parse(argv)


def test_a_program_takes_the_flags_it_asks_for_and_reads_them_back():
    flags = SourceFlags(sources=("checkpoint", "gguf"), data=False, allow_nonfinite=False, as_saved=True)
    parser = sample.ArgumentParser(prog="p")
    flags.add_to(parser)
    source = flags.read(parser, parser.parse_args(["--gguf", "m.gguf"]))
    assert source == ModelSource(gguf="m.gguf", as_saved=True)
    for argv in (["--hf", "d"], ["--gguf", "m.gguf", "--data", "x"], ["--gguf", "m.gguf", "--quant", "int8"], []):
        with pytest.raises(UsageError):
            parser.parse_args(argv)
    args = sample.parse_args(["--gguf", "m.gguf", "--quant", "int4", "--scan-layers", "--adapter", "a", "--seed", "5"])
    assert args.model_source == ModelSource(gguf="m.gguf", quant="int4", scan_layers=True, adapter="a", seed=5)
    assert serve.parse_args(["--hf", "d", "--mesh", "tensor:2"]).model_source == ModelSource(hf="d", on_mesh=True)


def test_the_kernels_line_names_the_paged_loops_instruction_set_path_when_it_runs_native():
    from jaxattn.kernels import Kernels, native_paged, resolve_kernels
    from train.models.load import paged_part
    _, reasons = resolve_kernels(Kernels.auto())
    assert paged_part(Kernels(paged="ragged"), reasons) == f"paged 'ragged' ({reasons['paged']})"
    native = paged_part(Kernels(paged="ragged_cpu"), reasons)
    assert native == f"paged 'ragged_cpu', {native_paged.native_path()} path ({reasons['paged']})"
    assert native_paged.native_path() in ("avx512", "avx2", "neon", "scalar")
