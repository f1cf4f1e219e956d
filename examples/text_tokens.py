"""Tokenizers for the example: a byte-level BPE trained on the training pairs, and batching.

The tiny model's vocabulary is learnt from the *training* split only (queries and code
together, since the encoder is shared), so nothing of the held-out pairs leaks into it.
Byte-level BPE covers any text (no unknown tokens) and packs code about three to four
bytes per token, so 128 tokens hold the signature and the first lines of a function.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

PAD = "[PAD]"


def train_bpe(texts: Sequence[str], vocab_size: int, max_length: int) -> Tokenizer:
    """A byte-level BPE tokenizer trained on ``texts``, padding/truncating to ``max_length``.

    The id of ``[PAD]`` is 0.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    set_length(tokenizer, max_length)
    return tokenizer


def set_length(tokenizer: Tokenizer, max_length: int) -> None:
    """Makes ``tokenizer`` truncate and pad every text to exactly ``max_length`` tokens."""
    tokenizer.enable_truncation(max_length)
    pad = tokenizer.padding or {}
    tokenizer.enable_padding(
        length=max_length,
        pad_id=pad.get("pad_id", tokenizer.token_to_id(PAD)),
        pad_token=pad.get("pad_token", PAD),
    )


def encode(tokenizer: Tokenizer, texts: Sequence[str], max_length: int) -> dict[str, np.ndarray]:
    """``{"input_ids", "attention_mask"}``, each ``int32 [len(texts), max_length]``."""
    set_length(tokenizer, max_length)
    encodings = tokenizer.encode_batch(list(texts))
    return {
        "input_ids": np.array([e.ids for e in encodings], dtype=np.int32),
        "attention_mask": np.array([e.attention_mask for e in encodings], dtype=np.int32),
    }
