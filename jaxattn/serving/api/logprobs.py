"""Log-probabilities in the OpenAI API's shapes: a completion's `choices[].logprobs` and a chat's.

The numbers are the engine's (`SamplingParams.logprobs`, `prompt_logprobs`): the model's raw
log-softmax in float32, before temperature or any filter, as vLLM returns by default. Here they are
only written out:

* completions (`openai.types.completion_choice.Logprobs`): `tokens`, `token_logprobs`,
  `top_logprobs` (a `{token: logprob}` per token: the k most likely and the chosen one, so up to
  k + 1 entries, as OpenAI documents) and `text_offset` (each token's offset in the answer's text;
  the prompt's tokens first with `echo`, the first of them with `null`s, having nothing before it);
* chat (`openai.types.chat.ChatCompletionTokenLogprob`): `content[]` of `{token, logprob, bytes,
  top_logprobs: [{token, logprob, bytes}]}`, the top k most likely first.

A token is spelled as vLLM spells it: the detokenizer's text of that one token (`decode([id])`), its
`bytes` that text's UTF-8 (a token holding part of a character is spelled with U+FFFD, as in vLLM).
A log-probability of minus infinity is written as -9999.0 (JSON has no infinity; OpenAI's and vLLM's
number). Without a detokenizer a token is spelled `token_id:ID` (vLLM's `return_tokens_as_token_ids`).
"""

from __future__ import annotations

from typing import Callable, Iterable

from jaxattn.serving.requests import TopLogprobs

FLOOR = -9999.0  # what -inf is written as
# One token of an answer: (id, its log-probability, the top ones there); None, None for the prompt's first.
Entry = tuple[int, "float | None", "TopLogprobs | None"]


def _number(logprob: float) -> float:
    return max(float(logprob), FLOOR)


class LogprobsWriter:
    """One answer's `logprobs` objects, whole or chunk by chunk (a completion's text offsets go on from
    one chunk to the next, so the chunks' lists joined are the whole answer's).

    Args:
      kind: "completion" or "chat".
      detokenize: ids -> text (the engine's), or None.
    """

    def __init__(self, kind: str, detokenize: Callable[[list[int]], str] | None):
        self.kind, self._detokenize = kind, detokenize
        self._spelled: dict[int, str] = {}
        self.offset = 0

    def spell(self, token: int) -> str:
        if token not in self._spelled:
            self._spelled[token] = (f"token_id:{token}" if self._detokenize is None
                                    else self._detokenize([token]) or "")
        return self._spelled[token]

    def __call__(self, entries: Iterable[Entry]) -> dict:
        return self._completion(entries) if self.kind == "completion" else self._chat(entries)

    def _completion(self, entries: Iterable[Entry]) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, logprob, top in entries:
            text = self.spell(token)
            out["tokens"].append(text)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
            if logprob is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(_number(logprob))
            most_likely = {self.spell(i): _number(v) for i, v in top}
            most_likely.setdefault(text, _number(logprob))  # the chosen token's, always (k + 1 at most)
            out["top_logprobs"].append(most_likely)
        return out

    def _token(self, token: int, logprob: float) -> dict:
        text = self.spell(token)
        return {"token": text, "logprob": _number(logprob), "bytes": list(text.encode("utf-8", errors="replace"))}

    def _chat(self, entries: Iterable[Entry]) -> dict:
        content = [{**self._token(token, logprob), "top_logprobs": [self._token(i, v) for i, v in top]}
                   for token, logprob, top in entries]
        return {"content": content, "refusal": None}
