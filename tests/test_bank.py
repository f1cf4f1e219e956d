"""The representation bank (``Bank``, ContAccum/MoCo): extra negatives without gradient.

Every form (dense, blockwise; gather and ring across 8 devices, under ``shard_map``
and sharded ``jit``) against a naive float64 reference: the softmax over the current
batch's columns and the bank's, the bank a constant, its masks decided pair by pair
in Python loops (the ids; empty slots). Then the bank in the train state through
``make_train_step``, updated as the loss's aux, against full-batch ``jax.grad``.
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
from options_reference import GTE, keep_masks

import gc_jax
from gc_jax.losses import Bank, contrastive_loss, init_bank, update_bank

D, N, STEPS, DIM = 8, 2, 3, 4  # devices, queries per device, bank slots, width
TOL = {"rtol": 2e-4, "atol": 2e-5}  # float32 tiles against float64
CASES = {  # name: (k, options, ids, bank steps written)
    "plain": (1, {}, False, 2),
    "gte_ids": (2, {"directions": GTE}, True, 4),
    "symmetric_ids": (1, {"directions": ("query_to_doc", "doc_to_query"),
                          "partition_mode": "per_direction"}, True, 1),
    "in_batch_hardness": (2, {"hardness_mode": "in_batch_negatives",
                              "hardness_strength": 2.0}, False, 3),
}  # fmt: skip
FORMS = [(None, None), (None, 3), ("gather", None), ("gather", 1), ("ring", None), ("ring", 1)]


def _bank_masks(n, k, directions, qid, did, bqid, bdid, live):
    """Per direction, the bank's columns kept: ``[n, bank columns]`` booleans."""
    same = lambda a, i, b, j: a is not None and bool(np.all(a[i] == b[j]))
    nb = len(live)  # bank queries, each with k bank documents
    keep = {}
    for d in directions:
        docs = d.endswith("_doc")
        kept = np.zeros((n, nb * k if docs else nb), bool)
        for i in range(n):
            for j in range(kept.shape[1]):
                e = j // k if docs else j  # the bank query the column belongs to
                if docs:  # the positive's id again, or a positive of a duplicate query
                    drop = same(did, i * k, bdid, j) or (j % k == 0 and same(qid, i, bqid, e))
                else:  # a duplicate query, or a query with the same positive
                    drop = same(qid, i, bqid, e) or same(did, i * k, bdid, e * k)
                kept[i, j] = live[e] and not drop
        keep[d] = kept
    return keep


def reference(x, y, t, bank, *, directions=("query_to_doc",), partition_mode="joint",
              query_ids=None, doc_ids=None, hardness_mode=None, hardness_strength=0.0):  # fmt: skip
    """The loss over ``[batch ++ bank]`` columns, the bank a constant: naive, whole batch."""
    n, k = len(x), len(y) // len(x)
    bx = jax.lax.stop_gradient(jnp.asarray(bank.queries).reshape(-1, x.shape[1]))
    by = jax.lax.stop_gradient(jnp.asarray(bank.docs).reshape(-1, x.shape[1]))
    live = np.repeat((np.arange(STEPS) < int(bank.count))[None], len(bank.queries), 0).ravel()
    flat = lambda v, rows: None if v is None else np.asarray(v).reshape(rows, -1)
    qid, did = flat(query_ids, n), flat(doc_ids, n * k)
    bqid, bdid = flat(bank.query_ids, len(bx)), flat(bank.doc_ids, len(by))
    keep = keep_masks(n, k, directions, qid, did, None, "absolute", 0.0)
    bank_keep = _bank_masks(n, k, directions, qid, did, bqid, bdid, live)
    p = y[::k]
    rows = {"query": x, "doc": p}
    cols = {"query": (x, bx), "doc": (y, by)}
    logits = {}
    for d in directions:
        r, c = d.split("_to_")
        here, banked = (rows[r] @ v.T / t for v in cols[c])
        if d == "query_to_doc" and hardness_mode is not None:
            own = np.arange(n * k)[None] // k == np.arange(n)[:, None]
            chosen = {"hard_negatives": own & (np.arange(n * k)[None] % k != 0),
                      "in_batch_negatives": ~own}[hardness_mode]  # fmt: skip
            boost = lambda s: hardness_strength * jax.lax.stop_gradient(s * t)
            here = here + jnp.where(chosen, boost(here), 0)
            if hardness_mode != "hard_negatives":
                banked = banked + boost(banked)
        logits[d] = jnp.concatenate(
            [jnp.where(keep[d], here, -jnp.inf), jnp.where(bank_keep[d], banked, -jnp.inf)], 1
        )
    positive = jnp.sum(x * p, axis=1) / t
    if partition_mode == "joint":
        log_z = jax.nn.logsumexp(jnp.concatenate(list(logits.values()), 1), axis=1)
    else:
        log_z = sum(jax.nn.logsumexp(v, axis=1) for v in logits.values()) / len(logits)
    return jnp.mean(log_z - positive)


@functools.cache
def _case(name):
    """Rows, ids and a bank written ``written`` times (ids drawn from few values: the bank
    and the batch share some), and the float64 reference's value and gradients."""
    k, static, with_ids, written = CASES[name]
    rng = np.random.default_rng(7)
    n = D * N
    draw = lambda rows: rng.normal(size=(rows, DIM)).astype(np.float32)
    ids = lambda rows: rng.integers(0, 5, (rows, 2)).astype(np.int32) if with_ids else None
    kw = {"query_ids": ids(n), "doc_ids": ids(n * k)} if with_ids else {}
    shape = {f: jax.ShapeDtypeStruct(v.shape, v.dtype) for f, v in kw.items()}
    bank = init_bank(STEPS, draw(n), draw(n * k), **shape)
    for _ in range(written):
        bank_ids = {f: ids(len(v)) for f, v in kw.items()}
        bank = update_bank(bank, draw(n), draw(n * k), **bank_ids)
    x, y = draw(n), draw(n * k)
    with jax.enable_x64(True):
        to64 = lambda tree: jax.tree.map(lambda v: np.asarray(v, np.float64), tree)
        bank64 = bank._replace(queries=to64(bank.queries), docs=to64(bank.docs))
        f = jax.value_and_grad(
            lambda x, y, t: reference(x, y, t, bank64, **static, **kw), (0, 1, 2)
        )
        want = jax.tree.map(np.asarray, f(*to64((x, y)), np.float64(0.6)))
    return x, y, bank, static, kw, want


def _mesh(axis_type=AxisType.Explicit):
    return jax.make_mesh((D,), ("d",), (axis_type,))


def _put(mesh, tree, spec=None):
    sharding = NamedSharding(mesh, P("d") if spec is None else spec)
    return jax.tree.map(lambda v: jax.device_put(v, sharding), tree)


def _sharded(mesh, bank):
    """The bank placed like the batch: rows split over the devices, its count replicated."""
    return _put(mesh, bank._replace(count=None))._replace(count=_put(mesh, bank.count, P()))


# Every case on one device, on the gather and on the ring; every form with two cases.
GRID = [(name, *FORMS[2 * m + (i + m) % 2]) for i, name in enumerate(CASES) for m in range(3)]


@pytest.mark.parametrize(("name", "method", "block_size"), GRID)
def test_matches_the_float64_reference(name, method, block_size):
    """One device (dense, blockwise), and 8 devices under shard_map (gather, ring)."""
    if method is not None and jax.device_count() < D:
        pytest.skip(f"needs {D} devices")
    x, y, bank, static, ids, want = _case(name)
    kw = {"temperature": 0.6, "block_size": block_size, **static}
    grads = lambda f: jax.value_and_grad(f, (0, 1, 2))
    if method is None:
        loss = lambda x, y, t, bank, ids: contrastive_loss(
            x, y, bank=bank, **kw | {"temperature": t}, **ids
        )
        got = jax.jit(grads(loss))(x, y, 0.6, bank, ids)
    else:
        kw |= {"method": method, "axis_name": "d"}

        def per_device(x, y, t, bank, ids):
            loss = lambda x, y, t: contrastive_loss(x, y, bank=bank, **kw | {"temperature": t},
                                                    **ids)  # fmt: skip
            return grads(loss)(x, y, t)

        mesh = _mesh()
        by_ids = P("d") if ids else None
        specs = (P("d"), P("d"), P(), Bank(P("d"), P("d"), by_ids, by_ids, P()), P("d"))
        f = jax.shard_map(per_device, mesh=mesh, in_specs=specs,
                          out_specs=(P(), (P("d"), P("d"), P())))  # fmt: skip
        got = jax.jit(f)(*_put(mesh, (x, y)), 0.6, _sharded(mesh, bank), _put(mesh, ids))
    chex.assert_trees_all_close(got, want, **TOL)


@pytest.mark.parametrize(("method", "block_size"), [(None, 3), ("ring", 1)])
def test_hardness_strength_is_differentiated(method, block_size):
    """d loss / d alpha with the bank's columns boosted too: the float64 reference's."""
    if method is not None and jax.device_count() < D:
        pytest.skip(f"needs {D} devices")
    x, y, bank, static, _, _ = _case("in_batch_hardness")
    static = dict(static)
    alpha = static.pop("hardness_strength")
    with jax.enable_x64(True):
        to64 = lambda tree: jax.tree.map(lambda v: np.asarray(v, np.float64), tree)
        bank64 = bank._replace(queries=to64(bank.queries), docs=to64(bank.docs))
        ref = lambda a: reference(*to64((x, y)), 0.6, bank64, hardness_strength=a, **static)
        want = np.asarray(jax.grad(ref)(np.float64(alpha)))
    kw = {"temperature": 0.6, "block_size": block_size, **static}
    grad = lambda x, y, a, bank: jax.grad(
        lambda a: contrastive_loss(x, y, bank=bank, hardness_strength=a, **kw)
    )(a)
    if method is None:
        got = jax.jit(grad)(x, y, alpha, bank)
    else:
        kw |= {"method": method, "axis_name": "d"}
        mesh = _mesh()
        specs = (P("d"), P("d"), P(), Bank(P("d"), P("d"), None, None, P()))
        grad = jax.shard_map(grad, mesh=mesh, in_specs=specs, out_specs=P())
        got = jax.jit(grad)(*_put(mesh, (x, y)), alpha, _sharded(mesh, bank))
    assert abs(float(want)) > 1e-2
    chex.assert_trees_all_close(got, want, **TOL)


@pytest.mark.parametrize("method", ["gather", "ring"])
def test_sharded_jit_explicit_axes(method):
    """Rows, ids and the bank sharded in their types: no axis_name, no shard_map."""
    if jax.device_count() < D:
        pytest.skip(f"needs {D} devices")
    x, y, bank, static, ids, want = _case("gte_ids")
    kw = {"temperature": 0.6, "block_size": 1, "method": method, **static}

    def run(x, y, t, bank, ids):
        loss = lambda x, y, t: contrastive_loss(x, y, bank=bank, **kw | {"temperature": t}, **ids)
        return jax.value_and_grad(loss, (0, 1, 2))(x, y, t)

    mesh = _mesh()
    got = jax.jit(run)(*_put(mesh, (x, y)), 0.6, _sharded(mesh, bank), _put(mesh, ids))
    chex.assert_trees_all_close(got, want, **TOL)


def test_the_cases_mask_bank_entries_by_ids_and_slots():
    """The reference cases are not vacuous: ids drop some live bank entries, and a bank
    written fewer times than it has slots has empty ones."""
    _, y, bank, _, ids, _ = _case("gte_ids")
    n, k = D * N, len(y) // (D * N)
    flat = lambda v: np.asarray(v).reshape(-1, 2)
    live = np.ones(n * STEPS, bool)
    args = (flat(bank.query_ids), flat(bank.doc_ids), live)
    masked = _bank_masks(n, k, GTE, flat(ids["query_ids"]), flat(ids["doc_ids"]), *args)
    plain = _bank_masks(n, k, GTE, None, None, *args)
    assert all(masked[d].sum() < plain[d].sum() for d in GTE)
    assert int(_case("plain")[2].count) < STEPS < int(bank.count)


def test_an_empty_bank_is_no_bank():
    x, y, _, static, ids, _ = _case("gte_ids")
    empty = init_bank(STEPS, x, y, query_ids=ids["query_ids"], doc_ids=ids["doc_ids"])
    for block_size in (None, 3):
        loss = functools.partial(contrastive_loss, temperature=0.6, block_size=block_size,
                                 **static, **ids)  # fmt: skip
        with_bank = functools.partial(loss, bank=empty)
        got = jax.jit(jax.value_and_grad(with_bank, (0, 1)))(x, y)
        want = jax.jit(jax.value_and_grad(loss, (0, 1)))(x, y)
        chex.assert_trees_all_close(got, want, **TOL)


def test_update_writes_the_oldest_slot_and_no_gradient():
    q, d = jnp.arange(8.0).reshape(2, 4), jnp.arange(16.0).reshape(4, 4)
    bank = init_bank(2, q, d)
    for s in range(3):
        bank = jax.jit(update_bank)(bank, q + s, d + s)
    chex.assert_trees_all_equal(bank.queries[:, 0], q + 2)  # slot 0: written at 0, then 2
    chex.assert_trees_all_equal(bank.docs[:, 1].reshape(4, 4), d + 1)
    grad = jax.grad(lambda q: update_bank(bank, q, d).queries.sum())(q)
    chex.assert_trees_all_equal(grad, jnp.zeros_like(q))
    assert int(bank.count) == 3


def test_errors_name_what_to_write():
    x, y = jnp.ones((4, 3)), jnp.ones((8, 3))
    ids = jnp.zeros(4, jnp.int32)
    with pytest.raises(ValueError, match=re.escape("init_bank(..., query_ids=")):
        contrastive_loss(x, y, bank=init_bank(2, x, y), query_ids=ids)
    with pytest.raises(ValueError, match="of this batch's shapes"):
        contrastive_loss(x, y, bank=init_bank(2, x[:2], y[:4]))
    with pytest.raises(TypeError, match=r"gc_jax\.losses\.Bank"):
        contrastive_loss(x, y, bank=(x, y))
    with pytest.raises(ValueError, match="steps must be a positive int"):
        init_bank(0, x, y)
    with pytest.raises(ValueError, match="pass query_ids= to update_bank"):
        update_bank(init_bank(2, x, y, query_ids=ids), x, y)


def test_the_example_trains_with_a_full_bank():
    """``examples/bank.py``, short: its bank is written every step and R@1 rises."""
    import bank as example  # examples/ (pytest's pythonpath)

    config = example.Config()
    out = example.train(config, steps=40, batch=8, chunk=4, bank_steps=4, corpus=128)
    held = example.make_pairs(config, 128, seed=10**9)
    untrained = example.recall_at_1(example.init(config, jax.random.key(0)), *held)
    assert out["bank_count"] == 40 and np.isfinite(out["loss"])
    assert out["recall_at_1"] > untrained, (out, untrained)


# The bank in the train state: the loss reads it and returns the updated one as aux.


def _encode(p, x, key):
    return jnp.tanh(x @ p)


def _loss(p, q, d, bank, **kw):
    loss = contrastive_loss(q, d, temperature=0.5, bank=bank, **kw)
    return loss, update_bank(bank, q, d)


@pytest.mark.parametrize("method", ["gather", "ring"])
def test_make_train_step_with_the_bank_as_aux(method):
    """Two steps of sgd(1) over a sharded batch: each step's gradient and bank match
    plain ``jax.grad`` of the whole batch against the reference bank."""
    if jax.device_count() < D:
        pytest.skip(f"needs {D} devices")
    rng = np.random.default_rng(3)
    batches = rng.normal(size=(2, 2, D * N, 5)).astype(np.float32)
    params = jnp.eye(5, dtype=jnp.float32) + 0.1
    loss = functools.partial(_loss, block_size=1, method=method)
    opt = optax.sgd(1.0)
    step = gc_jax.make_train_step(loss, _encode, 1, optimizer=opt, has_aux=True)

    @jax.jit
    def train(state, bank, q, d):
        state, metrics = step(state, q, d, bank=bank)
        return state, metrics["aux"]

    mesh = _mesh()
    reps = jax.ShapeDtypeStruct((D * N, 5), jnp.float32, sharding=NamedSharding(mesh, P("d")))
    state, bank = (params, opt.init(params)), init_bank(STEPS, reps, reps)  # split like reps
    assert bank.queries.sharding.spec == P("d") and bank.count.sharding.spec == P()
    want_p, want_bank = params, init_bank(STEPS, batches[0, 0], batches[0, 1])
    for q, d in batches:
        state, bank = train(state, bank, *_put(mesh, (q, d)))
        full = lambda p, q=q, d=d, b=want_bank: _loss(
            p, _encode(p, q, None), _encode(p, d, None), b
        )
        grads, want_bank = jax.grad(full, has_aux=True)(want_p)
        want_p = want_p - grads
        chex.assert_trees_all_close(state[0], want_p, **TOL)
        chex.assert_trees_all_close(jax.device_get(bank), want_bank, **TOL)
    assert jax.typeof(bank.queries).sharding.spec[0] == "d"
