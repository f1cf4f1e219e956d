"""One process of the 2-process test: 4 CPU devices each, gloo collectives on loopback.

Run by tests/test_multihost.py as ``python multihost_worker.py PORT PROCESS_ID``; exits 0
when the distributed step matches the single-process full-batch reference.
"""

import sys


def main(port: int, process_id: int) -> None:
    import jax

    jax.config.update("jax_num_cpu_devices", 4)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)

    import chex
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from test_distributed import encode, expected, global_batch, make_loss, make_params

    import gc_jax

    assert jax.device_count() == 8 and jax.local_device_count() == 4
    mesh = jax.make_mesh((8,), ("d",))
    q, d = global_batch(k=2)  # every process draws the same global batch

    def local_rows(x):  # this process holds its 4 devices' rows
        rows = x.shape[0] // jax.process_count()
        return np.asarray(x[process_id * rows : (process_id + 1) * rows])

    inputs = [
        jax.make_array_from_process_local_data(NamedSharding(mesh, P("d")), local_rows(x))
        for x in (q, d)
    ]
    grad_fn = gc_jax.cached_value_and_grad(make_loss("d"), encode, 4, axis_name="d")
    step = jax.jit(
        jax.shard_map(grad_fn, mesh=mesh, in_specs=(P(), P("d"), P("d")), out_specs=(P(), P()))
    )
    loss, grads = step(make_params(), *inputs)
    got = jax.tree.map(lambda a: np.asarray(a.addressable_data(0)), (loss, grads))
    chex.assert_trees_all_close(got, expected(k=2), rtol=2e-5, atol=2e-6)
    print(f"process {process_id}: loss {float(got[0]):.6f} matches the full batch")
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
