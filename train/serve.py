"""Serve a model over HTTP with the OpenAI API: many callers at once through the continuous-batching engine.

    python -m train.serve --hf exports/baby                 # a transformers directory with tokenizer.json
    python -m train.serve --gguf model-Q8_0.gguf            # a llama.cpp file: its chat template, named by its stem
    python -m train.serve --checkpoint runs/shakespeare_char_baby --port 8001
    python -m train.serve --random-init shakespeare_char_baby --max-seqs 16 --kv-memory 0.5
    python -m train.serve --hf exports/baby --lora poet=runs/poet_lora/peft --max-loras 4 --max-lora-rank 16
    python -m train.serve --gguf SmolLM2-135M-Instruct.Q4_1.gguf --speculative ngram:k=4   # or draft:DIR,k=4
    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "baby", "prompt": "ROMEO:", "max_tokens": 64, "temperature": 0.8}'

Endpoints: `POST /v1/completions` and `/v1/chat/completions` (streamed as server-sent events with
`"stream": true`; chat takes `tools`), `POST /v1/embeddings`, `POST /tokenize` and `/detokenize`
(vLLM's), `GET /v1/models`, `GET /health` (200 once ready, 503 while draining),
`GET /metrics` (Prometheus text) and `GET /`, a chat page; with `--max-loras`, `POST /v1/load_lora_adapter`
and `/v1/unload_lora_adapter` (vLLM's). docs/serving.md has the knobs, the metrics and the memory arithmetic.

LoRA adapters (`--lora NAME=DIR`, a PEFT directory; more loaded over HTTP) are served unmerged beside the
base, each under its name as a `model` of its own (`/v1/models` lists it with `parent` the base):
`--max-loras` of them sit in the model at once (`jaxattn.serving.loras`), the rest wait on the host.
`--adapter DIR` still merges one adapter into the base. A bad `--lora` spec: one `error:` line and exit 2;
an adapter directory that cannot be read: exit 1.

Every step program of the engine is compiled before the server listens: the first request runs
as fast as the thousandth. When it serves, the program prints one line on stdout,
`ready: URL (...)`, with the model, its pages and their memory. SIGTERM or Ctrl-C drains: new
requests get a 503, those running get `--drain-seconds` to finish, then they are cancelled and the
program exits 0; a second signal exits at once. A port in use, an address that is not this
machine's, or a model that does not load: one `error:` line and exit 1.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import uvicorn
from tqdm import tqdm

from jaxattn import Kernels, axes, prepare_weights, resolve_kernels
from jaxattn.cache.containers import KV_CACHES
from jaxattn.hf.chat_template import ChatTemplate, ChatTemplateError
from jaxattn.hf.tokenizer import HFTokenizer
from jaxattn.kernels import Platform, exact_matmul
from jaxattn.serving import Embedder, Engine, EngineConfig
from jaxattn.serving.api.app import Limits, ServedModel, create_app
from jaxattn.serving.api.metrics import ServerMetrics
from jaxattn.serving.api.runner import EngineRunner
from jaxattn.serving.api.server import DrainingServer, HeadersTimeout, listen_socket  # a ListenError is an OSError: exit 1
from jaxattn.serving.embedding import POOLINGS
from jaxattn.serving.structured import GuideCompiler
from jaxattn.speculative import DraftProposer
from train import kept_programs
from train.decode import speculative
from train.checkpoints.store import CheckpointError
from train.cli import ArgumentParser, UsageError, guard
from train.data.errors import DataError
from train.data.tokenizer import CharTokenizer, to_hf_tokenizer
from train.models.load import device_mesh, load_model, paged_part, quant_line, read_adapter, read_chat
from train.models.source import SourceFlags
from train.run import runtime as runtime_lib
from train.run.host_memory import release_freed_memory

PROGRAM = "python -m train.serve"
FLAGS = SourceFlags(quant=True, adapter=True)  # every model source; its --seed is its own
log = logging.getLogger("train.serve")


class ServeError(RuntimeError):
    """The server cannot start: the chat template (exit 1; an address it cannot listen on is a `ListenError`)."""


def parse_args(argv=None) -> argparse.Namespace:
    parser = ArgumentParser(prog=PROGRAM, description=__doc__.split("\n\n")[0])
    FLAGS.add_to(parser)
    parser.add_argument("--seed", type=int, default=0, help="with --random-init: the weights' seed; and the seeds "
                        "of requests that give none")
    parser.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template (instead of the model's)")
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="the port (0: a free one; default 8000)")
    parser.add_argument("--served-model-name", metavar="NAME", help="the model id clients send (default: the "
                        "directory's or config's name, a GGUF file's stem)")
    parser.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/ (default: none)")
    parser.add_argument("--max-seqs", type=int, default=32, help="requests running at once (default 32)")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per KV-cache page (default 16)")
    memory = parser.add_mutually_exclusive_group()
    memory.add_argument("--kv-memory", type=float, metavar="GIB", help="the KV cache's size in GiB")
    memory.add_argument("--num-pages", type=int, help="the KV cache's pages (default: every running "
                        "request can reach the context)")
    parser.add_argument("--kv-cache", choices=KV_CACHES, default="auto", help="the pages' storage: auto (the "
                        "compute dtype) or int8 (int8 numbers with a float32 scale per token and head: about four "
                        "times float32's pages in --kv-memory; default auto)")
    parser.add_argument("--token-budget", type=int, help="tokens per engine step, decoding first (default: "
                        "--max-seqs + two prompt chunks of 128)")
    parser.add_argument("--decode-steps", type=int, metavar="K", help="the most decode steps one program call "
                        "runs while every running request only decodes (default: 8 on an accelerator, 1 on a CPU)")
    parser.add_argument("--no-overlap", dest="overlap", action="store_false", help="read every step's tokens "
                        "before the next step is queued (default: the next decode step is queued first, fed them "
                        "on the device)")
    parser.add_argument("--max-waiting", type=int, default=256, help="requests queued for a row; one more "
                        "gets a 429 (default 256)")
    parser.add_argument("--drain-seconds", type=float, default=30.0, help="on SIGTERM, how long running "
                        "requests may take to finish before they are cancelled (default 30)")
    parser.add_argument("--max-body", type=int, default=4 * 2**20, metavar="BYTES", help="the largest request "
                        "body; more gets a 413 (default 4 MiB)")
    parser.add_argument("--embedding-pooling", choices=POOLINGS, default="last", help="/v1/embeddings: the last "
                        "token's final state (vLLM's default for a decoder) or the mean of every token's (default last)")
    parser.add_argument("--bf16-matmul", action="store_true", help="a float32 model's matmuls in bfloat16 where "
                        "this machine runs them faster (a CPU with AMX, a GPU): faster, its log-probabilities off by "
                        "about 1e-2 (default: exact)")
    parser.add_argument("--mesh", help="serve on a device mesh, e.g. tensor:2 (product = device count)")
    add_lora_flags(parser)
    speculative.add_flag(parser, ENGINE_HELP)
    kept_programs.add_flag(parser)
    parser.add_argument("--cpu-devices", type=int, metavar="N", help="make N host devices on a CPU for --mesh")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    args = parser.parse_args(argv)
    args.model_source = FLAGS.read(parser, args)  # the model-source flags' usage errors, then the server's
    for name in ("max_seqs", "page_size", "max_waiting", "max_body"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.decode_steps is not None and args.decode_steps < 1:
        parser.error(f"--decode-steps must be >= 1, got {args.decode_steps}")
    if not 0 <= args.port < 2**16:
        parser.error(f"--port must be in [0, 65535], got {args.port}")
    if args.drain_seconds < 0:
        parser.error(f"--drain-seconds must be >= 0, got {args.drain_seconds}")
    if args.cpu_devices is not None and args.mesh is None:
        parser.error("--cpu-devices goes with --mesh")
    args.loras = lora_specs(parser, args)
    speculative.check_flags(parser, args)
    return args


def add_lora_flags(parser) -> None:
    parser.add_argument("--lora", action="append", default=[], metavar="NAME=DIR", help="a PEFT LoRA adapter "
                        "served unmerged under NAME: a request whose model is NAME runs with it (repeat for more; "
                        "POST /v1/load_lora_adapter loads more while serving)")
    parser.add_argument("--max-loras", type=int, metavar="N", help="LoRA adapters held in the model at once, "
                        "chosen per request; more loaded wait on the host (default: the --lora count; 0: none)")
    parser.add_argument("--max-lora-rank", type=int, default=16, metavar="R", help="the largest rank of an "
                        "adapter served (lower ranks are zero-padded to it; default 16)")


def lora_specs(parser, args) -> dict[str, str]:
    """--lora NAME=DIR as {name: directory}; --max-loras defaulted to their count. Usage errors (exit 2)
    for a spec without NAME or DIR, a name given twice or the base's, --max-loras below what is asked."""
    specs = {}
    for spec in args.lora:
        name, sep, directory = spec.partition("=")
        if not sep or not name.strip() or not directory:
            parser.error(f"--lora takes NAME=DIR (a PEFT adapter directory), got {spec!r}")
        if name in specs or name == model_name(args):
            parser.error(f"--lora {spec}: the name {name!r} is served already (names must differ, and from the "
                         "base's)")
        specs[name] = directory
    args.max_loras = len(specs) if args.max_loras is None else args.max_loras
    if args.max_loras < 0 or args.max_lora_rank < 1:
        parser.error(f"--max-loras must be >= 0 and --max-lora-rank >= 1, got {args.max_loras} and "
                     f"{args.max_lora_rank}")
    if specs and args.max_loras == 0:
        parser.error("--lora needs --max-loras >= 1 (0 holds no adapter)")
    if args.max_loras and args.mesh is not None:
        parser.error("--max-loras serves on one device: not with --mesh")
    return specs


def model_name(args) -> str:
    """--served-model-name, else the model's own name (`train.models.source.ModelSource.name`)."""
    return args.served_model_name or args.model_source.name


def chat_template(args, tokenizer) -> ChatTemplate | None:
    """--chat-template, else the --hf directory's or the --gguf file's, else None (chat answers 400); the
    model's special tokens either way (`train.models.load.read_chat`)."""
    try:
        source, tokens = read_chat(args.model_source, template=not args.chat_template)
        if args.chat_template:
            path = Path(args.chat_template)
            if not path.is_file():
                raise ServeError(f"--chat-template {args.chat_template}: no such file")
            return ChatTemplate(path.read_text(encoding="utf-8"), tokens)
        return ChatTemplate(source, tokens) if source is not None else None
    except ChatTemplateError as err:
        raise ServeError(f"the chat template: {err}") from None


def served_model(args, tokenizer, max_model_len: int, vocab_size: int) -> ServedModel:
    if isinstance(tokenizer, HFTokenizer):  # a BOS where the tokenizer adds one, for a completion's prompt
        def encode(text, special):
            return tokenizer.encode(text, add_special_tokens=special)

        def decode(ids):  # special tokens kept, as vLLM's /detokenize keeps them
            return tokenizer.decode(ids, skip_special_tokens=False)
    else:
        def encode(text, special):
            return [int(t) for t in tokenizer.encode(text)]

        def decode(ids):
            return tokenizer.decode(ids)
    eos = getattr(tokenizer, "eos_token_id", None)
    return ServedModel(name=model_name(args), encode=encode, max_model_len=max_model_len,
                       stop_token_ids=() if eos is None else (int(eos),),
                       chat_template=chat_template(args, tokenizer), decode=decode, vocab_size=vocab_size)


def guide_compiler(tokenizer, vocab_size: int) -> GuideCompiler:
    """Structured outputs for the model's tokenizer: llguidance reads a tokenizer.json (a transformers or
    GGUF tokenizer, a run's BPE or bytes); a run's characters are given to it as each id's bytes."""
    eos = getattr(tokenizer, "eos_token_id", None)
    eos = () if eos is None else (int(eos),)
    if isinstance(tokenizer, HFTokenizer):
        try:
            return GuideCompiler(tokenizer.tokenizer.to_str(), vocab_size, eos)
        except ValueError:  # a decoder llguidance cannot read (a character tokenizer's Fuse): each id's text
            hf = tokenizer.tokenizer
            return GuideCompiler.from_token_bytes([hf.decode([i]).encode("utf-8") for i in range(hf.get_vocab_size())],
                                                  lambda text: hf.encode(text, add_special_tokens=False).ids,
                                                  vocab_size, eos)
    if isinstance(tokenizer, CharTokenizer):
        return GuideCompiler.from_token_bytes([c.encode("utf-8") for c in tokenizer.chars],
                                              lambda text: tokenizer.encode(text).tolist(), vocab_size, eos)
    return GuideCompiler(to_hf_tokenizer(tokenizer).to_str(), vocab_size, eos)


def serving_kernels(dtype: str, bf16_matmul: bool = False) -> tuple[Kernels, dict[str, str]]:
    """`Kernels.auto()` resolved for this machine, its float matmuls exact for a float32 model unless
    `bf16_matmul`: a served model's log-probabilities are an answer of the API (lm-eval scores with them),
    and bfloat16 dots (what "auto" picks on a CPU with AMX and on a GPU) move them by about 1e-2."""
    platform = Platform.detect()
    kernels, reasons = resolve_kernels(Kernels.auto(), platform)
    exact, why = exact_matmul(platform)
    if dtype == "float32" and not bf16_matmul and kernels.matmul != exact:
        reasons = {**reasons, "matmul": f"a float32 model served exactly, {why} (--bf16-matmul: "
                   f"{kernels.matmul!r} would be faster here: {reasons['matmul']})"}
        kernels = kernels.replace(matmul=exact)
    return kernels, reasons


ENGINE_HELP = ("decode speculatively: ngram, ngram:k=4,n_min=1,n_max=3 (prompt lookup), or draft:DIR,k=4 (a draft "
               "model of the same vocabulary: a run, a transformers directory or a .gguf file); adaptive=0 keeps "
               "k fixed; a decode row's drafts are verified in one step (docs/speculative.md)")


def build_engine(args, params, config, tokenizer, kernels, mesh) -> tuple[Engine, float]:
    """The engine with every step program compiled (a progress bar on stderr); its compile seconds."""
    options, draft = args.speculative, None
    if options is not None and options.method == "draft":
        draft_params, draft_config = speculative.load_draft(options, config, config.max_seq_len, kernels)
        draft = DraftProposer(draft_params, draft_config, k=options.k, kernels=kernels)
    engine_config = EngineConfig(max_seqs=args.max_seqs, page_size=args.page_size, num_pages=args.num_pages,
                                 kv_memory_gib=args.kv_memory, token_budget=args.token_budget,
                                 kv_cache=args.kv_cache, max_waiting=args.max_waiting, decode_steps=args.decode_steps,
                                 overlap=args.overlap, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                                 speculative=options.ngram_settings() if options and draft is None else None,
                                 adaptive_k=options.adaptive if options else True)
    bar = tqdm(total=0, desc="compiling the step programs", unit="program", file=sys.stderr, leave=False,
               disable=None)

    def progress(done, total, shape):
        bar.total = total
        bar.update(done - bar.n)

    def detokenize(ids):
        return tokenizer.decode(ids)

    started = time.perf_counter()
    try:
        engine = Engine(params, config, engine_config, kernels=kernels, mesh=mesh, detokenize=detokenize,
                        seed=args.seed, progress=progress, guide_compiler=guide_compiler(tokenizer, config.vocab_size),
                        draft=draft)
    except ValueError as err:
        raise UsageError(str(err)) from err
    finally:
        bar.close()
    return engine, time.perf_counter() - started


def check_lora_dirs(loras: dict[str, str]) -> None:
    """CheckpointError (exit 1) before anything loads for a --lora directory that is not one."""
    for name, directory in loras.items():
        if not (Path(directory) / "adapter_config.json").is_file():
            raise CheckpointError(f"--lora {name}={directory}: no adapter_config.json there (a PEFT adapter directory)")


def adapter_loader(engine: Engine):
    """`path -> adapter params` over the engine's base (its layers unrolled); ValueError, one line, for a
    directory that cannot be read or does not fit the model (`ServedModel.load_adapter`)."""
    config, base = engine.config, engine.base_params

    def load(path: str):
        try:
            return read_adapter(path, config, base)
        except CheckpointError as err:
            raise ValueError(str(err)) from None
    return load


def api_parts(args, engine: Engine, tokenizer, vocab_size: int) -> tuple[ServedModel, ServerMetrics, EngineRunner]:
    """What the application serves: the model (its embeddings, its --lora adapters added), metrics, runner.
    CheckpointError (exit 1) for an adapter that cannot be read, UsageError (exit 2) for one that does
    not fit the slots."""
    served = served_model(args, tokenizer, engine.max_model_len, vocab_size)
    embedder = Embedder(engine.base_params, engine.config, kernels=engine.kernels, max_len=engine.max_model_len,
                        pooling=args.embedding_pooling)
    served.embed = lambda ids, normalize: embedder.embed(ids, normalize=normalize)
    if engine.loras is not None:
        served.load_adapter = adapter_loader(engine)
    for name, directory in args.loras.items():
        try:
            adapter = read_adapter(directory, engine.config, engine.base_params)
        except CheckpointError as err:
            raise CheckpointError(f"--lora {name}={directory}: {err}") from None
        try:
            engine.add_lora(name, adapter)
        except ValueError as err:
            raise UsageError(f"--lora {name}={directory}: {err}") from None
    metrics = ServerMetrics(engine)
    return served, metrics, EngineRunner(engine, on_step=metrics.on_step, on_tokens=metrics.on_tokens)


def run(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    if args.cpu_devices is not None:
        runtime_lib.host_devices(args.cpu_devices)
    kept = kept_programs.KeptPrograms(args)
    sock = listen_socket(args.host, args.port)
    try:
        check_lora_dirs(args.loras)
        loaded = load_model(args.model_source)
        loaded.print_notes()
        params, config, tokenizer = loaded.params, loaded.config, loaded.tokenizer
        mesh = device_mesh(args.mesh, config)
        kernels, reasons = serving_kernels(config.dtype, args.bf16_matmul)
        print(f"kernels: {paged_part(kernels, reasons)}, matmul {kernels.matmul!r} "
              f"({reasons['matmul']})" + (f"; mesh {axes.MeshShape.of(mesh)}" if mesh is not None else "")
              + quant_line(loaded.quant, kernels, reasons, loaded.head_quant), file=sys.stderr)
        params = prepare_weights(params, kernels)  # e.g. quantized weights in the native kernel's panels
        started = time.perf_counter()
        engine, compile_seconds = build_engine(args, params, config, tokenizer, kernels, mesh)
        release_freed_memory()  # the compiler's freed heap: not resident while serving
        kept.report()
        served, metrics, runner = api_parts(args, engine, tokenizer, config.vocab_size)
        app = create_app(runner, served, metrics, Limits(api_key=args.api_key, max_body_bytes=args.max_body))
        host, port = sock.getsockname()[:2]
        url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
        memory = engine.memory()

        def ready_line() -> str:
            return (f"ready: {url} (model {served.name!r}; {memory['pages_total']:,} pages of {engine.page_size} "
                    f"tokens, {memory['pool_bytes'] / 2**20:,.1f} MiB of KV cache: each of {args.max_seqs} rows "
                    f"reaches {engine.pool.per_row:,} tokens at once, {engine.pool.reason}; "
                    f"{len(engine.programs.shapes)} step programs compiled in {compile_seconds:.1f} s; {engine.steps_per_call} decode step"
                    f"{'s' if engine.steps_per_call > 1 else ''} per call; ready {time.perf_counter() - started:.1f} s "
                    f"after loading; chat {'on' if served.chat_template else 'off: no chat template'}"
                    + (f"; LoRA: {len(engine.lora_names)} adapters, {args.max_loras} slots of rank "
                       f"{args.max_lora_rank}" if args.max_loras else "")
                    + (f"; speculative: {args.speculative.describe()}" if args.speculative else "") + ")")

        config_uv = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                   timeout_graceful_shutdown=5, timeout_keep_alive=5, http=HeadersTimeout)
        server = DrainingServer(config_uv, runner, args.drain_seconds, ready_line)
        runner.start()
        try:
            server.run(sockets=[sock])
        finally:
            runner.stop()
    finally:
        sock.close()
    if server.signalled is not None:
        log.info("drained and stopped")
    return 0


def main(argv=None) -> int:
    """0 after a drain; one line and exit 1 or 2 otherwise (train.cli)."""
    return guard(PROGRAM, lambda: run(argv), expected=(CheckpointError, DataError, ServeError))


if __name__ == "__main__":
    sys.exit(main())
