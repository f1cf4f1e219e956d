"""The accumulation dtype: what every loss and batch-wide term computes in.

Tiles, per-row statistics, per-block gradients and the batch-wide terms' sums are
computed in the inputs' dtype widened to at least float32: bfloat16 and float16 rows
stay narrow in memory, their products accumulate in float32, and float64 (under x64)
stays float64.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp


def accumulation_dtype(*values: Any) -> jnp.dtype:
    """The values' (arrays', dtypes' or scalars') common dtype, at least float32.

    Examples:
      >>> import jax.numpy as jnp
      >>> accumulation_dtype(jnp.zeros(2, jnp.bfloat16), 1.0).name
      'float32'
    """
    return jnp.promote_types(jnp.result_type(*values), jnp.float32)
