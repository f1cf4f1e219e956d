"""The paper's experiment (Gao et al. 2021, Gradient Cache), scaled to a 2-core CPU.

Trains the example's tiny dual encoder (``examples/dual_encoder.py``: docstring ->
code retrieval, a 2-layer width-128 transformer with tied weights, InfoNCE with
in-batch negatives and a learnable temperature) on the same training examples in the
same order, from the same initial parameters, in four settings:

* ``small``: batch ``--small`` (8) with in-batch negatives (7 per query);
* ``accum``: plain gradient accumulation: micro-batches of ``--small`` rows, each with
  its own loss over its own 7 negatives, gradients averaged over ``--big / --small``
  micro-batches before each update (what people do without gradient caching);
* ``gc``: gradient caching at batch ``--big`` (128), chunk ``--small``
  (``gc_jax.cached_value_and_grad``): 127 negatives per query;
* ``full``: the same loss at batch ``--big`` with plain ``jax.value_and_grad``.

``gc`` and ``full`` compute the same gradient, so they should follow the same loss
curve up to float rounding (summation order differs, and training carries the
differences forward); the script records the per-step losses of both and reports their
largest difference, in absolute terms and in float32 ulps of the loss. Every setting is then
evaluated on the held-out pairs exactly as the example does (Recall@1, Recall@10 and
MRR of every held-out query against every held-out function).

Same data, same schedule: one seeded stream of ``--big``-row batches drives every
setting; the small-batch settings cut each into consecutive ``--small``-row pieces.
The optimizer is the example's recipe (AdamW, weight decay 0.01 on matrices only,
gradients clipped to global norm 1, linear warmup over the first 10% then cosine decay
to a tenth of the peak) with the schedule written as a function of *examples seen*,
so it is the same curve for every setting. The peak learning rate is ``--lr`` (the
example's 2e-3) at batch ``--big``, scaled by ``sqrt(batch / big)`` for the batch-8
updates of ``small`` (the square-root rule usual for Adam; ``--lr-scaling none``
keeps it). ``accum`` updates with an average over ``--big`` examples, so it uses the
big-batch rate. Dropout is off (the example's default).

Outputs: ``benchmarks/results/paper_experiment.{json,csv,md}`` (the CSV holds the
per-update training losses of every setting) and
``benchmarks/plots/paper_loss_curves.png``.

The example's modules are imported from ``examples/`` (``benchmarks.example_modules``:
``examples`` on ``PYTHONPATH``), not copied: the model, tokenizer, data split and
evaluation are the example's own.

Usage (from the repository root)::

    PYTHONPATH=examples python -m benchmarks.paper_experiment          # ~10 min, 2 CPU cores
    PYTHONPATH=examples python -m benchmarks.paper_experiment --quick  # 1-2 min, writes nothing
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import platform
import shlex
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import gc_jax
from benchmarks import common
from benchmarks.example_modules import dual_encoder, retrieval_data

Params = dict[str, Any]
Batch = dict[str, np.ndarray]
Step = Callable[..., tuple[Params, Any, jax.Array]]

SETTINGS = ("small", "accum", "gc", "full")
LABELS = {
    "small": "(a) small batch",
    "accum": "(b) grad accumulation",
    "gc": "(c) gradient cache",
    "full": "(d) full batch",
}
MODEL = "tiny"
RESULTS = common.RESULTS
PLOTS = common.PLOTS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--small", type=int, default=8, help="small batch and chunk size (%(default)s)")
    add("--big", type=int, default=128, help="big batch (%(default)s)")
    add("--steps", type=int, default=86, help="big-batch steps (%(default)s, ~2 epochs)")
    add("--lr", type=float, default=2e-3, help="peak learning rate at --big (%(default)s)")
    add(
        "--lr-scaling",
        choices=("sqrt", "none"),
        default="sqrt",
        help="peak rate of the small-batch setting: lr * sqrt(small / big), or lr (%(default)s)",
    )
    add("--evals", type=int, default=4, help="held-out evaluations per setting (%(default)s)")
    add("--eval-size", type=int, default=1000, help="held-out pairs (%(default)s)")
    add("--seed", type=int, default=0, help="init and batch order (%(default)s)")
    add("--data-seed", type=int, default=0, help="train / held-out split (%(default)s)")
    add("--quick", action="store_true", help="sanity run: 6 big steps, results not saved")
    add("--no-save", action="store_true", help="print only, write no files")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.evals, args.no_save = 6, 1, True
    if not 2 <= args.small <= args.big or args.big % args.small:
        parser.error(f"--small ({args.small}) must be >= 2 and divide --big ({args.big}).")
    if args.steps < 1 or args.evals < 1 or not args.lr > 0:
        parser.error("--steps, --evals and --lr must be positive.")
    return args


# --- training steps --------------------------------------------------------------------


def loss_fn(params: Params, queries: jax.Array, documents: jax.Array) -> jax.Array:
    """The example's loss: InfoNCE with in-batch negatives and a learnable temperature."""
    temperature = jnp.exp(params["log_temperature"])
    return gc_jax.losses.contrastive_loss(queries, documents, temperature=temperature)


def make_step(
    loss_and_grads: Callable[..., tuple[jax.Array, Params]],
    optimizer: optax.GradientTransformation,
) -> Step:
    """``step(params, opt_state, queries, documents) -> (params, opt_state, loss)``.

    The update is the example's (``dual_encoder.make_train_step``): the optimizer, then
    the temperature clipped to [0.01, 1]. Only ``loss_and_grads`` differs between the
    settings.
    """

    def step(params: Params, opt_state, queries: Batch, documents: Batch):
        loss, grads = loss_and_grads(params, queries, documents)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        params["log_temperature"] = jnp.clip(params["log_temperature"], math.log(0.01), 0.0)
        return params, opt_state, loss

    return step


def gradient_functions(model, small: int) -> dict[str, Callable[..., tuple[jax.Array, Params]]]:
    """``loss_and_grads(params, queries, documents)`` of each setting.

    ``accum`` takes its batch as ``[micro-batches, small, ...]`` arrays.
    """
    encoder = gc_jax.nnx_encoder(model)
    encode = lambda params, batch, key: encoder(params["encoder"], batch, key)

    def batch_loss(params, queries, documents):
        return loss_fn(params, encode(params, queries, None), encode(params, documents, None))

    plain = jax.value_and_grad(batch_loss)

    def accumulated(params, queries, documents):
        """Mean loss and mean gradient of the micro-batches, one at a time (``scan``)."""

        def add(total, micro_batch):
            loss, grads = plain(params, *micro_batch)
            return jax.tree.map(jnp.add, total, (loss, grads)), None

        zeros = jax.tree.map(jnp.zeros_like, (jnp.zeros((), jnp.float32), params))
        (loss, grads), _ = jax.lax.scan(add, zeros, (queries, documents))
        count = jax.tree.leaves(queries)[0].shape[0]
        return jax.tree.map(lambda x: x / count, (loss, grads))

    return {
        "small": plain,
        "accum": accumulated,
        "gc": gc_jax.cached_value_and_grad(loss_fn, encode, small),
        "full": plain,
    }


# --- data ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    name: str
    batch: int  # examples per update
    micro_batch: int  # rows per loss (the negatives a query sees, plus one)
    peak_lr: float


def settings(args: argparse.Namespace) -> list[Setting]:
    small_lr = args.lr * (math.sqrt(args.small / args.big) if args.lr_scaling == "sqrt" else 1.0)
    return [
        Setting("small", args.small, args.small, small_lr),
        Setting("accum", args.big, args.small, args.lr),
        Setting("gc", args.big, args.big, args.lr),
        Setting("full", args.big, args.big, args.lr),
    ]


def update_batches(
    data: dual_encoder.Tokenized, args: argparse.Namespace, setting: Setting
) -> Iterator[tuple[Batch, Batch]]:
    """The batches of every update: the same ``--big``-row stream for every setting."""
    rows = dual_encoder.batches(len(data), args.big, args.seed)
    for _ in range(args.steps):
        queries, documents = data.rows(next(rows))
        if setting.name == "accum":  # [micro-batches, small, length]
            shape = lambda b: {k: v.reshape(-1, args.small, *v.shape[1:]) for k, v in b.items()}
            yield shape(queries), shape(documents)
        else:
            for start in range(0, args.big, setting.batch):
                cut = lambda b, s=start: {k: v[s : s + setting.batch] for k, v in b.items()}
                yield cut(queries), cut(documents)


# --- one run ---------------------------------------------------------------------------


@dataclass
class Run:
    setting: Setting
    losses: list[float] = field(default_factory=list)  # one per update
    evals: list[dict[str, float]] = field(default_factory=list)  # with "examples"
    compile_seconds: float = 0.0
    train_seconds: float = 0.0  # the updates only (no compilation, no evaluation)
    eval_seconds: float = 0.0
    temp_bytes: int | None = None
    final_params: Params | None = None

    @property
    def final(self) -> dict[str, float]:
        return self.evals[-1]


def run_setting(setting, grad_fn, model, params0, train, evaluate, args) -> Run:
    total = args.steps * args.big
    updates = total // setting.batch
    # The schedule counts examples seen, so every setting follows it per example.
    optimizer = dual_encoder.make_optimizer(setting.peak_lr, total, units_per_update=setting.batch)
    step = jax.jit(make_step(grad_fn, optimizer), donate_argnums=(0, 1))
    params = jax.tree.map(jnp.array, params0)  # a fresh copy: the step donates it
    opt_state = optimizer.init(params)
    batches = update_batches(train, args, setting)
    first = next(batches)

    run = Run(setting)
    tick = time.perf_counter()
    compiled = step.lower(params, opt_state, *first).compile()
    run.compile_seconds = time.perf_counter() - tick
    run.temp_bytes = dual_encoder.compiled_temp_bytes(compiled)

    per_big = args.big // setting.batch  # evaluate at the same examples seen in every setting
    eval_at = {round(args.steps * (i + 1) / args.evals) * per_big for i in range(args.evals)}
    batch, done = first, 0
    print(f"{LABELS[setting.name]}: {updates} updates of {setting.batch} examples", flush=True)
    while True:
        tick = time.perf_counter()
        params, opt_state, loss = compiled(params, opt_state, *batch)
        run.losses.append(float(loss))  # waits for the step
        run.train_seconds += time.perf_counter() - tick
        done += 1
        if done in eval_at:
            tick = time.perf_counter()
            metrics = evaluate(params)
            run.eval_seconds += time.perf_counter() - tick
            run.evals.append({"examples": done * setting.batch, **metrics})
            print(
                f"  {done * setting.batch:6d} examples: loss {np.mean(run.losses[-10:]):.3f} "
                f"(last 10 updates), held-out {_metrics(metrics)}",
                flush=True,
            )
        if done == updates:
            break
        batch = next(batches)
    run.final_params = params
    return run


def _metrics(m: dict[str, float]) -> str:
    return f"R@1 {m['recall@1']:.3f}  R@10 {m['recall@10']:.3f}  MRR {m['mrr']:.3f}"


def _mib(num_bytes: int | None) -> str:
    return "n/a" if num_bytes is None else f"{num_bytes / 2**20:.1f} MiB"


# --- report ----------------------------------------------------------------------------


def agreement(gc: Run, full: Run) -> dict[str, Any]:
    """How closely the gradient-cached run follows the full-batch one."""
    diff = np.abs(np.asarray(gc.losses) - np.asarray(full.losses))
    ulps = diff / np.spacing(np.abs(np.asarray(full.losses, np.float32)))
    leaves = lambda r: [np.asarray(x).ravel() for x in jax.tree.leaves(r.final_params)]
    param_diff = np.abs(np.concatenate(leaves(gc)) - np.concatenate(leaves(full)))
    param_scale = max(float(jnp.max(jnp.abs(b))) for b in leaves(full))
    return {
        "max_abs_loss_diff": float(diff.max()),
        "max_abs_loss_diff_step": int(diff.argmax()),
        "first_step_abs_loss_diff": float(diff[0]),
        "max_abs_loss_diff_per_quarter": [
            float(part.max()) for part in np.array_split(diff, min(4, len(diff)))
        ],
        "max_loss_diff_float32_ulps": float(ulps.max()),
        "max_loss_diff_float32_ulps_per_quarter": [
            float(part.max()) for part in np.array_split(ulps, min(4, len(ulps)))
        ],
        "identical_losses": int((diff == 0).sum()),
        "max_rel_loss_diff": float((diff / np.abs(full.losses)).max()),
        "final_max_abs_param_diff": float(param_diff.max()),
        "final_median_abs_param_diff": float(np.median(param_diff)),
        "final_params_differing_by_over_1e-6": int((param_diff > 1e-6).sum()),
        "num_params": int(param_diff.size),
        "final_max_abs_param": param_scale,
    }


def markdown_table(runs: dict[str, Run], args: argparse.Namespace) -> str:
    lines = [
        "| setting | batch (loss over) | peak LR | updates | R@1 | R@10 | MRR "
        "| train time (updates only) | one step's compiled temp memory |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in SETTINGS:
        r = runs[name]
        s = r.setting
        batch = f"{s.batch}" if s.batch == s.micro_batch else f"{s.batch} ({s.micro_batch})"
        f = r.final
        lines.append(
            f"| {LABELS[name]} | {batch} | {s.peak_lr:.2g} | {len(r.losses)} "
            f"| {f['recall@1']:.3f} | {f['recall@10']:.3f} | {f['mrr']:.3f} "
            f"| {r.train_seconds:.0f} s | {_mib(r.temp_bytes)} |"
        )
    return "\n".join(lines)


def trajectory_table(runs: dict[str, Run]) -> str:
    """Held-out MRR of every setting at each evaluation (examples seen)."""
    points = [e["examples"] for e in runs["full"].evals]
    lines = [
        "Held-out MRR during training (examples seen):\n",
        "| setting | " + " | ".join(str(p) for p in points) + " |",
        "|---|" + "---|" * len(points),
    ]
    for name, r in runs.items():
        lines.append(f"| {LABELS[name]} | " + " | ".join(f"{e['mrr']:.3f}" for e in r.evals) + " |")
    return "\n".join(lines)


def plot(runs: dict[str, Run], before: dict[str, float], args, epoch: int, path: Path) -> None:
    """Loss curves of (c) and (d), their difference, held-out MRR; ``epoch``: examples."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"small": "tab:orange", "accum": "tab:green", "gc": "tab:blue", "full": "black"}
    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    examples = lambda r: (np.arange(len(r.losses)) + 1) * r.setting.batch

    ax = axes[0]
    ax.plot(
        examples(runs["full"]),
        runs["full"].losses,
        color="black",
        lw=3.5,
        alpha=0.35,
        label=LABELS["full"] + " (jax.value_and_grad)",
    )
    ax.plot(
        examples(runs["gc"]),
        runs["gc"].losses,
        color="tab:blue",
        lw=1.2,
        ls="--",
        label=LABELS["gc"] + f" (chunk {args.small})",
    )
    ax.set(
        xlabel="training examples seen",
        ylabel=f"training loss (InfoNCE over {args.big})",
        title=f"Batch {args.big}: gradient cache vs full batch",
    )
    ax.legend(loc="upper right")
    ax.grid(alpha=0.3)

    ax = axes[1]
    full = np.asarray(runs["full"].losses, np.float32)
    diff = np.abs(np.asarray(runs["gc"].losses) - full)
    updates, same = np.arange(1, len(diff) + 1), diff == 0
    spacing = np.spacing(np.abs(full))
    floor = spacing.min() / 8  # identical losses are drawn here
    ax.semilogy(updates[~same], diff[~same], ".", color="tab:blue", label="|loss(c) - loss(d)|")
    ax.semilogy(
        updates[same],
        np.full(same.sum(), floor),
        "x",
        color="tab:blue",
        ms=4,
        label=f"identical ({same.sum()} updates), drawn at {floor:.0e}",
    )
    ax.semilogy(updates, spacing, ":", color="gray", label="float32 spacing (1 ulp) of loss(d)")
    ax.set_ylim(floor / 2, max(diff.max(), spacing.max()) * 30)  # room for the legend
    ax.legend(loc="upper right", fontsize=8)
    ax.set(
        xlabel=f"update (batch {args.big})",
        ylabel="|loss(c) - loss(d)|",
        title=f"Per-step loss difference (max {diff.max():.1e})",
    )
    ax.grid(alpha=0.3, which="both")

    for ax in axes[[0, 2]]:
        for start in range(epoch, args.steps * args.big, epoch):
            ax.axvline(start, color="gray", lw=0.8, ls=":")
            ax.text(
                start,
                0.02,
                f" epoch {start // epoch + 1}",
                transform=ax.get_xaxis_transform(),
                va="bottom",
                fontsize=8,
                color="gray",
            )

    ax = axes[2]
    for name in SETTINGS:
        r = runs[name]
        xs = [0] + [e["examples"] for e in r.evals]
        ys = [before["mrr"]] + [e["mrr"] for e in r.evals]
        style = {"lw": 3.5, "alpha": 0.35} if name == "full" else {"lw": 1.5}
        ls = "--" if name == "gc" else "-"
        ax.plot(xs, ys, marker="o", ls=ls, color=colors[name], label=LABELS[name], **style)
    ax.set(
        xlabel="training examples seen",
        ylabel=f"held-out MRR ({args.eval_size} pairs)",
        title="Held-out retrieval (all four settings)",
    )
    ax.legend()
    ax.grid(alpha=0.3)

    fig.suptitle(
        f"Docstring->code dual encoder ({MODEL}), {args.steps * args.big} examples, "
        f"small batch {args.small}, big batch {args.big}"
    )
    common.save_figure(fig, path, dpi=110)
    plt.close(fig)


def save(runs, before, agree, args, info, table, command) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    result = {
        "command": command,
        "args": {k: v for k, v in vars(args).items()},
        **info,
        "before_training": before,
        "gc_vs_full": agree,
        "settings": {
            name: {
                "label": LABELS[name],
                "batch": r.setting.batch,
                "loss_rows": r.setting.micro_batch,
                "peak_lr": r.setting.peak_lr,
                "updates": len(r.losses),
                "held_out": r.final,
                "held_out_during_training": r.evals,
                "train_seconds": r.train_seconds,
                "compile_seconds": r.compile_seconds,
                "eval_seconds": r.eval_seconds,
                "step_temp_bytes": r.temp_bytes,
                "final_loss": r.losses[-1],
            }
            for name, r in runs.items()
        },
    }
    (RESULTS / "paper_experiment.json").write_text(json.dumps(result, indent=2) + "\n")
    with open(RESULTS / "paper_experiment.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["setting", "update", "examples_seen", "loss"])
        for name, r in runs.items():
            for i, loss in enumerate(r.losses):
                writer.writerow([name, i + 1, (i + 1) * r.setting.batch, repr(loss)])
    (RESULTS / "paper_experiment.md").write_text(
        "# The paper's experiment, scaled to this machine\n\n"
        f"Command: `{command}`\n\n"
        f"{info['description']}\n\n{table}\n\n{info['agreement_text']}\n\n"
        f"{trajectory_table(runs)}\n"
    )


def main(argv=None) -> dict[str, Any]:
    args = parse_args(argv)
    command = "PYTHONPATH=examples python -m benchmarks.paper_experiment" + "".join(
        f" {shlex.quote(a)}" for a in (sys.argv[1:] if argv is None else argv)
    )
    started = time.perf_counter()
    defaults = dual_encoder.DEFAULTS[MODEL]

    pairs = retrieval_data.mine_pairs()
    split = retrieval_data.split_by_source(pairs, args.eval_size, seed=args.data_seed)
    model, tokenizer = dual_encoder.build_model(MODEL, split.train, args.seed, dropout=0.0)
    train = dual_encoder.tokenize(tokenizer, split.train, defaults)
    held_out = dual_encoder.tokenize(tokenizer, split.held_out, defaults)
    evaluate = dual_encoder.make_evaluator(model, held_out)
    params0 = dual_encoder.initial_params(model)
    total = args.steps * args.big
    epoch_examples = len(train) // args.big * args.big  # dual_encoder.batches drops the rest
    description = (
        f"Model: the example's `{MODEL}` encoder "
        f"({sum(x.size for x in jax.tree.leaves(params0)) / 1e6:.2f}M parameters), "
        f"trained on {len(train)} docstring->code pairs for {total} examples "
        f"({total / len(train):.1f} epochs), evaluated on {len(held_out)} held-out pairs "
        f"from unseen files (every query against all {len(held_out)} functions). Same "
        f"initial parameters, same example order and the same learning-rate schedule per "
        f"example seen in every setting; peak LR {args.lr:g} at batch {args.big}"
        + (
            f", scaled by sqrt({args.small}/{args.big}) for the batch-{args.small} setting."
            if args.lr_scaling == "sqrt"
            else " for every setting."
        )
        + f" CPU: {platform.processor() or platform.machine()}, "
        f"{jax.device_count()} JAX device(s) ({jax.devices()[0].platform})."
    )
    print(description)
    print(f"setup (mining, tokenizer, tokens): {time.perf_counter() - started:.0f}s")
    before = evaluate(params0)
    print(f"held-out before training: {_metrics(before)}")

    grad_fns = gradient_functions(model, args.small)
    runs = {}
    for setting in settings(args):
        grad_fn = grad_fns[setting.name]
        runs[setting.name] = run_setting(setting, grad_fn, model, params0, train, evaluate, args)
        r = runs[setting.name]
        print(
            f"  train {r.train_seconds:.0f}s, compile {r.compile_seconds:.1f}s, eval "
            f"{r.eval_seconds:.0f}s, step temp memory {_mib(r.temp_bytes)}",
            flush=True,
        )

    agree = agreement(runs["gc"], runs["full"])
    agreement_text = (
        f"Gradient cache (c) vs full batch (d), training loss per update over "
        f"{len(runs['gc'].losses)} updates: max |difference| "
        f"{agree['max_abs_loss_diff']:.2e} (at update {agree['max_abs_loss_diff_step'] + 1}; "
        f"first update {agree['first_step_abs_loss_diff']:.1e}; max per quarter of the run "
        + ", ".join(f"{d:.1e}" for d in agree["max_abs_loss_diff_per_quarter"])
        + f"), i.e. at most {agree['max_loss_diff_float32_ulps']:.0f} float32 ulps of the loss "
        "(max per quarter "
        + ", ".join(f"{d:.0f}" for d in agree["max_loss_diff_float32_ulps_per_quarter"])
        + f"); {agree['identical_losses']} updates with bit-identical losses; max relative "
        f"difference {agree['max_rel_loss_diff']:.1e}. Final parameters: "
        f"max |difference| {agree['final_max_abs_param_diff']:.1e}, median "
        f"{agree['final_median_abs_param_diff']:.1e}, "
        f"{agree['final_params_differing_by_over_1e-6']} of {agree['num_params']} differ by "
        f"more than 1e-6 (largest parameter {agree['final_max_abs_param']:.2f}; Adam's "
        "per-coordinate scaling turns rounding-level gradient differences of nearly unused "
        "coordinates, e.g. rare tokens' embeddings, into larger update differences). "
        "One step's compiled temp "
        f"memory: (c) {_mib(runs['gc'].temp_bytes)}, (d) {_mib(runs['full'].temp_bytes)}."
    )
    table = markdown_table(runs, args)
    elapsed = time.perf_counter() - started
    info = {
        "description": description,
        "agreement_text": agreement_text,
        "total_seconds": elapsed,
        "held_out_pairs": len(held_out),
        "train_pairs": len(train),
        "jax": jax.__version__,
    }
    print()
    print(table)
    print()
    print(agreement_text)
    print(f"\ntotal {elapsed:.0f}s; command: {command}")
    if not args.no_save:
        info["agreement_text"] += f" Whole script: {elapsed:.0f} s."
        save(runs, before, agree, args, info, table, command)
        plot(runs, before, args, epoch_examples, PLOTS / "paper_loss_curves.png")
        print(f"wrote {RESULTS}/paper_experiment.{{json,csv,md}}")
    return {"runs": runs, "agreement": agree, "table": table}


if __name__ == "__main__":
    main()
