"""The large-embedder recipe (``examples/large_embedder.py``) in its tiny configuration.

A Qwen3-shaped decoder with FSDP weights (each layer gathered before use, activations
constrained by rows), layers in a ``scan`` with per-layer remat, LoRA adapters on a
frozen base, and the ring loss, on 8 emulated devices: gc_jax's step must equal
``jax.value_and_grad`` of the whole batch, unsharded, under explicit and auto axes,
for causal last-token and bidirectional mean pooling, LoRA and full fine-tuning.
"""

import functools
import re

import chex
import jax
import jax.numpy as jnp
import large_embedder as le  # examples/ (pytest's pythonpath)
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import gc_jax

SIZE = le.SIZES["tiny"]
PAIRS, CHUNK = 32, 2
TOL = {"rtol": 1e-4, "atol": 1e-5}


@pytest.fixture(autouse=True)
def _eight_devices():
    assert jax.device_count() >= 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"


def setup(axis_type):
    base, lora = le.init(SIZE, jax.random.key(0))
    q, d = le.batch(SIZE, PAIRS, 8, 16, seed=0)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
    return mesh, (base, lora, q, d), le.place(mesh, base, lora, q, d)


def encoder(base, lora, train, **kw):
    """``encode(params, batch, key)`` over what is trained; the rest closed over."""
    if train == "lora":
        return lambda p, batch, key=None: le.encode(SIZE, base, p, batch, key, **kw)
    return lambda p, batch, key=None: le.encode(SIZE, p, lora, batch, key, **kw)


CASES = [
    (AxisType.Explicit, "lora", True, "last"),
    (AxisType.Explicit, "full", False, "mean"),
    (AxisType.Auto, "lora", False, "mean"),
    (AxisType.Auto, "full", True, "last"),
]


@pytest.mark.parametrize(
    "axis_type,train,causal,pooling", CASES, ids=[f"{a.name}-{t}-{p}" for a, t, _, p in CASES]
)
def test_the_recipe_is_exact_against_the_full_batch(axis_type, train, causal, pooling):
    mesh, (base, lora, q, d), (pbase, plora, pq, pd) = setup(axis_type)
    kw = {"causal": causal, "pooling": pooling, "dtype": jnp.float32}
    enc = encoder(base, lora, train, **kw)
    loss = functools.partial(le.loss_fn, method="gather")
    params = lora if train == "lora" else base
    f32 = lambda t: jax.tree.map(lambda x: x.astype(jnp.float32), t)
    want = jax.jit(jax.value_and_grad(lambda p: loss(p, enc(p, q), enc(p, d))))(f32(params))

    def step(pbase, plora, q, d):
        p = plora if train == "lora" else f32(pbase)
        enc = encoder(pbase, plora, train, **kw)
        batch_axis = "data" if axis_type == AxisType.Auto else None
        grad_fn = gc_jax.cached_value_and_grad(le.loss_fn, enc, CHUNK, batch_axis=batch_axis)
        return grad_fn(p, q, d)

    with jax.set_mesh(mesh):
        got = jax.jit(step)(pbase, plora, pq, pd)
    chex.assert_trees_all_close(got, want, **TOL)
    if axis_type == AxisType.Explicit and train == "full":  # the gradient stays sharded
        specs = le.base_specs(SIZE)
        for g, spec in zip(jax.tree.leaves(got[1]), jax.tree.leaves(specs), strict=True):
            assert g.sharding.is_equivalent_to(NamedSharding(mesh, spec), g.ndim)


def test_weights_gathered_once_per_step_with_the_local_view():
    """Full fine-tuning with the weights gathered once, before the step, and each device
    encoding its own rows with its copy (``encoder_view="local"``): exact."""
    mesh, (base, _, q, d), (pbase, _, pq, pd) = setup(AxisType.Explicit)
    f32 = lambda t: jax.tree.map(lambda x: x.astype(jnp.float32), t)
    enc = lambda p, batch, key=None: le.encode(SIZE, p, None, batch, key, dtype=jnp.float32)
    loss = functools.partial(le.loss_fn, method="gather")
    want = jax.jit(jax.value_and_grad(lambda p: loss(p, enc(p, q), enc(p, d))))(f32(base))

    def step(pbase, q, d):
        whole = jax.tree.map(lambda w: jax.sharding.reshard(w, P()), f32(pbase))  # once
        grad_fn = gc_jax.cached_value_and_grad(le.loss_fn, enc, CHUNK, encoder_view="local")
        return grad_fn(whole, q, d)

    with jax.set_mesh(mesh):
        got = jax.jit(step)(pbase, pq, pd)
    chex.assert_trees_all_close(got, want, **TOL)


def test_the_local_view_names_a_closed_over_explicit_array():
    """JAX's ``shard_map`` cannot close over arrays typed on explicit mesh axes: with
    ``encoder_view="local"`` a note on JAX's error says what to do; ``"auto"`` takes the
    global view."""
    _, _, (pbase, plora, pq, pd) = setup(AxisType.Explicit)
    enc = encoder(pbase, plora, "lora")
    grad_fn = gc_jax.cached_value_and_grad(le.loss_fn, enc, CHUNK, encoder_view="local")
    with pytest.raises(Exception) as info:  # JAX's own error, by version
        jax.jit(grad_fn)(plora, pq, pd)
    assert "pass them in params" in "\n".join(getattr(info.value, "__notes__", []))
    auto = gc_jax.cached_value_and_grad(le.loss_fn, enc, CHUNK)
    jax.jit(auto)(plora, pq, pd)  # the global view


def test_fsdp_specs_split_every_matrix_over_the_batch_axis():
    for size in le.SIZES.values():
        specs = le.base_specs(size)
        shapes = le.base_shapes(size)
        for path, spec in jax.tree_util.tree_flatten_with_path(
            specs, is_leaf=lambda s: isinstance(s, P)
        )[0]:
            name = jax.tree_util.keystr(path)
            shape = dict(jax.tree_util.tree_flatten_with_path(shapes)[0])[path].shape
            assert ("data" in spec) == ("norm" not in name), (name, spec)
            for dim, axis in zip(shape, spec, strict=False):
                assert axis is None or dim % 256 == 0 or size.vocab == 512, (name, shape, spec)


def test_the_example_runs_and_learns(capsys):
    """The example's ``train_step`` (LoRA, FSDP base, ring loss, bf16) over explicit
    axes lowers the loss in a few steps."""
    le.main(["--steps", "4", "--batch", str(PAIRS), "--chunk", str(CHUNK),
             "--query-tokens", "8", "--doc-tokens", "16"])  # fmt: skip
    out = capsys.readouterr().out
    losses = [float(x) for x in re.findall(r"step \d+: loss (\S+)", out)]
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.1, out
