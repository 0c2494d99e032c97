"""The PyTorch backend: an aiayn `Transformer`, or the ensemble of several, under aiayn's search.

The default of `Translator`, and the only backend that returns attention maps: one extra
teacher-forced pass over each batch's best outputs (an ensemble has no maps of its own, each
model attends differently).

A model keeps its device and dtype; `load_model_dirs` loads model directories and prepares
them for inference (int8, bf16 or pre-packed oneDNN weights; on a CPU, the attention kernels
of `acceleration.use_cpu_attention`). During a search or an attention pass the models are in
evaluation mode, and a search on a CPU runs those kernels; the previous mode and kernels come
back after each, so that a training loop can decode between updates (validation BLEU).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

from aiayn.acceleration import (
    native_bf16_cpu,
    quantize_int8,
    use_cpu_attention,
    using_cpu_attention,
)
from aiayn.decode import search
from aiayn.decode.backends import Backend
from aiayn.decode.ensemble import Ensemble, check_same_vocabulary
from aiayn.decode.options import DecodingOptions
from aiayn.decode.packing import pack_for_decoding, stack_self_attention
from aiayn.decode.restricted import RestrictedModel
from aiayn.decode.results import Hypothesis, SentenceAttention, cut_attention
from aiayn.decode.scoring import PairScore, score_pairs
from aiayn.decode.search import pad, search_with
from aiayn.decode.shortlist import Shortlist, model_shortlist
from aiayn.errors import UserValueError
from aiayn.model import ATTENTION_KINDS, Transformer
from aiayn.model_dir import LoadedModel, load_model_dir
from aiayn.runtime import checked_device
from aiayn.text.tokenizer import BOS_ID, SplitTokenizer, Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)

__all__ = ["PyTorchBackend", "load_model_dirs"]


class PyTorchBackend(Backend):
    """One model, or an ensemble (`aiayn.decode.ensemble.Ensemble`: the mean of the models'
    probabilities at every step), decoded by `aiayn.decode.search`; the backend that scores
    given translations (`aiayn.decode.scoring`).

    Attributes:
        models: The Transformers.
        device: The first model's.
        shortlist: One model's lexical shortlist, which ``options.shortlist`` decodes with
            (`aiayn.decode.restricted`); None where it has none.
        target_side: The target ids a single model's projection scores
            (`Transformer.target_side`), which every search is restricted to, its projection's
            rows taken once; None where it scores them all, or decodes over them all.
    """

    def __init__(
        self,
        models: Sequence[nn.Module],
        shortlist: Shortlist | None = None,
        target_side: torch.Tensor | None = None,
    ) -> None:
        """One model, or an ensemble's models (sharing a tokenizer); a single model's
        shortlist, and its target side where its weights stay as they are (a trained model's
        for inference; rows taken once would not follow a training model's updates).

        Raises:
            TypeError: A model is not an aiayn `Transformer`.
        """
        if not models:
            raise ValueError("no model given")
        for model in models:
            if not isinstance(model, Transformer):
                raise TypeError(f"expected an aiayn Transformer, got {type(model).__name__}")
        self.models: list[Transformer] = list(models)  # type: ignore[arg-type]
        self.device = next(self.models[0].parameters()).device
        self.shortlist = shortlist
        # What search decodes with: the model itself, or the ensemble of all of them.
        self._decoder: search.IncrementalModel = (
            self.models[0] if len(self.models) == 1 else Ensemble(self.models)
        )
        self.target_side = None if len(self.models) > 1 else target_side
        if target_side is not None and len(target_side) == self.models[0].config.tgt_vocab_size:
            self.target_side = None  # every piece: the search as it is
        if self.target_side is not None:
            self.target_side = self.target_side.to(self.device)
            # Exact: the pieces outside it have probability 0 (their fixed bias).
            self._decoder = RestrictedModel(self.models[0], self.target_side)
            self._target_side_ids = self.target_side.cpu().numpy()

    supports_scoring = True

    @property
    def returns_attention(self) -> bool:  # type: ignore[override]
        return len(self.models) == 1

    def check(self, options: DecodingOptions, *, return_attention: bool) -> None:
        if return_attention and not self.returns_attention:
            raise UserValueError(
                "an ensemble has no attention maps of its own (each model attends "
                "differently): ask for attention or alignments with a single model"
            )

    def shortlist_missing(self) -> str | None:
        if len(self.models) > 1:
            return "an ensemble decodes over the whole vocabulary (a shortlist is one model's)"
        if self.shortlist is None:
            return "the model has no lexical shortlist (aiayn shortlist makes one)"
        return None

    def seed(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    def search(
        self,
        sources: list[list[int]],
        options: DecodingOptions,
        generator: torch.Generator | None,
    ) -> list[list[Hypothesis]]:
        on_cpu = self.device.type == "cpu"
        kernels = using_cpu_attention(self.models) if on_cpu else contextlib.nullcontext()
        decoder, vocab = self._decoder, self.target_side
        if options.shortlist and self.shortlist is not None and len(self.models) == 1:
            allowed = self.shortlist.allowed(sources)
            if self.target_side is not None:
                allowed = np.intersect1d(allowed, self._target_side_ids)
            if len(allowed) < (len(vocab) if vocab is not None else self.shortlist.tgt_vocab_size):
                vocab = torch.from_numpy(allowed).to(self.device)
                decoder = RestrictedModel(self.models[0], vocab)
        with _evaluating(self.models), kernels:
            return search_with(decoder, sources, options, generator, self.device, vocab)

    def attention(
        self,
        sources: list[list[int]],
        outputs: list[list[int]],
        kinds: Sequence[str] | None = None,
    ) -> list[SentenceAttention]:
        """One teacher-forced pass over ``[BOS] + output`` for the whole batch, cut per
        sentence.

        Target padding on the right changes nothing before it, as decoder self-attention is
        causal; source padding is masked.
        """
        src = pad(sources, self.device)  # (B, S)
        tgt = pad([[BOS_ID, *tokens] for tokens in outputs], self.device)  # (B, T)
        with _evaluating(self.models), torch.inference_mode():
            _, maps = self.models[0].forward_with_attention(src, tgt, kinds or ATTENTION_KINDS)
            return cut_attention(maps, [len(s) for s in sources], [len(t) + 1 for t in outputs])

    def score(
        self,
        tokenizer: Tokenizer | SplitTokenizer,
        pairs: Iterable[tuple[str, str]],
        *,
        max_tokens: int,
        progress: Callable[[int], None] | None,
    ) -> Iterator[PairScore]:
        return score_pairs(self.models, tokenizer, pairs, max_tokens=max_tokens, progress=progress)


@contextlib.contextmanager
def _evaluating(models: list[Transformer]) -> Iterator[None]:
    """The models in evaluation mode, their previous modes restored after."""
    was_training = [model.training for model in models]
    for model in models:
        model.eval()
    try:
        yield
    finally:
        for model, training in zip(models, was_training, strict=True):
            model.train(training)


def load_model_dirs(
    dirs: Sequence[str | Path],
    *,
    device: str | torch.device,
    int8: bool = False,
    bf16: bool = False,
    onednn: bool | None = None,
) -> tuple[PyTorchBackend, Tokenizer | SplitTokenizer, list[LoadedModel]]:
    """The backend over model directories (checksums verified), their shared tokenizer, and
    what was loaded (metadata, directories); `Translator`'s arguments say the rest.

    Raises:
        CheckpointError: A directory is missing, incomplete or corrupt, or an ensemble's
            models do not share their tokenizer and target vocabulary.
    """
    device = checked_device(device)
    if int8 and device.type != "cpu":
        raise UserValueError(f"int8 dynamic quantization runs on the CPU only, not on {device}")
    if int8 and bf16:
        raise UserValueError("choose one of int8 and bf16")
    if bf16 and device.type == "cpu" and not native_bf16_cpu():
        logger.warning("this CPU has no native bf16 arithmetic: bf16 will be slower")
    loaded = [load_model_dir(d, device=device) for d in dirs]
    check_same_vocabulary(loaded)
    tokenizer = load_tokenizer(loaded[0].tokenizer_file)
    # Loaded for this backend alone: quantized or packed in place, not copied first.
    models: list[nn.Module] = [one.model for one in loaded]
    target_side = loaded[0].model.target_side() if len(loaded) == 1 else None
    if int8:
        models = [quantize_int8(stack_self_attention(model), in_place=True) for model in models]
    elif bf16:
        models = [model.to(torch.bfloat16) for model in models]
    elif device.type == "cpu":
        models = [pack_for_decoding(model, onednn, in_place=True) for model in models]
    if device.type == "cpu":
        models = [use_cpu_attention(model) for model in models]
    shortlist = None
    if len(loaded) == 1:
        shortlist = model_shortlist(loaded[0].directory, loaded[0].config.tgt_vocab_size)
    return PyTorchBackend(models, shortlist, target_side), tokenizer, loaded
