"""jaxattn.gguf against transformers' own GGUF loader, on tiny GGUF files written here with gguf.GGUFWriter.

Each file is a tiny random model of one llama.cpp architecture (its 2-D tensors in one tensor
type, its norms F32, as llama.cpp writes them) with a byte-level BPE or a SentencePiece
vocabulary. jaxattn's logits must equal those of `AutoModelForCausalLM.from_pretrained(dir,
gguf_file=name)` on the same file, and jaxattn's tokenizer must encode and decode as
`AutoTokenizer.from_pretrained(dir, gguf_file=name)` does. The block formats gguf-py cannot write
(the K-quants) are written as random blocks with small scales: both loaders dequantize the same
bytes. `test_the_tensors_land_where_transformers_names_put_them` checks the mapping against the
transformers checkpoint the file was made from, without transformers. test_gguf_kept.py checks the
block formats kept quantized.
"""

from __future__ import annotations

import dataclasses
import re

import jax.numpy as jnp
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf import GGUFWriter  # noqa: E402
from gguf.quants import quantize  # noqa: E402

import jaxattn  # noqa: E402
from jaxattn import hf  # noqa: E402
from jaxattn.gguf import GGUFModel, load_gguf  # noqa: E402
from jaxattn.gguf.architectures import ARCHITECTURES  # noqa: E402
from jaxattn.gguf.reader import TENSOR_TYPES, reverse_permute  # noqa: E402
from programs import call  # noqa: E402
from train import sample  # noqa: E402

# The f16 scales inside each K-quant block (byte offsets), set small so that random blocks are weights.
K_SCALES = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
K_SCALE = {Q.Q2_K: 2e-3, Q.Q3_K: 1e-3, Q.Q4_K: 2e-4, Q.Q5_K: 1e-4, Q.Q6_K: 2e-5}
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
TEXTS = ["Hello world", " the cat is in the hall", "héllo ✓ 🤖 there", "  two  spaces\nnew line\n\nend",
         "1234567 the end<|endoftext|>after", "<think>is this</think> in"]


@dataclasses.dataclass(frozen=True)
class Spec:
    """A tiny model of one llama.cpp architecture: sizes (every 2-D tensor's row a multiple of 256, for the
    K-quants), the vocabulary kind and what the file states."""

    arch: str
    vocab: str = "bpe"  # "bpe" (byte-level, tokenizer.ggml.model gpt2), "spm" or "gemma" (SentencePiece)
    pre: str | None = None  # tokenizer.ggml.pre
    d: int = 256
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    ffn: int = 512
    tied: bool = False
    name: str = "tiny"
    theta: float = 10000.0


SPECS = {
    "llama": Spec("llama", pre="llama-bpe"),
    "llama-spm": Spec("llama", vocab="spm"),
    "qwen2": Spec("qwen2", pre="qwen2", tied=True),
    "qwen3": Spec("qwen3", pre="qwen2", heads=2, kv_heads=1, head_dim=128, tied=True),
    "phi3": Spec("phi3", vocab="spm"),
    "gemma2": Spec("gemma2", vocab="gemma", tied=True),
    "gemma3": Spec("gemma3", vocab="gemma", tied=True, theta=1e6),
}


# ------------------------------------------------------------------ vocabularies


def bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


BPE_MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ s", "r e", "a t", "Ġ w", "o u", "Ġ o", "Ġ h",
              "i s", "e n", "Ġ c", "l l", "Ġ f", "e l", "Ġ i", "Ġi n", "Ġ is", "Ġh e", "Ġh all", "a ll", "Ġc at",
              "c at", "Ġ the", "Ġ e", "Ġe nd", "n d", "1 2", "12 3", "Ġ Ċ", "Ċ Ċ", "w or", "o r", "l d", "H e",
              "He ll", "Hell o"]


def bpe_vocab(w: GGUFWriter, spec: Spec) -> int:
    """A byte-level vocabulary: the 256 byte characters, the merges' tokens, control tokens and one
    user-defined token (Llama 3 style: a BOS it adds, an end-of-text EOS)."""
    tokens = list(bytes_to_unicode().values())
    merges = []
    for merge in BPE_MERGES:
        left, right = merge.split(" ")
        if left in tokens and right in tokens and left + right not in tokens:
            tokens.append(left + right)
            merges.append(merge)
    types = [1] * len(tokens)
    tokens += ["<|begin_of_text|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    types += [3, 3, 3, 3, 4, 4]
    w.add_tokenizer_model("gpt2")
    if spec.pre:
        w.add_tokenizer_pre(spec.pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|begin_of_text|>"))
    w.add_eos_token_id(tokens.index("<|endoftext|>"))
    w.add_add_bos_token(spec.arch == "llama")
    return len(tokens)


SPM_PIECES = ["▁", "e", "t", "a", "o", "h", "n", "s", "r", "i", "l", "d", "c", "w", "H", "▁t", "he", "▁the", "in",
              "▁a", "er", "on", "▁s", "re", "at", "▁w", "ou", "▁o", "▁h", "is", "en", "▁c", "ll", "▁f", "th",
              "▁th", "▁is", "▁he", "▁in", "all", "▁hall", "▁cat", "ca", "▁ca", "nd", "▁end", "el", "lo", "llo",
              "He", "Hello", "▁wor", "or", "ld", "▁world", "  ", "1", "2", "3"]


def spm_vocab(w: GGUFWriter, spec: Spec) -> int:
    """A SentencePiece vocabulary (no merges: they come from the scores), byte fallback tokens, and the
    specials of Llama's (`<s>`...) or Gemma's (`<bos>`...) files."""
    if spec.vocab == "gemma":
        specials, types = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"], [3, 3, 3, 2, 4]
        bos, eos, unk, pad = 2, 1, 3, 0
    else:
        specials, types = ["<unk>", "<s>", "</s>"], [2, 3, 3]
        bos, eos, unk, pad = 1, 2, 0, None
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)] + SPM_PIECES + ["<start_of_turn>"]
    types = types + [6] * 256 + [1] * len(SPM_PIECES) + [4]
    scores = [0.0] * (len(specials) + 256) + [-float(i) for i in range(len(SPM_PIECES))] + [0.0]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores(scores)
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    w.add_unk_token_id(unk)
    if pad is not None:
        w.add_pad_token_id(pad)
    elif spec.arch == "phi3":
        w.add_pad_token_id(eos)
    return len(tokens)


# ------------------------------------------------------------------ tensors


def llamacpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py `LlamaModel.permute` (what the loaders undo)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def random_tensors(spec: Spec, vocab: int, rng) -> dict[str, np.ndarray]:
    """`{llama.cpp name: float32 array}` of a random model in the file's layout (norms as llama.cpp stores them)."""
    D, N, K, H, F = spec.d, spec.heads, spec.kv_heads, spec.head_dim, spec.ffn
    gemma = spec.arch.startswith("gemma")

    def mat(rows, cols, std=0.05):
        return (rng.standard_normal((rows, cols)) * std).astype(np.float32)

    def norm(n):  # Gemma stores 1 + w; the others w: both around one, far from it
        return (1.0 + 0.3 * rng.standard_normal(n)).astype(np.float32)

    t = {"token_embd.weight": mat(vocab, D, 0.5), "output_norm.weight": norm(D)}
    if not spec.tied:
        t["output.weight"] = mat(vocab, D)
    for i in range(spec.layers):
        b = f"blk.{i}."
        t[b + "attn_norm.weight"] = norm(D)
        if spec.arch == "phi3":
            t[b + "attn_qkv.weight"] = mat((N + 2 * K) * H, D)
            t[b + "ffn_up.weight"] = mat(2 * F, D)
        else:
            t[b + "attn_q.weight"], t[b + "attn_k.weight"] = mat(N * H, D), mat(K * H, D)
            t[b + "attn_v.weight"] = mat(K * H, D)
            t[b + "ffn_gate.weight"], t[b + "ffn_up.weight"] = mat(F, D), mat(F, D)
        if spec.arch == "qwen2":
            for name, rows in (("attn_q", N * H), ("attn_k", K * H), ("attn_v", K * H)):
                t[b + f"{name}.bias"] = (0.1 * rng.standard_normal(rows)).astype(np.float32)
        if spec.arch in ("qwen3", "gemma3"):
            t[b + "attn_q_norm.weight"], t[b + "attn_k_norm.weight"] = norm(H), norm(H)
        t[b + "attn_output.weight"] = mat(D, N * H)
        t[b + "ffn_down.weight"] = mat(D, F)
        t[b + "ffn_norm.weight"] = norm(D)
        if gemma:
            t[b + "post_attention_norm.weight"], t[b + "post_ffw_norm.weight"] = norm(D), norm(D)
    return t


def encoded(array: np.ndarray, qtype: Q, rng) -> tuple[np.ndarray, Q | None]:
    """`array` in tensor type `qtype` for `GGUFWriter.add_tensor` (random blocks for the K-quants)."""
    if qtype == Q.F32:
        return array, None
    if qtype == Q.F16:
        return array.astype(np.float16), None
    if qtype not in K_SCALES:
        return quantize(array, qtype), qtype
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (array.shape[0], array.shape[1] // block, size), dtype=np.uint8)
    for offset in K_SCALES[qtype]:
        scale = (K_SCALE[qtype] * (0.5 + rng.random(blocks.shape[:2]))).astype(np.float16)
        blocks[..., offset:offset + 2] = scale.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(array.shape[0], -1), qtype


def write_gguf(path, spec: Spec, qtype: Q = Q.F32, seed: int = 0, *, chat_template: str | None = CHAT_TEMPLATE,
               extra=None, tensors: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """A tiny GGUF file of `spec` with its 2-D tensors in `qtype` (random, or `tensors`); returns its tensors
    before encoding, in llama.cpp's layout."""
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), spec.arch)
    w.add_name(spec.name)
    w.add_block_count(spec.layers)
    w.add_context_length(64)
    w.add_embedding_length(spec.d)
    w.add_feed_forward_length(spec.ffn)
    w.add_head_count(spec.heads)
    w.add_head_count_kv(spec.kv_heads)
    w.add_rope_freq_base(spec.theta)
    w.add_layer_norm_rms_eps(1e-5)
    if spec.arch == "llama":
        w.add_rope_dimension_count(spec.head_dim)
    if spec.arch in ("qwen3", "gemma2", "gemma3"):
        w.add_key_length(spec.head_dim)
        w.add_value_length(spec.head_dim)
    if spec.arch.startswith("gemma"):
        w.add_sliding_window(4)
    vocab = bpe_vocab(w, spec) if spec.vocab == "bpe" else spm_vocab(w, spec)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    if extra is not None:
        extra(w)
    tensors = random_tensors(spec, vocab, rng) if tensors is None else tensors
    for name, array in tensors.items():
        data, raw = encoded(array, qtype, rng) if array.ndim == 2 else (array, None)
        w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors


# ------------------------------------------------------------------ transformers' side


def transformers_logits(directory, name: str, ids: np.ndarray) -> np.ndarray:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name)
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.float().numpy()


def jaxattn_logits(path, ids: np.ndarray, dtype: str = "float32") -> np.ndarray:
    config, params, _, _ = load_gguf(path, dtype)
    return np.asarray(jaxattn.DecoderLM(config).apply({"params": params}, jnp.asarray(ids)), np.float32)


def ids_for(path, n: int = 12, seed: int = 1) -> np.ndarray:
    vocab = len(GGUFModel.open(path).metadata["tokenizer.ggml.tokens"])
    return np.random.default_rng(seed).integers(0, vocab, (2, n))


def parity(tmp_path, spec: Spec, qtype: Q) -> float:
    """max |jaxattn logits - transformers logits| on a file of `spec` in `qtype`, asserted small."""
    path = tmp_path / f"{spec.arch}-{qtype.name}.gguf"
    write_gguf(path, spec, qtype)
    ids = ids_for(path)
    ours, theirs = jaxattn_logits(path, ids), transformers_logits(tmp_path, path.name, ids)
    assert ours.shape == theirs.shape
    difference = float(np.abs(ours - theirs).max())
    scale = float(np.abs(theirs).max())
    print(f"{spec.arch} {qtype.name}: max |logit difference| {difference:.2e} (logits up to {scale:.2f})")
    assert difference <= 1e-4 * max(1.0, scale), (difference, scale)
    return difference


# ------------------------------------------------------------------ tests: the model


@pytest.mark.slow  # transformers' import and load, and a compile: about ten seconds
def test_a_llama_file_in_f32_computes_what_transformers_computes(tmp_path):
    parity(tmp_path, SPECS["llama"], Q.F32)


@pytest.mark.slow  # a model compiled and loaded twice per type
@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K,
                                   Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda q: q.name)
def test_every_tensor_type_computes_what_transformers_computes(tmp_path, qtype):
    parity(tmp_path, SPECS["llama"], qtype)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama-spm", "qwen2", "qwen3", "phi3", "gemma2", "gemma3"])
@pytest.mark.parametrize("qtype", [Q.F32, Q.Q4_K], ids=lambda q: q.name)
def test_every_architecture_computes_what_transformers_computes(tmp_path, name, qtype):
    parity(tmp_path, SPECS[name], qtype)


def test_every_tensor_type_read_is_one_the_gguf_package_dequantizes():
    assert set(TENSOR_TYPES) == {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K",
                                 "Q4_K", "Q5_K", "Q6_K"}
    for name in TENSOR_TYPES:
        block, size = gguf.GGML_QUANT_SIZES[Q[name]]
        raw = np.zeros((1, size * (256 // block)), np.uint8)
        assert gguf.quants.dequantize(raw, Q[name]).shape == (1, 256)


HF_BLOCK = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
            "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
            "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def test_the_tensors_land_where_transformers_names_put_them(tmp_path):
    """A Llama checkpoint written as llama.cpp's converter writes it (q/k rows permuted) loads as the checkpoint."""
    spec, rng = SPECS["llama"], np.random.default_rng(3)
    layout = GGUFModel.open(_written(tmp_path / "layout.gguf", spec)).file
    checkpoint, as_written = {}, {}
    for name in layout.tensors:
        stem, suffix = name.rsplit(".", 1)
        parts = stem.split(".")
        hf_name = ({"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}[stem]
                   if parts[0] != "blk" else f"model.layers.{parts[1]}.{HF_BLOCK[parts[2]]}") + f".{suffix}"
        checkpoint[hf_name] = rng.standard_normal(layout.shape(name)).astype(np.float32)
        heads = {"attn_q": spec.heads, "attn_k": spec.kv_heads}.get(parts[-1])
        as_written[name] = checkpoint[hf_name] if heads is None else llamacpp_permute(checkpoint[hf_name],
                                                                                       spec.heads, heads)
    path = tmp_path / "permuted.gguf"
    write_gguf(path, spec, tensors=as_written)
    config, params, _, _ = load_gguf(path)
    expected_config, expected = hf.load_state_dict(GGUFModel.open(path).hf_config(), checkpoint)
    assert config == expected_config
    flat, reference = _flat(params), _flat(expected)
    assert flat.keys() == reference.keys()
    for key in flat:
        np.testing.assert_array_equal(flat[key], reference[key], err_msg=str(key))


def _written(path, spec: Spec):
    write_gguf(path, spec)
    return path


def _flat(params) -> dict:
    from flax.traverse_util import flatten_dict
    return {k: np.asarray(v) for k, v in flatten_dict(params).items()}


def test_reverse_permute_undoes_llama_cpps_permutation():
    rng = np.random.default_rng(0)
    for heads, kv in ((4, 4), (4, 2), (8, 1)):
        w = rng.standard_normal((kv * 16, 32))
        np.testing.assert_array_equal(reverse_permute(llamacpp_permute(w, heads, kv), heads, kv), w)
        b = rng.standard_normal(kv * 16)
        np.testing.assert_array_equal(reverse_permute(llamacpp_permute(b, heads, kv), heads, kv), b)


def test_the_config_is_what_transformers_derives(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, SPECS["llama"])
    config = GGUFModel.open(path).hf_config()
    tokens = GGUFModel.open(path).metadata["tokenizer.ggml.tokens"]
    assert config == {"model_type": "llama", "max_position_embeddings": 64, "num_hidden_layers": 2,
                      "intermediate_size": 512, "hidden_size": 256, "head_dim": 64, "rope_theta": 10000.0,
                      "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": pytest.approx(1e-5),
                      "bos_token_id": tokens.index("<|begin_of_text|>"), "eos_token_id": tokens.index("<|endoftext|>"),
                      "tie_word_embeddings": False, "vocab_size": len(tokens)}
    pytest.importorskip("transformers")
    pytest.importorskip("torch")
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    theirs = {k: v for k, v in load_gguf_checkpoint(str(path), return_tensors=False)["config"].items()
              if not k.startswith("_")}
    assert theirs.keys() == config.keys()
    assert all(theirs[k] == pytest.approx(v) if isinstance(v, float) else theirs[k] == v for k, v in config.items())


def test_a_file_named_mistral_is_read_as_mistral_as_transformers_reads_it(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, dataclasses.replace(SPECS["llama"], name="mistral"))
    assert GGUFModel.open(path).hf_config()["model_type"] == "mistral"
    config, _, _, _ = load_gguf(path)
    assert config.sliding_window == 4096  # MistralConfig's default window


def test_linear_rope_scaling_is_read_and_other_scalings_refused(tmp_path):
    def linear(w):
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(4.0)

    path = tmp_path / "linear.gguf"
    write_gguf(path, SPECS["llama"], extra=linear)
    config, _, _, _ = load_gguf(path)
    assert config.rope_scaling == jaxattn.RopeScaling("linear", 4.0)

    def yarn(w):
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(4.0)

    path = tmp_path / "yarn.gguf"
    write_gguf(path, SPECS["llama"], extra=yarn)
    with pytest.raises(hf.UnsupportedCheckpoint, match=r"yarn.gguf: llama.rope.scaling.type='yarn'"):
        load_gguf(path)


def llamacpp_rope_freqs(theta: float, dims: int, factor=32.0, low=1.0, high=4.0, old=8192) -> np.ndarray:
    """The rope_freqs.weight llama.cpp's converter writes for Llama 3.1's 'llama3' RoPE scaling."""
    freqs = 1.0 / (theta ** (np.arange(0, dims, 2, dtype=np.float32) / dims))
    factors = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < old / high:
            factors.append(1)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, np.float32)


@pytest.mark.parametrize("factor, low, high", [(32.0, 1.0, 4.0), (8.0, 1.0, 4.0), (16.0, 2.0, 8.0)])
def test_llama_3_rope_freqs_are_read_as_its_rope_scaling(tmp_path, factor, low, high):
    spec = dataclasses.replace(SPECS["llama"], layers=1, theta=500000.0)
    path = tmp_path / "llama3.gguf"
    rope = llamacpp_rope_freqs(spec.theta, spec.head_dim, factor, low, high)
    write_gguf(path, spec, extra=lambda w: w.add_tensor("rope_freqs.weight", rope))
    config, _, _, _ = load_gguf(path)
    scaling = config.rope_scaling
    assert (scaling.kind, scaling.original_max_position) == ("llama3", 8192)
    assert (scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor) == pytest.approx((factor, low, high))
    noise = rope * np.random.default_rng(0).uniform(0.5, 1.5, rope.shape).astype(np.float32)
    write_gguf(path, spec, extra=lambda w: w.add_tensor("rope_freqs.weight", noise))
    with pytest.raises(hf.UnsupportedCheckpoint, match="rope_freqs.weight: per-frequency RoPE factors that no"):
        load_gguf(path)


# ------------------------------------------------------------------ tests: the tokenizer


@pytest.mark.parametrize("name", ["llama", "llama-spm", "qwen2", "phi3", "gemma2"])
def test_the_tokenizer_encodes_and_decodes_as_transformers_does(tmp_path, name):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    spec = SPECS[name]
    path = tmp_path / f"{name}.gguf"
    write_gguf(path, dataclasses.replace(spec, layers=1))
    ours = GGUFModel.open(path).tokenizer()
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False), text
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip), text
    assert ours.eos_token_id == theirs.eos_token_id


def test_load_gguf_returns_the_tokenizer_and_the_chat_template(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, dataclasses.replace(SPECS["llama"], layers=1))
    config, params, tokenizer, template = load_gguf(path)
    assert template == CHAT_TEMPLATE
    assert isinstance(tokenizer, hf.HFTokenizer) and tokenizer.vocab_size == config.vocab_size
    assert tokenizer.encode("the")[0] == GGUFModel.open(path).metadata["tokenizer.ggml.bos_token_id"]
    assert tokenizer.decode(tokenizer.encode(" the cat")) == " the cat"
    assert GGUFModel.open(path).special_tokens == {"bos_token": "<|begin_of_text|>", "eos_token": "<|endoftext|>"}
    write_gguf(path, dataclasses.replace(SPECS["llama"], layers=1), chat_template=None)
    assert load_gguf(path)[3] is None


def test_importing_jaxattn_gguf_imports_neither_torch_nor_transformers():
    import subprocess
    import sys
    code = "import sys; from jaxattn import gguf; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ------------------------------------------------------------------ tests: refusals


def write_mamba(directory):
    """A GGUF file of an architecture jaxattn does not implement (one tensor)."""
    path = directory / "mamba.gguf"
    w = GGUFWriter(str(path), "mamba")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_an_unknown_architecture_is_refused_naming_it_and_the_file(tmp_path):
    path = write_mamba(tmp_path)
    with pytest.raises(hf.UnsupportedCheckpoint) as err:
        load_gguf(path)
    message = str(err.value)
    assert len(message.splitlines()) == 1 and str(path) in message
    assert "unsupported architecture 'mamba'" in message and "llama" in message
    assert isinstance(err.value, ValueError)


@pytest.mark.parametrize("qtype, array", [(Q.I8, np.zeros((4, 256), np.int8)),
                                          (Q.IQ4_NL, np.zeros((4, 256 // 32 * 18), np.uint8))],
                         ids=["I8", "IQ4_NL"])
def test_an_unknown_tensor_type_is_refused_naming_it_the_tensor_and_the_file(tmp_path, qtype, array):
    path = tmp_path / "m.gguf"

    def odd_tensor(w):
        w.add_tensor("blk.0.attn_q_extra.weight", array, raw_dtype=qtype if array.dtype == np.uint8 else None)

    write_gguf(path, dataclasses.replace(SPECS["llama"], layers=1), extra=odd_tensor)
    with pytest.raises(hf.UnsupportedCheckpoint) as err:
        GGUFModel.open(path)
    message = str(err.value)
    assert len(message.splitlines()) == 1 and str(path) in message
    assert f"blk.0.attn_q_extra.weight: tensor type {qtype.name} is not read" in message


@pytest.mark.parametrize("arch, tensor, why", [("qwen2", "rope_freqs.weight", "per-frequency RoPE factors"),
                                               ("llama", "blk.0.attn_gate.weight", "has no counterpart")])
def test_a_tensor_the_architecture_does_not_read_is_refused_naming_it(tmp_path, arch, tensor, why):
    path = tmp_path / "m.gguf"
    write_gguf(path, dataclasses.replace(SPECS[arch], layers=1),
               extra=lambda w: w.add_tensor(tensor, np.ones((32,) if "rope" in tensor else (4, 32), np.float32)))
    with pytest.raises(hf.UnsupportedCheckpoint, match=re.escape(f"{path}: {tensor}: ") + ".*" + why):
        load_gguf(path)


@pytest.mark.parametrize("content", [b"", b"GGUF", b"not a gguf file at all" * 10])
def test_a_file_that_is_not_gguf_is_an_invalid_checkpoint_naming_it(tmp_path, content):
    path = tmp_path / "broken.gguf"
    path.write_bytes(content)
    with pytest.raises(hf.InvalidCheckpoint, match=re.escape(str(path))):
        load_gguf(path)
    with pytest.raises(hf.InvalidCheckpoint, match="does not exist"):
        load_gguf(tmp_path / "missing.gguf")


def test_a_truncated_file_names_itself_the_tensor_and_the_likely_cause(tmp_path):
    """It said "cannot reshape array of size 399424 into shape (576,960)"."""
    path = tmp_path / "cut.gguf"
    write_gguf(path, dataclasses.replace(SPECS["llama"], layers=1), Q.Q8_0)
    data = path.read_bytes()
    path.write_bytes(data[:len(data) - 300])  # the last tensor's last bytes are gone
    with pytest.raises(hf.InvalidCheckpoint, match=re.escape(str(path)) + r".*: holds [\d,]+ of its [\d,]+ bytes: "
                       r"the file ends before this tensor's data \(truncated\?"):
        load_gguf(path)


def test_every_architecture_reads_as_a_registered_jaxattn_family():
    from jaxattn.hf.families import FAMILIES
    for record in ARCHITECTURES.values():
        assert record.model_type_of({}) in FAMILIES
    assert set(ARCHITECTURES) >= {"llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3"}


def test_the_tensor_names_agree_with_the_gguf_packages_own_map():
    """Each record's llama.cpp -> transformers names are those gguf-py's TensorNameMap maps back (Gemma's
    files have no `output`: their head is always the embedding)."""
    for record in ARCHITECTURES.values():
        arch = next(key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == record.name)
        names = gguf.get_tensor_name_map(arch, 2)
        for ours, hf_name in {**record.globals_, **{f"blk.1.{k}": f"model.layers.1.{v}"
                                                     for k, v in record.block.items()}}.items():
            found = names.get_name(hf_name)
            assert found == ours or (found is None and ours == "output"), (record.name, ours, hf_name)


# ------------------------------------------------------------------ tests: the programs


@pytest.fixture
def tiny_gguf(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_gguf(path, dataclasses.replace(SPECS["llama"], layers=1))
    return path


def test_sample_reads_a_gguf_file(tiny_gguf, capsys):
    code, out, err = call(capsys, sample.main, "--gguf", str(tiny_gguf), "--prompt", " the cat",
                          "--max-new-tokens", "4", "--temperature", "0")
    assert code == 0, err
    assert out.startswith(" the cat") and "tokens/s" in err


@pytest.mark.parametrize("content", [b"GGUF-but-broken", None])
def test_sample_refuses_a_bad_gguf_file_in_one_line(tmp_path, capsys, content):
    path = tmp_path / "bad.gguf"
    if content is not None:
        path.write_bytes(content)
    code, out, err = call(capsys, sample.main, "--gguf", str(path), "--prompt", "A")
    assert code == 1 and out == ""
    assert err.startswith("error: cannot load ") and str(path) in err and len(err.splitlines()) == 1


def test_sample_refuses_an_unsupported_architecture_in_one_line(tmp_path, capsys):
    path = write_mamba(tmp_path)
    code, _, err = call(capsys, sample.main, "--gguf", str(path), "--prompt", "A")
    assert code == 1 and "unsupported architecture 'mamba'" in err and len(err.splitlines()) == 1


def test_export_writes_a_gguf_file_as_a_transformers_directory(tiny_gguf, tmp_path, capsys):
    from train import export
    out = tmp_path / "hf"
    code, printed, err = call(capsys, export.main, "--gguf", str(tiny_gguf), "--out", str(out))
    assert code == 0, err
    assert "as LlamaForCausalLM" in printed and (out / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    config, params = hf.load_pretrained(out)
    ours, _ = GGUFModel.open(tiny_gguf).load()
    assert config == ours
    assert hf.load_tokenizer(out).encode(" the cat") == GGUFModel.open(tiny_gguf).tokenizer().encode(" the cat")
    from jaxattn.hf.chat_template import special_tokens
    assert special_tokens(out)["bos_token"] == "<|begin_of_text|>"
    del params


def test_serve_takes_the_name_and_the_chat_template_from_a_gguf_file(tiny_gguf):
    from train import serve
    args = serve.parse_args(["--gguf", str(tiny_gguf)])
    assert serve.model_name(args) == "tiny"
    template = serve.chat_template(args, None)
    assert template.render([{"role": "user", "content": "hi"}]) == "<|im_start|>user\nhi<|im_end|>\n"
    assert template.special_tokens["bos_token"] == "<|begin_of_text|>"


def test_the_quicker_reader_parses_what_the_gguf_packages_reader_parses(tiny_gguf):
    from gguf import GGUFReader

    from jaxattn.gguf.reader import _PlainReader
    stock, plain = GGUFReader(tiny_gguf), _PlainReader(tiny_gguf)
    assert {k: v.contents() for k, v in stock.fields.items()} == {k: v.contents() for k, v in plain.fields.items()}
    assert [(t.name, t.tensor_type, t.shape.tolist()) for t in stock.tensors] == \
        [(t.name, t.tensor_type, t.shape.tolist()) for t in plain.tensors]
    for theirs, ours in zip(stock.tensors, plain.tensors):
        np.testing.assert_array_equal(np.asarray(theirs.data), np.asarray(ours.data))
