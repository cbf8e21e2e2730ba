"""The engine's OpenAI-compatible HTTP server (FastAPI and uvicorn), which `python -m train.serve` runs.

It lives beside the engine, as vLLM keeps `vllm/entrypoints/openai` beside its engine: it is the
engine's own front door, reads the engine's parts by name (the runner owns an `Engine`, the metrics
read its scheduler's queues and pool, errors come from `jaxattn.serving.validation` and the
scheduler), and a program that serves a model only loads the model and starts it. `jaxattn.serving`
does not import it, so the engine alone needs no web framework.

* `protocol`: the OpenAI API's requests: bodies parsed into types, fields refused, errors;
* `answers`: whole answers, their choices and stream chunks (tool calls parsed back), usage;
* `logprobs`: log-probabilities in a completion's and a chat's shapes (`LogprobsWriter`);
* `runner`: the engine on a thread of its own, and what crosses to the event loop (`Ticket`, `Update`);
* `state`: what the routes read (`ApiState`: the runner, the `ServedModel`, the metrics, the `Limits`);
* `handlers`: the routes, plain functions over that state;
* `tools`: a chat's `tools` and `tool_choice` read, rendered and, when a call is forced, constrained;
* `tool_calls`: the formats templates write tool calls in, and the parser that reads them back;
* `tokens`: `/tokenize` and `/detokenize` (vLLM's extensions);
* `embeddings`: `/v1/embeddings` over the decoder's last hidden state;
* `adapters`: `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`, LoRA adapters loaded while serving;
* `app`: `create_app`, the routes with their error answers and middleware;
* `metrics`: `GET /metrics` in Prometheus text;
* `server`: the listening socket and uvicorn draining on a signal;
* `chat.html`: the chat page at `/`.
"""
