"""gc_jax: gradient caching for JAX.

Exact large-batch gradients for contrastive models with one chunk's activations in
memory at a time (Gao et al., 2021), as pure, jittable functions.
"""

from gc_jax import _deprecated
from gc_jax import compat
from gc_jax import losses
from gc_jax import packing
from gc_jax import pooling
from gc_jax import testing
from gc_jax._value_and_grad import cached_value_and_grad
from gc_jax._chunked_encoder import chunked_encoder
from gc_jax._chunk_size import device_memory
from gc_jax._chunk_size import largest_chunk_size
from gc_jax._step_plan import plan_step
from gc_jax._step_plan import StepPlan
from gc_jax._distributed import global_loss
from gc_jax._equinox import equinox_encoder
from gc_jax._flax import linen_encoder
from gc_jax._flax import nnx_encoder
from gc_jax._keras import keras_encoder
from gc_jax._loss_scale import DynamicLossScale
from gc_jax._chunks.budget import TokenBudget
from gc_jax._chunks.lines import TokenPacking
from gc_jax._train_step import make_train_step

__version__ = "0.2.0"

__all__ = [
    "DynamicLossScale",
    "StepPlan",
    "TokenBudget",
    "TokenPacking",
    "cached_value_and_grad",
    "chunked_encoder",
    "compat",
    "device_memory",
    "equinox_encoder",
    "global_loss",
    "keras_encoder",
    "largest_chunk_size",
    "linen_encoder",
    "losses",
    "make_train_step",
    "nnx_encoder",
    "packing",
    "plan_step",
    "pooling",
    "testing",
]


def __getattr__(name: str):
    # The porting layers' 0.1 paths (gc_jax.GradCache, .cachex, .functional): each warns
    # once, then is bound here; see gc_jax._deprecated.
    value = _deprecated.attribute(name)
    globals()[name] = value
    return value
