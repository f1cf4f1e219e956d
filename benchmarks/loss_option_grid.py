"""The options x forms grid of ``python -m benchmarks.loss_programs --options``.

Each entry is ``name -> (step, *inputs)``: the value and gradients (with respect to
``x``, ``y`` and the temperature or scale) of one loss with one set of options in one
form, the per-row option arrays (ids, a guide's rows, a bank) passed as inputs, not
baked in as constants. The forms: ``dense`` and ``block`` on one device; inside
``shard_map`` over 8 devices, ``gather``, ``ring`` and ``ringdense`` (the ring with one
tile per travelling block). A module of ``loss_programs``, not a script.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from gc_jax import losses

DEVICES = 8
N, K, DIM = 64, 2, 16  # queries, documents per query, width
GTE = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
LOCAL = {"dense": {}, "block": {"block_size": 16}}
SHARDED = {
    "gather": {"block_size": 8, "axis_name": "d", "method": "gather"},
    "ring": {"block_size": 8, "axis_name": "d", "method": "ring"},
    "ringdense": {"axis_name": "d", "method": "ring"},
}


def _data() -> dict:
    key = jax.random.split(jax.random.key(1), 8)
    x, y = jax.random.normal(key[0], (N, DIM)), jax.random.normal(key[1], (N * K, DIM))
    qid = jax.random.randint(key[2], (N,), 0, 20)
    pid = jax.random.randint(key[3], (N * K,), 0, 20)
    guide = (jax.random.normal(key[4], (N, 8)), jax.random.normal(key[5], (N * K, 8)))
    bank = losses.init_bank(3, x, y, query_ids=qid, doc_ids=pid)
    bank = losses.update_bank(bank, x * 0.5, y * 0.5, query_ids=qid, doc_ids=pid)
    tokens = (jax.random.normal(key[6], (16, 4, 8)), jax.random.normal(key[7], (32, 5, 8)))
    return {"x": x, "y": y, "qid": qid, "pid": pid, "guide": guide, "bank": bank,
            "tokens": tokens}  # fmt: skip


def _contrastive_options(d: dict) -> dict:
    """``name -> (static options, per-row option arrays)`` of ``contrastive_loss``."""
    ids = {"query_ids": d["qid"], "doc_ids": d["pid"]}
    guided = ("query_to_doc", "query_to_query", "doc_to_doc")
    per_direction = {"directions": ("query_to_doc", "doc_to_query"),
                     "partition_mode": "per_direction"}  # fmt: skip
    return {
        "plain": ({}, {}),
        "ids": ({}, ids),
        "guide": ({"margin": 0.1, "directions": guided}, {"guide": d["guide"]}),
        "hard": ({"hardness_mode": "all_negatives", "hardness_strength": 2.0}, {}),
        "gte_ids": ({"directions": GTE}, ids),
        "perdir": (per_direction, {}),
        "bank": ({"directions": GTE}, {**ids, "bank": d["bank"]}),
    }


def _step(loss, arrays: dict, mesh) -> Callable:
    """Value and gradients of ``loss(x, y, t, arrays)`` at ``t = 0.5``: on one device
    (``mesh`` None) or inside ``shard_map`` (rows split, a bank's count replicated)."""
    grad = lambda a, b, t, arrays: jax.value_and_grad(loss, (0, 1, 2))(a, b, t, arrays)
    if mesh is None:
        return lambda a, b, arrays: grad(a, b, 0.5, arrays)
    rows = P("d")
    specs = {k: jax.tree.map(lambda _: rows, v) for k, v in arrays.items()}
    if "bank" in arrays:
        specs["bank"] = specs["bank"]._replace(count=P())
    f = jax.shard_map(grad, mesh=mesh, in_specs=(rows, rows, P(), specs),
                      out_specs=(P(), (rows, rows, P())))  # fmt: skip
    return lambda a, b, arrays: f(a, b, 0.5, arrays)


def _forms(mesh) -> dict:
    """``form name -> (its keyword arguments, its mesh or None)``."""
    local = {name: (kw, None) for name, kw in LOCAL.items()}
    if mesh is None:
        return local
    return local | {name: (kw, mesh) for name, kw in SHARDED.items()}


def forms() -> dict:
    """``name -> (step, x, y, arrays)`` for every loss, option set and form."""
    d, out = _data(), {}
    mesh = None
    if jax.device_count() >= DEVICES:
        mesh = jax.make_mesh((DEVICES,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    x, y = d["x"], d["y"]
    for fname, (kw, m) in _forms(mesh).items():
        for oname, (static, arrays) in _contrastive_options(d).items():
            loss = lambda a, b, t, arr, s=static, kw=kw: losses.contrastive_loss(
                a, b, temperature=t, **s, **kw, **arr
            )
            out[f"contrastive_{oname}_{fname}"] = (_step(loss, arrays, m), x, y, arrays)
        out |= _k1_forms(d, fname, kw, m)
        out |= _other_losses(d, fname, kw, m)
    return dict(sorted(out.items(), key=lambda item: _order(item[0])))


def _k1_forms(d: dict, fname: str, kw: dict, mesh) -> dict:
    """One document per query with ids (alone and with GTE), and bfloat16 rows with ids."""
    x, y, n = d["x"], d["y"], N
    ids1 = {"query_ids": d["qid"], "doc_ids": d["pid"][:n]}
    out = {}
    for oname, static in (("ids1", {}), ("gte_ids1", {"directions": GTE})):
        loss = lambda a, b, t, arr, s=static: losses.contrastive_loss(
            a, b, temperature=t, **s, **kw, **arr
        )
        out[f"contrastive_{oname}_{fname}"] = (_step(loss, ids1, mesh), x, y[:n], ids1)
    ids = {"query_ids": d["qid"], "doc_ids": d["pid"]}
    loss = lambda a, b, t, arr: losses.contrastive_loss(a, b, temperature=t, **kw, **arr)
    bf16 = (x.astype(jnp.bfloat16), y.astype(jnp.bfloat16))
    out[f"contrastive_bf16_ids_{fname}"] = (_step(loss, ids, mesh), *bf16, ids)
    return out


def _other_losses(d: dict, fname: str, kw: dict, mesh) -> dict:
    """SigLIP and CLIP (plain and with ids), GISTEmbed and MaxSim in one form."""
    x, y, n = d["x"], d["y"], N
    ids = {"query_ids": d["qid"], "doc_ids": d["pid"][:n]}
    out = {}
    for oname, arrays in (("plain", {}), ("ids", ids)):
        sig = lambda a, b, t, arr: losses.sigmoid_loss(a, b, t, -1.0, **kw, **arr)
        out[f"sigmoid_{oname}_{fname}"] = (_step(sig, arrays, mesh), x, y[:n], arrays)
        clip = lambda a, b, t, arr: losses.clip_loss(a, b, t, **kw, **arr)
        out[f"clip_{oname}_{fname}"] = (_step(clip, arrays, mesh), x, y[:n], arrays)
    guide = {"guide": d["guide"]}
    gist = lambda a, b, t, arr: losses.gist_loss(
        a, b, arr["guide"], temperature=t, margin=0.1, **kw
    )
    out[f"gist_{fname}"] = (_step(gist, guide, mesh), x, y, guide)
    (q, docs), masks = d["tokens"], {"dm": jnp.ones((32, 5), bool).at[:, 3:].set(False)}
    mkw = {**kw, "block_size": 4} if "block_size" in kw else kw
    maxsim = lambda a, b, t, arr: losses.maxsim_loss(a, b, d_mask=arr["dm"], temperature=t, **mkw)
    out[f"maxsim_{fname}"] = (_step(maxsim, masks, mesh), q, docs, masks)
    return out


def _order(name: str) -> tuple:
    """Losses, then options, then forms in the order of ``LOCAL`` and ``SHARDED``."""
    form = name.rsplit("_", 1)[1]
    return (name.rsplit("_", 1)[0], list(LOCAL | SHARDED).index(form))
