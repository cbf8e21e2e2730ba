"""How every program ends (train/cli.py) and what it checks before work (train/outputs.py)."""

import errno
import re
import signal

import pytest

from train import cli, outputs


def ending(capsys, body, **kwargs):
    """(exit code, stderr) of `cli.guard` around `body`."""
    with pytest.raises(SystemExit) as stop:
        cli.guard("python -m train.example", body, **kwargs)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return stop.value.code, err


def raises(err):
    def body():
        raise err
    return body


def test_each_kind_of_ending_is_one_line_with_its_code(capsys):
    class Expected(RuntimeError):
        pass
    cases = [
        (cli.UsageError("--top-k must be >= 0"), 2, "error: --top-k must be >= 0 (see python -m train.example --help)"),
        (cli.Stopped("SIGINT at step 5: saved x"), 130, "stopped: SIGINT at step 5: saved x"),
        (KeyboardInterrupt(), 130, "stopped: interrupted before python -m train.example had finished"),
        (Expected("the run diverged\nat step 3"), 1, "error: the run diverged; at step 3"),
        (PermissionError(errno.EACCES, "Permission denied", "/some/file"), 1, "error: /some/file: Permission denied"),
        (MemoryError("cannot allocate"), 1, "error: out of memory: cannot allocate (a smaller batch, model or "
                                            "--max-new-tokens needs less)"),
    ]
    for err, code, line in cases:
        assert ending(capsys, raises(err), expected=(Expected,)) == (code, line + "\n")


def test_an_unexpected_exception_is_one_line_and_its_traceback_is_kept(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.delenv(cli.TRACEBACK_ENV, raising=False)
    monkeypatch.setattr(cli.tempfile, "tempdir", None)  # tempfile caches the directory: read TMPDIR again

    def buggy():
        return {}["missing"]
    code, err = ending(capsys, buggy)
    assert code == 1 and len(err.splitlines()) == 1
    match = re.fullmatch(r"error: unexpected KeyError: 'missing' \(a failure jaxattn does not expect; its "
                         r"traceback is in (\S+): please report it\)\n", err)
    assert match, err
    saved = open(match.group(1)).read()
    assert match.group(1).startswith(str(tmp_path)) and "Traceback" in saved and "def buggy" not in err
    assert "return {}[\"missing\"]" in saved


def test_sigterm_stops_like_ctrl_c(capsys):
    def terminated():
        signal.raise_signal(signal.SIGTERM)
    assert ending(capsys, terminated)[0] == 130
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # restored afterwards


def test_usage_errors_from_argparse_are_one_line(capsys):
    parser = cli.ArgumentParser(prog="python -m train.example")
    parser.add_argument("--n", type=int)
    code, err = ending(capsys, lambda: parser.parse_args(["--n", "many"]))
    assert code == 2 and err == ("error: argument --n: invalid int value: 'many' "
                                 "(see python -m train.example --help)\n")


def test_stop_signals_ask_once_and_stop_at_once_the_second_time():
    before = signal.getsignal(signal.SIGINT)  # Python's default, or SIG_IGN where a shell started us in the background
    with cli.StopSignals() as signals:
        signal.raise_signal(signal.SIGINT)
        assert signals.requested == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGTERM)
    assert signal.getsignal(signal.SIGINT) is before  # restored as it was


def test_outputs_are_checked_before_any_work(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("mine")
    assert outputs.check_file(tmp_path / "new" / "deeper" / "loss.png", "--loss-plot").name == "loss.png"
    assert not (tmp_path / "new").exists()  # nothing is made by a check
    for path, message in [(a_file / "sub" / "loss.png", f"--loss-plot {a_file / 'sub' / 'loss.png'}: {a_file} is "
                                                        "a file, so no folder can be made there"),
                          (tmp_path, f"--loss-plot {tmp_path} is a folder: give a file name")]:
        with pytest.raises(outputs.UnwritablePath) as info:
            outputs.check_file(path, "--loss-plot")
        assert str(info.value) == message
    with pytest.raises(outputs.UnwritablePath, match=f"--out {a_file} is a file, not a folder"):
        outputs.check_folder(a_file, "--out")
    with pytest.raises(cli.UsageError, match=r"--out maps.xyz: not an image type matplotlib writes \(.*png"):
        outputs.check_image_file("maps.xyz", "--out")
    assert a_file.read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


def test_a_folder_this_process_cannot_write_is_found_by_trying(tmp_path, monkeypatch):
    """(Simulated: the tests may run as root, who can write anywhere.)"""
    def refuse(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")
    monkeypatch.setattr(outputs.tempfile, "NamedTemporaryFile", refuse)
    with pytest.raises(outputs.UnwritablePath, match=rf"--out {tmp_path}/x/maps.png: cannot write in {tmp_path} "
                                                     r"\(Permission denied\)"):
        outputs.check_file(tmp_path / "x" / "maps.png", "--out")
