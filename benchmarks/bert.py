"""A BERT-base-sized dual encoder in plain JAX, for the extreme-batch benchmarks.

Two towers (DPR-style: one for queries, one for passages), each a post-LayerNorm
Transformer encoder: token and position embeddings, ``layers`` blocks of multi-head
self-attention and a GELU MLP, mean pooling over the attention mask. Parameters are
float32; compute runs in ``compute_dtype`` (bfloat16 by default), so the towers'
outputs (the representations) are bfloat16. Weights are random: the benchmarks
measure memory and time, not accuracy.

Inputs per tower: ``{"ids": int32[B, T], "mask": bool[B, T]}``; masks are prefixes
(right padding), as ``random_batch`` makes them.

Attention (``BertConfig.attention``) is ``jax.nn.dot_product_attention``'s default XLA
implementation unless asked otherwise: ``"cudnn"`` is cuDNN's fused (flash) attention,
GPU only, bfloat16 or float16 compute, the padding given as key lengths; ``"xla_remat"``
is the XLA implementation under ``jax.checkpoint``, so that only its inputs are saved
for the backward pass (what a fused kernel keeps, on any backend).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

import gc_jax

Params = dict[str, Any]


@dataclass(frozen=True)
class BertConfig:
    """Sizes of one tower (defaults: BERT-base) and of the inputs."""

    vocab: int = 30522
    layers: int = 12
    width: int = 768
    heads: int = 12
    mlp: int = 3072
    query_len: int = 32
    passage_len: int = 128
    compute_dtype: Any = jnp.bfloat16
    attention: str = "xla"

    def __post_init__(self):
        if self.attention not in ATTENTION:
            raise ValueError(f"attention={self.attention!r}: expected one of {ATTENTION}")
        if self.attention == "cudnn" and jnp.dtype(self.compute_dtype).itemsize != 2:
            raise ValueError(
                f"attention='cudnn' with compute_dtype={jnp.dtype(self.compute_dtype).name}: "
                "cuDNN's fused attention takes bfloat16 or float16; use attention='xla' "
                "(or 'xla_remat') for float32"
            )

    def num_params(self) -> int:
        """Parameters of one tower."""
        per_layer = 4 * self.width**2 + 2 * self.width * self.mlp + 9 * self.width + self.mlp
        emb = (self.vocab + self.passage_len) * self.width + 2 * self.width
        return emb + self.layers * per_layer

    def describe(self) -> str:
        return (
            f"two towers of {self.layers} layers, width {self.width}, {self.heads} heads, "
            f"MLP {self.mlp} ({self.num_params() / 1e6:.1f} M float32 parameters each), "
            f"{jnp.dtype(self.compute_dtype).name} compute, {self.attention} attention; queries "
            f"{self.query_len} and passages {self.passage_len} tokens (int32 ids, bool mask)"
        )


ATTENTION = ("xla", "cudnn", "xla_remat")

# A 2-layer model of the same shape, for quick runs and tests on a CPU.
TINY = BertConfig(vocab=512, layers=2, width=64, heads=4, mlp=128, query_len=8, passage_len=16)


def _dense(key, n_in, n_out):
    return {"w": jax.random.normal(key, (n_in, n_out)) * 0.02, "b": jnp.zeros((n_out,))}


def _norm(width):
    return {"scale": jnp.ones((width,)), "bias": jnp.zeros((width,))}


def init_tower(cfg: BertConfig, key: jax.Array) -> Params:
    keys = jax.random.split(key, 2 + cfg.layers)
    layers = []
    for k in keys[2:]:
        kq, ko, k1, k2 = jax.random.split(k, 4)
        layers.append(
            {
                "qkv": _dense(kq, cfg.width, 3 * cfg.width),
                "out": _dense(ko, cfg.width, cfg.width),
                "norm1": _norm(cfg.width),
                "mlp_in": _dense(k1, cfg.width, cfg.mlp),
                "mlp_out": _dense(k2, cfg.mlp, cfg.width),
                "norm2": _norm(cfg.width),
            }
        )
    return {
        "tokens": jax.random.normal(keys[0], (cfg.vocab, cfg.width)) * 0.02,
        "positions": jax.random.normal(keys[1], (cfg.passage_len, cfg.width)) * 0.02,
        "norm": _norm(cfg.width),
        "layers": layers,
    }


def init_params(cfg: BertConfig, key: jax.Array) -> Params:
    kq, kp = jax.random.split(key)
    return {"query": init_tower(cfg, kq), "passage": init_tower(cfg, kp)}


def abstract_params(cfg: BertConfig) -> Params:
    """``ShapeDtypeStruct``s of the parameters (nothing allocated)."""
    return jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))


def _layer_norm(p, x):
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = ((x32 - mean) ** 2).mean(-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + 1e-12) * p["scale"] + p["bias"]
    return y.astype(x.dtype)


def _apply(p, x, dtype):
    return x @ p["w"].astype(dtype) + p["b"].astype(dtype)


def _xla_attention(q, k, v, mask):
    return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None, None, :])


def _attention(kind: str, q, k, v, mask):
    if kind == "cudnn":  # the padding as key lengths: the same values for a prefix mask
        lengths = mask.sum(-1, dtype=jnp.int32)
        return jax.nn.dot_product_attention(
            q, k, v, key_value_seq_lengths=lengths, implementation="cudnn"
        )
    if kind == "xla_remat":
        return jax.checkpoint(_xla_attention)(q, k, v, mask)
    return _xla_attention(q, k, v, mask)


def block(cfg: BertConfig, p: Params, h: jax.Array, mask: jax.Array) -> jax.Array:
    """One post-LN Transformer block."""
    b, t, _ = h.shape
    dt, hd = cfg.compute_dtype, cfg.width // cfg.heads
    q, k, v = jnp.split(_apply(p["qkv"], h, dt), 3, axis=-1)
    q, k, v = (a.reshape(b, t, cfg.heads, hd) for a in (q, k, v))
    att = _attention(cfg.attention, q, k, v, mask)
    h = _layer_norm(p["norm1"], h + _apply(p["out"], att.reshape(b, t, cfg.width), dt))
    mlp = _apply(p["mlp_out"], jax.nn.gelu(_apply(p["mlp_in"], h, dt)), dt)
    return _layer_norm(p["norm2"], h + mlp)


def tower(cfg: BertConfig, p: Params, batch: dict, key=None, remat_layers: bool = False):
    """Mean-pooled representations ``[B, width]`` in ``cfg.compute_dtype``."""
    del key  # no dropout: the benchmarks compare memory and time
    ids, mask = batch["ids"], batch["mask"]
    t = ids.shape[1]
    h = p["tokens"][ids].astype(cfg.compute_dtype) + p["positions"][:t].astype(cfg.compute_dtype)
    h = _layer_norm(p["norm"], h)
    run = jax.checkpoint(block, static_argnums=0) if remat_layers else block
    for layer in p["layers"]:
        h = run(cfg, layer, h, mask)
    m = mask[..., None].astype(h.dtype)
    return (h * m).sum(1) / jnp.maximum(m.sum(1), 1)


def query_tower(cfg: BertConfig, remat_layers: bool = False):
    return lambda params, batch, key: tower(cfg, params["query"], batch, key, remat_layers)


def passage_tower(cfg: BertConfig, remat_layers: bool = False):
    return lambda params, batch, key: tower(cfg, params["passage"], batch, key, remat_layers)


def loss_fn(block_size: int | None):
    def loss(params, q, p):
        del params
        return gc_jax.losses.contrastive_loss(q, p, temperature=0.05, block_size=block_size)

    return loss


def abstract_batch(cfg: BertConfig, rows: int, length: int) -> dict:
    return {
        "ids": jax.ShapeDtypeStruct((rows, length), jnp.int32),
        "mask": jax.ShapeDtypeStruct((rows, length), jnp.bool_),
    }


def random_batch(cfg: BertConfig, rows: int, length: int, key: jax.Array) -> dict:
    ids = jax.random.randint(key, (rows, length), 0, cfg.vocab, jnp.int32)
    lengths = jax.random.randint(jax.random.fold_in(key, 1), (rows, 1), length // 4, length + 1)
    return {"ids": ids, "mask": jnp.arange(length)[None, :] < lengths}


def steps(cfg: BertConfig, chunk: int, block_size: int | None = 4096) -> dict:
    """``step(params, queries, passages) -> (loss, grads)`` for every variant compared."""
    loss = loss_fn(block_size)

    def full(remat_layers):
        q_enc, p_enc = query_tower(cfg, remat_layers), passage_tower(cfg, remat_layers)
        total = lambda params, q, p: loss(params, q_enc(params, q, None), p_enc(params, p, None))
        return jax.value_and_grad(total)

    encoders = [query_tower(cfg), passage_tower(cfg)]
    return {
        "gc_jax": gc_jax.cached_value_and_grad(loss, encoders, chunk),
        "full batch": full(False),
        "per-layer remat": full(True),
    }
