"""docs_per_query: under pmap and shard_map(check_vma=False) documents passed
replicated cannot be told from hard negatives, so more documents than queries must be
said (issue 34 item 3: 16 replicated documents read as 8 hard negatives per query)."""

from __future__ import annotations

import chex
import jax
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from options_reference import contrastive
from test_losses import BLOCK_TOL

from gc_jax.losses import contrastive_loss, gist_loss, maxsim_loss

D = 8


@pytest.fixture(scope="module", autouse=True)
def _devices():
    if jax.device_count() < D:
        pytest.skip(f"needs {D} devices: XLA_FLAGS=--xla_force_host_platform_device_count={D}")


def _rows(n, seed):
    return jax.random.normal(jax.random.key(seed), (n, 4))


def _per_device(v):
    return v.reshape(D, -1, *v.shape[1:])


LOSSES = {
    "contrastive_loss": lambda q, d, **kw: contrastive_loss(q, d, axis_name="d", **kw),
    "gist_loss": lambda q, d, **kw: gist_loss(q, d, (q, d), axis_name="d", **kw),
    "maxsim_loss": lambda q, d, **kw: maxsim_loss(q[:, None], d[:, None], axis_name="d", **kw),
}


@pytest.mark.parametrize("name", LOSSES)
def test_replicated_documents_under_pmap_are_refused(name):
    """The issue's case: 2 queries per device, every device's 16 documents replicated."""
    q, d = _rows(2 * D, 0), _rows(2 * D, 1)
    f = jax.pmap(lambda q, d: LOSSES[name](q, d), axis_name="d", in_axes=(0, None))
    with pytest.raises(ValueError, match=r"docs_per_query=8.*split it like"):
        f(_per_device(q), d)


def test_replicated_documents_under_untyped_shard_map_are_refused():
    q, d = _rows(2 * D, 0), _rows(2 * D, 1)
    mesh = jax.make_mesh((D,), ("d",), (AxisType.Auto,))
    f = jax.shard_map(lambda q, d: contrastive_loss(q, d, axis_name="d"), mesh=mesh,
                      in_specs=(P("d"), P()), out_specs=P(), check_vma=False)  # fmt: skip
    with pytest.raises(ValueError, match=r"pmap or shard_map\(check_vma=False\)"):
        jax.jit(f)(q, d)


@pytest.mark.parametrize("method", ["gather", "ring"])
def test_said_hard_negatives_under_pmap_are_exact(method):
    k = 3
    q, d = _rows(2 * D, 0), _rows(2 * D * k, 1)
    want = jax.value_and_grad(lambda q, d: contrastive(q, d, 0.5), (0, 1))(q, d)

    kw = {"temperature": 0.5, "axis_name": "d", "method": method, "block_size": 2}

    def per_device(q, d):  # each device's rows get their whole gradient
        loss = lambda q, d: contrastive_loss(q, d, docs_per_query=k, **kw)
        return jax.value_and_grad(loss, (0, 1))(q, d)

    value, (dq, dd) = jax.pmap(per_device, axis_name="d")(_per_device(q), _per_device(d))
    got = (value[0], (dq.reshape(q.shape), dd.reshape(d.shape)))
    chex.assert_trees_all_close(got, want, **BLOCK_TOL)


def test_pairs_need_nothing_said():
    q, d = _rows(2 * D, 0), _rows(2 * D, 1)
    f = jax.pmap(lambda q, d: contrastive_loss(q, d, axis_name="d"), axis_name="d")
    value = f(_per_device(q), _per_device(d))[0]
    np.testing.assert_allclose(value, contrastive(q, d, 1.0), rtol=1e-5)


def test_a_wrong_count_is_named():
    q, d = _rows(4, 0), _rows(8, 1)
    with pytest.raises(ValueError, match=r"docs_per_query=3 says y holds 3 rows per query: 12"):
        contrastive_loss(q, d, docs_per_query=3)
    with pytest.raises(ValueError, match="docs_per_query must be a positive int"):
        contrastive_loss(q, d, docs_per_query=0)
    chex.assert_trees_all_close(contrastive_loss(q, d, docs_per_query=2), contrastive_loss(q, d))
