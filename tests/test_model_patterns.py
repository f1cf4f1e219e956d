"""The patterns the JAX model libraries rely on, in plain JAX, with default arguments.

MaxText, Google DeepMind's ``gemma`` library and Penzai are too heavy for CI
(``benchmarks/model_libraries.py`` runs them; see ``docs/model_libraries.md``). What
they do to a batch is tested here with a tiny text embedder (lookup, a layer, a final
RMS norm, attention-mask-aware mean pooling, a dense head, L2 norm):

* MaxText: a mesh with axes ``("data", "fsdp", "tensor")`` (auto axes, ``jax.set_mesh``),
  weights sharded over ``fsdp`` by its logical axis rules, and activations constrained
  with ``NamedSharding(mesh, P(("data", "fsdp"), None, None))``; FSDP ``(1, 8, 1)`` and
  data parallel ``(8, 1, 1)``.
* FSDP weights with and without activation constraints, on explicit and auto axes.
* Penzai: a model written over named axes (``jax.vmap`` with ``axis_name`` and
  collectives over the token axis), on explicit and auto axes.

Each is ``gc_jax.cached_value_and_grad`` with default arguments (``batch_axis`` where
the mesh has auto axes, as the docs say) under ``jax.jit`` on 8 devices, compared with
``jax.value_and_grad`` of the same loss over the whole, unsharded batch.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import gc_jax
from gc_jax import pooling

VOCAB, WIDTH, TOKENS, ROWS, CHUNK = 32, 16, 6, 32, 2
TOL = {"rtol": 5e-5, "atol": 5e-6}
BATCH_AXES = ("data", "fsdp")


@pytest.fixture(autouse=True)
def _eight_devices():
    assert jax.device_count() >= 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"


def loss_fn(params, q, d):
    return gc_jax.losses.contrastive_loss(q, d, temperature=0.1)


def params():
    k = jax.random.split(jax.random.key(0), 4)
    return {
        "embed": jax.random.normal(k[0], (VOCAB, WIDTH)),
        "w_in": jax.random.normal(k[1], (WIDTH, 2 * WIDTH)) / 4,
        "w_out": jax.random.normal(k[2], (2 * WIDTH, WIDTH)) / 6,
        "norm": jnp.ones((WIDTH,)),
        "head": jax.random.normal(k[3], (WIDTH, 8)) / 4,
    }


def batches():
    """Two batches of token ids with right padding (lengths 2 to ``TOKENS``)."""
    ids = jax.random.randint(jax.random.key(1), (ROWS, TOKENS), 0, VOCAB)
    lengths = 2 + np.arange(ROWS) % (TOKENS - 1)
    mask = jnp.asarray(np.arange(TOKENS)[None] < lengths[:, None], jnp.int32)
    return {"ids": ids, "mask": mask}, {"ids": (ids * 5 + 1) % VOCAB, "mask": mask[::-1]}


def rms_norm(h, scale):
    return h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6) * scale


def make_encoder(rows=None, gather=None, lookup=None):
    """The embedder; ``rows`` constrains activations, ``gather`` a weight before use."""
    rows, gather = rows or (lambda h: h), gather or (lambda w: w)
    lookup = lookup or (lambda t, i: t[i])

    def encode(p, batch, key):
        h = rows(lookup(gather(p["embed"]), batch["ids"]))
        h = rows(h + jax.nn.gelu(h @ gather(p["w_in"])) @ gather(p["w_out"]))
        h = rms_norm(h, gather(p["norm"]))  # the decoder's final norm
        return pooling.embed(h, batch["mask"], head=gather(p["head"]))

    return encode


@functools.cache
def reference(encode):
    """``jax.value_and_grad`` of the loss over the whole, unsharded batch (once per model)."""
    q, d = batches()
    full = lambda p: loss_fn(p, encode(p, q, None), encode(p, d, None))
    return jax.jit(jax.value_and_grad(full))(params())


def place(mesh, specs, batch_spec):
    put = lambda tree, spec: jax.device_put(tree, NamedSharding(mesh, spec))
    placed = {k: put(v, specs.get(k, P())) for k, v in params().items()}
    return placed, *(put(b, batch_spec) for b in batches())


plain_encode = make_encoder()  # no annotation: the reference's model

# -- MaxText: its mesh, its logical axis rules, activations constrained by rows -------

MAXTEXT_SPECS = {  # MaxText's rules: "embed" -> fsdp, "mlp" / "vocab" -> tensor
    "embed": P("tensor", "fsdp"),
    "w_in": P("fsdp", "tensor"),
    "w_out": P("tensor", "fsdp"),
    "head": P("fsdp", None),
}


@pytest.mark.parametrize("shape", [(1, 8, 1), (8, 1, 1)], ids=["fsdp", "data_parallel"])
def test_maxtext_style_constraints_on_an_auto_mesh(shape):
    mesh = jax.make_mesh(shape, ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)
    rows = lambda h: jax.lax.with_sharding_constraint(
        h, NamedSharding(mesh, P(BATCH_AXES, None, None))
    )
    placed, q, d = place(mesh, MAXTEXT_SPECS, P(BATCH_AXES))
    step = gc_jax.cached_value_and_grad(loss_fn, make_encoder(rows), CHUNK, batch_axis=BATCH_AXES)
    with jax.set_mesh(mesh):
        got = jax.jit(step)(placed, q, d)
    chex.assert_trees_all_close(got, reference(plain_encode), **TOL)


# -- FSDP weights, with and without activation constraints ---------------------------

FSDP_SPECS = {"embed": P("data", None), "w_in": P("data", None), "w_out": P(None, "data")}


def fsdp_annotations(explicit, constrained):
    """``(rows, gather, lookup)`` as FSDP code writes them on explicit or auto axes."""
    if explicit:  # explicit axes: the weights are gathered by hand, the lookup typed
        rows = lambda h: jax.sharding.reshard(h, P("data", None, None))
        gather = lambda w: jax.sharding.reshard(w, P())
        lookup = lambda t, i: t.at[i].get(out_sharding=P("data", None, None))
        return (rows if constrained else lambda h: h), gather, lookup
    rows = lambda h: jax.lax.with_sharding_constraint(h, P("data", None, None))
    return (rows if constrained else lambda h: h), (lambda w: w), (lambda t, i: t[i])


@pytest.mark.parametrize("constrained", [True, False], ids=["constrained", "unconstrained"])
@pytest.mark.parametrize("explicit", [True, False], ids=["explicit", "auto"])
def test_fsdp_weights(explicit, constrained):
    axis_type = AxisType.Explicit if explicit else AxisType.Auto
    mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
    encode = make_encoder(*fsdp_annotations(explicit, constrained))
    placed, q, d = place(mesh, FSDP_SPECS, P("data"))
    step = gc_jax.cached_value_and_grad(
        loss_fn, encode, CHUNK, batch_axis=None if explicit else "data"
    )
    with jax.set_mesh(mesh):
        got = jax.jit(step)(placed, q, d)
    chex.assert_trees_all_close(got, reference(plain_encode), **TOL)


# -- Penzai: a model over named axes ---------------------------------------------------


def named_axis_encode(p, batch, key):
    """Each token is a call over the named axis ``"seq"`` (collectives reduce over it),
    each row a call over ``"batch"``: how Penzai's named arrays run their layers."""

    def token(ids, m):
        h = p["embed"][ids]
        mixed = h + jax.lax.pmean(h, "seq")  # a token-mixing layer over the named axis
        h = rms_norm(mixed + jax.nn.gelu(mixed @ p["w_in"]) @ p["w_out"], p["norm"])
        pooled = jax.lax.psum(h * m, "seq") / jax.lax.psum(m, "seq")
        return pooled @ p["head"]

    row = lambda ids, m: jax.vmap(token, axis_name="seq")(ids, m.astype(jnp.float32))[0]
    return pooling.l2_normalize(jax.vmap(row, axis_name="batch")(batch["ids"], batch["mask"]))


@pytest.mark.parametrize("explicit", [True, False], ids=["explicit", "auto_fsdp"])
def test_a_named_axis_model(explicit):
    axis_type = AxisType.Explicit if explicit else AxisType.Auto
    mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
    placed, q, d = place(mesh, {} if explicit else FSDP_SPECS, P("data"))
    step = gc_jax.cached_value_and_grad(
        loss_fn, named_axis_encode, CHUNK, batch_axis=None if explicit else "data"
    )
    with jax.set_mesh(mesh):
        got = jax.jit(step)(placed, q, d)
    chex.assert_trees_all_close(got, reference(named_axis_encode), **TOL)
