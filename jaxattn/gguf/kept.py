"""A GGUF file's quantized weights kept quantized: which `jaxattn.quantize` mode holds each ggml type.

llama.cpp users expect the file's size to be the memory the model takes, so its block formats are
not left as the float32 they are dequantized to. `kept_quantization(file)` chooses, for the model's
layers and for its head, the mode that holds the file's numbers:

* Q8_0 -> "int8:32", Q4_0 -> "int4:32", Q4_1 -> "int4:asym": the same numbers. Each is quantized
  from `load_gguf`'s float32 weights, which give back the file's own values and scales (and Q4_1's
  minimums) because llama.cpp's quantizer puts a block's extremes where these modes look for them:
  Q8_0's largest |value| at +-127, Q4_0's value of largest magnitude at -8, Q4_1's minimum at 0 and
  maximum at 15 (its float16 scale found again by rounding (max - min) / 15 to float16).
  tests/gguf/test_gguf_kept.py checks the numbers on files the `gguf` package writes.
* the other block formats -> the nearest native mode, quantized again from the float32 weights:
  Q5_0, Q5_1, Q5_K, Q6_K (more than 4 bits) -> "int8:32"; Q2_K, Q3_K, Q4_K -> "int4:asym".
* F32, F16, BF16 -> None: the weights stay float.

The layers' weights share one mode (layers stacked for a scan must): the widest the file's layer
matmuls need, so no weight is held with fewer bits than the file gives it. The head (`output.weight`,
or the token embedding where the head is tied to it) has its own. The token embedding's lookup table
itself stays float (`jaxattn.quantize` leaves lookup tables as they are).
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from jaxattn.gguf.reader import GGUFFile

# ggml type -> (the jaxattn.quantize mode that keeps it, whether it holds the file's own numbers)
KEPT_AS = {"Q8_0": ("int8:32", True), "Q4_0": ("int4:32", True), "Q4_1": ("int4:asym", True),
           "Q5_0": ("int8:32", False), "Q5_1": ("int8:32", False), "Q5_K": ("int8:32", False),
           "Q6_K": ("int8:32", False), "Q2_K": ("int4:asym", False), "Q3_K": ("int4:asym", False),
           "Q4_K": ("int4:asym", False)}
WIDTH = ("int4:32", "int4:asym", "int8:32")  # the kept modes, fewest bits first
HEAD_TENSORS = ("output.weight", "token_embd.weight")  # the untied head, else the embedding it is tied to


@dataclasses.dataclass(frozen=True)
class KeptQuantization:
    """How a GGUF file's matmul weights are kept.

    Attributes:
      layers: the `jaxattn.quantize` mode of the layers' matmul weights, or None (float).
      head: the head's mode, or None (float).
      types: `{ggml type: count}` of the file's matmul weights (the head included).
      exact: whether every kept weight holds the file's own numbers (no type quantized again).
    """

    layers: str | None
    head: str | None
    types: dict[str, int]
    exact: bool

    def describe(self) -> str:
        """One line: the file's types and what each became, e.g. "Q4_1 (210) and Q8_0 (1) kept as
        int4:asym, the head as int8:32: the file's own numbers"."""
        types = " and ".join(f"{name} ({count})" for name, count in sorted(self.types.items()))
        head = "" if self.head == self.layers else f", the head as {self.head or 'float32'}"
        how = "the file's own numbers" if self.exact else "the nearest native formats (quantized again)"
        return f"{types} kept as {self.layers or 'float32'}{head}: {how}"


def kept_quantization(file: GGUFFile) -> KeptQuantization | None:
    """The modes that keep `file`'s matmul weights (the module docstring), or None when they are all float."""
    architecture = file.architecture
    matmuls = [name for name in file.tensors if name not in architecture.config_tensors
               and len(file.shape(name)) == 2 and name != "token_embd.weight"]
    head = next((name for name in HEAD_TENSORS if name in file.tensors), None)
    layers = [name for name in matmuls if name != head]
    types = Counter(file.type_name(name) for name in layers + ([head] if head else []))
    if not any(kind in KEPT_AS for kind in types):
        return None
    layer_types = {file.type_name(name) for name in layers}
    layer_mode = _widest(layer_types)
    head_types = {file.type_name(head)} if head else set()
    head_mode = _widest(head_types)
    exact = all(KEPT_AS.get(kind) == (mode, True) for kinds, mode in ((layer_types, layer_mode), (head_types, head_mode))
                if mode is not None for kind in kinds)
    return KeptQuantization(layer_mode, head_mode, dict(types), exact)


def _widest(kinds: set[str]) -> str | None:
    """The mode that holds every type of `kinds` with at least its bits; None if any is float (or none)."""
    if not kinds or any(kind not in KEPT_AS for kind in kinds):
        return None
    return max((KEPT_AS[kind][0] for kind in kinds), key=WIDTH.index)
