"""``keep=``: pass 1 keeps the VJPs of the batch's last chunks; exact for every count.

Each case is checked against plain ``jax.value_and_grad`` of the full batch under
``jax.jit``; memory is read from XLA:CPU's compiled memory analysis (no timing).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_distributed import make_params  # the same small tower

import gc_jax
from gc_jax._chunks import plan as _plan
from gc_jax.losses import contrastive_loss

TOL = {"rtol": 2e-5, "atol": 2e-6}
ROWS_Q, ROWS_D, CHUNKS = 20, 40, (3, 16)  # 7 query chunks (a short tail), 3 doc chunks
ALL = 10


def encode(params, x, key):
    h = jnp.tanh(x @ params["w1"])
    if key is not None:
        h = h * jax.random.bernoulli(key, 0.8, h.shape) / 0.8
    return h @ params["w2"]


def loss_fn(params, q, d, axis_name=None):
    return contrastive_loss(q, d, temperature=jnp.exp(params["log_temp"]), axis_name=axis_name)


def batch(rows_q=ROWS_Q, rows_d=ROWS_D):
    kq, kd = jax.random.split(jax.random.key(1))
    return jax.random.normal(kq, (rows_q, 5)), jax.random.normal(kd, (rows_d, 5))


def full_batch(params, q, d):
    total = lambda p, q, d: loss_fn(p, encode(p, q, None), encode(p, d, None))
    return jax.jit(jax.value_and_grad(total))(params, q, d)


@pytest.mark.parametrize("keep", [0, 1, 2, 4, 8, ALL])
def test_matches_full_batch(keep):
    """Queries and docs of different chunk counts; ``keep`` spans both at 4 and more."""
    grad_fn = jax.jit(gc_jax.cached_value_and_grad(loss_fn, encode, CHUNKS, keep=keep))
    want = full_batch(make_params(), *batch())
    chex.assert_trees_all_close(grad_fn(make_params(), *batch()), want, **TOL)


def test_dropout_replayed_for_every_count():
    """The chunks' keys do not depend on ``keep``: every count gives the same step."""
    rng = jax.random.key(7)
    want = jax.jit(gc_jax.cached_value_and_grad(loss_fn, encode, CHUNKS))(
        make_params(), *batch(), rng=rng
    )
    ref = gc_jax.testing.full_batch_value_and_grad(loss_fn, encode, CHUNKS)
    chex.assert_trees_all_close(want, jax.jit(ref)(make_params(), *batch(), rng=rng), **TOL)
    for keep in (0, 3, ALL):
        grad_fn = jax.jit(gc_jax.cached_value_and_grad(loss_fn, encode, CHUNKS, keep=keep))
        chex.assert_trees_all_close(grad_fn(make_params(), *batch(), rng=rng), want, **TOL)


def test_train_step_and_chunked_encoder():
    params, (q, d) = make_params(), batch()
    opt = optax.sgd(0.1)
    plain = jax.jit(gc_jax.make_train_step(loss_fn, encode, CHUNKS, optimizer=opt))
    kept = jax.jit(gc_jax.make_train_step(loss_fn, encode, CHUNKS, optimizer=opt, keep=5))
    state = (params, opt.init(params))
    chex.assert_trees_all_close(kept(state, q, d), plain(state, q, d), **TOL)
    want = full_batch(params, q, d)
    for keep in (0, 2, 7):
        enc = gc_jax.chunked_encoder(encode, 3, keep=keep)
        loss = lambda p, q, d, enc=enc: loss_fn(p, enc(p, q), enc(p, d))
        chex.assert_trees_all_close(jax.jit(jax.value_and_grad(loss))(params, q, d), want, **TOL)


def test_chunked_encoder_batch_gradients():
    """Differentiated batch leaves get their gradient from the kept chunks too."""
    params, (q, d) = make_params(), batch()
    enc = gc_jax.chunked_encoder(encode, 3, keep=4)
    loss = lambda p, q, d: loss_fn(p, enc(p, q), encode(p, d, None))
    plain = lambda p, q, d: loss_fn(p, encode(p, q, None), encode(p, d, None))
    got = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, q, d)
    chex.assert_trees_all_close(got, jax.grad(plain, argnums=(0, 1))(params, q, d), **TOL)


@pytest.mark.parametrize("bad", [-1, 1.0, "2", True])
def test_keep_must_be_a_non_negative_int(bad):
    with pytest.raises(ValueError, match=rf"keep must be a non-negative int .*got {bad!r}.*keep=2"):
        gc_jax.cached_value_and_grad(loss_fn, encode, 3, keep=bad)
    with pytest.raises(ValueError, match="keep must be a non-negative int"):
        gc_jax.chunked_encoder(encode, 3, keep=bad)


def test_keep_more_than_the_chunks_is_an_error():
    grad_fn = jax.jit(gc_jax.cached_value_and_grad(loss_fn, encode, CHUNKS, keep=ALL + 1))
    with pytest.raises(ValueError, match=r"keep=11 is more chunks than the batch has: 10 .*"
                                         r"\[7, 3\].*write keep=10"):  # fmt: skip
        grad_fn(make_params(), *batch())
    enc = gc_jax.chunked_encoder(encode, 3, keep=8)
    with pytest.raises(ValueError, match=r"keep=8\) is more chunks than the batch has: 7"):
        jax.grad(lambda p: enc(p, batch()[0]).sum())(make_params())


# --------------------------------------------------------------- token budgets, packing


def test_token_budget_and_packing():
    """Kept chunks are the last bucket's; where it has fewer, the extra ones write no row."""
    import test_token_chunks as budget_case
    import test_token_packing as packing_case

    cases = (
        (budget_case, budget_case.BUDGET, {"tied": False}),
        (packing_case, packing_case.PACKING, {}),
    )
    for case, chunking, kwargs in cases:
        params, encoders = case.make_params(), case.towers(**kwargs)
        q, d = case.text_batch(20, "uniform", 1), case.text_batch(20, "long", 2)
        want = case.full_batch(case.loss_fn, encoders, params, q, d)
        for keep in (1, 3, 7):
            grad_fn = gc_jax.cached_value_and_grad(case.loss_fn, encoders, chunking, keep=keep)
            chex.assert_trees_all_close(jax.jit(grad_fn)(params, q, d), want, **TOL)


BUDGET = gc_jax.TokenBudget(tokens=64, buckets=(4, 8, 16))


@pytest.mark.parametrize("chunk_size", [3, 5, BUDGET], ids=str)
def test_every_row_is_visited_once(chunk_size):
    """Loops, kept chunks and the tail together write every row once, for every count."""
    rows = 22
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 17, rows)
    mask = jnp.asarray(np.arange(16)[None, :] < lengths[:, None], jnp.int32)
    data = {"attention_mask": mask, "row": jnp.arange(rows, dtype=jnp.float32)}

    def visit(keep):
        planned = _plan.make(data, chunk_size, name="batch")
        plan = planned.plan
        seen = jnp.zeros(rows)

        def write(seen, c):  # a count per row, through take_cotangent of ones
            ones = plan.take_cotangent(jnp.ones(rows), c)
            return plan.put(seen, plan.take_cotangent(seen, c) + ones, c)

        for index, turns in plan.loops(keep):
            seen = jax.lax.fori_loop(0, turns, lambda j, s, index=index: write(s, index(j)), seen)
        index, turns = plan.kept(keep)
        seen = jax.lax.fori_loop(0, turns, lambda j, s: write(s, index(j)), seen)
        return write(seen, None) if plan.has_tail(keep) else seen

    for keep in (0, 1, 2, 5):
        chex.assert_trees_all_equal(jax.jit(lambda k=keep: visit(k))(), jnp.ones(rows))


# ----------------------------------------------------------------------------- devices


def _eight_devices():
    assert jax.device_count() >= 8, (
        "needs 8 devices: run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
    )


@pytest.mark.parametrize("keep", [0, 2, 5])
def test_shard_map(keep):
    _eight_devices()
    mesh = jax.make_mesh((8,), ("d",))
    q, d = batch(48, 48)  # 6 rows per device: chunks of 2 (3 per input)
    grad_fn = gc_jax.cached_value_and_grad(
        lambda p, q, d: loss_fn(p, q, d, "d"), encode, 2, axis_name="d", keep=keep
    )
    step = jax.jit(jax.shard_map(grad_fn, mesh=mesh, in_specs=(P(), P("d"), P("d")),
                                 out_specs=(P(), P())))  # fmt: skip
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P("d")))
    chex.assert_trees_all_close(step(make_params(), put(q), put(d)),
                                full_batch(make_params(), q, d), **TOL)  # fmt: skip


@pytest.mark.parametrize("view", ["local", "global"])
def test_sharded_jit(view):
    _eight_devices()
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
    q, d = batch(48, 48)
    grad_fn = jax.jit(gc_jax.cached_value_and_grad(loss_fn, encode, 2, keep=4, encoder_view=view))
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P("d")))
    with jax.set_mesh(mesh):
        got = grad_fn(make_params(), put(q), put(d))
    chex.assert_trees_all_close(got, full_batch(make_params(), q, d), **TOL)


# ------------------------------------------------------------------------------ memory

WIDTH, DEPTH, ROWS, CHUNK = 256, 6, 2048, 256  # 8 chunks per input


def deep_mlp(params, x, key):
    for w in params:
        x = jnp.tanh(x @ w)
    return x


def temp_bytes(fn):
    params = [jax.ShapeDtypeStruct((WIDTH, WIDTH), jnp.float32)] * DEPTH
    x = jax.ShapeDtypeStruct((ROWS, WIDTH), jnp.float32)
    return jax.jit(fn).lower(params, x, x).compile().memory_analysis().temp_size_in_bytes


def alignment(params, q, d):
    return -jnp.mean(jnp.sum(q * d, axis=-1))


def test_temp_bytes_grow_with_keep():
    """One more kept chunk holds one more chunk's activations (about 1.1x: its
    residuals); ``keep=1`` is the default's program (the last chunk kept), ``keep=0``
    needs no more, and keeping every chunk needs the full batch's, and the cache."""
    cached = lambda keep: temp_bytes(gc_jax.cached_value_and_grad(alignment, deep_mlp, CHUNK,
                                                                  keep=keep))  # fmt: skip
    default = temp_bytes(gc_jax.cached_value_and_grad(alignment, deep_mlp, CHUNK))
    got = {keep: cached(keep) for keep in (0, 1, 2, 4, 8)}
    chunk_activations = DEPTH * CHUNK * WIDTH * 4
    assert got[1] == default
    assert got[0] <= got[1]
    for a, b in ((1, 2), (2, 4), (4, 8)):
        assert (b - a) * chunk_activations * 0.9 <= got[b] - got[a], got
        assert got[b] - got[a] <= (b - a) * chunk_activations * 1.5, got
    full = jax.value_and_grad(lambda p, q, d: alignment(p, deep_mlp(p, q, None),
                                                        deep_mlp(p, d, None)))  # fmt: skip
    cache = 2 * ROWS * WIDTH * 4  # both inputs' representations
    assert cached(2 * ROWS // CHUNK) <= temp_bytes(full) + 2 * cache  # the cache, its gradient


def test_grad_cache():
    """``GradCache(keep=)`` goes through the same passes."""
    from flax import nnx

    class Tower(nnx.Module):
        def __init__(self, seed):
            self.hidden = nnx.Linear(5, 12, rngs=nnx.Rngs(seed))

        def __call__(self, x):
            return jnp.tanh(self.hidden(x))

    mq, md = Tower(0), Tower(1)
    q, d = batch()
    want = gc_jax.compat.GradCache([mq, md], CHUNKS, contrastive_loss)(q, d)
    for keep in (0, 4, ALL):
        got = gc_jax.compat.GradCache([mq, md], CHUNKS, contrastive_loss, keep=keep)(q, d)
        chex.assert_trees_all_close(got, want, **TOL)


def test_the_guide_plans_half_the_chunks_kept():
    """docs/chunk_size.md, "Keep what fits": the plan keeps half the chunks in 24 MiB."""
    from test_guide import run

    ns = run("chunk_size.md", "setup", "largest chunk size", "keep what fits")
    plan = ns["plan"]
    assert plan.bytes <= 24 * 2**20 and plan.keep / plan.chunks >= 0.5, plan[:8]
