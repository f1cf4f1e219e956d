"""How ``encoder_view="auto"`` decides what an encoder sees of a chunk under ``jit`` over
a batch split across devices, and the notes on errors that plain ``jit`` raises too."""

import logging

import chex
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import gc_jax
from gc_jax.losses import contrastive_loss

ROWS, CHUNK = 16, 4


def loss_fn(params, q, d):
    return contrastive_loss(q, d, temperature=0.5)


def batch(mesh, spec):
    kq, kd = jax.random.split(jax.random.key(0))
    sharding = NamedSharding(mesh, spec)
    return [jax.device_put(jax.random.normal(k, (ROWS, 3, 4)), sharding) for k in (kq, kd)]


def constrained_encoder(constraint):
    """MaxText's pattern: activations constrained to the batch axes, layer by layer."""

    def encode(params, x, key):
        h = jax.lax.with_sharding_constraint(x, constraint)
        h = jnp.tanh(jnp.einsum("btd,de->bte", h, params["w"]))
        return jax.lax.with_sharding_constraint(h, constraint).mean(1)

    return encode


def full_batch(encode, params, q, d):
    return jax.value_and_grad(lambda p: loss_fn(p, encode(p, q, None), encode(p, d, None)))(params)


@pytest.mark.parametrize("shape", [(1, 8, 1), (8, 1, 1)], ids=["fsdp8", "data8"])
def test_constraints_naming_the_batch_axes_on_an_auto_mesh(shape, caplog):
    """Inside shard_map over the batch axes such a constraint names manual axes, which
    JAX 0.12 refuses only when the step is lowered: 'auto' reads it from the jaxpr and
    gives the encoder the chunk spanning the devices. 'local' says why it cannot."""
    mesh = jax.make_mesh(shape, ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)
    rows = ("data", "fsdp")
    encode = constrained_encoder(NamedSharding(mesh, P(rows, None, None)))
    params = {"w": jnp.linspace(-0.5, 0.5, 16).reshape(4, 4)}
    q, d = batch(mesh, P(rows))
    with jax.set_mesh(mesh):
        want = jax.jit(full_batch, static_argnums=0)(encode, params, q, d)
        step = gc_jax.cached_value_and_grad(loss_fn, encode, CHUNK, batch_axis=rows)
        with caplog.at_level(logging.INFO, logger="gc_jax"):
            got = jax.jit(step)(params, q, d)
        local = gc_jax.cached_value_and_grad(
            loss_fn, encode, CHUNK, batch_axis=rows, encoder_view="local"
        )
        with pytest.raises(ValueError, match=r"encoder_view='local' cannot be used here: .*"
                           r"sharding annotation \(sharding_constraint to P\(\('data', 'fsdp'\)"
                           r".*use encoder_view='auto' or 'global'"):  # fmt: skip
            jax.jit(local)(params, q, d)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
    assert "names the batch axes ('data', 'fsdp') in a sharding annotation" in caplog.text


def test_an_unannotated_encoder_on_an_auto_mesh_keeps_the_local_view(caplog):
    """No annotation naming the batch axes: each device encodes its own rows (no log)."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    encode = constrained_encoder(NamedSharding(mesh, P(None, None, None)))
    params = {"w": jnp.linspace(-0.5, 0.5, 16).reshape(4, 4)}
    q, d = batch(mesh, P("data"))
    with jax.set_mesh(mesh):
        want = jax.jit(full_batch, static_argnums=0)(encode, params, q, d)
        step = gc_jax.cached_value_and_grad(loss_fn, encode, CHUNK, batch_axis="data")
        with caplog.at_level(logging.INFO, logger="gc_jax"):
            got = jax.jit(step)(params, q, d)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
    assert "span the devices" not in caplog.text


def test_a_vmapped_lookup_of_fsdp_weights_under_explicit_axes_names_the_fix():
    """A named-axis model (Penzai's pattern) vmaps its lookup over the rows with the
    table unmapped: with the table sharded over the batch axes (FSDP) under explicit
    axes, JAX refuses it under plain jit too. gc_jax's note names the meshes that work."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))

    def encode(params, ids, key):
        rows = jax.vmap(lambda table, i: table[i], in_axes=(None, 0))(params["table"], ids)
        return rows.mean(1)

    table = jax.device_put(jnp.ones((16, 4)), NamedSharding(mesh, P("data", None)))
    ids = [jax.device_put(jnp.arange(ROWS * 3).reshape(ROWS, 3) % 16,
                          NamedSharding(mesh, P("data")))] * 2  # fmt: skip
    step = gc_jax.cached_value_and_grad(loss_fn, encode, CHUNK)
    error = pytest.raises(ValueError, match="Unmapped values passed to vmap")
    with jax.set_mesh(mesh), error as info:
        jax.jit(step)({"table": table}, *ids)
    note = "\n".join(getattr(info.value, "__notes__", []))
    assert "plain jit of the full batch fails the same way" in note
    assert "axis_types=(AxisType.Auto," in note and "batch_axis=" in note


def test_a_scan_over_layers_sharded_along_the_layer_axis_names_the_fix():
    """MaxText's shard_mode='explicit' with scanned layers: lax.scan refuses stacked
    weights whose layer axis is sharded (plain jit too); the note says what works."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))

    def encode(params, x, key):
        body = lambda h, w: (jnp.tanh(h @ jax.sharding.reshard(w, P())), None)
        return jax.lax.scan(body, x.mean(1), params["layers"])[0]

    layers = jax.device_put(jnp.ones((8, 4, 4)) / 8, NamedSharding(mesh, P("data", None, None)))
    q, d = batch(mesh, P("data"))
    step = gc_jax.cached_value_and_grad(loss_fn, encode, CHUNK)
    error = pytest.raises(ValueError, match="0th dimension of all xs should be replicated")
    with jax.set_mesh(mesh), error as info:
        jax.jit(step)({"layers": layers}, q, d)
    note = "\n".join(getattr(info.value, "__notes__", []))
    assert "scan_layers=False" in note and "axis_types=(AxisType.Auto,))" in note
