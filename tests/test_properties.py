"""Property tests: cached gradients equal plain full-batch jax.value_and_grad.

Hypothesis draws batch sizes, per-input chunk sizes, hard-negative counts, the
input pytree structure, tied or separate encoders, and dropout seeds. The examples
are derandomized (the same ones on every run) and bounded, so CI is stable.

Nearly every example is a new static configuration, so compiling dominates the
run time: the functions are jitted with XLA's CPU backend optimisation level 0
(HLO passes still run; LLVM optimises less), which cuts compile time about 2.5x
and changes nothing this file tests.
"""

import functools

import chex
import jax
import jax.numpy as jnp
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import gc_jax
from gc_jax.losses import contrastive_loss

D_A, D_B, D_HID, D_OUT = 5, 3, 8, 4

FAST_COMPILE = {"xla_backend_optimization_level": 0}

SETTINGS = settings(
    max_examples=9,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)


def init_params(seed=0):
    ka, kb, k2, kd = jax.random.split(jax.random.key(seed), 4)
    return {
        "wa": jax.random.normal(ka, (D_A, D_HID)) / 2,
        "wb": jax.random.normal(kb, (D_B, D_HID)) / 2,
        "w2": jax.random.normal(k2, (D_HID, D_OUT)) / 3,
        "doc": jax.random.normal(kd, (D_HID, D_OUT)) / 3,
        "log_temp": jnp.array(-0.7),
    }


def features(p, x, structure):
    if structure == "array":
        return x @ p["wa"]
    a, b = (x["a"], x["b"]) if structure == "dict" else x
    return a @ p["wa"] + b @ p["wb"]


def make_encoder(structure, head):
    def encode(p, x, key):
        h = jnp.tanh(features(p, x, structure))
        if key is not None:  # dropout, replayed from the chunk's key
            h = h * jax.random.bernoulli(key, 0.75, h.shape) / 0.75
        return h @ p[head]

    return encode


def encoders(structure, tied):
    query = make_encoder(structure, "w2")
    return query if tied else (query, make_encoder(structure, "doc"))


def loss_fn(p, q, d):
    return contrastive_loss(q, d, temperature=jnp.exp(p["log_temp"]))


def make_input(key, rows, structure):
    ka, kb = jax.random.split(key)
    a = jax.random.normal(ka, (rows, D_A))
    b = jax.random.normal(kb, (rows, D_B))
    return {"array": a, "dict": {"a": a, "b": b}, "tuple": (a, b)}[structure]


@functools.cache
def cached_fn(structure, tied, chunk_size):
    """One jitted function per static configuration; jit caches the shapes."""
    f = gc_jax.cached_value_and_grad(loss_fn, encoders(structure, tied), chunk_size)
    return jax.jit(f, compiler_options=FAST_COMPILE)


@functools.cache
def reference_fn(structure, tied, chunk_sizes):
    """Full-batch jax.value_and_grad, encoding with the same per-chunk dropout keys.

    Chunk ``c`` of input ``i`` gets ``fold_in(fold_in(rng, i), c)``; the reps of every
    chunk are built inside one differentiable function and concatenated. Without
    dropout (``chunk_sizes=None``) each batch is encoded at once.
    """
    encs = encoders(structure, tied)
    encs = (encs, encs) if tied else encs

    def reps(p, enc, x, size, rng, i):
        rows = jax.tree.leaves(x)[0].shape[0]
        size = size or rows
        parts = []
        for c, start in enumerate(range(0, rows, size)):
            chunk = jax.tree.map(lambda v, s=start: v[s : s + size], x)
            key = None if rng is None else jax.random.fold_in(jax.random.fold_in(rng, i), c)
            parts.append(enc(p, chunk, key))
        return jnp.concatenate(parts)

    def total(p, q, d, rng):
        sizes = zip(encs, (q, d), chunk_sizes or (None, None), strict=True)
        return loss_fn(p, *(reps(p, e, x, s, rng, i) for i, (e, x, s) in enumerate(sizes)))

    return jax.jit(jax.value_and_grad(total), compiler_options=FAST_COMPILE)


@st.composite
def configs(draw):
    # Hypothesis shrinks towards (and often draws) the first option of each choice,
    # so the first options are the demanding ones: dropout on, a nested structure,
    # separate encoders and chunk sizes per input.
    n = draw(st.integers(1, 8))
    k = draw(st.integers(1, 3))
    if draw(st.sampled_from([True, False])):
        chunk_size = (draw(st.integers(1, n + 2)), draw(st.integers(1, n * k + 2)))
    else:
        chunk_size = draw(st.integers(1, n * k + 2))
    return {
        "n": n,
        "k": k,
        "chunk_size": chunk_size,
        "structure": draw(st.sampled_from(["dict", "tuple", "array"])),
        "tied": draw(st.sampled_from([False, True])),
        "seed": draw(st.integers(0, 2**31 - 1)),
        "dropout": draw(st.sampled_from([True, False])),
    }


@SETTINGS
@given(configs())
@example(
    {
        "n": 7,
        "k": 3,
        "chunk_size": (3, 4),
        "structure": "dict",
        "tied": False,
        "seed": 1,
        "dropout": True,
    }
)
@example(
    {
        "n": 5,
        "k": 2,
        "chunk_size": 4,
        "structure": "tuple",
        "tied": True,
        "seed": 2,
        "dropout": True,
    }
)
@example(
    {
        "n": 3,
        "k": 2,
        "chunk_size": (8, 1),
        "structure": "array",
        "tied": False,
        "seed": 3,
        "dropout": True,
    }
)
def test_cached_gradients_equal_full_batch(config):
    structure, tied, chunk_size = config["structure"], config["tied"], config["chunk_size"]
    kq, kd, kr = jax.random.split(jax.random.key(config["seed"]), 3)
    q = make_input(kq, config["n"], structure)
    d = make_input(kd, config["n"] * config["k"], structure)
    rng = kr if config["dropout"] else None
    params = init_params()

    value, grads = cached_fn(structure, tied, chunk_size)(params, q, d, rng=rng)
    sizes = chunk_size if isinstance(chunk_size, tuple) else (chunk_size, chunk_size)
    reference = reference_fn(structure, tied, sizes if rng is not None else None)
    want_value, want_grads = reference(params, q, d, rng)

    chex.assert_trees_all_close(value, want_value, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(grads, want_grads, rtol=1e-4, atol=1e-5)
    chex.assert_trees_all_equal_shapes_and_dtypes(grads, params)
