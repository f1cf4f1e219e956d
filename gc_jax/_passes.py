"""The two passes of gradient caching for one input: the one implementation of the algorithm.

Every public form (``cached_value_and_grad``, ``chunked_encoder``, ``GradCache``, the
``cachex`` port) runs these two functions:

* :func:`forward` (*pass 1*): encodes every chunk of a batch in a ``fori_loop`` and
  writes the representations in place into a batch-sized cache (no stacked copy of
  the inputs or the cache). Optionally the last chunk (the *tail*) is encoded under
  ``jax.vjp`` and its VJP kept, so pass 2 need not encode it again.
* :func:`backward` (*pass 2*): encodes every chunk again under ``jax.vjp``, pulls its
  slice of the representation gradient back to the parameters (and to the batch's
  differentiated float leaves) and accumulates in the loop carry.

Chunk ``c`` is encoded with ``fold_in(rng, c)`` in both passes (``None`` stays None),
so dropout is replayed exactly. Outputs that are not floating point (ids, masks
carried through the encoder) are cached as they are and get no gradient.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from gc_jax import _device_view, _distributed, _keys, _layout, _narrow, _validation
from gc_jax._base import Encoder, EncoderView, PyTree
from gc_jax._chunks import plan as _plan


class Input(NamedTuple):
    """One batch and how it is encoded.

    Attributes:
      encode: ``encode(params, chunk, key) -> reps``.
      batch: the batch pytree (leading axis: rows), packed by its plan
        (``Plan.pack``): read only through ``plan.take``.
      plan: how the batch is cut into chunks (``gc_jax._chunks.plan.Plan``).
      rng: chunk ``c`` is encoded with ``fold_in(rng, c)``; None: no key.
      wrt: one flag per leaf of ``batch``: whether pass 2 returns its gradient.
      policy: a ``jax.checkpoint`` policy for each chunk's re-encoding, or None.
      name: how errors name the encoder.
      per_device: encode each device's rows of a chunk on their own (set by
        :func:`per_device`).
    """

    encode: Encoder
    batch: PyTree
    plan: _plan.Plan
    rng: jax.Array | None
    wrt: tuple[bool, ...] = ()
    policy: Any = None
    name: str = "encoder"
    per_device: bool = False


def is_inexact(x: Any) -> bool:
    """Whether ``x`` is floating point or complex: a leaf JAX differentiates."""
    return jnp.issubdtype(x.dtype, jnp.inexact)


def wide(dtype: Any) -> Any:
    """Float dtypes narrower than float32 are widened (gradient accumulators)."""
    return jnp.promote_types(dtype, jnp.float32) if jnp.issubdtype(dtype, jnp.floating) else dtype


def make_input(encode, batch, chunk_size, rng, *, name, batch_name, axis_name=None,
               batch_axis=None, index=None, wrt=(), policy=None) -> Input:  # fmt: skip
    """Validates ``batch`` and plans its chunks (``gc_jax._chunks.plan.make``: the layout, the
    plan and the key of input ``index``)."""
    where = {"axis_name": axis_name, "batch_axis": batch_axis}
    batch, plan, key = _plan.make(batch, chunk_size, rng=rng, index=index, name=batch_name, **where)
    wrt = tuple(wrt) or (False,) * len(jax.tree.leaves(batch))
    return Input(encode, plan.pack(batch, wrt), plan, key, wrt, policy, name)


def per_device(inputs: list[Input], params: PyTree, view: EncoderView = "auto") -> list[Input]:
    """``inputs`` set to encode each device's rows on their own, where they can.

    Under ``jit`` over a mesh, a chunk holds every device's rows. Encoded *per device*
    (``shard_map`` over the batch axes, with each device's own copy of the parameters:
    :meth:`Layout.stack <gc_jax._layout.Layout.stack>`), every chunk's gradient stays
    on its device, and the step all-reduces once. Device ``s``'s rows of chunk ``c``
    get the key ``fold_in(key_c, s)``, in both passes. See :data:`EncoderView` for
    when; the gradients are the same either way.
    """
    layouts = {(inp.plan.layout.mesh, inp.plan.layout.axes) for inp in inputs}
    layout = inputs[0].plan.layout
    why_not = _device_view.why_not_local(layouts, layout, params)
    if view == "global" or (why_not and view == "auto"):
        return inputs
    if why_not:
        raise ValueError(f"encoder_view='local' cannot be used here: {why_not}.")
    chosen = [inp._replace(per_device=True) for inp in inputs]
    for inp, spanning in zip(chosen, inputs, strict=True):
        why = _why_spanning(inp, spanning, params, view)
        if why and view == "local":
            raise ValueError(
                f"encoder_view='local' cannot be used here: {inp.name} {why}; inside "
                f"shard_map over the batch axes {inp.plan.layout.axes!r} (manual there) it "
                "is not provably valid: use encoder_view='auto' or 'global' (the chunk then "
                "spans the devices, as under plain jit)."
            )
        if why:
            _log_spanning(inp, why)
            return inputs
    return chosen


def _why_spanning(inp: Input, spanning: Input, params: PyTree, view: EncoderView) -> str | None:
    """Why ``inp`` (encoded per device) must span the devices (None: it need not).

    Read are the encoder's jaxpr and its VJP's (where JAX traced the custom derivative
    rules: ``custom_vjp``'s forward and backward, ``custom_jvp``'s JVP), as pass 2
    differentiates it: ``_device_view.unsafe_annotation``. An encoder whose VJP does
    not trace per device is not provably harmless, and spans the devices ('auto').
    """
    layout = inp.plan.layout
    try:
        jaxprs = traced(inp, params)  # the encoder under shard_map
    except Exception as e:
        if view == "local":
            found = _spanning_annotation(spanning, params)
            if found:  # named, with what commonly makes an encoder fail per device
                e = ValueError(f"encoder_view='local' cannot be used here: {inp.name} "
                               f"{found}: {e}").with_traceback(e.__traceback__)  # fmt: skip
            _device_view.explain(e)
            raise e
        # Written for the global view: keep it so, if it traces there; else this
        # raises the error of that view too.
        output_shapes(spanning, params)
        return "does not trace on each device's rows"
    found = next(filter(None, (_device_view.unsafe_annotation(j, layout) for j in jaxprs)), None)
    if found:
        return found
    try:
        pulled = _traced_vjp(inp, params)
    except Exception as e:
        if view == "local":
            return _spanning_annotation(spanning, params)
        return f"does not differentiate on each device's rows ({type(e).__name__})"
    found = next(filter(None, (_device_view.unsafe_annotation(j, layout) for j in pulled)), None)
    if not found:
        return None
    rule = next(filter(None, (_device_view.rule_holding(j, layout) for j in jaxprs)), None)
    return f"{found}, in {rule or 'a custom derivative rule'}"


def _log_spanning(inp: Input, why: str) -> None:
    logging.getLogger("gc_jax").info(
        "%s %s; its chunks span the devices (encoder_view='global').", inp.name, why
    )


def traced(inp: Input, params: PyTree) -> list:
    """The jaxprs of the encoder on the plan's sample chunks."""
    return [jax.make_jaxpr(_encoder(inp, c))(params, _diff(inp, c)) for c in inp.plan.samples()]


def _traced_vjp(inp: Input, params: PyTree) -> list:
    """The jaxprs of the encoder's VJP on the plan's sample chunks, as pass 2 runs it
    (one copy of the parameters per device), pulled back from ones."""

    def pulled(c, params, diff):
        own = jax.tree.map(inp.plan.layout.stack, params)
        out, pull = jax.vjp(_encoder(inp, c, True, True), own, diff)
        return pull(jax.tree.map(_ones, out))

    return [jax.make_jaxpr(lambda p, d, c=c: pulled(c, p, d))(params, _diff(inp, c))
            for c in inp.plan.samples()]  # fmt: skip


def _ones(r: jax.Array) -> jax.Array:
    return jnp.ones_like(r) if is_inexact(r) else np.zeros(r.shape, jax.dtypes.float0)


def _spanning_annotation(spanning: Input, params: PyTree) -> str | None:
    """For an error: the first annotation that is not harmless per device in the
    encoder on a chunk spanning the devices, or in its VJP (None: none, or it does not
    trace there either)."""
    layout = spanning.plan.layout
    c = next(iter(spanning.plan.samples()))
    chunk = spanning.plan.take(spanning.batch, c)
    encode = lambda p: _validation.call_encoder(spanning.encode, p, chunk, _key(spanning, c),
                                                spanning.name)  # fmt: skip
    try:
        primal = jax.make_jaxpr(encode)(params)
        found = _device_view.unsafe_annotation(primal, layout, encoder_only=False)
        if found:
            return found
        cotangents = jax.eval_shape(encode, params)
        pulled = jax.make_jaxpr(lambda p, g: jax.vjp(encode, p)[1](g))(params, cotangents)
    except Exception:
        return None
    found = _device_view.unsafe_annotation(pulled, layout, encoder_only=False)
    return found and f"{found}, in a custom derivative rule"


def _key(inp: Input, c) -> jax.Array | None:
    return _keys.chunk_key(inp.rng, inp.plan.number(c))


def _differentiated(tree: PyTree, wrt: tuple[bool, ...]) -> list:
    return [x for x, w in zip(jax.tree.leaves(tree), wrt, strict=True) if w]


def _replace(tree: PyTree, wrt: tuple[bool, ...], new: list) -> PyTree:
    leaves, treedef = jax.tree.flatten(tree)
    it = iter(new)
    return treedef.unflatten([next(it) if w else x for x, w in zip(leaves, wrt, strict=True)])


def _encoder(
    inp: Input, c, remat: bool = False, stacked: bool = False
) -> Callable[[PyTree, list], PyTree]:
    """``f(params, diff)``: chunk ``c`` (None: the tail) encoded with its key.

    ``diff`` replaces the chunk's differentiated leaves (``inp.wrt``), so ``jax.vjp``
    of ``f`` also gives their gradients. ``stacked``: ``params`` hold one copy per
    device (``inp.per_device``), so the gradients do too.
    """
    encode = inp.encode
    if remat and inp.policy is not None:
        encode = jax.checkpoint(encode, policy=inp.policy)

    def f(params, diff):
        chunk = inp.plan.take(inp.batch, c)
        if any(inp.wrt):
            chunk = _replace(chunk, inp.wrt, diff)
        if inp.per_device:
            layout, key = inp.plan.layout, _key(inp, c)
            reps = _device_view.encode_local(layout, encode, params, chunk, key, stacked, inp.name)
        else:
            try:
                reps = _validation.call_encoder(encode, params, chunk, _key(inp, c), inp.name)
            except Exception as e:
                _device_view.explain_spanning(e, inp.plan.layout)
                raise
            reps = jax.tree.map(inp.plan.layout.rows_split, reps)
        _validation.rows(
            reps, inp.plan.num_shards * inp.plan.rows_of(c), inp.name, inp.plan.rows_hint
        )
        return reps

    return f


def _diff(inp: Input, c) -> list:
    if not any(inp.wrt):
        return []
    return _differentiated(inp.plan.take(inp.batch, c), inp.wrt)


def output_shapes(inp: Input, params: PyTree) -> PyTree:
    """Shapes and dtypes of one chunk's representations, the same for every chunk."""
    shapes = [jax.eval_shape(_encoder(inp, c), params, _diff(inp, c)) for c in inp.plan.samples()]
    return inp.plan.same_outputs(shapes, inp.name)


def _cache_like(shapes: PyTree, cache_dtype: Any) -> PyTree:
    def one(r):
        dtype = cache_dtype if cache_dtype is not None and is_inexact(r) else r.dtype
        return jax.ShapeDtypeStruct(r.shape, dtype, sharding=getattr(r, "sharding", None))

    return jax.tree.map(one, shapes)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Kept:
    """The VJPs pass 1 kept for one input, for pass 2 to apply instead of re-encoding.

    Attributes:
      count: the chunks kept (``keep``): the tail, if the plan has one, and the chunks
        of ``Plan.kept``.
      tail: the tail's VJP, or None.
      body: the VJPs of the other kept chunks (``Plan.kept``), or None.
    """

    count: int = dataclasses.field(metadata={"static": True})
    tail: Any = None
    body: Any = None


@_layout.types_mesh
def forward(inp: Input, params: PyTree, *, keep: int = 0, cache_dtype: Any = None,
            after: PyTree | None = ()) -> tuple[PyTree, Kept | None]:  # fmt: skip
    """Pass 1: the batch's representations, and the VJPs of ``keep`` chunks.

    The chunks not kept (``plan.loops(keep)``) are encoded in loops, keeping nothing;
    the kept ones (``plan.kept(keep)``, then the tail) are encoded under ``jax.vjp``
    after every other chunk and after ``after`` (the caches already written), so no
    other chunk's activations overlap with theirs. ``keep``: a count (a bool: 0 or 1).
    The cache has the encoder's own dtype (``cache_dtype`` overrides it for float
    outputs). ``after=None``: every chunk of the step is kept (plain full-batch
    training), so there is nothing to wait for, and the compiler schedules the step as
    it would the full batch (a barrier there only constrains that schedule;
    ``tests/test_memory.py::test_one_chunk_per_input_is_the_full_batch`` holds the
    step to the full batch's temp bytes).
    """
    like = _cache_like(output_shapes(inp, params), cache_dtype)
    cache = _zeros(like, inp.plan, params, inp.batch)
    for index, turns in inp.plan.loops(keep):  # in place: no stacked copy
        body = lambda j, cache, index=index: inp.plan.put(
            cache, _encoder(inp, index(j))(params, _diff(inp, index(j))), index(j)
        )
        cache = jax.lax.fori_loop(0, turns, body, cache)
    if not keep:
        if not inp.plan.has_tail(keep):
            return cache, None
        return _put_tail(cache, _encoder(inp, None)(params, _diff(inp, None)), inp.plan), None
    # The barrier orders the kept chunks' forward after all other pass-1 work.
    if after is not None:
        (cache, after), params = jax.lax.optimization_barrier(((cache, after), params))
    stacked = inp.per_device  # the kept VJPs' gradients: one per device, as pass 2's
    own = jax.tree.map(inp.plan.layout.stack, params) if stacked else params
    cache, body = _keep_body(inp, own, cache, keep)
    if not inp.plan.has_tail(keep):
        return cache, Kept(keep, None, body)
    reps, vjp = jax.vjp(_encoder(inp, None, True, stacked), own, _diff(inp, None))
    if not inp.plan.num_body:  # a single chunk: its representations are the cache
        return jax.tree.map(lambda r, c: r.astype(c.dtype), reps, cache), Kept(keep, vjp)
    return _put_tail(cache, reps, inp.plan), Kept(keep, vjp, body)


def _keep_body(inp: Input, own: PyTree, cache: PyTree, keep: int) -> tuple[PyTree, tuple]:
    """``cache`` with the chunks of ``plan.kept(keep)`` written in, and their VJPs.

    Each is its own ``jax.vjp``, unrolled: its residuals are the tail's (a VJP in a
    ``lax.scan`` stacks every residual the linearisation names, e.g. ``1 - tanh^2``
    beside ``tanh``, which the compiler would otherwise fuse away: 2.4x a chunk's
    activations per kept chunk against 1.1x, measured on XLA:CPU), at the cost of
    compiling the encoder once per kept chunk.
    """
    index, turns = inp.plan.kept(keep)
    vjps = []
    for j in range(turns):
        c = index(j)
        reps, vjp = jax.vjp(_encoder(inp, c, True, inp.per_device), own, _diff(inp, c))
        cache = inp.plan.put(cache, reps, c)
        vjps.append(vjp)
    return cache, tuple(vjps) or None


def _put_tail(cache: PyTree, reps: PyTree, plan: _plan.Plan) -> PyTree:
    """``cache`` with the tail's ``reps`` written in, in place (no batch-sized copy)."""
    return _narrow.update_in_place(lambda cache: plan.put(cache, reps, None), cache)


def _zeros(like: PyTree, plan: _plan.Plan, *vary_like: PyTree) -> PyTree:
    """A batch-sized buffer for chunks shaped like ``like``, laid out like the batch and
    varying like ``vary_like`` (the shard_map axes the chunks written into it vary over)."""

    def one(r):
        buf = jnp.zeros((plan.batch_size, *r.shape[1:]), r.dtype)
        return plan.layout.place_like(_distributed.vary_like(buf, *vary_like), r)

    return jax.tree.map(one, like)


def _cotangent(rep_grad: PyTree, shapes: PyTree, plan, c) -> PyTree:
    """Chunk ``c``'s slice of the representation gradient, typed like the encoder's output."""

    rows = plan.num_shards * plan.rows_of(c)

    def one(g, r):
        if not is_inexact(r):  # integer/boolean outputs: a float0 zero cotangent
            return np.zeros((rows, *r.shape[1:]), jax.dtypes.float0)
        piece = plan.take_cotangent(g, c)
        if piece.ndim > 1 and piece.shape[1] > r.shape[1]:  # a token axis cut to the chunk's
            piece = piece[:, : r.shape[1]]
        return _layout.typed_like(piece.astype(r.dtype), r)  # the rows as the encoder split them

    return jax.tree.map(one, rep_grad, shapes)


def _add(acc: PyTree, grads: PyTree) -> PyTree:
    """``acc + grads``; integer leaves (a float0 gradient) get none, as in JAX."""
    add = lambda a, g: a if g.dtype == jax.dtypes.float0 else a + g.astype(a.dtype)
    return jax.tree.map(add, acc, grads)


def grad_buffer(params: PyTree) -> PyTree:
    """Zeros to accumulate the parameter gradients in (narrow floats widened)."""
    return jax.tree.map(lambda p: jnp.zeros_like(p, wide(p.dtype)), params)


def param_grads(acc: PyTree, params: PyTree) -> PyTree:
    """Accumulated gradients in the parameters' dtypes; integer leaves: float0, as ``jax.vjp``."""

    def one(g, p):
        return g.astype(p.dtype) if is_inexact(p) else np.zeros(p.shape, jax.dtypes.float0)

    return jax.tree.map(one, acc, params)


def input_grad_buffer(inp: Input) -> list:
    """Zeros for the gradients of the batch's differentiated leaves."""
    return [jnp.zeros_like(x) for x in _differentiated(inp.batch, inp.wrt)]


def _pullback(inp: Input, shapes: PyTree, rep_grad: PyTree, c, vjp=None):
    """``step(params, dx) -> (grads, dx)``: chunk ``c``'s parameter gradient; ``dx``
    with the chunk's batch gradient written in.

    ``vjp``: the chunk's VJP kept from pass 1; None: the chunk is encoded again.
    """

    def step(params, dx):
        out, pull = shapes, vjp  # the chunk's outputs (a token axis: the chunk's length)
        if vjp is None:
            out, pull = jax.vjp(_encoder(inp, c, True, inp.per_device), params, _diff(inp, c))
        g_params, g_x = pull(_cotangent(rep_grad, out, inp.plan, c))
        dx = [inp.plan.put(b, x, c) for b, x in zip(dx, g_x, strict=True)]
        return g_params, dx

    return step


@_layout.types_mesh
def backward(inputs: list[Input], params: PyTree, rep_grads: list, acc: PyTree, *,
             kept: list[Kept | None] | None = None) -> tuple[PyTree, list[list]]:  # fmt: skip
    """Pass 2 of every input: ``acc`` plus every chunk's parameter gradient.

    Kept VJPs (``kept[i]``, from :func:`forward`) are pulled back first, freeing their
    activations; then *one* loop re-encodes every other chunk of every input
    (a ``lax.switch`` picks the input), so the buffers of one chunk's backward are
    allocated once for all inputs. ``rep_grads[i]`` has the structure of input
    ``i``'s representations (leaves of non-float outputs are ignored).

    Inputs encoded per device (:func:`per_device`) accumulate one gradient per device,
    summed over the devices once, at the end.

    Returns:
      ``(acc, batch_grads)``: ``batch_grads[i]`` lists the gradients of the
      differentiated leaves of input ``i``'s batch (``inputs[i].wrt``).
    """
    acc = jax.tree.map(_layout.typed_like, acc, params)  # the gradients' own type
    if not inputs[0].per_device:
        return _backward(inputs, params, params, rep_grads, acc, kept)
    stack = inputs[0].plan.layout.stack
    own = jax.tree.map(stack, params)
    zeros = jax.tree.map(lambda a: stack(jnp.zeros_like(a)), acc)
    per_device, dxs = _backward(inputs, params, own, rep_grads, zeros, kept)
    return _add(acc, jax.tree.map(lambda g: g.sum(0), per_device)), dxs  # the all-reduce


def _backward(inputs, params, own, rep_grads, acc, kept):
    """:func:`backward` with ``own``: the parameters the chunks are differentiated
    against (``params``, or one copy per device), and ``acc`` shaped like them."""
    kept = kept or [None] * len(inputs)
    shapes = [output_shapes(inp, params) for inp in inputs]
    params = own  # what the chunks' VJPs differentiate against
    dxs = [input_grad_buffer(inp) for inp in inputs]
    pieces = []  # (input, index of turn j, how many turns) for the loop
    for i, (inp, k) in enumerate(zip(inputs, kept, strict=True)):
        for pull in _kept_pullbacks(inp, params, shapes[i], rep_grads[i], k):
            grads, dxs = _for_input(i, pull, acc)(params, dxs)
            acc = _add(acc, grads)
        count = 0 if k is None else k.count
        pieces += [(i, index, turns) for index, turns in inp.plan.loops(count)]
        if not count and inp.plan.has_tail(0):
            pieces.append((i, lambda j: None, 1))
    if not pieces:
        return acc, dxs
    # The barrier makes the re-encoding wait for the gradient so far: XLA can neither
    # hoist it next to pass 1 nor merge it with pass 1's forward.
    (acc, dxs), params = jax.lax.optimization_barrier(((acc, dxs), params))
    turns = [n for _, _, n in pieces]  # traced for token plans
    static = all(isinstance(n, int) for n in turns)
    starts = np.cumsum([0, *turns]) if static else jnp.cumsum(jnp.stack([0, *turns]))

    def branch(piece):
        i, index, _ = piece

        def run(j, dxs):
            pull = _pullback(inputs[i], shapes[i], rep_grads[i], index(j))
            return _for_input(i, pull, acc)(params, dxs)

        return run

    branches = [branch(p) for p in pieces]

    def step(g, carry):
        # The accumulator stays out of the switch: passed through a conditional it
        # would be copied at every turn (XLA:CPU); a branch returns one chunk's grads.
        acc, dxs = carry
        if len(branches) == 1:
            grads, dxs = branches[0](g, dxs)
        else:
            k = jnp.sum(g >= jnp.asarray(starts[1:-1]))
            grads, dxs = jax.lax.switch(k, branches, g - jnp.asarray(starts)[k], dxs)
        return _add(acc, grads), dxs

    return jax.lax.fori_loop(0, int(starts[-1]) if static else starts[-1], step, (acc, dxs))


def _kept_pullbacks(inp: Input, params: PyTree, shapes: PyTree, rep_grad: PyTree,
                    kept: Kept | None) -> list:  # fmt: skip
    """The :func:`_pullback` of each chunk whose VJP pass 1 kept: the tail, then the
    chunks of ``plan.kept``."""
    if kept is None:
        return []
    pulls = [] if kept.tail is None else [_pullback(inp, shapes, rep_grad, None, kept.tail)]
    index = inp.plan.kept(kept.count)[0]
    for j, vjp in enumerate(kept.body or ()):
        c = index(j)
        out = jax.eval_shape(_encoder(inp, c, False, inp.per_device), params, _diff(inp, c))
        pulls.append(_pullback(inp, out, rep_grad, c, vjp))
    return pulls


def _for_input(i: int, step, acc: PyTree):
    """Applies input ``i``'s ``step(params, dx_i)`` to ``[dx_0, dx_1, ...]``.

    The gradients come back typed like ``acc``, so every input's branch agrees
    (an integer leaf's float0 gradient becomes zeros of the accumulator's dtype).
    """

    def typed(a, g):
        return jnp.zeros_like(a) if g.dtype == jax.dtypes.float0 else g.astype(a.dtype)

    def run(params, dxs):
        grads, dx = step(params, dxs[i])
        grads = jax.tree.map(typed, acc, grads)
        return grads, [*dxs[:i], dx, *dxs[i + 1 :]]

    return run
