"""A Qwen3-shaped decoder embedder trained on a pod: FSDP, LoRA and the ring loss.

The recipe of ``docs/large_embedders.md``, end to end, in plain JAX:

* **FSDP.** Every weight matrix is sharded over the batch's mesh axis (``data``); each
  layer gathers its own weights just before use (``gather``) and its activations are
  constrained by rows (``by_rows``), as JAX FSDP code is written. Under gc_jax such an
  encoder sees each chunk as a sharded global array (``encoder_view="global"``, which
  ``"auto"`` picks), so the weights travel layer by layer, chunk by chunk, and never
  sit whole on a chip.
* **Layers in a ``scan`` with per-layer remat** (``jax.checkpoint``): one layer's
  activations of one chunk are alive in the backward pass.
* **LoRA** on the attention's query and value projections. The frozen base is
  bfloat16 and closed over by the encoder; only the adapters are differentiated,
  so the gradient accumulator and the optimizer state are the adapters' size.
* **The ring loss** (``contrastive_loss(..., method="ring")``): each device scores its
  queries against every device's documents, passed round the ring, so no chip holds
  the whole batch's representations.

Run the tiny configuration on CPU (8 emulated devices)::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/large_embedder.py

On a pod, ``--size 0.6b|4b|8b`` picks the Qwen3 shape and ``--data`` the devices on the
batch axis (default: all of them); the batch is ``--batch`` query-document pairs with
one hard negative each, ``--query-tokens`` and ``--doc-tokens`` long.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gc_jax


@dataclasses.dataclass(frozen=True)
class Size:
    """A Qwen3 shape: layers, width, query and key-value heads, MLP width, vocabulary."""

    layers: int
    dim: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int = 151_936
    head_dim: int = 128
    rank: int = 16  # LoRA rank


SIZES = {
    "tiny": Size(2, 64, 4, 2, 128, vocab=512, head_dim=16, rank=4),
    "0.6b": Size(28, 1024, 16, 8, 3072),
    "4b": Size(36, 2560, 32, 8, 9728),
    "8b": Size(36, 4096, 32, 8, 12288),
}


def base_shapes(size: Size, dtype: Any = jnp.bfloat16) -> dict:
    """The frozen base: embeddings, then every layer's weights stacked on a leading axis."""
    L, D, F, hd = size.layers, size.dim, size.ffn, size.head_dim
    s = lambda *shape: jax.ShapeDtypeStruct(shape, dtype)
    layers = {
        "attn_norm": s(L, D), "mlp_norm": s(L, D), "q_norm": s(L, hd), "k_norm": s(L, hd),
        "wq": s(L, D, size.heads * hd), "wk": s(L, D, size.kv_heads * hd),
        "wv": s(L, D, size.kv_heads * hd), "wo": s(L, size.heads * hd, D),
        "gate": s(L, D, F), "up": s(L, D, F), "down": s(L, F, D),
    }  # fmt: skip
    return {"embed": s(size.vocab, D), "layers": layers, "norm": s(D)}


def lora_shapes(size: Size, dtype: Any = jnp.float32) -> dict:
    """LoRA adapters on the query and value projections: ``w + a @ b`` per layer."""
    L, D, r, hd = size.layers, size.dim, size.rank, size.head_dim
    s = lambda *shape: jax.ShapeDtypeStruct(shape, dtype)
    return {
        "q_a": s(L, D, r), "q_b": s(L, r, size.heads * hd),
        "v_a": s(L, D, r), "v_b": s(L, r, size.kv_heads * hd),
    }  # fmt: skip


def fsdp_spec(path: str, shape: tuple[int, ...], axis: str = "data") -> P:
    """FSDP: the embedding table split along its width (151,936 rows divide by 128 but
    not 256); a layer's ``[layers, a, b]`` matrix along its larger dimension; norms
    replicated."""
    if "norm" in path:
        return P()
    if len(shape) == 2:
        return P(None, axis)
    return P(None, axis, None) if shape[1] >= shape[2] else P(None, None, axis)


def init(size: Size, key: jax.Array) -> tuple[dict, dict]:
    """Random base weights (norms at one) and LoRA adapters (``b`` at zero)."""
    paths, treedef = jax.tree_util.tree_flatten_with_path(base_shapes(size))
    keys = jax.random.split(key, len(paths) + 2)

    def one(path, s, k):
        if "norm" in jax.tree_util.keystr(path):
            return jnp.ones(s.shape, s.dtype)
        return (jax.random.normal(k, s.shape) / np.sqrt(s.shape[-2])).astype(s.dtype)

    base = treedef.unflatten([one(p, s, k) for (p, s), k in zip(paths, keys, strict=False)])
    lora = {n: jnp.zeros(s.shape, s.dtype) for n, s in lora_shapes(size).items()}
    lora["q_a"] = jax.random.normal(keys[-2], lora["q_a"].shape) / np.sqrt(size.dim)
    lora["v_a"] = jax.random.normal(keys[-1], lora["v_a"].shape) / np.sqrt(size.dim)
    return base, lora


def base_specs(size: Size, axis: str = "data") -> dict:
    """The FSDP partition spec of every base weight."""
    spec = lambda path, s: fsdp_spec(jax.tree_util.keystr(path), s.shape, axis)
    return jax.tree_util.tree_map_with_path(spec, base_shapes(size))


# -- the sharding a FSDP encoder writes ------------------------------------------------


def _mesh_kind(x: jax.Array) -> str:
    """``"explicit"`` (the sharding is in the type), ``"auto"`` (a mesh is set) or ``""``
    (no mesh, or inside ``shard_map``: each device's own rows, gc_jax's local view)."""
    context = jax.sharding.get_abstract_mesh()
    if not context.empty and jax.sharding.AxisType.Manual in context.axis_types:
        return ""
    mesh = getattr(jax.typeof(x).sharding, "mesh", None)
    if mesh is not None and not mesh.empty and jax.sharding.AxisType.Explicit in mesh.axis_types:
        return "explicit"
    return "" if jax.sharding.get_abstract_mesh().empty else "auto"


def gather(w: jax.Array) -> jax.Array:
    """A layer's weight, whole on every device (an all-gather of its FSDP shards)."""
    kind = _mesh_kind(w)
    if kind == "explicit":
        return jax.sharding.reshard(w, P())
    return jax.lax.with_sharding_constraint(w, P()) if kind == "auto" else w


def by_rows(h: jax.Array, axis: str = "data") -> jax.Array:
    """Activations split by rows over the batch axis."""
    kind = _mesh_kind(h)
    if kind == "explicit":
        return jax.sharding.reshard(h, P(axis))
    return jax.lax.with_sharding_constraint(h, P(axis)) if kind == "auto" else h


# -- the model -------------------------------------------------------------------------


def _rms(x: jax.Array, scale: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)


def _rope(x: jax.Array, positions: jax.Array) -> jax.Array:
    half = x.shape[-1] // 2
    freq = 1e6 ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions[..., None, None].astype(jnp.float32) * freq  # [b, t, 1, half]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def _layer(size: Size, causal: bool, mask: jax.Array, positions: jax.Array, dtype: Any):
    """One decoder block, weights gathered on entry (``w``: base and LoRA of the layer)."""
    b_t = mask.shape
    attend = mask[:, None, None, :]
    if causal:
        attend = attend & jnp.tril(jnp.ones((b_t[1], b_t[1]), bool))[None, None]

    def block(h, w):
        base, lora = jax.tree.map(lambda x: gather(x.astype(dtype)), w)
        x = _rms(h, base["attn_norm"])
        q, k, v = x @ base["wq"], x @ base["wk"], x @ base["wv"]
        if lora is not None:
            q = q + (x @ lora["q_a"]) @ lora["q_b"]
            v = v + (x @ lora["v_a"]) @ lora["v_b"]
        heads = lambda t, n: t.reshape(*b_t, n, size.head_dim)
        q = _rope(_rms(heads(q, size.heads), base["q_norm"]), positions)
        k = _rope(_rms(heads(k, size.kv_heads), base["k_norm"]), positions)
        o = jax.nn.dot_product_attention(q, k, heads(v, size.kv_heads), mask=attend)
        h = by_rows(h + o.reshape(*b_t, -1) @ base["wo"])
        x = _rms(h, base["mlp_norm"])
        h = h + (jax.nn.silu(x @ base["gate"]) * (x @ base["up"])) @ base["down"]
        return by_rows(h), None

    return jax.checkpoint(block)  # per-layer remat


def encode(size: Size, base: dict, lora: dict | None, batch: dict, key: Any = None, *,
           causal: bool = True, pooling: str = "last",
           dtype: Any = jnp.bfloat16) -> jax.Array:  # fmt: skip
    """``batch["token_ids"]``, ``batch["padding_mask"]`` (``[rows, tokens]``, right
    padded) to L2-normalised float32 embeddings: the last real token's state (causal,
    as Qwen3-Embedding) or the mean over real tokens. Layers compute in ``dtype``;
    ``lora=None``: the base alone."""
    del key  # no dropout
    ids, mask = batch["token_ids"], batch["padding_mask"].astype(bool)
    table = gather(base["embed"].astype(dtype))
    if _mesh_kind(ids) == "explicit":
        h = table.at[ids].get(out_sharding=jax.typeof(ids).sharding.spec)
    else:
        h = by_rows(table[ids])
    positions = jnp.cumsum(mask, axis=1) - 1
    layers = (base["layers"], lora)
    h, _ = jax.lax.scan(_layer(size, causal, mask, positions, dtype), h, layers)
    h = _rms(h, gather(base["norm"])).astype(jnp.float32)
    if pooling == "last":
        last = jnp.sum(mask, axis=1) - 1
        pooled = jnp.take_along_axis(h, last[:, None, None], axis=1)[:, 0]
    else:
        pooled = jnp.sum(h * mask[..., None], 1) / jnp.maximum(mask.sum(1, keepdims=True), 1)
    return pooled / jnp.linalg.norm(pooled, axis=-1, keepdims=True)


def loss_fn(lora: dict, queries: jax.Array, docs: jax.Array, *, method: str = "ring") -> jax.Array:
    """InfoNCE over the batch, one positive and one hard negative per query (``docs``
    interleaved as ``[positive_0, negative_0, positive_1, ...]``)."""
    del lora
    return gc_jax.losses.contrastive_loss(queries, docs, temperature=0.05, method=method)


def train_step(size: Size, chunk: int, optimizer: optax.GradientTransformation, *,
               causal: bool = True, pooling: str = "last", method: str = "ring"):  # fmt: skip
    """``step(base, lora, opt_state, queries, docs) -> (lora, opt_state, loss)``: one
    gradient-cached step of the adapters; the frozen base is closed over."""

    def step(base, lora, opt_state, queries, docs):
        enc = functools.partial(encode, size, base, causal=causal, pooling=pooling)
        grad_fn = gc_jax.cached_value_and_grad(
            functools.partial(loss_fn, method=method), enc, chunk_size=chunk
        )
        loss, grads = grad_fn(lora, queries, docs)
        updates, opt_state = optimizer.update(grads, opt_state, lora)
        return optax.apply_updates(lora, updates), opt_state, loss

    return step


def batch(size: Size, pairs: int, query_tokens: int, doc_tokens: int, seed: int) -> tuple:
    """Random pairs with lengths varied: documents are a query's tokens plus others."""
    rng = np.random.default_rng(seed)
    q_ids = rng.integers(1, size.vocab, (pairs, query_tokens))
    d_ids = rng.integers(1, size.vocab, (2 * pairs, doc_tokens))
    d_ids[0::2, :query_tokens] = q_ids  # the positive contains the query
    q_len = rng.integers(query_tokens // 2, query_tokens + 1, pairs)
    d_len = rng.integers(doc_tokens // 2, doc_tokens + 1, 2 * pairs)
    d_len[0::2] = np.maximum(d_len[0::2], query_tokens)
    make = lambda ids, n: {
        "token_ids": jnp.asarray(ids, jnp.int32),
        "padding_mask": jnp.asarray(np.arange(ids.shape[1]) < n[:, None], jnp.int32),
    }
    return make(q_ids, q_len), make(d_ids, d_len)


def place(mesh: jax.sharding.Mesh, base: dict, lora: dict, q: dict, d: dict) -> tuple:
    """Base weights FSDP-sharded, adapters replicated, the batch split by rows."""
    specs = base_specs(SIZES["tiny"])  # the same tree for every size
    base = jax.tree.map(lambda w, s: jax.device_put(w, NamedSharding(mesh, s)), base, specs)
    lora = jax.device_put(lora, NamedSharding(mesh, P()))
    rows = NamedSharding(mesh, P("data"))
    return base, lora, jax.device_put(q, rows), jax.device_put(d, rows)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--data", type=int, default=None, help="devices on the batch axis")
    parser.add_argument("--batch", type=int, default=64, help="query-document pairs")
    parser.add_argument("--chunk", type=int, default=2, help="rows per device per chunk")
    parser.add_argument("--query-tokens", type=int, default=16)
    parser.add_argument("--doc-tokens", type=int, default=32)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--pooling", choices=["last", "mean"], default="last")
    parser.add_argument("--bidirectional", action="store_true")
    args = parser.parse_args(argv)
    size = SIZES[args.size]
    devices = args.data or jax.device_count()
    mesh = jax.make_mesh((devices,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    base, lora = init(size, jax.random.key(0))
    opt = optax.adamw(1e-2)
    step = jax.jit(
        train_step(size, args.chunk, opt, causal=not args.bidirectional, pooling=args.pooling)
    )
    q, d = batch(size, args.batch, args.query_tokens, args.doc_tokens, seed=0)
    base, lora, q, d = place(mesh, base, lora, q, d)
    opt_state = opt.init(lora)
    print(f"{args.size}: {args.batch} pairs on {devices} devices, chunks of {args.chunk} rows")
    for i in range(args.steps):
        start = time.perf_counter()
        lora, opt_state, loss = step(base, lora, opt_state, q, d)
        print(f"step {i}: loss {float(loss):.4f} ({time.perf_counter() - start:.2f} s)")


if __name__ == "__main__":
    main()
