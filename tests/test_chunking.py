"""Chunk reads (gc_jax._chunks.rows): narrow leaves read as whole 128-element lines.

``pack`` views a leaf whose rows hold fewer than 128 elements (token ids and masks of
32 tokens) as ``[rows // per_line, 128]``, so the TPU compiler copies it unpadded;
every chunk read from the view must equal the same rows of the leaf, and the
gradients must not change.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from reference import full_batch_value_and_grad

import gc_jax
from gc_jax._chunks import rows as row_chunks


def leaves_of(tree):
    return jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, row_chunks.Lines))


@pytest.mark.parametrize(
    "shape, dtype, chunk, packed",
    [
        ((96, 32), jnp.int32, 8, True),  # 4 rows per line, chunks of 2 lines
        ((96, 4, 8), jnp.bool_, 12, True),  # rows of 32 elements, any trailing shape
        ((96, 16), jnp.float32, 24, True),
        ((96, 32), jnp.int32, 6, False),  # a chunk of 6 rows is not whole lines
        ((90, 32), jnp.int32, 8, False),  # the tail (2 rows) is not whole lines
        ((96, 3), jnp.int32, 8, False),  # 128 is not a multiple of 3
        ((96, 128), jnp.int32, 8, False),  # already a whole line
        ((96,), jnp.int32, 8, False),  # one value per row: a vector, kept
    ],
)
def test_packed_chunks_read_the_same_rows(shape, dtype, chunk, packed):
    x = jnp.arange(np.prod(shape)).reshape(shape).astype(dtype)
    plan = row_chunks.make_plan(shape[0], chunk)
    view = plan.pack({"x": x}, (False,))
    assert isinstance(view["x"], row_chunks.Lines) is packed
    take = jax.jit(lambda v, c: plan.take(v, c)["x"])
    for c in range(plan.num_body):
        np.testing.assert_array_equal(take(view, c), x[c * chunk : (c + 1) * chunk])
    tail = plan.take(view, None)["x"]
    np.testing.assert_array_equal(tail, x[plan.num_body * chunk :])


def test_a_differentiated_leaf_is_not_packed():
    plan = row_chunks.make_plan(64, 8)
    view = plan.pack((jnp.ones((64, 32)), jnp.ones((64, 32))), (True, False))
    assert [isinstance(v, row_chunks.Lines) for v in leaves_of(view)] == [False, True]


VOCAB, WIDTH = 50, 16


def token_tower(params, batch, key):
    """Embedding bag over int32 ids with a float mask (both [B, 32]: packed)."""
    del key
    h = jnp.tanh(params["emb"][batch["ids"]] @ params["w"])
    m = batch["mask"][..., None]
    return (h * m).sum(1) / jnp.maximum(m.sum(1), 1.0)


def contrastive(params, q, d):
    del params
    return gc_jax.losses.contrastive_loss(q, d, temperature=0.1)


def token_batch(key, rows, length=32):
    ids = jax.random.randint(key, (rows, length), 0, VOCAB)
    lengths = jax.random.randint(jax.random.fold_in(key, 1), (rows, 1), 4, length + 1)
    return {"ids": ids, "mask": (jnp.arange(length) < lengths).astype(jnp.float32)}


@pytest.mark.parametrize("chunk", [8, 12])  # 8: packed; 12 (3 lines) too; tail 4
def test_gradients_with_packed_token_ids_match_full_batch(chunk):
    k = jax.random.split(jax.random.key(0), 4)
    params = {
        "emb": jax.random.normal(k[0], (VOCAB, WIDTH)),
        "w": jax.random.normal(k[1], (WIDTH, WIDTH)) / 4,
    }
    q, d = token_batch(k[2], 40), token_batch(k[3], 40)
    f = jax.jit(gc_jax.cached_value_and_grad(contrastive, token_tower, chunk))
    want = full_batch_value_and_grad(contrastive, token_tower, chunk, params, q, d)
    chex.assert_trees_all_close(f(params, q, d), want, rtol=2e-5, atol=2e-6)


def one_hot_tower(params, batch, key):
    """:func:`token_tower` with a one-hot product for the lookup (sharding-agnostic)."""
    del key
    emb = jax.nn.one_hot(batch["ids"], VOCAB) @ params["emb"]
    h = jnp.tanh(emb @ params["w"])
    m = batch["mask"][..., None]
    return (h * m).sum(1) / jnp.maximum(m.sum(1), 1.0)


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_packed_token_ids_under_sharded_jit_match_full_batch(axis_type):
    """Each device's ids are viewed as lines on that device (8 devices, 8 rows each)."""
    assert jax.device_count() >= 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
    mesh = jax.make_mesh((8,), ("d",), axis_types=(axis_type,))
    k = jax.random.split(jax.random.key(1), 4)
    params = {
        "emb": jax.random.normal(k[0], (VOCAB, WIDTH)),
        "w": jax.random.normal(k[1], (WIDTH, WIDTH)) / 4,
    }
    q, d = token_batch(k[2], 64), token_batch(k[3], 64)
    want = full_batch_value_and_grad(contrastive, one_hot_tower, 4, params, q, d)
    q, d = jax.device_put((q, d), NamedSharding(mesh, P("d")))
    params = jax.device_put(params, NamedSharding(mesh, P()))
    batch_axis = "d" if axis_type == AxisType.Auto else None
    f = jax.jit(gc_jax.cached_value_and_grad(contrastive, one_hot_tower, 4, batch_axis=batch_axis))
    with jax.set_mesh(mesh):
        got = f(params, q, d)
        layout = gc_jax._layout.layout_of(q, None, batch_axis)[1]
    chex.assert_trees_all_close(got, want, rtol=2e-5, atol=2e-6)
    assert layout.shards == 8
    assert row_chunks._packable(q["ids"], row_chunks.make_plan(64, 4, layout))
