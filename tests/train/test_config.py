import json

import pytest

from jaxattn.axes import MeshShape
from jaxattn.config import ModelConfig
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
    ("model.d_modl=256", ValueError, r"unknown model keys \['d_modl'\]; known keys: \[.*'d_model'"),
    ("train.learning_rate=1", ValueError, r"unknown train keys \['learning_rate'\]; known keys: \[.*'lr'"),
    ("model.d_model=big", TypeError, "model.d_model must be a valid integer, got 'big'"),
    ("model.d_model=2.5", TypeError, "model.d_model must be a valid integer, got 2.5"),
    ("model.d_model=true", TypeError, "model.d_model must be a valid integer, got True"),
    ("train.lr=fast", TypeError, "train.lr must be a valid number, got 'fast'"),
    ('train.lr="3e-4"', TypeError, "train.lr must be a valid number, got '3e-4'"),  # a string, not a number
    ("train.checkpoint=1", TypeError, "train.checkpoint must be a valid boolean, got 1"),
    ("train.out_dir=3", TypeError, "train.out_dir must be a valid string, got 3"),
    ("model.positions=alibi", ValueError, "model.positions must be 'learned', 'sinusoidal', 'rope' or 'none', got 'alibi'"),
    ("train.tokenizer=word", ValueError, "train.tokenizer must be 'char', 'byte', 'bpe' or 'hf'"),
    ("train.beta2=1.5", ValueError, "train.beta2 must be less than 1, got 1.5"),
    ("train.batch_size=0", ValueError, "train.batch_size must be greater than 0, got 0"),
    ("train.seed=-1", ValueError, "train.seed must be greater than or equal to 0, got -1"),
    ("train.min_lr=0.1", ValueError, r"train: min_lr=0.1 exceeds lr=0.001"),
    ("model.num_kv_heads=3", ValueError, "model: ModelConfig.num_heads=4 must be a multiple of num_kv_heads=3"),
    ("d_model=3", ValueError, "TABLE.FIELD=VALUE"),
    ("optim.lr=3", ValueError, "TABLE.FIELD=VALUE"),
    ("model.attention=mla", ValueError, r"unknown model keys \['attention'\]"),
    ("model.mla={kv_lora_rank = 0}", ValueError, "model.mla: MLAConfig.kv_lora_rank must be a positive integer"),
    ("model.mla={rank = 8}", ValueError, r"^unknown model.mla keys \['rank'\]$"),
    ("model.rope_scaling=2", TypeError, r"model.rope_scaling must be a table, got 2"),
    ("runtime.matmul=bf16", ValueError, r"runtime.matmul must be 'xla', 'bfloat16', 'bfloat16_cpu', 'native_cpu' or 'auto', got 'bf16'"),
    ("runtime.data_parallel=2", ValueError, r"unknown runtime keys \['data_parallel'\]; known keys: \[.*'mesh'"),
    ("runtime.mesh=data2", ValueError,
     r"runtime.mesh: mesh 'data2': each item must be AXIS:SIZE with AXIS one of \('data', 'fsdp', 'tensor'\)"),
    ("runtime.mesh=data:0", ValueError, "runtime.mesh: mesh axis data must have a positive integer size, got 0"),
    ("runtime.mesh=2", TypeError, r'runtime.mesh must be "auto" or a mesh like "data:2,fsdp:2", got 2'),
    ("runtime.cpu_devices=0", ValueError, "runtime.cpu_devices must be greater than 0 or 'auto', got 0"),
    ("runtime.cpu_devices=true", TypeError, "runtime.cpu_devices must be a valid integer or 'auto', got True"),
    ("train.block_size=128", ValueError, r"^model.max_seq_len=64 is shorter than train.block_size=128$"),
    ("model.layer_pattern={local = true}", TypeError, "model.layer_pattern must be a valid array"),
    ("model.layer_pattern=[{locl = true}]", ValueError, r"unknown model.layer_pattern\[0\] keys \['locl'\]"),
    ("model.layer_pattern=[{rope = 1}]", TypeError, r"model.layer_pattern\[0\].rope must be a valid boolean, got 1"),
    ("model.layer_pattern=[{rope_scaling = 'x'}]", TypeError,
     r"model.layer_pattern\[0\].rope_scaling must be a table or 'none', got 'x'"),
    ("model.layer_pattern=[{local = true}]", ValueError, "local layers but sliding_window is None"),
    ("model.qk_norm=both", ValueError, r"model.qk_norm must be 'none', 'head' or 'full' or a valid boolean, got 'both'"),
    ("model.norm_placement=after", ValueError, r"model.norm_placement must be 'pre', 'sandwich' or 'post'"),
])
def test_validation_errors_are_one_line_naming_the_field(override, error, match):
    with pytest.raises(error, match=match) as caught:
        load_config(overrides=[override])
    assert "\n" not in str(caught.value) and "pydantic" not in str(caught.value)


def test_every_bad_field_is_named_on_the_one_line():
    with pytest.raises(TypeError) as caught:
        load_config(overrides=["train.lr=fast", "model.d_model=x", "runtime.matmul=bf16"])
    assert str(caught.value) == ("model.d_model must be a valid integer, got 'x'; train.lr must be a valid number, "
                                 "got 'fast'; runtime.matmul must be 'xla', 'bfloat16', 'bfloat16_cpu', 'native_cpu' or "
                                 "'auto', got 'bf16'")
    with pytest.raises(ValueError, match=r"^unknown train keys \['lrr', 'sed'\]; known keys: \["):
        load_config(overrides=["train.lrr=1", "train.sed=2"])


@pytest.mark.parametrize("build, error, match", [
    (lambda: TrainConfig(lr="fast"), TypeError, "^TrainConfig.lr must be a valid number, got 'fast'$"),
    (lambda: TrainConfig(lr=1e-3, min_lr=1e-2), ValueError, "^TrainConfig: min_lr=0.01 exceeds lr=0.001$"),
    (lambda: TrainConfig(learning_rate=1), ValueError, r"^unknown TrainConfig keys \['learning_rate'\]$"),
    (lambda: RuntimeConfig(mesh="data:x"), ValueError, "^RuntimeConfig.mesh: mesh 'data:x': each item"),
    (lambda: TrainConfig().replace(batch_size=0), ValueError, "^TrainConfig.batch_size must be greater than 0"),
    (lambda: load_config().replace(train=TrainConfig(block_size=128)), ValueError, "^model.max_seq_len=64 is shorter"),
])
def test_tables_built_in_python_raise_the_same_one_line_errors(build, error, match):
    with pytest.raises(error, match=match):
        build()


def test_unknown_keys_in_files(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[model]\nd_model = 64\n[optimizer]\nlr = 1\n')
    with pytest.raises(ValueError, match=r"config file bad.toml: unknown keys \['optimizer'\]"):
        load_config(bad)
    bad.write_text('[train]\nbatchsize = 4\n')
    with pytest.raises(ValueError, match=r"unknown train keys \['batchsize'\]"):
        load_config(bad)
    with pytest.raises(FileNotFoundError, match="available: .*shakespeare_char_baby"):
        load_config("no_such_experiment")
    bad.write_text('[train]\nlr = 1e-3\nbatch_size = "many"\n')
    with pytest.raises(TypeError, match="^train.batch_size must be a valid integer, got 'many'$"):
        load_config(bad)
    bad.write_text('[train]\nlr 1e-3\n')
    with pytest.raises(ValueError, match=r"bad.toml is not valid TOML: .*\(at line 2, column 4\)$") as caught:
        load_config(bad)
    assert "\n" not in str(caught.value)


def test_json_round_trip():
    cfg = load_config("shakespeare_char_baby_gqa", ["model.rope_scaling={kind='ntk', factor=4.0}"])
    again = ExperimentConfig.from_dict(json.loads(cfg.to_json()))
    assert again == cfg


def test_a_saved_config_with_the_older_moe_names_reads_as_todays():
    """Before the routed experts' function was named by its maths, GPT-OSS's was activation="gptoss"."""
    config = load_config(overrides=["model.num_layers=2", "model.moe={num_experts = 4, experts_per_token = 2, "
                                    "activation = 'clamped_swiglu', expert_bias = true, gate_up_interleaved = true, "
                                    "swiglu_limit = 5.0}"])
    saved = json.loads(config.to_json())
    moe = saved["model"]["moe"]
    for name in ("expert_bias", "gate_up_interleaved", "swiglu_alpha"):
        del moe[name]
    moe.update(activation="gptoss", gptoss_limit=moe.pop("swiglu_limit"), gptoss_alpha=1.702)
    assert ExperimentConfig.from_dict(saved) == config
    assert ModelConfig.from_dict(saved["model"]) == config.model


def test_runtime_table_and_overrides():
    cfg = load_config(overrides=["runtime.matmul=bfloat16", "runtime.mesh=data:3", "runtime.attention=xla",
                                 'runtime.xla_flags="--xla_cpu_enable_fast_math=false"'])
    assert cfg.runtime == RuntimeConfig(matmul="bfloat16", mesh="data:3", attention="xla",
                                        xla_flags="--xla_cpu_enable_fast_math=false")
    assert cfg.runtime.mesh == MeshShape(data=3)  # the text is parsed once, when the config is built
    assert cfg.to_dict()["runtime"]["mesh"] == "data:3,fsdp:1,tensor:1"  # and saved as text
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
