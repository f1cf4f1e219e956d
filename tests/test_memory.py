"""Memory, read deterministically from XLA's compiled memory analysis (no timing)."""

import functools

import jax
import jax.numpy as jnp
import pytest

import gc_jax

WIDTH, DEPTH, DIM_OUT, CHUNK = 256, 8, 64, 128
MIB = 2**20


def deep_mlp(params, x, key):
    for w in params["layers"]:
        x = jnp.tanh(x @ w)
    return x @ params["out"]


def alignment_loss(params, q, d):
    """An O(batch) loss, so only the cache itself may grow with the batch."""
    return -jnp.mean(jnp.sum(q * d, axis=-1))


PARAMS = {
    "layers": [jax.ShapeDtypeStruct((WIDTH, WIDTH), jnp.float32)] * DEPTH,
    "out": jax.ShapeDtypeStruct((WIDTH, DIM_OUT), jnp.float32),
}


def temp_bytes(fn, batch):
    x = jax.ShapeDtypeStruct((batch, WIDTH), jnp.float32)
    return jax.jit(fn).lower(PARAMS, x, x).compile().memory_analysis().temp_size_in_bytes


def cached():
    return gc_jax.cached_value_and_grad(alignment_loss, deep_mlp, CHUNK)


def full_batch():
    return jax.value_and_grad(
        lambda p, q, d: alignment_loss(p, deep_mlp(p, q, None), deep_mlp(p, d, None))
    )


def test_temp_memory_grows_only_with_the_cache():
    small, large = 1024, 16384
    growth = temp_bytes(cached(), large) - temp_bytes(cached(), small)
    cache_growth = 2 * (large - small) * DIM_OUT * 4  # two inputs' representations
    # The cache and its gradient: twice the representations, plus a little slack.
    assert growth <= 2 * cache_growth + MIB, (
        f"temp memory grew by {growth / MIB:.1f} MiB from B={small} to B={large}; "
        f"the cache grew by {cache_growth / MIB:.1f} MiB"
    )


def test_far_below_full_batch_for_a_deep_model():
    batch = 16384
    ours, full = temp_bytes(cached(), batch), temp_bytes(full_batch(), batch)
    assert ours * 10 < full, f"gc_jax {ours / MIB:.1f} MiB vs full batch {full / MIB:.1f} MiB"


# --- bfloat16 encoders: batch-dependent memory at its floor, fixed overhead bounded -----

VOCAB, TOKENS, BF16_DIM = 1000, 8, 128


def token_encoder(params, ids, key):
    """Embedding bag and a tanh MLP in bfloat16 over float32 parameters (int32 token ids)."""
    x = params["emb"][ids].astype(jnp.bfloat16).mean(1)
    for w in params["layers"]:
        x = jnp.tanh(x @ w.astype(jnp.bfloat16))
    return x @ params["out"].astype(jnp.bfloat16)


TOKEN_PARAMS = {
    "emb": jax.ShapeDtypeStruct((VOCAB, WIDTH), jnp.float32),
    "layers": [jax.ShapeDtypeStruct((WIDTH, WIDTH), jnp.float32)] * 4,
    "out": jax.ShapeDtypeStruct((WIDTH, BF16_DIM), jnp.float32),
}
PARAM_BYTES = sum(x.size * 4 for x in jax.tree.leaves(TOKEN_PARAMS))
BF16_CHUNK = 64


def ids(rows):
    return jax.ShapeDtypeStruct((rows, TOKENS), jnp.int32)


def analysis(fn, *args):
    return jax.jit(fn).lower(*args).compile().memory_analysis()


def total_bytes(fn, *args):
    m = analysis(fn, *args)
    return m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes


def blockwise(params, q, d):
    return gc_jax.losses.contrastive_loss(q, d, temperature=0.05, block_size=256)


@functools.cache
def per_row(cache_dtype=None, small=4096, large=16384):
    f = gc_jax.cached_value_and_grad(blockwise, token_encoder, BF16_CHUNK, cache_dtype=cache_dtype)
    grown = total_bytes(f, TOKEN_PARAMS, ids(large), ids(large)) - total_bytes(
        f, TOKEN_PARAMS, ids(small), ids(small)
    )
    return grown / (large - small)


# Per row: both inputs' ids, both towers' bfloat16 representations and the first
# tower's bfloat16 gradient. The second tower's gradient is written over its cache
# by the blockwise loss's backward, so it needs no row of its own.
FLOOR = 2 * TOKENS * 4 + 3 * BF16_DIM * 2


def test_bf16_batch_memory_per_row_is_at_the_floor():
    growth = per_row()
    assert growth <= 1.1 * FLOOR, f"{growth:.0f} bytes per row; floor {FLOOR}"


def test_a_batch_not_a_multiple_of_the_block_is_not_padded():
    """4096 + 40 rows: the loss's last block overlaps the one before; no padded copies."""
    growth = per_row(small=4096 + 40, large=16384 + 40)
    assert growth <= 1.1 * FLOOR, f"{growth:.0f} bytes per row; floor {FLOOR}"


def test_loss_gradient_is_written_over_the_cache():
    """The blockwise backward writes the second input's gradient over its cache.

    With a float32 cache, per row: both inputs' ids, both caches and the first
    input's gradient; the second input's gradient takes its cache's place.
    """
    growth = per_row(jnp.float32)
    three = 2 * TOKENS * 4 + 3 * BF16_DIM * 4
    assert growth <= 1.05 * three, f"{growth:.0f} bytes per row; three float32 rows: {three}"


def test_cache_dtype_never_increases_memory():
    default, bf16 = per_row(), per_row(jnp.bfloat16)
    assert bf16 <= default, f"cache_dtype=bfloat16: {bf16:.0f} B/row, default {default:.0f}"
    wide = per_row(jnp.float32)  # float32 only costs: twice the cache and its gradient
    assert wide > default


def readout(params, *reps):
    return sum(jnp.mean(r[:, 0].astype(jnp.float32)) for r in reps)


@functools.cache
def one_chunk_vjp_temp():
    ct = jax.ShapeDtypeStruct((BF16_CHUNK, BF16_DIM), jnp.bfloat16)
    vjp = lambda p, x, ct: jax.vjp(lambda p: token_encoder(p, x, None), p)[1](ct)
    return analysis(vjp, TOKEN_PARAMS, ids(BF16_CHUNK), ct).temp_size_in_bytes


@pytest.mark.parametrize("inputs", [1, 2, 3])
@pytest.mark.parametrize("chunks", [2, 4])
def test_fixed_overhead_is_one_chunk_and_two_parameter_buffers(inputs, chunks):
    """At a small batch: one chunk's VJP (compiled alone) + accumulator + one chunk's grads."""
    bound = 1.1 * (one_chunk_vjp_temp() + 2 * PARAM_BYTES)
    f = gc_jax.cached_value_and_grad(readout, token_encoder, BF16_CHUNK)
    temp = analysis(f, TOKEN_PARAMS, *[ids(chunks * BF16_CHUNK)] * inputs).temp_size_in_bytes
    assert temp <= bound, f"temp {temp / MIB:.2f} MiB > bound {bound / MIB:.2f} MiB"


def full_batch_readout(params, *batches):
    return readout(params, *[token_encoder(params, x, None) for x in batches])


# (inputs, rows per chunk): from where one chunk's activations outweigh the parameter
# gradient buffer that gradient caching adds (one input: between 64 and 128 rows).
TWO_CHUNK_CASES = [(1, 128), (1, 512), (2, 64), (2, 512), (3, 64), (3, 512)]


@pytest.mark.parametrize(("inputs", "chunk"), TWO_CHUNK_CASES)
def test_two_chunks_per_input_stay_below_the_full_batch(inputs, chunk):
    """Both chunks' activations are never live at once, even with one input."""
    f = gc_jax.cached_value_and_grad(readout, token_encoder, chunk)
    batch = [ids(2 * chunk)] * inputs
    ours = analysis(f, TOKEN_PARAMS, *batch).temp_size_in_bytes
    theirs = analysis(jax.value_and_grad(full_batch_readout), TOKEN_PARAMS, *batch)
    theirs = theirs.temp_size_in_bytes
    assert ours <= theirs, f"gc_jax {ours / MIB:.2f} MiB > full batch {theirs / MIB:.2f} MiB"


@pytest.mark.parametrize("inputs", [1, 2, 3])
def test_one_chunk_per_input_is_the_full_batch(inputs):
    """Below the crossover, chunk_size >= batch gives exactly full-batch memory."""
    f = gc_jax.cached_value_and_grad(readout, token_encoder, 4 * BF16_CHUNK)
    batch = [ids(BF16_CHUNK)] * inputs
    ours = analysis(f, TOKEN_PARAMS, *batch).temp_size_in_bytes
    theirs = analysis(jax.value_and_grad(full_batch_readout), TOKEN_PARAMS, *batch)
    assert ours == theirs.temp_size_in_bytes, (ours, theirs.temp_size_in_bytes)
