"""Where a model whose weights hold NaN or infinity goes wrong, for the programs' one line.

A model loaded with `--allow-nonfinite` (`--hf DIR` or `--gguf FILE`) may hold NaN or infinity:
`nonfinite_weights` and `list_weights` name those weights, `first_nonfinite` finds the first module
whose output over some tokens is not finite, and `describe_nonfinite` says both in words, as the end
of the line `train.sample` and `train.attention_maps` end with.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxattn.config import ModelConfig
from jaxattn.model import DecoderLM
from train.checkpoints.meta import path_name

# The methods whose outputs `first_nonfinite` looks at, in the order they run: every module's __call__,
# and the model's embeddings and logits (which are methods of the model, not modules of their own).
_TRACED_METHODS = ("__call__", "embed", "embed_values", "logits")


def nonfinite_weights(params) -> list[tuple[str, int]]:
    """(path, how many values) of each parameter holding NaN or infinity, in tree order."""
    found = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(nn.unbox(params)):
        bad = int(np.size(leaf) - np.count_nonzero(np.isfinite(np.asarray(leaf))))
        if bad:
            found.append((path_name(path), bad))
    return found


def first_nonfinite(params, config: ModelConfig, token_ids) -> str | None:
    """The module (e.g. "blocks_1/attn/query", "embed", "logits") whose output is the first, in the
    order the forward pass runs, to hold NaN or infinity over `token_ids` `[T]`; None when none does."""
    tokens = jnp.asarray(np.asarray(token_ids, np.int32).reshape(1, -1))
    paths = []  # filled while tracing: a jitted function's dicts come back in sorted order, not the run's

    def forward(params, tokens):
        _, state = DecoderLM(config).apply({"params": params}, tokens, mutable=["intermediates"],
                                           capture_intermediates=lambda module, method: method in _TRACED_METHODS)
        captured = list(_in_order(state["intermediates"]))
        paths[:] = [path[:-1] if path[-1] == "__call__" else path for path, _ in captured]
        return [value for _, value in captured]

    outputs = jax.jit(forward)(params, tokens)
    for path, value in zip(paths, outputs):
        if path and "dropout" in str(path[-1]):
            continue  # the identity when sampling: its input said it first
        leaves = [np.asarray(x) for x in jax.tree.leaves(value) if jnp.issubdtype(x.dtype, jnp.inexact)]
        if not all(np.isfinite(x).all() for x in leaves):
            return "/".join(str(p) for p in path) or "logits"
    return None


def _in_order(tree, path=()):
    """(path, value) of a nested dict of captured outputs, depth first in insertion order: the order
    the modules returned, so a layer's parts come before the layer and the layer before the next."""
    for key, value in tree.items():
        if hasattr(value, "items"):
            yield from _in_order(value, (*path, key))
        else:
            yield (*path, key), value


def describe_nonfinite(params, config: ModelConfig, token_ids, *, padding: int | None = None) -> str:
    """Where the outputs over `token_ids` first stop being finite and which weights hold NaN or
    infinity, as the end of a one-line message: "they first appear in layer 1, at blocks_1/attn/query;
    the weights holding NaN or infinity: blocks_1/attn/query/kernel (1 value)".

    `padding`: the token a program padded `token_ids` with (`jaxattn.generate` pads each prompt to its
    compiled length). A padding token whose embedding is not finite reaches the real tokens' outputs
    though attention gives it weight 0 (0 x NaN is NaN); when the tokens alone stay finite, they are
    tried again followed by it, and the line says so.
    """
    module, cause = first_nonfinite(params, config, token_ids), ""
    if module is None and padding is not None:
        module = first_nonfinite(params, config, [*np.asarray(token_ids).tolist(), padding])
        cause = (f" of the padding (token {padding}) after the prompt: attention gives it weight 0, but 0 x NaN "
                 "is NaN")
    if module is None:
        where = "every layer's output is finite on the same tokens run whole"
    else:
        layer = module.split("/")[0]
        name = (f"layer {layer.split('_')[-1]}" if layer.startswith("blocks_") else
                "the embeddings" if layer.startswith(("embed", "wte", "wpe", "value_embed")) else
                "the final norm" if layer == "final_norm" else "the output layer")
        where = f"they first appear in {name}, at {module}{cause}"
    listed = list_weights(params)
    return f"{where}; the weights holding NaN or infinity: {listed}" if listed else \
        f"{where}; every weight is finite (an overflow)"


def list_weights(params, most: int = 4) -> str:
    """The parameters holding NaN or infinity as words, "wte/embedding (16 values), ..." (the first
    `most`, then how many more); "" when there are none."""
    weights = nonfinite_weights(params)
    listed = ", ".join(f"{name} ({count:,} value{'s' if count > 1 else ''})" for name, count in weights[:most])
    return listed + (f" and {len(weights) - most} more" if len(weights) > most else "")
