"""The ring losses (``method="ring"``, ``gc_jax.losses._ring``) on 8 emulated devices.

Every result is compared with the dense single-device loss over the whole batch
(plain ``jax.value_and_grad`` under ``jit``), in value and in the gradients of both
sides and of every scalar: under ``shard_map`` (with and without vma typing),
``pmap``, sharded ``jit`` with explicit and auto mesh axes, and inside
``cached_value_and_grad``, ``chunked_encoder`` and ``make_train_step``. Shapes are
small: 3 query rows per device, blocks of 2 (uneven), hard negatives with k = 3.
"""

from __future__ import annotations

import functools
import re

import chex
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from test_losses import BLOCK_TOL, CASES, _data

import gc_jax
from gc_jax import _layout, losses
from gc_jax.losses import _common

D = 8
N = 3  # rows per device
RING = (  # (case, block_size, reduction): every loss, uneven blocks, and one dense ring
    ("contrastive_hard_negatives", 2, "mean"),
    ("clip", 2, "sum"),
    ("sigmoid", 2, "mean"),
    ("contrastive", None, "none"),
)


@pytest.fixture(scope="module", autouse=True)
def _devices():
    if jax.device_count() < D:
        pytest.skip(f"needs {D} devices: XLA_FLAGS=--xla_force_host_platform_device_count={D}")


def _batches(dtype=jnp.float32):
    k = lambda case: CASES[case][2]
    return [tuple(v.astype(dtype) for v in _data(D * N, D * N * k(c), seed=7)) for c, _, _ in RING]


def _scalars(case):
    return [jnp.float32(v) for v in CASES[case][3]]


def _fn(case, block, reduction, **kw):
    if kw.get("axis_name") and CASES[case][2] > 1:  # hard negatives: said (pmap needs it)
        kw["docs_per_query"] = CASES[case][2]
    return functools.partial(CASES[case][0], block_size=block, reduction=reduction, **kw)


def _value_and_grads(fn, x, y, scalars):
    if fn.keywords["reduction"] == "none":  # per-row losses: the gradient of their sum
        total = lambda *a: jnp.sum(fn(*a))
        return fn(x, y, *scalars), jax.grad(total, tuple(range(2 + len(scalars))))(x, y, *scalars)
    return jax.value_and_grad(fn, tuple(range(2 + len(scalars))))(x, y, *scalars)


@functools.cache
def _want(dtype=jnp.float32):
    """The dense single-device loss over the whole batch, in float32."""

    def run(batches):
        return [
            _value_and_grads(_fn(c, None, r), x.astype(jnp.float32), y.astype(jnp.float32),
                             _scalars(c))
            for (c, _, r), (x, y) in zip(RING, batches, strict=True)
        ]  # fmt: skip

    return jax.jit(run)(_batches(dtype))


def _per_device(psum_scalars: bool):
    def run(batches):
        out = []
        for (c, b, r), (x, y) in zip(RING, batches, strict=True):
            value, (dx, dy, *ds) = _value_and_grads(
                _fn(c, b, r, axis_name="d", method="ring"), x, y, _scalars(c)
            )
            if psum_scalars:  # untyped: each device has its share's gradient
                ds = jax.lax.psum(ds, "d")
            out.append((value, (dx, dy, *ds)))
        return out

    return run


def _out_specs():
    value = lambda r: P("d") if r == "none" else P()
    return [(value(r), (P("d"), P("d"), *[P()] * len(CASES[c][3]))) for c, _, r in RING]


def _mesh(axis_type=AxisType.Explicit):
    return jax.make_mesh((D,), ("d",), (axis_type,))


def _shard(mesh, batches):
    rows = NamedSharding(mesh, P("d"))
    return [tuple(jax.device_put(v, rows) for v in b) for b in batches]


@pytest.mark.parametrize("check_vma", [True, False])
def test_shard_map_matches_dense(check_vma):
    mesh = _mesh()
    f = jax.shard_map(
        _per_device(psum_scalars=not check_vma),
        mesh=mesh,
        in_specs=(P("d"),),
        out_specs=_out_specs(),
        check_vma=check_vma,
    )
    got = jax.jit(f)(_shard(mesh, _batches()))
    chex.assert_trees_all_close(got, _want(), **BLOCK_TOL)


def test_bfloat16_rows_match_float32_dense():
    """bf16 rows: a float32 loss close to the float32 dense one, bf16 gradients."""
    mesh = _mesh()
    f = jax.shard_map(_per_device(False), mesh=mesh, in_specs=(P("d"),), out_specs=_out_specs())
    got = jax.jit(f)(_shard(mesh, _batches(jnp.bfloat16)))
    for value, (dx, dy, *_) in got:
        assert value.dtype == jnp.float32 and dx.dtype == dy.dtype == jnp.bfloat16
    as32 = jax.tree.map(lambda v: v.astype(jnp.float32), got)
    chex.assert_trees_all_close(as32, _want(jnp.bfloat16), rtol=2e-2, atol=2e-2)


def test_pmap_matches_dense():
    f = jax.pmap(_per_device(psum_scalars=True), axis_name="d")
    split = lambda v: v.reshape(D, -1, v.shape[-1])
    got = f([tuple(map(split, b)) for b in _batches()])
    flat = lambda v: v.reshape(-1, *v.shape[2:])
    for (_, _, r), (value, grads), (want_value, want_grads) in zip(RING, got, _want(), strict=True):
        value = flat(value) if r == "none" else value
        want_value = want_value if r == "none" else jnp.full(D, want_value)
        dx, dy, *ds = grads
        want = (
            want_value,
            (want_grads[0], want_grads[1], *[jnp.full(D, g) for g in want_grads[2:]]),
        )
        chex.assert_trees_all_close((value, (flat(dx), flat(dy), *ds)), want, **BLOCK_TOL)


def _every_loss(batches, **kw):
    return [
        _value_and_grads(_fn(c, b, r, method="ring", **kw), x, y, _scalars(c))
        for (c, b, r), (x, y) in zip(RING, batches, strict=True)
    ]


def test_sharded_jit_explicit_axes():
    """Rows sharded in their types: the loss runs its ring in a shard_map of its own."""
    mesh = _mesh()
    got = jax.jit(_every_loss)(_shard(mesh, _batches()))
    chex.assert_trees_all_close(got, _want(), **BLOCK_TOL)
    for _, (dx, dy, *_) in got:  # the rows' gradients keep the rows' sharding
        assert jax.typeof(dx).sharding.spec[0] == jax.typeof(dy).sharding.spec[0] == "d"


def test_sharded_jit_auto_axes_with_axis_name_of_the_mesh():
    """Auto axes: ``axis_name`` names the mesh axis (set with jax.set_mesh) outside shard_map."""
    mesh = _mesh(AxisType.Auto)
    with jax.set_mesh(mesh):
        f = jax.jit(functools.partial(_every_loss, axis_name="d"))
        got = f(_shard(mesh, _batches()))
        hlo = f.lower(_shard(mesh, _batches())).compile().as_text()
    chex.assert_trees_all_close(got, _want(), **BLOCK_TOL)
    assert "collective-permute" in hlo


def test_tuple_axis_name():
    """A ring over two mesh axes at once (2 x 4 devices)."""
    mesh = jax.make_mesh((2, 4), ("a", "b"))
    c, b, r = RING[0]
    fn = _fn(c, b, r, axis_name=("a", "b"), method="ring")
    f = jax.shard_map(
        lambda x, y, t: _value_and_grads(fn, x, y, [t]),
        mesh=mesh,
        in_specs=(P(("a", "b")), P(("a", "b")), P()),
        out_specs=(P(), (P(("a", "b")), P(("a", "b")), P())),
    )
    rows = NamedSharding(mesh, P(("a", "b")))
    x, y = (jax.device_put(v, rows) for v in _batches()[0])
    got = jax.jit(f)(x, y, *_scalars(c))
    chex.assert_trees_all_close(got, _want()[0], **BLOCK_TOL)


# Inside gc_jax's own forms: the encoder's gradient through the ring loss.


def _encode(p, x, key):
    return jnp.tanh(x @ p[0])


def _loss(p, q, d, **kw):
    return losses.contrastive_loss(q, d, temperature=p[1], block_size=2, method="ring", **kw)


def _problem(k=3):
    params = (jnp.eye(5) + 0.1, jnp.float32(0.5))
    q, d = _data(D * N, D * N * k, seed=4)
    full = lambda p: losses.contrastive_loss(_encode(p, q, None), _encode(p, d, None),
                                             temperature=p[1])  # fmt: skip
    return params, q, d, jax.jit(jax.value_and_grad(full))(params)


def test_cached_value_and_grad_under_shard_map():
    params, q, d, want = _problem()
    step = gc_jax.cached_value_and_grad(
        functools.partial(_loss, axis_name="d"), _encode, chunk_size=2, axis_name="d"
    )
    mesh = _mesh()
    f = jax.shard_map(step, mesh=mesh, in_specs=(P(), P("d"), P("d")), out_specs=(P(), P()))
    (qs, ds), = _shard(mesh, [(q, d)])  # fmt: skip
    chex.assert_trees_all_close(jax.jit(f)(params, qs, ds), want, **BLOCK_TOL)


def test_make_train_step_auto_axes_batch_axis():
    """Auto axes and batch_axis: the core tells the loss (no axis_name) how rows lie."""
    params, q, d, (_, want_grads) = _problem()
    step = gc_jax.make_train_step(_loss, _encode, 2, optimizer=optax.sgd(1.0), batch_axis="d")
    mesh = _mesh(AxisType.Auto)
    with jax.set_mesh(mesh):
        f = jax.jit(step)
        state = (params, optax.sgd(1.0).init(params))
        (new, _), _ = f(state, q, d)
        hlo = f.lower(state, q, d).compile().as_text()
    got = jax.tree.map(lambda a, b: a - b, params, new)  # sgd(1): the gradient
    chex.assert_trees_all_close(got, want_grads, **BLOCK_TOL)
    assert "collective-permute" in hlo


def test_chunked_encoder_auto_axes():
    """chunked_encoder(batch_axis=) and a loss whose axis_name names the mesh axis."""
    params, q, d, want = _problem()
    enc = gc_jax.chunked_encoder(_encode, 2, batch_axis="d")

    def full(p, q, d):
        return _loss(p, enc(p, q, None), enc(p, d, None), axis_name="d")

    mesh = _mesh(AxisType.Auto)
    with jax.set_mesh(mesh):
        got = jax.jit(jax.value_and_grad(full))(params, q, d)
    chex.assert_trees_all_close(got, want, **BLOCK_TOL)


# The compiled step: collective-permutes, and no all-gather of a batch-sized array.

_GATHER = re.compile(r"= ([a-z0-9]+)\[([0-9,]*)\][^ ]* all-gather(?:-start)?\(")


def _gathered_shapes(hlo):
    return [tuple(int(d) for d in dims.split(",") if d) for _, dims in _GATHER.findall(hlo)]


@pytest.mark.parametrize("method", ["ring", "gather"])
def test_hlo_ring_permutes_and_gathers_nothing_batch_sized(method):
    mesh = _mesh()
    got = jax.jit(functools.partial(_every_loss_method, method=method))
    hlo = got.lower(_shard(mesh, _batches())).compile().as_text()
    batch_sized = [s for s in _gathered_shapes(hlo) if s and s[0] >= D * N]
    if method == "ring":
        assert "collective-permute" in hlo
        assert not batch_sized and "all-gather" not in hlo
    else:  # the check itself sees the gather form's all-gathers
        assert batch_sized


def _every_loss_method(batches, method):
    return [
        _value_and_grads(_fn(c, b, r, method=method), x, y, _scalars(c))
        for (c, b, r), (x, y) in zip(RING[:3], batches[:3], strict=True)
    ]


# The automatic rule and the errors.


def test_auto_picks_the_ring_above_the_gather_limit():
    """Traced only (no compile): a pod-sized batch rings, a small one gathers."""
    mesh = _mesh()

    def primitives(rows):
        x = jax.ShapeDtypeStruct((rows, 64), jnp.bfloat16, sharding=NamedSharding(mesh, P("d")))
        loss = functools.partial(losses.contrastive_loss, block_size=4096)
        return str(jax.make_jaxpr(jax.grad(loss, (0, 1)))(x, x))

    limit_rows = _common.GATHER_BYTES // (64 * 2)
    big, small = primitives(2 * limit_rows), primitives(limit_rows)
    assert "ppermute" in big and "all_gather" not in big
    assert "ppermute" not in small


def test_errors_name_the_argument():
    x = jnp.ones((4, 2))
    with pytest.raises(ValueError, match="method must be one of"):
        losses.clip_loss(x, x, 0.0, method="rings")
    with pytest.raises(ValueError, match="axis_name='nope' is neither an axis"):
        jax.jit(functools.partial(losses.contrastive_loss, axis_name="nope"))(x, x)


def test_forward_mode_is_not_supported_and_says_so():
    """A custom_vjp: jax.jvp raises (documented in gc_jax.losses); jax.grad works."""
    x = jnp.ones((4, 2))
    loss = functools.partial(losses.contrastive_loss, block_size=2)
    with pytest.raises(TypeError, match="custom_vjp"):
        jax.jvp(loss, (x, x), (x, x))
    jax.jvp(losses.contrastive_loss, (x, x), (x, x))  # the dense gather form is plain JAX


def test_layout_is_read_once_per_kind():
    """``_layout.rows_layout``: single, explicit (types), manual and the core's context."""
    x = jnp.ones((16, 2))
    assert _layout.rows_layout(x) == _layout.SINGLE
    mesh = _mesh()
    xs = jax.device_put(x, NamedSharding(mesh, P("d")))
    kinds = []
    jax.jit(lambda v: kinds.append(_layout.rows_layout(v)) or v)(xs)
    assert kinds[0].kind == "explicit" and kinds[0].axes == "d" and kinds[0].shards == D
    auto = _layout.Layout("auto", "d", mesh.abstract_mesh, D)
    with _layout.batch_layout(auto):
        assert _layout.rows_layout(x) == auto
    jax.shard_map(
        lambda v: kinds.append(_layout.rows_layout(v, "d")) or v,
        mesh=mesh,
        in_specs=P("d"),
        out_specs=P("d"),
    )(xs)
    assert kinds[-1] == _layout.Layout("manual", "d", None, D)


def _independent_collectives(hlo: str) -> list[tuple[str, str]]:
    """Pairs of top-level collectives or loops of the compiled step that neither
    depends on (XLA:CPU may run those concurrently)."""
    entry = hlo[hlo.index("\nENTRY") :]
    operands = {}
    for line in entry.splitlines()[1:]:
        found = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = .*?[\w\-]+\((.*?)\)(?:,|$)", line)
        if found:
            operands[found[1]] = re.findall(r"%([\w.\-]+)", found[2])

    @functools.cache
    def ancestors(name):
        return frozenset(operands.get(name, ())).union(
            *(ancestors(o) for o in operands.get(name, ()))
        )

    ops = [n for n in operands if n.startswith(("while", "all-reduce", "ppermute"))]
    return [
        (a, b) for a in ops for b in ops
        if a < b and a not in ancestors(b) and b not in ancestors(a)
    ]  # fmt: skip


@pytest.mark.parametrize("loss", ["clip", "contrastive"])
def test_ring_collectives_are_ordered_and_the_process_lives(loss):
    """The ring losses under sharded jit: every collective ordered, exact, run again.

    XLA:CPU in jaxlib 0.10 expands optimization barriers away, runs independent
    collectives concurrently and keys them all alike (op_id=1): with the clip loss's
    two rings side by side, or a ring's last ppermute beside the scalars' psum,
    devices entered them in different orders and the process aborted on a
    rendezvous timeout (4 of 6 runs of 4 calls). Now no two top-level collectives
    (or loops holding them) of the compiled step are independent.
    """
    mesh = jax.make_mesh((8,), ("d",))
    rows = jax.random.normal(jax.random.key(0), (2, 1024, 64))
    x, y = (jax.device_put(r, NamedSharding(mesh, P("d"))) for r in rows)
    fn = {
        "clip": lambda x, y, t, m: losses.clip_loss(x, y, t, method=m, block_size=128),
        "contrastive": lambda x, y, t, m: losses.contrastive_loss(
            x, y, temperature=jnp.exp(t), method=m, block_size=128
        ),
    }[loss]
    step = lambda m: jax.jit(jax.value_and_grad(lambda x, y, t: fn(x, y, t, m), (0, 1, 2)))
    ring = step("ring")
    hlo = ring.lower(x, y, 0.0).compile().as_text()
    assert not _independent_collectives(hlo), _independent_collectives(hlo)
    want = step("gather")(x, y, 0.0)
    for _ in range(4):
        got = jax.block_until_ready(ring(x, y, 0.0))
    chex.assert_trees_all_close(jax.device_get(got), jax.device_get(want), rtol=1e-5, atol=1e-6)
