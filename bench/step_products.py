"""The matrix products a LoRA fine-tuning step cannot do without, and how fast this CPU runs them alone.

A LoRA step on a frozen base computes the forward pass and, through every frozen weight, only the gradient
of its input (no weight gradient but the adapters'): so much is the chain rule's, whoever writes the step.
`step_products` lists those products for a model of standard attention (MHA, GQA or MQA) and a dense MLP;
`time_products_xla` and `time_products_torch` time each distinct one alone, at its best over repeated calls,
with bfloat16 operands and float32 sums (what `runtime.matmul = "bfloat16_cpu"` and `torch.autocast` give),
and add them up over the step. That sum is a floor under any step at that precision on this machine: the
products alone, with nothing between them (no softmax, norm, RoPE, loss or optimizer) and nothing of
their operands to convert, lay out or write back. bench/finetune.py sets it beside the whole steps.

Needs only the standard library to list the products; JAX or torch only in the timer that uses it (a
peer's process has no JAX).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import Counter
from typing import Callable, Iterable

GATED_MLPS = ("swiglu", "geglu")


@dataclasses.dataclass(frozen=True)
class Product:
    """`count` products `[batch, m, k] @ [batch, k, n]` a step, for `what`."""

    what: str
    batch: int
    m: int
    k: int
    n: int
    count: int

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return self.batch, self.m, self.k, self.n

    @property
    def flops(self) -> int:
        """Multiplies and adds of all `count` products."""
        return 2 * self.batch * self.m * self.k * self.n * self.count


def projections(model) -> dict[str, tuple[int, int]]:
    """Each layer's frozen projections by the logical names LoRA targets: {name: (in, out)}."""
    D, N, K, H, F = model.d_model, model.num_heads, model.num_kv_heads, model.head_dim, model.mlp_hidden
    mlp = {"gate": (D, F), "up": (D, F), "down": (F, D)} if model.mlp in GATED_MLPS else {"up": (D, F), "down": (F, D)}
    return {"q": (D, N * H), "k": (D, K * H), "v": (D, K * H), "o": (N * H, D), **mlp}


def step_products(model, batch: int, seq: int, rank: int, targets: Iterable[str]) -> list[Product]:
    """The products of one LoRA step (rank `rank` on the projections named in `targets`) over `batch` rows
    of `seq` tokens, for a `jaxattn.ModelConfig` of standard attention and a dense MLP:

    * every projection: its forward `[R, in] @ [in, out]` and its input's gradient `[R, out] @ [out, in]`,
      but for the first layer's q, k and v, whose input is the frozen embedding (R = batch * seq rows);
    * every adapter `B A`: `x A`, `(x A) B` forward; `B`'s and `A`'s gradients and, where the input's
      gradient is taken, its share of it;
    * attention, dense, per row and kv head (G = N / K query heads over the same keys): `Q K^T` and `P V`
      forward, `dO V^T`, `P^T dO`, `dS K` and `dS^T Q` backward;
    * the head (frozen, tied or not): logits forward and the final hidden state's gradient.
    ValueError for MLA or a mixture of experts, whose products this does not list."""
    if model.mla is not None or model.moe is not None:
        raise ValueError("step_products: lists the products of standard attention and a dense MLP; "
                         f"this model has {'MLA' if model.mla is not None else 'a mixture of experts'}")
    shapes = projections(model)
    unknown = sorted(set(targets) - set(shapes))
    if unknown:
        raise ValueError(f"step_products: targets {unknown} are not projections of this model ({sorted(shapes)})")
    R, L, r = batch * seq, model.num_layers, rank
    G, H = model.num_heads // model.num_kv_heads, model.head_dim
    products: list[Product] = []
    for name, (d_in, d_out) in shapes.items():
        # the first layer's q, k and v take their input from the frozen embedding: no gradient for it
        with_input_grad = L - 1 if name in ("q", "k", "v") else L
        products += [Product(f"{name} forward", 1, R, d_in, d_out, L),
                     Product(f"{name} input gradient", 1, R, d_out, d_in, with_input_grad)]
        if name in targets:
            products += [Product(f"{name} adapter x A", 1, R, d_in, r, L),
                         Product(f"{name} adapter (x A) B", 1, R, r, d_out, L),
                         Product(f"{name} adapter B's gradient", 1, r, R, d_out, L),
                         Product(f"{name} adapter (x A)'s gradient", 1, R, d_out, r, L),
                         Product(f"{name} adapter A's gradient", 1, d_in, R, r, L),
                         Product(f"{name} adapter input gradient", 1, R, r, d_in, with_input_grad)]
    groups, rows = batch * model.num_kv_heads, G * seq
    products += [Product("attention Q K^T", groups, rows, H, seq, L),
                 Product("attention P V", groups, rows, seq, H, L),
                 Product("attention dO V^T", groups, rows, H, seq, L),
                 Product("attention P^T dO", groups, seq, rows, H, L),
                 Product("attention dS K", groups, rows, seq, H, L),
                 Product("attention dS^T Q", groups, seq, rows, H, L),
                 Product("head forward", 1, R, model.d_model, model.vocab_size, 1),
                 Product("head input gradient", 1, R, model.vocab_size, model.d_model, 1)]
    return products


def total_flops(products: Iterable[Product]) -> int:
    return sum(p.flops for p in products)


def _timed(products: list[Product], product_call: Callable[[tuple[int, int, int, int]], Callable[[], object]],
           rounds: int) -> dict:
    """Each distinct shape's product (`product_call(shape)` gives a call that computes one, operands made)
    called once a round for `rounds` rounds after one untimed call, in turns so that the machine's drift
    falls on all alike; its fewest seconds times its count, summed over the step."""
    counts = Counter()
    for p in products:
        counts[p.shape] += p.count
    calls = {shape: product_call(shape) for shape in counts}
    best = {shape: math.inf for shape in counts}
    for call in calls.values():
        call()
    for _ in range(rounds):
        for shape, call in calls.items():
            start = time.perf_counter()
            call()
            best[shape] = min(best[shape], time.perf_counter() - start)
    rows = [{"batch": b, "m": m, "k": k, "n": n, "count": counts[(b, m, k, n)], "ms_each": 1000 * best[(b, m, k, n)],
             "gflops": 2 * b * m * k * n / best[(b, m, k, n)] / 1e9} for b, m, k, n in counts]
    floor_s = sum(best[shape] * count for shape, count in counts.items())
    flops = total_flops(products)
    return {"ms_per_step": 1000 * floor_s, "flops": flops, "gflops": flops / floor_s / 1e9, "shapes": rows}


def time_products_xla(products: list[Product], rounds: int = 5) -> dict:
    """The step's products with XLA on this machine, each distinct one alone (bfloat16 operands, float32
    sums and output, as `runtime.matmul = "bfloat16_cpu"` asks of every dot): {"ms_per_step", "flops",
    "gflops", "shapes": per shape its count, best ms and GFLOP/s}."""
    import jax
    import jax.numpy as jnp

    # a lone product as the step's are: two-dimensional, or batched over the attention's groups
    product = jax.jit(lambda a, b: jnp.einsum("...mk,...kn->...mn", a, b, preferred_element_type=jnp.float32))

    def product_call(shape):
        b, m, k, n = shape
        lead = (b,) if b > 1 else ()
        keys = jax.random.split(jax.random.PRNGKey(0))
        x = jax.random.normal(keys[0], (*lead, m, k), jnp.bfloat16)
        y = jax.random.normal(keys[1], (*lead, k, n), jnp.bfloat16)
        return lambda: product(x, y).block_until_ready()
    return _timed(products, product_call, rounds)


def time_products_torch(products: list[Product], threads: int, rounds: int = 5) -> dict:
    """`time_products_xla` for torch on `threads` threads: `torch.matmul` of bfloat16 tensors, what a linear
    layer computes under `torch.autocast("cpu", torch.bfloat16)`."""
    import torch
    torch.set_num_threads(threads)
    generator = torch.Generator().manual_seed(0)

    def product_call(shape):
        b, m, k, n = shape
        lead = (b,) if b > 1 else ()
        x = torch.randn(*lead, m, k, generator=generator).to(torch.bfloat16)
        y = torch.randn(*lead, k, n, generator=generator).to(torch.bfloat16)
        return lambda: torch.matmul(x, y)
    with torch.no_grad():
        return _timed(products, product_call, rounds)
