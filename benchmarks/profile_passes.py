"""Where the step time of gradient caching goes: its passes timed alone, vs full batch.

Rebuilds the pieces of ``gc_jax.cached_value_and_grad`` from public JAX (the same
``fori_loop`` / ``dynamic_slice`` pattern as the core, not the core's private
functions) and times them interleaved in one run, for the headline configuration
of ``speed.py``:

* ``fwd_full``: the encoder on both inputs, full batch (forward only);
* ``fwd_chunked``: the same chunk by chunk into a cache (gc's pass 1, all chunks);
* ``loss_grad``: the loss and its gradient w.r.t. the two ``[B, dim_out]`` caches;
* ``vjp_chunked``: chunk by chunk, re-encode under ``jax.vjp`` and pull a given
  representation gradient back to the parameters (gc's pass 2, all chunks);
* ``vjp_full``: the same pull-back over the full batch in one ``jax.vjp``;
* ``step_full`` and ``step_gc``: the complete steps, as in ``speed.py``.

If the core is efficient, ``step_gc ~ fwd_chunked * (1 - chunk/B) + loss_grad +
vjp_chunked`` (the core keeps the last chunk's forward from pass 1) and
``step_full ~ loss_grad + vjp_full``.

Usage::

    python -m benchmarks.profile_passes
    python -m benchmarks.profile_passes --quick
"""

from __future__ import annotations

import argparse
from typing import Any

import jax
import jax.numpy as jnp

from benchmarks import common


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    common.add_model_args(p, depth=6)
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.depth, args.width, args.dim_in, args.dim_out = 2, 64, 64, 32
        args.batch, args.chunk, args.reps, args.warmup = 256, 64, 3, 1
    return args


def chunked_forward(params: Any, x: jax.Array, chunk: int, dim_out: int) -> jax.Array:
    """Pass 1: every chunk encoded in a ``fori_loop``, written into the cache in place."""

    def body(c: jax.Array, cache: jax.Array) -> jax.Array:
        rows = jax.lax.dynamic_slice_in_dim(x, c * chunk, chunk)
        return jax.lax.dynamic_update_slice_in_dim(
            cache, common.encode(params, rows), c * chunk, axis=0
        )

    cache = jnp.zeros((x.shape[0], dim_out), x.dtype)
    return jax.lax.fori_loop(0, x.shape[0] // chunk, body, cache)


def chunked_vjp(params: Any, x: jax.Array, rep_grad: jax.Array, chunk: int) -> Any:
    """Pass 2: every chunk re-encoded under ``jax.vjp``, parameter gradients summed."""

    def body(c: jax.Array, acc: Any) -> Any:
        rows = jax.lax.dynamic_slice_in_dim(x, c * chunk, chunk)
        g = jax.lax.dynamic_slice_in_dim(rep_grad, c * chunk, chunk)
        _, vjp = jax.vjp(lambda p: common.encode(p, rows), params)
        return jax.tree.map(jnp.add, acc, vjp(g)[0])

    zeros = jax.tree.map(jnp.zeros_like, params)
    return jax.lax.fori_loop(0, x.shape[0] // chunk, body, zeros)


def full_vjp(params: Any, x: jax.Array, rep_grad: jax.Array) -> Any:
    _, vjp = jax.vjp(lambda p: common.encode(p, x), params)
    return vjp(rep_grad)[0]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.quick:
        print(common.QUICK)
    if args.batch % args.chunk:
        raise SystemExit("--batch must be a multiple of --chunk here")
    cfg = common.model_config(args)
    params = common.init_params(cfg, jax.random.key(0))
    q, d = common.make_batch(cfg, args.batch, jax.random.key(1))
    loss = common.loss_fn()
    reps = (common.encode(params, q), common.encode(params, d))
    grads = jax.grad(lambda r: loss(None, *r))(reps)
    chunk, dim_out = args.chunk, args.dim_out

    # Every function takes (params, q, d, reps, rep_grads): nothing is a compile-time
    # constant that XLA could fold away.
    fns = {
        "fwd_full": jax.jit(lambda p, q, d, r, g: (common.encode(p, q), common.encode(p, d))),
        "fwd_chunked": jax.jit(
            lambda p, q, d, r, g: (
                chunked_forward(p, q, chunk, dim_out),
                chunked_forward(p, d, chunk, dim_out),
            )
        ),
        "loss_grad": jax.jit(lambda p, q, d, r, g: jax.value_and_grad(lambda r: loss(p, *r))(r)),
        "vjp_chunked": jax.jit(
            lambda p, q, d, r, g: jax.tree.map(
                jnp.add, chunked_vjp(p, q, g[0], chunk), chunked_vjp(p, d, g[1], chunk)
            )
        ),
        "vjp_full": jax.jit(
            lambda p, q, d, r, g: jax.tree.map(jnp.add, full_vjp(p, q, g[0]), full_vjp(p, d, g[1]))
        ),
        "step_full": jax.jit(lambda p, q, d, r, g: common.full_batch_step()(p, q, d)),
        "step_gc": jax.jit(lambda p, q, d, r, g: common.cached_step(chunk)(p, q, d)),
    }
    print(f"machine: {common.machine()}")
    print(f"model: {cfg.describe()}; B={args.batch}, chunk={chunk}, {args.reps} rounds")
    timings = common.interleaved_times(fns, (params, q, d, reps, grads), args.reps, args.warmup)
    times, cpu = timings.wall, timings.cpu
    print(f"after: {common.load()}")
    med = {k: common.median(v) for k, v in times.items()}
    full = times["step_full"]
    print("| piece | median wall s | vs step_full (paired) | median CPU s | CPU vs step_full |")
    print("|---|---:|---:|---:|---:|")
    for name, ts in times.items():
        print(
            f"| {name} | {med[name]:.3f} | {common.paired_ratio(ts, full):.3f} | "
            f"{common.median(cpu[name]):.3f} | "
            f"{common.paired_ratio(cpu[name], cpu['step_full']):.3f} |"
        )
    kept = 1 - chunk / args.batch
    predicted_gc = med["fwd_chunked"] * kept + med["loss_grad"] + med["vjp_chunked"]
    predicted_full = med["loss_grad"] + med["vjp_full"]
    print(
        f"\nsum of pieces: gc ~ {predicted_gc:.3f} s (measured {med['step_gc']:.3f}); "
        f"full ~ {predicted_full:.3f} s (measured {med['step_full']:.3f})"
    )
    bwd = lambda vjp, fwd: (med[vjp] - med[fwd]) / med[fwd]
    print(
        f"backward/forward cost: full batch {bwd('vjp_full', 'fwd_full'):.2f}, "
        f"chunked {bwd('vjp_chunked', 'fwd_chunked'):.2f}; "
        f"chunked/full forward {med['fwd_chunked'] / med['fwd_full']:.2f}, "
        f"chunked/full vjp {med['vjp_chunked'] / med['vjp_full']:.2f}"
    )


if __name__ == "__main__":
    main()
