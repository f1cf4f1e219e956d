"""The run directory of the example: everything needed to resume a run or use its model.

One directory holds one training run and is self-contained (nothing is re-mined or
re-downloaded to resume it or to search with it)::

    DIR/
      run.json          flags, model config, data summary and package versions (written
                        once checkpoint 0 exists: a directory with it can be resumed)
      tokenizer.json    the tokenizer (for ``tiny``: the BPE learnt from the training split)
      data.jsonl.gz     every mined pair with its split (train, held_out or unused)
      checkpoints/N/    Orbax checkpoint after N steps: params and opt_state (arrays),
                        progress (JSON: step, data order, RNG key)
      metrics.jsonl     one line per training step, per held-out evaluation, per compile
      training.png      the curves (``training_plot.py``)
      search/           corpus embeddings cached by ``search.py``

Checkpoints are written by an ``orbax.checkpoint.CheckpointManager`` synchronously (the
training step donates its buffers, so nothing may still be reading them afterwards),
keeping the latest :data:`MAX_TO_KEEP`.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import logging
import os
import signal
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx
from tokenizers import Tokenizer

import retrieval_data
from text_encoder import EncoderConfig, SentenceEncoder

RUN_CONFIG = "run.json"
TOKENIZER = "tokenizer.json"
DATA = "data.jsonl.gz"
CHECKPOINTS = "checkpoints"
METRICS = "metrics.jsonl"
PLOT = "training.png"
SEARCH_CACHE = "search"
MAX_TO_KEEP = 2
SPLITS = ("train", "held_out", "unused")


# ---------------------------------------------------------------------------- small files


def write_json(path: Path, value: Any) -> None:
    """Writes ``value`` as indented JSON, atomically (a crash leaves the old file or none)."""
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")
    os.replace(temporary, path)


def read_run_config(directory: Path) -> dict[str, Any] | None:
    """The ``run.json`` of ``directory``, or None if it holds no run yet."""
    path = directory / RUN_CONFIG
    return json.loads(path.read_text()) if path.is_file() else None


def encoder_config(run_config: dict[str, Any]) -> EncoderConfig:
    """The model's :class:`EncoderConfig` as saved in ``run.json``."""
    return EncoderConfig(**run_config["encoder"])


def config_fields(config: EncoderConfig) -> dict[str, Any]:
    """``config`` as a JSON-ready dict (the inverse of :func:`encoder_config`)."""
    return dataclasses.asdict(config)


def load_tokenizer(directory: Path) -> Tokenizer:
    """The run's tokenizer (padding and truncation as saved)."""
    return Tokenizer.from_file(str(directory / TOKENIZER))


def build_model(run_config: dict[str, Any]) -> SentenceEncoder:
    """A model of the run's architecture; its parameters are restored from a checkpoint."""
    return SentenceEncoder(encoder_config(run_config), rngs=nnx.Rngs(run_config["seed"]))


# ---------------------------------------------------------------------------- data


def save_pairs(path: Path, pairs: Sequence[retrieval_data.Pair], split: retrieval_data.Split):
    """Writes every mined pair, in mining order, with its split; byte-for-byte reproducible."""
    held_out, train = set(split.held_out), set(split.train)
    temporary = path.with_name(path.name + ".tmp")
    with temporary.open("wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
        for pair in pairs:
            label = "train" if pair in train else "held_out" if pair in held_out else "unused"
            record = {"split": label, **dataclasses.asdict(pair)}
            f.write((json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))
    os.replace(temporary, path)


def load_pairs(path: Path) -> tuple[list[retrieval_data.Pair], retrieval_data.Split]:
    """Every pair (mining order) and the train / held-out split, as :func:`save_pairs` wrote."""
    pairs: list[retrieval_data.Pair] = []
    by_split: dict[str, list[retrieval_data.Pair]] = {name: [] for name in SPLITS}
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            pair = retrieval_data.Pair(**{k: v for k, v in record.items() if k != "split"})
            pairs.append(pair)
            by_split[record["split"]].append(pair)
    return pairs, retrieval_data.Split(train=by_split["train"], held_out=by_split["held_out"])


# ---------------------------------------------------------------------------- checkpoints


def checkpoint_manager(directory: Path, *, read_only: bool = False) -> ocp.CheckpointManager:
    """The run's Orbax checkpoint manager (synchronous saves, the latest two kept)."""
    options = ocp.CheckpointManagerOptions(
        max_to_keep=None if read_only else MAX_TO_KEEP,
        save_interval_steps=0 if read_only else 1,
        enable_async_checkpointing=False,
        read_only=read_only,
        create=not read_only,
    )
    absl_logger = logging.getLogger("absl")
    level = absl_logger.level
    absl_logger.setLevel(logging.ERROR)  # not "Given directory is read only" on every search
    try:
        return ocp.CheckpointManager(directory.absolute() / CHECKPOINTS, options=options)
    finally:
        absl_logger.setLevel(level)


def save_checkpoint(
    manager: ocp.CheckpointManager, step: int, params: Any, opt_state: Any, progress: dict
) -> None:
    """Saves the training state after ``step`` steps (``progress`` must be JSON-ready)."""
    manager.save(
        step,
        args=ocp.args.Composite(
            params=ocp.args.StandardSave(params),
            opt_state=ocp.args.StandardSave(opt_state),
            progress=ocp.args.JsonSave(progress),
        ),
    )


def abstract(tree: Any) -> Any:
    """Shapes, dtypes and shardings of ``tree``'s arrays: the target of a restore."""
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


def restore_checkpoint(
    manager: ocp.CheckpointManager, step: int, params: Any, opt_state: Any
) -> tuple[Any, Any, dict]:
    """``(params, opt_state, progress)`` saved after ``step`` steps.

    ``params`` and ``opt_state`` give the structure, shapes and dtypes to restore into.
    """
    restored = manager.restore(
        step,
        args=ocp.args.Composite(
            params=ocp.args.StandardRestore(abstract(params)),
            opt_state=ocp.args.StandardRestore(abstract(opt_state)),
            progress=ocp.args.JsonRestore(),
        ),
    )
    return restored.params, restored.opt_state, restored.progress


def restore_params(manager: ocp.CheckpointManager, step: int, params: Any) -> Any:
    """Only the parameters saved after ``step`` steps (no optimizer state is read)."""
    restored = manager.restore(
        step, args=ocp.args.Composite(params=ocp.args.StandardRestore(abstract(params)))
    )
    return restored.params


# ---------------------------------------------------------------------------- metrics log


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of ``metrics.jsonl`` (none if it does not exist)."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def truncate_metrics(path: Path, step: int) -> list[dict[str, Any]]:
    """Drops records after ``step`` (written after the checkpoint a run resumes from)."""
    kept = [r for r in read_metrics(path) if r["step"] <= step]
    write_metrics(path, kept)
    return kept


def write_metrics(path: Path, records: Iterable[dict[str, Any]]) -> None:
    """Rewrites ``metrics.jsonl`` with ``records``."""
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in records))
    os.replace(temporary, path)


def append_metrics(path: Path, record: dict[str, Any]) -> None:
    """Appends one record to ``metrics.jsonl``."""
    with path.open("a") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")


def records_of(records: Iterable[dict[str, Any]], kind: str) -> Iterator[dict[str, Any]]:
    """The records of one kind: ``"train"``, ``"eval"`` or ``"compile"``."""
    return (r for r in records if r["kind"] == kind)


@dataclasses.dataclass
class StopRequest:
    """Set by :func:`stop_requests` when Ctrl-C (SIGINT) or SIGTERM arrives."""

    signal_name: str | None = None

    @property
    def requested(self) -> bool:
        return self.signal_name is not None


@contextmanager
def stop_requests() -> Iterator[StopRequest]:
    """Turns the first Ctrl-C or SIGTERM into a request to stop after the current step.

    The training loop then checkpoints and returns, so an interrupted run keeps every
    finished step. A second signal stops at once (the default behaviour comes back).
    Only in the main thread (signal handlers can be set nowhere else).
    """
    request = StopRequest()
    names = ("SIGINT", "SIGTERM")
    previous = {}

    def handle(signum, frame):
        request.signal_name = signal.Signals(signum).name
        for name, handler in previous.items():  # a second signal is not deferred
            signal.signal(getattr(signal, name), handler)

    try:
        for name in names:
            previous[name] = signal.signal(getattr(signal, name), handle)
    except ValueError:  # not the main thread: no handlers, nothing deferred
        previous.clear()
    try:
        yield request
    finally:
        for name, handler in previous.items():
            signal.signal(getattr(signal, name), handler)
