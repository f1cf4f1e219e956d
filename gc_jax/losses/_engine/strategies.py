"""Strategies: how a row-wise contrastive loss forms each row's loss from tiles of logits.

The tile loops of ``blockwise`` (one device) and ``engine`` (across devices) are
shared by every row-wise loss; a loss only says, tile by tile, how its running
per-row statistics are updated, how they end as the rows' losses, and what each
logit's gradient is. :class:`Softmax` (InfoNCE, CLIP) and :class:`Sigmoid` (SigLIP)
are the two strategies.
"""

from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp

Rows = tuple[jax.Array, ...]


class Strategy(Protocol):
    """How a blockwise loss forms each row's loss and its logits' gradient, tile by tile.

    A new row-wise loss fills these four static methods (see :class:`Softmax` and
    :class:`Sigmoid`); the loops, the masking of overlapping blocks, the custom VJP
    and the ring across devices (``engine``) are shared. Every array argument is
    in the accumulation dtype; ``z`` is a ``[rows, cols]`` tile of logits, ``valid``
    marks the columns the tile owns (a last, overlapping block's columns shared with
    the block before are not), ``pos`` marks each row's target (at most one column,
    always valid).
    """

    @staticmethod
    def init(zeros: jax.Array) -> Rows:
        """The running statistics before any tile, from ``[rows]`` zeros.

        ``zeros`` has the accumulation dtype and the rows' type (mesh, varying axes):
        build every statistic from it (``zeros``, ``full_like``), never from scratch.
        """

    @staticmethod
    def update(carry: Rows, z: jax.Array, valid: jax.Array, pos: jax.Array) -> Rows:
        """``carry`` updated with one tile's valid columns (tiles come in any order)."""

    @staticmethod
    def finish(carry: Rows) -> tuple[jax.Array, jax.Array]:
        """``(per-row losses, per-row statistic the backward needs)`` after every tile."""

    @staticmethod
    def dlogits(z: jax.Array, valid: jax.Array, pos: jax.Array, stat: jax.Array) -> jax.Array:
        """``d loss_row / d z`` on one tile (zero off ``valid``), given ``finish``'s statistic."""


class Softmax:
    """Per row: ``-log softmax(z)[target] = lse(z) - z[target]``."""

    @staticmethod
    def init(zeros: jax.Array) -> Rows:
        """Running max, running sum of ``exp(z - max)``, and the target's logit."""
        return jnp.full_like(zeros, -jnp.inf), zeros, zeros

    @staticmethod
    def update(carry: Rows, z: jax.Array, valid: jax.Array, pos: jax.Array) -> Rows:
        mx, se, target = carry
        z_valid = jnp.where(valid, z, -jnp.inf)
        new_mx = jnp.maximum(mx, z_valid.max(axis=1))
        # A row with no valid column yet (masked pairs) keeps max -inf: shift by 0 then.
        shift = jnp.where(new_mx == -jnp.inf, 0, new_mx)
        se = se * jnp.exp(mx - shift) + jnp.exp(z_valid - shift[:, None]).sum(axis=1)
        return new_mx, se, target + jnp.where(pos, z, 0).sum(axis=1)

    @staticmethod
    def finish(carry: Rows) -> tuple[jax.Array, jax.Array]:
        """The per-row losses and the statistic the backward needs (the LSE)."""
        mx, se, target = carry
        lse = mx + jnp.log(se)
        return lse - target, lse

    @staticmethod
    def dlogits(z: jax.Array, valid: jax.Array, pos: jax.Array, lse: jax.Array) -> jax.Array:
        return jnp.where(valid, jnp.exp(z - lse[:, None]), 0) - pos


class Sigmoid:
    """Per row: ``sum_j -log sigmoid(label_ij * z_ij)``, label ``+1`` at the target only."""

    @staticmethod
    def init(zeros: jax.Array) -> Rows:
        return (zeros,)

    @staticmethod
    def update(carry: Rows, z: jax.Array, valid: jax.Array, pos: jax.Array) -> Rows:
        terms = jax.nn.softplus(jnp.where(pos, -z, z))  # -log sigmoid(label * z)
        return (carry[0] + jnp.where(valid, terms, 0).sum(axis=1),)

    @staticmethod
    def finish(carry: Rows) -> tuple[jax.Array, jax.Array]:
        return carry[0], carry[0]  # the backward needs no statistic

    @staticmethod
    def dlogits(z: jax.Array, valid: jax.Array, pos: jax.Array, _: jax.Array) -> jax.Array:
        return jnp.where(valid, jnp.where(pos, -jax.nn.sigmoid(-z), jax.nn.sigmoid(z)), 0)
