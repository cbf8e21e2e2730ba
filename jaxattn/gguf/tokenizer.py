"""A GGUF file's tokenizer, built from its metadata as transformers 5.23 builds it, without transformers.

A GGUF file holds no tokenizer.json: `tokenizer.ggml.model` names the kind, and the vocabulary
(`tokenizer.ggml.tokens`, with `scores`, `token_type` and `merges`) is metadata. transformers
(`transformers.integrations.gguf.gguf_tokenizer_mapping`) hands these to one of its tokenizer
classes; the same `tokenizers.Tokenizer` is built here directly:

* "gpt2": byte-level BPE (GPT-2's `GPT2Tokenizer`): tokens spelled in GPT-2's byte alphabet (a
  token with other characters is respelled byte by byte), the file's merges, GPT-2's split of the
  text or the one `tokenizer.ggml.pre` names ("llama-bpe", "qwen2", ...).
* "llama": SentencePiece as BPE with byte fallback (`LlamaTokenizer`: a "▁" prepended to the
  first word, "▁" for spaces), merges from the file or, without them, rebuilt from the tokens'
  scores (`generate_merges`); Gemma's files as `GemmaTokenizer` (whitespace tokens respelled,
  merges in the tokens' order) and Phi-3's with its normalizer, chosen by the architecture
  (`Architecture.sentencepiece`).

Then, as transformers does: the tokens of type CONTROL (3) become special tokens (in a byte-level
vocabulary only those spelled in its alphabet), USER_DEFINED (4) tokens added tokens that are
not special (matched whole in text), and the file's bos/eos/unk/pad tokens and the tokenizer
class's default special tokens special too (the defaults only where the vocabulary has them:
transformers would append one it lacks as a new id, beyond the model's vocabulary). A BOS is
prepended when `tokenizer.ggml.add_bos_token` says so (SentencePiece files: unless it says not),
an EOS appended when `add_eos_token` does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

from jaxattn.gguf.architecture import Architecture
from jaxattn.hf.errors import InvalidCheckpoint, UnsupportedCheckpoint

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types
SPECIAL_IDS = {"bos_token": "tokenizer.ggml.bos_token_id", "eos_token": "tokenizer.ggml.eos_token_id",
               "unk_token": "tokenizer.ggml.unknown_token_id", "pad_token": "tokenizer.ggml.padding_token_id"}
# The special tokens each transformers tokenizer class has by default.
CLASS_SPECIALS = {"gpt2": ("<|endoftext|>",), "llama": ("<unk>", "<s>", "</s>"), "phi3": ("<unk>", "<s>", "</s>"),
                  "gemma": ("<unk>", "<bos>", "<eos>", "<pad>", "<mask>")}

# transformers' splits for `tokenizer.ggml.pre` (its `GGUF_PRE_TOKENIZER_SPLITS`); others keep GPT-2's.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                 r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (transformers' `bytes_to_unicode`)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(2 ** 8):
        if b not in bs:
            bs.append(b)
            cs.append(2 ** 8 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


def generate_merges(vocab: Mapping[str, int], vocab_scores: Mapping[str, float] | None = None
                    ) -> list[tuple[str, str]]:
    """BPE merges implied by a vocabulary: every split of a token into two tokens, best-scored first
    (transformers' `generate_merges`; without scores, by id)."""
    reverse = vocab_scores is not None
    scores = dict(vocab_scores) if reverse else vocab
    merges = []
    for merge, piece_score in scores.items():
        local = [(merge[:i], merge[i:], piece_score) for i in range(1, len(merge))
                 if merge[:i] in vocab and merge[i:] in vocab]
        merges.extend(sorted(local, key=lambda x: (vocab[x[0]], vocab[x[1]])))
    merges = sorted(merges, key=lambda val: (val[2], len(val[0]), len(val[1])), reverse=reverse)
    return [(left, right) for left, right, _ in merges]


class _Vocabulary:
    """The tokenizer metadata of one file, checked as it is read (InvalidCheckpoint naming the key)."""

    def __init__(self, metadata: Mapping[str, Any], path: Path):
        self.metadata, self.path = metadata, path
        self.tokens = self._list("tokenizer.ggml.tokens", str, required=True)
        self.types = self._list("tokenizer.ggml.token_type", int) or []
        self.scores = self._list("tokenizer.ggml.scores", (int, float))
        self.merges = self._list("tokenizer.ggml.merges", str)

    def _list(self, key: str, kind, required: bool = False) -> list | None:
        value = self.metadata.get(key)
        if value is None and not required:
            return None
        if not isinstance(value, list) or not all(isinstance(v, kind) for v in value) or (required and not value):
            problem = "is missing: the file holds no vocabulary" if value is None else "is not a list of the right type"
            raise InvalidCheckpoint(self.path, key, problem)
        return value

    def token_id(self, name: str) -> int | None:
        """The id the file gives for `name` ("eos_token", ...); None when it gives none."""
        key = SPECIAL_IDS[name]
        value = self.metadata.get(key)
        if value is None:
            return None
        if not isinstance(value, int) or not 0 <= value < len(self.tokens):
            raise InvalidCheckpoint(self.path, key, f"{value!r} is not a token id (the vocabulary has "
                                    f"{len(self.tokens)} tokens)")
        return value

    def merge_list(self, vocab_scores: Mapping[str, float] | None = None) -> list[tuple[str, ...]]:
        """The file's merges, else those its tokens imply (transformers' `get_merges`)."""
        if self.merges is not None:
            return [tuple(merge.split(" ")) for merge in self.merges]
        if vocab_scores is None:
            if self.scores is None or len(self.scores) != len(self.tokens):
                raise InvalidCheckpoint(self.path, "tokenizer.ggml.merges", "is missing, and so are the scores of "
                                        "every token (tokenizer.ggml.scores) to rebuild the merges from")
            vocab_scores = dict(zip(self.tokens, self.scores))
        return generate_merges({token: index for index, token in enumerate(self.tokens)}, vocab_scores)


def _byte_level(vocab: _Vocabulary) -> Tokenizer:
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    ids = {token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8")): index
           for index, token in enumerate(vocab.tokens)}
    tokenizer = Tokenizer(BPE(vocab=ids, merges=vocab.merge_list(), dropout=None, continuing_subword_prefix="",
                              end_of_word_suffix="", fuse_unk=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    split = PRE_TOKENIZER_SPLITS.get(vocab.metadata.get("tokenizer.ggml.pre"))
    if split is not None:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return tokenizer


def _sentencepiece(vocab: _Vocabulary) -> Tokenizer:
    ids = {token: index for index, token in enumerate(vocab.tokens)}
    tokenizer = Tokenizer(BPE(vocab=ids, merges=vocab.merge_list(), fuse_unk=True, byte_fallback=True, dropout=None))
    tokenizer.normalizer = None
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(content=" ", left=1)])
    return tokenizer


def _phi3(vocab: _Vocabulary) -> Tokenizer:
    tokenizer = _sentencepiece(vocab)
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend(prepend="▁"),
                                                 normalizers.Replace(pattern=" ", content="▁")])
    tokenizer.pre_tokenizer = None
    return tokenizer


def _gemma(vocab: _Vocabulary) -> Tokenizer:
    tokens = ["▁" * len(t) if " " in t and not t.strip() else t for t in vocab.tokens]
    ids = {token: index for index, token in enumerate(tokens)}
    positions = {token: -index for index, token in enumerate(tokens)}
    tokenizer = Tokenizer(BPE(vocab=ids, merges=generate_merges(ids, positions), fuse_unk=True, unk_token="<unk>",
                              dropout=None, byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tokenizer.normalizer = normalizers.Replace(" ", "▁")
    return tokenizer


BUILDERS = {"gpt2": _byte_level, "llama": _sentencepiece, "phi3": _phi3, "gemma": _gemma}


def _add_special_tokens(tokenizer: Tokenizer, vocab: _Vocabulary, kind: str) -> None:
    byte_level = kind == "gpt2"
    spelled = set(bytes_to_unicode().values())
    types = vocab.types
    control = [token for token, token_type in zip(vocab.tokens, types)
               if token_type == CONTROL and (not byte_level or set(token) <= spelled)]
    known = tokenizer.get_vocab(with_added_tokens=True)
    defaults = [token for token in CLASS_SPECIALS[kind] if token in known]
    named = [vocab.tokens[i] for i in map(vocab.token_id, SPECIAL_IDS) if i is not None]
    specials = list(dict.fromkeys(defaults + control + named))
    tokenizer.add_special_tokens([AddedToken(token, normalized=False, special=True) for token in specials])
    known = tokenizer.get_vocab(with_added_tokens=True)
    user = [token for token, token_type in zip(vocab.tokens, types) if token_type == USER_DEFINED and token in known]
    if user:
        tokenizer.add_tokens([AddedToken(token, normalized=False, special=False) for token in user])


def _post_processor(tokenizer: Tokenizer, vocab: _Vocabulary, sentencepiece: bool) -> None:
    """A BOS and an EOS around each text where the file asks for them (transformers' `update_post_processor`)."""
    add_bos = vocab.metadata.get("tokenizer.ggml.add_bos_token", sentencepiece)
    add_eos = vocab.metadata.get("tokenizer.ggml.add_eos_token", False)
    bos_id, eos_id = vocab.token_id("bos_token"), vocab.token_id("eos_token")
    bos = vocab.tokens[bos_id] if add_bos and bos_id is not None else None
    eos = vocab.tokens[eos_id] if add_eos and eos_id is not None else None
    single = f"{bos + ':0 ' if bos else ''}$A:0{' ' + eos + ':0' if eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if bos else ''} $B:1{' ' + eos + ':1' if eos else ''}"
    ends = [(token, tokenizer.token_to_id(token)) for token in (bos, eos) if token is not None]
    tokenizer.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=ends)


def build_tokenizer(metadata: Mapping[str, Any], architecture: Architecture, path: str | Path) -> Tokenizer:
    """The `tokenizers.Tokenizer` of a GGUF file's metadata (see the module docstring).

    UnsupportedCheckpoint for a `tokenizer.ggml.model` other than "gpt2" and "llama";
    InvalidCheckpoint (naming the key) for a vocabulary that is missing or malformed.
    """
    path = Path(path)
    model = metadata.get("tokenizer.ggml.model")
    if model not in ("gpt2", "llama"):
        raise UnsupportedCheckpoint(f"{path}: tokenizer.ggml.model={model!r}: only 'gpt2' (byte-level BPE) and "
                                    "'llama' (SentencePiece) vocabularies are read")
    vocab = _Vocabulary(metadata, path)
    kind = "gpt2" if model == "gpt2" else architecture.sentencepiece
    try:
        tokenizer = BUILDERS[kind](vocab)
    except Exception as err:  # noqa: BLE001 (`tokenizers` raises a bare Exception for a bad vocabulary)
        if isinstance(err, InvalidCheckpoint):
            raise
        raise InvalidCheckpoint(path, "tokenizer.ggml.tokens", f"makes no tokenizer ({err})") from None
    _add_special_tokens(tokenizer, vocab, kind)
    _post_processor(tokenizer, vocab, sentencepiece=model == "llama")
    return tokenizer


def special_tokens(metadata: Mapping[str, Any], path: str | Path) -> dict[str, str]:
    """`{"bos_token": ..., "eos_token": ..., ...}`: the named special tokens the file gives (for chat templates)."""
    vocab = _Vocabulary(metadata, Path(path))
    return {name: vocab.tokens[i] for name in SPECIAL_IDS for i in [vocab.token_id(name)] if i is not None}
