"""Settings that cannot work are refused before anything runs: non-finite numbers,
a Muon momentum warm-up that goes down, a target loss that is no loss, a WSD run that ends inside
its warmup, empty paths; `--set` tables merge into the config's; `--resume` where there is no run,
and `--resume --overwrite`.

Through `load_config` and `python -m train.tiny_lm` in this process. Nothing here trains: a refused
setting must stop the program before JAX starts, which `no_run` checks by making the runtime's
start itself fail the test.
"""

import dataclasses
import math

import pytest

from jaxattn.config import ModelConfig
from jaxattn.rope import RopeScaling
from train import tiny_lm
from train.config import ExperimentConfig, TrainConfig, load_config
from train.run import runtime as runtime_lib

HELP = "(see python -m train.tiny_lm --help)"
TINY = ["model.d_model=32", "model.num_layers=2", "model.num_heads=2", "model.max_seq_len=16",
        "train.batch_size=4", "train.block_size=16", "train.eval_iters=4", "train.eval_interval=10",
        "train.warmup_iters=5", "train.max_iters=10", "train.lr_decay_iters=10", "train.sample_tokens=0",
        "train.plot=false", "runtime.mesh=data:1"]


class RunStarted(BaseException):
    """Raised instead of starting the runtime: not an Exception, so the program's guard lets it through."""


@pytest.fixture
def no_run(monkeypatch):
    def started(*args, **kwargs):
        raise RunStarted("the setting was accepted: the runtime was about to start")
    monkeypatch.setattr(runtime_lib, "start", started)


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text("To be, or not to be, that is the question.\n" * 50)
    return path


def cli(capsys, *argv):
    """`python -m train.tiny_lm ARGV` in this process: (exit code, stderr)."""
    with pytest.raises(SystemExit) as stop:
        tiny_lm.main(list(argv))
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return stop.value.code, err


def float_fields(kind) -> list[str]:
    fields = kind.model_fields.items() if isinstance(kind, type) and hasattr(kind, "model_fields") else \
        ((f.name, f) for f in dataclasses.fields(kind))
    annotations = ((name, str(getattr(f, "annotation", None) or f.type)) for name, f in fields)
    return [name for name, annotation in annotations
            if "float" in annotation and "Literal" not in annotation]  # a Literal is a choice of names


# ------------------------------------------------------------------------------------ numbers

def test_train_lr_and_muon_lr_inf_stop_before_anything_runs(capsys, no_run):
    for field in ("lr", "muon_lr"):
        code, err = cli(capsys, "--set", f"train.{field}=inf")
        assert (code, err) == (2, f"error: train.{field} must be a finite number, got inf {HELP}\n")


def test_every_float_setting_must_be_finite():
    """Every float of [train] and [model], and of the model's tables: inf, -inf and NaN name the field."""
    cases = [(f"{table}.{name}", value) for table, kind in (("train", TrainConfig), ("model", ModelConfig))
             for name in float_fields(kind) for value in ("inf", "-inf", "nan")]
    cases += [(f"model.rope_scaling.{name}", value) for name in float_fields(RopeScaling) for value in ("inf", "nan")]
    cases += [(f"model.moe.{name}", value) for name in ("aux_loss_coef", "z_loss_coef", "routed_scaling_factor")
              for value in ("inf", "nan")]
    assert len(cases) >= 3 * 20 + 2 * 7  # the fields were found
    accepted, wrong = [], []
    for key, value in cases:
        try:
            load_config("shakespeare_char_baby_moe", ["model.rope_scaling={kind = 'llama3', factor = 8}",
                                                      f"{key}={value}"])
        except (ValueError, TypeError) as err:
            if str(err) != f"{key} must be a finite number, got {value}":
                wrong.append((key, value, str(err)))
            continue
        accepted.append((key, value))
    assert not accepted, accepted
    assert not wrong, wrong


def test_a_finite_large_number_is_still_accepted():
    config = load_config(overrides=["train.grad_clip=1e30", "model.rope_theta=1e6", "train.target_loss=0"])
    assert config.train.grad_clip == 1e30 and config.model.rope_theta == 1e6 and config.train.target_loss == 0.0


# ------------------------------------------------------------------------------------ settings between settings

def test_muon_momentum_start_above_muon_momentum_is_refused():
    with pytest.raises(ValueError, match=r"^train: muon_momentum_start=0.97 is above muon_momentum=0.95: the "
                                         r"warm-up over muon_momentum_warmup=300 steps would lower the momentum"):
        load_config(overrides=["train.optimizer=muon", "train.muon_momentum_start=0.97"])
    with pytest.raises(ValueError, match="^TrainConfig: muon_momentum_start=0.9 is above muon_momentum=0.8"):
        TrainConfig(muon_momentum_start=0.9, muon_momentum=0.8)
    flat = load_config(overrides=["train.muon_momentum_start=0.95"]).train  # equal: no warm-up to speak of
    assert flat.muon_momentum_start == flat.muon_momentum
    assert load_config(overrides=["train.muon_momentum_start=0.97", "train.muon_momentum_warmup=0"])  # unused


@pytest.mark.parametrize("flag", ["nan", "-1", "-inf"])
def test_target_loss_must_be_a_loss(capsys, no_run, flag):
    code, err = cli(capsys, f"--target-loss={flag}")
    expected = {"nan": "train.target_loss must be a finite number, got nan",
                "-inf": "train.target_loss must be a finite number, got -inf",
                "-1": "train.target_loss must be greater than or equal to 0 (a loss), got -1.0"}[flag]
    assert (code, err) == (2, f"error: {expected} {HELP}\n")


def test_wsd_ending_inside_its_warmup_is_refused():
    with pytest.raises(ValueError, match=r"^train: schedule 'wsd' with warmup_iters=100 >= max_iters=100: the run "
                                         r"would end inside the warmup"):
        load_config(overrides=["train.schedule=wsd", "train.max_iters=100"])
    with pytest.raises(ValueError, match="warmup_iters=300 >= max_iters=200"):
        load_config(overrides=["train.schedule=wsd", "train.max_iters=200", "train.warmup_iters=300"])
    assert load_config(overrides=["train.schedule=wsd", "train.max_iters=101"]).train.max_iters == 101
    assert load_config(overrides=["train.max_iters=50"]).train.schedule == "cosine"  # nanoGPT's: as nanoGPT


def test_a_config_a_run_saved_still_loads():
    """The checks between settings apply to configs being made: a run saved before them still reads
    (train.sample, export and resume read its config.json); a non-finite number never did train."""
    saved = load_config().to_dict()
    saved["train"].update(out_dir="", schedule="wsd", max_iters=50, target_loss=-1.0, muon_momentum_start=0.97)
    config = ExperimentConfig.from_dict(saved)
    assert (config.train.out_dir, config.train.target_loss, config.train.muon_momentum_start) == ("", -1.0, 0.97)
    with pytest.raises(ValueError, match="out_dir must be a non-empty path"):
        ExperimentConfig.from_dict(saved, saved=False)
    with pytest.raises(ValueError, match="^train.lr must be a finite number, got inf$"):
        ExperimentConfig.from_dict({**saved, "train": {**saved["train"], "lr": math.inf}})


# ------------------------------------------------------------------------------------ paths

@pytest.mark.parametrize("argv, field", [
    (["--set", "train.out_dir="], "train.out_dir"),
    (["--set", "train.out_dir=''"], "train.out_dir"),
    (["--out-dir", ""], "train.out_dir"),
    (["--set", "train.data_path="], "train.data_path"),
    (["--data", ""], "train.data_path"),
])
def test_an_empty_path_is_a_usage_error_and_nothing_is_written(capsys, no_run, tmp_path, monkeypatch, argv, field):
    monkeypatch.chdir(tmp_path)  # where an empty out_dir would put the run
    code, err = cli(capsys, *argv)
    assert (code, err) == (2, f"error: {field} must be a non-empty path, got '' {HELP}\n")
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------ --set tables

def test_an_inline_table_merges_into_the_configs():
    file = load_config("shakespeare_char_baby_moe").model.moe
    merged = load_config("shakespeare_char_baby_moe", ["model.moe={experts_per_token = 1}"]).model.moe
    assert merged == dataclasses.replace(file, experts_per_token=1)  # the file's coefficients are kept
    assert (merged.aux_loss_coef, merged.z_loss_coef, merged.expert_hidden) == (0.01, 0.001, 168)
    fresh = load_config("shakespeare_char_baby_moe", ["model.moe=none", "model.moe={experts_per_token = 1}"]).model.moe
    assert fresh.aux_loss_coef != file.aux_loss_coef  # none first: the table starts from nothing
    mla = load_config("shakespeare_char_baby_mla", ["model.mla={q_lora_rank = 8}"]).model.mla
    assert (mla.q_lora_rank, mla.kv_lora_rank, mla.v_head_dim) == (8, 32, 32)


def test_a_dotted_key_sets_one_key_of_a_table():
    file = load_config("shakespeare_char_baby_moe").model.moe
    dotted = load_config("shakespeare_char_baby_moe", ["model.moe.experts_per_token=1", "model.moe.z_loss_coef=0"])
    assert dotted.model.moe == dataclasses.replace(file, experts_per_token=1, z_loss_coef=0.0)
    rope = load_config(overrides=["model.rope_scaling.kind=linear", "model.rope_scaling.factor=2"]).model.rope_scaling
    assert (rope.kind, rope.factor) == ("linear", 2.0)  # a table the file has not set is made from its keys
    with pytest.raises(ValueError, match=r"^unknown model.moe keys \['experts'\]$"):
        load_config("shakespeare_char_baby_moe", ["model.moe.experts=9"])
    with pytest.raises(ValueError, match=r"^override 'model.d_model.x=1': model.d_model is 128, not a table: "
                                         r"set it whole, model.d_model=VALUE$"):
        load_config(overrides=["model.d_model.x=1"])


def test_a_dotted_key_through_the_program_names_the_tables_field(capsys, no_run):
    code, err = cli(capsys, "--config", "shakespeare_char_baby_moe", "--set", "model.moe.experts_per_token=9")
    assert (code, err) == (2, "error: model.moe: MoEConfig.experts_per_token must be in [1, num_experts=8], got 9 "
                              f"{HELP}\n")


# ------------------------------------------------------------------------------------ --resume

def test_resume_where_there_is_no_run_says_so_and_makes_nothing(capsys, text_file, tmp_path):
    never = tmp_path / "never" / "made"
    code, err = cli(capsys, "--set", *TINY, "--data", str(text_file), "--quiet", "--out-dir", str(never), "--resume")
    assert (code, err) == (1, f"error: --resume: no checkpoint to continue: there is no run in {never} (no such "
                              "directory); leave out --resume to start one\n")
    assert not (tmp_path / "never").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    code, err = cli(capsys, "--set", *TINY, "--data", str(text_file), "--quiet", "--out-dir", str(empty), "--resume")
    assert code == 1 and f"there is no run in {empty} (none of config.json, " in err
    assert list(empty.iterdir()) == []  # no .lock left behind


def test_resume_and_overwrite_together_is_a_usage_error(capsys, text_file, tmp_path):
    out = tmp_path / "run"
    code, err = cli(capsys, "--set", *TINY, "--data", str(text_file), "--quiet", "--out-dir", str(out),
                    "--resume", "--overwrite")
    assert (code, err) == (2, "error: --resume continues the run in --out-dir, --overwrite replaces it: pick one "
                              f"{HELP}\n")
    assert not out.exists()
