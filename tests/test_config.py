import json

import pytest

from train.config import CONFIG_DIR, ExperimentConfig, RuntimeConfig, TrainConfig, load_config, parse_override

BABY_VARIANTS = ["gqa", "mqa", "mla", "learned", "sinusoidal", "rope"]


def test_default_is_nanogpt_baby_run():
    cfg = load_config()
    m, t = cfg.model, cfg.train
    assert (m.num_layers, m.num_heads, m.d_model, m.dropout) == (4, 4, 128, 0.0)
    assert (t.block_size, t.batch_size, t.max_iters, t.lr, t.min_lr) == (64, 12, 2000, 1e-3, 1e-4)
    assert (t.lr_decay_iters, t.warmup_iters, t.beta2, t.eval_interval, t.eval_iters) == (2000, 100, 0.99, 250, 20)


def test_gpu_config_and_every_file_loads():
    gpu = load_config("shakespeare_char")
    assert (gpu.model.num_layers, gpu.model.num_heads, gpu.model.d_model) == (6, 6, 384)
    assert (gpu.train.block_size, gpu.train.batch_size, gpu.model.dropout, gpu.train.max_iters) == (256, 64, 0.2, 5000)
    for path in CONFIG_DIR.glob("*.toml"):
        assert load_config(path.stem).name == path.stem


def test_baby_variants_inherit_and_change_one_thing():
    baby = load_config()
    got = {v: load_config(f"shakespeare_char_baby_{v}") for v in BABY_VARIANTS}
    assert got["gqa"].model.num_kv_heads == 2 and got["mqa"].model.num_kv_heads == 1
    assert got["mla"].model.attention == "mla" and got["mla"].model.mla.kv_lora_rank == 32
    for p in ("learned", "sinusoidal", "rope"):
        assert got[p].model.positions == p
        assert got[p].model.replace(positions=baby.model.positions) == baby.model
    assert got["gqa"].train.replace(out_dir=baby.train.out_dir) == baby.train
    assert all(g.runtime == baby.runtime for g in got.values())


def test_overrides_coerce_types():
    cfg = load_config(overrides=["model.d_model=256", "train.lr=3e-4", "train.min_lr=0",
                                 "model.num_kv_heads=none", "train.data_path=/tmp/x.txt",
                                 "train.tokenizer=byte", "train.checkpoint=false",
                                 'model.rope_scaling={kind = "linear", factor = 2}'])
    assert cfg.model.d_model == 256 and cfg.train.lr == 3e-4
    assert isinstance(cfg.train.min_lr, float) and cfg.train.min_lr == 0.0
    assert cfg.model.num_kv_heads == cfg.model.num_heads and cfg.train.data_path == "/tmp/x.txt"
    assert cfg.train.tokenizer == "byte" and cfg.train.checkpoint is False
    assert cfg.model.rope_scaling.kind == "linear" and cfg.model.rope_scaling.factor == 2.0


@pytest.mark.parametrize("override, error, match", [
    ("model.d_modl=256", ValueError, r"unknown model keys \['d_modl'\]"),
    ("train.learning_rate=1", ValueError, "unknown train keys"),
    ("model.d_model=big", TypeError, "model.d_model must be an integer"),
    ("model.d_model=2.5", TypeError, "model.d_model must be an integer"),
    ("train.lr=fast", TypeError, "train.lr must be a number"),
    ("train.checkpoint=1", TypeError, "must be a bool"),
    ("model.positions=alibi", ValueError, r"model.positions must be one of \('learned'"),
    ("train.tokenizer=word", ValueError, "train.tokenizer must be one of"),
    ("train.beta2=1.5", ValueError, r"beta2 must be in \(0, 1\)"),
    ("train.batch_size=0", ValueError, "batch_size must be positive"),
    ("model.num_kv_heads=3", ValueError, "multiple of"),
    ("d_model=3", ValueError, "TABLE.FIELD=VALUE"),
    ("optim.lr=3", ValueError, "TABLE.FIELD=VALUE"),
    ("model.attention=mla", ValueError, r"unknown model keys \['attention'\]"),
    ("model.mla={kv_lora_rank = 0}", ValueError, "MLAConfig.kv_lora_rank must be a positive integer"),
    ("model.mla={rank = 8}", ValueError, r"unknown model.mla keys \['rank'\]"),
    ("runtime.matmul=bf16", ValueError, r"RuntimeConfig.matmul must be one of \('xla', 'bfloat16', 'bfloat16_cpu', 'auto'\)"),
    ("runtime.data_parallel=0", ValueError, "data_parallel must be a positive integer or 'auto'"),
    ("runtime.mesh=data2", ValueError, r"each item must be AXIS:SIZE with AXIS one of \('data', 'fsdp', 'tensor'\)"),
    ("runtime.mesh=data:0", ValueError, "mesh axis data must have a positive integer size, got 0"),
    ("runtime.cpu_devices=0", ValueError, "cpu_devices must be a positive integer or 'auto'"),
    ("train.block_size=128", ValueError, r"model.max_seq_len=64 is shorter than train.block_size=128"),
    ("model.layer_pattern={local = true}", TypeError, "model.layer_pattern must be an array"),
    ("model.layer_pattern=[{locl = true}]", ValueError, r"unknown model.layer_pattern\[0\] keys \['locl'\]"),
    ("model.layer_pattern=[{rope = 1}]", TypeError, r"model.layer_pattern\[0\].rope must be a bool"),
    ("model.layer_pattern=[{local = true}]", ValueError, "local layers but sliding_window is None"),
    ("model.qk_norm=both", TypeError, r"model.qk_norm must be one of"),
    ("model.norm_placement=after", ValueError, r"model.norm_placement must be one of \('pre', 'sandwich', 'post'\)"),
])
def test_validation_errors(override, error, match):
    with pytest.raises(error, match=match):
        load_config(overrides=[override])


def test_unknown_keys_in_files(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[model]\nd_model = 64\n[optimizer]\nlr = 1\n')
    with pytest.raises(ValueError, match=r"unknown config file bad.toml keys \['optimizer'\]"):
        load_config(bad)
    bad.write_text('[train]\nbatchsize = 4\n')
    with pytest.raises(ValueError, match=r"unknown train keys \['batchsize'\]"):
        load_config(bad)
    with pytest.raises(FileNotFoundError, match="available: .*shakespeare_char_baby"):
        load_config("no_such_experiment")


def test_json_round_trip():
    cfg = load_config("shakespeare_char_baby_gqa", ["model.rope_scaling={kind='ntk', factor=4.0}"])
    again = ExperimentConfig.from_dict(json.loads(cfg.to_json()))
    assert again == cfg


def test_runtime_table_and_overrides():
    cfg = load_config(overrides=["runtime.matmul=bfloat16", "runtime.mesh=data:3", "runtime.attention=xla",
                                 'runtime.xla_flags="--xla_cpu_enable_fast_math=false"'])
    assert cfg.runtime == RuntimeConfig(matmul="bfloat16", mesh="data:3", attention="xla",
                                        xla_flags="--xla_cpu_enable_fast_math=false")
    assert cfg.runtime.requested_kernels().decode == "auto"
    assert load_config().runtime == RuntimeConfig()  # the default config asks for "auto" everywhere
    assert load_config("shakespeare_char").runtime.mesh == "auto"  # no CPU devices asked for on a GPU


def test_mla_as_an_inline_table():
    cfg = load_config(overrides=["model.mla={kv_lora_rank = 16, q_lora_rank = 8}"])
    assert cfg.model.mla.kv_lora_rank == 16 and cfg.model.mla.q_lora_rank == 8 and cfg.model.mla.v_head_dim == 32


def test_parse_override_values():
    assert parse_override("train.sample_prompt='ROMEO:'") == ("train", "sample_prompt", "ROMEO:")
    assert parse_override("train.out_dir=runs/x") == ("train", "out_dir", "runs/x")
    assert parse_override("model.dropout=0.1") == ("model", "dropout", 0.1)
    assert TrainConfig().replace(seed=3).seed == 3


def test_layer_kinds_as_arrays_of_tables(tmp_path):
    """Gemma 3's pattern written once in a file: `[[model.layer_pattern]]` tables, the new model fields."""
    path = tmp_path / "gemma_like.toml"
    path.write_text('base = "shakespeare_char_baby"\n[model]\nnorm = "rmsnorm"\nsliding_window = 16\n'
                    'qk_norm = true\nnorm_placement = "sandwich"\nnorm_unit_offset = true\n'
                    'attn_logits_soft_cap = 50\nresidual = "parallel"\n'
                    + '[[model.layer_pattern]]\nlocal = true\nrope_theta = 10000\nrope_scaling = "none"\n' * 5
                    + '[[model.layer_pattern]]\nrope_theta = 1e6\nrope_scaling = {kind = "linear", factor = 8}\n')
    cfg = load_config(path)
    m = cfg.model
    assert len(m.layer_pattern) == 6 and m.qk_norm == "head" and m.attn_logits_soft_cap == 50.0
    assert [m.layer_attention(i).window for i in range(4)] == [16, 16, 16, 16]
    assert m.layer_pattern[5].rope_scaling.factor == 8.0 and m.layer_pattern[0].rope_scaling == "none"
    assert ExperimentConfig.from_dict(json.loads(cfg.to_json())) == cfg  # what a run saves loads back
    inline = load_config(overrides=["model.sliding_window=8", "model.layer_pattern=[{local = true}, {rope = false}]"])
    assert [k.local for k in inline.model.layer_pattern] == [True, False] and not inline.model.layer_pattern[1].rope
