"""`python -m train.distill_draft` on a tiny random target: the loss falls, the directory loads and drafts."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from programs import call

import jaxattn as ja
from jaxattn import hf
from jaxattn.config import ModelConfig
from jaxattn.model import DecoderLM
from jaxattn.speculative import DraftProposer
from train import distill_draft
from train.data.tokenizer import ByteTokenizer, to_hf_tokenizer
from train.distill import draft
from train.models.load import load_model
from train.models.source import ModelSource

TEXT = ("ROMEO:\nBut soft, what light through yonder window breaks?\nIt is the east, and Juliet is the sun.\n\n"
        "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?\n") * 8


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A 3-layer Llama-shaped target (RoPE, RMSNorm, SwiGLU, GQA, tied head) of byte ids, as a transformers
    directory; and a text file."""
    folder = tmp_path_factory.mktemp("distill")
    config = ModelConfig(vocab_size=256, d_model=32, num_layers=3, num_heads=4, num_kv_heads=2, positions="rope",
                         norm="rmsnorm", mlp="swiglu", mlp_hidden=64, max_seq_len=4096, tie_embeddings=True,
                         use_bias=False, init_std=0.2)
    params = DecoderLM(config).init(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))["params"]
    hf.save_pretrained(folder / "target", config, params, tokenizer=to_hf_tokenizer(ByteTokenizer()))
    (folder / "text.txt").write_text(TEXT)
    return folder


def test_the_cut_keeps_the_first_blocks_and_the_last():
    assert draft.kept_layers(30, 2, "ends") == [0, 29]
    assert draft.kept_layers(30, 3, "first") == [0, 1, 2]
    with pytest.raises(ValueError, match="1 to 29"):
        draft.kept_layers(30, 30, "ends")


def test_a_few_steps_lower_the_loss_and_write_a_draft_that_drafts(target, capsys):
    out = target / "draft"
    code, stdout, _ = call(capsys, distill_draft.main, "--hf", str(target / "target"), "--layers", "2",
                           "--out", str(out), "--minutes", "1", "--steps", "12", "--eval-every", "1",
                           "--seq-len", "48", "--batch", "4", "--prompts", "4", "--held-out", "1",
                           "--reply-tokens", "12", "--reply-batch", "4", "--text", str(target / "text.txt"),
                           "--text-windows", "6", "--lr", "3e-3")
    assert code == 0, stdout
    assert "held-out top-1 agreement" in stdout and "step 12:" in stdout
    record = json.loads((out / "distill.json").read_text())
    losses = [line["loss"] for line in record["lines"]]
    assert record["steps"] == 12 and np.mean(losses[-3:]) < np.mean(losses[:3])
    assert 0.0 <= record["agreement_before"] <= 1.0 and 0.0 <= record["agreement_after"] <= 1.0

    drafted = load_model(ModelSource(hf=str(out)))
    assert drafted.config.num_layers == 2 and drafted.config.vocab_size == 256
    goal = load_model(ModelSource(hf=str(target / "target")))
    prompt, common = np.array([[72, 105, 33, 10]], np.int32), dict(max_new_tokens=8, rng=jax.random.PRNGKey(0),
                                                                   temperature=0.0)
    spec = ja.speculative_generate(goal.params, goal.config, prompt, [4], adaptive=False,
                                   proposer=DraftProposer(drafted.params, drafted.config, k=3), **common)
    plain = ja.generate(goal.params, goal.config, prompt, [4], **common)
    assert (spec.tokens == np.asarray(plain.tokens)).all() and spec.stats.steps >= 1


@pytest.mark.parametrize("argv, says", [
    (["--layers", "0"], "--layers must be >= 1"),
    (["--minutes", "0"], "--minutes must be > 0"),
    (["--held-out", "6", "--prompts", "6"], "--held-out (6) must leave"),
    (["--layers", "3"], "1 to 2 of the target's 3 layers"),
])
def test_bad_arguments_are_one_error_line_and_exit_2(target, capsys, argv, says):
    base = {"--hf": str(target / "target"), "--out": str(target / "refused"), "--minutes": "1"}
    given = dict(zip(argv[::2], argv[1::2]))
    words = [w for flag, value in {**base, **given}.items() for w in (flag, value)]
    code, _, stderr = call(capsys, distill_draft.main, *words)
    assert code == 2 and stderr.startswith("error: ") and says in stderr
    assert not (target / "refused").exists()
