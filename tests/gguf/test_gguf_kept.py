"""A GGUF file's quantized weights kept quantized (`jaxattn.gguf.kept`), on tiny files written with gguf.GGUFWriter.

* Q8_0, Q4_0 and Q4_1 weights quantized as their kept modes ("int8:32", "int4:32", "int4:asym") are the
  file's own blocks, bit for bit: values (nibbles), float16 scales and Q4_1's minimums, through the
  loader's own mapping (q/k permutation, transposition, fused projections).
* The kept model computes what transformers' own GGUF loader computes from the same file: within 1e-3
  for the kept formats; a K-quant, kept in the nearest native format, within the difference measured.
* `train.sample` keeps a file so unless `--quant` or `--dtype float32` says otherwise, and says so.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("gguf")
from flax.traverse_util import flatten_dict  # noqa: E402
from gguf import GGMLQuantizationType as Q  # noqa: E402

import jaxattn  # noqa: E402
from jaxattn import Kernels  # noqa: E402
from jaxattn.gguf import GGUFModel, load_gguf  # noqa: E402
from jaxattn.gguf.reader import reverse_permute  # noqa: E402
from jaxattn.quantization import TIED_HEAD, QuantizedWeight, quantize, unpack  # noqa: E402
from programs import call  # noqa: E402
from tests.gguf.test_gguf import SPECS, _flat, ids_for, transformers_logits, write_gguf  # noqa: E402
from train import sample  # noqa: E402
from train.models.load import load_model  # noqa: E402

# ggml type -> (bytes per block of 32, the offsets of its float16 d and m (None: no m), where the 32 values start)
BLOCKS = {"Q8_0": (34, 0, None, 2), "Q4_0": (18, 0, None, 2), "Q4_1": (20, 0, 2, 4)}
KEPT = {Q.Q8_0: "int8:32", Q.Q4_0: "int4:32", Q.Q4_1: "int4:asym"}


def blocks(file, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Tensor `name`'s blocks as stored: (q [rows, in] (Q8_0's int8, Q4's unsigned nibbles), d float32
    [rows, in / 32], m float32 [rows, in / 32] or None)."""
    kind = file.type_name(name)
    size, d_at, m_at, q_at = BLOCKS[kind]
    rows, columns = file.shape(name)
    raw = np.asarray(file.tensors[name].data, np.uint8).reshape(rows, columns // 32, size)
    f16 = lambda at: raw[..., at:at + 2].copy().view(np.float16)[..., 0].astype(np.float32)  # noqa: E731
    if kind == "Q8_0":
        q = raw[..., q_at:].copy().view(np.int8)
    else:  # values 0..15 in the low nibbles, 16..31 in the high ones
        packed = raw[..., q_at:]
        q = np.concatenate([packed & 15, packed >> 4], axis=-1)
    return q.reshape(rows, columns), f16(d_at), None if m_at is None else f16(m_at)


def as_loaded(model: GGUFModel, stored) -> dict:
    """The params `model.load()` gives when each block tensor reads as `stored(q, d, m)` [rows, in] instead of
    its dequantized values: the file's blocks laid out by the loader's own mapping."""
    def read(name):
        if model.file.type_name(name) not in BLOCKS:
            return type(model.file).dequantized(model.file, name)
        return stored(*blocks(model.file, name)).astype(np.float32)

    model.file.dequantized = read
    try:
        return _flat(model.load()[1])
    finally:
        del model.file.dequantized


def quantized_leaves(params) -> dict:
    return {k: w for k, w in flatten_dict(params, is_leaf=lambda _, x: isinstance(x, QuantizedWeight)).items()
            if isinstance(w, QuantizedWeight)}


@pytest.mark.parametrize("qtype", list(KEPT), ids=lambda q: q.name)
@pytest.mark.parametrize("name", ["llama", "qwen2", "phi3"])  # q/k permuted; tied head; fused qkv and gate_up
def test_kept_weights_are_the_files_own_blocks(tmp_path, name, qtype):
    spec = dataclasses.replace(SPECS[name], layers=1)
    path = tmp_path / f"{name}-{qtype.name}.gguf"
    write_gguf(path, spec, qtype)
    model = GGUFModel.open(path)
    kept = model.kept_quantization()
    assert (kept.layers, kept.head, kept.exact) == (KEPT[qtype], KEPT[qtype], True)
    config, params = model.load()
    weights = quantized_leaves(quantize(params, config, kept.layers, head=kept.head))
    nibble = 0 if qtype == Q.Q8_0 else 8  # the stored value of zero
    values = as_loaded(model, lambda q, d, m: q.astype(np.float32))
    scales = as_loaded(model, lambda q, d, m: np.repeat(d, 32, axis=1))  # each group's d on its 32 inputs
    minimums = as_loaded(model, lambda q, d, m: np.repeat(m, 32, axis=1)) if qtype == Q.Q4_1 else None
    kernels = {k[:-1] for k in values if k[-1] == "kernel"}
    assert {k[:-1] for k in weights if k != (TIED_HEAD,)} == kernels and len(kernels) >= 5
    assert ((TIED_HEAD,) in weights) == spec.tied
    for key, weight in weights.items():
        source = ("wte", "embedding") if key == (TIED_HEAD,) else key
        flip = (lambda a: a.T) if key == (TIED_HEAD,) else (lambda a: a)  # noqa: E731  the head: the table's transpose
        assert weight.group == 32
        np.testing.assert_array_equal(np.asarray(unpack(weight)).astype(np.int32) + nibble,
                                      flip(values[source]).astype(np.int32), err_msg=str(key))
        np.testing.assert_array_equal(np.asarray(weight.scales), flip(scales[source])[::32], err_msg=str(key))
        if minimums is not None:
            np.testing.assert_array_equal(np.asarray(weight.minimums), flip(minimums[source])[::32], err_msg=str(key))
    if name == "llama":  # one projection laid out by hand: llama.cpp's q rows unpermuted, then [in, out]
        q, d, _ = blocks(model.file, "blk.0.attn_q.weight")
        query = weights[("blocks_0", "attn", "query", "kernel")]
        np.testing.assert_array_equal(np.asarray(unpack(query)).astype(np.int32) + nibble,
                                      reverse_permute(q, spec.heads, spec.heads).T)
        np.testing.assert_array_equal(np.asarray(query.scales), reverse_permute(d, spec.heads, spec.heads).T)


def kept_logits(path, ids, kernels: Kernels) -> np.ndarray:
    config, params, _, _ = load_gguf(path)
    kept = GGUFModel.open(path).kept_quantization()
    params = quantize(params, config, kept.layers, head=kept.head)
    return np.asarray(jaxattn.DecoderLM(config, kernels).apply({"params": params}, jnp.asarray(ids)), np.float32)


@pytest.mark.slow  # transformers' import and load, and a compile per type
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K], ids=lambda q: q.name)
def test_a_kept_file_computes_what_transformers_computes(tmp_path, qtype):
    spec = SPECS["llama"]
    path = tmp_path / f"llama-{qtype.name}.gguf"
    write_gguf(path, spec, qtype)
    ids = ids_for(path)
    theirs = transformers_logits(tmp_path, path.name, ids)
    scale = max(1.0, float(np.abs(theirs).max()))
    kept = GGUFModel.open(path).kept_quantization()
    for kernels in (Kernels(), Kernels(quantized="native_cpu")):  # the reference, and the native float loop
        difference = float(np.abs(kept_logits(path, ids, kernels) - theirs).max())
        print(f"{qtype.name} kept as {kept.layers} ({kernels.quantized}): max |logit difference| "
              f"{difference:.2e} (logits up to {scale:.2f})")
        if kept.exact:
            assert difference <= 1e-3 * scale, (difference, scale)
        else:  # Q4_K's blocks of 32 held again as int4 with a minimum: the nearest, not the same numbers
            assert kept.layers == "int4:asym" and difference <= 5e-2 * scale, (difference, scale)


@pytest.mark.parametrize("types, layers, head, exact", [
    ({"layers": Q.Q4_1, "embd": Q.Q8_0}, "int4:asym", "int8:32", True),  # SmolLM2's own file: a Q8_0 tied head
    ({"layers": Q.Q4_0, "output": Q.Q8_0}, "int4:32", "int8:32", True),
    ({"layers": Q.Q4_K, "v": Q.Q6_K}, "int8:32", "int4:asym", False),  # a K-quant mix: the widest for every layer
    ({"layers": Q.F16}, None, None, True),
    ({"layers": Q.Q8_0, "output": Q.F16}, "int8:32", None, True),  # a float head stays float
], ids=["q4_1-q8_0-tied-head", "q4_0-q8_0-head", "q4_k-q6_k-mix", "f16", "q8_0-f16-head"])
def test_the_kept_modes_follow_the_files_types(tmp_path, types, layers, head, exact):
    spec = dataclasses.replace(SPECS["qwen2" if "embd" in types else "llama"], layers=1)
    path = tmp_path / "m.gguf"
    tensors = write_gguf(path, spec, types["layers"])
    others = {"blk.0.attn_v.weight": types.get("v"), "output.weight": types.get("output"),
              "token_embd.weight": types.get("embd")}
    if any(others.values()):
        extra_types = {name: kind for name, kind in others.items() if kind is not None}
        written = {name: tensors.pop(name) for name in extra_types}
        encode = _encoder(extra_types, written)
        write_gguf(path, spec, types["layers"], tensors=tensors, extra=encode)
    kept = GGUFModel.open(path).kept_quantization()
    if layers is None:
        assert kept is None
        return
    assert (kept.layers, kept.head, kept.exact) == (layers, head, exact)


def _encoder(kinds: dict, arrays: dict):
    from tests.gguf.test_gguf import encoded

    def extra(writer):
        rng = np.random.default_rng(5)
        for name, kind in kinds.items():
            data, raw = encoded(arrays[name], kind, rng)
            writer.add_tensor(name, data, raw_dtype=raw)
    return extra


def test_sample_keeps_a_q4_1_file_quantized_unless_asked_otherwise(tmp_path, capsys):
    from jaxattn import resolve_kernels
    from jaxattn.decoding import generate
    path = tmp_path / "tiny-Q4_1.gguf"
    write_gguf(path, dataclasses.replace(SPECS["llama"], layers=1), Q.Q4_1)
    code, out, err = call(capsys, sample.main, "--gguf", str(path), "--prompt", " the cat", "--max-new-tokens", "6",
                          "--temperature", "0")
    assert code == 0, err
    note = (f"note: {path} stores its weights as Q4_1 (8) kept as int4:asym: the file's own numbers; "
            "--dtype float32 to dequantize them\n")
    assert note in err and "weights int4:asym, quantized '" in err
    config, params, tokenizer, _ = load_gguf(path)
    prompt = np.asarray(tokenizer.encode(" the cat"))
    expected = generate(quantize(params, config, "int4:asym"), config, prompt[None], np.array([len(prompt)]),
                        max_new_tokens=6, rng=jax.random.PRNGKey(0), temperature=0.0,
                        kernels=resolve_kernels(Kernels.auto())[0])
    assert out == " the cat" + tokenizer.decode(sample.until_eos(np.asarray(expected.tokens[0]),
                                                                 tokenizer.eos_token_id)) + "\n"

    def loaded(parse, *argv):  # what the program's flags load, through the one loader
        return load_model(parse(["--gguf", str(path), *argv]).model_source)

    kept = loaded(sample.parse_args, "--prompt", "A")
    qkv = kept.params["blocks_0"]["attn"]["qkv"]["kernel"]  # q, k and v fused on loading
    assert kept.quant == "int4:asym" and qkv.minimums is not None and (qkv.bits, qkv.group) == (4, 32)
    asked = loaded(sample.parse_args, "--prompt", "A", "--quant", "int4")
    assert asked.quant == "int4" and asked.params["blocks_0"]["attn"]["qkv"]["kernel"].minimums is None
    floats = loaded(sample.parse_args, "--prompt", "A", "--dtype", "float32")
    assert floats.quant is None and floats.params["lm_head"]["kernel"].dtype == np.float32
    meshed = loaded(sample.parse_args, "--prompt", "A", "--mesh", "data:1")  # no quantized weights on a mesh
    assert not isinstance(meshed.params["lm_head"]["kernel"], QuantizedWeight) and meshed.quant is None
    from train import serve
    served = loaded(serve.parse_args)  # train.serve loads through the same loader
    assert isinstance(served.params["lm_head"]["kernel"], QuantizedWeight) and served.quant == "int4:asym"


def test_dtype_goes_with_gguf(tmp_path, capsys):
    code, _, err = call(capsys, sample.main, "--random-init", "baby", "--prompt", "A", "--dtype", "float32")
    assert code == 2 and "--dtype goes with --gguf" in err
