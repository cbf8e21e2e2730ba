"""The KV pool's size against the memory there is (`jaxattn.serving.kv_memory`): a default that fits a share of
what is available, a size asked for beyond it refused in one line before anything is allocated, by the
engine and by `python -m train.serve`."""

import pytest

import jax
from jaxattn.serving import Engine, EngineConfig
from jaxattn.serving.kv_memory import CPU_CAP, available_bytes, pool_plan
from server_process import tiny_server_args
from tiny_models import drawn_params, tiny_config
from train import serve

TOKEN = 1024  # bytes a token's keys and values take, all layers
GIB = 2**30


def test_the_default_is_the_full_need_when_it_fits_and_a_share_of_what_is_available_when_not():
    ec = EngineConfig(max_seqs=32, page_size=16)
    full = pool_plan(ec, TOKEN, 8192, available=100 * GIB)
    assert full.pages == 32 * 512 and full.per_row == 8192 and full.reason.startswith("the full need")
    assert pool_plan(ec, TOKEN, 8192, available=None).pages == full.pages  # nothing known: as asked
    small = pool_plan(ec, TOKEN, 8192, available=GIB // 2)  # the full need is 256 MiB, a quarter of 512 is 128
    assert small.pages * 16 * TOKEN == GIB // 8 and small.per_row == small.pages // 32 * 16 == 8192 // 2
    assert "25% of the 0.5 GiB available" in small.reason
    capped = pool_plan(ec, 64 * TOKEN, 8192, available=64 * GIB)  # a quarter would be 16 GiB: 4 GiB at most
    assert capped.pages * 16 * 64 * TOKEN == CPU_CAP
    device = pool_plan(ec, 64 * TOKEN, 8192, available=10 * GIB, platform="gpu")
    assert device.pages * 16 * 64 * TOKEN == int(0.7 * 10 * GIB) // (16 * 64 * TOKEN) * 16 * 64 * TOKEN
    tight = pool_plan(ec, TOKEN, 8192, available=20 * 2**20)  # a quarter holds less than one sequence: one
    assert tight.pages == 512 and tight.per_row == 256


@pytest.mark.parametrize("changes, message", [
    (dict(kv_memory_gib=64.0), r"kv_memory_gib=64.0 is a KV cache of 64.0 GiB, more than the 8.0 GiB this machine"),
    (dict(num_pages=10**6), r"num_pages=1000000 is a KV cache of 15.3 GiB, more than the 8.0 GiB"),
])
def test_a_size_asked_for_beyond_what_is_available_is_refused_naming_both(changes, message):
    with pytest.raises(ValueError, match=message):
        pool_plan(EngineConfig(**changes), TOKEN, 8192, available=8 * GIB)
    with pytest.raises(ValueError, match="lower max_model_len"):  # not even one sequence fits
        pool_plan(EngineConfig(), TOKEN, 8192, available=4 * 2**20)


def test_the_engine_refuses_a_pool_larger_than_the_machine_before_allocating_it():
    config = tiny_config("gqa", positions="rope", vocab_size=32, max_seq_len=64)
    params = drawn_params(config, seed=0)
    too_much = available_bytes(jax.devices()[0])
    with pytest.raises(ValueError, match="more than the .* GiB this machine has available"):
        Engine(params, config, EngineConfig(kv_memory_gib=2 * too_much / GIB))  # would take twice the memory


def test_train_serve_refuses_a_kv_memory_larger_than_the_machine_in_one_line(capsys, tmp_path):
    with pytest.raises(SystemExit) as exited:
        serve.main(tiny_server_args(tmp_path) + ["--port", "0", "--kv-memory", "100000"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and err[-1].startswith("error: kv_memory_gib=100000.0 is a KV cache of")
    assert "available" in err[-1]
