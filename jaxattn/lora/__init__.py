"""LoRA: low-rank adapters on a model's frozen matmul weights (Hu et al. 2021; PEFT's conventions).

A targeted weight `W [in, out]` becomes `W + scale * A B` with `A [in, r]` and `B [r, out]`,
`scale = alpha / r` (`alpha / sqrt(r)` with rsLoRA). Only A and B train; W stays as it was, float or
a `jaxattn.quantization.QuantizedWeight` (QLoRA).

Letters: D model dim, N heads, K kv heads, H head dim, F mlp hidden, E experts, r rank, R stacked
layers (a scan's leading axis).

* `LoraWeight` replaces a parameter in the tree (a pytree, as `QuantizedWeight` is): the frozen `base`
  and, for each *part* of the weight's output columns, an optional adapter `a [..., in, r]`,
  `b [..., r, width]`. Parts follow jaxattn's column order: a fused `qkv` kernel has three (q, k, v:
  widths `N*H, K*H, K*H`), a gated MLP's `gate_up` two (gate, up: `F, F`), every other weight one. A
  part that is not targeted has `a = b = None` (no delta). Leading axes (layers stacked for a scan,
  `[R, in, out]`; experts, `[E, in, out]`) are on every leaf alike, so `nn.scan` slices them.
* `jaxattn.layers.primitives.Linear` runs a `LoraWeight` kernel as the base matmul (the float or the quantized
  kernel) plus `scale * (dropout(x) @ a) @ b` per part; the routed experts and MLA's `wkv_b` read
  theirs through `float_param`, merged (`base + scale * a @ b`, per expert).
* Dropout contract: the adapters' input dropout (PEFT's `lora_dropout`, on x) runs only when the module
  is applied with a "dropout" rng (`rngs={"dropout": key}`, what training passes when its dropout is
  on) and `LoraConfig.dropout > 0`; without the rng it is off, whatever `deterministic` says. Merged
  weights (experts, `wkv_b`) take no adapter dropout.

Targets (`TARGETS`) are logical names, mapped to weights by the module that holds them
(the role tables of `jaxattn.lora.params`):

| target | weight |
| --- | --- |
| q, k, v | `attn/query`, `attn/key`, `attn/value`, or the parts of `attn/qkv`; MLA: q is `wq` or `wq_b` |
| o | `attn/out`; MLA: `wo` |
| gate, up | the parts of `mlp/gate_up` and of a mixture's `shared_gate_up`; up alone: a plain MLP's `mlp/c_fc` |
| down | `mlp/down`, `mlp/c_proj`, a mixture's `shared_down` |
| experts | the routed experts' `experts_gate_up [E, D, 2F]`, `experts_down [E, F, D]` (one part each, per expert) |

MLA computes keys and values from one up-projection of the latent, `wkv_b [R_lat, N, P + V]`
(W_UK and W_UV per head, side by side): "k" and "v" there both name `wkv_b` as one part (its columns
interleave them per head), so they are targeted together or not at all (naming one alone is a
ValueError). The shared latent compression `wkv_a` (and `wq_a`) is no target: it feeds every head.
The router, norms, embeddings and the head are never adapted.

Functions: `add_lora` (params -> params with `LoraWeight`s), `split_lora` / `combine_lora` (the
adapters alone, for the optimizer and checkpoints, and the frozen rest), `merge_lora` (plain float
params), `count_lora_params`. `jaxattn.hf.peft` reads and writes PEFT's adapter files.

The package, one job a module (each name below is also `jaxattn.lora.<name>`), beside its config in the
configs' room (`jaxattn.config.lora`: `LoraConfig`, its rank, alpha, dropout, rsLoRA and targets, and `TARGETS`):

* `jaxattn.lora.weight`: `LoraWeight` and its maths, what a layer reads (`lora_delta`, `float_param`);
* `jaxattn.lora.params`: which weight each target names (`roles_of`, `part_widths`), and the adapters
  over a params tree (`add_lora`, `split_lora`, `combine_lora`, `merge_lora`, `count_lora_params`);
* `jaxattn.lora.slots`: many adapters on one base, chosen per token row (`LoraSlots`, `empty_slots`,
  `write_slot`, `clear_slot`, `with_token_slots`);
* `jaxattn.lora.slot_forms`: the maths a Linear reads for them, `slot_delta`, in each of its formulations.
"""

from jaxattn.config.lora import TARGETS, LoraConfig
from jaxattn.lora.params import (KV, add_lora, combine_lora, count_lora_params, merge_lora, part_widths, role_targets,
                                 roles_of, split_lora)
from jaxattn.lora.slots import (FORMS, LoraSlots, clear_slot, empty_slots, is_slots, slot_delta, with_token_slots,
                                write_slot)
from jaxattn.lora.weight import LoraWeight, float_param, is_lora, lora_delta

__all__ = ["FORMS", "KV", "TARGETS", "LoraConfig", "LoraSlots", "LoraWeight", "add_lora", "clear_slot", "combine_lora",
           "count_lora_params", "empty_slots", "float_param", "is_lora", "is_slots", "lora_delta", "merge_lora",
           "part_widths", "role_targets", "roles_of", "slot_delta", "split_lora", "with_token_slots", "write_slot"]
