"""Contrastive losses for cached representations, local or across devices.

* :func:`contrastive_loss`: InfoNCE of queries against documents, with in-batch and
  hard negatives; GTE's directions, false-negative masks by ids, GISTEmbed's guide.
* :func:`clip_loss`: CLIP's symmetric InfoNCE of paired rows.
* :func:`sigmoid_loss`: SigLIP's pairwise sigmoid loss.
* :func:`maxsim_loss`: InfoNCE over ColBERT's late-interaction (MaxSim) scores of
  multi-vector rows ``[rows, tokens, dim]`` with token masks.
* :func:`matryoshka`: any of these (or your own) summed over truncated widths of the
  representations, from one cache.
* :func:`text_ids`: ids of texts from their tokens, for the false-negative masks.
* :class:`Bank`, :func:`init_bank`, :func:`update_bank`: earlier steps' representations
  as extra negatives of :func:`contrastive_loss` (ContAccum, MoCo), without gradient.

*Across devices*, with ``axis_name`` (inside ``shard_map`` or ``pmap``), each device
computes only its own rows' losses against every device's other side, and the loss
returns the *global* loss on every device with the gradient of this device's share
(see ``gc_jax.global_loss``), which is what ``cached_value_and_grad`` expects. Under
``shard_map`` the loss is typed replicated: return it with ``out_specs=P()``. Rows'
gradients are this device's rows of the global gradient, and a replicated scalar
(e.g. a temperature in ``in_specs=P()``) gets the global gradient. Under plain
``jit`` over rows sharded with ``NamedSharding`` the losses read the layout from the
rows' types (explicit mesh axes); under auto mesh axes pass ``axis_name`` naming the
batch's mesh axis (with ``jax.set_mesh``), or nothing inside ``cached_value_and_grad``
/ ``make_train_step`` with ``batch_axis``, which tell the loss (see
``gc_jax._layout.rows_layout``).

*Two forms across devices* (``method=``):

* ``"gather"``: every device all-gathers the other side (``all_gather``, which
  transposes to a reduce-scatter). Under sharded ``jit`` the compiler replicates the
  rows instead and every device computes the whole loss. Per-device memory grows
  with the *global* batch.
* ``"ring"``: each device keeps its rows; the other side's blocks travel around the
  devices with ``ppermute`` (the next block is sent while this one is computed), with an
  online log-sum-exp for the softmax losses and a backward on the ring that carries each
  block's gradient home. Nothing batch-sized is gathered in either direction, and
  per-device memory follows the *per-device* batch, whatever the number of devices. Under
  sharded ``jit`` the loss runs its ring inside a ``shard_map`` over the batch's mesh
  axes.
* ``"auto"`` (the default): the ring when the rows are split over more than one
  device and the gather form would hold more than 64 MiB of gathered rows per device
  (e.g. 43,690 rows of 768-d bfloat16 for ``contrastive_loss``, both sides for
  ``clip_loss``); the gather form below that, where the ring's
  ``P`` sequential steps would cost more than its memory saves.

With ``block_size`` the logits are computed in ``block_size x block_size`` tiles,
forward and backward, and never held whole (an online log-sum-exp, and a custom VJP that
recomputes them): memory grows with ``rows * dim`` instead of ``rows**2``. Values and
gradients match the dense computation up to float rounding. In the ring, ``block_size``
tiles each travelling block (without it, each travelling block is one tile).

*Forward mode*: a loss with ``block_size`` (or in ring form) is a ``jax.custom_vjp``,
so ``jax.jvp`` and ``jax.jacfwd`` do not go through it (JAX raises); reverse mode
(``jax.grad``, ``jax.vjp``) does. Without ``block_size``, in the gather form, it is
plain JAX and supports both.

*Precision*: logits and losses are accumulated in at least float32. Rows in bfloat16
or float16 are never cast whole (each matrix product accumulates in float32); the
loss is float32 and the rows' gradients come back in the rows' own dtype. Scalars
(temperature, logit scale and bias) are used in float32 and differentiated as such.
"""

# The public losses, one per line (optax style); the forms they share are private.
from gc_jax.losses._bank import (
    Bank,
    init_bank,
    update_bank,
)
from gc_jax.losses._clip import clip_loss
from gc_jax.losses._contrastive import contrastive_loss
from gc_jax.losses._distillation import embedding_distillation
from gc_jax.losses._gist import gist_loss
from gc_jax.losses._ids import text_ids
from gc_jax.losses._matryoshka import matryoshka
from gc_jax.losses._maxsim import maxsim_loss
from gc_jax.losses._sigmoid import sigmoid_loss
from gc_jax.losses._sparse import (
    flops_regularizer,
    l1_regularizer,
    quadratic_warmup,
    sparse_regularizer,
    splade_pool,
)
from gc_jax.losses._spread_out import spread_out_regularizer

__all__ = [
    "Bank",
    "clip_loss",
    "contrastive_loss",
    "embedding_distillation",
    "flops_regularizer",
    "gist_loss",
    "init_bank",
    "l1_regularizer",
    "matryoshka",
    "maxsim_loss",
    "quadratic_warmup",
    "sigmoid_loss",
    "sparse_regularizer",
    "splade_pool",
    "spread_out_regularizer",
    "text_ids",
    "update_bank",
]
