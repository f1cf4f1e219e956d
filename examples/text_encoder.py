"""A BERT-style transformer sentence encoder in Flax NNX.

One implementation serves both models of the example: a tiny encoder trained from
scratch, and all-MiniLM-L6-v2 (a 6-layer BERT) with its pretrained weights (see
``minilm.py``). It follows Hugging Face's ``BertModel`` exactly (post-layer-norm
blocks, exact-erf GELU, learned absolute positions and token types), and the sentence
embedding is sentence-transformers' recipe: the mean of the last hidden states over real
(unmasked) tokens, L2-normalised.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from gc_jax import packing


@dataclass(frozen=True)
class EncoderConfig:
    """Sizes of the encoder; field names follow Hugging Face's ``BertConfig``."""

    vocab_size: int
    hidden_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    intermediate_size: int = 512
    max_position_embeddings: int = 128
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_attention_heads


class Embeddings(nnx.Module):
    """Word + position + token-type embeddings, then layer norm and dropout."""

    def __init__(self, config: EncoderConfig, *, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.02)
        width = config.hidden_size
        self.word_embeddings = nnx.Embed(config.vocab_size, width, embedding_init=init, rngs=rngs)
        self.position_embeddings = nnx.Embed(
            config.max_position_embeddings, width, embedding_init=init, rngs=rngs
        )
        self.token_type_embeddings = nnx.Embed(
            config.type_vocab_size, width, embedding_init=init, rngs=rngs
        )
        self.layer_norm = nnx.LayerNorm(width, epsilon=config.layer_norm_eps, rngs=rngs)
        self.dropout = nnx.Dropout(config.hidden_dropout_prob, rngs=rngs)

    def __call__(
        self, input_ids: jax.Array, token_type_ids: jax.Array, positions: jax.Array | None = None
    ) -> jax.Array:
        if positions is None:
            positions = jnp.arange(input_ids.shape[-1])
        x = (
            self.word_embeddings(input_ids)
            + self.position_embeddings(positions)
            + self.token_type_embeddings(token_type_ids)
        )
        return self.dropout(self.layer_norm(x))


class SelfAttention(nnx.Module):
    """Multi-head self-attention with separate query/key/value projections (as in BERT)."""

    def __init__(self, config: EncoderConfig, *, rngs: nnx.Rngs):
        width = config.hidden_size
        dense = lambda: nnx.Linear(width, width, kernel_init=_kernel_init, rngs=rngs)
        self.num_heads = config.num_attention_heads
        self.query, self.key, self.value, self.output = dense(), dense(), dense(), dense()
        self.dropout = nnx.Dropout(config.attention_probs_dropout_prob, rngs=rngs)

    def __call__(self, x: jax.Array, keep: jax.Array) -> jax.Array:
        """``keep``: which keys each query may attend to, broadcast to ``[..., heads, q, k]``."""
        *batch, length, width = x.shape
        heads = lambda y: y.reshape(*batch, length, self.num_heads, -1)
        q, k, v = heads(self.query(x)), heads(self.key(x)), heads(self.value(x))
        scores = jnp.einsum("...qhd,...khd->...hqk", q, k) / jnp.sqrt(q.shape[-1]).astype(x.dtype)
        # Hugging Face adds the dtype's minimum to masked keys; a large finite value
        # keeps rows that are all padding finite too.
        scores = jnp.where(keep, scores, jnp.finfo(scores.dtype).min)
        weights = self.dropout(jax.nn.softmax(scores, axis=-1))
        context = jnp.einsum("...hqk,...khd->...qhd", weights, v)
        return self.output(context.reshape(*batch, length, width))


class Layer(nnx.Module):
    """One post-layer-norm transformer block."""

    def __init__(self, config: EncoderConfig, *, rngs: nnx.Rngs):
        width, eps = config.hidden_size, config.layer_norm_eps
        self.attention = SelfAttention(config, rngs=rngs)
        self.attention_norm = nnx.LayerNorm(width, epsilon=eps, rngs=rngs)
        self.intermediate = nnx.Linear(
            width, config.intermediate_size, kernel_init=_kernel_init, rngs=rngs
        )
        self.output = nnx.Linear(
            config.intermediate_size, width, kernel_init=_kernel_init, rngs=rngs
        )
        self.output_norm = nnx.LayerNorm(width, epsilon=eps, rngs=rngs)
        self.dropout = nnx.Dropout(config.hidden_dropout_prob, rngs=rngs)

    def __call__(self, x: jax.Array, keep: jax.Array) -> jax.Array:
        x = self.attention_norm(x + self.dropout(self.attention(x, keep)))
        hidden = jax.nn.gelu(self.intermediate(x), approximate=False)
        return self.output_norm(x + self.dropout(self.output(hidden)))


class SentenceEncoder(nnx.Module):
    """Token ids to L2-normalised sentence embeddings (mean over real tokens)."""

    def __init__(self, config: EncoderConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.embeddings = Embeddings(config, rngs=rngs)
        self.layers = nnx.List([Layer(config, rngs=rngs) for _ in range(config.num_hidden_layers)])

    def hidden_states(
        self,
        input_ids: jax.Array,
        attention_mask: jax.Array,
        token_type_ids: jax.Array | None = None,
        **packed: jax.Array,
    ) -> jax.Array:
        """The last layer's hidden states, ``[..., length, hidden_size]``; ``packed``: a
        ``TokenPacking``'s keys (``segment_ids``, ``position_ids``, ``segment_starts``)."""
        if token_type_ids is None:
            token_type_ids = jnp.zeros_like(input_ids)
        chunk = {"input_ids": input_ids, "attention_mask": attention_mask, **packed}
        if packing.is_packed(chunk):
            keep, positions = packing.attention_mask(chunk), packing.positions(chunk)
        else:  # [..., heads, queries, keys]
            keep, positions = attention_mask[..., None, None, :].astype(bool), None
        x = self.embeddings(input_ids, token_type_ids, positions)
        for layer in self.layers:
            x = layer(x, keep)
        return x

    def __call__(
        self,
        input_ids: jax.Array,
        attention_mask: jax.Array,
        token_type_ids: jax.Array | None = None,
        **packed: jax.Array,
    ) -> jax.Array:
        """Sentence embeddings, ``[..., hidden_size]``, each of unit L2 norm; with a
        ``TokenPacking``'s keys (``packed``), one per slot, ``[lines * segments, ...]``."""
        hidden = self.hidden_states(input_ids, attention_mask, token_type_ids, **packed)
        chunk = {"attention_mask": attention_mask, **packed}
        if packing.is_packed(chunk):
            return normalize(packing.mean_pool(hidden, chunk))
        return normalize(mean_pool(hidden, attention_mask))


def _kernel_init(key: jax.Array, shape, dtype=jnp.float32) -> jax.Array:
    return nnx.initializers.normal(0.02)(key, shape, dtype)


def mean_pool(hidden: jax.Array, attention_mask: jax.Array) -> jax.Array:
    """Mean of ``hidden`` over the positions where ``attention_mask`` is 1."""
    mask = attention_mask[..., None].astype(hidden.dtype)
    count = jnp.maximum(mask.sum(axis=-2), 1e-9)  # sentence-transformers' clamp
    return (hidden * mask).sum(axis=-2) / count


def normalize(x: jax.Array, eps: float = 1e-12) -> jax.Array:
    """Rows scaled to unit L2 norm (``torch.nn.functional.normalize``)."""
    return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), eps)
