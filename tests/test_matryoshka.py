"""gc_jax.losses.matryoshka: exact against the weighted sum of the loss at each width.

The reference truncates (and renormalises) by hand and sums the loss at each width,
differentiated with plain ``jax.value_and_grad``: for every loss, dense, blockwise and
ring, across 8 devices (shard_map, sharded jit), and inside cached_value_and_grad,
chunked_encoder and make_train_step.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_losses import BLOCK_TOL, TOL

import gc_jax
from gc_jax.losses import clip_loss, contrastive_loss, matryoshka, maxsim_loss, sigmoid_loss

DIMS, WEIGHTS = (16, 8, 4, 2), (1.0, 0.5, 0.25, 2.0)


def unit(v):
    """``F.normalize``: ``v / max(|v|, 1e-12)`` along the last axis."""
    return v / jnp.maximum(jnp.linalg.norm(v, axis=-1, keepdims=True), 1e-12)


def reference(loss, dims=DIMS, weights=WEIGHTS, normalize=True, argnums=(0, 1)):
    """The definition, written out: the loss at each width, truncated by hand."""

    def total(*args, **kw):
        out = 0.0
        for m, w in zip(dims, weights, strict=True):
            cut = lambda a, m=m: unit(a[..., :m]) if normalize else a[..., :m]
            args_m = [cut(a) if i in argnums else a for i, a in enumerate(args)]
            out = out + w * loss(*args_m, **kw)
        return out

    return total


def rows(n, k=1, seed=0, dim=16):
    kx, ky = jax.random.split(jax.random.key(seed))
    return jax.random.normal(kx, (n, dim)), jax.random.normal(ky, (n * k, dim))


LOSSES = {  # name: (loss of (x, y, scalar), k, scalar)
    "contrastive": (lambda x, y, t, **kw: contrastive_loss(x, y, temperature=t, **kw), 2, 0.3),
    "clip": (clip_loss, 1, float(np.log(5.0))),
    "sigmoid": (lambda x, y, s, **kw: sigmoid_loss(x, y, s, -1.0, **kw), 1, float(np.log(3.0))),
}


def value_and_grads(fn, *args, **kw):
    argnums = tuple(range(len(args)))
    return jax.jit(jax.value_and_grad(lambda *a: fn(*a, **kw), argnums))(*args)


# Every loss dense and blockwise, with and without normalising; every pair of those.
SUM_GRID = [
    (name, block_size, normalize)
    for i, name in enumerate(LOSSES)
    for block_size, normalize in (
        [(None, True), (3, False)] if i % 2 else [(None, False), (3, True)]
    )
]


@pytest.mark.parametrize(("name", "block_size", "normalize"), SUM_GRID)
def test_matches_sum_over_widths(name, block_size, normalize):
    loss, k, scalar = LOSSES[name]
    x, y = rows(7, k)
    mrl = matryoshka(loss, DIMS, weights=WEIGHTS, normalize=normalize)
    got = value_and_grads(mrl, x, y, jnp.float32(scalar), block_size=block_size)
    want = value_and_grads(reference(loss, normalize=normalize), x, y, jnp.float32(scalar))
    chex.assert_trees_all_close(got, want, **(TOL if block_size is None else BLOCK_TOL))


@pytest.mark.parametrize("block_size", [None, 3])
def test_maxsim_with_masks_passed_through(block_size):
    """Token vectors [rows, tokens, dim] are cut along dim; the masks are not cut."""
    kq, kd, km = jax.random.split(jax.random.key(1), 3)
    q, d = jax.random.normal(kq, (6, 3, 16)), jax.random.normal(kd, (12, 4, 16))
    q_mask = jnp.array([[1, 1, 0]] * 6)
    d_mask = jax.random.bernoulli(km, 0.7, (12, 4)).at[:, 0].set(True)
    loss = functools.partial(maxsim_loss, q_mask=q_mask, d_mask=d_mask, block_size=block_size)
    got = value_and_grads(matryoshka(loss, DIMS, weights=WEIGHTS), q, d, temperature=0.2)
    want = value_and_grads(reference(loss), q, d, temperature=0.2)
    chex.assert_trees_all_close(got, want, **BLOCK_TOL)


def test_default_weights_are_ones_and_per_row_losses_pass_through():
    x, y = rows(5)
    loss = functools.partial(contrastive_loss, reduction="none")
    got = matryoshka(loss, (16, 4), normalize=False)(x, y)
    assert got.shape == (5,)
    want = loss(x, y) + loss(x[:, :4], y[:, :4])
    chex.assert_trees_all_close(got, want, **TOL)


def test_widths_narrower_than_the_representation_only():
    """The full width need not be trained (sentence-transformers warns; we allow it)."""
    x, y = rows(5)
    got = matryoshka(contrastive_loss, (8, 4), normalize=False)(x, y)
    want = contrastive_loss(x[:, :8], y[:, :8]) + contrastive_loss(x[:, :4], y[:, :4])
    chex.assert_trees_all_close(got, want, **TOL)


def test_normalize_keeps_narrow_dtypes_and_zero_vectors_finite():
    x, y = (v.astype(jnp.bfloat16) for v in rows(6))
    x = x.at[0].set(0)  # a zero vector: F.normalize's eps, no NaN
    mrl = matryoshka(functools.partial(contrastive_loss, temperature=0.1), DIMS)
    value, (dx, dy) = value_and_grads(mrl, x, y)
    assert (value.dtype, dx.dtype, dy.dtype) == (jnp.float32, jnp.bfloat16, jnp.bfloat16)
    assert all(bool(jnp.all(jnp.isfinite(v))) for v in (value, dx, dy))
    wide = value_and_grads(mrl, x.astype(jnp.float32), y.astype(jnp.float32))
    chex.assert_trees_all_close(value, wide[0], rtol=2e-2)


# n_dims_per_step: a random subset of the widths per call, drawn from a key.


def test_n_dims_per_step_sums_the_drawn_widths():
    x, y = rows(6)
    loss = functools.partial(contrastive_loss, temperature=0.5, block_size=4)
    mrl = matryoshka(loss, DIMS, weights=WEIGHTS, n_dims_per_step=2)
    drawn, wants = set(), {}
    ours = jax.jit(jax.value_and_grad(lambda x, y, key: mrl(x, y, key=key), (0, 1)))  # once
    for seed in range(6):
        key = jax.random.key(seed)
        picks = [int(i) for i in jax.random.choice(key, len(DIMS), (2,), replace=False)]
        assert len(set(picks)) == 2
        drawn.add(tuple(sorted(picks)))
        if tuple(picks) not in wants:
            dims, weights = [DIMS[i] for i in picks], [WEIGHTS[i] for i in picks]
            wants[tuple(picks)] = value_and_grads(reference(loss, dims, weights), x, y)
        chex.assert_trees_all_close(ours(x, y, key), wants[tuple(picks)], **BLOCK_TOL)
    assert len(drawn) > 1  # the key decides
    every = matryoshka(loss, DIMS, weights=WEIGHTS, n_dims_per_step=len(DIMS))
    chex.assert_trees_all_close(every(x, y), reference(loss)(x, y), **BLOCK_TOL)


# Across devices: the options pass through to the loss at every width.

D = 8


@pytest.fixture(scope="module")
def mesh():
    if jax.device_count() < D:
        pytest.skip(f"needs {D} devices: XLA_FLAGS=--xla_force_host_platform_device_count={D}")
    return jax.make_mesh((D,), ("d",), devices=jax.devices()[:D])


@pytest.mark.parametrize(("name", "method"), [("contrastive", "gather"), ("clip", "ring")])
def test_shard_map_and_sharded_jit(mesh, name, method):
    loss, k, scalar = LOSSES[name]
    x, y = rows(D * 3, k, seed=2)
    s = jnp.float32(scalar)
    want = value_and_grads(reference(loss), x, y, s)
    mrl = matryoshka(loss, DIMS, weights=WEIGHTS)
    kw = {"method": method, "block_size": 2}
    per_device = jax.value_and_grad(functools.partial(mrl, axis_name="d", **kw), (0, 1, 2))
    f = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(P("d"), P("d"), P()),
        out_specs=(P(), (P("d"),) * 2 + (P(),)),
    )
    rows_sharding = NamedSharding(mesh, P("d"))
    xs, ys = (jax.device_put(v, rows_sharding) for v in (x, y))
    chex.assert_trees_all_close(jax.jit(f)(xs, ys, s), want, **BLOCK_TOL)
    got = value_and_grads(functools.partial(mrl, **kw), xs, ys, s)
    chex.assert_trees_all_close(got, want, **BLOCK_TOL)


def test_n_dims_per_step_on_the_ring_under_shard_map(mesh):
    """The drawn widths' losses (collectives inside lax.switch) with a replicated key."""
    x, y = rows(D * 2, seed=3)
    loss = functools.partial(contrastive_loss, temperature=0.5, block_size=2)
    key = jax.random.key(7)
    picks = [int(i) for i in jax.random.choice(key, len(DIMS), (3,), replace=False)]
    dims, weights = [DIMS[i] for i in picks], [WEIGHTS[i] for i in picks]
    want = value_and_grads(reference(loss, dims, weights), x, y)
    mrl = matryoshka(loss, DIMS, weights=WEIGHTS, n_dims_per_step=3)
    ring = functools.partial(mrl, axis_name="d", method="ring")
    per_device = lambda x, y, key: jax.value_and_grad(ring, (0, 1))(x, y, key=key)
    f = jax.shard_map(
        per_device, mesh=mesh, in_specs=(P("d"), P("d"), P()), out_specs=(P(), (P("d"), P("d")))
    )
    rows_sharding = NamedSharding(mesh, P("d"))
    xs, ys = (jax.device_put(v, rows_sharding) for v in (x, y))
    chex.assert_trees_all_close(jax.jit(f)(xs, ys, key), want, **BLOCK_TOL)


# Inside the gradient cache: one cache, every width.


def encode(params, x, key):
    return jnp.tanh(x @ params["w"])


def loss_fn(params, q, d, **kw):
    return contrastive_loss(q, d, temperature=params["t"], **kw)


def test_cached_value_and_grad_chunked_encoder_and_train_step():
    kx, ky, kw = jax.random.split(jax.random.key(4), 3)
    q, d = jax.random.normal(kx, (12, 10)), jax.random.normal(ky, (24, 10))
    params = {"w": jax.random.normal(kw, (10, 16)) / 3, "t": jnp.float32(0.4)}
    mrl = matryoshka(
        functools.partial(loss_fn, block_size=5), DIMS, weights=WEIGHTS, argnums=(1, 2)
    )
    full = lambda p: reference(loss_fn, argnums=(1, 2))(p, encode(p, q, None), encode(p, d, None))
    want = jax.jit(jax.value_and_grad(full))(params)

    got = jax.jit(gc_jax.cached_value_and_grad(mrl, encode, chunk_size=5))(params, q, d)
    chex.assert_trees_all_close(got, want, **BLOCK_TOL)

    enc = gc_jax.chunked_encoder(encode, chunk_size=5)
    got = jax.jit(jax.value_and_grad(lambda p: mrl(p, enc(p, q), enc(p, d))))(params)
    chex.assert_trees_all_close(got, want, **BLOCK_TOL)

    opt = optax.sgd(0.1)
    step = jax.jit(gc_jax.make_train_step(mrl, encode, 5, optimizer=opt))
    (new, _), metrics = step((params, opt.init(params)), q, d)
    chex.assert_trees_all_close(metrics["loss"], want[0], **BLOCK_TOL)
    updated = jax.tree.map(lambda p, g: p - 0.1 * g, params, want[1])
    chex.assert_trees_all_close(new, updated, **BLOCK_TOL)


def test_cached_value_and_grad_with_a_key_per_step():
    """The widths' key passes through the step's loss keywords."""
    kx, ky, kw = jax.random.split(jax.random.key(5), 3)
    q, d = jax.random.normal(kx, (8, 10)), jax.random.normal(ky, (8, 10))
    params = {"w": jax.random.normal(kw, (10, 16)) / 3, "t": jnp.float32(0.4)}
    mrl = matryoshka(loss_fn, DIMS, n_dims_per_step=1, argnums=(1, 2))
    key = jax.random.key(3)
    pick = int(jax.random.choice(key, len(DIMS), (1,), replace=False)[0])
    ref = reference(loss_fn, (DIMS[pick],), (1.0,), argnums=(1, 2))
    full = lambda p: ref(p, encode(p, q, None), encode(p, d, None))
    got = jax.jit(gc_jax.cached_value_and_grad(mrl, encode, 4))(params, q, d, key=key)
    chex.assert_trees_all_close(got, jax.jit(jax.value_and_grad(full))(params), **TOL)


def test_weights_may_be_an_array_traced_and_differentiated():
    """``weights`` as a ``[len(dims)]`` array: the same loss, and under jit its gradient."""
    x, y = rows(6)
    loss = functools.partial(contrastive_loss, temperature=0.3)
    want = value_and_grads(reference(loss), x, y)
    got = value_and_grads(matryoshka(loss, DIMS, weights=jnp.asarray(WEIGHTS)), x, y)
    chex.assert_trees_all_close(got, want, **TOL)
    total = lambda w: matryoshka(loss, DIMS, weights=w)(x, y)
    per_width = [reference(loss, (m,), (1.0,))(x, y) for m in DIMS]
    chex.assert_trees_all_close(jax.jit(jax.grad(total))(jnp.asarray(WEIGHTS)),
                                jnp.stack(per_width), **TOL)  # fmt: skip


# Validation: errors name the argument.


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"dims": ()}, "dims must be a non-empty sequence"),
        ({"dims": 64}, "dims must be a non-empty sequence"),
        ({"dims": (8, 4.0)}, "dims must hold ints"),
        ({"dims": (8, 0)}, "dims must be positive"),
        ({"dims": (4, 8)}, r"dims must decrease strictly .* pass \(8, 4\)"),
        ({"dims": (8, 8, 4)}, r"dims must decrease strictly"),
        (
            {"dims": (8, 4), "weights": (1.0,)},
            r"weights must hold one weight per width .*\(2\), got 1",
        ),
        ({"dims": (8, 4), "weights": jnp.ones(3)}, r"real array of shape \(2,\), got float32"),
        ({"dims": (8, 4), "weights": (1.0, jnp.ones(2))}, r"weights\[1\] must be a real scalar"),
        ({"dims": (8, 4), "n_dims_per_step": 0}, "n_dims_per_step must be a positive int"),
        ({"dims": (8, 4), "argnums": (-1,)}, "argnums must be the positions"),
    ],
)
def test_rejects_bad_configuration(kw, match):
    with pytest.raises(ValueError, match=match):
        matryoshka(contrastive_loss, **kw)


def test_rejects_bad_calls():
    x, y = rows(4)
    with pytest.raises(ValueError, match=r"dims=\(32, 8\) holds widths larger than argument 0"):
        matryoshka(contrastive_loss, (32, 8))(x, y)
    with pytest.raises(ValueError, match="key: pass a PRNG key"):
        matryoshka(contrastive_loss, (8, 4), n_dims_per_step=1)(x, y)
    with pytest.raises(ValueError, match="key: pass a PRNG key"):
        matryoshka(contrastive_loss, (8, 4))(x, y, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"argnums=\(1, 2\) names positional argument 2"):
        matryoshka(contrastive_loss, (8, 4), argnums=(1, 2))(x, y)
    with pytest.raises(ValueError, match=r"argument 0 .* must be a float array"):
        matryoshka(contrastive_loss, (8, 4))(jnp.ones((4, 16), jnp.int32), y)


def test_renormalised_widths_are_recomputed_not_kept():
    """The unit vectors of every width are rematerialised in the backward pass: at
    4,096 x 768 with five widths, renormalising costs at most 4.5 side-sized arrays of
    temp over ``normalize=False`` (measured 3.3 on JAX 0.12, 3.5 on 0.10; kept, they
    took 9.6 and 7.4). Compiled only (XLA:CPU's ``memory_analysis``)."""
    rows, width = 4096, 768
    shape = jax.ShapeDtypeStruct((rows, width), jnp.float32)
    loss = functools.partial(contrastive_loss, temperature=0.05, block_size=1024)

    def temp(normalize):
        mrl = matryoshka(loss, (768, 512, 256, 128, 64), normalize=normalize)
        step = jax.jit(jax.value_and_grad(mrl, (0, 1)))
        return step.lower(shape, shape).compile().memory_analysis().temp_size_in_bytes

    extra = (temp(True) - temp(False)) / (rows * width * 4)
    assert 0 <= extra <= 4.5, extra
