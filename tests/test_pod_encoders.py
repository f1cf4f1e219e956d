"""Real encoders on pods: text encoders under explicit mesh axes, and FSDP encoders.

* A text encoder starts with an embedding lookup. Under sharded ``jit`` over explicit
  mesh axes (``jax.make_mesh``'s default on JAX 0.12) every entry point encodes each
  device's rows as plain local arrays (``encoder_view="local"``), so ``table[ids]``
  needs no annotation: plain JAX, NNX ``Embed``, Linen ``Embed``, Keras ``Embedding``
  and Equinox ``Embedding``.
* An encoder written for plain ``jit`` over the mesh (``out_sharding=P("data")``,
  ``with_sharding_constraint``, weights sharded over the batch axis and gathered per
  layer: FSDP) runs unchanged: its chunks span the devices (``encoder_view="global"``).
* The same FSDP stack as an NNX model (layers made by ``nnx.vmap``, run by
  ``nnx.scan`` with ``nnx.remat``) through ``GradCache``, under ``jax.jit`` and
  ``nnx.jit``.

Every case is compared with ``jax.value_and_grad`` of the same loss over the whole,
unsharded batch.
"""

import contextlib
import functools
import os
import re

import chex
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import gc_jax
from gc_jax.compat import cachex
from gc_jax.compat.functional import cached

os.environ.setdefault("KERAS_BACKEND", "jax")  # before keras is imported

VOCAB, DIM, TOKENS, ROWS, CHUNK = 40, 8, 5, 32, 2
TOL = {"rtol": 2e-5, "atol": 2e-6}


@pytest.fixture(autouse=True)
def _eight_devices():
    assert jax.device_count() >= 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"


def loss_fn(p, q, d):
    return gc_jax.losses.contrastive_loss(q, d, temperature=0.5)


def ids_pair():
    ids = jax.random.randint(jax.random.key(2), (ROWS, TOKENS), 0, VOCAB)
    return ids, (ids * 7 + 3) % VOCAB


def lookup_params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "embed": jax.random.normal(k1, (VOCAB, DIM)),
        "w": jax.random.normal(k2, (DIM, DIM)) / 3,
    }


def lookup_encode(p, batch, key):
    """What users write first: a lookup, a layer, mean pooling. No annotation."""
    return jnp.tanh(p["embed"][batch["ids"]] @ p["w"]).mean(1)


def reference(encode, params, *batches):
    total = lambda p: loss_fn(p, *(encode(p, b, None) for b in batches))
    return jax.jit(jax.value_and_grad(total))(params)


def explicit_mesh():
    return jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))


def put(mesh, tree, spec):
    return jax.device_put(tree, NamedSharding(mesh, spec))


def check_grads_placed(grads, params):
    for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
        want = params
        for k in path:
            want = want[k.key]
        assert g.sharding.is_equivalent_to(want.sharding, g.ndim), (
            f"grads{jax.tree_util.keystr(path)} came back as {g.sharding}, the parameter "
            f"is {want.sharding}"
        )


# -- 1. A lookup encoder under explicit axes, every entry point ----------------------


def _value_and_grad(encode):
    return jax.jit(gc_jax.cached_value_and_grad(loss_fn, encode, CHUNK))


def _train_step(encode, batch_axis=None):
    opt = optax.sgd(1.0)  # params - grads: the gradient is read back from the update
    step = gc_jax.make_train_step(loss_fn, encode, CHUNK, optimizer=opt, batch_axis=batch_axis)
    step = jax.jit(step)

    def run(params, q, d):
        (new, _), metrics = step((params, opt.init(params)), q, d)
        return metrics["loss"], jax.tree.map(jnp.subtract, params, new)

    return run


def _chunked_encoder(encode, batch_axis=None):
    enc = gc_jax.chunked_encoder(encode, CHUNK, batch_axis=batch_axis)
    return jax.jit(jax.value_and_grad(lambda p, q, d: loss_fn(p, enc(p, q), enc(p, d))))


def _cachex(encode):
    """The original's JAX port, as Tevatron uses it: pre-chunked batches."""
    fwd = cachex.grad_cached(lambda p, x: encode(p, x, None), None)

    def chunked(p, x):  # 8 chunks, each device holding its own (the chunk axis sharded)
        return fwd(p, cachex.tree_chunk(x, 8))

    return jax.jit(jax.value_and_grad(lambda p, q, d: loss_fn(p, chunked(p, q), chunked(p, d))))


def _functional(encode):
    """``gc_jax.compat.functional.cached`` on sub-batches, as the original's functional API."""

    def step(p, q, d):
        f = cached(encode)
        halves = [jax.tree.map(lambda x, i=i: x[i * ROWS // 2 : (i + 1) * ROWS // 2], b)
                  for b in (q, d) for i in range(2)]  # fmt: skip
        out = [f(p, h) for h in halves]
        reps = [r for r, _ in out]
        cat = lambda rs: jnp.concatenate(rs)
        value, (gq, gd) = jax.value_and_grad(
            lambda rq, rd: loss_fn(p, cat(rq), cat(rd)), argnums=(0, 1)
        )(reps[:2], reps[2:])
        grads = [back(g) for (_, back), g in zip(out, gq + gd, strict=True)]
        return value, jax.tree.map(lambda *g: sum(g), *grads)

    return jax.jit(step)


ENTRY_POINTS = {
    "cached_value_and_grad": _value_and_grad,
    "make_train_step": _train_step,
    "chunked_encoder": _chunked_encoder,
    "cachex.grad_cached": _cachex,
    "functional.cached": _functional,
}


@pytest.mark.parametrize("with_mesh", [False, True], ids=["no_mesh", "set_mesh"])
@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_a_lookup_encoder_under_explicit_axes(entry, with_mesh):
    ids_q, ids_d = ids_pair()
    params = lookup_params()
    want = reference(lookup_encode, params, {"ids": ids_q}, {"ids": ids_d})
    mesh = explicit_mesh()
    q, d = ({"ids": put(mesh, x, P("data"))} for x in (ids_q, ids_d))
    placed = put(mesh, params, P())
    with jax.set_mesh(mesh) if with_mesh else contextlib.nullcontext():
        got = ENTRY_POINTS[entry](lookup_encode)(placed, q, d)
    chex.assert_trees_all_close(got, want, **TOL)


def test_jax_makes_mesh_axes_explicit_by_default_where_this_matters():
    """Where ``jax.make_mesh`` defaults to explicit axes (JAX 0.12), the lookup runs on
    the mesh a user gets without naming axis types."""
    mesh = jax.make_mesh((8,), ("data",))
    if AxisType.Explicit not in mesh.axis_types:
        pytest.skip(f"jax {jax.__version__}: make_mesh defaults to {mesh.axis_types}")
    ids_q, ids_d = ids_pair()
    params = lookup_params()
    q, d = ({"ids": put(mesh, x, P("data"))} for x in (ids_q, ids_d))
    got = _value_and_grad(lookup_encode)(put(mesh, params, P()), q, d)
    want = reference(lookup_encode, params, {"ids": ids_q}, {"ids": ids_d})
    chex.assert_trees_all_close(got, want, **TOL)


def assert_exact_on_explicit_axes(entry, encode, params):
    """``entry(encode)(params, q, d)`` on token ids split over 8 devices (explicit axes,
    parameters replicated) equals the unsharded full batch's value and gradient."""
    ids_q, ids_d = ids_pair()
    want = reference(encode, params, ids_q, ids_d)
    mesh = explicit_mesh()
    q, d = (put(mesh, x, P("data")) for x in (ids_q, ids_d))
    got = entry(encode)(put(mesh, params, P()), q, d)
    chex.assert_trees_all_close(got, want, **TOL)


def _nnx_model():
    from flax import nnx

    class Text(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)
            self.dense = nnx.Linear(DIM, DIM, rngs=rngs)

        def __call__(self, ids):
            return jnp.tanh(self.dense(self.embed(ids))).mean(1)

    return Text(nnx.Rngs(0))


def test_nnx_embed_through_nnx_encoder():
    from flax import nnx

    model = _nnx_model()
    encode = gc_jax.nnx_encoder(model)
    assert_exact_on_explicit_axes(_value_and_grad, encode, nnx.state(model, nnx.Param))


def test_gradcache_with_an_nnx_embed_model():
    from flax import nnx

    model = _nnx_model()
    gc = gc_jax.compat.GradCache([model, model], CHUNK, loss_fn=lambda a, b: loss_fn(None, a, b))
    entry = lambda _: jax.jit(lambda p, q, d: gc(q, d, params=p))
    encode = gc_jax.nnx_encoder(model)  # the reference's
    assert_exact_on_explicit_axes(entry, encode, nnx.state(model, nnx.Param))


def test_linen_embed_through_linen_encoder():
    import flax.linen as nn

    class Text(nn.Module):
        @nn.compact
        def __call__(self, ids):
            h = nn.Embed(VOCAB, DIM)(ids)
            return jnp.tanh(nn.Dense(DIM)(h)).mean(1)

    module = Text()
    params = module.init(jax.random.key(0), ids_pair()[0][:2])["params"]
    assert_exact_on_explicit_axes(_train_step, gc_jax.linen_encoder(module), params)


def test_keras_embedding_through_keras_encoder():
    keras = pytest.importorskip("keras")
    keras.utils.set_random_seed(0)
    ids_in = keras.Input((TOKENS,), dtype="int32")
    h = keras.layers.Embedding(VOCAB, DIM)(ids_in)
    out = keras.ops.mean(keras.layers.Dense(DIM, activation="tanh")(h), axis=1)
    encode, params = gc_jax.keras_encoder(keras.Model(ids_in, out))
    assert_exact_on_explicit_axes(_value_and_grad, encode, params)


def test_equinox_embedding_through_equinox_encoder():
    eqx = pytest.importorskip("equinox")

    class Text(eqx.Module):
        embed: eqx.nn.Embedding
        dense: eqx.nn.Linear

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.embed = eqx.nn.Embedding(VOCAB, DIM, key=k1)
            self.dense = eqx.nn.Linear(DIM, DIM, key=k2)

        def __call__(self, ids):  # one row, as Equinox models are written
            return jnp.tanh(jax.vmap(lambda t: self.dense(self.embed(t)))(ids)).mean(0)

    encode, params = gc_jax.equinox_encoder(Text(jax.random.key(0)))
    assert_exact_on_explicit_axes(_chunked_encoder, encode, params)


# -- 2. Encoders written for plain jit over the mesh run unchanged -------------------


def annotated_encode(p, batch, key):
    """A lookup as plain JAX code over explicit axes writes it."""
    h = p["embed"].at[batch["ids"]].get(out_sharding=P("data"))
    h = jax.lax.with_sharding_constraint(jnp.tanh(h @ p["w"]), P("data"))
    return h.mean(1)


@pytest.mark.parametrize("entry", ["cached_value_and_grad", "make_train_step", "chunked_encoder"])
def test_an_encoder_written_for_plain_jit_runs_unchanged(entry):
    mesh = explicit_mesh()
    ids_q, ids_d = ids_pair()
    params = lookup_params()
    q, d = ({"ids": put(mesh, x, P("data"))} for x in (ids_q, ids_d))
    placed = put(mesh, params, P())
    with jax.set_mesh(mesh):  # plain JAX's own step needs the mesh for the lookup
        want = jax.jit(
            jax.value_and_grad(
                lambda p: loss_fn(p, annotated_encode(p, q, None), annotated_encode(p, d, None))
            )
        )(placed)
        got = ENTRY_POINTS[entry](annotated_encode)(placed, q, d)
    chex.assert_trees_all_close(got, want, **TOL)
    chex.assert_trees_all_close(got, reference(lookup_encode, params, *_dicts()), **TOL)


def _dicts():
    ids_q, ids_d = ids_pair()
    return {"ids": ids_q}, {"ids": ids_d}


def test_encoder_view_is_checked_and_local_refuses_an_annotated_encoder():
    with pytest.raises(ValueError, match="encoder_view must be one of"):
        gc_jax.cached_value_and_grad(loss_fn, lookup_encode, CHUNK, encoder_view="spmd")
    mesh = explicit_mesh()
    q, d = ({"ids": put(mesh, x, P("data"))} for x in ids_pair())
    step = jax.jit(
        gc_jax.cached_value_and_grad(loss_fn, annotated_encode, CHUNK, encoder_view="local")
    )
    with jax.set_mesh(mesh), pytest.raises(Exception, match="data"):
        step(put(mesh, lookup_params(), P()), q, d)


# -- 3. FSDP: weights sharded over the batch axis, gathered layer by layer ----------

LAYERS, WIDTH = 3, 16


def fsdp_params():
    ks = jax.random.split(jax.random.key(5), 3)
    return {
        "embed": jax.random.normal(ks[0], (VOCAB, WIDTH)),
        "layers": {
            "w_in": jax.random.normal(ks[1], (LAYERS, WIDTH, 2 * WIDTH)) / 4,
            "w_out": jax.random.normal(ks[2], (LAYERS, 2 * WIDTH, WIDTH)) / 6,
        },
    }


FSDP_SPECS = {
    "embed": P("data", None),
    "layers": {"w_in": P(None, "data", None), "w_out": P(None, "data", None)},
}


def fsdp_annotations(explicit: bool, sharded: bool = True):
    """``(gather, rows, lookup)`` as JAX FSDP code writes them: a weight whole on every
    device, activations split by rows, and the embedding lookup. ``sharded=False``:
    none (the unsharded reference)."""
    if not sharded:
        return (lambda w: w), (lambda h: h), (lambda table, ids: table[ids])
    if explicit:
        rows = lambda h: jax.sharding.reshard(h, P("data"))
        lookup = lambda table, ids: table.at[ids].get(out_sharding=P("data"))
        return (lambda w: jax.sharding.reshard(w, P())), rows, lookup
    rows = lambda h: jax.lax.with_sharding_constraint(h, P("data"))
    return (lambda w: jax.lax.with_sharding_constraint(w, P())), rows, lambda t, i: rows(t[i])


def fsdp_encoder(explicit: bool, sharded: bool = True):
    """A transformer-shaped stack: layers in a ``scan`` with per-layer remat, each
    layer's weights gathered just before use, activations constrained by rows."""
    gather, rows, lookup = fsdp_annotations(explicit, sharded)

    def encode(p, batch, key):
        h = lookup(gather(p["embed"]), batch["ids"])

        @jax.checkpoint
        def layer(h, w):
            up = jax.nn.gelu(h @ gather(w["w_in"]))
            return rows(h + up @ gather(w["w_out"])), None

        h, _ = jax.lax.scan(layer, h, p["layers"])
        return h.mean(1)

    return encode


@pytest.mark.parametrize("explicit", [True, False], ids=["explicit", "auto"])
@pytest.mark.parametrize(
    "entry", ["cached_value_and_grad", "make_train_step", "chunked_encoder", "functional.cached"]
)
def test_an_fsdp_encoder(entry, explicit):
    axis_type = AxisType.Explicit if explicit else AxisType.Auto
    mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
    params = fsdp_params()
    want = reference(fsdp_encoder(explicit, sharded=False), params, *_dicts())
    placed = jax.tree.map(lambda v, s: put(mesh, v, s), params, FSDP_SPECS)
    q, d = ({"ids": put(mesh, x, P("data"))} for x in ids_pair())
    axis = None if explicit else "data"
    make = {
        "cached_value_and_grad": lambda e: jax.jit(
            gc_jax.cached_value_and_grad(loss_fn, e, CHUNK, batch_axis=axis)
        ),
        "make_train_step": lambda e: _train_step(e, batch_axis=axis),
        "chunked_encoder": lambda e: _chunked_encoder(e, batch_axis=axis),
        "functional.cached": _functional,
    }[entry]
    with jax.set_mesh(mesh):
        got = make(fsdp_encoder(explicit))(placed, q, d)
    chex.assert_trees_all_close(got, want, rtol=5e-5, atol=5e-6)
    if explicit and entry != "make_train_step":  # auto axes: the compiler's choice, as plain
        check_grads_placed(got[1], placed)  # jit's (replicated here); out_shardings decide


def _three_calls(encode, n_chunk):
    """The original's three-call form: ``chunk_encode`` over bound params, the loss on
    the caches, ``cache_grad``."""
    enc = lambda params, ids: encode(params, {"ids": ids}, None)

    def step(p, q, d):
        qq, dd = (cachex.tree_chunk(b, n_chunk) for b in (q, d))
        reps = [cachex.chunk_encode(functools.partial(enc, p))(**b) for b in (qq, dd)]
        loss_of = cachex.unchunk_args(axis=0, argnums=(1, 2))(loss_fn)
        value, gs = jax.value_and_grad(loss_of, argnums=(1, 2))(p, *reps)
        grads = jax.tree.map(jnp.zeros_like, p)
        for g, b in zip(gs, (qq, dd), strict=True):
            grads = cachex.cache_grad(enc)(p, grads, g, **b)
        return value, grads

    return jax.jit(step)


def _cachex_fsdp(explicit: bool, n_chunk: int, rows: int, three_calls: bool = False):
    """The original's port on an FSDP encoder: ``rows`` query and passage rows cut into
    ``n_chunk`` chunks of the batch as placed (split over ``data``)."""
    axis_type = AxisType.Explicit if explicit else AxisType.Auto
    mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
    ids = jax.random.randint(jax.random.key(3), (rows, TOKENS), 0, VOCAB)
    batches = {"ids": ids}, {"ids": (ids * 7 + 3) % VOCAB}
    params = fsdp_params()
    want = reference(fsdp_encoder(False, sharded=False), params, *batches)
    placed = jax.tree.map(lambda v, s: put(mesh, v, s), params, FSDP_SPECS)
    fwd = cachex.grad_cached(lambda p, x: fsdp_encoder(explicit)(p, x, None), None)
    chunked = lambda p, x: fwd(p, cachex.tree_chunk(x, n_chunk))
    step = jax.jit(jax.value_and_grad(lambda p, q, d: loss_fn(p, chunked(p, q), chunked(p, d))))
    if three_calls:
        step = _three_calls(fsdp_encoder(explicit), n_chunk)
    with jax.set_mesh(mesh):
        return step(placed, *(put(mesh, b, P("data")) for b in batches)), want


@pytest.mark.parametrize(
    "explicit, n_chunk, rows, three_calls",
    [(False, 8, ROWS, False), (True, 8, 64, False), (True, 4, 64, False), (True, 8, 64, True)],
    ids=["auto", "explicit-chunks-moved", "explicit-chunks-spread-by-tree_chunk", "three-calls"],
)
def test_an_fsdp_encoder_through_the_cachex_port(explicit, n_chunk, rows, three_calls):
    """Under explicit axes, 8 chunks of a batch split over ``data`` lie one per device;
    the encoder constrains each chunk's rows to ``data``, so ``grad_cached`` (and the
    three-call form) spreads every chunk over the devices first (params sharded over
    ``data``). With 4 chunks ``tree_chunk`` spreads them itself. Under auto axes it is
    exact as written."""
    got, want = _cachex_fsdp(explicit, n_chunk, rows, three_calls)
    chex.assert_trees_all_close(got, want, rtol=5e-5, atol=5e-6)


def test_the_cachex_port_names_chunks_too_small_to_spread_over_fsdp_devices():
    """8 chunks of 4 rows cannot each be split over 8 devices under explicit axes."""
    with pytest.raises(ValueError, match=r"batch\['ids'\] has shape \(8, 4, 5\).*FSDP.*larger"):
        _cachex_fsdp(True, 8, ROWS)


def test_local_refuses_parameters_sharded_over_the_batch_axis():
    mesh = explicit_mesh()
    placed = jax.tree.map(lambda v, s: put(mesh, v, s), fsdp_params(), FSDP_SPECS)
    q, d = ({"ids": put(mesh, x, P("data"))} for x in ids_pair())
    step = jax.jit(
        gc_jax.cached_value_and_grad(loss_fn, fsdp_encoder(True), CHUNK, encoder_view="local")
    )
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="sharded over the batch axes"):
        step(placed, q, d)


def test_the_local_view_all_reduces_once_per_step():
    """Per-device encoding keeps every chunk's gradient on its device: no all-reduce
    inside the compiled step's loops."""
    mesh = explicit_mesh()
    q, d = ({"ids": put(mesh, x, P("data"))} for x in ids_pair())
    placed = put(mesh, lookup_params(), P())
    hlo = _value_and_grad(lookup_encode).lower(placed, q, d).compile().as_text()
    names = set(re.findall(r"body=%?([\w.\-]+)", hlo))
    blocks = re.split(r"\n(?=\S)", hlo)
    bodies = [b for b in blocks if any(re.match(rf"%?{re.escape(n)}\b", b) for n in names)]
    assert bodies, "expected the chunk loops in the compiled step"
    assert not any("all-reduce" in b for b in bodies), "an all-reduce runs once per chunk"
    assert "all-reduce" in hlo, "expected the step's one gradient all-reduce"


# -- 4. FSDP in NNX: layers made by nnx.vmap, run by nnx.scan with nnx.remat ---------


def nnx_fsdp_model(explicit: bool, sharded: bool = True):
    """The FSDP stack of section 3 as an NNX model, with the same weights."""
    from flax import nnx

    gather, rows, lookup = fsdp_annotations(explicit, sharded)
    weights = fsdp_params()

    class Block(nnx.Module):
        def __init__(self, w_in, w_out):
            self.w_in, self.w_out = nnx.Param(w_in), nnx.Param(w_out)

        def __call__(self, h):
            up = jax.nn.gelu(h @ gather(self.w_in[...]))
            return rows(h + up @ gather(self.w_out[...]))

    class Stack(nnx.Module):
        def __init__(self):
            self.embed = nnx.Param(weights["embed"])
            self.layers = nnx.vmap(Block)(weights["layers"]["w_in"], weights["layers"]["w_out"])

        def __call__(self, ids):
            h = lookup(gather(self.embed[...]), ids)
            layer = nnx.remat(lambda h, block: block(h))  # per-layer remat
            run = nnx.scan(layer, in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            return run(h, self.layers).mean(1)

    return Stack()


def test_an_nnx_model_with_scanned_layers_on_one_device():
    """``nnx.scan`` inside the model refuses variables made in another trace: the
    encoders merge the state afresh in each chunk's."""
    from flax import nnx

    model = nnx_fsdp_model(False, sharded=False)
    ids_q, ids_d = ids_pair()
    want = reference(lambda p, b, k: fsdp_encoder(False, False)(p, {"ids": b}, k),
                     fsdp_params(), ids_q, ids_d)  # fmt: skip
    loss, grads = _value_and_grad(gc_jax.nnx_encoder(model))(
        nnx.state(model, nnx.Param), ids_q, ids_d
    )
    chex.assert_trees_all_close((loss, nnx.to_pure_dict(grads)), want, **TOL)


@pytest.mark.parametrize("explicit", [True, False], ids=["explicit", "auto"])
@pytest.mark.parametrize("step", ["jax.jit", "nnx.jit"])
def test_an_nnx_fsdp_model_through_gradcache(step, explicit):
    from flax import nnx

    axis_type = AxisType.Explicit if explicit else AxisType.Auto
    mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
    reference_model = nnx_fsdp_model(explicit, sharded=False)
    want = reference(gc_jax.nnx_encoder(reference_model), nnx.state(reference_model, nnx.Param),
                     *ids_pair())  # fmt: skip
    model = nnx_fsdp_model(explicit)
    spec = lambda path: (
        P("data", None) if "embed" in jax.tree_util.keystr(path) else P(None, "data", None)
    )  # as FSDP_SPECS
    placed = jax.tree_util.tree_map_with_path(
        lambda path, v: put(mesh, v, spec(path)), nnx.state(model, nnx.Param)
    )
    q, d = (put(mesh, x, P("data")) for x in ids_pair())
    gc = gc_jax.compat.GradCache(
        [model, model], CHUNK, loss_fn=lambda a, b: loss_fn(None, a, b),
        batch_axis=None if explicit else "data",
    )  # fmt: skip
    with jax.set_mesh(mesh):
        if step == "jax.jit":
            got = jax.jit(lambda p, q, d: gc(q, d, params=p))(placed, q, d)
        else:
            nnx.update(model, placed)  # the usual NNX loop: the model is the argument
            got = nnx.jit(lambda m, q, d: gc(q, d))(model, q, d)
    chex.assert_trees_all_close(got, want, rtol=5e-5, atol=5e-6)
    if explicit:  # gathered layer by layer: gradients stay sharded like the weights
        chex.assert_trees_all_equal_structs(got[1], nnx.state(model, nnx.Param))
        for g, w in zip(jax.tree.leaves(got[1]), jax.tree.leaves(placed), strict=True):
            assert g.sharding.is_equivalent_to(w.sharding, g.ndim), (g.sharding, w.sharding)
