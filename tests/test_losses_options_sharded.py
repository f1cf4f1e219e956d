"""contrastive_loss's options across 8 devices, and inside gc_jax's own forms.

Gather and ring forms, dense and blockwise, under ``shard_map`` (typed and untyped),
``pmap``, sharded ``jit`` (explicit axes; auto axes with ``jax.set_mesh``): values
and gradients against the naive full-batch reference (``options_reference``); ids
and the guide's rows split like the rows they belong to. Then ``cached_value_and_grad``,
``chunked_encoder`` and ``make_train_step`` with the options as loss arguments, against
plain ``jax.value_and_grad`` of the dense loss over the whole batch.
"""

from __future__ import annotations

import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from options_reference import contrastive
from test_losses import BLOCK_TOL
from test_losses_options import data, options
from test_ring import _independent_collectives

import gc_jax
from gc_jax.losses import contrastive_loss

D, N = 8, 3  # devices, queries per device
CASES = [("gte_ids", 1), ("gist_relative", 2), ("symmetric_guided", 2), ("gist", 3),
         ("in_batch_hardness", 2), ("hard_negatives", 3)]  # fmt: skip
FORMS = [("gather", None), ("gather", 2), ("ring", None), ("ring", 2)]


@pytest.fixture(scope="module", autouse=True)
def _devices():
    if jax.device_count() < D:
        pytest.skip(f"needs {D} devices: XLA_FLAGS=--xla_force_host_platform_device_count={D}")


def _split(kw):
    """(static options, per-row arrays) of an options dict."""
    arrays = {k: v for k, v in kw.items() if k in ("query_ids", "doc_ids", "guide")}
    return {k: v for k, v in kw.items() if k not in arrays}, arrays


@functools.cache
def _case(name, k):
    x, y, arrays = data(D * N, k, seed=3)
    static, arrays = _split(options(name, arrays))
    ref = lambda x, y, t: contrastive(x, y, t, **static, **arrays)
    want = jax.jit(jax.value_and_grad(ref, (0, 1, 2)))(x, y, jnp.float32(0.6))
    return x, y, static, arrays, want


def _mesh(axis_type=AxisType.Explicit):
    return jax.make_mesh((D,), ("d",), (axis_type,))


def _put(mesh, tree):
    return jax.tree.map(lambda v: jax.device_put(v, NamedSharding(mesh, P("d"))), tree)


def _grads(loss):
    return jax.value_and_grad(loss, (0, 1, 2))


# Every case on the gather and on the ring, each form with three or more cases.
SHARD_MAP_GRID = [
    (name, k, *form)
    for i, (name, k) in enumerate(CASES)
    for form in (FORMS[i % 2], FORMS[2 + (i + 1) % 2])
]


@pytest.mark.parametrize(("name", "k", "method", "block_size"), SHARD_MAP_GRID)
def test_shard_map_matches_reference(name, k, method, block_size):
    x, y, static, arrays, want = _case(name, k)
    kw = {"block_size": block_size, "method": method, "axis_name": "d", **static}

    def per_device(x, y, t, arrays):
        return _grads(lambda x, y, t: contrastive_loss(x, y, temperature=t, **kw, **arrays))(
            x, y, t
        )

    mesh = _mesh()
    specs = (P("d"), P("d"), P(), P("d"))
    f = jax.shard_map(
        per_device, mesh=mesh, in_specs=specs, out_specs=(P(), (P("d"),) * 2 + (P(),))
    )
    got = jax.jit(f)(*_put(mesh, (x, y)), 0.6, _put(mesh, arrays))
    chex.assert_trees_all_close(got, want, **BLOCK_TOL)


@pytest.mark.parametrize(("name", "method", "block_size", "transform"), [
    ("in_batch_hardness", "ring", 2, "shard_map"),
    ("in_batch_hardness", "gather", None, "shard_map"),
    ("all_hardness_guided", "ring", None, "shard_map"),
    ("all_hardness_guided", "gather", 2, "shard_map"),
    ("in_batch_hardness", "ring", 1, "jit"),
])  # fmt: skip
def test_hardness_strength_is_differentiated(name, method, block_size, transform):
    """d loss / d alpha across devices, a replicated scalar's global gradient: jax.grad
    of the float64 reference's."""
    with jax.enable_x64(True):
        f64 = lambda v: v.astype(jnp.float64) if v.dtype.kind == "f" else v
        x, y, arrays = jax.tree.map(f64, data(D * N, 2, seed=3))
        static, arrays = _split(options(name, arrays))
        alpha = static.pop("hardness_strength")
        ref = lambda a: contrastive(x, y, 0.6, hardness_strength=a, **static, **arrays)
        want = jax.grad(ref)(alpha)
        # Scalars as float64 arrays: under sharded jit a Python float becomes float32.
        t, alpha = np.float64(0.6), np.float64(alpha)
        kw = {"block_size": block_size, "method": method, "temperature": t, **static}
        grad = lambda x, y, a, arrays: jax.grad(
            lambda a: contrastive_loss(x, y, hardness_strength=a, **kw, **arrays)
        )(a)
        mesh = _mesh()
        if transform == "shard_map":
            kw["axis_name"] = "d"
            specs = (P("d"), P("d"), P(), P("d"))
            grad = jax.shard_map(grad, mesh=mesh, in_specs=specs, out_specs=P())
        got = jax.jit(grad)(*_put(mesh, (x, y)), alpha, _put(mesh, arrays))
        chex.assert_trees_all_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("transform", ["pmap", "shard_map_untyped"])
def test_untyped_forms_match_reference(transform):
    """pmap and shard_map(check_vma=False): the temperature's gradient summed by hand."""
    x, y, static, arrays, (value, (dx, dy, dt)) = _case("gist_relative", 2)
    kw = {"block_size": 2, "method": "ring", "axis_name": "d", "docs_per_query": 2, **static}

    def per_device(x, y, t, arrays):
        loss = lambda x, y, t: contrastive_loss(x, y, temperature=t, **kw, **arrays)
        value, (dx, dy, dt) = _grads(loss)(x, y, t)
        return value, (dx, dy, jax.lax.psum(dt, "d"))

    if transform == "pmap":
        split = lambda v: v.reshape(D, -1, *v.shape[1:])
        f = jax.pmap(per_device, axis_name="d", in_axes=(0, 0, None, 0))
        got = f(split(x), split(y), 0.6, jax.tree.map(split, arrays))
        flat = lambda v: v.reshape(-1, *v.shape[2:])
        got = (got[0][0], (flat(got[1][0]), flat(got[1][1]), got[1][2][0]))
    else:
        mesh = _mesh()
        specs = (P("d"), P("d"), P(), P("d"))
        f = jax.shard_map(per_device, mesh=mesh, in_specs=specs,
                          out_specs=(P(), (P("d"), P("d"), P())), check_vma=False)  # fmt: skip
        got = jax.jit(f)(*_put(mesh, (x, y)), 0.6, _put(mesh, arrays))
    chex.assert_trees_all_close(got, (value, (dx, dy, dt)), **BLOCK_TOL)


@pytest.mark.parametrize(("method", "block_size"), FORMS)
def test_sharded_jit_explicit_axes(method, block_size):
    """Rows, ids and the guide's rows sharded in their types, no axis_name, no mesh set."""
    x, y, static, arrays, want = _case("gte_ids", 2) if block_size else _case("gist", 3)
    kw = {"block_size": block_size, "method": method, **static}

    def run(x, y, t, arrays):
        return _grads(lambda x, y, t: contrastive_loss(x, y, temperature=t, **kw, **arrays))(
            x, y, t
        )

    mesh = _mesh()
    got = jax.jit(run)(*_put(mesh, (x, y)), 0.6, _put(mesh, arrays))
    chex.assert_trees_all_close(got, want, **BLOCK_TOL)
    _, (dx, dy, _) = got
    assert jax.typeof(dx).sharding.spec[0] == jax.typeof(dy).sharding.spec[0] == "d"


def test_auto_axes_ring_with_axis_name_of_the_mesh():
    x, y, static, arrays, want = _case("symmetric_guided", 2)
    kw = {"block_size": 2, "method": "ring", "axis_name": "d", **static}

    def run(x, y, t, arrays):
        return _grads(lambda x, y, t: contrastive_loss(x, y, temperature=t, **kw, **arrays))(
            x, y, t
        )

    mesh = _mesh(AxisType.Auto)
    with jax.set_mesh(mesh):
        f = jax.jit(run)
        args = (*_put(mesh, (x, y)), 0.6, _put(mesh, arrays))
        got, hlo = f(*args), f.lower(*args).compile().as_text()
    chex.assert_trees_all_close(got, want, **BLOCK_TOL)
    assert "collective-permute" in hlo and "all-gather" not in hlo


@pytest.mark.parametrize("name", ["doc_ids", "guide"])
def test_a_replicated_option_under_shard_map_is_refused(name):
    """Ids (or a guide's rows) replicated while the rows are split: refused, named. Of
    this device's length they would silently pair with other devices' rows."""
    x, y, _, arrays, _ = _case("gist_relative", 2)
    mesh = _mesh()
    loss = lambda x, y, a: contrastive_loss(x, y, axis_name="d", method="ring", **{name: a})
    f = jax.shard_map(loss, mesh=mesh, in_specs=(P("d"), P("d"), P()), out_specs=P())
    local = jax.tree.map(lambda v: v[: len(v) // D], arrays[name])
    with pytest.raises(ValueError, match=rf"{name}\S* is replicated over mesh axes \['d'\]"):
        jax.jit(f)(*_put(mesh, (x, y)), local)
    side = "y" if name == "doc_ids" else "x"
    with pytest.raises(ValueError, match=f"across devices: this device's rows, split like {side}"):
        jax.jit(f)(*_put(mesh, (x, y)), arrays[name])  # whole: the wrong length


@pytest.mark.parametrize("directions", ["gte_ids", "gist_relative"])
def test_ring_collectives_are_ordered_and_the_process_lives(directions):
    """Both rings (documents, then queries), their ppermutes and the scalars' psum:
    no two top-level collectives (or loops holding them) of the step independent."""
    static, arrays = _split(options(directions, data(8 * 64, 2, seed=1)[2]))
    x, y, _ = data(8 * 64, 2, seed=1, dim=16)
    mesh = _mesh()
    step = lambda m: jax.jit(_grads(lambda x, y, t, a: contrastive_loss(
        x, y, temperature=t, method=m, block_size=32, **static, **a)))  # fmt: skip
    args = (*_put(mesh, (x, y)), jnp.float32(0.6), _put(mesh, arrays))
    ring = step("ring")
    hlo = ring.lower(*args).compile().as_text()
    pairs = _independent_collectives(hlo)
    collective = lambda op: not op.startswith("while") or _loop_has_collectives(hlo, op)
    assert pairs and not [p for p in pairs if all(map(collective, p))], pairs
    want = step("gather")(*args)
    for _ in range(3):
        got = jax.block_until_ready(ring(*args))
    chex.assert_trees_all_close(jax.device_get(got), jax.device_get(want), rtol=1e-5, atol=1e-6)


def _loop_has_collectives(hlo: str, op: str) -> bool:
    """Whether the body of the entry computation's loop ``op`` holds a collective."""
    body = re.search(rf"%{re.escape(op)} = .* body=%([\w.\-]+)", hlo)[1]
    start = hlo.index(f"%{body} ")
    text = hlo[start : hlo.index("\n}", start)]
    return "collective-permute(" in text or "all-reduce(" in text


# Inside gc_jax: the options as loss arguments, the encoders' gradient through them.


def _encode(p, x, key):
    return jnp.tanh(x @ p[0])


def _loss(p, q, d, **kw):
    return contrastive_loss(q, d, temperature=p[1], **kw)


def _problem(name, k=2):
    """Parameters, inputs, the options' arrays, and the full-batch dense value and grad."""
    params = (jnp.eye(5) + 0.1, jnp.float32(0.5))
    q, d, arrays = data(D * N, k, seed=4)
    static, arrays = _split(options(name, arrays))
    full = lambda p: _loss(p, _encode(p, q, None), _encode(p, d, None), **static, **arrays)
    return params, q, d, static, arrays, jax.jit(jax.value_and_grad(full))(params)


def test_cached_value_and_grad_under_shard_map_ring():
    params, q, d, static, arrays, want = _problem("gist_relative")
    loss = functools.partial(_loss, block_size=2, method="ring", axis_name="d", **static)
    step = gc_jax.cached_value_and_grad(loss, _encode, chunk_size=2, axis_name="d")
    mesh = _mesh()
    f = jax.shard_map(lambda p, q, d, a: step(p, q, d, **a), mesh=mesh,
                      in_specs=(P(), P("d"), P("d"), P("d")), out_specs=(P(), P()))  # fmt: skip
    got = jax.jit(f)(params, *_put(mesh, (q, d)), _put(mesh, arrays))
    chex.assert_trees_all_close(got, want, **BLOCK_TOL)


def test_chunked_encoder_auto_axes_with_options():
    params, q, d, static, arrays, want = _problem("gte_ids")
    enc = gc_jax.chunked_encoder(_encode, 2, batch_axis="d")

    def full(p, q, d, arrays):
        reps = (enc(p, q, None), enc(p, d, None))
        return _loss(p, *reps, block_size=2, method="ring", axis_name="d", **static, **arrays)

    mesh = _mesh(AxisType.Auto)
    with jax.set_mesh(mesh):
        got = jax.jit(jax.value_and_grad(full))(params, *_put(mesh, (q, d)), _put(mesh, arrays))
    chex.assert_trees_all_close(got, want, **BLOCK_TOL)


def test_make_train_step_batch_axis_with_options():
    """Auto axes and batch_axis: the loss is told the layout; the options are loss kwargs."""
    params, q, d, static, arrays, (_, want) = _problem("symmetric_guided")
    loss = functools.partial(_loss, block_size=2, method="ring", **static)
    step = gc_jax.make_train_step(loss, _encode, 2, optimizer=optax.sgd(1.0), batch_axis="d")
    mesh = _mesh(AxisType.Auto)
    with jax.set_mesh(mesh):
        state = (params, optax.sgd(1.0).init(params))
        f = jax.jit(lambda s, q, d, a: step(s, q, d, **a))
        args = (state, *_put(mesh, (q, d)), _put(mesh, arrays))
        (new, _), metrics = f(*args)
        hlo = f.lower(*args).compile().as_text()
    got = jax.tree.map(lambda a, b: a - b, params, new)  # sgd(1): the gradient
    chex.assert_trees_all_close(got, want, **BLOCK_TOL)
    assert bool(metrics["is_finite"]) and "collective-permute" in hlo
