"""The loss engine: the tiled forms every loss runs, on one device or a ring.

:mod:`vjp` is the one custom VJP; its engines run a :class:`families.Spec`, the
families of logits of a loss (one for SigLIP, MaxSim or InfoNCE with ids alone;
several for InfoNCE's directions, a guide, a bank), each spec carrying its strategy
and score: :mod:`families` (``Plan``: one device, or the gathered columns) and
:mod:`ring_families` (``RingPlan``: a ring of devices, on :mod:`ring`'s schedule).
They share the tile loops (:mod:`blockwise`'s ``sweep`` and ``backward``,
:mod:`sweeps`' two sweeps, the block helpers of :mod:`tiles`, :mod:`order`'s data
dependencies), what a tile computes (:mod:`scores`: dot product or MaxSim;
:mod:`strategies`: softmax or sigmoid) and which pairs it keeps (:mod:`masks`).
Nothing here imports the losses around it (``gc_jax.losses``' public modules and their options).
"""
