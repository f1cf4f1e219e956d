"""GradCache (the class API for NNX modules) against plain full-batch jax.value_and_grad."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gc_jax
from gc_jax.losses import contrastive_loss

B, DIN, DOUT = 8, 5, 4
TOL = dict(atol=2e-5, rtol=2e-5)


class Tower(nnx.Module):
    def __init__(self, seed: int, rate: float = 0.0):
        rngs = nnx.Rngs(seed, dropout=seed + 100)
        self.hidden = nnx.Linear(DIN, 16, rngs=rngs)
        self.drop = nnx.Dropout(rate, rngs=rngs)
        self.out = nnx.Linear(16, DOUT, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(jnp.tanh(self.hidden(x))))


class DictTower(nnx.Module):
    """Takes keyword inputs and returns a dict, like a Hugging Face model."""

    def __init__(self, seed: int):
        self.embed = nnx.Linear(DIN, DOUT, rngs=nnx.Rngs(seed))

    def __call__(self, features, mask):
        hidden = jnp.tanh(self.embed(features)) * mask[:, None]
        return {
            "pooled": hidden / (1.0 + jnp.sum(hidden**2, axis=1, keepdims=True)),
            "hidden": hidden,
        }


def full_value_and_grad(fn, *args, **kwargs):
    """The reference: plain jax.value_and_grad over the whole batch (jitted for speed)."""
    return jax.jit(jax.value_and_grad(fn, *args, **kwargs))


def batch(seed: int, rows: int = B):
    return jax.random.normal(jax.random.key(seed), (rows, DIN))


def params_of(model):
    return nnx.state(model, nnx.Param)


def apply(model, params, x):
    graphdef, _, rest = nnx.split(model, nnx.Param, ...)
    return nnx.merge(graphdef, params, rest)(x)


def apply_kw(model, params, kw):
    graphdef, _, rest = nnx.split(model, nnx.Param, ...)
    return nnx.merge(graphdef, params, rest)(**kw)


@pytest.mark.parametrize("chunk_sizes", [1, 3, 4, 8, 100, [3, 5]])
def test_two_models(chunk_sizes):
    mq, md = Tower(0), Tower(1)
    q, d = batch(1), batch(2)
    loss, (gq, gd) = gc_jax.compat.GradCache([mq, md], chunk_sizes, contrastive_loss)(q, d)
    ref = lambda pq, pd: contrastive_loss(apply(mq, pq, q), apply(md, pd, d))
    ref_loss, ref_grads = full_value_and_grad(ref, (0, 1))(params_of(mq), params_of(md))
    chex.assert_trees_all_close((loss, (gq, gd)), (ref_loss, ref_grads), **TOL)
    assert jax.tree.structure(gq) == jax.tree.structure(params_of(mq))


@pytest.mark.parametrize("chunk_sizes", [2, 3])
def test_single_model_and_tied_models(chunk_sizes):
    m = Tower(0)
    x, q, d = batch(1), batch(2), batch(3)
    single = lambda r: jnp.mean(jnp.sum(r**2, axis=1))
    loss, grads = gc_jax.compat.GradCache(m, chunk_sizes, single)(x)
    ref_loss, ref_grads = full_value_and_grad(lambda p: single(apply(m, p, x)))(params_of(m))
    chex.assert_trees_all_close((loss, grads), (ref_loss, ref_grads), **TOL)

    # The same object twice: one summed gradient, as the original's hooks give.
    loss, grads = gc_jax.compat.GradCache([m, m], chunk_sizes, contrastive_loss)(q, d)
    ref = lambda p: contrastive_loss(apply(m, p, q), apply(m, p, d))
    chex.assert_trees_all_close((loss, grads), full_value_and_grad(ref)(params_of(m)), **TOL)
    assert isinstance(grads, nnx.State)


def test_tied_among_three_inputs():
    a, b = Tower(0), Tower(1)
    x, y, z = batch(1), batch(2), batch(3)
    loss_fn = lambda rx, ry, rz: contrastive_loss(rx, ry) + contrastive_loss(rz, ry)
    loss, grads = gc_jax.compat.GradCache([a, b, a], 3, loss_fn)(x, y, z)
    ref = lambda pa, pb: loss_fn(apply(a, pa, x), apply(b, pb, y), apply(a, pa, z))
    ref_out = full_value_and_grad(ref, (0, 1))(params_of(a), params_of(b))
    chex.assert_trees_all_close((loss, grads), ref_out, **TOL)


def test_dict_inputs_get_rep_fn_and_loss_kwargs():
    mq, md = DictTower(0), DictTower(1)
    mask = (jnp.arange(B) % 3 != 0).astype(jnp.float32)
    q = {"features": batch(1), "mask": mask}
    d = {"features": batch(2), "mask": jnp.ones(B)}
    temperature = jnp.float32(0.3)
    gc = gc_jax.compat.GradCache(
        [mq, md], [3, 5], contrastive_loss, get_rep_fn=lambda o: o["pooled"]
    )
    loss, grads = gc(q, d, temperature=temperature, reduction="sum")

    def ref(pq, pd):
        rq = apply_kw(mq, pq, q)["pooled"]
        return contrastive_loss(rq, apply_kw(md, pd, d)["pooled"], temperature=0.3, reduction="sum")

    ref_out = full_value_and_grad(ref, (0, 1))(params_of(mq), params_of(md))
    chex.assert_trees_all_close((loss, grads), ref_out, **TOL)


class TextTower(nnx.Module):
    """Embeds token ids and mean-pools over the mask: outputs ignore padding."""

    def __init__(self, seed: int, vocab: int = 13):
        rngs = nnx.Rngs(seed)
        self.embed = nnx.Embed(vocab, 16, rngs=rngs)
        self.out = nnx.Linear(16, DOUT, rngs=rngs)

    def __call__(self, input_ids, attention_mask):
        m = attention_mask[..., None].astype(jnp.float32)
        pooled = (jnp.tanh(self.embed(input_ids)) * m).sum(1) / jnp.maximum(m.sum(1), 1.0)
        return self.out(pooled)


def text(seed: int, rows: int = B, padded: int = 16):
    k1, k2 = jax.random.split(jax.random.key(seed))
    lengths = jax.random.randint(k1, (rows,), 1, padded + 1)
    mask = (jnp.arange(padded)[None] < lengths[:, None]).astype(jnp.int32)
    return {"input_ids": jax.random.randint(k2, (rows, padded), 1, 13) * mask,
            "attention_mask": mask}  # fmt: skip


@pytest.mark.parametrize("per_model", [False, True])
def test_token_budget_chunk_sizes(per_model):
    """A TokenBudget as chunk_sizes (for all models, or beside a row count) is exact."""
    mq, md = TextTower(0), TextTower(1)
    q, d = text(1), text(2)
    budget = gc_jax.TokenBudget(tokens=32, buckets=(4, 8, 16))
    gc = gc_jax.compat.GradCache([mq, md], [3, budget] if per_model else budget, contrastive_loss)
    loss, grads = gc(q, d)

    def ref(pq, pd):
        return contrastive_loss(apply_kw(mq, pq, q), apply_kw(md, pd, d))

    ref_out = full_value_and_grad(ref, (0, 1))(params_of(mq), params_of(md))
    chex.assert_trees_all_close((loss, grads), ref_out, **TOL)
    with pytest.raises(ValueError, match=r"chunk_sizes\[0\] is a TokenBudget.*split_input_fn"):
        gc_jax.compat.GradCache([mq, md], budget, contrastive_loss, split_input_fn=lambda x, n: [x])


def test_list_inputs_are_positional_and_has_aux():
    class Pair(nnx.Module):
        def __init__(self):
            self.a = nnx.Linear(DIN, DOUT, rngs=nnx.Rngs(0))

        def __call__(self, x, scale):
            return self.a(x) * scale[:, None]

    m = Pair()
    x, scale = batch(1), jnp.linspace(0.5, 1.5, B)
    loss_fn = lambda r: (jnp.sum(r**2), {"norm": jnp.linalg.norm(r)})
    (loss, aux), grads = gc_jax.compat.GradCache(m, 3, loss_fn, has_aux=True)([x, scale])
    ref = lambda p: loss_fn(nnx.merge(nnx.graphdef(m), p)(x, scale))
    (ref_loss, ref_aux), ref_grads = full_value_and_grad(ref, has_aux=True)(params_of(m))
    chex.assert_trees_all_close((loss, aux, grads), (ref_loss, ref_aux, ref_grads), **TOL)


def test_split_input_fn_is_honoured():
    mq, md = Tower(0), Tower(1)
    q, d = batch(1), batch(2)
    calls = []

    def split(x, chunk_size):  # uneven chunks, and the batch reversed
        calls.append(chunk_size)
        x = x[::-1]
        return [x[:1], x[1:4], x[4:]]

    gc = gc_jax.compat.GradCache([mq, md], [2, 3], contrastive_loss, split_input_fn=split)
    out = gc(q, d)
    assert calls == [2, 3]
    ref = lambda pq, pd: contrastive_loss(apply(mq, pq, q[::-1]), apply(md, pd, d[::-1]))
    ref_out = full_value_and_grad(ref, (0, 1))(params_of(mq), params_of(md))
    chex.assert_trees_all_close(out, ref_out, **TOL)


def reference_with_chunk_keys(models, inputs, chunk_size, rng, loss_fn):
    """Full-batch value_and_grad; chunk c of input i has the key fold_in(fold_in(rng, i), c)."""

    def encode(model, params, x, i):
        graphdef, _, rest = nnx.split(model, nnx.Param, ...)
        reps = []
        for c, start in enumerate(range(0, x.shape[0], chunk_size)):
            module = nnx.merge(graphdef, params, jax.tree.map(lambda v: v, rest))
            nnx.reseed(module, dropout=jax.random.fold_in(jax.random.fold_in(rng, i), c))
            reps.append(module(x[start : start + chunk_size]))
        return jnp.concatenate(reps)

    def total(params):
        reps = [
            encode(m, p, x, i)
            for i, (m, p, x) in enumerate(zip(models, params, inputs, strict=True))
        ]
        return loss_fn(*reps)

    return full_value_and_grad(total)([params_of(m) for m in models])


@pytest.mark.parametrize("chunk_size", [3, 4])
def test_dropout_is_replayed(chunk_size):
    mq, md = Tower(0, rate=0.5), Tower(1, rate=0.5)
    q, d = batch(1), batch(2)
    rng = jax.random.key(42)
    gc = gc_jax.compat.GradCache([mq, md], chunk_size, contrastive_loss)
    loss, grads = gc(q, d, rng=rng)
    ref_loss, ref_grads = reference_with_chunk_keys(
        [mq, md], [q, d], chunk_size, rng, contrastive_loss
    )
    chex.assert_trees_all_close((loss, list(grads)), (ref_loss, ref_grads), **TOL)
    # Dropout is really on with a key; without one it raises, unless the models are
    # in eval mode, where it is off.
    other_loss, _ = gc(q, d, rng=jax.random.key(7))
    with pytest.raises(TypeError, match=r"models\[0\] has dropout in training mode"):
        gc(q, d)
    det = lambda m: nnx.view(m, deterministic=True)
    eval_loss, _ = gc_jax.compat.GradCache([det(mq), det(md)], chunk_size, contrastive_loss)(q, d)
    assert len({float(loss), float(other_loss), float(eval_loss)}) == 3
    chex.assert_trees_all_close(eval_loss, contrastive_loss(det(mq)(q), det(md)(d)), **TOL)


@pytest.mark.parametrize("tied", [True, False])
def test_optimizer_loop_matches_full_batch_training(tied):
    def make():
        q_tower = Tower(0)
        return [q_tower, q_tower] if tied else [q_tower, Tower(1)]

    models, ref_models = make(), make()
    unique = lambda ms: list({id(m): m for m in ms}.values())
    tx = optax.adamw(1e-2, weight_decay=1e-2)
    opts = [nnx.Optimizer(m, tx, wrt=nnx.Param) for m in unique(models)]
    ref_opts = [nnx.Optimizer(m, tx, wrt=nnx.Param) for m in unique(ref_models)]
    traces = []

    def loss_fn(q, d, temperature):
        # The square term gives the document bias a gradient that is not ~0: Adam
        # would turn float noise into full-size, sign-random updates.
        traces.append(1)
        return contrastive_loss(q, d, temperature=temperature) + jnp.mean(d**2)

    @nnx.jit
    @nnx.value_and_grad
    def ref_step(ms, q, d, t):
        rd = ms[-1](d)
        return contrastive_loss(ms[0](q), rd, temperature=t) + jnp.mean(rd**2)

    gc = gc_jax.compat.GradCache(models, 3, loss_fn)
    traced = []
    for step in range(3):
        q, d, t = batch(10 + step), batch(20 + step), jnp.float32(0.5 + step)
        loss, grads = gc(q, d, temperature=t)
        traced.append(len(traces))
        grads = [grads] if tied else grads
        for opt, m, g in zip(opts, unique(models), grads, strict=True):
            opt.update(m, g)

        ref_loss, ref_grads = ref_step(unique(ref_models), q, d, t)
        ref_grads = [ref_grads[i] for i in range(len(ref_opts))]
        for opt, m, g in zip(ref_opts, unique(ref_models), ref_grads, strict=True):
            opt.update(m, g)
        chex.assert_trees_all_close(loss, ref_loss, **TOL)

    chex.assert_trees_all_close(
        [params_of(m) for m in unique(models)], [params_of(m) for m in unique(ref_models)], **TOL
    )
    assert traced[0] == traced[-1] > 0, "the jitted step should be traced once and reused"


@pytest.mark.parametrize(
    ("transform", "gathered"),
    [("shard_map", False), ("shard_map", True), ("pmap", False), ("sharded_jit", False)],
)
def test_data_parallel(transform, gathered):
    """Weights passed as params= of an outer jitted transform; an update is picked up."""
    assert jax.device_count() >= 8, (
        "needs 8 devices: export XLA_FLAGS=--xla_force_host_platform_device_count=8"
    )
    mesh = jax.make_mesh((8,), ("d",))
    sharded = NamedSharding(mesh, P("d"))
    mq, md = Tower(0), Tower(1)
    q, d = batch(1, 16), batch(2, 16)
    if transform == "sharded_jit":  # plain jit over a sharded batch: no axis_name
        replicated = NamedSharding(mesh, P())
        loss_fn = lambda rq, rd: contrastive_loss(rq, jax.sharding.reshard(rd, replicated))
    elif gathered:  # a plain loss made global with gc_jax.compat.functional.gather_inputs
        loss_fn = gc_jax.compat.functional.gather_inputs("d")(contrastive_loss)
    else:
        loss_fn = lambda rq, rd: contrastive_loss(rq, rd, axis_name="d")
    axis_name = None if transform == "sharded_jit" else "d"
    gc = gc_jax.compat.GradCache([mq, md], 1, loss_fn, axis_name=axis_name)
    body = lambda params, q, d: gc(q, d, params=params)
    if transform == "shard_map":
        step = jax.jit(
            jax.shard_map(body, mesh=mesh, in_specs=(P(), P("d"), P("d")), out_specs=P())
        )
        run = lambda: step(gc.params, jax.device_put(q, sharded), jax.device_put(d, sharded))
    elif transform == "pmap":
        step = jax.pmap(body, axis_name="d", in_axes=(None, 0, 0), devices=jax.devices()[:8])
        per_device = lambda x: x.reshape(8, 2, DIN)
        run = lambda: jax.tree.map(lambda x: x[0], step(gc.params, per_device(q), per_device(d)))
    else:
        put = lambda x: jax.device_put(x, replicated)
        run = lambda: gc(
            jax.device_put(q, sharded), jax.device_put(d, sharded), params=put(gc.params)
        )
    run()
    mq.out.kernel.set_value(mq.out.kernel.get_value() * 2)  # e.g. an optimizer update
    out = run()
    ref = lambda pq, pd: contrastive_loss(apply(mq, pq, q), apply(md, pd, d))
    ref_out = full_value_and_grad(ref, (0, 1))(params_of(mq), params_of(md))
    chex.assert_trees_all_close(out, ref_out, **TOL)


def test_batch_axis_under_auto_mesh_axes_and_cache_dtype():
    """The settings GradCache shares with cached_value_and_grad: batch_axis (each
    device encodes its rows of every chunk under auto axes) and cache_dtype."""
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    mq, md = Tower(0), Tower(1)
    q, d = batch(1, 16), batch(2, 16)
    ref = lambda pq, pd: contrastive_loss(apply(mq, pq, q), apply(md, pd, d))
    want = full_value_and_grad(ref, (0, 1))(params_of(mq), params_of(md))
    gc = gc_jax.compat.GradCache([mq, md], 1, contrastive_loss, batch_axis="d")
    with jax.set_mesh(mesh):
        sharded = NamedSharding(mesh, P("d"))
        got = gc(jax.device_put(q, sharded), jax.device_put(d, sharded))
    chex.assert_trees_all_close(got, want, **TOL)

    narrow = gc_jax.compat.GradCache([mq, md], 3, contrastive_loss, cache_dtype=jnp.bfloat16)
    rounded = lambda pq, pd: contrastive_loss(
        apply(mq, pq, q).astype(jnp.bfloat16), apply(md, pd, d).astype(jnp.bfloat16)
    )
    want = full_value_and_grad(rounded, (0, 1))(params_of(mq), params_of(md))
    chex.assert_trees_all_close(narrow(q, d), want, **TOL)
    with pytest.raises(TypeError, match="cache_dtype must be a real floating-point dtype"):
        gc_jax.compat.GradCache([mq, md], 3, contrastive_loss, cache_dtype=jnp.int32)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(chunk_sizes=0), ValueError, "chunk_sizes must be a positive int"),
        (dict(chunk_sizes=2.5), TypeError, "chunk_sizes must be a positive int"),
        (dict(chunk_sizes=[2]), ValueError, "chunk_sizes has 1 entries for 2 models"),
        (dict(chunk_sizes=[2, -1]), ValueError, r"chunk_sizes\[1\]"),
        (dict(models=[]), ValueError, "models is empty"),
        (dict(models=[Tower(0), lambda x: x]), TypeError, r"models\[1\] must be an nnx.Module"),
        (dict(loss_fn="mean"), TypeError, "loss_fn must be callable"),
        (dict(get_rep_fn=3), TypeError, "get_rep_fn must be callable"),
    ],
)
def test_constructor_validation(kwargs, error, match):
    args = dict(models=[Tower(0), Tower(1)], chunk_sizes=2, loss_fn=contrastive_loss) | kwargs
    with pytest.raises(error, match=match):
        gc_jax.compat.GradCache(**args)


def test_call_validation():
    gc = gc_jax.compat.GradCache([Tower(0), Tower(1)], 2, contrastive_loss)
    with pytest.raises(ValueError, match="got 1 model_inputs for 2 models"):
        gc(batch(1))
    with pytest.raises(TypeError, match=r"loss_kwargs\['weights'\]"):
        gc(batch(1), batch(2), weights=[1.0, 2.0])
    with pytest.raises(ValueError, match="params has 1 entries for 2 distinct models"):
        gc(batch(1), batch(2), params=[gc.params[0]])
    bad = gc_jax.compat.GradCache([Tower(0)], 2, jnp.sum, split_input_fn=lambda x, n: x)
    with pytest.raises(TypeError, match="split_input_fn returned Array"):
        bad(batch(1))


# --- inside nnx.jit / jax.jit ------------------------------------------------------


class SharedTower(nnx.Module):
    """A tower whose first layer may be shared with another tower."""

    def __init__(self, embed: nnx.Linear, seed: int):
        self.embed = embed
        self.head = nnx.Linear(16, DOUT, rngs=nnx.Rngs(seed))

    def __call__(self, x):
        return self.head(jnp.tanh(self.embed(x)))


def two_towers(shared: bool):
    embed = lambda seed: nnx.Linear(DIN, 16, rngs=nnx.Rngs(seed))
    first = embed(0)
    return SharedTower(first, 1), SharedTower(first if shared else embed(2), 3)


def flat(tree):
    """``{path: array}`` of an nnx.State, or of a tuple of them keyed by position."""
    if isinstance(tree, tuple):
        return {(i, *k): v for i, t in enumerate(tree) for k, v in flat(t).items()}
    return {path: v.get_value() for path, v in nnx.to_flat_state(tree)}


@pytest.mark.parametrize("shared", [False, True])
def test_nnx_jit_loop_matches_nnx_value_and_grad(shared):
    """The tutorial loop: gc built outside, called in an nnx.jit step taking the models."""
    models, ref_models = two_towers(shared), two_towers(shared)
    tx = optax.adamw(1e-2, weight_decay=1e-2)
    optimizer = nnx.Optimizer(models, tx, wrt=nnx.Param)
    ref_optimizer = nnx.Optimizer(ref_models, tx, wrt=nnx.Param)
    loss_fn = lambda q, d: contrastive_loss(q, d) + jnp.mean(d**2)
    gc = gc_jax.compat.GradCache(list(models), 3, loss_fn)

    @nnx.jit
    def step(models, optimizer, q, d):
        loss, grads = gc(q, d)
        optimizer.update(models, grads)
        return loss, grads

    @nnx.jit
    def ref_step(models, optimizer, q, d):
        full = lambda ms: loss_fn(ms[0](q), ms[1](d))
        loss, grads = nnx.value_and_grad(full)(models)
        optimizer.update(models, grads)
        return loss, grads

    for i in range(3):
        q, d = batch(10 + i), batch(20 + i)
        loss, grads = step(models, optimizer, q, d)
        ref_loss, ref_grads = ref_step(ref_models, ref_optimizer, q, d)
        chex.assert_trees_all_close((loss, flat(grads)), (ref_loss, flat(ref_grads)), **TOL)
        chex.assert_trees_all_close(
            flat(nnx.state(models, nnx.Param)), flat(nnx.state(ref_models, nnx.Param)), **TOL
        )
    # A shared variable is one leaf, under the first model only.
    assert (("embed", "kernel") in flat(grads[1])) == (not shared)


@pytest.mark.parametrize(
    "wrap",
    [
        lambda gc, model: jax.jit(lambda q, d: gc(q, d)),
        lambda gc, model: functools.partial(nnx.jit(lambda m, q, d: gc(q, d), graph=False), model),
        lambda gc, model: functools.partial(
            nnx.jit(lambda m, q, d: gc(q, d), graph_updates=False), model
        ),
        lambda gc, model: nnx.jit(lambda q, d: gc(q, d)),  # the model is not an argument
    ],
    ids=["jax.jit", "nnx.jit(graph=False)", "nnx.jit(graph_updates=False)", "closure"],
)
def test_traced_without_params_raises(wrap):
    """Weights that would be compiled in as constants: an error, never stale weights."""
    model = Tower(0)
    gc = gc_jax.compat.GradCache([model, Tower(1)], 4, contrastive_loss)
    with pytest.raises(ValueError, match=r"models\[0\] and models\[1\].*not traced.*params=params"):
        wrap(gc, model)(batch(1), batch(2))


def test_shared_submodule_gets_summed_gradient():
    a, b = two_towers(shared=True)
    q, d = batch(1), batch(2)
    gc = gc_jax.compat.GradCache([a, b], 3, contrastive_loss)
    loss, grads = gc(q, d)
    ref = nnx.jit(nnx.value_and_grad(lambda ms: contrastive_loss(ms[0](q), ms[1](d))))
    ref_loss, ref_grads = ref((a, b))
    chex.assert_trees_all_close((loss, flat(grads)), (ref_loss, flat(ref_grads)), **TOL)
    assert ("embed", "kernel") not in flat(grads[1])
    assert jax.tree.structure(gc.params) == jax.tree.structure(grads)
    # One optimizer over both towers applies the shared gradient once; an optimizer
    # over the second tower alone would update the shared weights a second time,
    # and fails on the missing leaves instead.
    nnx.Optimizer((a, b), optax.sgd(0.1), wrt=nnx.Param).update((a, b), grads)
    with pytest.raises(Exception, match="embed"):
        nnx.Optimizer(b, optax.adam(0.1), wrt=nnx.Param).update(b, grads[1])
    with pytest.raises(ValueError, match=r"params\[1\] does not match models\[1\].*embed"):
        gc(q, d, params=(nnx.state(a, nnx.Param), nnx.state(b, nnx.Param)))


class NormTower(nnx.Module):
    def __init__(self, seed: int, rate: float = 0.3):
        rngs = nnx.Rngs(seed, dropout=seed + 100)
        self.hidden = nnx.Linear(DIN, 16, rngs=rngs)
        self.norm = nnx.BatchNorm(16, rngs=rngs)
        self.drop = nnx.Dropout(rate, rngs=rngs)
        self.out = nnx.Linear(16, DOUT, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(jnp.tanh(self.norm(self.hidden(x)))))


def test_batch_norm_in_training_mode_raises():
    """Per-chunk batch statistics are not the full batch's: an error, never silent.

    What to write instead, nnx.view(model, use_running_average=True), is tested
    against the full batch in test_flax.py.
    """
    mq, md = NormTower(0), NormTower(1)
    with pytest.raises(ValueError, match=r"models\[0\] updated its nnx.BatchStat.*norm.mean"):
        gc_jax.compat.GradCache([mq, md], 3, contrastive_loss)(
            batch(1), batch(2), rng=jax.random.key(0)
        )
