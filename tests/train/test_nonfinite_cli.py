"""Models with NaN weights, loaded with `--allow-nonfinite`: sampling stops in one line naming the first
layer whose output is not finite, and so do attention maps that are not finite; the library's side
is `GenerateOutput.nonfinite_from` and `windows(..., check_finite=True)`."""

from pathlib import Path

import jax
import numpy as np
import pytest
from flax.traverse_util import flatten_dict, unflatten_dict
from programs import CHARS, call
from tiny_models import drawn_params

from jaxattn import generate, hf
from jaxattn.config import ModelConfig
from jaxattn.windowed import windows
from train import attention_maps, sample
from train.data.tokenizer import CharTokenizer, to_hf_tokenizer

CONFIG = ModelConfig(vocab_size=65, d_model=16, num_layers=2, num_heads=2, max_seq_len=16, positions="rope",
                     norm="rmsnorm", mlp="swiglu", use_bias=False, tie_embeddings=False)  # a Llama
PROMPT = ["--prompt", "ROMEO:", "--max-new-tokens", "20", "--num-samples", "2"]


def with_nan(**where) -> dict:
    """`drawn_params(CONFIG)` changed at each `path=change` (path "blocks_1__attn__qkv__kernel" for
    blocks_1/attn/qkv/kernel): an index is set to NaN, a function changes the array in place."""
    flat = {"/".join(path): np.array(leaf) for path, leaf in flatten_dict(drawn_params(CONFIG, std=0.3)).items()}
    for path, change in where.items():
        if callable(change):
            change(flat[path.replace("__", "/")])
        else:
            flat[path.replace("__", "/")][change] = np.nan
    return unflatten_dict({tuple(path.split("/")): leaf for path, leaf in flat.items()})


def _set(index, value):
    def change(array):
        array[index] = value
    return change


DRAWN = 5  # "&": the token greedy decoding draws first below, whose embedding is NaN
# The blocks add nothing (their output projections are 0), so the stream is a token's embedding, whose
# dim 0 is 1; the final norm keeps only that dim and the lm_head maps it to token DRAWN alone: every
# token's logits are 0 but DRAWN's, which is positive.
NAN_TOKEN = dict(**{f"blocks_{i}__{name}__kernel": _set(..., 0.0) for i in range(2) for name in ("attn__out", "mlp__down")},
                 wte__embedding=lambda e: (e.__setitem__((..., 0), 1.0), e.__setitem__(DRAWN, np.nan)),
                 final_norm__scale=lambda s: (s.__setitem__(..., 0.0), s.__setitem__(0, 1.0)),
                 lm_head__kernel=lambda w: (w.__setitem__(..., 0.0), w.__setitem__((0, DRAWN), 1.0)))
PAD_NAN = dict(wte__embedding=(0,))  # token 0, which generate pads the prompts with
DAMAGE = {
    "query": dict(blocks_1__attn__qkv__kernel=(0, 0)),  # layer 1, head 0's query
    "mlp": dict(blocks_1__mlp__down__kernel=(3, 2)),  # after the last attention: the maps stay finite
    "token": NAN_TOKEN,
    "pad": PAD_NAN,
}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    """A transformers directory with its tokenizer per kind of damage."""
    root, tokenizer = tmp_path_factory.mktemp("nan"), to_hf_tokenizer(CharTokenizer(CHARS))
    return {name: hf.save_pretrained(root / name, CONFIG, with_nan(**where), tokenizer).directory
            for name, where in DAMAGE.items()}


STOPS = {  # damage: (extra flags, where the error line says the non-finite values first appear)
    "query": ((), "new token 1 of sample 1 would be drawn from are not finite (NaN or infinity): they first "
                  "appear in layer 1, at blocks_1/attn/query; the weights holding NaN or infinity: "
                  "blocks_1/attn/query/kernel (1 value)"),
    # a drawn token's embedding: the next token's logits
    "token": (("--temperature", "0"), "new token 2 of sample 1 would be drawn from are not finite (NaN or "
              "infinity): they first appear in the embeddings, at embed; the weights holding NaN or infinity: "
              "wte/embedding (16 values)"),
    "pad": ((), "new token 1 of sample 1 would be drawn from are not finite (NaN or infinity): they first appear "
                "in the embeddings, at embed of the padding (token 0) after the prompt: attention gives it weight "
                "0, but 0 x NaN is NaN; the weights holding NaN or infinity: wte/embedding (16 values)"),
}


@pytest.mark.parametrize("damage", STOPS)
def test_sampling_stops_naming_where_the_values_first_stop_being_finite(hf_dirs, capsys, damage):
    flags, where = STOPS[damage]
    code, out, err = call(capsys, sample.main, "--hf", str(hf_dirs[damage]), "--allow-nonfinite", *PROMPT, *flags)
    assert code == 1 and out == ""
    assert err.splitlines()[-1] == f"error: the logits that {where}"


def test_nan_weights_that_never_reach_the_logits_sample_as_before_with_a_warning(tmp_path, capsys):
    tokenizer, greedy = to_hf_tokenizer(CharTokenizer(CHARS)), [*PROMPT, "--temperature", "0"]
    finite = hf.save_pretrained(tmp_path / "finite", CONFIG, with_nan(), tokenizer).directory
    code, text, err = call(capsys, sample.main, "--hf", str(finite), *greedy)
    assert code == 0, err
    unused = min(set(range(1, len(CHARS))) - {CHARS.index(c) for c in text})  # neither read, drawn nor padding
    broken = hf.save_pretrained(tmp_path / "nan", CONFIG, with_nan(wte__embedding=(unused, 3)), tokenizer).directory
    code, out, err = call(capsys, sample.main, "--hf", str(broken), "--allow-nonfinite", *greedy)
    assert code == 0 and out == text, err
    assert ("warning: the weights holding NaN or infinity: wte/embedding (1 value); sampling stops at the first "
            "token whose logits are not finite") in err.splitlines()


@pytest.mark.parametrize("outputs", [["--html", "maps.html"], ["--out", "maps.png"]])
def test_attention_maps_that_are_not_finite_are_refused_naming_the_heads_and_the_layer(hf_dirs, capsys, tmp_path,
                                                                                     monkeypatch, outputs):
    monkeypatch.chdir(tmp_path)
    code, out, err = call(capsys, attention_maps.main, "--hf", str(hf_dirs["query"]), "--allow-nonfinite",
                          "--text", "ROMEO:", *outputs)
    assert code == 1 and out == "" and not (tmp_path / outputs[1]).exists()
    assert err == ("error: the attention weights are not finite (NaN or infinity) in layer 1 head 0, so nothing is "
                   "drawn: they first appear in layer 1, at blocks_1/attn/query; the weights holding NaN or "
                   "infinity: blocks_1/attn/query/kernel (1 value)\n")


def test_attention_maps_are_drawn_with_a_warning_when_the_nan_weights_leave_them_finite(hf_dirs, capsys, tmp_path):
    page = tmp_path / "maps.html"
    code, out, err = call(capsys, attention_maps.main, "--hf", str(hf_dirs["mlp"]), "--allow-nonfinite",
                          "--text", "ROMEO:", "--html", str(page))
    assert code == page and page.stat().st_size > 1000 and out.startswith("wrote ")
    assert err == ("warning: the weights holding NaN or infinity (blocks_1/mlp/down/kernel (1 value)) leave this "
                   "text's attention weights finite: drawing them\n")


def test_generate_says_where_a_row_first_drew_from_logits_that_are_not_finite():
    params = with_nan(**NAN_TOKEN)
    prompt = np.array([[6, 7, 8], [DRAWN, 1, 2]])  # row 1 starts with the NaN token
    out = generate(params, CONFIG, prompt, np.array([3, 3]), max_new_tokens=4, rng=jax.random.PRNGKey(0),
                   temperature=0.0)
    assert out.tokens[0, 0] == DRAWN and out.nonfinite_from.tolist() == [1, 0]
    finite = generate(drawn_params(CONFIG), CONFIG, prompt, np.array([3, 3]), max_new_tokens=4,
                      rng=jax.random.PRNGKey(0))
    assert finite.nonfinite_from.tolist() == [-1, -1]


def test_windows_raise_with_the_context_of_the_logits_only_when_asked():
    from jaxattn.windowed import NonFiniteLogits
    params, prompt = with_nan(**NAN_TOKEN), np.array([6, 7, 8])
    kwargs = dict(max_new_tokens=30, rng=jax.random.PRNGKey(0), num_samples=2, temperature=0.0)
    drawn = np.concatenate(list(windows(params, CONFIG, prompt, **kwargs)), axis=1)
    assert drawn.shape == (2, 30)  # unchecked: arbitrary tokens, as before
    with pytest.raises(NonFiniteLogits) as raised:
        list(windows(params, CONFIG, prompt, check_finite=True, **kwargs))
    assert (raised.value.sample, raised.value.token) == (0, 1)
    assert raised.value.context.tolist() == [6, 7, 8, DRAWN]
    assert str(raised.value) == "sample 0's new token 1 was drawn from logits that are not finite (NaN or infinity)"
