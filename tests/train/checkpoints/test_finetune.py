"""Fine-tuning runs (`train.init_from`, `[lora]`, chat data): a tiny Llama saved as a transformers
directory with its byte-level BPE tokenizer and a ChatML template, fine-tuned whole and with LoRA by
`train.run.experiment.run_experiment`, resumed exactly, read back for sampling and export, refused in one
line where the settings or the data are wrong."""

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn import hf, lora
from jaxattn.config import ModelConfig
from jaxattn.model import DecoderLM
from tests.tiny_models import drawn_params
from train import tiny_lm
from train.checkpoints import init_from
from train.checkpoints.meta import CheckpointError
from train.config import ExperimentConfig, load_config
from train.data.errors import DataError
from train.models.load import with_adapter
from train.models.runs import load_for_sampling
from train.run.experiment import run_experiment

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WORDS = "to be or not to be that is the question whether tis nobler in the mind to suffer the slings".split()
RUN = ["train.batch_size=4", "train.block_size=24", "train.eval_iters=2", "train.eval_interval=3",
       "train.log_interval=1", "train.warmup_iters=1", "train.lr=3e-3", "train.lr_decay_iters=6", "train.max_iters=6",
       "train.sample_tokens=4", "train.plot=false", "train.steps_per_dispatch=3", "runtime.mesh=data:1",
       "runtime.attention=xla", "runtime.matmul=xla"]


def sentences(count: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=rng.integers(4, 9))) + "." for _ in range(count)]


def bpe_tokenizer(text: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([text], trainer)
    return tokenizer


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(base directory, text corpus, chat JSONL) of the fine-tuning runs."""
    root = tmp_path_factory.mktemp("finetune")
    text = "\n".join(sentences(300, 0))
    (root / "corpus.txt").write_text(text)
    tokenizer = bpe_tokenizer(text)
    config = ModelConfig(vocab_size=tokenizer.get_vocab_size(), d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                         max_seq_len=32, positions="rope", norm="rmsnorm", mlp="swiglu", mlp_hidden=64,
                         tie_embeddings=False, use_bias=False)
    base = root / "base"
    hf.save_pretrained(base, config, drawn_params(config, seed=3, std=0.05), tokenizer=tokenizer, eos_token_id=0)
    (base / "chat_template.jinja").write_text(CHATML)
    rng = np.random.default_rng(1)
    with open(root / "chats.jsonl", "w") as f:
        for question, answer in zip(sentences(40, 2), sentences(40, 3)):
            messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
            if rng.random() < 0.3:
                messages = [{"role": "system", "content": "answer"}] + messages
            f.write(json.dumps({"messages": messages}) + "\n")
    return base, root / "corpus.txt", root / "chats.jsonl"


def config_for(out: Path, data: Path, base: Path, *extra: str):
    return load_config(overrides=RUN + [f"train.out_dir='{out}'", f"train.data_path='{data}'",
                                        f"train.init_from='hf:{base}'", *extra])


def checkpoint_meta(out: Path, step: int) -> dict:
    return json.loads((out / "checkpoints" / "latest" / str(step) / "meta" / "metadata").read_text())


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def evals(out: Path) -> list[tuple[int, float]]:
    return [(m["step"], m["val_loss"]) for m in metrics(out) if "val_loss" in m]


@pytest.fixture(scope="module")
def full_run(files, tmp_path_factory):
    base, text, _ = files
    out = tmp_path_factory.mktemp("full") / "run"
    result = run_experiment(config_for(out, text, base), quiet=True)
    return out, result


def test_a_full_fine_tune_starts_from_the_checkpoint_and_lowers_the_val_loss(files, full_run):
    base, _, _ = files
    out, result = full_run
    initial = init_from.load(f"hf:{base}")
    saved = ExperimentConfig.from_dict(json.loads((out / "config.json").read_text()))
    assert saved.model == initial.config and saved.train.init_from == f"hf:{base}" and saved.lora is None
    losses = evals(out)
    assert losses[0][0] == 0 and losses[-1][1] < losses[0][1]
    # step 0's val loss is the checkpoint's own: its weights, not a random initialisation, were evaluated
    params, config, tokenizer = load_for_sampling(out)
    assert tokenizer == initial.tokenizer and config == initial.config
    moved = [float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(initial.params))]
    assert 0 < max(moved) < 0.5  # trained from there, not from elsewhere
    assert checkpoint_meta(out, 6)[init_from.META_KEY] == {"source": f"hf:{base}", "sha256": initial.digest}


def test_the_first_evaluation_is_the_checkpoints_loss(files, full_run):
    base, text, _ = files
    out, _ = full_run
    initial = init_from.load(f"hf:{base}")
    ids = initial.tokenizer.encode(text.read_text())
    val = ids[int(len(ids) * 0.9):]
    # the run's first val loss averages eval_iters random windows: the checkpoint's mean loss over the
    # whole val split is close to it, a random model's (about log V) far from it
    window = jnp.asarray(np.stack([val[i:i + 25] for i in range(0, len(val) - 25, 25)]), jnp.int32)
    logits = DecoderLM(initial.config).apply({"params": initial.params}, window[:, :-1])
    loss = float(jnp.mean(-jnp.take_along_axis(jax.nn.log_softmax(logits), window[:, 1:, None], -1)))
    assert abs(evals(out)[0][1] - loss) < 0.15 * loss


def test_a_resumed_fine_tune_replays_the_uninterrupted_one(files, full_run, tmp_path):
    base, text, _ = files
    out, _ = full_run
    cut = tmp_path / "cut"
    run_experiment(config_for(cut, text, base, "train.max_iters=3"), quiet=True, sample=False)
    run_experiment(config_for(cut, text, base), resume=True, quiet=True, sample=False)
    assert evals(cut) == evals(out)


@pytest.fixture(scope="module")
def lora_run(files, tmp_path_factory):
    base, _, chats = files
    out = tmp_path_factory.mktemp("lora") / "run"
    config = config_for(out, chats, base, "lora.rank=4", "lora.alpha=8", "train.lr=1e-2")
    return out, run_experiment(config, quiet=True)


def test_a_lora_run_on_chats_trains_and_saves_only_the_adapters(files, lora_run):
    base, _, _ = files
    out, result = lora_run
    losses = evals(out)
    assert losses[-1][1] < losses[0][1]
    meta = checkpoint_meta(out, 6)
    arrays = [name for name in meta["checksums"] if name.startswith("params/")]
    assert arrays and all(name.rsplit("/", 1)[-1] in ("a", "b") for name in arrays)
    # every targeted projection (the fused gate_up in two parts), nothing else
    assert {tuple(name.split("/")[3:-1]) for name in arrays} == {
        ("query", "kernel", "query"), ("key", "kernel", "key"), ("value", "kernel", "value"), ("out", "kernel", "out"),
        ("gate_up", "kernel", "gate"), ("gate_up", "kernel", "up"), ("down", "kernel", "down")}
    # the saved state is a sliver of the model: the adapters and their two Adam moments
    params, config, _ = load_for_sampling(out)
    initial = init_from.load(f"hf:{base}")
    flat, start = hf_flat(params), hf_flat(initial.params)
    changed = {path for path in flat if not np.array_equal(flat[path], start[path])}
    assert changed and all(path[-2] in ("query", "key", "value", "out", "gate_up", "down") for path in changed)
    assert not any("embedding" in "/".join(path) or "norm" in "/".join(path) for path in changed)


def hf_flat(params) -> dict:
    from flax.traverse_util import flatten_dict
    return {path: np.asarray(v) for path, v in flatten_dict(params).items()}


def test_a_lora_run_resumes_only_on_the_base_it_was_trained_from(files, lora_run, tmp_path):
    base, _, chats = files
    out, _ = lora_run
    changed = tmp_path / "base"
    shutil.copytree(base, changed)
    config, params = hf.load_pretrained(changed)
    params = jax.tree.map(lambda x: x * 1.01, params)
    hf.save_pretrained(changed, config, params, overwrite=True)
    cut = tmp_path / "run"
    shutil.copytree(out, cut)
    with pytest.raises(CheckpointError, match="base's weights changed"):
        run_experiment(config_for(cut, chats, changed, "lora.rank=4", "lora.alpha=8", "train.lr=1e-2",
                                  "train.max_iters=9", "train.lr_decay_iters=9"), resume=True, quiet=True)


def test_the_base_held_in_bfloat16_trains_adapters_in_float32(files, tmp_path):
    base, text, _ = files
    out = tmp_path / "run"
    run_experiment(config_for(out, text, base, "lora.rank=2", "lora.base_dtype='bfloat16'", "lora.targets=['q','v']",
                              "train.max_iters=3"), quiet=True, sample=False)
    meta = checkpoint_meta(out, 3)
    assert {name.split("/")[3] for name in meta["checksums"] if name.startswith("params/")} == {"query", "value"}


@pytest.mark.parametrize("argv,message", [
    (["--set", "lora.rank=4"], "set train.init_from"),
    (["--init-from", "pt:model.bin"], "train.init_from"),
    (["--init-from", "hf:BASE", "--set", "lora.rank=4", "train.optimizer='muon'"], "trains its adapters with AdamW"),
    (["--init-from", "hf:BASE", "--set", "lora.targets=['q','x']"], "lora.targets"),
    (["--init-from", "hf:BASE", "--set", "model.d_model=64"],
     "only model.dtype, model.dropout, model.scan_layers can be set"),
])
def test_bad_fine_tuning_settings_are_one_usage_line(files, tmp_path, capsys, argv, message):
    base, text, _ = files
    argv = [a.replace("BASE", str(base)) for a in argv]
    with pytest.raises(SystemExit) as stop:
        tiny_lm.main(["--data", str(text), "--out-dir", str(tmp_path / "run"), *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(err) == 1 and err[0].startswith("error:") and message in err[0]


def test_a_bad_chat_line_and_a_missing_checkpoint_are_one_runtime_line(files, tmp_path, capsys):
    base, _, chats = files
    bad = tmp_path / "bad.jsonl"
    lines = chats.read_text().splitlines()
    bad.write_text("\n".join(lines[:5] + ['{"messages": [{"role": "user"}]}'] + lines[5:]) + "\n")
    for argv, message in ([f"hf:{base}", str(bad)], f"{bad}:6"), ([f"hf:{tmp_path / 'none'}", str(chats)], "none"):
        with pytest.raises(SystemExit) as stop:
            tiny_lm.main(["--init-from", argv[0], "--data", argv[1], "--out-dir", str(tmp_path / "run")] + RUN_FLAGS)
        err = capsys.readouterr().err.strip().splitlines()
        assert stop.value.code == 1 and len(err) == 1 and message in err[0], err
    with pytest.raises(DataError, match="fine-tunes a checkpoint"):
        run_experiment(load_config(overrides=RUN + [f"train.data_path='{chats}'",
                                                    f"train.out_dir='{tmp_path / 'scratch'}'"]), quiet=True)


RUN_FLAGS = ["--set", *RUN]


def test_adapters_leave_every_untargeted_weight_and_merge_back(files):
    base, _, _ = files
    initial = init_from.load(f"hf:{base}")
    with_adapters = lora.add_lora(jax.tree.map(jnp.asarray, initial.params), initial.config,
                                  lora.LoraConfig(rank=2, targets=("q", "down")), jax.random.PRNGKey(0))
    adapters, frozen = lora.split_lora(with_adapters)
    assert len(jax.tree.leaves(adapters)) == 2 * 2 * initial.config.num_layers
    merged = lora.merge_lora(lora.combine_lora(frozen, adapters))  # b = 0 at the start: the base itself
    for a, b in zip(jax.tree.leaves(merged), jax.tree.leaves(initial.params)):
        np.testing.assert_array_equal(np.asarray(a), b)


def test_a_lora_run_exports_as_a_peft_adapter_and_merged_both_as_transformers_computes(files, lora_run, tmp_path,
                                                                                         capsys):
    import peft
    import torch
    import transformers

    from train import export, sample
    base, _, _ = files
    out, _ = lora_run
    assert export.main(["--checkpoint", str(out), "--out", str(tmp_path / "adapter")]) == 0
    assert export.main(["--checkpoint", str(out), "--out", str(tmp_path / "merged"), "--merge"]) == 0
    merged, config, _ = load_for_sampling(out)
    ids = np.random.default_rng(0).integers(0, config.vocab_size, size=(2, 12))
    ours = np.asarray(DecoderLM(config).apply({"params": merged}, jnp.asarray(ids)))
    torch.set_num_threads(2)
    model = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base), tmp_path / "adapter")
    whole = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    with torch.no_grad():
        for theirs in (model, whole):
            logits = theirs(torch.tensor(ids)).logits.numpy()
            assert np.max(np.abs(logits - ours)) < 1e-4
    # the adapter read back here, merged into the base, is the run's model
    adapted = with_adapter(str(tmp_path / "adapter"), config, hf.load_pretrained(base)[1])
    for a, b in zip(jax.tree.leaves(adapted), jax.tree.leaves(merged)):
        np.testing.assert_allclose(np.asarray(a), b, atol=1e-6)
    # and train.sample draws the same greedy text from the base plus the adapter as from the merged export
    texts, _ = [], capsys.readouterr()
    for source in (["--hf", str(base), "--adapter", str(tmp_path / "adapter")], ["--hf", str(tmp_path / "merged")],
                   ["--checkpoint", str(out)]):
        assert sample.main([*source, "--prompt", "to be", "--max-new-tokens", "8", "--temperature", "0"]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] == texts[2] and texts[0].startswith("to be")


def test_export_refuses_merge_without_adapters_and_an_adapter_over_one(files, full_run, lora_run, tmp_path, capsys):
    from train import export
    full, _ = full_run
    lora_out, _ = lora_run
    with pytest.raises(SystemExit) as stop:
        export.main(["--checkpoint", str(full), "--out", str(tmp_path / "x"), "--merge"])
    assert stop.value.code == 2 and "trained every weight" in capsys.readouterr().err
    assert export.main(["--checkpoint", str(lora_out), "--out", str(tmp_path / "a")]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        export.main(["--checkpoint", str(lora_out), "--out", str(tmp_path / "a")])
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 1
    assert len(err) == 1 and "--overwrite" in err[0]


@pytest.mark.slow
def test_a_lora_run_on_a_two_device_mesh_gives_the_one_device_losses(files, lora_run, tmp_path):
    import os
    import subprocess
    import sys
    base, _, chats = files
    out, _ = lora_run
    root = Path(__file__).resolve().parents[3]
    env = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, "PYTHONPATH": str(root)}
    mesh_out = tmp_path / "mesh"
    overrides = [o for o in RUN if not o.startswith("runtime.mesh")] + [
        "lora.rank=4", "lora.alpha=8", "train.lr=1e-2", "train.sample_tokens=0", "runtime.mesh='fsdp:2'"]
    done = subprocess.run([sys.executable, "-m", "train.tiny_lm", "--init-from", f"hf:{base}", "--data", str(chats),
                           "--out-dir", str(mesh_out), "--cpu-devices", "2", "--quiet", "--set", *overrides],
                          env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    ours, theirs = evals(out), evals(mesh_out)
    assert [s for s, _ in ours] == [s for s, _ in theirs]
    np.testing.assert_allclose([v for _, v in theirs], [v for _, v in ours], rtol=1e-5)


def test_the_first_val_loss_of_packed_chats_is_the_bases_loss_on_each_conversation_alone(files, lora_run):
    from train.data import chats as finetune_data
    base, _, chats = files
    out, _ = lora_run
    initial = init_from.load(f"hf:{base}")
    documents = finetune_data.chat_documents(chats, initial.chat_template, initial.tokenizer)
    held_out = documents[-max(1, round(len(documents) * 0.1)):]  # the run's val split (train.val_fraction 0.1)
    T = 24  # train.block_size: a longer conversation is cut into pieces of T + 1 tokens, overlapping by one
    pieces = [(ids[k:k + T + 1], weights[k:k + T + 1]) for ids, weights in held_out for k in range(0, len(ids) - 1, T)]
    assert len(pieces) > len(held_out)  # some are cut: the pieces are what the rows hold
    total = weight = 0.0
    for ids, weights in pieces:  # each alone, unpacked: its assistant tokens' losses
        logits = DecoderLM(initial.config).apply({"params": initial.params}, jnp.asarray(ids[None, :-1]))
        losses = -np.take_along_axis(np.asarray(jax.nn.log_softmax(logits))[0], ids[1:, None], -1)[:, 0]
        total += float(np.sum(losses * weights[1:]))
        weight += float(np.sum(weights[1:]))
    # B = 0 at the start: step 0 evaluates the base itself, on the packed val rows
    assert evals(out)[0] == (0, pytest.approx(total / weight, rel=1e-5))


def test_a_gguf_file_starts_a_run_as_its_transformers_directory_does(files, tmp_path):
    from bench.quant import write_gguf
    base, _, _ = files
    path = write_gguf(base, tmp_path / "base.gguf", "F32")
    from_gguf, from_hf = init_from.load(f"gguf:{path}"), init_from.load(f"hf:{base}")
    assert init_from.model_config(f"gguf:{path}") == from_gguf.config
    # GGUF keeps the norm's eps as float32 (1e-5 comes back as 9.99999975e-06)
    assert from_gguf.config.norm_eps == np.float32(from_hf.config.norm_eps)
    assert from_gguf.config.replace(norm_eps=from_hf.config.norm_eps) == from_hf.config
    for a, b in zip(jax.tree.leaves(from_gguf.params), jax.tree.leaves(from_hf.params)):
        np.testing.assert_allclose(a, b, atol=1e-6)
    assert from_gguf.digest == from_hf.digest  # the same weights: a run resumes on either


def test_how_the_model_runs_is_the_runs_own_and_what_it_computes_the_checkpoints(files, tmp_path):
    base, text, _ = files
    given = ["model.dtype='bfloat16'", "model.dropout=0.1"]
    config = init_from.with_checkpoint_model(config_for(tmp_path / "run", text, base, *given), given)
    checkpoint = init_from.model_config(f"hf:{base}")
    assert config.model == checkpoint.replace(dtype="bfloat16", dropout=0.1)
    initial = init_from.load(f"hf:{base}")
    assert init_from.with_base_model(config, initial).model == config.model  # the second call keeps them
    # a file's [model] of another architecture gives the checkpoint's settings, not its own
    assert init_from.with_base_model(config_for(tmp_path / "run", text, base), initial).model == checkpoint
    # a LoRA run computing in bfloat16 through tiny_lm: the saved config says so, and the loss is finite
    out = tmp_path / "bf16"
    tiny_lm.main(["--init-from", f"hf:{base}", "--data", str(text), "--out-dir", str(out), "--quiet",
                  *(x for item in RUN + given + ["lora.rank=2", "train.max_iters=2"] for x in ("--set", item))])
    saved = json.loads((out / "config.json").read_text())["model"]
    assert (saved["dtype"], saved["dropout"], saved["d_model"]) == ("bfloat16", 0.1, checkpoint.d_model)
    assert all(np.isfinite(m["loss"]) for m in metrics(out) if "loss" in m)


def test_a_run_with_its_layers_scanned_replays_the_unrolled_run_and_exports_the_same_model(files, full_run, lora_run,
                                                                                           tmp_path):
    from flax.traverse_util import flatten_dict

    from jaxattn.scan_plan import unstack_params
    from train import export
    base, text, chats = files
    lora_settings = ("lora.rank=4", "lora.alpha=8", "train.lr=1e-2")
    for name, (unrolled, _), data, extra in (("full", full_run, text, ()), ("lora", lora_run, chats, lora_settings)):
        out = tmp_path / name
        config = init_from.with_checkpoint_model(config_for(out, data, base, *extra, "train.sample_tokens=0"),
                                                 ["model.scan_layers=true"])
        run_experiment(config, quiet=True, sample=False)
        # the same adapters drawn (per layer, then stacked), the same steps: the unrolled run's losses
        steps = [(m["step"], m["loss"]) for m in metrics(out) if "loss" in m]
        assert steps == [(s, pytest.approx(v, rel=1e-5)) for s, v in
                         ((m["step"], m["loss"]) for m in metrics(unrolled) if "loss" in m)]
        assert [s for s, _ in evals(out)] == [s for s, _ in evals(unrolled)]
        np.testing.assert_allclose([v for _, v in evals(out)], [v for _, v in evals(unrolled)], rtol=1e-5)
        meta = checkpoint_meta(out, 6)
        assert any(path.startswith("params/layers/") for path in meta["checksums"])  # saved stacked
        # read back for sampling (a LoRA run's adapters on its base, merged): the unrolled run's model
        params, model, _ = load_for_sampling(out)
        assert model.scan_layers
        ours, theirs = flatten_dict(unstack_params(params, model)), flatten_dict(load_for_sampling(unrolled)[0])
        assert ours.keys() == theirs.keys()
        for path in ours:
            np.testing.assert_allclose(np.asarray(ours[path]), np.asarray(theirs[path]), atol=1e-5, err_msg=str(path))
    # the scanned LoRA run's PEFT adapter, read back onto the base, is the same model
    assert export.main(["--checkpoint", str(tmp_path / "lora"), "--out", str(tmp_path / "adapter")]) == 0
    merged, model, _ = load_for_sampling(lora_run[0])
    adapted = with_adapter(str(tmp_path / "adapter"), model, hf.load_pretrained(base)[1])
    for a, b in zip(jax.tree.leaves(adapted), jax.tree.leaves(merged)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_the_block_is_checked_against_the_checkpoints_context_not_the_files_model(files, tmp_path, capsys):
    base, text, _ = files
    # the default config's model has a context of 64; the checkpoint's (32) is the one that counts
    config = load_config(overrides=[f"train.init_from='hf:{base}'", "train.block_size=128"])
    with pytest.raises(ValueError, match="longer than the checkpoint's max_seq_len=32"):
        init_from.with_checkpoint_model(config)
    with pytest.raises(SystemExit) as stop:
        tiny_lm.main(["--init-from", f"hf:{base}", "--data", str(text), "--out-dir", str(tmp_path / "run"),
                      "--set", "train.block_size=128"])
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(err) == 1 and "max_seq_len=32" in err[0]
