"""``benchmarks/bert.py``'s dual encoder in PyTorch, for ``vs_pytorch.py``.

Each tower is a ``transformers.BertModel`` of ``bert.py``'s sizes with ``bert.py``'s
choices: post-LayerNorm blocks (epsilon 1e-12), the tanh GELU, no dropout, no token
types (one, zero and frozen), no pooler, mean pooling over the mask, ``sdpa``
attention; random weights (no download), or ``bert.py``'s copied in (``to_hf``), and
its gradients read back in ``bert.py``'s names and layouts (``from_hf``). The mapping is
NumPy only; PyTorch, transformers and GradCache are imported only when called.
"""

from __future__ import annotations

import sys
from importlib import import_module, metadata

import numpy as np

QKV = ("query", "key", "value")  # bert.py's fused qkv: these, in this order
LAYER_MAP = {  # bert.py's layer parameters -> transformers.BertLayer's modules
    "out": "attention.output.dense",
    "norm1": "attention.output.LayerNorm",
    "mlp_in": "intermediate.dense",
    "mlp_out": "output.dense",
    "norm2": "output.LayerNorm",
}


def _names(layers: int) -> dict[str, str]:
    """``bert.py``'s names within a tower -> the state dict's, all but the fused qkv."""
    names = {"tokens": "embeddings.word_embeddings.weight",
             "positions": "embeddings.position_embeddings.weight",
             "norm/scale": "embeddings.LayerNorm.weight",
             "norm/bias": "embeddings.LayerNorm.bias"}  # fmt: skip
    for i in range(layers):
        for ours, theirs in LAYER_MAP.items():
            pairs = (("scale", "weight"), ("bias", "bias")) if "norm" in ours else (
                ("w", "weight"), ("b", "bias"))  # fmt: skip
            for x, y in pairs:
                names[f"layers/{i}/{ours}/{x}"] = f"encoder.layer.{i}.{theirs}.{y}"
    return names


def to_hf(flat: dict[str, np.ndarray], tower: str, layers: int) -> dict[str, np.ndarray]:
    """One tower of ``bert.py``'s parameters (flat: ``"query/layers/0/qkv/w"``) as a
    ``transformers.BertModel`` state dict: ``[out, in]`` weights, the fused qkv split
    into query, key and value (no token types, no pooler)."""
    sd = {}
    for ours, theirs in _names(layers).items():
        x = flat[f"{tower}/{ours}"]
        sd[theirs] = x.T if ours.endswith("/w") else x
    for i in range(layers):
        qkv = [np.split(flat[f"{tower}/layers/{i}/qkv/{j}"], 3, axis=-1) for j in "wb"]
        for name, w, b in zip(QKV, *qkv, strict=True):
            sd[f"encoder.layer.{i}.attention.self.{name}.weight"] = w.T
            sd[f"encoder.layer.{i}.attention.self.{name}.bias"] = b
    return sd


def from_hf(sd: dict[str, np.ndarray], tower: str, layers: int) -> dict[str, np.ndarray]:
    """The inverse of ``to_hf`` (for gradients): flat ``bert.py`` names and layouts."""
    flat = {}
    for ours, theirs in _names(layers).items():
        flat[f"{tower}/{ours}"] = sd[theirs].T if ours.endswith("/w") else sd[theirs]
    for i in range(layers):
        own = [f"encoder.layer.{i}.attention.self.{name}" for name in QKV]
        flat[f"{tower}/layers/{i}/qkv/w"] = np.concatenate([sd[f"{n}.weight"].T for n in own], 1)
        flat[f"{tower}/layers/{i}/qkv/b"] = np.concatenate([sd[f"{n}.bias"] for n in own])
    return flat


def import_gradcache():
    """``GradCache`` and where it came from: PyPI's ``gradcache`` 0.0.1 (luyug/GradCache's
    code, whose ``from grad_cache.context_managers import ...`` finds no ``grad_cache``
    module under that package name, and whose ``__init__`` swallows the error: aliased
    here), else luyug/GradCache installed from source (``grad_cache``)."""
    try:
        package = import_module("gradcache")
    except ImportError:
        return import_module("grad_cache").GradCache, f"GradCache {metadata.version('GradCache')}"
    sys.modules.setdefault("grad_cache", package)
    module = import_module("gradcache.grad_cache")
    return module.GradCache, f"gradcache {metadata.version('gradcache')}"


def hf_config(sizes: dict):
    """The ``transformers.BertConfig`` of ``bert.py``'s sizes (``vs_pytorch.model_sizes``)."""
    import transformers

    return transformers.BertConfig(
        vocab_size=sizes["vocab"], hidden_size=sizes["width"],
        num_hidden_layers=sizes["layers"], num_attention_heads=sizes["heads"],
        intermediate_size=sizes["mlp"], max_position_embeddings=sizes["passage_len"],
        type_vocab_size=1, pad_token_id=None, hidden_act="gelu_pytorch_tanh",
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, layer_norm_eps=1e-12,
        attn_implementation="sdpa",
    )  # fmt: skip


def towers(sizes: dict, bf16: bool, device: str, flat: dict[str, np.ndarray] | None) -> list:
    """The query and the passage tower on ``device``, in training mode; ``bf16``: each
    forward under ``torch.autocast(bfloat16)`` (parameters stay float32); ``flat``:
    ``bert.py``'s parameters (``"query/..."``, ``"passage/..."``), else random weights."""
    import torch
    import transformers

    config = hf_config(sizes)

    class Tower(torch.nn.Module):  # BertModel, mean-pooled over the mask (as bert.tower)
        def __init__(self):
            super().__init__()
            self.bert = transformers.BertModel(config, add_pooling_layer=False)
            self.bert.embeddings.token_type_embeddings.weight.requires_grad_(False)

        def forward(self, input_ids, attention_mask):
            with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
                h = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            m = attention_mask[..., None].to(h.dtype)
            return (h * m).sum(1) / m.sum(1).clamp(min=1)

    out = []
    for name in ("query", "passage"):
        tower = Tower()
        with torch.no_grad():
            tower.bert.embeddings.token_type_embeddings.weight.zero_()
        if flat is not None:
            sd = {k: torch.from_numpy(v) for k, v in to_hf(flat, name, sizes["layers"]).items()}
            missing, unexpected = tower.bert.load_state_dict(sd, strict=False)
            if unexpected or set(missing) - {"embeddings.token_type_embeddings.weight"}:
                raise ValueError(f"weights do not fit BertModel: {missing=}, {unexpected=}")
        out.append(tower.to(device).train())
    return out


def gradients(towers: list, layers: int) -> dict[str, np.ndarray]:
    """Both towers' ``.grad``, float32, in ``bert.py``'s flat names and layouts."""
    flat = {}
    for name, tower in zip(("query", "passage"), towers, strict=True):
        sd = {k: v.grad.float().cpu().numpy() for k, v in tower.bert.named_parameters()
              if v.grad is not None}  # fmt: skip
        flat.update(from_hf(sd, name, layers))
    return flat
