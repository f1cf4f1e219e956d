"""Search code with a model trained by ``dual_encoder.py``: natural language -> functions.

Usage::

    python examples/search.py DIR "read a json file"        # the top 5 functions
    python examples/search.py DIR "parse a date" --top-k 10 --lines 6
    python examples/search.py DIR --eval                    # held-out metrics of the model

``DIR`` is the run directory of ``dual_encoder.py`` (``--checkpoint-dir``); it holds the
model config, tokenizer, checkpoints and every mined function, so nothing is mined again.
The corpus (every mined function, training and held-out ones alike, docstrings cut out
as in training) is embedded once per checkpoint and cached in ``DIR/search/``; later
searches only embed the query. Hits print as ``module:line``, the cosine similarity of
query and code, the function's docstring summary and its first lines.
"""

from __future__ import annotations

import argparse
import functools
import os
import textwrap
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import dual_encoder
import retrieval_data
import run_dir
import text_tokens
from text_encoder import SentenceEncoder


@dataclass
class Trained:
    """A trained model loaded from a run directory."""

    directory: Path
    config: dict[str, Any]
    model: SentenceEncoder
    tokenizer: Any
    params: dual_encoder.Params
    step: int

    @functools.cached_property
    def _embedder(self):
        return dual_encoder.make_embedder(self.model)  # jitted once, reused by every call

    def embed(self, texts: Sequence[str], length: int, progress: str | None = None):
        """Unit-norm embeddings of ``texts`` (truncated to ``length`` tokens)."""
        tokens = text_tokens.encode(self.tokenizer, texts, length)
        return self._embedder(self.params["encoder"], tokens, progress)


@dataclass(frozen=True)
class Hit:
    """One search result."""

    score: float
    pair: retrieval_data.Pair

    @property
    def location(self) -> str:
        return f"{self.pair.module}:{self.pair.line}"


def load(directory: Path, step: int | None = None) -> Trained:
    """The model of ``directory`` with the parameters of checkpoint ``step`` (latest)."""
    config = run_dir.read_run_config(directory)
    if config is None:
        raise FileNotFoundError(f"{directory} holds no run of dual_encoder.py (no run.json).")
    manager = run_dir.checkpoint_manager(directory, read_only=True)
    step = manager.latest_step() if step is None else step
    if step is None or step not in manager.all_steps():
        raise FileNotFoundError(f"{directory}: no checkpoint {step} in {manager.all_steps()}.")
    model = run_dir.build_model(config)
    params = run_dir.restore_params(manager, step, dual_encoder.initial_params(model))
    tokenizer = run_dir.load_tokenizer(directory)
    return Trained(directory, config, model, tokenizer, params, step)


def corpus_embeddings(trained: Trained, pairs: Sequence[retrieval_data.Pair]) -> np.ndarray:
    """Embeddings of every function's code: cached in ``DIR/search/`` per checkpoint."""
    cache = trained.directory / run_dir.SEARCH_CACHE / f"corpus-step{trained.step}.npy"
    if cache.is_file():
        embeddings = np.load(cache)
        if len(embeddings) == len(pairs):
            return embeddings
    started = time.perf_counter()
    documents = [pair.document for pair in pairs]
    embeddings = trained.embed(documents, trained.config["document_length"], "embedding code")
    cache.parent.mkdir(exist_ok=True)
    temporary = cache.with_name(cache.name + ".tmp")
    with temporary.open("wb") as f:
        np.save(f, embeddings)
    os.replace(temporary, cache)
    print(f"embedded {len(pairs)} functions in {time.perf_counter() - started:.1f}s -> {cache}")
    return embeddings


def search(trained: Trained, query: str, top_k: int = 5) -> list[Hit]:
    """The ``top_k`` functions of the run's corpus most similar to ``query``, best first."""
    pairs, _ = run_dir.load_pairs(trained.directory / run_dir.DATA)
    corpus = corpus_embeddings(trained, pairs)
    query_embedding = trained.embed([query], trained.config["query_length"])[0]
    scores = corpus @ query_embedding
    best = np.argsort(-scores, kind="stable")[:top_k]
    return [Hit(float(scores[i]), pairs[i]) for i in best]


def evaluate(trained: Trained) -> dict[str, float]:
    """Held-out loss (at the run's batch size), Recall@1, Recall@10 and MRR."""
    _, split = run_dir.load_pairs(trained.directory / run_dir.DATA)
    flags = trained.config["flags"]
    defaults = dual_encoder.run_defaults(trained.config)
    held_out = dual_encoder.tokenize(trained.tokenizer, split.held_out, defaults)
    evaluator = dual_encoder.make_evaluator(trained.model, held_out, batch_size=flags["batch"])
    return evaluator(trained.params)


def format_hit(rank: int, hit: Hit, lines: int) -> str:
    """``rank  score  module:line  name``, the docstring summary, the first lines of code."""
    summary = textwrap.shorten(hit.pair.query, width=96, placeholder=" ...")
    code = hit.pair.document.splitlines()[:lines]
    body = "\n".join(["# " + summary, *code])
    header = f"{rank:2d}. {hit.score:.3f}  {hit.location}  {hit.pair.name}"
    return header + "\n" + textwrap.indent(body, "      ")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("directory", type=Path, help="run directory of dual_encoder.py (--checkpoint-dir)")
    add("query", nargs="?", help="what the function should do, in words")
    add("--top-k", type=int, default=5, help="results to show (%(default)s)")
    add("--lines", type=int, default=4, help="lines of code shown per result (%(default)s)")
    add("--step", type=int, help="checkpoint to load (default: the latest)")
    add("--eval", action="store_true", help="print the held-out metrics of the saved model")
    return parser


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Searches and/or evaluates; returns ``{"hits": [...], "metrics": {...}}``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.query is None and not args.eval:
        parser.error("give a query, or --eval.")
    if args.top_k <= 0 or args.lines < 0:
        parser.error("--top-k must be positive and --lines non-negative.")
    try:
        trained = load(args.directory, args.step)
    except FileNotFoundError as e:
        parser.error(str(e))
    flags = trained.config["flags"]
    print(
        f"model: {flags['model']} after {trained.step} of {flags['steps']} steps ({args.directory})"
    )
    result: dict[str, Any] = {}
    if args.eval:
        metrics = evaluate(trained)
        size = trained.config["data"]["held_out"]
        line = "  ".join(f"{k} {v:.3f}" for k, v in metrics.items())
        print(f"held-out ({size} queries x {size} functions from unseen files): {line}")
        result["metrics"] = metrics
    if args.query is not None:
        hits = search(trained, args.query, args.top_k)
        print(f"query: {args.query!r}")
        for rank, hit in enumerate(hits, 1):
            print(format_hit(rank, hit, args.lines))
        result["hits"] = hits
    return result


if __name__ == "__main__":
    main()
