"""CTranslate2: export an aiayn model directory, and translate with the export.

`export_ctranslate2` writes a directory that `ctranslate2.Translator(DIR)` loads: CTranslate2's
``model.bin``, ``config.json`` and vocabulary (the SentencePiece pieces, by id), plus what
CTranslate2's own Marian converter puts next to them, ``source.spm`` and ``target.spm`` (the
one joint ``tokenizer.model`` twice, or an imported model's two), and ``aiayn.json`` (the
`ModelConfig` and metadata, for `CTranslate2Translator`). Sources need no ``</s>``: the export
sets CTranslate2's ``add_source_eos``, so the pieces of ``source.spm`` go in as they are::

    sp = sentencepiece.SentencePieceProcessor(model_file=f"{DIR}/source.spm")
    out = ctranslate2.Translator(DIR).translate_batch([sp.encode(text, out_type=str)])

The weights go into a CTranslate2 ``TransformerSpec``: post- or pre-norm, the model's
activation, LayerNorm ε and sinusoidal table, embeddings ×√d_model; CTranslate2 decodes the
very same function (tests: fp32 greedy and beam outputs equal aiayn's).

`CTranslate2Translator` is `aiayn.decode.translator.Translator` over such a directory: same
`translate` options and results, CTranslate2's search underneath. What CTranslate2 cannot do
is refused with a clear error: per-head attention maps, and the GNMT length penalty (it
divides by ``|Y| ** α``: pass ``length_penalty_kind="power"``).
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from aiayn.config import ModelConfig
from aiayn.decode.results import TranslationResult, translation_result
from aiayn.decode.search import DecodingOptions, Hypothesis
from aiayn.decode.translator import Translator, _Source
from aiayn.interop._runtime import ExportedModel, require
from aiayn.model import Transformer, sinusoidal_positional_encoding
from aiayn.model_dir import CheckpointError, load_model_dir
from aiayn.text.tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    SOURCE_SPM_FILE,
    TARGET_SPM_FILE,
    VOCAB_FILE,
    SplitTokenizer,
    Tokenizer,
    load_tokenizer,
    tokenizer_files,
)

logger = logging.getLogger(__name__)

QUANTIZATIONS = ("int8", "int8_float32", "int16", "float16", "bfloat16")
AIAYN_FILE = "aiayn.json"
EXTRA_POSITIONS = 512
_ACTIVATIONS = {"relu": "RELU", "gelu": "GELU", "swish": "SWISH"}


# --------------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------------


def export_ctranslate2(
    model_dir: str | Path, out_dir: str | Path, quantization: str | None = None
) -> Path:
    """Write `model_dir` (an aiayn model or run directory) as a CTranslate2 model directory.

    Args:
        model_dir: The aiayn model directory.
        out_dir: Where to write (replaced if it exists).
        quantization: How the weights are stored: None (float32) or one of `QUANTIZATIONS`.
            CTranslate2 can still compute in another type (``compute_type=``).

    Returns:
        `out_dir`.
    """
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(
            f"quantization ({quantization!r}) must be None or one of {', '.join(QUANTIZATIONS)}"
        )
    require("ctranslate2", "exporting to CTranslate2")
    from ctranslate2.converters.converter import Converter

    loaded = load_model_dir(model_dir)
    tokenizer = load_tokenizer(loaded.tokenizer_file)
    spec = ct2_spec(loaded.model, vocabulary(tokenizer, loaded.config.tgt_vocab_size))

    class _FromAiayn(Converter):
        def _load(self):
            return spec

    out_dir = Path(out_dir)
    _FromAiayn().convert(str(out_dir), quantization=quantization, force=True)
    files = tokenizer_files(loaded.tokenizer_file)
    if len(files) == 1:  # one joint model serves both sides
        shutil.copyfile(files[0], out_dir / SOURCE_SPM_FILE)
        shutil.copyfile(files[0], out_dir / TARGET_SPM_FILE)
    else:
        for file in files:
            shutil.copyfile(file, out_dir / file.name)
    aiayn = {
        "config": loaded.config.to_dict(),
        "metadata": loaded.metadata,
        "tokenizer": "joint" if len(files) == 1 else "split",
        "quantization": quantization,
    }
    (out_dir / AIAYN_FILE).write_text(json.dumps(aiayn, indent=2) + "\n")
    logger.info("exported %s to CTranslate2 (%s) -> %s", model_dir, quantization, out_dir)
    return out_dir


def vocabulary(tokenizer: Tokenizer | SplitTokenizer, size: int) -> list[str]:
    """The piece of every id 0..size-1 (ids past the tokenizer's, if any, get filler names)."""
    pieces = tokenizer.pieces(range(min(size, tokenizer.vocab_size)))
    return pieces + [f"<unused{i}>" for i in range(len(pieces), size)]


def _array(tensor: torch.Tensor):
    """A NumPy *copy*: the converter quantizes arrays in place, which must not reach our model."""
    return tensor.detach().float().cpu().numpy().copy()


def _linear(spec: Any, *linears: torch.nn.Linear) -> None:
    """Set a CTranslate2 LinearSpec from one or several (fused, row-stacked) nn.Linear."""
    spec.weight = _array(torch.cat([m.weight for m in linears]))
    if linears[0].bias is not None:
        spec.bias = _array(torch.cat([m.bias for m in linears]))


def _layer_norm(spec: Any, norm: torch.nn.LayerNorm) -> None:
    spec.gamma, spec.beta = _array(norm.weight), _array(norm.bias)


def ct2_spec(model: Transformer, tokens: list[str], *, add_source_eos: bool = True) -> Any:
    """A CTranslate2 `TransformerSpec` holding `model`'s weights, with vocabulary `tokens`.

    With `add_source_eos`, CTranslate2 appends ``</s>`` to every source, as aiayn does, so
    callers pass the bare pieces; without, they pass aiayn's source ids with the ``</s>``.

    Raises:
        ValueError: The model has learned positions or d_k · h ≠ d_model, which a
            CTranslate2 Transformer cannot hold.
    """
    from ctranslate2.specs import common_spec, transformer_spec

    c = model.config
    if c.positional_encoding != "sinusoidal":
        raise ValueError(
            f"positional_encoding ({c.positional_encoding!r}): the CTranslate2 export needs "
            "'sinusoidal'"
        )
    if c.d_k * c.n_heads != c.d_model or c.d_v != c.d_k:
        raise ValueError(
            f"d_k ({c.d_k}), d_v ({c.d_v}): the CTranslate2 export needs d_k = d_v = "
            f"d_model / n_heads ({c.d_model // c.n_heads})"
        )
    spec = transformer_spec.TransformerSpec.from_config(
        (c.n_encoder_layers, c.n_decoder_layers),
        c.n_heads,
        pre_norm=c.norm_first,
        activation=getattr(common_spec.Activation, _ACTIVATIONS[c.activation]),
    )
    spec.config.layer_norm_epsilon = c.layer_norm_eps
    spec.config.decoder_start_token = tokens[BOS_ID]
    spec.config.bos_token = tokens[BOS_ID]
    spec.config.eos_token = tokens[EOS_ID]
    spec.config.add_source_eos = add_source_eos
    # aiayn extends its table on the fly; CTranslate2 needs one long enough for the outputs
    # too (up to source + 50 tokens by default): max_positions + EXTRA_POSITIONS rows.
    table = _array(sinusoidal_positional_encoding(c.max_positions + EXTRA_POSITIONS, c.d_model))
    for side, embed, stack in (
        (spec.encoder, model.src_embed, model.encoder),
        (spec.decoder, model.tgt_embed, model.decoder),
    ):
        embeddings = side.embeddings if isinstance(side.embeddings, list) else [side.embeddings]
        embeddings[0].weight = _array(embed.embedding.weight)
        side.scale_embeddings = True
        side.position_encodings.encodings = table
        if c.norm_first:
            _layer_norm(side.layer_norm, stack.final_norm)
    for layer_spec, layer in zip(spec.encoder.layer, model.encoder.layers, strict=True):
        attn = layer.self_attn
        _linear(layer_spec.self_attention.linear[0], attn.q_proj, attn.k_proj, attn.v_proj)
        _linear(layer_spec.self_attention.linear[1], attn.out_proj)
        _layer_norm(layer_spec.self_attention.layer_norm, layer.self_attn_sublayer.norm)
        _linear(layer_spec.ffn.linear_0, layer.feed_forward.linear1)
        _linear(layer_spec.ffn.linear_1, layer.feed_forward.linear2)
        _layer_norm(layer_spec.ffn.layer_norm, layer.feed_forward_sublayer.norm)
    for layer_spec, layer in zip(spec.decoder.layer, model.decoder.layers, strict=True):
        attn, cross = layer.self_attn, layer.cross_attn
        _linear(layer_spec.self_attention.linear[0], attn.q_proj, attn.k_proj, attn.v_proj)
        _linear(layer_spec.self_attention.linear[1], attn.out_proj)
        _layer_norm(layer_spec.self_attention.layer_norm, layer.self_attn_sublayer.norm)
        _linear(layer_spec.attention.linear[0], cross.q_proj)
        _linear(layer_spec.attention.linear[1], cross.k_proj, cross.v_proj)
        _linear(layer_spec.attention.linear[2], cross.out_proj)
        _layer_norm(layer_spec.attention.layer_norm, layer.cross_attn_sublayer.norm)
        _linear(layer_spec.ffn.linear_0, layer.feed_forward.linear1)
        _linear(layer_spec.ffn.linear_1, layer.feed_forward.linear2)
        _layer_norm(layer_spec.ffn.layer_norm, layer.feed_forward_sublayer.norm)
    spec.decoder.projection.weight = _array(model.output_projection.weight)
    spec.register_source_vocabulary(tokens[: c.src_vocab_size])
    spec.register_target_vocabulary(tokens[: c.tgt_vocab_size])
    return spec


def convert_model(model: Transformer, out_dir: Path, quantization: str | None) -> Path:
    """Write an in-memory `model` as a bare CTranslate2 directory (no tokenizer; token names
    ``t<id>`` besides the specials), for benchmarks that feed aiayn's source ids, ``</s>``
    included."""
    require("ctranslate2", "converting to CTranslate2")
    from ctranslate2.converters.converter import Converter

    tokens = id_tokens(model.config.tgt_vocab_size)

    class _FromAiayn(Converter):
        def _load(self):
            return ct2_spec(model, tokens, add_source_eos=False)

    return Path(_FromAiayn().convert(str(out_dir), quantization=quantization, force=True))


def id_tokens(size: int) -> list[str]:
    """Token names for ids 0..size-1 when there is no tokenizer: the specials, then t<id>."""
    names = {PAD_ID: "<pad>", 1: "<unk>", BOS_ID: "<s>", EOS_ID: "</s>"}
    return [names.get(i, f"t{i}") for i in range(size)]


# --------------------------------------------------------------------------------------------
# Translating with an export
# --------------------------------------------------------------------------------------------


class CTranslate2Translator(Translator):
    """`Translator` over a directory written by `export_ctranslate2`: the same `translate`
    options and `TranslationResult`s, decoded by CTranslate2.

    Differences, all refused with an error rather than approximated: no attention maps
    (``return_attention``), no GNMT length penalty with beam search (CTranslate2 divides by
    ``|Y| ** α``: pass ``length_penalty_kind="power"``). Sampling runs CTranslate2's sampler, so
    samples differ from the PyTorch model's for the same seed.

    Speed: in a process where PyTorch has already run on several threads, CTranslate2 decodes
    1.15-1.9x slower (both run OpenMP threads, more of them than cores; docs/interop.md).
    Call ``torch.set_num_threads(1)`` before any PyTorch work, as ``aiayn translate --backend
    ctranslate2`` does, or translate in a process of its own.
    """

    def __init__(
        self,
        ct2_dir: str | Path,
        *,
        device: str = "cpu",
        compute_type: str = "default",
        max_tokens: int = 4096,
        threads: int = 0,
    ) -> None:
        """Loads an export.

        Args:
            ct2_dir: Written by `export_ctranslate2`.
            device: "cpu", "cuda" (CTranslate2's devices).
            compute_type: CTranslate2's compute type ("default" = as stored, "int8",
                "float32", ...).
            max_tokens: Batch budget, as `Translator`'s.
            threads: CPU threads (``intra_threads``); 0 = CTranslate2's default.
        """
        ctranslate2 = require("ctranslate2", "CTranslate2Translator")
        directory = Path(ct2_dir)
        try:
            aiayn = json.loads((directory / AIAYN_FILE).read_text())
        except (OSError, ValueError) as error:
            raise CheckpointError(
                f"{directory} is not an aiayn CTranslate2 export (no readable {AIAYN_FILE}: "
                f"{error}); write one with export_ctranslate2"
            ) from None
        config = ModelConfig.from_dict(aiayn["config"])
        if aiayn["tokenizer"] == "split":
            tokenizer: Tokenizer | SplitTokenizer = SplitTokenizer.load(directory / VOCAB_FILE)
        else:
            tokenizer = Tokenizer.load(directory / SOURCE_SPM_FILE)
        self.ct2 = ctranslate2.Translator(
            str(directory), device=device, compute_type=compute_type, intra_threads=threads
        )
        self._token_ids: dict[str, int] = {}
        for i, piece in enumerate(vocabulary(tokenizer, config.tgt_vocab_size)):
            self._token_ids.setdefault(piece, i)
        model = ExportedModel(config, torch.device("cpu"))
        self._setup([model], tokenizer, max_tokens, aiayn.get("metadata", {}), [directory])

    def _translate(
        self,
        sentences: Any,
        options: DecodingOptions,
        *,
        return_attention: bool,
        seed: int | None,
        first_number: int,
        progress: Callable[[int], None] | None = None,
    ) -> list[TranslationResult]:
        if return_attention:
            raise ValueError(
                "the CTranslate2 backend cannot return per-head attention maps "
                "(return_attention=True); use Translator on the aiayn model directory"
            )
        beam = not options.sampling and options.beam_size > 1
        if beam and options.length_penalty_kind == "gnmt" and options.length_penalty != 0:
            raise ValueError(
                "CTranslate2 ranks beam hypotheses by log_prob / |Y| ** α, not GNMT's "
                "((5 + |Y|) / 6) ** α: pass length_penalty_kind='power' (or length_penalty=0)"
            )
        if options.sampling and seed is not None:
            require("ctranslate2", "sampling").set_random_seed(seed)
        return super()._translate(
            sentences,
            options,
            return_attention=return_attention,
            seed=seed,
            first_number=first_number,
            progress=progress,
        )

    def _run(
        self,
        batch: list[_Source],
        options: DecodingOptions,
        return_attention: bool,
        generator: Any,
    ) -> list[TranslationResult]:
        """One CTranslate2 call per output length limit (it takes one per call)."""
        nbest: list[list[Hypothesis]] = [[] for _ in batch]
        limits: dict[int, list[int]] = {}
        for i, source in enumerate(batch):
            limit = max(0, int(source.max_len_a * len(source.ids) + source.max_len_b))
            limits.setdefault(limit, []).append(i)
        for limit, rows in limits.items():
            found = self._search([batch[i] for i in rows], limit, options)
            for i, hyps in zip(rows, found, strict=True):
                nbest[i] = hyps
        return [
            translation_result(self.tokenizer, s.ids, hyps, truncated=s.truncated)
            for s, hyps in zip(batch, nbest, strict=True)
        ]

    def _search(
        self, sources: list[_Source], max_len: int, options: DecodingOptions
    ) -> list[list[Hypothesis]]:
        tokens = [self.tokenizer.pieces(s.ids[:-1]) for s in sources]  # CTranslate2 adds </s>
        kwargs: dict[str, Any] = dict(
            max_decoding_length=max_len,
            return_scores=True,
            max_batch_size=0,
            suppress_sequences=[[piece] for piece in self.tokenizer.pieces([PAD_ID, BOS_ID])],
        )
        alpha = 0.0 if options.length_penalty_kind == "none" else options.length_penalty
        if options.sampling:
            n = options.n_best
            tokens = [t for t in tokens for _ in range(n)]
            kwargs |= dict(
                beam_size=1,
                sampling_topk=options.top_k,
                sampling_topp=options.top_p,
                sampling_temperature=options.temperature,
            )
        else:
            n = 1
            kwargs |= dict(
                beam_size=options.beam_size,
                num_hypotheses=options.n_best,
                length_penalty=alpha if options.beam_size > 1 else 0.0,
            )
        outputs = self.ct2.translate_batch(tokens, **kwargs)
        hyps = [
            [
                self._hypothesis(pieces, score, kwargs.get("length_penalty", 0.0))
                for pieces, score in zip(out.hypotheses, out.scores, strict=True)
            ]
            for out in outputs
        ]
        if n > 1:
            hyps = [
                sorted((h for hs in hyps[i * n : (i + 1) * n] for h in hs), key=lambda h: -h.score)
                for i in range(len(sources))
            ]
        return hyps

    def _hypothesis(self, pieces: list[str], score: float, alpha: float) -> Hypothesis:
        ids = [self._token_ids.get(p, 1) for p in pieces]
        if ids and ids[-1] == EOS_ID:
            ids = ids[:-1]
        log_prob = score * float(len(ids) + 1) ** alpha
        return Hypothesis(tokens=ids, score=score, log_prob=log_prob)


__all__ = ["QUANTIZATIONS", "CTranslate2Translator", "export_ctranslate2"]
