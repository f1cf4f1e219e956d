"""The default encoder view finds annotations in custom derivative rules and on other meshes.

``encoder_view="auto"`` reads the encoder's jaxpr and its VJP's (where JAX traces the
``custom_vjp`` forward and backward rules and the ``custom_jvp`` rule): an annotation
naming a batch axis, or any axis of another mesh, gives the encoder the chunk spanning
the devices, as plain ``jit``. Each form is exact against ``jax.value_and_grad`` of
the full batch under ``jit``; a forced ``encoder_view="local"`` names the rule.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import gc_jax
from gc_jax.losses import contrastive_loss

ROWS, CHUNK = 16, 4
TOL = {"rtol": 1e-5, "atol": 1e-6}
WHERE = ["fwd", "bwd", "jvp"]


def loss_fn(params, q, d):
    return contrastive_loss(q, d, temperature=0.5)


def annotate(x, sharding, explicit):
    if explicit:
        return jax.sharding.reshard(x, sharding)
    return jax.lax.with_sharding_constraint(x, sharding)


def rule_encoder(where, sharding, explicit=False):
    """An encoder whose custom_vjp forward or backward rule, or custom_jvp rule, holds
    an annotation (or, ``where="primal"``, whose own body does)."""
    mark = lambda at, x: annotate(x, sharding, explicit) if where == at else x

    @jax.custom_vjp
    def squash(x):
        return jnp.tanh(x)

    def squash_fwd(x):
        y = jnp.tanh(mark("fwd", x))
        return y, y

    def squash_bwd(y, g):
        return (mark("bwd", g * (1 - y**2)),)

    squash.defvjp(squash_fwd, squash_bwd)

    @jax.custom_jvp
    def wave(x):
        return jnp.sin(x)

    @wave.defjvp
    def wave_jvp(primals, tangents):
        return jnp.sin(primals[0]), mark("jvp", jnp.cos(primals[0]) * tangents[0])

    def encode(params, x, key):
        h = mark("primal", jnp.einsum("btd,de->bte", x, params["w"]))
        return wave(squash(h)).mean(1)

    return encode


def setup(explicit):
    types = (AxisType.Explicit if explicit else AxisType.Auto,)
    mesh = jax.make_mesh((8,), ("data",), axis_types=types)
    params = {"w": jnp.linspace(-0.5, 0.5, 16).reshape(4, 4)}
    keys = jax.random.split(jax.random.key(0))
    sharding = NamedSharding(mesh, P("data"))
    q, d = [jax.device_put(jax.random.normal(k, (ROWS, 3, 4)), sharding) for k in keys]
    return mesh, params, q, d, (None if explicit else "data")


def full_batch(encode, params, q, d):
    return jax.value_and_grad(lambda p: loss_fn(p, encode(p, q, None), encode(p, d, None)))(params)


def three_forms(encode, batch_axis, view="auto"):
    """``(params, q, d) -> (loss, grads)`` through cached_value_and_grad, chunked_encoder
    and make_train_step (the gradient recovered from one SGD step of rate 1)."""
    cached = gc_jax.cached_value_and_grad(loss_fn, encode, CHUNK, batch_axis=batch_axis,
                                          encoder_view=view)  # fmt: skip
    chunked = gc_jax.chunked_encoder(encode, CHUNK, batch_axis=batch_axis, encoder_view=view)
    through = lambda p, q, d: jax.value_and_grad(
        lambda p: loss_fn(p, chunked(p, q), chunked(p, d))
    )(p)
    step = gc_jax.make_train_step(loss_fn, encode, CHUNK, optimizer=optax.sgd(1.0),
                                  batch_axis=batch_axis, encoder_view=view)  # fmt: skip

    def trained(p, q, d):
        (new, _), metrics = step((p, optax.sgd(1.0).init(p)), q, d)
        return metrics["loss"], jax.tree.map(jnp.subtract, p, new)

    return {"cached_value_and_grad": cached, "chunked_encoder": through, "make_train_step": trained}


@pytest.mark.parametrize("explicit", [False, True], ids=["auto_mesh", "explicit_mesh"])
@pytest.mark.parametrize("where", WHERE)
def test_an_annotation_in_a_custom_rule_spans_the_devices(where, explicit):
    mesh, params, q, d, batch_axis = setup(explicit)
    encode = rule_encoder(where, NamedSharding(mesh, P("data")), explicit)
    with jax.set_mesh(mesh):
        want = jax.jit(full_batch, static_argnums=0)(encode, params, q, d)
        for name, form in three_forms(encode, batch_axis).items():
            got = jax.jit(form)(params, q, d)
            chex.assert_trees_all_close(got, want, **TOL, custom_message=name)


def test_an_annotation_on_another_mesh_of_the_same_devices_spans_the_devices():
    """``P("batch")`` on a mesh named ``("batch",)`` while the batch is split over
    ``"data"``: not a batch axis, yet not valid inside shard_map over ``"data"``."""
    mesh, params, q, d, batch_axis = setup(explicit=False)
    other = NamedSharding(Mesh(np.array(jax.devices()), ("batch",)), P("batch"))
    encode = rule_encoder("primal", other)
    with jax.set_mesh(mesh):
        want = jax.jit(full_batch, static_argnums=0)(encode, params, q, d)
        for name, form in three_forms(encode, batch_axis).items():
            got = jax.jit(form)(params, q, d)
            chex.assert_trees_all_close(got, want, **TOL, custom_message=name)
        with pytest.raises(ValueError, match=r"on another mesh \(sharding_constraint to "
                           r"P\('batch',\) on a mesh of axes \(\('batch', 8\),\)"):  # fmt: skip
            jax.jit(three_forms(encode, batch_axis, "local")["cached_value_and_grad"])(params, q, d)


@pytest.mark.parametrize(
    "where, rule",
    [("fwd", "forward rule 'squash_fwd' of the custom_vjp function 'squash'"),
     ("jvp", "JVP rule 'wave_jvp' of the custom_jvp function 'wave'"),
     ("bwd", "backward rule 'squash_bwd' of the custom_vjp function 'squash'")],
)  # fmt: skip
def test_a_forced_local_view_names_the_annotation_and_its_rule(where, rule):
    mesh, params, q, d, batch_axis = setup(explicit=False)
    encode = rule_encoder(where, NamedSharding(mesh, P("data")))
    with jax.set_mesh(mesh):
        for name, form in three_forms(encode, batch_axis, "local").items():
            error = pytest.raises(ValueError, match="encoder_view='local' cannot be used here")
            with error as info:
                jax.jit(form)(params, q, d)
            message = str(info.value)
            assert "sharding annotation (sharding_constraint to P('data',))" in message, name
            assert rule in message, (name, message)


def test_a_model_axis_annotation_in_a_rule_keeps_the_local_view(caplog):
    """Naming only a model axis of the batch's own mesh is harmless per device."""
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    encode = rule_encoder("bwd", NamedSharding(mesh, P(None, None, "model")))
    params = {"w": jnp.linspace(-0.5, 0.5, 16).reshape(4, 4)}
    keys = jax.random.split(jax.random.key(0))
    q, d = [jax.device_put(jax.random.normal(k, (ROWS, 3, 4)), NamedSharding(mesh, P("data")))
            for k in keys]  # fmt: skip
    with jax.set_mesh(mesh), caplog.at_level("INFO", logger="gc_jax"):
        want = jax.jit(full_batch, static_argnums=0)(encode, params, q, d)
        got = jax.jit(three_forms(encode, "data")["cached_value_and_grad"])(params, q, d)
    chex.assert_trees_all_close(got, want, **TOL)
    assert "span the devices" not in caplog.text
