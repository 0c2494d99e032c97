"""Ensemble decoding: several models that share a vocabulary, searched as one model.

Search sees a model only through :class:`aiayn.decode.search.IncrementalModel`, so an ensemble is
one
more such model: :class:`Ensemble` encodes the source with every model, keeps one decoder cache
per model in an :class:`EnsembleCache` that reorders them together, and at every step returns

    log p(y) = log( (1/N) Σ_i p_i(y) ) = logsumexp_i log p_i(y) − log N,

the log of the *mean of the models' probabilities*, as fairseq's ``EnsembleModel`` does. (Marian
adds the models' log-probabilities instead: a product of the distributions, unnormalised.) The
mean of distributions is a distribution, so beam search's scores and stopping rule, the length
penalty and sampling work unchanged; an ensemble of a model with itself is that model, up to
float rounding (tested).

The models must give the same token id the same meaning: one tokenizer, one target vocabulary.
:class:`aiayn.decode.translator.Translator` checks that before building an ensemble; here only the
vocabulary sizes can be compared.

Shapes: B sentences, R rows (hypotheses) of the decoder cache, S source length, V vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from aiayn.decode.search import IncrementalModel, ReorderableCache
from aiayn.errors import UserValueError
from aiayn.model_dir import CheckpointError, LoadedModel, sha256_of

__all__ = ["Ensemble", "EnsembleCache"]


class EnsembleCache:
    """One decoder cache per model, reordered together.

    Attributes:
        caches: The models' caches, in the ensemble's model order.
    """

    def __init__(self, caches: list[ReorderableCache]) -> None:
        self.caches = caches

    def reorder(self, index: Tensor, sentences: Tensor | None = None) -> EnsembleCache:
        """The same row and sentence selection applied to every model's cache."""
        self.caches = [cache.reorder(index, sentences) for cache in self.caches]
        return self


class Ensemble:
    """N models decoded as one by averaging their next-token probabilities.

    ``encode`` returns, as the ensemble's "memory", the list of every model's memory and source
    mask; search never looks inside it and hands it back to ``init_cache``.

    Args:
        models: Two or more models over the same vocabulary (one is allowed and is that model).

    Raises:
        ValueError: No model, or the models' target vocabulary sizes differ (where they say).
    """

    def __init__(self, models: Sequence[IncrementalModel]) -> None:
        if not models:
            raise ValueError("an ensemble needs at least one model")
        sizes = {getattr(getattr(m, "config", None), "tgt_vocab_size", None) for m in models}
        sizes.discard(None)
        if len(sizes) > 1:
            raise UserValueError(
                f"the models' target vocabularies differ in size ({sorted(sizes)}): an "
                "ensemble needs models trained with the same tokenizer"
            )
        self.models = list(models)

    def encode(self, src_tokens: Tensor) -> tuple[Any, Tensor | None]:
        """(B, S) source ids -> every model's (memory, src_key_mask), and the source mask."""
        encoded = [model.encode(src_tokens) for model in self.models]
        return encoded, encoded[0][1]

    def init_cache(self, memory: Any, src_key_mask: Tensor | None, max_len: int) -> EnsembleCache:
        """Each model's cache over its own memory (``src_key_mask`` is each model's own)."""
        return EnsembleCache(
            [
                model.init_cache(model_memory, model_mask, max_len)
                for model, (model_memory, model_mask) in zip(self.models, memory, strict=True)
            ]
        )

    def decode_step(self, tokens: Tensor, cache: EnsembleCache) -> Tensor:
        """(R,) tokens -> (R, V) float32 log of the mean of the models' probabilities."""
        log_probs = torch.stack(
            [
                model.decode_step(tokens, model_cache)
                for model, model_cache in zip(self.models, cache.caches, strict=True)
            ]
        )  # (N, R, V)
        if len(self.models) == 1:
            return log_probs[0]
        return log_probs.logsumexp(dim=0) - math.log(len(self.models))


def check_same_vocabulary(loaded: list[LoadedModel]) -> None:
    """An ensemble's models must share the tokenizer (byte for byte) and the target vocabulary
    size: then a token id means the same piece to each of them."""
    first = loaded[0]
    first_sha = sha256_of(first.tokenizer_file)
    for other in loaded[1:]:
        sha = sha256_of(other.tokenizer_file)
        if sha != first_sha:
            raise CheckpointError(
                f"cannot ensemble {first.directory} and {other.directory}: their tokenizers "
                f"differ (sha256 {first_sha[:12]}… and {sha[:12]}…); the models of an ensemble "
                "must be trained with the same tokenizer"
            )
        sizes = first.config.tgt_vocab_size, other.config.tgt_vocab_size
        if sizes[0] != sizes[1]:
            raise CheckpointError(
                f"cannot ensemble {first.directory} and {other.directory}: their target "
                f"vocabularies have {sizes[0]} and {sizes[1]} entries"
            )
