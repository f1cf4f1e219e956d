"""The loss engine: the tiled forms every loss runs, on one device or a ring.

:mod:`vjp` is the one custom VJP; its engines are :mod:`blockwise` (one family of
logits), :mod:`ring` (one family on a ring of devices), :mod:`families` and
:mod:`ring_families` (several families: InfoNCE's directions, a guide, a bank). They
share the tile loops (:mod:`blockwise`'s ``sweep``, :mod:`sweeps`' backward, the
block helpers of :mod:`tiles`, :mod:`order`'s data dependencies), what a tile
computes (:mod:`scores`: dot product or MaxSim; :mod:`strategies`: softmax or
sigmoid) and which pairs it keeps (:mod:`masks`). Nothing here imports the losses
around it (``gc_jax.losses``' public modules and their options).
"""
