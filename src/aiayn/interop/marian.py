"""Hugging Face Marian: export an aiayn model as a `MarianMTModel`, import one (OPUS-MT).

aiayn's Transformer *is* the architecture of HF's `MarianMTModel`: post-norm, sinusoidal
positions, embeddings ×√d_model (Marian's ``scale_embedding=True``), one matrix for both
embeddings and the pre-softmax projection. Moving weights across takes three adjustments:

- Positions. Marian's table is [sin | cos] halves; aiayn interleaves sin and cos (§3.5). A
  model is unchanged by any permutation of its d_model coordinates applied to every weight
  (LayerNorm statistics do not depend on the order), so the export permutes them
  (even coordinates first, then odd) and the two tables line up exactly; import undoes it.
- LayerNorm ε. Marian's is fixed at 1e-5, aiayn's default 1e-6 (`layer_norm_eps`). An export
  keeps the weights and records aiayn's ε in config.json as ``aiayn_layer_norm_eps``, which
  HF ignores: its logits differ from aiayn's by ~1e-6 (greedy outputs identical in the
  tests); importing that directory back restores ε. Other Marian models import with 1e-5.
- Token ids. aiayn fixes ``<pad>`` 0, ``<unk>`` 1, ``<s>`` 2 (decoder start), ``</s>`` 3;
  OPUS-MT has ``</s>`` 0, ``<unk>`` 1, ``<pad>`` last, and starts decoding with ``<pad>``.
  Import reorders the vocabulary (the decoder-start row is copied to id 2 when it is the pad
  row) and writes a `SplitTokenizer`: Marian's source.spm and target.spm plus vocab.json.

Decoding. An export's generation_config.json is aiayn's greedy search: start with ``<s>``,
never generate ``<pad>`` or ``<s>``, no forced EOS; ``generate()`` gives aiayn's greedy
outputs, and so does ``pipeline("translation")`` (transformers 4; version 5 removed that task)
when called with ``num_beams=1``: the pipeline's own default, beam 4, overrides the export's
(tested on transformers 4 and 5 by ``make test``). Beam search differs: HF
and aiayn both rank by ``log_prob / |Y| ** α`` (aiayn's default ``length_penalty_kind``), but
each stops by its own rule, and at the length limit HF stops where aiayn forces EOS.
MarianTokenizer also applies Moses punctuation normalisation when ``sacremoses`` is
installed; aiayn's tokenizers do not.

What aiayn cannot represent is refused with one line naming the field: pre-norm
(``normalize_before``), ``normalize_embedding``/``layernorm_embedding``, learned positions
(``static_position_embeddings=False``), ``scale_embedding=False``, untied or unshared
embeddings, separate vocabularies, different encoder/decoder widths, a ``final_logits_bias``
other than an aiayn target side's (0, or `aiayn.model.OUTSIDE_TARGET_SIDE` for a piece
outside), activations other than relu, gelu and swish.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from aiayn.config import ModelConfig
from aiayn.decode.backends import EXTRA_POSITIONS
from aiayn.errors import UserValueError
from aiayn.extras import require
from aiayn.model import OUTSIDE_TARGET_SIDE, Transformer
from aiayn.model_dir import LoadedModel, load_model_dir, save_model_dir
from aiayn.parts import system_scratch
from aiayn.text.tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    SOURCE_SPM_FILE,
    SPECIAL_PIECES,
    TARGET_SPM_FILE,
    UNK_ID,
    VOCAB_FILE,
    load_tokenizer,
    tokenizer_files,
)

logger = logging.getLogger(__name__)

MARIAN_LAYER_NORM_EPS = 1e-5  # nn.LayerNorm's default, which MarianMTModel always uses
_ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "swish": "swish", "silu": "swish"}


class MarianFormatError(UserValueError):
    """A model uses something the other side cannot represent; the message names the field."""


# --------------------------------------------------------------------------------------------
# Parameter names and the d_model permutation
# --------------------------------------------------------------------------------------------


def _hidden_permutation(d_model: int) -> Tensor:
    """Marian coordinate j is aiayn coordinate perm[j]: sines (even) first, then cosines."""
    return torch.cat([torch.arange(0, d_model, 2), torch.arange(1, d_model, 2)])


def _layer_pairs(n_encoder: int, n_decoder: int) -> list[tuple[str, str, tuple[int, ...]]]:
    """(aiayn name, HF name, the dimensions indexed by d_model) of every per-layer tensor."""
    attention = [  # projections read d_model (dim 1 of the weight); out_proj writes it (dim 0)
        *((f"{p}_proj.weight", (1,)) for p in "qkv"),
        *((f"{p}_proj.bias", ()) for p in "qkv"),
        ("out_proj.weight", (0,)),
        ("out_proj.bias", (0,)),
    ]
    norm = [("weight", (0,)), ("bias", (0,))]
    ffn = [
        ("feed_forward.linear1.weight", "fc1.weight", (1,)),
        ("feed_forward.linear1.bias", "fc1.bias", ()),
        ("feed_forward.linear2.weight", "fc2.weight", (0,)),
        ("feed_forward.linear2.bias", "fc2.bias", (0,)),
    ]
    pairs = []
    for side, n, blocks in (
        ("encoder", n_encoder, [("self_attn", "self_attn")]),
        ("decoder", n_decoder, [("self_attn", "self_attn"), ("cross_attn", "encoder_attn")]),
    ):
        for i in range(n):
            ours, theirs = f"{side}.layers.{i}", f"model.{side}.layers.{i}"
            for a, h in blocks:
                pairs += [(f"{ours}.{a}.{p}", f"{theirs}.{h}.{p}", d) for p, d in attention]
                pairs += [
                    (f"{ours}.{a}_sublayer.norm.{p}", f"{theirs}.{h}_layer_norm.{p}", d)
                    for p, d in norm
                ]
            pairs += [(f"{ours}.{a}", f"{theirs}.{h}", d) for a, h, d in ffn]
            pairs += [
                (f"{ours}.feed_forward_sublayer.norm.{p}", f"{theirs}.final_layer_norm.{p}", d)
                for p, d in norm
            ]
    return pairs


def _permute(tensor: Tensor, dims: tuple[int, ...], perm: Tensor) -> Tensor:
    for dim in dims:
        tensor = tensor.index_select(dim, perm)
    return tensor


# --------------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------------


def _check_exportable(c: ModelConfig) -> None:
    refusals = [
        (c.norm_first, "norm_first (True): MarianMTModel is post-norm only"),
        (
            c.positional_encoding != "sinusoidal",
            f"positional_encoding ({c.positional_encoding!r}): MarianMTModel has sinusoidal "
            "positions only",
        ),
        (
            c.share_embeddings != "all",
            f"share_embeddings ({c.share_embeddings!r}): the export needs 'all' (one matrix "
            "for both embeddings and the output projection)",
        ),
        (
            c.d_k * c.n_heads != c.d_model or c.d_v != c.d_k,
            f"d_k ({c.d_k}), d_v ({c.d_v}): MarianMTModel needs d_model / n_heads",
        ),
    ]
    for refused, message in refusals:
        if refused:
            raise MarianFormatError(message)


def export_hf(model_dir: str | Path, out_dir: str | Path) -> Path:
    """Write `model_dir` as a Hugging Face Marian directory.

    `MarianMTModel.from_pretrained(out_dir)`, `MarianTokenizer.from_pretrained(out_dir)` and
    `pipeline("translation", model=out_dir)` (transformers 4; 5 removed the task) load it offline;
    greedy outputs (`num_beams=1` in the pipeline, whose default is beam 4) equal aiayn's.

    Raises:
        MarianFormatError: The model uses something MarianMTModel cannot represent.
    """
    require("export", "transformers", needed_by="exporting to Hugging Face")
    from transformers import GenerationConfig, MarianMTModel

    loaded = load_model_dir(model_dir)
    c, model = loaded.config, loaded.model
    _check_exportable(c)
    if c.layer_norm_eps != MARIAN_LAYER_NORM_EPS:
        logger.warning(
            "layer_norm_eps is %g but MarianMTModel always uses %g: HF's logits will differ "
            "from aiayn's by about 1e-6 (recorded as aiayn_layer_norm_eps)",
            c.layer_norm_eps,
            MARIAN_LAYER_NORM_EPS,
        )
    hf = MarianMTModel(_marian_config(c)).eval()
    perm = _hidden_permutation(c.d_model)
    ours = model.state_dict()
    theirs = dict(hf.named_parameters())
    with torch.no_grad():
        embedding = _permute(ours["tgt_embed.embedding.weight"], (1,), perm)
        theirs["model.shared.weight"].copy_(embedding)
        for a, h, dims in _layer_pairs(c.n_encoder_layers, c.n_decoder_layers):
            theirs[h].copy_(_permute(ours[a], dims, perm))
        bias = ours.get("output_projection.bias")  # a target side's (target_side_output)
        if bias is None:
            hf.final_logits_bias.zero_()
        else:
            hf.final_logits_bias.copy_(bias.unsqueeze(0))
    if hf.get_output_embeddings().weight is not hf.get_input_embeddings().weight:
        raise RuntimeError("transformers did not tie MarianMTModel's embeddings")
    hf.generation_config = GenerationConfig(
        decoder_start_token_id=BOS_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        forced_eos_token_id=None,
        bad_words_ids=[[PAD_ID], [BOS_ID]],  # aiayn never generates them
        num_beams=1,
        do_sample=False,
        max_length=c.max_positions + EXTRA_POSITIONS,
    )
    out_dir = Path(out_dir)
    hf.save_pretrained(out_dir)
    _save_marian_tokenizer(loaded, out_dir)
    logger.debug("exported %s to Hugging Face Marian -> %s", model_dir, out_dir)
    return out_dir


def _marian_config(c: ModelConfig) -> Any:
    """The `MarianConfig` of aiayn's architecture `c` (post-norm, ×√d_model, tied weights)."""
    from transformers import MarianConfig

    hf_config = MarianConfig(
        vocab_size=c.tgt_vocab_size,
        decoder_vocab_size=c.tgt_vocab_size,
        max_position_embeddings=c.max_positions + EXTRA_POSITIONS,
        d_model=c.d_model,
        encoder_layers=c.n_encoder_layers,
        decoder_layers=c.n_decoder_layers,
        encoder_attention_heads=c.n_heads,
        decoder_attention_heads=c.n_heads,
        encoder_ffn_dim=c.d_ff,
        decoder_ffn_dim=c.d_ff,
        activation_function=c.activation,
        dropout=c.dropout,
        attention_dropout=c.attention_dropout,
        activation_dropout=0.0,
        scale_embedding=True,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        decoder_start_token_id=BOS_ID,
        forced_eos_token_id=None,
        share_encoder_decoder_embeddings=True,
        tie_word_embeddings=True,
    )
    hf_config.aiayn_layer_norm_eps = c.layer_norm_eps  # read back by import_marian only
    hf_config.aiayn_max_positions = c.max_positions
    return hf_config


def _save_marian_tokenizer(loaded: LoadedModel, out_dir: Path) -> None:
    """A `MarianTokenizer` (source.spm, target.spm, vocab.json) for the model's tokenizer."""
    from transformers import MarianTokenizer

    tokenizer = load_tokenizer(loaded.tokenizer_file)
    files = tokenizer_files(loaded.tokenizer_file)
    with system_scratch("aiayn-marian-export") as tmp:
        vocab = tmp / "vocab.json"
        pieces: dict[str, int] = {}
        for i, piece in enumerate(tokenizer.pieces(range(tokenizer.vocab_size))):
            pieces.setdefault(piece, i)
        vocab.write_text(json.dumps(pieces, ensure_ascii=False, indent=0) + "\n")
        source = files[0] if len(files) == 1 else files[0].parent / SOURCE_SPM_FILE
        target = files[0] if len(files) == 1 else files[0].parent / TARGET_SPM_FILE
        hf_tokenizer = MarianTokenizer(
            source_spm=str(source),
            target_spm=str(target),
            vocab=str(vocab),
            source_lang=loaded.metadata.get("src_lang"),
            target_lang=loaded.metadata.get("tgt_lang"),
            bos_token=SPECIAL_PIECES[BOS_ID],  # special, so that decoding skips it
            unk_token=SPECIAL_PIECES[UNK_ID],
            eos_token=SPECIAL_PIECES[EOS_ID],
            pad_token=SPECIAL_PIECES[PAD_ID],
            model_max_length=loaded.config.max_positions,
        )
        hf_tokenizer.save_pretrained(out_dir)


# --------------------------------------------------------------------------------------------
# Import
# --------------------------------------------------------------------------------------------


def _read_json(path: Path) -> Any:
    """A JSON file of the Hugging Face directory; one that is not UTF-8 JSON is a
    `MarianFormatError` naming it (a missing one, an OSError naming it)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as error:  # json.JSONDecodeError, UnicodeDecodeError
        raise MarianFormatError(f"{path}: not valid JSON: {error}") from None


def _check_importable(raw: dict[str, Any], tokenizer_config: dict[str, Any]) -> None:
    """Refuse, naming the field, what aiayn's Transformer cannot represent."""

    def refuse(field: str, why: str) -> None:
        raise MarianFormatError(f"{field} ({raw.get(field, tokenizer_config.get(field))!r}): {why}")

    if raw.get("model_type") != "marian":
        refuse("model_type", "only Marian models (MarianMTModel) can be imported")
    if raw.get("normalize_before", False):
        refuse("normalize_before", "pre-norm layers; aiayn imports post-norm Marian models")
    for field in ("normalize_embedding", "layernorm_embedding", "add_final_layer_norm"):
        if raw.get(field, False):
            refuse(field, "aiayn has no LayerNorm on the embeddings or after the stacks")
    if not raw.get("static_position_embeddings", True):
        refuse("static_position_embeddings", "aiayn imports sinusoidal positions only")
    if not raw.get("scale_embedding", False):
        refuse("scale_embedding", "aiayn always scales embeddings by √d_model (§3.4)")
    if raw.get("add_bias_logits", False):
        refuse("add_bias_logits", "aiayn's output projection has no learned bias")
    if raw.get("activation_function", "gelu") not in _ACTIVATIONS:
        refuse("activation_function", f"aiayn has {', '.join(sorted(set(_ACTIVATIONS)))}")
    if not raw.get("share_encoder_decoder_embeddings", True):
        refuse("share_encoder_decoder_embeddings", "aiayn imports one shared vocabulary")
    if not raw.get("tie_word_embeddings", True):
        refuse("tie_word_embeddings", "aiayn ties the output projection to the embeddings")
    if raw.get("decoder_vocab_size") not in (None, raw.get("vocab_size")):
        refuse("decoder_vocab_size", "aiayn imports one shared vocabulary")
    if tokenizer_config.get("separate_vocabs", False):
        refuse("separate_vocabs", "aiayn imports one shared vocabulary")
    for ours, theirs in (("attention_heads", "heads"), ("ffn_dim", "width")):
        enc, dec = raw.get(f"encoder_{ours}"), raw.get(f"decoder_{ours}")
        if enc != dec:
            why = f"differs from encoder_{ours} ({enc}); aiayn has one {theirs}"
            refuse(f"decoder_{ours}", why)


def import_marian(hf_dir: str | Path, out_dir: str | Path) -> Path:
    """Convert a Hugging Face Marian directory (e.g. an OPUS-MT model) to an aiayn model
    directory with a `SplitTokenizer` (source.spm, target.spm, vocab.json).

    Reads the directory only (no download). The result translates with `Translator` as
    transformers' greedy ``generate`` does, and loads as any model directory; ``aiayn train
    --init-from OUT_DIR`` fine-tunes it with its own tokenizer (aiayn.train.finetune).

    Raises:
        MarianFormatError: The model uses something aiayn cannot represent (the message names
            the field).
    """
    require("export", "transformers", needed_by="importing a Hugging Face Marian model")
    from transformers import MarianMTModel

    hf_dir = Path(hf_dir)
    raw = _read_json(hf_dir / "config.json")
    tokenizer_config_file = hf_dir / "tokenizer_config.json"
    tokenizer_config = _read_json(tokenizer_config_file) if tokenizer_config_file.is_file() else {}
    _check_importable(raw, tokenizer_config)
    hf = MarianMTModel.from_pretrained(hf_dir, local_files_only=True).eval()
    cfg = hf.config
    final_bias = hf.final_logits_bias[0]
    target_side = bool(final_bias.ne(0).any())
    if target_side and not bool((final_bias.eq(0) | final_bias.eq(OUTSIDE_TARGET_SIDE)).all()):
        raise MarianFormatError(
            "final_logits_bias: aiayn's output projection has no bias but a target side's "
            f"(every value 0 or {OUTSIDE_TARGET_SIDE:g})"
        )
    vocab: dict[str, int] = _read_json(hf_dir / "vocab.json")
    if SPECIAL_PIECES[UNK_ID] not in vocab:
        raise MarianFormatError(f"vocab.json: no {SPECIAL_PIECES[UNK_ID]!r} piece")
    size = cfg.vocab_size
    pad, eos, start = cfg.pad_token_id, cfg.eos_token_id, cfg.decoder_start_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    specials = [pad, vocab[SPECIAL_PIECES[UNK_ID]], start, eos]  # aiayn ids 0, 1, 2, 3
    if target_side and bool(final_bias[[pad, eos]].ne(0).any()):
        raise MarianFormatError(
            "final_logits_bias: a target side must score the padding and end-of-sentence pieces "
            f"(0 at ids {pad} and {eos})"
        )
    order = specials + [i for i in range(size) if i not in set(specials)]
    piece_of = {i: piece for piece, i in vocab.items()}
    pieces = [SPECIAL_PIECES[i] for i in range(len(specials))]
    pieces += [piece_of.get(i, f"<unused{i}>") for i in order[len(specials) :]]

    heads, d_model = cfg.encoder_attention_heads, cfg.d_model
    config = ModelConfig(
        src_vocab_size=len(order),
        tgt_vocab_size=len(order),
        d_model=d_model,
        d_ff=cfg.encoder_ffn_dim,
        n_heads=heads,
        n_encoder_layers=cfg.encoder_layers,
        n_decoder_layers=cfg.decoder_layers,
        dropout=float(cfg.dropout),
        attention_dropout=float(cfg.attention_dropout),
        max_positions=int(getattr(cfg, "aiayn_max_positions", cfg.max_position_embeddings)),
        share_embeddings="all",
        layer_norm_eps=float(getattr(cfg, "aiayn_layer_norm_eps", MARIAN_LAYER_NORM_EPS)),
        activation=_ACTIVATIONS[cfg.activation_function],
        target_side_output=target_side,
    )
    model = Transformer(config).eval()
    inverse = torch.argsort(_hidden_permutation(d_model))
    theirs = hf.state_dict()
    ours = dict(model.named_parameters())
    with torch.no_grad():
        embedding = theirs["model.shared.weight"][torch.tensor(order)]
        # One Parameter for both embeddings and the output projection (share_embeddings="all").
        model.tgt_embed.embedding.weight.copy_(_permute(embedding, (1,), inverse))
        for a, h, dims in _layer_pairs(config.n_encoder_layers, config.n_decoder_layers):
            ours[a].copy_(_permute(theirs[h], dims, inverse))
        if target_side:
            ours["output_projection.bias"].copy_(final_bias[torch.tensor(order)])

    metadata = {
        "src_lang": tokenizer_config.get("source_lang") or "src",
        "tgt_lang": tokenizer_config.get("target_lang") or "tgt",
        "imported_from": {"format": "huggingface-marian", "path": str(hf_dir.resolve())},
    }
    with system_scratch("aiayn-marian-import") as tmp:
        vocab_file = tmp / VOCAB_FILE
        vocab_file.write_text(json.dumps({"pieces": pieces}, ensure_ascii=False) + "\n")
        for name in (SOURCE_SPM_FILE, TARGET_SPM_FILE):
            shutil.copyfile(hf_dir / name, tmp / name)
        out = save_model_dir(out_dir, model, tokenizer_file=vocab_file, metadata=metadata)
    logger.debug("imported %s (Hugging Face Marian) -> %s", hf_dir, out)
    return out


__all__ = ["MarianFormatError", "export_hf", "import_marian"]
