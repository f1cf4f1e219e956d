"""Embedders from the JAX model libraries, for gc_jax: the recipes of docs/model_libraries.md.

Each function builds a model with its library and returns ``(encode, params)``:
``encode(params, batch, key)`` maps a batch ``{"ids": int[rows, tokens], "mask":
int[rows, tokens]}`` (mask 1 on real tokens) to L2-normalised embeddings
``[rows, dim]``: the decoder's hidden states after its final norm, mean-pooled over
the real tokens (``gc_jax.pooling``), through a dense head. ``key`` is the dropout key
gc_jax hands each chunk (``None``: no dropout). The libraries are imported inside the
functions: each is a large install (see the page).

``benchmarks/model_libraries.py`` builds tiny random-init models with these functions
and checks ``gc_jax.cached_value_and_grad`` against ``jax.value_and_grad`` of the full
batch; docs/model_libraries.md shows them, and a test keeps the two the same.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gc_jax import pooling


def dense_head(key, width, dim):
    """The embedding head: a ``(width, dim)`` projection after pooling."""
    return jax.random.normal(key, (width, dim)) / width**0.5


# [penzai]
def penzai_embedder(config, dim, key, dropout=0.0):
    """Penzai's Llama-like transformer (``LlamalikeTransformerConfig``) as an embedder."""
    from penzai import pz
    from penzai.models.transformer.variants import llamalike_common

    model = llamalike_common.build_llamalike_transformer(config, init_base_rng=key)
    layers = list(model.body.sublayers[:-1])  # the LM head dropped, the final norm kept
    if dropout:
        layers.insert(1, pz.nn.StochasticDropout(drop_rate=dropout))
    unbound, frozen = pz.unbind_params(pz.nn.Sequential(layers), freeze=True)
    no_dropout = pz.select(unbound).at_instances_of(pz.nn.StochasticDropout)
    no_dropout = no_dropout.apply(lambda _: pz.nn.Identity())
    params = {"model": frozen, "head": dense_head(key, config.embedding_dim, dim)}

    def encode(params, batch, key):
        tokens = pz.nx.wrap(batch["ids"]).tag("batch", "seq")
        positions = pz.nx.arange("seq", tokens.named_shape["seq"])
        if key is None:
            hidden = pz.bind_variables(no_dropout, params["model"])(
                tokens, token_positions=positions
            )
        else:  # Penzai draws dropout masks from a RandomStream: one per chunk's key
            stream = pz.RandomStream.from_base_key(key)
            hidden = pz.bind_variables(unbound, params["model"])(
                tokens, token_positions=positions, random_stream=stream
            )
        hidden = hidden.untag("batch", "seq", "embedding").unwrap()
        return pooling.embed(hidden, batch["mask"], head=params["head"])

    return encode, params


# [/penzai]


# [penzai: the step]
def penzai_step(encode, params, loss_fn, chunk_size):
    """``(step, params)`` on all devices: auto mesh axes, weights sharded FSDP-style.

    Under explicit axes Penzai's lookup (a ``vmap`` over the named batch axis) cannot
    take weights sharded over the batch axis, under plain ``jit`` too: use auto axes.
    """
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import gc_jax

    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,))
    fsdp = lambda x: P("data") if x.ndim > 1 and x.shape[0] % n == 0 else P()
    params = jax.device_put(params, jax.tree.map(lambda x: NamedSharding(mesh, fsdp(x)), params))
    grad_fn = jax.jit(gc_jax.cached_value_and_grad(loss_fn, encode, chunk_size, batch_axis="data"))

    def step(params, q, d, rng=None):
        q, d = jax.device_put((q, d), NamedSharding(mesh, P("data")))
        with jax.set_mesh(mesh):
            return grad_fn(params, q, d, rng=rng)

    return step, params


# [/penzai: the step]


# [maxtext]
def maxtext_embedder(config, dim, seed=0, devices=None):
    """MaxText's decoder (any ``model_name``: Qwen3, Gemma 3, Llama) as an NNX embedder.

    Returns ``(model, mesh)``: the embedder and the mesh MaxText built from ``config``
    (its ``ici_*_parallelism``); the model's sharding constraints name that mesh.
    """
    from flax import nnx
    from flax.linen import partitioning
    from maxtext.models import models
    from maxtext.utils import maxtext_utils

    class Embedder(nnx.Module):
        def __init__(self, mesh, rngs):
            self.transformer = models.Transformer(config, mesh, quant=None, rngs=rngs)
            self.head = nnx.Param(dense_head(rngs.params(), config.emb_dim, dim))
            self.deterministic = not config.dropout_rate

        def __call__(self, ids, mask):  # gc_jax.nnx_encoder passes a dict batch as keywords
            decoder = self.transformer.decoder
            _, hidden, _ = decoder(
                shared_embedding=self.transformer.token_embedder,
                decoder_input_tokens=ids,
                decoder_positions=jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape),
                decoder_segment_ids=mask,  # padding is segment 0: attended by padding only
                deterministic=self.deterministic,
            )
            hidden = decoder.decoder_norm(hidden)  # MaxText returns it before its final norm
            return pooling.embed(hidden, mask, head=self.head[...])

    mesh = maxtext_utils.get_mesh_from_config(config, devices)
    with jax.set_mesh(mesh), partitioning.axis_rules(config.logical_axis_rules):
        return Embedder(mesh, nnx.Rngs(seed)), mesh


def maxtext_shardings(config, mesh, params):
    """MaxText's shardings: the parameters' (its logical axis rules) and the batch's."""
    import flax.linen as nn
    from flax import nnx
    from maxtext.utils import sharding

    specs = nnx.get_partition_spec(params)
    rules = config.logical_axis_rules
    return nn.logical_to_mesh_sharding(specs, mesh, rules), sharding.get_input_data_sharding(
        config, mesh
    )


# [/maxtext]


# [maxtext: the step]
def maxtext_step(config, model, mesh, loss_fn, chunk_size):
    """``(step, params)``: gc_jax's ``step(params, q, d, rng=None)`` on MaxText's mesh,
    in its logical-axis-rules context, and the parameters placed by its rules."""
    from flax import nnx
    from flax.linen import partitioning
    from jax.sharding import AxisType

    import gc_jax

    params = nnx.state(model, nnx.Param)
    param_shardings, batch_sharding = maxtext_shardings(config, mesh, params)
    auto = AxisType.Explicit not in mesh.axis_types  # shard_mode=auto: name the batch axes
    grad_fn = gc_jax.cached_value_and_grad(
        loss_fn,
        gc_jax.nnx_encoder(model),
        chunk_size,
        batch_axis=batch_sharding.spec[0] if auto else None,
    )
    grad_fn = jax.jit(grad_fn)

    def step(params, q, d, rng=None):
        q, d = jax.device_put((q, d), batch_sharding)
        with jax.set_mesh(mesh), partitioning.axis_rules(config.logical_axis_rules):
            return grad_fn(params, q, d, rng=rng)

    return step, jax.device_put(params, param_shardings)


# [/maxtext: the step]


# [gemma]
def gemma_embedder(config, dim, key):
    """The ``gemma`` library's Gemma 3 made bidirectional, as EmbeddingGemma."""
    from gemma import gm

    model = gm.nn.Transformer(config=config, dtype=jnp.float32)
    ids = jnp.ones((1, 4), jnp.int32)
    params = {
        "model": model.init(key, ids)["params"],
        "head": dense_head(key, config.embed_dim, dim),
    }

    def encode(params, batch, key):
        ids, mask = batch["ids"], batch["mask"].astype(bool)
        every_token_sees_every_real_token = jnp.broadcast_to(
            mask[:, None, :], (*ids.shape, ids.shape[1])
        )
        out = model.apply(
            {"params": params["model"]},
            ids,
            attention_mask=every_token_sees_every_real_token,  # bidirectional
            return_hidden_states=True,  # after the final norm
        )
        return pooling.embed(out.hidden_states, mask, head=params["head"])

    return encode, params


def siglip_embedder(vit, dim, image_shape, key):
    """The ``gemma`` library's SigLIP vision tower (``ViTModel``, with its dropout)."""
    params = {
        "model": vit.init(key, jnp.zeros((1, *image_shape)))["params"],
        "head": dense_head(key, vit.width, dim),
    }

    def encode(params, images, key):
        rngs = {} if key is None else {"dropout": key}
        tokens = vit.apply({"params": params["model"]}, images, train=key is not None, rngs=rngs)
        return pooling.l2_normalize(tokens.mean(axis=1) @ params["head"])

    return encode, params


# [/gemma]


# [gemma: the step]
def kauldron_fsdp(params):
    """kauldron's FSDP (the ``gemma`` library's trainer): each weight's largest dimension
    that the device count divides, over its mesh of all devices (auto axes)."""
    from kauldron import kd

    shardings = kd.sharding.FSDPSharding(min_size_to_shard_mb=0)(params)
    return shardings, kd.sharding.FIRST_DIM  # the parameters', the batch's


def gemma_step(encode, params, loss_fn, chunk_size):
    """``(step, params)`` on kauldron's mesh (all devices, auto axes), FSDP weights."""
    import gc_jax

    param_shardings, batch_sharding = kauldron_fsdp(params)
    batch_axis = batch_sharding.spec[0]  # "devices"
    grad_fn = gc_jax.cached_value_and_grad(loss_fn, encode, chunk_size, batch_axis=batch_axis)
    grad_fn = jax.jit(grad_fn)

    def step(params, q, d, rng=None):
        q, d = jax.device_put((q, d), batch_sharding)
        with jax.set_mesh(batch_sharding.mesh):
            return grad_fn(params, q, d, rng=rng)

    return step, jax.device_put(params, param_shardings)


# [/gemma: the step]
