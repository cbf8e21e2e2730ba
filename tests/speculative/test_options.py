"""`SpeculativeOptions` and `parse_speculative`: every command-line form, every error named, the proposers made."""

import pytest

from jaxattn.config import ModelConfig
from jaxattn.speculative import (DraftProposer, NgramProposer, NgramSettings, SpeculativeOptions, make_proposer,
                                 parse_speculative)
from jaxattn.speculative.options import FORMS
from tiny_models import drawn_params


@pytest.mark.parametrize("text, expected", [
    ("ngram", SpeculativeOptions("ngram")),
    ("ngram:k=2", SpeculativeOptions("ngram", k=2)),
    ("ngram:k=4,n_min=2,n_max=5", SpeculativeOptions("ngram", k=4, n_min=2, n_max=5)),
    ("ngram:n_max=2,adaptive=0", SpeculativeOptions("ngram", n_max=2, adaptive=False)),
    ("ngram:adaptive=1", SpeculativeOptions("ngram", adaptive=True)),
    ("ngram:adaptive=false", SpeculativeOptions("ngram", adaptive=False)),
    ("draft:runs/small", SpeculativeOptions("draft", draft="runs/small")),
    ("draft:runs/small,k=3", SpeculativeOptions("draft", k=3, draft="runs/small")),
    ("draft:k=3,adaptive=0,runs/small", SpeculativeOptions("draft", k=3, draft="runs/small", adaptive=False)),
    ("draft:C:/models/small.gguf", SpeculativeOptions("draft", draft="C:/models/small.gguf")),  # ':' in the path
    ("draft:runs/lr=3e-4,k=2", SpeculativeOptions("draft", k=2, draft="runs/lr=3e-4")),  # '=' in the path
])
def test_the_forms_parse(text, expected):
    assert parse_speculative(text) == expected


@pytest.mark.parametrize("text, bad", [
    ("", "unknown method ''"),
    ("medusa", "unknown method 'medusa', expected one of ngram, draft"),
    ("Ngram:k=4", "unknown method 'Ngram'"),
    ("ngram:", "nothing after ':'"),
    ("ngram:k=4,", "an empty item between commas"),
    ("ngram:k=4,,n_max=3", "an empty item between commas"),
    ("ngram:q=1", "unknown key 'q' for ngram, expected k, n_min, n_max, adaptive"),
    ("draft:DIR,n_max=3", "unknown key 'n_max' for draft, expected k, adaptive"),
    ("ngram:k=4,k=2", "k is given twice"),
    ("ngram:k=0", "k='0' must be a positive integer"),
    ("ngram:k=-1", "k='-1' must be a positive integer"),
    ("ngram:k=two", "k='two' must be a positive integer"),
    ("ngram:k=", "k='' must be a positive integer"),
    ("ngram:n_min=1.5", "n_min='1.5' must be a positive integer"),
    ("ngram:adaptive=yes", "adaptive='yes' must be 0 or 1"),
    ("ngram:n_min=3,n_max=2", "n_max must be >= n_min=3, got 2"),
    ("ngram:runs/small", "'runs/small' is not a key=value setting (ngram takes no path)"),
    ("ngram:K=4", "'K=4' is not a key=value setting"),
    ("draft", "draft needs the draft model's path, draft:DIR"),
    ("draft:k=4", "draft needs the draft model's path, draft:DIR"),
    ("draft:a,b", "one draft path, got 2: 'a', 'b'"),
])
def test_every_bad_spec_is_a_value_error_naming_it_and_the_accepted_forms(text, bad):
    with pytest.raises(ValueError) as err:
        parse_speculative(text)
    message = str(err.value)
    assert message.startswith(f"speculative decoding {text!r}: ") and bad in message
    assert message.endswith(f"(accepted: {FORMS})") and "\n" not in message


def test_a_spec_must_be_text():
    with pytest.raises(TypeError, match="parse_speculative takes a str, got int"):
        parse_speculative(4)


@pytest.mark.parametrize("kwargs, field", [
    (dict(method="lookup"), "method must be one of"),
    (dict(method="ngram", k=0), "k must be a positive int, got 0"),
    (dict(method="ngram", k=2.0), "k must be a positive int, got 2.0"),
    (dict(method="ngram", n_min=0), "n_min must be a positive int"),
    (dict(method="ngram", n_min=4, n_max=3), "n_max must be >= n_min=4, got 3"),
    (dict(method="draft"), "draft must name the draft model"),
    (dict(method="draft", draft=""), "draft must name the draft model"),
    (dict(method="ngram", draft="runs/small"), "draft goes with method 'draft', not 'ngram'"),
    (dict(method="ngram", adaptive=1), "adaptive must be a bool, got 1"),
])
def test_the_options_check_their_fields(kwargs, field):
    with pytest.raises(ValueError, match=f"^SpeculativeOptions.{field}"):
        SpeculativeOptions(**kwargs)


def test_ngram_settings_and_the_proposers():
    options = parse_speculative("ngram:k=3,n_min=2,n_max=4,adaptive=0")
    assert options.ngram_settings() == NgramSettings(n_min=2, n_max=4, k=3)
    assert options.describe() == "ngram k=3 n=2..4 (k fixed)"
    proposer = make_proposer(options)
    assert isinstance(proposer, NgramProposer) and proposer.k == 3
    config = ModelConfig(vocab_size=11, d_model=16, num_layers=1, num_heads=2, max_seq_len=32)
    draft = parse_speculative("draft:runs/small,k=2")
    assert draft.describe() == "draft runs/small k=2"
    proposer = make_proposer(draft, (drawn_params(config), config))
    assert isinstance(proposer, DraftProposer) and proposer.k == 2 and proposer.vocab_size == 11
    with pytest.raises(ValueError, match="method 'draft' needs the draft model loaded from 'runs/small'"):
        make_proposer(draft)
