"""gc_jax.largest_chunk_size on the CPU: the compiler's answer, every entry point, errors.

(On a TPU topology: tests/test_tpu.py.)
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import gc_jax
from gc_jax._chunk_size import compiled_bytes

ROWS, WIDTH, OUT = 2048, 512, 64
CANDIDATES = [64, 128, 256, 512, 1024, 2048]


def encode(params, x, key):
    for w in params:
        x = jnp.tanh(x @ w)
    return x


def loss(params, q, d):
    return -jnp.mean(jnp.sum(q * d, axis=-1))


PARAMS = [
    jax.ShapeDtypeStruct(s, jnp.float32) for s in [(OUT, WIDTH), (WIDTH, WIDTH), (WIDTH, OUT)]
]
X = jax.ShapeDtypeStruct((ROWS, OUT), jnp.float32)
ARGS = (PARAMS, X, X)


def cached(chunk_size):
    return gc_jax.cached_value_and_grad(loss, encode, chunk_size)


@functools.cache
def measured(chunk_size) -> int:
    return compiled_bytes(jax.jit(cached(chunk_size)).lower(*ARGS).compile())


@pytest.mark.parametrize("k", [1, 3])
def test_the_largest_candidate_within_the_budget(k):
    """A budget between candidate k's bytes and candidate k+1's gives candidate k."""
    low, high = measured(CANDIDATES[k]), measured(CANDIDATES[k + 1])
    assert low < high
    got = gc_jax.largest_chunk_size(cached, ARGS, CANDIDATES, budget_bytes=(low + high) / 2)
    assert got == CANDIDATES[k]
    # Exactly the budget still fits.
    assert gc_jax.largest_chunk_size(cached, ARGS, CANDIDATES, budget_bytes=low) == CANDIDATES[k]


def test_an_int_is_the_batch_rows():
    """candidates=ROWS tries the powers of two below it and ROWS (full batch)."""
    assert gc_jax.largest_chunk_size(cached, ARGS, ROWS, budget_bytes=2**40) == ROWS
    got = gc_jax.largest_chunk_size(cached, ARGS, 1000, budget_bytes=2**40)
    assert got == 1000  # not a power of two: the full batch is still a candidate


def test_make_train_step_per_input_chunks_and_donation():
    """Tuples of per-input sizes; a jitted step keeps its donate_argnums."""
    tx = optax.sgd(0.1)
    state = (PARAMS, jax.eval_shape(tx.init, PARAMS))
    q = jax.ShapeDtypeStruct((ROWS // 4, OUT), jnp.float32)

    def make(chunks):
        contrastive = lambda p, q, d: gc_jax.losses.contrastive_loss(q, d)  # 4 docs per query
        step = gc_jax.make_train_step(contrastive, encode, chunks, optimizer=tx)
        return jax.jit(step, donate_argnums=0)

    candidates = [(c // 4, c) for c in CANDIDATES]
    low = compiled_bytes(make(candidates[2]).lower(state, q, X).compile())
    high = compiled_bytes(make(candidates[3]).lower(state, q, X).compile())
    got = gc_jax.largest_chunk_size(make, (state, q, X), candidates, budget_bytes=(low + high) / 2)
    assert got == candidates[2]


def test_chunked_encoder_inside_grad():
    def make(chunk_size):
        encode_batch = gc_jax.chunked_encoder(encode, chunk_size)
        return jax.grad(lambda p, q, d: loss(p, encode_batch(p, q), encode_batch(p, d)))

    sizes = [compiled_bytes(jax.jit(make(c)).lower(*ARGS).compile()) for c in CANDIDATES[1:3]]
    got = gc_jax.largest_chunk_size(make, ARGS, CANDIDATES, budget_bytes=sum(sizes) / 2)
    assert got == CANDIDATES[1]


def test_a_mesh_budget_is_per_device():
    """Under shard_map on 8 devices: rows per device, bytes per device."""
    mesh = Mesh(np.array(jax.devices()[:8]), ("d",))
    x = jax.ShapeDtypeStruct((8 * ROWS, OUT), jnp.float32, sharding=NamedSharding(mesh, P("d")))

    def make(chunk_size):
        global_loss = lambda p, q, d: gc_jax.losses.contrastive_loss(q, d, axis_name="d")
        grad_fn = gc_jax.cached_value_and_grad(global_loss, encode, chunk_size, axis_name="d")
        return jax.shard_map(
            grad_fn, mesh=mesh, in_specs=(P(), P("d"), P("d")), out_specs=(P(), P())
        )

    per_device = [
        compiled_bytes(jax.jit(make(c)).lower(PARAMS, x, x).compile()) for c in (128, 256)
    ]
    budget = sum(per_device) / 2
    got = gc_jax.largest_chunk_size(
        make, (PARAMS, x, x), CANDIDATES, budget_bytes=budget, device=mesh
    )
    assert got == 128


def test_concrete_arrays_are_only_read_for_their_shapes():
    params = [jnp.zeros(s.shape) for s in PARAMS]
    x = jnp.zeros((ROWS, OUT))
    got = gc_jax.largest_chunk_size(cached, (params, x, x), CANDIDATES, budget_bytes=2**40)
    assert got == ROWS


def test_errors():
    with pytest.raises(ValueError, match="reports no memory limit; pass budget_bytes"):
        gc_jax.largest_chunk_size(cached, ARGS, CANDIDATES)
    with pytest.raises(ValueError, match=r"even the first candidate, chunk_size=64, needs [\d,]+"):
        gc_jax.largest_chunk_size(cached, ARGS, CANDIDATES, budget_bytes=1000)
    with pytest.raises(ValueError, match="budget_bytes must be positive"):
        gc_jax.largest_chunk_size(cached, ARGS, CANDIDATES, budget_bytes=0)
    with pytest.raises(TypeError, match="candidates must be the batch rows"):
        gc_jax.largest_chunk_size(cached, ARGS, [], budget_bytes=2**30)
    with pytest.raises(ValueError, match="candidates must be >= 1"):
        gc_jax.largest_chunk_size(cached, ARGS, 0, budget_bytes=2**30)
    with pytest.raises(TypeError, match="build a Mesh over them"):
        gc_jax.largest_chunk_size(cached, ARGS, 8, budget_bytes=2**30, device=jax.devices()[:2])
