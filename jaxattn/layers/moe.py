"""Mixture-of-experts MLPs: a router, routed experts, shared experts, and the router losses (docs/theory.md §24).

Letters: B batch, T tokens, D model width, M = B*T rows, E experts, K = experts per token,
F an expert's hidden width. A layer computes, per row x_m,

    y_m = sum_k gate[m, k] * expert_{index[m, k]}(x_m)  (+ shared(x_m), optionally gated)

* `route(x [M, D], router, cfg) -> (expert_index [M, K] int32, gate [M, K] float32, logits [M, E])`:
  the router of every family transformers implements (`MoEConfig` says which field is whose),
  in float32.
* the routed experts (`jaxattn.kernels.moe`, chosen by `Kernels.moe`): "dense" (the reference:
  every expert on every row, weighted by the sparse gate matrix), "grouped" (rows sorted by expert,
  `jax.lax.ragged_dot`), "grouped_cpu" (the same grouping in tiles of rows, XLA:CPU's fast form),
  "gathered" (each row with copies of its K experts' weights: decoding steps), "auto_cpu" (per
  call, by the shapes); `resolve_kernels` makes "auto" "auto_cpu" on a CPU and
  "grouped" elsewhere. All are dropless and exact: every row reaches its K experts, no capacity,
  no dropped rows.
* `load_balancing_loss` (the Switch Transformer's, as transformers' `load_balancing_loss_func`)
  and `router_z_loss` (ST-MoE's): training settings `MoEConfig.aux_loss_coef`, `z_loss_coef`.
* `MoE`: the Flax module owning the parameters, expert weights on the logical axis "expert". It is
  called as the dense `jaxattn.layers.primitives.MLP` is, `[B, T, D] -> [B, T, D]`, and sows its losses
  into `jaxattn.layer_losses.COLLECTION` (`LOSS_NAMES`), where a training step reads them, and its
  routing into "intermediates" (`ROUTING`) when a caller makes that collection mutable.
"""

from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxattn import layer_losses
from jaxattn.layers import primitives
from jaxattn._validate import require_float, require_rank
from jaxattn.axes import EMBED, EXPERT, MLP
from jaxattn.config import ModelConfig
from jaxattn.kernels import Kernels, moe_kernel
from jaxattn.kernels.moe import IMPLEMENTATIONS, ExpertWeights, gate_matrix, glu
from jaxattn.kernels.moe import (experts_dense, experts_gathered, experts_grouped,  # noqa: F401 (re-exported)
                                 experts_grouped_cpu)
from jaxattn.config.moe import MoEConfig
from jaxattn.lora import float_param  # a quantized or LoRA weight read as float
from jaxattn.layers.primitives import logical, make_linear, residual_init_std

# The losses each MoE layer sows into `jaxattn.layer_losses.COLLECTION`; "aux_loss" (their sum weighted by
# `aux_loss_coef` and `z_loss_coef`) is `layer_losses.OBJECTIVE`, the one a training step adds.
LOSS_NAMES = ("load_balancing_loss", "router_z_loss", layer_losses.OBJECTIVE)
# Where a layer sows its routing when "intermediates" is mutable: "router_logits" [B, T, E] float32,
# "expert_index" [B, T, K] int32 and "gate" [B, T, K] float32.
ROUTING = ("intermediates", "routing")


class RouterWeights(NamedTuple):
    """kernel [D, E]; bias [E] (`router_bias`) and correction_bias [E] (`correction_bias`), else None."""

    kernel: jax.Array
    bias: jax.Array | None = None
    correction_bias: jax.Array | None = None


def _limit_groups(choice: jax.Array, cfg: MoEConfig) -> jax.Array:
    """`choice [M, E]` with every expert outside the `topk_group` best groups at -inf."""
    M, E = choice.shape
    grouped = choice.reshape(M, cfg.n_group, E // cfg.n_group)  # [M, G, E/G]
    if cfg.group_score == "max":
        score = grouped.max(axis=-1)  # [M, G]
    else:
        score = jax.lax.top_k(grouped, 2)[0].sum(axis=-1)
    _, best = jax.lax.top_k(score, cfg.topk_group)  # [M, topk_group]
    keep = jnp.zeros((M, cfg.n_group), bool).at[jnp.arange(M)[:, None], best].set(True)
    # DeepSeek-V2 fills 0.0 (its softmax scores are > 0), V3 -inf: the same choice either way.
    return jnp.where(jnp.repeat(keep, E // cfg.n_group, axis=1), choice, -jnp.inf)


def _check_route(x, router: RouterWeights, cfg: MoEConfig) -> None:
    if not isinstance(cfg, MoEConfig):
        raise TypeError(f"cfg must be a jaxattn.layers.moe.MoEConfig, got {type(cfg).__name__}")
    require_rank("x", x, 2, "[M, D]")
    require_float("x", x)
    shapes = {"kernel": (x.shape[1], cfg.num_experts), "bias": (cfg.num_experts,),
              "correction_bias": (cfg.num_experts,)}
    wanted = {"kernel": True, "bias": cfg.router_bias, "correction_bias": cfg.correction_bias}
    for name, shape in shapes.items():
        value = getattr(router, name)
        if (value is None) == wanted[name] or (value is not None and tuple(value.shape) != shape):
            raise ValueError(f"router.{name} must be {'an array of shape ' + str(shape) if wanted[name] else 'None'} "
                             f"for x {tuple(x.shape)} and this MoEConfig, got "
                             f"{None if value is None else tuple(value.shape)}")


def route(x: jax.Array, router: RouterWeights, cfg: MoEConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Which K experts each row goes to, and with what weight, in float32.

    Args:
      x: [M, D] rows (any float dtype; the router runs in float32).
      router: the router's weights (`RouterWeights`).
      cfg: the family's routing (`MoEConfig`).

    Returns:
      `(expert_index [M, K] int32, gate [M, K] float32, router_logits [M, E] float32)`; the K
      indices of a row are distinct, in descending order of the score they were chosen by.
    """
    _check_route(x, router, cfg)
    logits = jnp.einsum("md,de->me", x.astype(jnp.float32), router.kernel.astype(jnp.float32))  # [M, E]
    if cfg.router_bias:
        logits = logits + router.bias.astype(jnp.float32)[None, :]
    if cfg.softmax_after_topk:  # GPT-OSS
        top, index = jax.lax.top_k(logits, cfg.experts_per_token)  # [M, K]
        gate = jax.nn.softmax(top, axis=-1)
    else:
        scores = jax.nn.softmax(logits, axis=-1) if cfg.scoring == "softmax" else jax.nn.sigmoid(logits)
        choice = scores
        if cfg.correction_bias:  # selection only; V3 trains it outside the gradient
            choice = choice + jax.lax.stop_gradient(router.correction_bias.astype(jnp.float32))[None, :]
        if cfg.n_group > 1:
            choice = _limit_groups(choice, cfg)
        _, index = jax.lax.top_k(choice, cfg.experts_per_token)  # [M, K]
        gate = jnp.take_along_axis(scores, index, axis=1)  # [M, K]: the unbiased scores
        if cfg.norm_topk_prob:
            gate = gate / (gate.sum(axis=-1, keepdims=True) + 1e-20)  # DeepSeek-V3's epsilon
    return index.astype(jnp.int32), gate * cfg.routed_scaling_factor, logits


def _rows_and_weights(router_logits: jax.Array, mask: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """`[..., E]` logits as float32 rows `[R, E]`, and each row's weight `[R]` (the mask, or 1)."""
    if not hasattr(router_logits, "ndim") or router_logits.ndim < 2:
        raise ValueError(f"router_logits must be [..., E] with at least one row axis, got "
                         f"{getattr(router_logits, 'shape', type(router_logits).__name__)}")
    logits = router_logits.reshape(-1, router_logits.shape[-1]).astype(jnp.float32)
    if mask is None:
        return logits, jnp.ones(logits.shape[:1], jnp.float32)
    if tuple(mask.shape) != tuple(router_logits.shape[:-1]):
        raise ValueError(f"mask must have router_logits' leading shape {tuple(router_logits.shape[:-1])}, "
                         f"got {tuple(mask.shape)}")
    return logits, mask.reshape(-1).astype(jnp.float32)


def load_balancing_loss(router_logits: jax.Array, k: int, mask: jax.Array | None = None) -> jax.Array:
    """The Switch Transformer's balancing loss, `E * sum_e f_e * P_e`, as transformers computes it.

    f_e: the share of rows whose top-k (of the softmax of the logits, whatever the router's own
    scoring) includes e (summing to k over e); P_e: the mean softmax probability of e. Gradients
    reach the logits through P only.

    Args:
      router_logits: [..., E] (e.g. [M, E], or several layers' concatenated: transformers pools them).
      k: experts per token.
      mask: [...] (the logits' leading shape), False/0 = a padding row left out; None = every row.

    Returns:
      a float32 scalar: 1 at perfect balance with k = 1 (k in general), up to E when one expert wins all.
    """
    logits, weight = _rows_and_weights(router_logits, mask)
    E = logits.shape[-1]
    probs = jax.nn.softmax(logits, axis=-1)  # [R, E]
    _, chosen = jax.lax.top_k(probs, k)  # [R, k]
    counts = jnp.zeros((E,), jnp.float32).at[chosen].add(jnp.broadcast_to(weight[:, None], chosen.shape))
    rows = weight.sum()
    return E * jnp.sum((counts / rows) * (jnp.einsum("re,r->e", probs, weight) / rows))


def router_z_loss(router_logits: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """ST-MoE's router z-loss: the mean over rows of `logsumexp(logits)^2` (float32 scalar).

    `router_logits [..., E]`; `mask [...]` leaves padding rows out, as in `load_balancing_loss`."""
    logits, weight = _rows_and_weights(router_logits, mask)
    z = jax.nn.logsumexp(logits, axis=-1)  # [R]
    return jnp.sum(weight * z * z) / weight.sum()


class MoE(nn.Module):
    """A mixture-of-experts MLP: `[B, T, D] -> [B, T, D]`, called as `jaxattn.layers.primitives.MLP` is.

    Attributes:
      config: the model (`d_model`, dtypes, `init_std`, `num_layers` and `zero_init_out` for the
        output projections' init).
      moe: the layer's `MoEConfig`.
      kernels: the routed experts' implementation (`Kernels.moe`, resolved) and the shared
        expert's matmul (`Kernels.matmul`).

    Parameters (logical axes): `router_kernel [D, E]` ("embed", "expert"), `router_bias [E]` and
    `router_correction_bias [E]` (float32; "expert"); `experts_gate_up [E, D, 2F]` ("expert", "embed",
    "mlp"), `experts_down [E, F, D]` ("expert", "mlp", "embed"), and with `MoEConfig.expert_bias`
    `experts_gate_up_bias [E, 2F]` and `experts_down_bias [E, D]`; the shared experts' `shared_gate_up/kernel [D, 2S]` ([gate | up]),
    `shared_down/kernel [S, D]` and `shared_expert_gate/kernel [D, 1]` (S = `MoEConfig.shared_hidden`).
    """

    config: ModelConfig
    moe: MoEConfig
    kernels: Kernels = Kernels()

    def _router(self) -> RouterWeights:
        c, m, E = self.config, self.moe, self.moe.num_experts
        kernel = self.param("router_kernel", logical(nn.initializers.normal(c.init_std), EMBED, EXPERT),
                            (c.d_model, E), jnp.dtype(c.param_dtype))
        zeros = logical(nn.initializers.zeros, EXPERT)
        bias = self.param("router_bias", zeros, (E,), jnp.dtype(c.param_dtype)) if m.router_bias else None
        correction = self.param("router_correction_bias", zeros, (E,), jnp.float32) if m.correction_bias else None
        return RouterWeights(kernel, bias, correction)

    def _experts(self) -> ExpertWeights:
        c, m = self.config, self.moe
        E, D, F, dtype = m.num_experts, c.d_model, m.expert_hidden, jnp.dtype(c.param_dtype)
        out_std = 0.0 if c.zero_init_out else residual_init_std(c)
        # Quantized experts (`jaxattn.quantize`) are dequantized here: the reference, for every Kernels.moe.
        gate_up = float_param(self, "experts_gate_up", logical(nn.initializers.normal(c.init_std), EXPERT, EMBED, MLP),
                              (E, D, 2 * F), dtype)
        down = float_param(self, "experts_down", logical(nn.initializers.normal(out_std), EXPERT, MLP, EMBED),
                           (E, F, D), dtype)
        if not m.expert_bias:
            return ExpertWeights(gate_up, down)
        return ExpertWeights(gate_up, down,
                             self.param("experts_gate_up_bias", logical(nn.initializers.zeros, EXPERT, MLP),
                                        (E, 2 * F), dtype),
                             self.param("experts_down_bias", logical(nn.initializers.zeros, EXPERT, EMBED),
                                        (E, D), dtype))

    def _shared(self, rows: jax.Array) -> jax.Array:
        """The shared experts on every row `[M, D] -> [M, D]`, times Qwen2-MoE's gate."""
        c, k, S = self.config, self.kernels, self.moe.shared_hidden
        gate, up = jnp.split(make_linear(c, k, 2 * S, (EMBED, MLP), use_bias=False, name="shared_gate_up")(rows),
                             2, axis=-1)  # [M, S] each
        out = make_linear(c, k, c.d_model, (MLP, EMBED), residual=True, use_bias=False,
                          name="shared_down")(nn.silu(gate) * up)
        if self.moe.shared_gate:
            g = make_linear(c, k, 1, (EMBED, None), use_bias=False, name="shared_expert_gate")(rows)  # [M, 1]
            out = (jax.nn.sigmoid(g.astype(jnp.float32)) * out.astype(jnp.float32)).astype(out.dtype)
        return out

    @nn.compact
    def __call__(self, x: jax.Array, *, padding_mask: jax.Array | None = None,
                 deterministic: bool = True) -> jax.Array:
        """`x [B, T, D]` -> `y [B, T, D]`, then residual dropout (`config.dropout`) as `MLP`.

        `padding_mask [B, T]` (True = a real token) leaves padding out of the losses only. Sown:
        into `jaxattn.layer_losses.COLLECTION`, "load_balancing_loss", "router_z_loss" and
        "aux_loss" (their sum weighted by `aux_loss_coef` and `z_loss_coef`), float32 scalars; into
        `ROUTING`, where "intermediates" is mutable, `{"router_logits", "expert_index", "gate"}`.
        """
        require_rank("x", x, 3, "[B, T, D]")
        B, T, D = x.shape
        if D != self.config.d_model:
            raise ValueError(f"x must be [B, T, d_model={self.config.d_model}], got shape {tuple(x.shape)}")
        if padding_mask is not None and tuple(padding_mask.shape) != (B, T):
            raise ValueError(f"padding_mask must be [B, T] = {(B, T)}, got {tuple(padding_mask.shape)}")
        rows = x.reshape(B * T, D).astype(jnp.dtype(self.config.dtype))  # [M, D]
        index, gate, logits = route(rows, self._router(), self.moe)
        y = moe_kernel(self.kernels.moe)(rows, index, gate, self._experts(), self.moe)
        if self.moe.shared_hidden:
            y = y + self._shared(rows)
        m, E, K = self.moe, self.moe.num_experts, self.moe.experts_per_token
        logits = logits.reshape(B, T, E)
        balance, z = load_balancing_loss(logits, K, padding_mask), router_z_loss(logits, padding_mask)
        losses = dict(zip(LOSS_NAMES, (balance, z, m.aux_loss_coef * balance + m.z_loss_coef * z)))
        for name, value in losses.items():
            self.sow(layer_losses.COLLECTION, name, value)
        if self.is_mutable_collection(ROUTING[0]) and not self.is_initializing():
            self.sow(*ROUTING, {"router_logits": logits, "expert_index": index.reshape(B, T, K),
                                "gate": gate.reshape(B, T, K)})
        return nn.Dropout(self.config.dropout)(y.reshape(B, T, D), deterministic=deterministic)


def mlp_for_layer(config: ModelConfig, kernels: Kernels, layer: int) -> nn.Module:
    """Layer `layer`'s MLP: a mixture of experts where `config.layer_is_moe(layer)`, else the dense
    `jaxattn.layers.primitives.MLP`. Both are called alike (`x, *, padding_mask, deterministic -> y`), so a
    block holds either without asking which."""
    return MoE(config, config.moe, kernels) if config.layer_is_moe(layer) else primitives.MLP(config, kernels)


__all__ = ["IMPLEMENTATIONS", "LOSS_NAMES", "MoE", "MoEConfig", "ExpertWeights", "ROUTING", "RouterWeights",
           "experts_dense", "experts_gathered", "experts_grouped", "experts_grouped_cpu", "gate_matrix", "glu",
           "load_balancing_loss", "mlp_for_layer", "route", "router_z_loss"]
