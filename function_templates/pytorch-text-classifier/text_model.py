"""A small text classifier in plain torch: a hashing tokenizer, an EmbeddingBag and a linear layer.

The tokenizer needs no vocabulary file (nothing to download): each lower-cased word, and each pair
of adjacent words when `ngrams=2`, is hashed with BLAKE2b into one of `num_buckets` embedding rows.
The hash is fixed (unlike Python's `hash()`, which changes per process), so the same text gives
the same ids on every machine.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import re
from dataclasses import dataclass

import torch
from torch import nn

_WORD = re.compile(r"\w+")


@dataclass(frozen=True)
class TokenizerConfig:
    num_buckets: int = 32768
    ngrams: int = 2  # 1: words only; 2: words and adjacent word pairs

    def __post_init__(self) -> None:
        if self.num_buckets < 1 or self.ngrams not in (1, 2):
            raise ValueError(f"num_buckets must be positive and ngrams 1 or 2, got {self}")


class HashingTokenizer:
    """Text -> bucket ids in [0, num_buckets)."""

    def __init__(self, config: TokenizerConfig) -> None:
        self.config = config

    def features(self, text: str) -> list[str]:
        words = _WORD.findall(text.lower())
        if self.config.ngrams == 2:
            return words + [f"{a} {b}" for a, b in itertools.pairwise(words)]
        return words

    def ids(self, text: str) -> list[int]:
        return [self._bucket(feature) for feature in self.features(text)]

    def _bucket(self, feature: str) -> int:
        digest = hashlib.blake2b(feature.encode("utf-8"), digest_size=8).digest()
        return int.from_bytes(digest, "little") % self.config.num_buckets


class TextClassifier(nn.Module):
    """Mean of the texts' bucket embeddings, then a linear layer: logits of shape (texts, classes)."""

    def __init__(self, num_buckets: int, embedding_dim: int, num_classes: int) -> None:
        super().__init__()
        self.embedding = nn.EmbeddingBag(num_buckets, embedding_dim, mode="mean")
        self.fc = nn.Linear(embedding_dim, num_classes)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.fc(self.embedding(ids, offsets))


def random_state_dict(num_buckets: int, embedding_dim: int, num_classes: int, seed: int) -> dict[str, torch.Tensor]:
    """Freshly initialised weights, a pure function of the arguments (one seeded generator)."""
    generator = torch.Generator().manual_seed(seed)
    model = TextClassifier(num_buckets, embedding_dim, num_classes)
    bound = 1 / math.sqrt(embedding_dim)
    with torch.no_grad():
        nn.init.normal_(model.embedding.weight, std=1.0, generator=generator)
        nn.init.uniform_(model.fc.weight, -bound, bound, generator=generator)
        nn.init.uniform_(model.fc.bias, -bound, bound, generator=generator)
    return {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
