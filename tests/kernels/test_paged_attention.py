"""Paged attention (`jaxattn.kernels.paged`, `jaxattn.kernels.native_paged`): the ragged kernel and the
native one equal the gathered reference, the dense cached attention and JAX's own ragged paged
attention reference; `jaxattn.kernels.paged_select` says which runs a call, and why.

One pool of P = 12 pages of ps = 4 slots, a block table of Pr = 5 columns and blocks of 2 pages
(2 does not divide 5: the last block's columns are clipped). Four rows of C = 3 query columns:
a decode-like row (one real query), a prefill-like row, a padding row and a row that shares its
first page with the decode row. Page 0 fills the table past each row's pages and holds random
values: a slot read as visible by mistake would show.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention

from jaxattn.attention import cached_attention
from jaxattn.kernels import native_paged, paged, paged_select
from jaxattn.kernels.select import Platform, resolve_kernels
from jaxattn.kernels.registry import Kernels

P, PS, H, SCALE, PAGES_PER_BLOCK = 12, 4, 8, 0.3, 2
BLOCK_TABLE = np.array([[7, 2, 11, 4, 0],  # 14 tokens
                        [9, 1, 0, 0, 0],  # 8 tokens
                        [0, 0, 0, 0, 0],  # no tokens
                        [7, 3, 10, 5, 8]], np.int32)  # 20 tokens, its first page shared with row 0
POSITIONS = np.array([[13, -1, -1], [5, 6, 7], [-1, -1, -1], [17, 18, 19]], np.int32)
KV_LENS, Q_LENS, REAL_ROWS = np.array([14, 8, 20]), np.array([1, 3, 3]), [0, 1, 3]  # the same, as sequences

# name: (N, K, head dims of the key parts, window, soft cap, with sinks); "mla": two parts, K = 1, values = part 0
CASES = {"gqa": (4, 2, (H,), None, None, False),
         "gqa-window-cap-sinks": (4, 2, (H,), 6, 1.5, True),
         "mha-window-sinks": (4, 4, (H,), 5, None, True),
         "mqa-cap": (4, 1, (H,), None, 2.0, False),
         "mla-window-cap-sinks": (4, 1, (H, 4), 7, 1.0, True)}

STATIC = ("scale", "window", "logits_soft_cap", "pages_per_block")
# Jitted once (compiles are most of these tests' time); the positions, hence the trip counts, are traced.
_ragged = jax.jit(paged.ragged_paged_attention, static_argnames=STATIC)
_gathered = jax.jit(paged.gathered_paged_attention, static_argnames=STATIC)
_native = jax.jit(native_paged.native_paged_attention, static_argnames=STATIC)
_ragged_cpu = jax.jit(paged_select.ragged_cpu_paged_attention, static_argnames=STATIC)
ONE_PART = [case for case in CASES if len(CASES[case][2]) == 1]
_cached = jax.jit(cached_attention, static_argnames=("scale", "window", "logits_soft_cap", "implementation"))


def inputs(case, dtype=jnp.float32, seed=0):
    """`(args, kwargs)` of both kernels for `CASES[case]`: numpy draws (a jax.random draw per shape compiles)."""
    N, K, dims, window, cap, with_sinks = CASES[case]
    rng = np.random.default_rng(seed)
    draw = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32)).astype(dtype)  # noqa: E731
    queries = tuple(draw(4, 3, N, d) for d in dims)
    key_pages = tuple(draw(P, PS, K, d) for d in dims)
    value_pages = key_pages[0] if len(dims) == 2 else draw(P, PS, K, H)  # MLA: the latent is the value
    sinks = jnp.asarray(np.linspace(-1.0, 2.0, N), jnp.float32) if with_sinks else None
    args = (queries, key_pages, value_pages, jnp.asarray(BLOCK_TABLE), jnp.asarray(POSITIONS))
    return args, dict(scale=SCALE, window=window, logits_soft_cap=cap, sinks=sinks)


def ragged(args, kwargs, pages_per_block=PAGES_PER_BLOCK):
    return _ragged(*args, **kwargs, pages_per_block=pages_per_block)


def gathered(args, kwargs):
    return _gathered(*args, **kwargs)


def native(args, kwargs):
    return _native(*args, **kwargs)


def dense(pages):
    """`[P, ps, K, H]` pages -> the heads-major cache `[R, K, Pr * ps, H]` of `cached_attention`."""
    return pages[BLOCK_TABLE].reshape(len(BLOCK_TABLE), -1, *pages.shape[2:]).transpose(0, 2, 1, 3)


def close(actual, expected, tol=1e-5):
    np.testing.assert_allclose(np.asarray(actual, np.float32), np.asarray(expected, np.float32), rtol=tol, atol=tol)


@pytest.mark.parametrize("case", list(CASES))
def test_ragged_equals_gathered(case):
    """GQA, MHA, MQA and MLA's two parts, with windows, soft caps and sinks; rows of different lengths,
    a shared page, a clipped last block; padding queries and the padding row give exact zeros."""
    args, kwargs = inputs(case)
    out, expected = ragged(args, kwargs), gathered(args, kwargs)
    assert out.shape == expected.shape == (4, 3, 4, args[2].shape[-1]) and out.dtype == jnp.float32
    close(out, expected)
    padding = np.asarray(POSITIONS) < 0
    np.testing.assert_array_equal(np.asarray(out)[padding], 0.0)
    np.testing.assert_array_equal(np.asarray(expected)[padding], 0.0)
    assert np.all(np.abs(np.asarray(out)[~padding]).sum(-1) > 0)


@pytest.mark.parametrize("pages_per_block", [1, 3, 8])
def test_any_pages_per_block_gives_the_same(pages_per_block):
    """One page per block, 3 (the second block clipped to one column), 8 (capped at the table: one block)."""
    args, kwargs = inputs("gqa-window-cap-sinks")
    close(ragged(args, kwargs, pages_per_block), gathered(args, kwargs))


@pytest.mark.parametrize("case", ["gqa-window-cap-sinks", "mla-window-cap-sinks"])
def test_both_equal_cached_attention_on_the_dense_cache(case):
    """The pages gathered into the heads-major cache of `jaxattn.attention.cached_attention` ("xla").
    MLA's two parts are one attention over the concatenated head dims: q.k = q_l.c_kv + q_r.k_rope."""
    args, kwargs = inputs(case)
    queries, key_pages, value_pages = args[:3]
    expected = _cached(jnp.concatenate(queries, -1), dense(jnp.concatenate(key_pages, -1)), dense(value_pages),
                       args[4], implementation="xla", **kwargs)
    close(ragged(args, kwargs), expected)
    close(gathered(args, kwargs), expected)


@pytest.mark.parametrize("window, cap", [(None, None), (6, 1.5)])
def test_ragged_equals_jax_ref_ragged_paged_attention(window, cap):
    """JAX's pure-JAX reference (a second, independent oracle; no sinks): flat queries, K and V
    interleaved on one heads axis, each sequence's queries the last `q_len` of its `kv_len` tokens."""
    args, kwargs = inputs("gqa", seed=1)
    (query,), (keys,), values, block_table, positions = args
    kwargs.update(window=window, logits_soft_cap=cap)
    kv_pages = jnp.stack([keys, values], 3).reshape(P, PS, -1, H)  # [P, ps, 2K, H]: 0::2 keys, 1::2 values
    flat = jnp.concatenate([query[r, :n] for r, n in zip(REAL_ROWS, Q_LENS)])
    cu_q_lens = np.concatenate([[0], np.cumsum(Q_LENS)]).astype(np.int32)
    assert np.array_equal(positions[REAL_ROWS, 0], KV_LENS - Q_LENS)  # the same case in both layouts
    expected = ref_ragged_paged_attention(
        flat, kv_pages, jnp.asarray(KV_LENS, jnp.int32), block_table[np.array(REAL_ROWS)], jnp.asarray(cu_q_lens),
        jnp.array([len(REAL_ROWS)], jnp.int32), sm_scale=SCALE, sliding_window=window, soft_cap=cap)
    for out in (ragged(args, kwargs), native(args, kwargs)):
        close(jnp.concatenate([out[r, :n] for r, n in zip(REAL_ROWS, Q_LENS)]), expected)


def test_bfloat16_pages_give_bfloat16_close_to_float32():
    """bfloat16 queries and pages: bfloat16 out, within bfloat16 rounding of the float32 kernel on the
    same (rounded) numbers; the sinks stay float32."""
    args, kwargs = inputs("gqa-window-cap-sinks", jnp.bfloat16)
    upcast = jax.tree.map(lambda x: x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x, args)
    expected = ragged(upcast, kwargs)
    for out in (ragged(args, kwargs), gathered(args, kwargs)):
        assert out.dtype == jnp.bfloat16
        close(out, expected, tol=2e-2)


def _bad(**changes):
    args, kwargs = inputs("gqa")
    names = ("queries", "key_pages", "value_pages", "block_table", "query_positions")
    return {**dict(zip(names, args)), **kwargs, **changes}


@pytest.mark.parametrize("changes, message", [
    (lambda a: dict(key_pages=a["key_pages"] * 2), "as many parts"),
    (lambda a: dict(key_pages=(jnp.zeros((P, PS, 3, H)),), value_pages=jnp.zeros((P, PS, 3, H))),
     "multiple of the key/value heads"),
    (lambda a: dict(block_table=a["block_table"].astype(jnp.float32)), "block_table must be"),
    (lambda a: dict(query_positions=a["query_positions"][:, :2]), "query_positions must be"),
], ids=["parts", "heads", "table-dtype", "positions-shape"])
@pytest.mark.parametrize("attend", [paged.ragged_paged_attention, paged.gathered_paged_attention],
                         ids=["ragged", "gathered"])
def test_bad_inputs_raise_value_errors(changes, message, attend):
    arguments = _bad()
    arguments.update(changes(arguments))
    with pytest.raises(ValueError, match=message):
        attend(**arguments)


def test_traced_positions_read_only_the_blocks_they_see():
    """One compiled program, two sets of positions (the trip count is traced: a `while` loop). With the
    late positions and window 6, blocks start at slot 8, so pages only in the first two table columns
    (7, 2, 9, 1, 3) are never read: NaN there changes nothing (a NaN read would reach the output)."""
    args, kwargs = inputs("gqa-window-cap-sinks")
    late = jnp.asarray([[19, -1, -1], [16, 17, -1], [-1, -1, -1], [17, 18, 19]], jnp.int32)
    attend = functools.partial(paged.ragged_paged_attention, **kwargs, pages_per_block=PAGES_PER_BLOCK)
    assert "while" in str(jax.make_jaxpr(attend)(*args))
    for positions in (args[4], late):
        moved = (*args[:4], positions)
        close(ragged(moved, kwargs), gathered(moved, kwargs))
    unread = np.isin(np.arange(P), [7, 2, 9, 1, 3])[:, None, None, None]
    (query,), (keys,), values, block_table, _ = args
    dirty = ((query,), (jnp.where(unread, jnp.nan, keys),), jnp.where(unread, jnp.nan, values), block_table, late)
    close(ragged(dirty, kwargs), gathered((*args[:4], late), kwargs))


# -- the native loop ("ragged_cpu") ------------------------------------------------------------------

@pytest.mark.parametrize("case", ONE_PART)
def test_native_equals_gathered(case):
    """Every one-part case through the C++ loop, whatever C * G (mqa-cap's 12 would go blockwise in
    "ragged_cpu"): the same numbers, exact zeros for padding queries and the padding row."""
    args, kwargs = inputs(case)
    out, expected = native(args, kwargs), gathered(args, kwargs)
    assert out.shape == expected.shape and out.dtype == jnp.float32
    close(out, expected)
    np.testing.assert_array_equal(np.asarray(out)[np.asarray(POSITIONS) < 0], 0.0)


@pytest.mark.parametrize("case", list(CASES))
def test_ragged_cpu_equals_gathered_going_native_only_where_it_should(case):
    args, kwargs = inputs(case)
    queries, key_pages, value_pages = args[:3]
    G = CASES[case][0] // CASES[case][1]
    assert takes_native(queries, key_pages, value_pages) == (len(queries) == 1 and 3 * G <= native_paged.NATIVE_UP_TO)
    close(_ragged_cpu(*args, **kwargs), gathered(args, kwargs))


def takes_native(queries, key_pages, value_pages) -> bool:
    """Whether "ragged_cpu" runs the native loop for a call (`paged_select.choose`)."""
    return paged_select.choose("ragged_cpu", queries, key_pages, value_pages)[0] == paged_select.NATIVE


def test_native_takes_decode_and_verification_rows_only():
    q = lambda C, N, dtype=jnp.float32: jnp.zeros((2, C, N, H), dtype)  # noqa: E731
    pages = lambda K, dtype=jnp.float32: jnp.zeros((P, PS, K, H), dtype)  # noqa: E731
    assert takes_native((q(1, 8),), (pages(1),), pages(1))  # one row per head group of 8
    assert takes_native((q(2, 8),), (pages(1),), pages(1))  # 16 queries per kv head: a verification's rows
    assert not takes_native((q(3, 8),), (pages(1),), pages(1))  # 24 queries per kv head: a prompt chunk
    assert not takes_native((q(1, 4), q(1, 4)), (pages(1), pages(1)), pages(1))  # MLA's parts
    assert not takes_native((q(1, 4, jnp.bfloat16),), (pages(2, jnp.bfloat16),), pages(2, jnp.bfloat16))


# -- the one rule: which kernel runs a call, and why ----------------------------------------------------

def test_the_call_rule_names_the_kernel_and_its_reason():
    """`paged_select.choose` for each name: "gather" and "ragged" whatever the call; "ragged_cpu" native for
    decoding rows and ragged, saying why, for a prompt chunk, MLA's two parts and int8 or 16-bit pages."""
    q = lambda C, N, dtype=jnp.float32: jnp.zeros((2, C, N, H), dtype)  # noqa: E731
    pages = lambda K, dtype=jnp.float32: jnp.zeros((P, PS, K, H), dtype)  # noqa: E731
    decoding, chunk = ((q(1, 8),), (pages(2),), pages(2)), ((q(8, 8),), (pages(2),), pages(2))
    assert paged_select.choose("gather", *decoding)[0] == "gather"
    assert paged_select.choose("ragged", *decoding)[0] == "ragged"
    kernel, reason = paged_select.choose("ragged_cpu", *decoding)
    assert kernel == "native" and "4 queries per row and kv head <= 16" in reason
    kernel, reason = paged_select.choose("ragged_cpu", *chunk)
    assert kernel == "ragged" and "32 queries per row and kv head > 16" in reason
    kernel, reason = paged_select.choose("ragged_cpu", (q(1, 4), q(1, 4)), (pages(1), pages(1)), pages(1))
    assert kernel == "ragged" and "2 key parts" in reason
    kernel, reason = paged_select.choose("ragged_cpu", (q(1, 4, jnp.bfloat16),), (pages(2, jnp.bfloat16),),
                                         pages(2, jnp.bfloat16))
    assert kernel == "ragged" and "float32" in reason


def test_the_call_rule_refuses_auto_and_unknown_names():
    args = inputs("gqa")[0][:3]
    with pytest.raises(ValueError, match='Kernels.paged is "auto": resolve it for a platform first'):
        paged_select.choose("auto", *args)
    with pytest.raises(ValueError, match="paged implementation must be one of"):
        paged_select.choose("splash", *args)


@pytest.mark.parametrize("platform, expected", [(Platform("cpu", cxx=True), "ragged_cpu"),
                                                (Platform("cpu"), "ragged"), (Platform("gpu"), "gather"),
                                                (Platform("tpu"), "gather")])
def test_auto_resolves_by_the_platform_rule_of_the_same_module(platform, expected):
    kernels, reasons = resolve_kernels(Kernels(paged="auto"), platform)
    assert kernels.paged == expected and reasons["paged"] == paged_select.platform_rule(platform)[1]


def test_native_reads_only_the_slots_each_query_sees():
    """Each query reads its own window: NaN in the pages before the late positions' windows changes
    nothing (the padding row's and padding queries' pages included: they read nothing)."""
    args, kwargs = inputs("gqa-window-cap-sinks")
    late = jnp.asarray([[19, -1, -1], [16, 17, -1], [-1, -1, -1], [17, 18, 19]], jnp.int32)
    unread = np.isin(np.arange(P), [7, 2, 9, 1, 3])[:, None, None, None]
    (query,), (keys,), values, block_table, _ = args
    dirty = ((query,), (jnp.where(unread, jnp.nan, keys),), jnp.where(unread, jnp.nan, values), block_table, late)
    close(native(dirty, kwargs), gathered((*args[:4], late), kwargs))


def test_native_refuses_a_block_table_entry_outside_the_pool():
    """The loop checks the table before it reads: a page index past the pool is an error, not a read
    out of bounds. (XLA raises the kernel's error as a ValueError at dispatch or, run asynchronously on
    its thread pool, as a JaxRuntimeError when the result is awaited.)"""
    args, kwargs = inputs("gqa")
    bad_table = args[3].at[0, 0].set(P)
    with pytest.raises((ValueError, jax.errors.JaxRuntimeError), match="INVALID_ARGUMENT: .*outside the pool"):
        jax.block_until_ready(native((*args[:3], bad_table, args[4]), kwargs))


def test_native_refuses_what_it_does_not_compute():
    args, kwargs = inputs("mla-window-cap-sinks")
    with pytest.raises(ValueError, match="one key part in float32, got 2 part"):
        native_paged.native_paged_attention(*args, **kwargs)
    args, kwargs = inputs("gqa", jnp.bfloat16)
    with pytest.raises(ValueError, match="one key part in float32"):
        native_paged.native_paged_attention(*args, **kwargs)


def test_a_missing_or_broken_compiler_says_so_and_names_the_way_out(monkeypatch, tmp_path):
    cxx = native_paged.compiler()
    monkeypatch.setattr(native_paged, "compiler", lambda: None)
    with pytest.raises(native_paged.NativeBuildError, match=r"needs a C\+\+ compiler.*paged='ragged'"):
        native_paged.library_path()
    with pytest.raises(native_paged.NativeBuildError, match="does not run"):
        native_paged.build(str(tmp_path / "no-such-compiler"))
    broken = tmp_path / "broken.cc"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(native_paged, "SOURCE", broken)
    monkeypatch.setenv("JAXATTN_NATIVE_CACHE", str(tmp_path / "cache"))
    with pytest.raises(native_paged.NativeBuildError, match=r"compiling broken.cc with .* failed: .*paged='ragged'"):
        native_paged.build(cxx)
    assert not list((tmp_path / "cache").glob("*.so"))  # nothing half-built left in the cache
