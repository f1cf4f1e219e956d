"""Embedders built with the JAX model libraries, gc_jax against the plain full batch.

Tiny random-init models from MaxText (Qwen3, Gemma 3 and Llama decoders, with their
final norm), Google DeepMind's ``gemma`` library (Gemma 3 made bidirectional, as
EmbeddingGemma, and a SigLIP vision tower with dropout) and Penzai (a Llama-like
transformer with dropout), each wrapped as a mean-pooled (attention-mask-aware)
embedder with a dense head and L2 norm by ``examples/library_embedders.py`` (the
recipes of docs/model_libraries.md). For each model and mesh it runs
``gc_jax.cached_value_and_grad`` with default arguments (``batch_axis`` on auto mesh
axes, as the docs say) under ``jax.jit`` and compares the loss and gradients with
``jax.value_and_grad`` of the same loss over the whole, unsharded batch
(``chex.assert_trees_all_close``, float32).

Meshes (``--devices 8`` emulates 8 CPU devices):

* ``single``: one device (``--devices 1``); also with a dropout key where the model has
  dropout, against ``gc_jax.testing.full_batch_value_and_grad`` (the same chunk keys).
* ``explicit dp`` / ``auto dp``: ``jax.make_mesh((8,), ("data",))`` with explicit or auto
  axes, the weights replicated, the batch split over ``data``.
* ``explicit fsdp`` / ``auto fsdp``: the same, every weight's first dimension that 8
  divides sharded over ``data``.
* the library's own mesh: MaxText's (``maxtext_utils.create_device_mesh``, its
  ``logical_axis_rules`` context, FSDP ``(1, 8, 1)`` and data parallel ``(8, 1, 1)``).

Where plain ``jax.jit`` of the full batch cannot run on a mesh, the row says so and
shows the first line of gc_jax's error and whether it names the fix.

Each library lives in its own environment (they pin different packages); run one per
interpreter, from the repository root:

    # with the Python of an environment holding gc_jax and Penzai:
    XLA_FLAGS=--xla_force_host_platform_device_count=8 PYTHONPATH=examples \\
        python -m benchmarks.model_libraries --library penzai --devices 8

``--json PATH`` appends the rows to a JSON file (``benchmarks/results/model_libraries.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import platform
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

LIBRARIES = ("maxtext", "gemma", "penzai")
ROWS, TOKENS, CHUNK, VOCAB, DIM = 32, 8, 2, 128, 8
TOL = {"rtol": 2e-5, "atol": 2e-6}


@dataclasses.dataclass
class Model:
    """A built embedder: ``encode(params, batch, key)``, its params, and how to run it on
    a mesh (``context(mesh)``: the library's context; ``specs(params)``: its own
    shardings, or None)."""

    library: str
    name: str
    encode: Callable
    params: Any
    dropout: bool = False
    context: Callable = lambda mesh: contextlib.nullcontext()
    meshes: dict = dataclasses.field(default_factory=dict)  # its own: name -> (mesh, specs, axes)
    generic: bool = True  # also on jax.make_mesh's meshes
    reference_encode: Callable | None = None  # the same model built without a mesh
    inputs: str = "tokens"  # or "images"
    recipe: Callable | None = None  # () -> (step, params): the page's step, as written


def loss_fn(params, q, d):
    import gc_jax

    return gc_jax.losses.contrastive_loss(q, d, temperature=0.1)


def batches(inputs: str = "tokens"):
    """Two batches of token ids, right-padded (lengths 3 to ``TOKENS``), or of images."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    if inputs == "images":
        images = jax.random.normal(jax.random.key(1), (2, ROWS, 8, 8, 3))
        return images[0], images[1]
    ids = jax.random.randint(jax.random.key(1), (ROWS, TOKENS), 1, VOCAB)
    lengths = 3 + np.arange(ROWS) % (TOKENS - 2)
    mask = jnp.asarray(np.arange(TOKENS)[None] < lengths[:, None], jnp.int32)
    q = {"ids": ids * mask, "mask": mask}
    d = {"ids": ((ids * 7 + 3) % (VOCAB - 1) + 1) * mask[::-1], "mask": mask[::-1]}
    return q, d


def max_diff(a, b) -> float:
    import jax
    import numpy as np

    diffs = jax.tree.leaves(jax.tree.map(lambda x, y: float(np.max(np.abs(x - y))), a, b))
    return max(diffs)


def first_line(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip().splitlines()[0]
    return text[:160]


# -- the checks -------------------------------------------------------------------------


def reference(model: Model):
    """``jax.value_and_grad`` of the loss over the whole batch, on one device, no mesh."""
    import jax

    q, d = batches(model.inputs)
    encode = model.reference_encode or model.encode
    full = lambda p: loss_fn(p, encode(p, q, None), encode(p, d, None))
    return jax.jit(jax.value_and_grad(full))(model.params)


def leaf_relative_diff(got, want) -> float:
    """The largest ``max|got - want| / max|want|`` over the leaves."""
    import jax
    import numpy as np

    rel = lambda a, b: float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))
    return max(jax.tree.leaves(jax.tree.map(rel, got, want)))


def compare(got, want) -> str:
    """``exact``: within ``TOL`` element by element (``chex.assert_trees_all_close``);
    ``float32 rounding``: not, but every leaf within 1e-5 of its largest entry (a
    library that keeps reductions in float32 rounds differently on a chunk's shape);
    else ``DIFFERS``."""
    import chex
    import jax

    got, want = jax.device_get((got, want))  # off their meshes
    diff = max_diff(got, want)
    try:
        chex.assert_trees_all_close(got, want, **TOL)
    except AssertionError:
        rel = leaf_relative_diff(got, want)
        kind = "float32 rounding" if rel < 1e-5 else "DIFFERS"
        return f"{kind} (max abs diff {diff:.1e}, {rel:.1e} of the leaf's largest)"
    return f"exact (max abs diff {diff:.1e})"


def check_single(model: Model, want) -> list[tuple[str, str]]:
    """One device: default arguments, and with a dropout key where the model has one."""
    import jax

    import gc_jax

    q, d = batches(model.inputs)
    step = jax.jit(gc_jax.cached_value_and_grad(loss_fn, model.encode, CHUNK))
    rows = [("single", compare(step(model.params, q, d), want))]
    if model.dropout:
        key, chunk = jax.random.key(7), ROWS // 4  # 4 chunks: the reference unrolls them
        drop = jax.jit(gc_jax.cached_value_and_grad(loss_fn, model.encode, chunk))
        full = jax.jit(gc_jax.testing.full_batch_value_and_grad(loss_fn, model.encode, chunk))
        got, ref = drop(model.params, q, d, rng=key), full(model.params, q, d, rng=key)
        moved = max_diff(got[1], want[1])
        rows.append(("single, dropout key", f"{compare(got, ref)}; dropout moves grads "
                     f"by {moved:.1e}"))  # fmt: skip
    return rows


def fsdp_spec(x, axes):
    """A weight's sharding under FSDP: its first dimension that the mesh divides."""
    from jax.sharding import PartitionSpec as P

    size = 8
    for i, n in enumerate(getattr(x, "shape", ())):
        if x.ndim >= 2 and n % size == 0 and n >= size:
            return P(*([None] * i), axes)
    return P()


def place(mesh, tree, specs):
    import jax
    from jax.sharding import NamedSharding

    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs)


def check_mesh(model: Model, want, mesh, specs, batch_axes, explicit: bool) -> str:
    """Plain jit of the full batch on ``mesh`` first (does it run?), then gc_jax with
    default arguments (``batch_axis`` under auto axes), against the unsharded ``want``."""
    import jax
    from jax.sharding import PartitionSpec as P

    import gc_jax

    params = place(mesh, model.params, specs)
    q, d = (place(mesh, b, jax.tree.map(lambda _: P(batch_axes), b)) for b in batches(model.inputs))
    full = lambda p: loss_fn(p, model.encode(p, q, None), model.encode(p, d, None))
    axis = None if explicit else batch_axes
    step = gc_jax.cached_value_and_grad(loss_fn, model.encode, CHUNK, batch_axis=axis)
    with jax.set_mesh(mesh), model.context(mesh):
        try:
            plain = jax.jit(jax.value_and_grad(full))(params)
        except Exception as error:
            plain = error
        try:
            got = jax.jit(step)(params, q, d)
        except Exception as error:
            notes = " | ".join(n for n in getattr(error, "__notes__", []) if "gc_jax" in n)
            where = "plain jit fails too" if isinstance(plain, Exception) else "plain jit runs"
            return f"ERROR ({where}): {first_line(error)}" + (f" NOTE: {notes}" if notes else "")
    if isinstance(plain, Exception):
        return f"{compare(got, want)}; plain jit fails: {first_line(plain)}"
    return compare(got, want)


def meshes(model: Model):
    """``(name, mesh, specs, batch_axes, explicit)`` for 8 devices: jax.make_mesh's, and
    the library's own."""
    import jax
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    for explicit in (True, False) if model.generic else ():
        kind = AxisType.Explicit if explicit else AxisType.Auto
        mesh = jax.make_mesh((8,), ("data",), axis_types=(kind,))
        name = "explicit" if explicit else "auto"
        replicated = jax.tree.map(lambda _: P(), model.params)
        yield f"make_mesh {name} dp", mesh, replicated, "data", explicit
        specs = jax.tree.map(lambda x: fsdp_spec(x, "data"), model.params)
        yield f"make_mesh {name} fsdp", mesh, specs, "data", explicit
    for name, (mesh, specs, axes) in model.meshes.items():
        explicit = AxisType.Explicit in mesh.axis_types
        yield name, mesh, specs, axes, explicit


def check_model(model: Model, devices: int) -> list[dict]:
    rows = []

    def add(mesh, result, seconds):
        rows.append({"library": model.library, "model": model.name, "devices": devices,
                     "mesh": mesh, "result": result, "seconds": round(seconds, 1)})  # fmt: skip
        line = f"  {model.library:8s} {model.name:28s} {devices} {mesh:28s} {result}"
        print(line[:400], flush=True)  # the whole result (a gc_jax note) in the JSON

    start = time.perf_counter()
    want = reference(model)
    if devices == 1:
        for mesh, result in check_single(model, want):
            add(mesh, result, time.perf_counter() - start)
            start = time.perf_counter()
        return rows
    for name, mesh, specs, axes, explicit in meshes(model):
        try:
            result = check_mesh(model, want, mesh, specs, axes, explicit)
        except Exception as error:
            traceback.print_exc()
            result = f"HARNESS ERROR: {first_line(error)}"
        add(name, result, time.perf_counter() - start)
        start = time.perf_counter()
    if model.recipe is not None:
        try:
            step, params = model.recipe()
            result = compare(step(params, *batches(model.inputs)), want)
        except Exception as error:
            traceback.print_exc()
            result = f"ERROR: {first_line(error)}"
        add("the page's step (recipe)", result, time.perf_counter() - start)
    return rows


# -- the models ---------------------------------------------------------------------------


def penzai_models(devices: int) -> list[Model]:
    import jax
    import library_embedders
    from penzai.models.transformer.variants import llamalike_common

    config = llamalike_common.LlamalikeTransformerConfig(
        num_kv_heads=2, query_head_multiplier=2, embedding_dim=32, projection_dim=8,
        mlp_hidden_dim=64, num_decoder_blocks=2, vocab_size=VOCAB, mlp_variant="swiglu",
        tie_embedder_and_logits=False,
    )  # fmt: skip
    encode, params = library_embedders.penzai_embedder(config, DIM, jax.random.key(0), 0.1)
    recipe = lambda: library_embedders.penzai_step(encode, params, loss_fn, CHUNK)
    return [Model("penzai", "llamalike 2x32, dropout", encode, params, dropout=True,
                  recipe=recipe)]  # fmt: skip


def maxtext_config(model_name: str, devices: int, parallelism: str, shard_mode: str,
                   scan_layers: bool = True, dropout: float = 0.0):  # fmt: skip
    """A tiny random-init MaxText model of ``model_name``'s architecture; ``parallelism``
    ``"fsdp"`` or ``"data"`` over ``devices`` devices."""
    from maxtext.configs import pyconfig

    base = Path(pyconfig.__file__).parent / "base.yml"
    tiny = ["override_model_config=True", "base_emb_dim=32", "base_num_query_heads=4",
            "base_num_kv_heads=2", "head_dim=8", "base_mlp_dim=64", "base_num_decoder_layers=2",
            f"vocab_size={VOCAB}", f"max_target_length={TOKENS}", "sliding_window_size=4",
            "dtype=float32", "weight_dtype=float32", "matmul_precision=highest",
            "attention=dot_product", "skip_jax_distributed_system=True",
            "enable_checkpointing=False", "run_name=gc_jax", "per_device_batch_size=4"]  # fmt: skip
    mesh = [f"ici_{parallelism}_parallelism={devices}", f"shard_mode={shard_mode}",
            f"scan_layers={scan_layers}", f"dropout_rate={dropout}"]  # fmt: skip
    if parallelism != "fsdp":
        mesh.append("ici_fsdp_parallelism=1")
    return pyconfig.initialize(["", str(base), f"model_name={model_name}", *tiny, *mesh])


def maxtext_models(devices: int) -> list[Model]:
    import jax
    import library_embedders
    from flax import nnx
    from flax.linen import partitioning

    import gc_jax

    def single(name, scan=True):
        """The model on one device (no mesh): the reference's encoder."""
        config = maxtext_config(name, 1, "fsdp", "auto", scan)
        model, _ = library_embedders.maxtext_embedder(config, DIM, devices=jax.devices()[:1])
        return nnx.state(model, nnx.Param), gc_jax.nnx_encoder(model)

    models = []
    if devices == 1:  # dropout in the scanned layers (MaxText's default scan_layers=True)
        models.append(maxtext_dropout_model())
    for name in ("qwen3-0.6b", "gemma3-4b", "llama2-7b"):
        if devices == 1:
            models.append(Model("maxtext", name, *reversed(single(name)), generic=False))
            continue
        variants = [("fsdp", "auto", True), ("data", "auto", True)]
        if name == "qwen3-0.6b":  # explicit axes: MaxText's scan fails under plain jit too
            variants += [("fsdp", "explicit", True), ("fsdp", "explicit", False)]
        for parallelism, shard_mode, scan in variants:
            config = maxtext_config(name, devices, parallelism, shard_mode, scan)
            on_mesh, mesh = library_embedders.maxtext_embedder(config, DIM)
            param_shardings, batch_sharding = library_embedders.maxtext_shardings(
                config, mesh, nnx.state(on_mesh, nnx.Param)
            )
            specs = jax.tree.map(lambda s: s.spec, param_shardings)
            rules = lambda _, c=config: partitioning.axis_rules(c.logical_axis_rules)
            mesh_name = f"maxtext {parallelism}={devices} {shard_mode}"
            mesh_name += "" if scan else " (scan_layers=False)"
            recipe = None
            if parallelism == "fsdp" and shard_mode == "auto":
                recipe = functools.partial(
                    library_embedders.maxtext_step, config, on_mesh, mesh, loss_fn, CHUNK
                )
            own = jax.device_get(nnx.state(on_mesh, nnx.Param))  # its init, on one host
            model = Model("maxtext", name, gc_jax.nnx_encoder(on_mesh), own, context=rules,
                          meshes={mesh_name: (mesh, specs, batch_sharding.spec[0])},
                          generic=False, reference_encode=single(name, scan)[1],
                          recipe=recipe)  # fmt: skip
            models.append(model)
    return models


def maxtext_dropout_model() -> Model:
    """Qwen3 with ``dropout_rate=0.1``: dropout on with a key; without one, the same
    parameters through the model built with ``dropout_rate=0`` (``nnx.view(model,
    deterministic=True)`` fails on the scanned layers' RNG streams, in flax 0.12.12)."""
    import jax
    import library_embedders
    from flax import nnx

    import gc_jax

    config = maxtext_config("qwen3-0.6b", 1, "fsdp", "auto", dropout=0.1)
    model, _ = library_embedders.maxtext_embedder(config, DIM, devices=jax.devices()[:1])
    train = gc_jax.nnx_encoder(model)
    without, _ = library_embedders.maxtext_embedder(
        maxtext_config("qwen3-0.6b", 1, "fsdp", "auto"), DIM, devices=jax.devices()[:1]
    )
    evaluate = gc_jax.nnx_encoder(without)
    encode = lambda p, x, key: (evaluate if key is None else train)(p, x, key)
    params = nnx.state(model, nnx.Param)
    return Model("maxtext", "qwen3-0.6b, dropout 0.1", encode, params, dropout=True, generic=False)


def gemma_models(devices: int) -> list[Model]:
    import dataclasses as dc

    import jax
    import library_embedders
    from gemma import gm
    from gemma.gm.nn import _config, _gemma
    from gemma.gm.nn.vision import _vision_utils

    config = dc.replace(
        gm.nn.Gemma3_270M.config, num_embed=VOCAB, embed_dim=32, hidden_dim=64, num_heads=2,
        head_dim=8, num_kv_heads=1, sliding_window_size=4,
        attention_types=_config.make_attention_layers_types(
            _gemma.GEMMA3_ATTENTION_PATTERN, num_layers=2),
    )  # fmt: skip
    text = library_embedders.gemma_embedder(config, DIM, jax.random.key(0))
    vit = _vision_utils.ViTModel(patch_size=(4, 4), width=16, depth=2, mlp_dim=32,
                                 num_heads=2, dropout=0.1)  # fmt: skip
    image = library_embedders.siglip_embedder(vit, DIM, (8, 8, 3), jax.random.key(0))
    models = [
        Model("gemma", "Gemma 3, bidirectional", *text),
        Model("gemma", "SigLIP ViT, dropout", *image, dropout=True, inputs="images"),
    ]
    for model in models:
        model.recipe = functools.partial(library_embedders.gemma_step, model.encode,
                                         model.params, loss_fn, CHUNK)  # fmt: skip
    for model in models if devices > 1 else ():
        shardings, batch = library_embedders.kauldron_fsdp(model.params)
        specs = jax.tree.map(lambda s: s.spec, shardings)
        model.meshes["kauldron fsdp (auto)"] = (batch.mesh, specs, "devices")
    return models


BUILDERS = {"penzai": penzai_models, "maxtext": maxtext_models, "gemma": gemma_models}


def versions(library: str) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("jax", "flax", library, "kauldron" if library == "gemma" else None):
        with contextlib.suppress(PackageNotFoundError, ValueError, TypeError):
            found[name] = version(name)
    return found


def run(library: str, devices: int) -> list[dict]:
    try:
        models = BUILDERS[library](devices)
    except ImportError as error:
        print(f"  {library}: not installed here ({error}); run it with its environment")
        return [{"library": library, "devices": devices, "result": f"not installed: {error}"}]
    print(f"{library} {versions(library)}", flush=True)
    return [row for model in models for row in check_model(model, devices)]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--library", choices=[*LIBRARIES, "all"], default="all")
    parser.add_argument("--devices", type=int, choices=[1, 8], default=8)
    parser.add_argument("--json", type=Path, default=None, help="append the rows here")
    args = parser.parse_args(argv)
    import jax

    if jax.device_count() < args.devices:
        parser.error(f"--devices {args.devices}: set XLA_FLAGS="
                     f"--xla_force_host_platform_device_count={args.devices} first")  # fmt: skip
    libraries = LIBRARIES if args.library == "all" else (args.library,)
    rows = [row for library in libraries for row in run(library, args.devices)]
    print("\n| library | model | devices | mesh | result |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['library']} | {r.get('model', '')} | {r['devices']} | {r.get('mesh', '')} "
              f"| {r['result']} |")  # fmt: skip
    if args.json:
        old = json.loads(args.json.read_text()) if args.json.exists() else []
        stamp = {"date": time.strftime("%Y-%m-%d %H:%M"), "python": platform.python_version()}
        args.json.write_text(json.dumps(old + [{**stamp, **r} for r in rows], indent=1))
    return rows


if __name__ == "__main__":
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    main()
