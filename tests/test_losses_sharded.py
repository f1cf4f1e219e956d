"""gc_jax.losses across 8 devices: pmap, shard_map (with and without vma checks), sharded jit.

Every result is compared with plain full-batch ``jax.value_and_grad`` under ``jit`` on
the concatenated batch. CI runs with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``.
"""

from __future__ import annotations

import contextlib
import functools

import chex
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from test_losses import BLOCK_TOL, CASES, TOL, _data

import gc_jax
from gc_jax.compat.functional import gather_inputs
from gc_jax.losses import clip_loss, contrastive_loss, sigmoid_loss

D = 8  # devices
N_LOCAL = 3  # rows per device


@pytest.fixture(scope="module")
def devices():
    if jax.device_count() < D:
        pytest.skip(
            f"needs {D} devices, found {jax.device_count()}: run with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={D} (as .ci/run does)"
        )
    return jax.devices()[:D]


def _mesh(devices):
    return jax.make_mesh((D,), ("d",), devices=devices)  # explicit axes (the default)


def _shard(mesh, *values):
    return [jax.device_put(v, NamedSharding(mesh, P("d"))) for v in values]


# Every loss, dense and blockwise, on 3 rows per device.

DISTRIBUTED = [  # (case, block_size, reduction)
    ("contrastive_hard_negatives", None, "mean"),
    ("contrastive_hard_negatives", 2, "mean"),
    ("clip", None, "sum"),
    ("clip", 2, "mean"),
    ("sigmoid", None, "mean"),
    ("sigmoid", 2, "sum"),
]
EVERY = tuple(range(len(DISTRIBUTED)))
SOME = (1, 2, 5)  # every loss once, dense or blockwise: for the less common transforms


def _batches(configs):
    k = lambda i: CASES[DISTRIBUTED[i][0]][2]
    return [_data(D * N_LOCAL, D * N_LOCAL * k(i), seed=1) for i in configs]


@functools.cache
def _full_batch():
    """Full-batch value and gradients (x, y, every scalar) of every config, in one jit."""

    def run(batches):
        return [
            jax.value_and_grad(
                functools.partial(CASES[c][0], reduction=r), tuple(range(2 + len(CASES[c][3])))
            )(x, y, *map(jnp.float32, CASES[c][3]))
            for (c, _, r), (x, y) in zip(DISTRIBUTED, batches, strict=True)
        ]

    return jax.jit(run)(_batches(EVERY))


def _per_device(scalars: str, configs):
    """Each device's value and gradients of ``configs``, written as a user would.

    ``scalars``: ``"replicated"`` (shard_map with vma typing: a replicated scalar's
    gradient comes back summed over devices, typed replicated), ``"varying"`` (cast to
    varying first, as ``cached_value_and_grad`` does with its parameters, then one
    ``psum``), or ``"untyped"`` (``pmap``, ``check_vma=False``: ``psum`` by hand).
    """

    def run(batches):
        out = []
        for i, (x, y) in zip(configs, batches, strict=True):
            case, block_size, reduction = DISTRIBUTED[i]
            loss, _, k, values = CASES[case]
            s = [jnp.float32(v) for v in values]
            if scalars == "varying":
                s = gc_jax._distributed.to_varying(s, "d")
            kw = {"docs_per_query": k} if k > 1 else {}  # said: required under pmap
            fn = functools.partial(
                loss, reduction=reduction, block_size=block_size, axis_name="d", **kw
            )
            value, (dx, dy, *ds) = jax.value_and_grad(fn, tuple(range(2 + len(s))))(x, y, *s)
            if scalars != "replicated":
                ds = jax.lax.psum(ds, "d")
            out.append((value, (dx, dy, *ds)))
        return out

    return run


def _out_specs(configs):
    """The loss and the scalars' gradients replicated, the rows' gradients sharded."""
    num_scalars = lambda i: len(CASES[DISTRIBUTED[i][0]][3])
    return [(P(), (P("d"), P("d"), *[P()] * num_scalars(i))) for i in configs]


@pytest.mark.parametrize(
    ("scalars", "check_vma", "configs"),
    [("replicated", True, EVERY), ("varying", True, SOME), ("untyped", False, SOME)],
)
def test_shard_map_replicated_loss_matches_full_batch(devices, scalars, check_vma, configs):
    """``out_specs=P()`` for the loss, with and without shard_map's replication check."""
    mesh = _mesh(devices)
    f = jax.shard_map(
        _per_device(scalars, configs),
        mesh=mesh,
        in_specs=(P("d"),),
        out_specs=_out_specs(configs),
        check_vma=check_vma,
    )
    got = jax.jit(f)([_shard(mesh, x, y) for x, y in _batches(configs)])
    chex.assert_trees_all_close(got, [_full_batch()[i] for i in configs], **TOL)


def test_pmap_matches_full_batch(devices):
    f = jax.pmap(_per_device("untyped", SOME), axis_name="d", devices=devices)
    per_device = lambda v: v.reshape(D, -1, v.shape[-1])
    got = f([(per_device(x), per_device(y)) for x, y in _batches(SOME)])
    flat = lambda g: g.reshape(-1, g.shape[-1])
    got = [(value, (flat(dx), flat(dy), *ds)) for value, (dx, dy, *ds) in got]
    every = lambda v: jnp.full(D, v)  # the value and the scalars' gradients, on every device
    want = [_full_batch()[i] for i in SOME]
    want = [(every(v), (dx, dy, *map(every, ds))) for v, (dx, dy, *ds) in want]
    chex.assert_trees_all_close(got, want, **TOL)


def test_shard_map_none_reduction_is_local_rows(devices):
    x, y = _data(D * N_LOCAL, D * N_LOCAL * 2, seed=3)
    mesh = _mesh(devices)
    f = jax.shard_map(
        functools.partial(contrastive_loss, reduction="none", block_size=2, axis_name="d"),
        mesh=mesh,
        in_specs=(P("d"), P("d")),
        out_specs=P("d"),
    )
    want = contrastive_loss(x, y, reduction="none")
    chex.assert_trees_all_close(jax.jit(f)(*_shard(mesh, x, y)), want, **TOL)


# The rule the losses rely on under shard_map, and the helpers built on it.


def test_psum_of_varying_value_transposes_to_pvary(devices):
    """Under vma typing psum(share) is replicated, and its gradient is the share's own."""
    x = jnp.arange(2.0 * D).reshape(D, 2)
    mesh = _mesh(devices)

    def per_device(x):
        total = jax.lax.psum(jnp.sum(x**2), "d")
        assert gc_jax._distributed.varying_axes(total) == ()
        return jax.value_and_grad(lambda x: jax.lax.psum(jnp.sum(x**2), "d"))(x)

    f = jax.shard_map(per_device, mesh=mesh, in_specs=P("d"), out_specs=(P(), P("d")))
    chex.assert_trees_all_close(jax.jit(f)(*_shard(mesh, x)), (jnp.sum(x**2), 2 * x))


def _mean_square(x):
    return jnp.mean(x**2)


@pytest.mark.parametrize("transform", ["shard_map", "shard_map_no_vma", "pmap"])
def test_global_loss_and_gather_inputs(devices, transform):
    """The global value everywhere (replicated under shard_map), each device its rows' grad."""
    x = jnp.sin(jnp.arange(4.0 * D)).reshape(2 * D, 2)
    share = lambda x: gc_jax.global_loss(jnp.sum(x**2) / x.size / D, "d")
    gathered = gather_inputs("d")(_mean_square)

    def per_device(x):
        return [jax.value_and_grad(f)(x) for f in (share, gathered)]

    want = [jax.value_and_grad(_mean_square)(x)] * 2
    if transform == "pmap":
        f = jax.pmap(per_device, axis_name="d", devices=devices)
        got = f(x.reshape(D, 2, 2))
        got = [(v, g.reshape(x.shape)) for v, g in got]
        want = [(jnp.full(D, v), g) for v, g in want]
    else:
        mesh = _mesh(devices)
        f = jax.shard_map(
            per_device,
            mesh=mesh,
            in_specs=P("d"),
            out_specs=[(P(), P("d"))] * 2,
            check_vma=transform == "shard_map",
        )
        got = jax.jit(f)(*_shard(mesh, x))
    chex.assert_trees_all_close(got, want, **TOL)


def test_cached_value_and_grad_with_blockwise_loss_under_shard_map(devices):
    """End to end: the core's one psum of parameter gradients gives the full-batch gradient."""
    encode = lambda p, x, key: jnp.tanh(x @ p[0])
    loss = lambda p, q, d, **kw: contrastive_loss(q, d, temperature=p[1], **kw)
    params = (jnp.eye(5) + 0.1, jnp.float32(0.5))
    q, d = _data(D * 4, D * 4, seed=4)
    full = lambda p: loss(p, encode(p, q, None), encode(p, d, None))
    want = jax.jit(jax.value_and_grad(full))(params)

    blockwise = functools.partial(loss, block_size=3, axis_name="d")
    step = gc_jax.cached_value_and_grad(blockwise, encode, chunk_size=3, axis_name="d")
    mesh = _mesh(devices)
    f = jax.shard_map(step, mesh=mesh, in_specs=(P(), P("d"), P("d")), out_specs=(P(), P()))
    chex.assert_trees_all_close(jax.jit(f)(params, *_shard(mesh, q, d)), want, **TOL)


# Plain jit over sharded rows, no axis_name.


def _every_loss(x, y, s):
    """Value and gradients of every loss, dense and blockwise (block_size=5)."""
    losses = (
        functools.partial(contrastive_loss, temperature=s),
        functools.partial(clip_loss, logit_scale=s),
        functools.partial(sigmoid_loss, logit_scale=s, logit_bias=-1.0),
    )
    return [
        jax.value_and_grad(functools.partial(f, block_size=b), (0, 1))(x, y)
        for f in losses
        for b in (None, 5)
    ]


SHARDED_JIT = [  # (axis type, spec of the rows, under jax.set_mesh)
    (AxisType.Explicit, P("data", None), False),
    (AxisType.Explicit, P("data", "model"), False),
    (AxisType.Explicit, P("data", "model"), True),
    (AxisType.Auto, P("data", "model"), False),  # the types carry no sharding: as unsharded
]


@pytest.mark.parametrize(("axis_type", "spec", "set_mesh"), SHARDED_JIT)
def test_sharded_jit_matches_unsharded(devices, axis_type, spec, set_mesh):
    """Rows sharded over a 2-D (data=4, model=2) mesh, with or without a mesh context."""
    x, y = _data(16, 16, dim=6, seed=5)
    want = jax.jit(_every_loss)(x, y, 0.5)
    mesh = jax.make_mesh((4, 2), ("data", "model"), (axis_type,) * 2, devices=devices)
    x_s, y_s = (jax.device_put(v, NamedSharding(mesh, spec)) for v in (x, y))
    with jax.set_mesh(mesh) if set_mesh else contextlib.nullcontext():
        got = jax.jit(_every_loss)(x_s, y_s, 0.5)
    chex.assert_trees_all_close(got, want, **BLOCK_TOL)
    if axis_type == AxisType.Explicit:  # the sharding is in the type: gradients keep it
        assert all(jax.typeof(g).sharding.spec == spec for _, grads in got for g in grads)


@pytest.mark.parametrize("loss", [contrastive_loss, sigmoid_loss])
def test_sharded_ring_keeps_python_float_scalars_weak_under_x64(devices, loss):
    """A Python-float temperature or scale takes the rows' dtype on the ring as elsewhere:
    float64 rows are not scored with a float32-rounded scalar, float32 rows stay float32."""
    mesh = _mesh(devices)
    args = () if loss is contrastive_loss else (0.07, -1.3)  # logit scale and bias
    kw = {"temperature": 0.07} if loss is contrastive_loss else {}
    with jax.enable_x64(True):
        for dtype, tol in ((jnp.float64, 1e-12), (jnp.float32, 1e-5)):
            x, y = (v.astype(dtype) for v in _data(16, 16, dim=6, seed=7))
            want = jax.jit(lambda x, y: loss(x, y, *args, **kw))(x, y)
            ring = jax.jit(lambda x, y: loss(x, y, *args, **kw, method="ring", block_size=2))
            got = ring(*_shard(mesh, x, y))
            assert got.dtype == dtype, (got.dtype, dtype)
            chex.assert_trees_all_close(got, want, rtol=tol, atol=0)


@pytest.mark.parametrize("method", ["gather", "ring"])
def test_a_replicated_side_under_shard_map_is_refused(method):
    """Queries split, documents replicated (``in_specs=(P("d"), P())``): the documents
    would be read as hard negatives, or gathered once per device. The types say it,
    so every loss and the core refuse it, naming the in_specs to write."""
    mesh = jax.make_mesh((4,), ("d",), devices=jax.devices()[:4])
    x = jax.device_put(jnp.ones((32, 8)), NamedSharding(mesh, P("d")))
    y = jnp.ones((32, 8))
    losses = {
        "contrastive": lambda x, y: gc_jax.losses.contrastive_loss(
            x, y, axis_name="d", method=method
        ),
        "clip": lambda x, y: gc_jax.losses.clip_loss(x, y[:8], 0.0, axis_name="d", method=method),
    }
    for loss in losses.values():
        f = jax.shard_map(loss, mesh=mesh, in_specs=(P("d"), P()), out_specs=P())
        with pytest.raises(ValueError, match=r"y is replicated over mesh axes \['d'\].*P\('d'\)"):
            jax.jit(f)(x, y)
    loss = lambda w, q, d: gc_jax.losses.contrastive_loss(q, d, axis_name="d", method=method)
    step = gc_jax.cached_value_and_grad(loss, lambda w, x, k: x @ w, 4, axis_name="d")
    step = jax.shard_map(step, mesh=mesh, in_specs=(P(), P("d"), P()), out_specs=(P(), P()))
    with pytest.raises(ValueError, match=r"inputs\[1\] is replicated .*in_specs=P\('d'\)"):
        jax.jit(step)(jnp.eye(8), x, y)
