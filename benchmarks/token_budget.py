"""Equal-row chunks vs token-budget chunks: padding, work, step time, compile time, memory.

Both settings compute the same exact gradient (the dual-encoder example's InfoNCE loss
with a learnable temperature, no optimizer) of the example's tiny encoder (2 layers,
width 128, positions up to the documents' padded length) over batches of ``--batch``
pairs; the data (``--data``):

* ``example``: the example's docstring -> code pairs mined from the installed Python
  packages, tokenised by its byte-level BPE (trained on the training split), the
  docstrings padded to ``--query-length`` (64) and the code to ``--document-length``
  (512) tokens: long real texts, most much shorter than the padded length;
* ``lognormal``: random token ids with lognormal lengths, median ``--median`` (1/5) of
  the padded length, ``--sigma`` 0.8, for queries and documents alike;
* ``heldout``: issue 36's held-out shape, random token ids with lognormal lengths of
  medians ``--medians`` (20 and 90 tokens, like web queries and passages) and sigma
  ``--sigma`` 0.75 (75 % of the padded tokens are padding), queries padded to 64 and
  documents to 512; its settings are per input, ``R = --chunk-rows`` (32) rows of the
  padded length ``L`` a chunk: ``rows`` (R rows), ``pow2`` (``TokenBudget(R * L,
  powers of 2 from 16 to L)``), ``fitted`` (``TokenBudget.for_lengths(sample, R * L,
  L)``), ``packing`` (``TokenPacking.for_lengths(sample, R * L, L)``) and
  ``packing+attention`` (the same, the encoder's attention through
  ``gc_jax.packing.attention(implementation="blocked")``: score blocks that mix rows
  skipped), the sample being
  ``--fit-batches`` other batches. It also prints each setting's modelled FLOPs
  (the encoder's linear and attention matmuls over the chunk shapes it encodes; for
  the packing also with attention within each row only, as a segment-aware kernel
  computes it) and how far its loss and gradients are from the rows'. Its settings
  also include ``fitted+flops``: ``TokenBudget.for_lengths(sample, R * L, L,
  attention_width=d)``, the buckets fitted to the modelled FLOPs, attention included,
  and ``packing+flops``: ``TokenPacking.for_lengths(sample, R * L, L,
  attention_width=d)``, rows packed into lines of a few lengths fitted the same way;
  ``fitted+flops+small``, ``packing+small`` and ``packing+flops+small`` are those fits
  with ``min_tokens=--min-tokens`` (2048): the chunk size fitted too, from ``R * L``
  tokens down by halvings (smaller chunks leave less of each bucket's last chunk
  empty where a bucket fills about one chunk), and ``rows+small``, their control:
  equal-row chunks of ``--min-tokens`` tokens (``--min-tokens // L`` rows);
* ``heldout2``: a second held-out shape, fixed before it was measured (the guard
  against tuning to ``heldout``), differing in every respect: a 3-layer encoder of
  width d = 64 (2 heads, feed-forward 256), batch 192, ``R = 24`` rows, queries padded
  to 48 tokens with Zipf lengths (``zipf(1.7) + 2``), documents padded to 384 tokens
  from a bimodal mixture (65 % log-normal, median 48, sigma 0.5; 35 % uniform from
  160 to 384 tokens): about two thirds of the padded tokens are padding, and
  attention is half of the long chunks' FLOPs (``n / (6 d) = 1`` at 384). Its
  settings are ``heldout``'s (``--settings`` picks some);
* ``heldout3``: a third held-out shape, fixed before it was measured, at
  75 % padding: a 2-layer encoder of width d = 64 with 4 heads of 16
  (feed-forward 256), batch 224, ``R = 28`` rows, queries padded to 40 tokens with
  lengths uniform from 3 to 24, documents padded to 448 tokens with gamma lengths
  (shape 1.5, scale 70: median 83, 90th percentile 219): 75.8 % of the padded
  tokens are padding (10^6 draws), and attention outweighs the dense layers from 384
  tokens on. Its settings are ``heldout``'s.

Settings: ``rows``: ``chunk_size=--chunk`` rows (default: ``--tokens`` over the documents'
padded length, so a chunk holds as many tokens as a budget chunk); ``tokens``: per input
``gc_jax.TokenBudget.for_lengths`` on ``--fit-batches`` other batches (``--max-buckets``;
``--query-max-buckets``), or ``--buckets`` for every input; ``packing``:
``gc_jax.TokenPacking(--tokens, --segments)`` for every input (one chunk shape per input;
the example's encoder reads the packing keys).

Printed for each: the padded share of the tokens each pass encodes (a budget's padding
rows count as padding), the work (FLOPs of every chunk's encoder forward and
forward-backward, from XLA's cost analysis of each chunk shape), the step time
(``--rounds`` interleaved rounds over the same batches: median and range of the
wall and CPU times, and of the paired ratio to ``rows``), the compile time (lower and
compile, wall and CPU seconds), the compiled temp memory on this machine and, with
``--tpu``, on the TPU compiler for one chip of that topology (``memory_analysis()`` and
the HBM temp its buffer assignment allocates, and how many tuple values it holds:
each takes a 16 KiB slot), and the chunk shapes compiled.

Usage (from the repository root)::

    PYTHONPATH=examples python -m benchmarks.token_budget --data lognormal
    PYTHONPATH=examples python -m benchmarks.token_budget --data example --tpu v5e:2x2
    PYTHONPATH=examples python -m benchmarks.token_budget --data heldout2 --batches 1
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import re
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import gc_jax
from benchmarks import common
from benchmarks.example_modules import dual_encoder, retrieval_data
from gc_jax import packing


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add(
        "--data",
        choices=["example", "lognormal", "heldout", "heldout2", "heldout3"],
        default="lognormal",
    )
    add("--batch", type=int, help="pairs per step (256; heldout2 192, heldout3 224)")
    add("--query-length", type=int, default=64, help="the queries' padded length")
    add("--document-length", type=int, default=512, help="the documents' padded length")
    add("--median", type=float, default=0.2, help="lognormal: median length / padded length")
    add("--sigma", type=float, help="lognormal: sigma of the log length (0.8; heldout 0.75)")
    add("--medians", type=float, nargs=2, default=(20, 90), metavar=("QUERY", "DOCUMENT"),
        help="heldout: median lengths in tokens")  # fmt: skip
    add(
        "--chunk-rows",
        type=int,
        help="heldout: rows R of a chunk, budget R * L (32; heldout2 24, heldout3 28)",
    )
    add("--settings", nargs="+", help="heldout: only these settings (rows always)")
    add("--min-tokens", type=int, default=2048,
        help="*+small settings: for_lengths(min_tokens=...), the smallest chunk")  # fmt: skip
    add("--tokens", type=int, default=4096, help="the token budget of a chunk")
    add("--chunk", type=int, help="rows of an equal-row chunk (default: tokens / doc length)")
    add("--max-buckets", type=int, default=5, help="TokenBudget.for_lengths max_buckets")
    add("--buckets", type=int, nargs="+", help="every input's buckets (else fitted)")
    add("--query-max-buckets", type=int, default=1, help="max_buckets of the queries' budget")
    add("--segments", type=int, default=16, help="TokenPacking segments (rows per line)")
    add("--no-packing", action="store_true", help="leave out the packing setting")
    add("--compile-scaling", type=int, nargs="*", metavar="K",
        help="only compile: rows, then budgets of K fitted document buckets, then the "
        "packing (lower and compile times, distinct chunk shapes)")  # fmt: skip
    add("--fit-batches", type=int, default=16, help="batches the buckets are fitted on")
    add("--batches", type=int, default=2, help="distinct batches timed")
    add("--rounds", type=int, default=5, help="interleaved timing rounds (0: no timing)")
    add("--tpu", metavar="TOPOLOGY", help="also compile for one TPU chip, e.g. v5e:2x2")
    add("--json", help="write the results here")
    args = parser.parse_args(argv)
    if args.sigma is None:
        args.sigma = 0.75 if args.data == "heldout" else 0.8
    if args.chunk_rows is None:
        args.chunk_rows = {"heldout2": 24, "heldout3": 28}.get(args.data, 32)
    if args.data == "heldout2":  # the second held-out shape (see the module's docstring)
        args.query_length, args.document_length = 48, 384
    if args.data == "heldout3":  # the third
        args.query_length, args.document_length = 40, 448
    if args.batch is None:
        args.batch = {"heldout2": 192, "heldout3": 224}.get(args.data, 256)
    return args


HELDOUT2_WIDTH = {"hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 2,
                  "intermediate_size": 256}  # fmt: skip


HELDOUT3_WIDTH = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "intermediate_size": 256}  # fmt: skip
WIDTHS = {"heldout2": HELDOUT2_WIDTH, "heldout3": HELDOUT3_WIDTH}


def heldout3_lengths(rng, rows: int, padded: int, query: bool) -> np.ndarray:
    """``heldout3``'s lengths: uniform queries (3 to 24), gamma documents (1.5, 70)."""
    if query:
        return np.minimum(rng.integers(3, 25, rows), padded)
    return np.clip(np.round(rng.gamma(1.5, 70.0, rows)), 1, padded)


def heldout2_lengths(rng, rows: int, padded: int, query: bool) -> np.ndarray:
    """``heldout2``'s lengths: Zipf queries; documents from a short log-normal mode
    (65 %) and a long uniform one (35 %)."""
    if query:
        return np.minimum(rng.zipf(1.7, rows) + 2, padded)
    short = np.round(rng.lognormal(np.log(48), 0.5, rows))
    long = rng.integers(160, padded + 1, rows)
    return np.clip(np.where(rng.random(rows) < 0.65, short, long), 1, padded)


def example_batches(args, count: int) -> tuple[int, list]:
    """The example's pairs, tokenised at the given padded lengths; ``count`` batches."""
    roots = retrieval_data.source_roots(retrieval_data.DEFAULT_PACKAGES)
    split = retrieval_data.split_by_source(retrieval_data.mine_pairs(roots), 1000, seed=0)
    texts = [p.query for p in split.train] + [p.document for p in split.train]
    vocab = dual_encoder.TINY_VOCAB_SIZE
    tokenizer = dual_encoder.text_tokens.train_bpe(texts, vocab, args.document_length)
    lengths = dataclasses.replace(
        dual_encoder.DEFAULTS["tiny"],
        query_length=args.query_length,
        document_length=args.document_length,
    )
    data = dual_encoder.tokenize(tokenizer, split.train, lengths)
    order = np.random.default_rng(0).permutation(len(data))
    if count * args.batch > len(data):
        raise SystemExit(f"{count} batches of {args.batch} need more than {len(data)} pairs")
    rows = [order[i * args.batch : (i + 1) * args.batch] for i in range(count)]
    return tokenizer.get_vocab_size(), [data.rows(r) for r in rows]


def lognormal_batches(args, count: int) -> tuple[int, list]:
    rng = np.random.default_rng(0)
    heldout = args.data == "heldout"

    def batch(i, padded):
        median = args.medians[i] if heldout else args.median * padded
        length = rng.lognormal(np.log(median), args.sigma, args.batch)
        length = np.clip(np.round(length), 1, padded).astype(np.int32)
        if args.data in ("heldout2", "heldout3"):
            draw = heldout2_lengths if args.data == "heldout2" else heldout3_lengths
            length = draw(rng, args.batch, padded, i == 0).astype(np.int32)
        mask = (np.arange(padded)[None] < length[:, None]).astype(np.int32)
        ids = rng.integers(1, dual_encoder.TINY_VOCAB_SIZE, mask.shape, dtype=np.int32)
        return {"input_ids": ids * mask, "attention_mask": mask}

    pads = (args.query_length, args.document_length)
    batches = [tuple(batch(i, p) for i, p in enumerate(pads)) for _ in range(count)]
    return dual_encoder.TINY_VOCAB_SIZE, batches


class Encoder(dual_encoder.SentenceEncoder):
    """The example's encoder, with a method whose attention is ``gc_jax.packing.attention``
    (the same outputs; on packed lines it skips the score blocks that mix rows)."""

    def row_attention(self, input_ids, attention_mask, **packed):
        chunk = {"input_ids": input_ids, "attention_mask": attention_mask, **packed}
        x = self.embeddings(input_ids, jnp.zeros_like(input_ids), packing.positions(chunk))
        for layer in self.layers:
            att = layer.attention
            heads = lambda y, att=att: y.reshape(*y.shape[:-1], att.num_heads, -1)
            context = packing.attention(heads(att.query(x)), heads(att.key(x)),
                                        heads(att.value(x)), chunk,
                                        implementation="blocked")  # fmt: skip
            x = layer.attention_norm(x + att.output(context.reshape(x.shape)))
            hidden = jax.nn.gelu(layer.intermediate(x), approximate=False)
            x = layer.output_norm(x + layer.output(hidden))
        pooled = packing.mean_pool(x, chunk)  # L2-normalised, as the example's
        return pooled / jnp.maximum(jnp.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)


def method_of(name: str) -> str:
    """The encoder method a setting uses: ``row_attention`` for ``*+attention``."""
    return "row_attention" if name.endswith("+attention") else "__call__"


def grad_step(model, chunk_size, method="__call__"):
    """The example's gradient (no optimizer): ``(params, queries, documents) -> (loss, grads)``."""
    encode_encoder = gc_jax.nnx_encoder(model, method=method)
    encode = lambda params, chunk, key: encode_encoder(params["encoder"], chunk, key)

    def loss_fn(params, queries, documents):
        temperature = jnp.exp(params["log_temperature"])
        return gc_jax.losses.contrastive_loss(queries, documents, temperature=temperature)

    return jax.jit(gc_jax.cached_value_and_grad(loss_fn, encode, chunk_size))


def chunk_counts(chunk_size, batch) -> dict[tuple[int, int], int]:
    """``{(rows, tokens): chunks}`` one input's step encodes in each pass (the library's
    own plan for a budget)."""
    rows, length = batch["input_ids"].shape
    if not isinstance(chunk_size, gc_jax.TokenBudget | gc_jax.TokenPacking):
        counts = {(min(chunk_size, rows), length): rows // chunk_size}
        if rows % chunk_size:
            counts[rows % chunk_size, length] = 1
        return counts
    mask = np.asarray(batch["attention_mask"]) > 0  # the length: one past the last token
    lengths = np.where(mask.any(1), length - np.argmax(mask[:, ::-1], axis=1), 0)
    return chunk_size.chunk_counts(lengths, length)


def chunk_flops(model, shape: tuple[int, int], cache: dict, segments: int | None = None,
                method: str = "__call__") -> float:  # fmt: skip
    """FLOPs of one chunk's forward (pass 1) plus forward and backward (pass 2);
    ``segments``: a packed chunk's (with its packing keys)."""
    if (shape, segments, method) not in cache:
        encode = gc_jax.nnx_encoder(model, method=method)
        params = nnx.state(model, nnx.Param)
        keys = ("input_ids", "attention_mask") + (
            ("segment_ids", "position_ids") if segments else ()
        )
        x = {k: jax.ShapeDtypeStruct(shape, jnp.int32) for k in keys}
        if segments:
            x["segment_starts"] = jax.ShapeDtypeStruct((shape[0], segments), jnp.int32)
        forward = lambda p, x: encode(p, x, None)
        both = lambda p, x: jax.vjp(lambda p: forward(p, x), p)[1](forward(p, x))
        cache[shape, segments, method] = sum(
            float(jax.jit(f).lower(params, x).cost_analysis()["flops"]) for f in (forward, both)
        )
    return cache[shape, segments, method]


def packings(args) -> tuple[gc_jax.TokenPacking, gc_jax.TokenPacking]:
    return (gc_jax.TokenPacking(args.tokens, args.segments),) * 2


def heldout_settings(args, fit, width: int) -> dict:
    """Issue 36's settings, per input: ``R`` rows, or ``R * L`` tokens a chunk (``width``:
    the encoder's, for ``fitted+flops``); those of ``--settings`` only, if given."""
    rows, pads = args.chunk_rows, (args.query_length, args.document_length)
    flops = lambda s, tokens, n: gc_jax.TokenBudget.for_lengths(s, tokens, n, attention_width=width)
    small = {"min_tokens": args.min_tokens}
    samples = [np.stack([b[i]["attention_mask"].sum(-1) for b in fit]) for i in range(2)]
    pow2 = lambda n: tuple(sorted({*(2**k for k in range(4, n.bit_length()) if 2**k < n), n}))
    per_input = lambda make: tuple(make(s, rows * n, n) for s, n in zip(samples, pads, strict=True))
    makers = {
        "pow2": lambda s, tokens, n: gc_jax.TokenBudget(tokens, pow2(n)),
        "fitted": gc_jax.TokenBudget.for_lengths,
        "fitted+flops": flops,
        "packing": gc_jax.TokenPacking.for_lengths,
        "packing+flops": lambda s, tokens, n: gc_jax.TokenPacking.for_lengths(
            s, tokens, n, attention_width=width
        ),
        "packing+attention": gc_jax.TokenPacking.for_lengths,
        "fitted+flops+small": lambda s, tokens, n: gc_jax.TokenBudget.for_lengths(
            s, tokens, n, attention_width=width, **small
        ),
        "packing+small": lambda s, tokens, n: gc_jax.TokenPacking.for_lengths(
            s, tokens, n, **small
        ),
        "packing+flops+small": lambda s, tokens, n: gc_jax.TokenPacking.for_lengths(
            s, tokens, n, attention_width=width, **small
        ),
    }
    chosen = args.settings or list(makers)
    if unknown := set(chosen) - set(makers) - {"rows", "rows+small"}:
        raise SystemExit(f"--settings: unknown {sorted(unknown)}; choose from {list(makers)}")
    out = {"rows": (rows, rows), **{k: per_input(m) for k, m in makers.items() if k in chosen}}
    if "rows+small" in chosen:  # the control: equal-row chunks of --min-tokens tokens
        out["rows+small"] = tuple(max(1, args.min_tokens // n) for n in pads)
    return out


def modelled_flops(config, counts, lengths=None) -> float:
    """The encoder's matmul FLOPs over ``counts`` (``{(rows, tokens): chunks}``), forward
    (pass 1) plus forward and backward (pass 2): 4x a forward. Per layer and token, the
    Q, K, V, output and feed-forward matmuls; per layer, query and key, the scores and
    the weighted values. ``lengths``: attention within each row of these lengths only
    (a segment-aware kernel on packed lines), else over each chunk row's tokens."""
    width, hidden = config.hidden_size, config.intermediate_size
    linear = 2 * (4 * width * width + 2 * width * hidden)
    tokens = sum(r * t * n for (r, t), n in counts.items())
    pairs = sum(r * t * t * n for (r, t), n in counts.items())
    if lengths is not None:
        pairs = float(np.sum(np.square(lengths, dtype=np.float64)))
    return 4.0 * config.num_hidden_layers * (linear * tokens + 4 * width * pairs)


def input_budgets(args, fit) -> tuple[gc_jax.TokenBudget, gc_jax.TokenBudget]:
    """A budget per input, fitted on the lengths of the ``fit`` batches."""
    out = []
    out = []
    for i, padded in enumerate((args.query_length, args.document_length)):
        if args.buckets:  # a batch padded to L uses the buckets below L, and L
            out.append(gc_jax.TokenBudget(args.tokens, tuple(sorted({*args.buckets, padded}))))
            continue
        sample = np.stack([b[i]["attention_mask"].sum(-1) for b in fit])
        most = (args.query_max_buckets, args.max_buckets)[i]
        out.append(gc_jax.TokenBudget.for_lengths(sample, args.tokens, padded,
                                                  max_buckets=most))  # fmt: skip
    return tuple(out)


def compile_scaling(args, model, params, chunk, fit, batch) -> None:
    """Lower and compile times of rows and of budgets of ``K`` fitted document buckets."""
    print("| chunks | distinct chunk shapes | lower s (CPU s) | compile s (CPU s) | "
          "total CPU vs rows |")  # fmt: skip
    base = None
    for k in [0, *args.compile_scaling, "packing"]:
        if k == "packing":
            chunks = packings(args)
        elif k:
            args.max_buckets, args.buckets = k, None
            chunks = input_budgets(args, fit)
        else:
            chunks = (chunk, chunk)
        shapes = {s for c, x in zip(chunks, batch, strict=True) for s in chunk_counts(c, x)}
        step = grad_step(model, chunks)
        wall, cpu = time.perf_counter(), time.process_time()
        lowered = step.lower(params, *batch)
        lower_wall, lower_cpu = time.perf_counter() - wall, time.process_time() - cpu
        wall, cpu = time.perf_counter(), time.process_time()
        lowered.compile()
        compile_wall, compile_cpu = time.perf_counter() - wall, time.process_time() - cpu
        base = base or lower_cpu + compile_cpu
        print(f"| {chunks} | {len(shapes)} | {lower_wall:.1f} ({lower_cpu:.1f}) | "
              f"{compile_wall:.1f} ({compile_cpu:.1f}) | "
              f"{(lower_cpu + compile_cpu) / base:.2f}x |", flush=True)  # fmt: skip


def compile_timed(step, *args):
    """``(compiled, wall s, CPU s)`` of ``step.lower(*args).compile()``."""
    wall, cpu = time.perf_counter(), time.process_time()
    compiled = step.lower(*args).compile()
    return compiled, time.perf_counter() - wall, time.process_time() - cpu


# A preallocated temp in HBM (no "color" clause) and the values in it, in a TPU
# buffer-assignment dump (see benchmarks.common._TEMP for the two line formats).
_HBM_TEMP = re.compile(r"^allocation \d+: size \d+,(?: page \d+,)? preallocated-temp:\n"
                       r"((?: value:.*\n)+)", re.M)  # fmt: skip
_VALUE = re.compile(r"value: <\d+ \S+ @\d+> \(size=\d+,offset=(\d+)\): (\S)")


def tuple_slots(dump: str) -> int:
    """Offsets of HBM temp values that are tuples (a multi-output fusion's or a loop's
    table of buffer addresses) in the buffer assignment: each takes a slot of its own."""
    slots = set()
    for block in _HBM_TEMP.findall(dump):
        slots |= {offset for offset, first in _VALUE.findall(block) if first == "("}
    return len(slots)


def tpu_memory(step, params, batch, topology: str) -> dict:
    """Temp bytes of the step compiled for one chip of ``topology`` (compile only)."""
    device = common.tpu_devices(topology, host_bounds=(2, 2, 1))[0]
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.asarray(x).dtype),
                          (params, *batch))  # fmt: skip
    with tempfile.TemporaryDirectory() as dump:
        compiled = step.lower(*common.on_device(device, shapes)).compile({"xla_dump_to": dump})
        (path,) = glob.glob(os.path.join(dump, "*after_optimizations-buffer-assignment.txt"))
        with open(path) as f:
            text = f.read()
    return {
        "tpu_temp": compiled.memory_analysis().temp_size_in_bytes,
        "tpu_allocated_temp": common.preallocated_temps(text).get(0, 0),
        "tpu_tuple_slots": tuple_slots(text),
    }


def measure(args, model, params, settings, batches) -> dict:
    results, flops = {}, {}
    for name, chunks in settings.items():
        step = grad_step(model, chunks, method_of(name))
        compiled, wall, cpu = compile_timed(step, params, *batches[0])
        counts = [[chunk_counts(c, x) for c, x in zip(chunks, b, strict=True)] for b in batches]
        encoded = [[sum(r * n * t for (r, n), t in c.items()) for c in b] for b in counts]
        real = [[int(x["attention_mask"].sum()) for x in b] for b in batches]
        segments = [getattr(c, "segments", None) for c in chunks]
        work = [
            sum(chunk_flops(model, s, flops, n, method_of(name)) * t
                for c, n in zip(b, segments, strict=True) for s, t in c.items())
            for b in counts
        ]  # fmt: skip
        lengths = [[np.asarray(x["attention_mask"]).sum(-1) for x in b] for b in batches]
        model_flops = [sum(modelled_flops(model.config, c) for c in b) for b in counts]
        per_row = [sum(modelled_flops(model.config, c, n) for c, n in zip(b, ls, strict=True))
                   for b, ls in zip(counts, lengths, strict=True)]  # fmt: skip
        results[name] = {
            "step": compiled,
            "model_gflop": float(np.mean(model_flops)) / 1e9,
            "model_gflop_per_row_attention": float(np.mean(per_row)) / 1e9,
            "wall": [],
            "cpu": [],
            "padded": 1 - np.sum(real) / np.sum(encoded),
            "padded_docs": 1 - np.sum(real, 0)[1] / np.sum(encoded, 0)[1],
            "gflop": float(np.mean(work)) / 1e9,
            "compile_s": wall,
            "compile_cpu_s": cpu,
            "temp": compiled.memory_analysis().temp_size_in_bytes,
            "shapes": [sorted(c) for c in counts[0]],
        }
        out = jax.block_until_ready(compiled(params, *batches[0]))  # warm up; exactness
        results[name]["out"] = out
    base = results["rows"]["out"]
    for r in results.values():
        scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(base[1]))
        r["loss_diff"] = abs(float(r["out"][0] - base[0]))
        pairs = zip(jax.tree.leaves(r["out"][1]), jax.tree.leaves(base[1]), strict=True)
        r["grad_diff"] = max(float(jnp.max(jnp.abs(a - b))) for a, b in pairs) / scale
    for i in range(args.rounds):  # interleaved; every other round in reverse order
        for r in list(results.values())[:: 1 if i % 2 == 0 else -1]:
            wall, cpu = time.perf_counter(), time.process_time()
            for b in batches:
                out = r["step"](params, *b)
            jax.block_until_ready(out)
            r["wall"].append((time.perf_counter() - wall) / len(batches))
            r["cpu"].append((time.process_time() - cpu) / len(batches))
    return results


def main(argv=None) -> dict:
    args = parse_args(argv)
    chunk = args.chunk or max(1, args.tokens // args.document_length)
    make = example_batches if args.data == "example" else lognormal_batches
    vocab, all_batches = make(args, args.fit_batches + args.batches)
    fit, batches = all_batches[: args.fit_batches], all_batches[args.fit_batches :]
    config = dual_encoder.tiny_config(vocab, args.document_length)
    if args.data in WIDTHS:
        config = dataclasses.replace(config, **WIDTHS[args.data])
    model = Encoder(config, rngs=nnx.Rngs(0))
    params = dual_encoder.initial_params(model)
    print(common.machine())
    if args.compile_scaling is not None:
        compile_scaling(args, model, params, chunk, fit, batches[0])
        return {}
    settings = {"rows": (chunk, chunk), "tokens": input_budgets(args, fit)}
    if args.data.startswith("heldout"):
        settings = heldout_settings(args, fit, config.hidden_size)
    elif not args.no_packing:
        settings["packing"] = packings(args)
    print(f"data {args.data}: batch {args.batch}, queries {args.query_length} / documents "
          f"{args.document_length} tokens, {args.batches} batches timed x {args.rounds} "
          f"interleaved rounds; buckets fitted on {args.fit_batches} other batches")  # fmt: skip
    results = measure(args, model, params, settings, batches)
    if args.tpu:  # after the timing: compiling for TPU takes the CPU for a while
        for name, chunks in settings.items():
            results[name].update(tpu_memory(grad_step(model, chunks), params, batches[0], args.tpu))
    print(f"after: {common.load()}")
    report(results, settings, args)
    if args.json:
        keep = {n: {k: v for k, v in r.items() if k not in ("step", "out")}
                for n, r in results.items()}  # fmt: skip
        settings_text = {n: str(s) for n, s in settings.items()}
        common.write_json(common.ROOT / args.json, {"args": vars(args), "settings": settings_text,
                                                    "results": keep}, default=float)  # fmt: skip
    return results


def _spread(xs) -> str:
    """Median (range); ``-`` where nothing was timed (``--rounds 0``)."""
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})" if xs else "-"


def report(results, settings, args) -> None:
    rows = results["rows"]
    tpu = f" TPU {args.tpu} temp MiB: analysis / allocated (tuple slots) |" if args.tpu else ""
    print("| chunks | padded share (all / docs) | GFLOP per step (vs rows) | step s, wall "
          "| step s, CPU | vs rows, wall | vs rows, CPU | compile s (CPU s) | CPU temp MiB |"
          f"{tpu} chunk shapes (queries; documents) |")  # fmt: skip
    for name, r in results.items():
        ratio = lambda key, r=r: [a / b for a, b in zip(r[key], rows[key], strict=True)]
        mem = ""
        if args.tpu:
            mem = (f" {r['tpu_temp'] / 2**20:.1f} / {r['tpu_allocated_temp'] / 2**20:.1f} "
                   f"({r['tpu_tuple_slots']}) |")  # fmt: skip
        shapes = "; ".join(", ".join(f"{a}x{b}" for a, b in s) for s in r["shapes"])
        print(
            f"| {name}: {settings[name]} | {r['padded']:.1%} / {r['padded_docs']:.1%} | "
            f"{r['gflop']:.0f} ({r['gflop'] / rows['gflop']:.2f}x) | {_spread(r['wall'])} | "
            f"{_spread(r['cpu'])} | {_spread(ratio('wall'))} | {_spread(ratio('cpu'))} | "
            f"{r['compile_s']:.1f} ({r['compile_cpu_s']:.1f}) | {r['temp'] / 2**20:.1f} |{mem} "
            f"{shapes} |"
        )
    print("\n| chunks | modelled GFLOP (vs rows) | with attention within rows (vs rows) "
          "| rows' step / this step: wall; CPU | vs rows: loss diff, max grad diff |")  # fmt: skip
    for name, r in results.items():
        speed = lambda key, r=r: [b / a for a, b in zip(r[key], rows[key], strict=True)]
        model, per_row = r["model_gflop"], r["model_gflop_per_row_attention"]
        print(f"| {name} | {model:.0f} ({model / rows['model_gflop']:.2f}x) | {per_row:.0f} "
              f"({per_row / rows['model_gflop']:.2f}x) | {_spread(speed('wall'))}; "
              f"{_spread(speed('cpu'))} | "
              f"{r['loss_diff']:.1e}, {r['grad_diff']:.1e} |")  # fmt: skip


if __name__ == "__main__":
    main()
