"""What a representation bank costs: the gradient-cached step's time and memory, by bank size.

``gc_jax.losses.contrastive_loss(..., bank=)`` scores the batch's queries against the
bank's ``steps x batch`` earlier documents too (no gradient for them: the backward
runs only the queries' sweep over the bank's columns), and the step writes this
step's rows into the bank (``update_bank``, the loss's aux). For each bank size
(``--banks``, 0: no bank) and each loss form (dense; blockwise ``--block``), the
jitted ``gc_jax.make_train_step`` (sgd, the MLP encoder of ``benchmarks.common``,
``--chunk`` rows encoded at a time) is compiled from shapes and XLA's
``memory_analysis().temp_size_in_bytes`` reported beside the bank's own bytes (an
argument of the step: the state); then the steps are run on this device,
interleaved, and the time ratio to the step without a bank given as median and
range over ``--rounds`` rounds.

Usage::

    python -m benchmarks.bank --json benchmarks/results/bank.json
    python -m benchmarks.bank --quick
"""

from __future__ import annotations

import argparse
import functools
import sys
from typing import Any

import jax
import jax.numpy as jnp
import optax

import gc_jax
from benchmarks import common
from gc_jax.losses import contrastive_loss, init_bank, update_bank

MIB = 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, default=2048, help="pairs per step")
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--block", type=int, default=512, help="the blockwise form's tile")
    p.add_argument("--banks", type=int, nargs="+", default=[0, 4, 16])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--json", type=str, default=None)
    p.add_argument("--quick", action="store_true", help=common.QUICK)
    common.add_model_args(p, depth=4)
    args = p.parse_args(argv)
    if args.quick:
        args.batch, args.chunk, args.block, args.banks, args.rounds = 128, 32, 32, [0, 4], 2
        args.depth, args.width, args.dim_in, args.dim_out = 1, 32, 32, 16
    return args


def make_step(chunk: int, block: int | None):
    """The jitted step: ``(params, bank, q, d) -> (params, bank, loss)`` (sgd)."""

    def loss(params, q, d, *, bank):
        value = contrastive_loss(q, d, temperature=common.TEMPERATURE, bank=bank, block_size=block)
        return value, None if bank is None else update_bank(bank, q, d)

    opt = optax.sgd(1e-3)
    step = gc_jax.make_train_step(loss, common.encode, chunk, optimizer=opt, has_aux=True)

    @jax.jit
    def run(params, bank, q, d):
        (params, _), metrics = step((params, opt.init(params)), q, d, bank=bank)
        return params, metrics["aux"], metrics["loss"]

    return run


def _bank(args, steps: int, reps: Any):
    return None if steps == 0 else init_bank(steps, reps, reps)


def memory(args: argparse.Namespace, cfg: common.ModelConfig) -> list[dict]:
    shape = jax.ShapeDtypeStruct
    params = common.param_shapes(cfg)
    x = shape((args.batch, cfg.dim_in), cfg.dtype)
    reps = shape((args.batch, cfg.dim_out), cfg.dtype)
    out = []
    for form, block in (("dense", None), ("blockwise", args.block)):
        base = None
        for steps in args.banks:
            bank = jax.eval_shape(functools.partial(_bank, args, steps), reps)
            compiled = make_step(args.chunk, block).lower(params, bank, x, x).compile()
            temp = compiled.memory_analysis().temp_size_in_bytes
            base = temp if base is None else base
            held = sum(v.size * v.dtype.itemsize for v in jax.tree.leaves(bank))
            row = {"form": form, "bank_steps": steps, "temp_bytes": temp, "bank_bytes": held,
                   "temp_minus_no_bank": temp - base}  # fmt: skip
            out.append(row)
            print(f"| {form} | {steps} | {temp / MIB:.2f} | {(temp - base) / MIB:+.2f} | "
                  f"{held / MIB:.2f} |", flush=True)  # fmt: skip
    return out


def timing(args: argparse.Namespace, cfg: common.ModelConfig) -> list[dict]:
    params = common.init_params(cfg, jax.random.key(0))
    q, d = common.make_batch(cfg, args.batch, jax.random.key(1))
    reps = jax.ShapeDtypeStruct((args.batch, cfg.dim_out), cfg.dtype)
    fns = {}
    for form, block in (("dense", None), ("blockwise", args.block)):
        for steps in args.banks:
            bank = _bank(args, steps, reps)
            if bank is not None:  # a full bank: every slot live, as after `steps` steps
                full = jax.random.normal(jax.random.key(2), bank.docs.shape, bank.docs.dtype)
                bank = bank._replace(queries=full[:, :, 0], docs=full, count=jnp.int32(steps))
            fns[form, steps] = functools.partial(make_step(args.chunk, block), params, bank, q, d)
    named = {f"{form} {steps}": fn for (form, steps), fn in fns.items()}
    wall = common.interleaved_times(named, (), reps=args.rounds).wall
    out = []
    for form, steps in fns:
        name, base = f"{form} {steps}", f"{form} {args.banks[0]}"
        med, lo, hi = common.ratio_range(wall[name], wall[base])
        s = sorted(wall[name])
        out.append({"form": form, "bank_steps": steps, "median_s": common.median(s),
                    "range_s": [s[0], s[-1]], "vs_no_bank": med,
                    "vs_no_bank_range": [lo, hi]})  # fmt: skip
        print(f"| {form} | {steps} | {common.median(s):.3f} ({s[0]:.3f}-{s[-1]:.3f}) | "
              f"{med:.2f} ({lo:.2f}-{hi:.2f}) |", flush=True)  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cfg = common.model_config(args)
    print(f"machine: {common.machine()}")
    print(f"{cfg.describe()}; batch {args.batch} pairs, chunk {args.chunk}, block {args.block}")
    result: dict[str, Any] = {"command": common.command("bank", sys.argv[1:]),
                              "machine": common.machine(), "args": vars(args)}  # fmt: skip
    print("\ncompiled temp memory of the step (XLA), and the bank's own bytes (the state)")
    print("| loss | bank steps | temp MiB | vs no bank MiB | bank MiB |")
    print("|---|---:|---:|---:|---:|")
    result["memory"] = memory(args, cfg)
    print(f"\nstep time, {args.rounds} interleaved rounds (a full bank)")
    print("| loss | bank steps | median s (range) | vs no bank: median (range) |")
    print("|---|---:|---:|---:|")
    result["time"] = timing(args, cfg)
    if args.json:
        common.write_json(common.ROOT / args.json, result)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
