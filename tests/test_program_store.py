"""Traced programs kept between runs (`jaxattn.program_store`): a program read back computes what the traced
one does, with the same donation; its key changes with the context, the shapes, the donation and the
library's source; a damaged file is traced again with a warning, a folder that cannot be written keeps
nothing and says so once; the engine's step programs read back give the same greedy tokens, and a second
process finds them."""

import os
import subprocess
import sys
from pathlib import Path

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_models import drawn_params, tiny_config

from jaxattn import program_store
from jaxattn.program_store import ProgramStore, program_key
from jaxattn.serving import Engine, EngineConfig, SamplingParams

ROOT = Path(__file__).resolve().parents[1]


def step(params, pool, x):
    """A toy step: a pool updated in place (donated), and a tree of outputs."""
    y = jnp.tanh(x @ params["w"] + params["b"][None])
    return pool.at[0].set(y.sum()), {"y": y, "extremes": (y.max(), y.min())}


def arguments():
    params = {"w": jnp.linspace(-1, 1, 64).reshape(8, 8), "b": jnp.arange(8.0) / 8}
    return params, jnp.zeros(16), jnp.ones((3, 8))


def run(store: ProgramStore, context: str = "toy"):
    args = arguments()
    compiled = store.program("toy-step", context, step, args, donate_argnums=(1,)).lower(*args).compile()
    pool = args[1]
    return compiled(*args), pool


def test_a_program_read_back_computes_what_the_traced_one_does_with_its_donation(tmp_path):
    expected = jax.jit(step)(*arguments())
    first = ProgramStore(tmp_path)
    (pool, out), donated = run(first)
    assert first.counts == {"read": 0, "written": 1} and len(list(tmp_path.glob("*.jaxexport"))) == 1
    second = ProgramStore(tmp_path)
    (pool_again, out_again), donated_again = run(second)
    assert second.counts == {"read": 1, "written": 0}
    assert donated.is_deleted() and donated_again.is_deleted()  # the pool given up, as jit(donate_argnums) does
    assert jax.tree.structure(out_again) == jax.tree.structure(expected[1])
    for got in (out, out_again):
        np.testing.assert_allclose(got["y"], expected[1]["y"], rtol=1e-6)
        np.testing.assert_allclose(got["extremes"], expected[1]["extremes"], rtol=1e-6)
    np.testing.assert_allclose(pool_again, expected[0], rtol=1e-6)


def test_the_key_holds_the_context_shapes_donation_and_library_source(monkeypatch):
    args = arguments()
    key = program_key("toy-step", "config A", args, (1,))
    assert key == program_key("toy-step", "config A", arguments(), (1,))  # same inputs: same file
    others = {program_key("toy-step", "config B", args, (1,)),
              program_key("toy-step", "config A", (args[0], jnp.zeros(17), args[2]), (1,)),
              program_key("toy-step", "config A", (args[0], args[1], args[2].astype(jnp.bfloat16)), (1,)),
              program_key("toy-step", "config A", args, ())}
    monkeypatch.setattr(flax, "__version__", "another flax")  # Flax traces the modules
    others.add(program_key("toy-step", "config A", args, (1,)))
    monkeypatch.setattr(program_store, "source_digest", lambda: "an edited library")
    others.add(program_key("toy-step", "config A", args, (1,)))
    assert key not in others and len(others) == 6


def test_the_source_digest_follows_the_library_s_files(tmp_path):
    (tmp_path / "maths.py").write_text("x = 1\n")
    (tmp_path / "notes.txt").write_text("not code\n")
    before = program_store.source_digest.__wrapped__(tmp_path)
    (tmp_path / "notes.txt").write_text("other notes\n")
    assert program_store.source_digest.__wrapped__(tmp_path) == before
    (tmp_path / "maths.py").write_text("x = 2\n")
    assert program_store.source_digest.__wrapped__(tmp_path) != before


def test_a_damaged_file_is_traced_again_with_a_warning_and_rewritten(tmp_path):
    run(ProgramStore(tmp_path))
    (path,) = tmp_path.glob("*.jaxexport")
    path.write_bytes(b"not an exported program")
    store = ProgramStore(tmp_path)
    with pytest.warns(UserWarning, match="could not be read back .* tracing it again"):
        (_, out), _ = run(store)
    assert store.counts == {"read": 0, "written": 1}
    np.testing.assert_allclose(out["y"], jax.jit(step)(*arguments())[1]["y"], rtol=1e-6)
    again = ProgramStore(tmp_path)
    run(again)
    assert again.counts == {"read": 1, "written": 0}  # the file written anew is whole


def test_a_folder_that_cannot_be_written_keeps_nothing_and_says_so_once(tmp_path):
    blocker = tmp_path / "a file"
    blocker.write_text("")
    store = ProgramStore(blocker / "exported")  # below a file: nothing can be made there
    with pytest.warns(UserWarning, match="could not write to") as caught:
        run(store, "one")
        run(store, "two")
    assert len([w for w in caught if "could not write" in str(w.message)]) == 1
    assert store.counts == {"read": 0, "written": 0}


def test_without_a_folder_the_program_is_jit_itself(tmp_path):
    store = ProgramStore(None)
    (_, out), _ = run(store)
    assert store.counts == {"read": 0, "written": 0} and not list(tmp_path.iterdir())
    np.testing.assert_allclose(out["y"], jax.jit(step)(*arguments())[1]["y"], rtol=1e-6)


CONFIG = tiny_config("gqa", positions="rope", vocab_size=48, max_seq_len=64)
ENGINE = EngineConfig(max_seqs=4, page_size=4, chunk=8, prefill_rows=2, num_pages=40)


def greedy_tokens(store: ProgramStore) -> tuple[list[list[int]], Engine]:
    engine = Engine(drawn_params(CONFIG, seed=5, std=0.4), CONFIG, ENGINE, store=store)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [7]]
    done = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6))
    return [list(tokens) for tokens in done], engine


def test_the_engine_s_step_programs_read_back_give_the_same_greedy_tokens(tmp_path):
    traced, engine = greedy_tokens(ProgramStore(None))
    first_store = ProgramStore(tmp_path)
    first, _ = greedy_tokens(first_store)
    programs = len(engine.model_runner.programs.programs) + len(engine.model_runner.programs.samplers)
    # Two shapes whose draws are the same program share one file: written by one, read by the other.
    assert first_store.counts["written"] > 0 and sum(first_store.counts.values()) == programs
    second_store = ProgramStore(tmp_path)
    second, _ = greedy_tokens(second_store)
    assert second_store.counts == {"read": programs, "written": 0}
    assert first == traced and second == traced


@pytest.mark.slow  # a fresh process: it never traced the kernels its programs call
def test_a_second_process_reads_the_engine_s_programs_back(tmp_path):
    script = f"""
import sys; sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests')!r}]
from pathlib import Path
from jaxattn.program_store import ProgramStore
from tests.test_program_store import greedy_tokens
store = ProgramStore(Path({str(tmp_path)!r}))
tokens, _ = greedy_tokens(store)
print(store.counts["read"], store.counts["written"], tokens)
"""
    runs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "PYTHONPATH": str(ROOT)}) for _ in range(2)]
    assert all(done.returncode == 0 for done in runs), runs[-1].stderr[-3000:]
    (read_1, written_1, tokens_1), (read_2, written_2, tokens_2) = (done.stdout.split(" ", 2) for done in runs)
    assert int(written_1) > 0 and (int(read_2), int(written_2)) == (int(read_1) + int(written_1), 0)
    assert tokens_1 == tokens_2


