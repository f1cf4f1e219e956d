"""gc_jax.largest_chunk_size on the CPU: the compiler's answer, every entry point, errors.

(On a TPU topology: tests/test_tpu.py.)
"""

import functools
import itertools
import logging
import re
from pathlib import Path

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


@pytest.mark.parametrize(
    "order", [CANDIDATES, CANDIDATES[::-1], [256, 64, 2048, 128, 1024, 512], [*CANDIDATES, 256]]
)
def test_any_order_gives_the_largest_that_fits(order):
    """Decreasing, shuffled or repeated candidates: the same answer as sorted ones."""
    low, high = measured(256), measured(512)
    got = gc_jax.largest_chunk_size(cached, ARGS, order, budget_bytes=(low + high) / 2)
    assert got == 256


# A memory that is not monotone in the chunk size (on a mesh, chunk 64 can need less
# than chunk 32): a bisection over [8, 16, 32, 64, 128] tries 32, sees it not fit and
# answers 16; the largest that fits is 64.
FAKE_BYTES = {8: 100, 16: 110, 32: 130, 64: 120, 128: 200, 256: 90}


def fake_search(monkeypatch, candidates, budget):
    """largest_chunk_size with FAKE_BYTES as the compiled memory; the compiles it made."""
    compiled = []

    def fake_bytes(step, args, kwargs, mesh):
        compiled.append(step)
        return FAKE_BYTES[step]

    monkeypatch.setattr(gc_jax._chunk_size, "_bytes_or_none", fake_bytes)
    got = gc_jax.largest_chunk_size(lambda c: c, ARGS, candidates, budget_bytes=budget)
    return got, compiled


def test_non_monotone_memory_in_every_order(monkeypatch):
    for order in itertools.permutations([8, 16, 32, 64, 128]):
        got, compiled = fake_search(monkeypatch, order, budget=125)
        assert got == 64, order
        assert compiled == [128, 64], order  # from the largest down to the answer, each once


def test_non_monotone_memory_compiles_down_to_the_answer(monkeypatch):
    assert fake_search(monkeypatch, [8, 16, 32, 64, 128, 256], 125) == (256, [256])
    assert fake_search(monkeypatch, 128, 125) == (64, [128, 64])  # powers of two up to 128
    assert fake_search(monkeypatch, [8, 16, 32], 115) == (16, [32, 16])
    with pytest.raises(ValueError, match=r"no candidate fits; even the smallest, chunk_size=8"):
        fake_search(monkeypatch, [16, 8, 32], 99)


def test_each_compile_is_logged(monkeypatch, caplog):
    """Compiles take minutes for a large model: each is logged at INFO on "gc_jax"."""
    monkeypatch.setitem(FAKE_BYTES, 512, None)  # the compiler's out of memory
    with caplog.at_level(logging.INFO, logger="gc_jax"):
        assert fake_search(monkeypatch, [8, 16, 32, 64, 512], 125)[0] == 64
    lines = [r.getMessage() for r in caplog.records if r.name == "gc_jax"]
    assert lines[0] == (
        "largest_chunk_size: 125 bytes per device; compiling the step for chunk sizes "
        "[512, 64, 32, 16, 8] from the largest down, until one fits"
    )
    assert lines[1] == "largest_chunk_size: compiling chunk_size=512 ..."
    assert re.fullmatch(r"largest_chunk_size: chunk_size=512 needs out of memory "
                        r"\(compiled in [\d.]+s\): does not fit", lines[2])  # fmt: skip
    assert re.fullmatch(r"largest_chunk_size: chunk_size=64 needs 120 bytes "
                        r"\(compiled in [\d.]+s\): fits", lines[-1])  # fmt: skip
    assert len(lines) == 5
    doc = (Path(__file__).resolve().parents[1] / "docs" / "chunk_size.md").read_text()
    assert 'logging.getLogger("gc_jax").setLevel(logging.INFO)' in doc


def test_per_input_candidates_are_sorted_too():
    tx = optax.sgd(0.1)
    state = (PARAMS, jax.eval_shape(tx.init, PARAMS))
    q = jax.ShapeDtypeStruct((ROWS // 4, OUT), jnp.float32)

    def make(chunks):
        contrastive = lambda p, q, d: gc_jax.losses.contrastive_loss(q, d)
        return gc_jax.make_train_step(contrastive, encode, chunks, optimizer=tx)

    candidates = [(c // 4, c) for c in CANDIDATES]
    low = compiled_bytes(jax.jit(make(candidates[2])).lower(state, q, X).compile())
    high = compiled_bytes(jax.jit(make(candidates[3])).lower(state, q, X).compile())
    got = gc_jax.largest_chunk_size(
        make, (state, q, X), candidates[::-1], budget_bytes=(low + high) / 2
    )
    assert got == candidates[2]


@pytest.mark.parametrize(
    ("budget", "expected"),
    [("1GB", 10**9), ("16GiB", 16 * 2**30), ("1.5 MiB", 1.5 * 2**20), (" 512kb ", 512e3),
     ("2048", 2048), (np.int64(300), 300), (2.5e9, 2.5e9)],
)  # fmt: skip
def test_budget_bytes_as_a_number_or_a_size(monkeypatch, budget, expected):
    assert gc_jax._chunk_size._budget(budget) == expected
    got, _ = fake_search(monkeypatch, [8, 16], budget)
    assert got == 16


def test_errors():
    with pytest.raises(ValueError, match="reports no memory limit; pass budget_bytes"):
        gc_jax.largest_chunk_size(cached, ARGS, CANDIDATES)
    with pytest.raises(ValueError, match=r"even the smallest, chunk_size=64, needs [\d,]+ bytes"):
        gc_jax.largest_chunk_size(cached, ARGS, CANDIDATES, budget_bytes=1000)
    with pytest.raises(ValueError, match="candidates is empty"):
        gc_jax.largest_chunk_size(cached, ARGS, [], budget_bytes=2**30)
    with pytest.raises(ValueError, match="candidates must be >= 1"):
        gc_jax.largest_chunk_size(cached, ARGS, 0, budget_bytes=2**30)
    with pytest.raises(TypeError, match="build a Mesh over them"):
        gc_jax.largest_chunk_size(cached, ARGS, 8, budget_bytes=2**30, device=jax.devices()[:2])


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(budget_bytes=0), ValueError, r"budget_bytes must be a positive number.*got 0 \(int"),
        (dict(budget_bytes=-1.0), ValueError, "budget_bytes must be a positive number"),
        (dict(budget_bytes=float("nan")), ValueError, "budget_bytes must be a positive number"),
        (dict(budget_bytes="1 GigaB"), ValueError, r"such as \"16GiB\".*got '1 GigaB' \(str\)"),
        (dict(budget_bytes="0GB"), ValueError, "budget_bytes must be a positive number"),
        (dict(budget_bytes=True), TypeError, r"budget_bytes must be.*got True \(bool\)"),
        (dict(budget_bytes=[2**30]), TypeError, r"budget_bytes must be.*got \[1073741824\]"),
        (dict(candidates="64"), TypeError,
         r"got '64' \(str\); a string is not a list of sizes: write candidates=64"),
        (dict(candidates="64,128"), TypeError, r"write a list such as \[64, 128, 256\]"),
        (dict(candidates=2.0), TypeError, r"candidates must be the rows.*got 2.0 \(float\)"),
        (dict(candidates={64: 1}), TypeError, "candidates must be the rows"),
        (dict(candidates=[64, 0]), ValueError, r"candidates\[1\] must be a positive int, got 0"),
        (dict(candidates=[64, "128"]), TypeError, r"candidates\[1\] must be a positive int"),
        (dict(candidates=[64, True]), TypeError, r"candidates\[1\] must be a positive int"),
        (dict(candidates=[(8, 32), ()]), ValueError, r"candidates\[1\] is empty"),
        (dict(candidates=[(8, 32), (16, 0)]), ValueError, r"candidates\[1\]\[1\] must be"),
        (dict(candidates=[64, (8, 32)]), TypeError, "all ints .* or all tuples of the same length"),
        (dict(candidates=[(8, 32), (16,)]), TypeError, "all tuples of the same length"),
        (dict(candidates=[(8, 64), (16, 32)]), ValueError, r"\(8, 64\) and \(16, 32\) do not grow"),
        (dict(candidates=[gc_jax.TokenBudget(512, (32, 64))]), TypeError, "is a gc_jax.TokenB"),
    ],
)  # fmt: skip
def test_argument_errors_name_the_argument(kwargs, error, match):
    """Raised before anything is compiled, naming the argument, what it got and what to write."""
    kwargs = {"candidates": CANDIDATES, "budget_bytes": 2**30, **kwargs}
    candidates = kwargs.pop("candidates")
    never = lambda c: pytest.fail("nothing should be compiled")
    with pytest.raises(error, match=match):
        gc_jax.largest_chunk_size(never, ARGS, candidates, **kwargs)
