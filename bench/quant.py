"""Quantized decoding: jaxattn's weight and KV-cache formats beside transformers and llama.cpp, and their perplexity.

    PYTHONPATH=$PWD python bench/quant.py [--checkpoint RUN_DIR] [--rounds 3] [--new-tokens 128]
        [--threads N] [--runners jax,engine,hf,llamacpp] [--caches float,int8] [--out DIR/NAME]
    PYTHONPATH=$PWD python bench/quant.py --quick      # a smoke run: a tiny Llama, a few tokens, one round

Decode tokens/s, greedy, after a prompt of --prompt-len (16) tokens, --new-tokens (128) new tokens per
sequence, on one set of random weights of SmolLM2-135M's shape (bench/serve.py's `smollm2` checkpoint:
Llama, 30 layers, d 576, 9 query / 3 kv heads of 64, MLP 1536, vocab 49152, tied; random init, seed 0,
written once with `jaxattn.hf.save_pretrained` under --cache-dir), every runner reading those weights:

* `jax`: `jaxattn.generate` at batch 1 for weights float32, bfloat16 (`hf.load_pretrained(dtype=
  "bfloat16")`: the compute dtype too), int8, int4 (groups of 32 each) and int4:asym (groups of 32
  with a minimum, llama.cpp's Q4_1; `jaxattn.quantize`), each
  with the KV cache in the model's float compute dtype ("float") and in int8 (--caches); the kernels "auto"
  resolves to on this machine (`Kernels.quantized`: the native loop on a CPU).
* `engine`: `jaxattn.serving.Engine` with --engine-batch (32) sequences at once, all added together,
  for float32, int8 and int4 weights and each --caches: output tokens/s over the whole run (prefill
  included), after an untimed warm-up of other prompts; no prefix caching.
* `hf`: transformers' `generate` (attn_implementation "sdpa", float32, KV cache) at batch 1 and at
  --engine-batch (one static batch), torch threads = --threads.
* `llamacpp`: llama.cpp through `llama-cpp-python` (a bench-only dependency, never a test's: `pip
  install llama-cpp-python` builds it from source) on a Q8_0, a Q4_0 and a Q4_1 GGUF of the same weights,
  written here with the `gguf` package (every 2-D tensor in that type, norms float32: llama.cpp's
  "pure" quantization), batch 1, n_threads = n_threads_batch = --threads, its KV cache float16 (its
  default). `--llama-n-batch` sets n_batch (default 1: a llama.cpp built here from source with
  GGML_NATIVE has crashed on batched prompt evaluation on an AMD EPYC with AVX-512; one token per
  evaluation does not).
  Reported as unavailable, with the reason, where `llama_cpp` does not import.

Each (runner, format) cell runs in a fresh process (`bench.fresh`) restricted to --threads cores, once
per round, the cells in turns (the order reversed every other round); inside, one untimed call compiles
and warms up, then --calls timed calls; reported: the median over rounds of each process's median.
Tokens/s = sequences x new tokens / the call's wall time (the prompt's prefill included: at batch 1
about one step's worth). Beside each batch-1 cell: the bytes of weights one token reads (every weight
as stored, values and scales; an embedding table one row, unless the tied head multiplies by all of
it; llama.cpp: the GGUF's tensors, the token table being its tied head) and the GB/s that makes, over
the machine's streaming read bandwidth (`bench.quant_matmul.streaming_read` on a buffer the size of
the float32 weights, in its own process each round).

Perplexity (--checkpoint RUN_DIR: a run of `python -m train.tiny_lm`, e.g. the baby model of `make
train`; or --ppl-gguf FILE: a real model, e.g. SmolLM2-135M-Instruct, its float32 the file's weights
as dequantized on loading, q, k and v fused as the programs load it; no weights are committed): the
model in float32, bfloat16, int8 (groups of 32), int8:channel (a scale per output channel), int4
(groups of 32), int4:64 and int4:asym (groups of 32 with a minimum, as llama.cpp's Q4_1), and for
--ppl-gguf the file's own blocks kept (`jaxattn.gguf.kept`, as `train.sample --gguf` runs it), on the last 10% of Tiny Shakespeare (the split the run held out; the
file's own tokenizer for --ppl-gguf; --data, else $JAXATTN_SHAKESPEARE, else
../shared/data/tinyshakespeare.txt beside the repository, else the cache), in windows of the
model's max_seq_len (--ppl-window: at most that many), each window's tokens after its first
predicted from those before them in it: exp(mean negative log-likelihood) over every predicted
token (at most --ppl-tokens of them), the kernels "auto" resolves to. A random model's perplexity
says nothing: without --checkpoint or --ppl-gguf it is not measured (`--runners none --ppl-gguf
FILE` measures it alone).

The int8 KV cache: where this tree's `jaxattn.generate` takes `CACHE_KEYWORD` and `EngineConfig` has
a field of that name, its cells run with it set to "int8"; elsewhere they are reported unavailable
with the reason (`cache_options`). Writes --out.json and --out.md (default bench/results/quant_<CPU
class>, `bench.machine.cpu_class`: a speed holds for its class; bench/results/quant.md then gathers
every class's table) with the CPU named, the command and the checks of the targets (int8 >= 2.5x and
int4 >= 4x our float32 at batch 1; our int8, int4 and int4:asym beside llama.cpp's Q8_0, Q4_0 and Q4_1
of the same weights at equal threads; perplexity of int8 within 0.2% of float32, int4 within 5%).

    python -m bench.fresh bench.quant:run_case SPEC_JSON     # one cell, what each fresh process runs
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import fresh  # noqa: E402
from bench.machine import (CPU_CLASSES, cpu_cores, load_average, pin_to_cores, portable_command,  # noqa: E402
                           write_results)

RESULTS = ROOT / "bench" / "results"
WEIGHTS = ("float32", "bfloat16", "int8", "int4", "int4:asym")
ENGINE_WEIGHTS = ("float32", "int8", "int4")
CACHES = ("float", "int8")
PPL_FORMATS = ("float32", "bfloat16", "int8", "int8:channel", "int4", "int4:64", "int4:asym")
GGUF_TYPES = ("Q8_0", "Q4_0", "Q4_1")
# Our batch-1 weights beside llama.cpp's format of the same numbers (the moonshot checks).
LLAMA_PEERS = (("int8", "Q8_0"), ("int4", "Q4_0"), ("int4:asym", "Q4_1"))
RUNNERS = ("jax", "engine", "hf", "llamacpp")
WEIGHT_NAMES = {"int8": "int8 (groups of 32)", "int8:channel": "int8 (per channel)", "int4": "int4 (groups of 32)",
                "int4:64": "int4 (groups of 64)", "int4:asym": "int4 with minimums (groups of 32, as Q4_1)",
                "kept": "the file's own blocks, kept (`train.sample --gguf`'s default)"}
# The int8 KV cache's switch: the keyword of `jaxattn.generate` and the field of `EngineConfig` that
# take "int8" (an older tree without it reports those cells unavailable).
CACHE_KEYWORD = "kv_cache"
SEED = 0


# ---------------------------------------------------------------- formats

def cache_options(cache: str, target) -> tuple[dict | None, str | None]:
    """(keyword arguments asking `target` (`jaxattn.generate` or `EngineConfig`) for the KV cache
    `cache`, None) or (None, why it cannot): "float" is the model's compute dtype, which both use
    unasked; "int8" needs `CACHE_KEYWORD` among `target`'s parameters."""
    if cache == "float":
        return {}, None
    if cache != "int8":
        raise ValueError(f"cache must be one of {CACHES}, got {cache!r}")
    if CACHE_KEYWORD in inspect.signature(target).parameters:
        return {CACHE_KEYWORD: "int8"}, None
    return None, (f"no int8 KV cache in this tree: {getattr(target, '__name__', target)} takes no "
                  f"{CACHE_KEYWORD}= (bench.quant.CACHE_KEYWORD)")


def load_weights(checkpoint: str, weights: str):
    """(config, params) of a transformers checkpoint in the weight format `weights`: "float32",
    "bfloat16" (parameters and compute), or a `jaxattn.quantize` mode of the float32 parameters; q, k and v
    fused into one projection first, as `train.sample` and `train.serve` load a model (`bench.serve.load_model`)."""
    from bench.serve import load_model
    from jaxattn.quantization import quantize
    config, params = load_model(checkpoint, dtype="bfloat16" if weights == "bfloat16" else "float32")
    if weights not in ("float32", "bfloat16"):
        params = quantize(params, config, weights)
    return config, params


def weight_bytes_per_token(params, config) -> int:
    """The bytes of weights one decoded token reads at batch 1: every parameter as stored (a quantized
    weight: values and scales), except that an embedding table is looked up (one row read) unless it
    is the tied head (every row read) and the model has no quantized copy of it (`TIED_HEAD`)."""
    import flax.linen as nn

    from jaxattn.quantization import TIED_HEAD, weight_bytes
    params = nn.unbox(params)
    params = params.get("params", params)
    total = weight_bytes(params)
    tables = [params["wte"]["embedding"]] + [v["embedding"] for k, v in params.items() if k.startswith("value_embed")]
    head_is_table = config.tie_embeddings and TIED_HEAD not in params
    for i, table in enumerate(tables):
        if not (i == 0 and head_is_table):
            total -= table.nbytes - table.nbytes // table.shape[0]
    return int(total)


def prompts(batch: int, length: int, vocab: int, seed: int = SEED) -> list[list[int]]:
    """`batch` prompts of `length` ids drawn uniformly from [3, vocab) (past any special token), seeded."""
    import numpy as np
    rng = np.random.default_rng(seed)
    return rng.integers(3, vocab, (batch, length)).tolist()


# ---------------------------------------------------------------- GGUF files of the same weights

def llama_cpp_permute(weights, n_head: int):
    """llama.cpp's converter's q/k row order (`jaxattn.gguf.reader.reverse_permute` undoes it): each head's
    rows from two rotated halves to interleaved pairs."""
    dim = weights.shape[0] // n_head // 2
    return weights.reshape(n_head, 2, dim, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def llama_cpp_tensors(state: dict, config) -> dict:
    """A Llama state dict under transformers' names as llama.cpp's (names, q/k rows permuted); a tied
    model has no `output.weight` (llama.cpp multiplies by `token_embd.weight`)."""
    from jaxattn.gguf.architecture import GLOBALS, LLAMA_BLOCK
    names = {f"{hf}.weight": f"{cpp}.weight" for cpp, hf in GLOBALS.items()}
    out = {}
    for name, array in state.items():
        if name.startswith("model.layers."):
            index, _, rest = name[len("model.layers."):].partition(".")
            part = {hf: cpp for cpp, hf in LLAMA_BLOCK.items()}[rest.removesuffix(".weight")]
            if part == "attn_q":
                array = llama_cpp_permute(array, config.num_heads)
            elif part == "attn_k":
                array = llama_cpp_permute(array, config.num_kv_heads)
            out[f"blk.{index}.{part}.weight"] = array
        elif name == "lm_head.weight" and config.tie_embeddings:
            continue
        else:
            out[names[name]] = array
    return out


def write_gguf(checkpoint: str | Path, path: str | Path, qtype: str) -> Path:
    """The transformers Llama checkpoint `checkpoint` as a llama.cpp GGUF file at `path`: every 2-D
    tensor in `qtype` ("Q8_0", "Q4_0", "Q4_1", "F32"), the norms float32, and a SentencePiece-kind vocabulary
    of placeholder pieces (`<unk>`, `<s>`, `</s>`, the 256 byte tokens, then `t{id}`: the bench feeds
    ids, never text). Written to a scratch name, then renamed into place."""
    import gguf
    import numpy as np
    from gguf.quants import quantize

    from jaxattn.hf.architectures import config_from_hf
    from jaxattn.hf.checkpoint import read_config_json
    from jaxattn.hf.safetensors_io import CheckpointReader
    _, config = config_from_hf(read_config_json(Path(checkpoint)), "float32")
    with CheckpointReader(checkpoint) as reader:
        state = {name: np.asarray(reader.read(name), np.float32) for name in reader.names()}
    tensors = llama_cpp_tensors(state, config)
    kind = gguf.GGMLQuantizationType[qtype]
    path = Path(path)
    scratch = path.with_name(f".{path.name}.{os.getpid()}")
    w = gguf.GGUFWriter(str(scratch), "llama")
    w.add_name("jaxattn-bench-quant")
    w.add_block_count(config.num_layers)
    w.add_context_length(config.max_seq_len)
    w.add_embedding_length(config.d_model)
    w.add_feed_forward_length(config.mlp_hidden)
    w.add_head_count(config.num_heads)
    w.add_head_count_kv(config.num_kv_heads)
    w.add_rope_dimension_count(config.head_dim)
    w.add_rope_freq_base(config.rope_theta)
    w.add_layer_norm_rms_eps(config.norm_eps)
    w.add_vocab_size(config.vocab_size)
    w.add_file_type({"Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
                     "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1, "F32": gguf.LlamaFileType.ALL_F32}[qtype])
    specials = ["<unk>", "<s>", "</s>"]
    pieces = (specials + [f"<0x{b:02X}>" for b in range(256)])[:config.vocab_size]
    pieces += [f"t{i}" for i in range(len(pieces), config.vocab_size)]
    types = [2, 3, 3] + [6] * 256 + [1] * (config.vocab_size - 259)
    w.add_tokenizer_model("llama")
    w.add_token_list(pieces)
    w.add_token_scores([0.0] * len(pieces))
    w.add_token_types(types[:len(pieces)])
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    for name, array in tensors.items():
        if array.ndim == 2 and kind != gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, quantize(array, kind), raw_dtype=kind)
        else:
            w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    scratch.rename(path)
    return path


def gguf_bytes_per_token(path: str | Path) -> int:
    """The bytes of a GGUF file's tensors one token reads at batch 1 (all of them: a tied file's token
    table is its head; an untied one's token table one row)."""
    import gguf
    reader = gguf.GGUFReader(str(path))
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    if "output.weight" in sizes:
        table = next(t for t in reader.tensors if t.name == "token_embd.weight")
        sizes["token_embd.weight"] //= int(table.shape[-1])  # gguf's shape is (columns, rows)
    return sum(sizes.values())


# ---------------------------------------------------------------- the cells (each in a fresh process)

def _speed(timing, tokens: int) -> dict:
    return {"tokens_per_s": tokens / timing.median_s, "median_s": timing.median_s, "times_s": timing.times_s,
            "compile_s": timing.compile_s}


def jax_decoder(spec: dict) -> tuple:
    """(a call of `jaxattn.generate` at batch 1 in `spec["weights"]` and `spec["cache"]` on JAX's default
    device, facts about it) or (None, why it cannot run)."""
    import jax
    import numpy as np

    from jaxattn.decoding import generate
    from jaxattn.kernels import prepare_weights, resolve_kernels
    options, reason = cache_options(spec["cache"], generate)
    if reason:
        return None, {"available": False, "reason": reason}
    config, params = load_weights(spec["checkpoint"], spec["weights"])
    kernels = resolve_kernels()[0]
    params = prepare_weights(params, kernels)  # as train.sample runs them
    prompt = np.asarray(prompts(1, spec["prompt_len"], config.vocab_size), np.int32)
    lengths = np.full((1,), prompt.shape[1], np.int32)

    def call():
        return generate(params, config, prompt, lengths, max_new_tokens=spec["new_tokens"], rng=jax.random.PRNGKey(0),
                        temperature=0.0, kernels=kernels, **options).tokens
    return call, {"available": True, "kernels": kernels.to_dict(),
                  "weight_bytes_per_token": weight_bytes_per_token(params, config)}


def run_jax(spec: dict) -> dict:
    """`jax_decoder`'s call timed: a warm-up (compiling), then `spec["calls"]` calls."""
    from bench.timing import time_call
    call, facts = jax_decoder(spec)
    return facts if call is None else {**facts, **_speed(time_call(call, spec["calls"]), spec["new_tokens"])}


def engine_decoder(spec: dict) -> tuple:
    """(a call of `jaxattn.serving.Engine.generate` on `spec["batch"]` prompts added at once, greedy,
    `spec["new_tokens"]` each, the engine compiled and warmed up on other prompts, facts about it) or
    (None, why it cannot run). No prefix caching."""
    import math
    import time

    from jaxattn.kernels import prepare_weights, resolve_kernels
    from jaxattn.serving import Engine, EngineConfig, SamplingParams
    options, reason = cache_options(spec["cache"], EngineConfig)
    if reason:
        return None, {"available": False, "reason": reason}
    config, params = load_weights(spec["checkpoint"], spec["weights"])
    kernels = resolve_kernels()[0]
    params = prepare_weights(params, kernels)  # as train.serve runs them
    batch, page = spec["batch"], 16
    longest = spec["prompt_len"] + spec["new_tokens"]
    engine_config = EngineConfig(max_seqs=batch, page_size=page, num_pages=batch * math.ceil(longest / page),
                                 prefix_caching=False, max_model_len=longest, **options)
    start = time.perf_counter()
    engine = Engine(params, config, engine_config, kernels=kernels)  # compiles every step program
    compile_s = time.perf_counter() - start
    sampling = SamplingParams(temperature=0.0, max_tokens=spec["new_tokens"], seed=0)
    engine.generate(prompts(batch, spec["prompt_len"], config.vocab_size, seed=SEED + 1), sampling)  # warm-up
    work = prompts(batch, spec["prompt_len"], config.vocab_size)

    def call():
        outputs = engine.generate(work, sampling)
        if any(len(o) != spec["new_tokens"] for o in outputs):
            raise RuntimeError(f"engine: a sequence ended before {spec['new_tokens']} tokens")
        return outputs
    return call, {"available": True, "compile_s": compile_s, "kernels": kernels.to_dict(),
                  "weight_bytes_per_token": weight_bytes_per_token(params, config)}


def run_engine(spec: dict) -> dict:
    """`engine_decoder`'s call timed `spec["calls"]` times: output tokens/s over the whole run."""
    from bench.timing import time_call
    call, facts = engine_decoder(spec)
    if call is None:
        return facts
    timing = time_call(call, spec["calls"], warmup=False)
    return {**facts, "tokens_per_s": spec["batch"] * spec["new_tokens"] / timing.median_s,
            "median_s": timing.median_s, "times_s": timing.times_s}


def run_hf(spec: dict) -> dict:
    """transformers' `generate` (sdpa, float32) at `spec["batch"]`: bench/hf_decode.py's measure."""
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError as err:
        return {"available": False, "reason": f"torch or transformers does not import: {err}"}
    from bench import hf_decode
    torch.set_num_threads(spec["threads"])
    model = AutoModelForCausalLM.from_pretrained(spec["checkpoint"], dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    prompt = torch.tensor(prompts(spec["batch"], spec["prompt_len"], model.config.vocab_size), dtype=torch.long)
    result = hf_decode.measure(model, prompt, "smollm2", spec["new_tokens"], spec["calls"])
    return {"available": True, "tokens_per_s": result["tokens_per_s"], "median_s": result["seconds"],
            "times_s": result["runs"], "torch": torch.__version__, "threads": torch.get_num_threads(),
            "attn_implementation": model.config._attn_implementation}


def run_llamacpp(spec: dict) -> dict:
    """llama.cpp on `spec["gguf"]` at batch 1: the prompt evaluated, then greedy steps of one token
    (`Llama.eval`, then the argmax of the last token's logits, `llama_get_logits_ith(ctx, -1)`:
    `Llama.scores` is filled only with logits_all), the context reset before each call."""
    try:
        import llama_cpp
    except ImportError as err:
        return {"available": False, "reason": f"llama-cpp-python is not installed ({err}): pip install "
                                              "llama-cpp-python (it builds llama.cpp from source)"}
    import numpy as np

    from bench.timing import time_call
    n_ctx = spec["prompt_len"] + spec["new_tokens"] + 1
    llm = llama_cpp.Llama(spec["gguf"], n_ctx=n_ctx, n_batch=spec["n_batch"], n_ubatch=spec["n_batch"],
                          n_threads=spec["threads"], n_threads_batch=spec["threads"], verbose=False)
    vocab = llm.n_vocab()
    prompt = prompts(1, spec["prompt_len"], vocab)[0]
    last = {}

    def call():
        llm.reset()
        llm.eval(prompt)
        tokens = []
        for _ in range(spec["new_tokens"]):
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(vocab,))
            token = int(np.argmax(logits))
            tokens.append(token)
            if len(tokens) < spec["new_tokens"]:
                llm.eval([token])
        last["tokens"] = tokens
    timing = time_call(call, spec["calls"])
    assert len(last["tokens"]) == spec["new_tokens"]
    return {"available": True, **_speed(timing, spec["new_tokens"]), "llama_cpp_python": llama_cpp.__version__,
            "n_threads": spec["threads"], "n_batch": spec["n_batch"], "system_info":
            llama_cpp.llama_print_system_info().decode(errors="replace").strip()}


def run_stream(spec: dict) -> dict:
    """The machine's streaming read bandwidth over `spec["bytes"]` (bench/quant_matmul.py's read)."""
    from bench.quant_matmul import streaming_read
    from bench.timing import time_call
    read, nbytes = streaming_read(spec["bytes"])
    timing = time_call(read, max(spec["calls"], 5))
    return {"available": True, "gb_per_s": nbytes / timing.median_s / 1e9, "bytes": nbytes,
            "times_s": timing.times_s}


def perplexity(params, config, ids, *, kernels=None, batch: int = 32, window: int | None = None) -> dict:
    """exp(mean negative log-likelihood) of `ids` (a 1-D int array) under the model: windows of
    `window` (default `config.max_seq_len`) tokens, each token after a window's first predicted from
    those before it in the window (the tail shorter than two tokens dropped), at most `batch` windows
    a call. {"perplexity", "nll", "tokens"}."""
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxattn.kernels import Kernels
    from jaxattn.model import DecoderLM
    L = min(window or config.max_seq_len, config.max_seq_len)
    ids = np.asarray(ids, np.int32)
    windows = [ids[i:i + L] for i in range(0, len(ids) - 1, L) if len(ids[i:i + L]) >= 2]
    batch = min(batch, len(windows))  # no rows of padding alone
    model = DecoderLM(config, kernels or Kernels())

    @functools.partial(jax.jit)
    def nll_sum(params, tokens, counts):  # tokens [B, L], counts [B]: real tokens per row
        logits = model.apply({"params": params}, tokens).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
        real = jnp.arange(1, tokens.shape[1])[None, :] < counts[:, None]
        return -jnp.sum(jnp.where(real, picked, 0.0))
    total, count = 0.0, 0
    for start in range(0, len(windows), batch):
        rows = windows[start:start + batch]
        tokens = np.zeros((batch, L), np.int32)  # a fixed shape: one compilation
        counts = np.zeros((batch,), np.int32)
        for r, window in enumerate(rows):
            tokens[r, :len(window)], counts[r] = window, len(window)
        total += float(nll_sum(params, jnp.asarray(tokens), jnp.asarray(counts)))
        count += int(np.maximum(counts - 1, 0).sum())
    nll = total / count
    return {"perplexity": float(np.exp(nll)), "nll": nll, "tokens": count}


def perplexity_model(spec: dict) -> tuple:
    """(params, config, tokenizer) of `spec["gguf"]` (a GGUF file, float32 as dequantized on loading, q, k
    and v fused as the programs load it) or else of `spec["checkpoint"]` (a run's best checkpoint)."""
    import flax.linen as nn

    from jaxattn import with_fused_qkv
    from jaxattn.gguf import load_gguf
    from train.models.runs import load_for_sampling
    if spec.get("gguf"):
        config, params, tokenizer, _ = load_gguf(spec["gguf"])
        params, config = with_fused_qkv(params, config)
        return params, config, tokenizer
    params, config, tokenizer = load_for_sampling(spec["checkpoint"])
    return nn.unbox(params), config, tokenizer


def run_perplexity(spec: dict) -> dict:
    """Each of `spec["formats"]` of a model (`perplexity_model`) on its corpus's val split, in windows
    of at most `spec["window"]` tokens (None: the model's context)."""
    import jax
    import numpy as np

    from bench.serve import corpus_path
    from jaxattn.gguf import GGUFModel
    from jaxattn.kernels import resolve_kernels
    from jaxattn.quantization import quantize
    from train.data.corpus import load_corpus
    params, config, tokenizer = perplexity_model(spec)
    corpus = load_corpus(corpus_path(spec.get("data")), tokenizer=tokenizer)
    val = np.asarray(corpus.val)[:spec["max_tokens"] + 1] if spec.get("max_tokens") else np.asarray(corpus.val)
    # The float dots exact: each format's perplexity is its weights', not that of bfloat16 arithmetic ("auto"'s
    # matmul on a CPU with AMX); the "bfloat16" format asks for that by its dtype.
    kernels = resolve_kernels()[0].replace(matmul="xla")
    results = {}
    kept = GGUFModel.open(spec["gguf"]).kept_quantization() if spec.get("gguf") else None
    for fmt in spec["formats"]:
        if fmt == "kept" and kept is None:  # a checkpoint, or a file of float weights: nothing kept
            continue
        if fmt == "kept":
            cfg, p = config, quantize(params, config, kept.layers, head=kept.head)
        elif fmt == "bfloat16":
            cfg = config.replace(dtype="bfloat16", param_dtype="bfloat16")
            p = jax.tree.map(lambda x: np.asarray(x).astype(jax.numpy.bfloat16), params)
        else:
            cfg, p = config, params if fmt == "float32" else quantize(params, config, fmt)
        results[fmt] = perplexity(p, cfg, val, kernels=kernels, window=spec.get("window"))
    return {"available": True, "results": results, "model": {
        "d_model": config.d_model, "num_layers": config.num_layers, "num_heads": config.num_heads,
        "vocab_size": config.vocab_size, "max_seq_len": config.max_seq_len, "tie_embeddings": config.tie_embeddings,
        "window": min(spec.get("window") or config.max_seq_len, config.max_seq_len)},
        "val_tokens": int(len(val)), "kernels": kernels.to_dict()}


CELLS = {"jax": run_jax, "engine": run_engine, "hf": run_hf, "llamacpp": run_llamacpp, "stream": run_stream,
         "perplexity": run_perplexity}


def run_case(spec: dict) -> dict:
    """One cell (`spec["runner"]` of CELLS) on `spec["threads"]` cores: what each fresh process runs."""
    pin_to_cores(spec["threads"])
    return CELLS[spec["runner"]](spec)


# ---------------------------------------------------------------- the driver

def quick_config():
    """The smoke run's model: SmolLM2's kind (Llama, tied, GQA), tiny."""
    from jaxattn.config import ModelConfig
    return ModelConfig(vocab_size=512, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                       mlp_hidden=128, mlp="swiglu", norm="rmsnorm", norm_eps=1e-5, positions="rope",
                       rope_theta=100000.0, use_bias=False, tie_embeddings=True, max_seq_len=128)


def cases(args, checkpoint: Path, ggufs: dict[str, Path], stream_bytes: int) -> list[dict]:
    """Every cell of the run, as the specs the fresh processes take."""
    base = {"checkpoint": str(checkpoint), "threads": args.threads, "calls": args.calls,
            "prompt_len": args.prompt_len, "new_tokens": args.new_tokens}
    out = []
    if "jax" in args.runners:
        out += [{**base, "runner": "jax", "weights": w, "cache": c, "batch": 1} for w in WEIGHTS for c in args.caches]
    if "engine" in args.runners:
        out += [{**base, "runner": "engine", "weights": w, "cache": c, "batch": args.engine_batch}
                for w in ENGINE_WEIGHTS for c in args.caches]
    if "hf" in args.runners:
        out += [{**base, "runner": "hf", "weights": "float32", "cache": "float", "batch": b}
                for b in (1, args.engine_batch)]
    if "llamacpp" in args.runners:
        out += [{**base, "runner": "llamacpp", "weights": q, "cache": "float16", "batch": 1, "gguf": str(ggufs[q]),
                 "n_batch": args.llama_n_batch} for q in GGUF_TYPES]
    if out:
        out.append({**base, "runner": "stream", "bytes": stream_bytes})
    return out


def model_line(facts: dict, quick: bool) -> str:
    """The benchmarked model in words, from `bench.serve.ensure_checkpoint`'s facts."""
    if quick:
        return f"the smoke run's tiny Llama ({facts['params'] / 1e6:.2f}M params, random init)"
    return f"SmolLM2-135M's shape ({facts['architecture']}, {facts['params'] / 1e6:.1f}M params, random init)"


def cell_name(spec: dict) -> str:
    return f"{spec['runner']} {spec.get('weights', '')} {spec.get('cache', '')} b{spec.get('batch', '')}".strip()


def measure(specs: list[dict], rounds: int, timeout: float) -> dict[str, dict]:
    """Each cell once a round in a fresh process, in turns; per cell its specs, every round's record, and
    `unavailable` or `failed` (then it is not run again)."""
    cells = {cell_name(s): {"spec": s, "records": []} for s in specs}
    order = list(cells)
    for round_index in range(rounds):
        for name in order if round_index % 2 == 0 else order[::-1]:
            cell = cells[name]
            if "unavailable" in cell or "failed" in cell:
                continue
            print(f"round {round_index + 1} of {rounds}: {name}", file=sys.stderr, flush=True)
            try:
                record = fresh.call("bench.quant:run_case", cell["spec"], threads=cell["spec"]["threads"],
                                    timeout=timeout)
            except fresh.FreshProcessError as err:
                cell["failed"] = str(err)
                continue
            if not record["available"]:
                cell["unavailable"] = record["reason"]
                continue
            record["load_average"] = load_average()
            cell["records"].append(record)
    return cells


def summarize(cells: dict[str, dict], ggufs: dict[str, Path]) -> tuple[list[dict], float | None]:
    """(one row per cell: medians over rounds, bytes per token, GB/s against the streaming read; the
    streaming read's median GB/s)."""
    stream = [r["gb_per_s"] for c in cells.values() if c["spec"]["runner"] == "stream" for r in c["records"]]
    stream_gbs = statistics.median(stream) if stream else None
    rows = []
    for cell in cells.values():
        spec = cell["spec"]
        if spec["runner"] == "stream":
            continue
        row = {k: spec[k] for k in ("runner", "weights", "cache", "batch")}
        if "unavailable" in cell or "failed" in cell:
            row["unavailable" if "unavailable" in cell else "failed"] = cell.get("unavailable") or cell["failed"]
        if cell["records"]:
            records = cell["records"]
            row["tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in records)
            row["rounds"] = [r["tokens_per_s"] for r in records]
            per_token = records[0].get("weight_bytes_per_token")
            if spec["runner"] == "llamacpp":
                per_token = gguf_bytes_per_token(ggufs[spec["weights"]])
            if spec["runner"] == "hf":  # transformers reads the float32 weights our float32 cell reads
                per_token = next((c["records"][0]["weight_bytes_per_token"] for c in cells.values()
                                  if c["spec"]["runner"] == "jax" and c["spec"]["weights"] == "float32"
                                  and c["records"]), None)
            row["weight_bytes_per_token"] = per_token
            if per_token and spec["batch"] == 1:
                row["gb_per_s"] = per_token * row["tokens_per_s"] / 1e9
                row["of_stream"] = row["gb_per_s"] / stream_gbs if stream_gbs else None
            row["settings"] = {k: v for k, v in records[0].items()
                               if k not in ("available", "tokens_per_s", "median_s", "times_s", "load_average")}
        rows.append(row)
    return rows, stream_gbs


def tokens_per_s(rows, runner, weights, cache="float", batch=1):
    return next((r.get("tokens_per_s") for r in rows if (r["runner"], r["weights"], r["cache"], r["batch"])
                 == (runner, weights, cache, batch)), None)


def checks(rows: list[dict], ppl: dict | None) -> list[dict]:
    """The targets' figures: each {"what", "value", "target", "holds"} (holds None where not measured)."""
    def ratio(a, b):
        return a / b if a and b else None
    f32 = tokens_per_s(rows, "jax", "float32")
    out = []
    for weights, target in (("int8", 2.5), ("int4", 4.0)):
        value = ratio(tokens_per_s(rows, "jax", weights), f32)
        out.append({"what": f"{WEIGHT_NAMES.get(weights, weights)} weights, batch 1: tok/s over our float32's",
                    "value": value, "target": f">= {target}x", "holds": None if value is None else value >= target})
    for weights, qtype in LLAMA_PEERS:
        value = ratio(tokens_per_s(rows, "jax", weights), tokens_per_s(rows, "llamacpp", qtype, "float16"))
        out.append({"what": f"moonshot: our {weights} over llama.cpp's {qtype}, batch 1, equal threads",
                    "value": value, "target": ">= 1x", "holds": None if value is None else value >= 1.0})
    results = (ppl or {}).get("results", {})
    base = results.get("float32", {}).get("perplexity")
    for fmt, limit in (("int8", 0.002), ("int4", 0.05)):
        value = ratio(results.get(fmt, {}).get("perplexity"), base)
        out.append({"what": f"perplexity of {WEIGHT_NAMES.get(fmt, fmt)} weights over float32's", "value": value,
                    "target": f"<= {1 + limit:g}x", "holds": None if value is None else value <= 1 + limit})
    return out


def fmt(value, spec=",.0f", none="–") -> str:
    return none if value is None else format(value, spec)


def markdown(record: dict) -> str:
    meta = record["meta"]
    rows = record["rows"]
    lines = [f"# Quantized decoding on {meta['machine_line']}", ""]
    if meta.get("note"):
        lines += [f"**{meta['note']}**", ""]
    if not rows:
        lines += ["No decoding cells were run (--runners none)."]
    else:
        lines += [f"{meta['model']}; greedy, prompt {meta['prompt_len']} tokens, {meta['new_tokens']} new tokens "
                  f"per sequence; {meta['threads']} thread(s) for every runner (each process on {meta['threads']} "
                  f"core(s); torch threads and llama.cpp's n_threads the same); each cell in a fresh process per "
                  f"round, cells in turns, {meta['calls']} timed call(s) after a warm-up in each; medians of "
                  f"{meta['rounds']} round(s). Cache \"float\": the model's compute dtype (bfloat16 for the bfloat16 "
                  f"weights). tok/s: sequences x new tokens over the call (the prompt's prefill included). MB/token: "
                  f"the weights one token reads at batch 1; GB/s: that times tok/s, beside the machine's streaming "
                  f"read of {fmt(meta['stream_gb_per_s'], '.1f')} GB/s.", "",
                  "| runner | weights | cache | batch | tok/s | vs our float32 (same batch) | MB/token | GB/s "
                  "| of stream |", "|" + " --- |" * 9]
    for r in rows:
        what = {"jax": "jaxattn generate", "engine": "jaxattn engine", "hf": "transformers generate (sdpa)",
                "llamacpp": "llama.cpp"}[r["runner"]]
        head = f"| {what} | {WEIGHT_NAMES.get(r['weights'], r['weights'])} | {r['cache']} | {r['batch']} |"
        if "tokens_per_s" not in r:
            state = "unavailable" if "unavailable" in r else "failed"
            lines.append(f"{head} {state}: {r.get('unavailable') or r.get('failed')} |" + " |" * 4)
            continue
        base = tokens_per_s(rows, "jax" if r["batch"] == 1 else "engine", "float32", "float", r["batch"])
        vs = f"{r['tokens_per_s'] / base:.2f}x" if base else "–"
        per_token = r.get("weight_bytes_per_token")
        lines.append(f"{head} {fmt(r['tokens_per_s'], ',.1f')} | {vs} | "
                     f"{fmt(per_token / 1e6 if per_token else None, ',.1f')} | {fmt(r.get('gb_per_s'), '.1f')} | "
                     f"{fmt(r.get('of_stream') and 100 * r['of_stream'], '.0f')}{'%' if r.get('of_stream') else ''} |")
    ppl = record.get("perplexity")
    lines += ["", "## Perplexity", ""]
    if not ppl or "results" not in ppl:
        lines.append(f"Not measured: {(ppl or {}).get('reason', 'no --checkpoint given')}.")
    else:
        m = ppl["model"]
        kind = meta.get("perplexity_kind", "trained checkpoint")
        float32 = "; float32: its weights as dequantized on loading" if kind == "GGUF file" else ""
        lines += [f"The {kind} `{meta['perplexity_checkpoint']}` (d {m['d_model']}, {m['num_layers']} "
                  f"layers, {m['num_heads']} heads, vocab {m['vocab_size']}, tied {m['tie_embeddings']}{float32}) on "
                  f"the "
                  f"last 10% of Tiny Shakespeare ({ppl['results']['float32']['tokens']:,} predicted tokens, windows "
                  f"of {m.get('window', m['max_seq_len'])}).", "", "| weights | perplexity | vs float32 |",
                  "| --- | --- | --- |"]
        base = ppl["results"]["float32"]["perplexity"]
        for name, result in ppl["results"].items():
            lines.append(f"| {WEIGHT_NAMES.get(name, name)} | {result['perplexity']:.4f} | "
                         f"{100 * (result['perplexity'] / base - 1):+.2f}% |")
    lines += ["", "## Checks against the targets", "", "| check | value | target | holds |", "| --- | --- | --- | --- |"]
    for c in record["checks"]:
        holds = {True: "yes", False: "**no**", None: "not measured"}[c["holds"]]
        lines.append(f"| {c['what']} | {fmt(c['value'], '.3f')} | {c['target']} | {holds} |")
    lines += ["", f"Command: `{meta['command']}`", ""]
    return "\n".join(lines)


def class_results(results: Path = RESULTS) -> list[dict]:
    """The records of `results`/quant_<class>.json, one per CPU class measured, in `CPU_CLASSES`' order."""
    slugs = [slug for _, slug, _ in CPU_CLASSES] + ["scalar"]
    paths = [results / f"quant_{slug}.json" for slug in slugs]
    return [json.loads(path.read_text()) for path in paths if path.is_file()]


def class_tables(records: list[dict]) -> str:
    """quant.md: one section per CPU class measured (each record's report, its headings a level down), and
    the classes with no measurement named."""
    measured = {r["meta"]["machine"]["cpu_class"] for r in records}
    missing = [words for _, _, words in CPU_CLASSES if words not in measured]
    lines = ["# Quantized decoding, one table per CPU class", "",
             "A speed holds for the CPU class it was measured on (`bench.machine.CPU_CLASSES`, from /proc/cpuinfo's "
             "flags); each class's run is kept in `quant_<class>.json`. Not measured: " + "; ".join(missing) + ".", ""]
    for record in records:
        text = markdown(record).replace("\n## ", "\n### ").replace("# Quantized decoding on ",
                                                                      f"## {record['meta']['machine']['cpu_class']}: ", 1)
        lines += [text, ""]
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ppl_model = parser.add_mutually_exclusive_group()
    ppl_model.add_argument("--checkpoint", help="a trained run directory (python -m train.tiny_lm) for the perplexity")
    ppl_model.add_argument("--ppl-gguf", metavar="FILE", help="a GGUF file's model for the perplexity (its float32: "
                           "the weights as dequantized on loading)")
    parser.add_argument("--ppl-window", type=int, default=None, help="perplexity windows of at most this many tokens "
                        "(default: the model's context)")
    parser.add_argument("--runners", default=",".join(RUNNERS),
                        help="comma-separated subset of %(default)s, or none (the perplexity alone)")
    parser.add_argument("--caches", default=",".join(CACHES),
                        help="comma-separated KV caches of the jaxattn cells, of %(default)s")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=2, help="timed calls per process after its warm-up")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--engine-batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=cpu_cores(),
                        help="cores (and torch threads, llama.cpp n_threads) of every runner (default %(default)s)")
    parser.add_argument("--llama-n-batch", type=int, default=1, help="llama.cpp's n_batch (default %(default)s)")
    parser.add_argument("--ppl-tokens", type=int, default=0, help="predicted val tokens at most (0: all)")
    parser.add_argument("--data", help="Tiny Shakespeare (default: as bench/serve.py finds it)")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="where the random checkpoint and its GGUF files are written once "
                             "(default: bench/serve.py's, ~/.cache/jaxattn/bench-serve)")
    parser.add_argument("--out", type=Path, default=None, help="writes OUT.json and OUT.md (default "
                        "bench/results/quant_<CPU class>, and bench/results/quant.md gathers every class's table; "
                        "--quick: a temporary directory's)")
    parser.add_argument("--note", help="a line set in bold above the table (e.g. how noisy the machine was)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per process")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: a tiny Llama, 8 new tokens, batch 4, one round, one call")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.calls, args.new_tokens, args.engine_batch = 1, 1, 8, 4
        args.ppl_tokens = args.ppl_tokens or 2048
    args.runners = [] if args.runners == "none" else [r for r in args.runners.split(",") if r]
    if not set(args.runners) <= set(RUNNERS):
        parser.error(f"--runners: choose from {', '.join(RUNNERS)}")
    args.caches = [c for c in args.caches.split(",") if c]
    if not args.caches or not set(args.caches) <= set(CACHES):
        parser.error(f"--caches: choose from {', '.join(CACHES)}")
    for name in ("rounds", "calls", "prompt_len", "new_tokens", "engine_batch", "threads", "llama_n_batch",
                 "ppl_window"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    from bench.machine import describe_machine, machine_line
    from bench.serve import default_cache_dir, ensure_checkpoint
    cache_dir = args.cache_dir or default_cache_dir()
    name = "quick" if args.quick else "smollm2"
    checkpoint, facts = ensure_checkpoint(name, cache_dir, quick_config() if args.quick else None)
    ggufs = {}
    if "llamacpp" in args.runners:
        for qtype in GGUF_TYPES:
            ggufs[qtype] = checkpoint / f"bench-quant-{qtype}.gguf"
            if not ggufs[qtype].is_file():
                print(f"writing {ggufs[qtype]} (once)", file=sys.stderr, flush=True)
                write_gguf(checkpoint, ggufs[qtype], qtype)
    stream_bytes = facts["params"] * 4
    cells = measure(cases(args, checkpoint, ggufs, stream_bytes), args.rounds, args.timeout)
    rows, stream_gbs = summarize(cells, ggufs)
    ppl = None
    ppl_source = args.ppl_gguf or args.checkpoint
    if ppl_source:
        spec = {"runner": "perplexity", "gguf" if args.ppl_gguf else "checkpoint": str(Path(ppl_source).resolve()),
                "data": args.data, "formats": list(PPL_FORMATS) + ["kept"] * bool(args.ppl_gguf),
                "max_tokens": args.ppl_tokens,
                "window": args.ppl_window, "threads": args.threads}
        try:
            ppl = fresh.call("bench.quant:run_case", spec, threads=args.threads, timeout=args.timeout)
        except fresh.FreshProcessError as err:
            ppl = {"available": False, "reason": str(err)}
    machine = describe_machine()
    model = model_line(facts, args.quick)
    meta = {"machine": machine, "machine_line": machine_line(machine), "cores": cpu_cores(), "threads": args.threads,
            "model": model, "checkpoint": facts, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
            "engine_batch": args.engine_batch, "rounds": args.rounds, "calls": args.calls,
            "llama_n_batch": args.llama_n_batch, "stream_gb_per_s": stream_gbs, "note": args.note,
            "cache_keyword": CACHE_KEYWORD, "load_average_end": load_average(),
            "perplexity_checkpoint": Path(ppl_source).name if ppl_source else None,
            "perplexity_kind": "GGUF file" if args.ppl_gguf else "trained checkpoint",
            "command": "PYTHONPATH=$PWD python bench/quant.py " + portable_command(
                ["", *map(shlex.quote, argv)],
                ("--checkpoint", "--ppl-gguf", "--data", "--cache-dir", "--out")).strip()}
    record = {"meta": meta, "rows": rows, "perplexity": ppl, "checks": checks(rows, ppl)}
    out = args.out or (Path(tempfile.gettempdir()) / "jaxattn-quant-quick" / "quant" if args.quick
                       else RESULTS / f"quant_{machine['cpu_class_slug']}")
    write_results(out.parent, out.name, record, markdown(record))
    if args.out is None and not args.quick:  # the table of this class beside the others measured
        (RESULTS / "quant.md").write_text(class_tables(class_results()))
    failed = [f"{r['runner']} {r['weights']} {r['cache']}: {r['failed']}" for r in rows if "failed" in r]
    if ppl is not None and not ppl.get("available"):
        failed.append(f"perplexity: {ppl.get('reason')}")
    for line in failed:
        print(f"error: {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
