"""The accelerator benchmark runs (on this CPU, with a tiny model) and reports what it says."""

import json

from benchmarks import common, gpu_step, tpu_compile


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
