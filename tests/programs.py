"""What the program tests share: a program's `main` run in this process, and a tiny config to sample from."""

import re

from train import sample

CHARS = "\n !$&',-.3:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"  # Tiny Shakespeare's 65
TINY_TOML = """
[model]
vocab_size = 65
d_model = 16
num_layers = 1
num_heads = 2
max_seq_len = 16
init_std = 0.2

[train]
block_size = 16
"""


def call(capsys, main, *argv):
    """(exit code, or what `main` returned; stdout; stderr) of a program's `main` run in this process;
    no traceback and no unforeseen error (`train.cli`'s "error: unexpected TYPE...") may reach stderr."""
    try:
        code = main(list(argv))
    except SystemExit as stop:
        code = stop.code
    out, err = capsys.readouterr()
    assert "Traceback" not in err and not re.search(r"unexpected [A-Za-z]*(Error|Exception)", err)
    return code, out, err


def run_sample(capsys, *argv):
    """`call` of `python -m train.sample`."""
    return call(capsys, sample.main, *argv)


def tiny_sampling_config(tmp_path, monkeypatch) -> str:
    """A tiny config file, and a corpus holding exactly Tiny Shakespeare's characters where the program
    looks for it (JAXATTN_SHAKESPEARE); returns the config's path."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(CHARS * 3)
    monkeypatch.setenv("JAXATTN_SHAKESPEARE", str(corpus))
    config = tmp_path / "tiny.toml"
    config.write_text(TINY_TOML)
    return str(config)
