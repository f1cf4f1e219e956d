"""The loss engine: the tiled forms every loss runs, on one device or a ring.

:mod:`vjp` is the one custom VJP and :mod:`engine` its one engine: ``engine.Engine`` runs
a :class:`families.Spec`, the families of logits of a loss (one for SigLIP, MaxSim or
InfoNCE with ids alone; several for InfoNCE's directions, a guide, a bank), each spec
carrying its strategy and score, on one device (or over the gathered columns) or on a
ring of devices (:mod:`ring`'s schedule; one device is the ring visited once): the two
:mod:`policies`, ``Local`` and ``Ring``. :mod:`families` also holds the dense form and
the metadata a spec's families read. They share the tile loops (:mod:`blockwise`'s
``sweep`` and ``backward``, :mod:`sweeps`' two sweeps, the tile problem and block
helpers of :mod:`tiles`, :mod:`order`'s data dependencies), what a tile computes
(:mod:`scores`: dot product or MaxSim; :mod:`strategies`: softmax or sigmoid), which
pairs it keeps (:mod:`masks`), the sides by name (:mod:`sides`) and the accumulation
dtype (:mod:`precision`). Nothing here imports the losses around it (``gc_jax.losses``'
public modules and their options).
"""
