"""CTranslate2: export an aiayn model directory, and translate with the export.

`export_ctranslate2` writes a directory that `ctranslate2.Translator(DIR)` loads: CTranslate2's
``model.bin``, ``config.json`` and vocabulary (the SentencePiece pieces, by id), plus what
CTranslate2's own Marian converter puts next to them, ``source.spm`` and ``target.spm`` (the
one joint ``tokenizer.model`` twice, or an imported model's two), ``aiayn.json`` (the
`ModelConfig` and metadata, for `CTranslate2Translator`), and where the model has a lexical
shortlist (`aiayn.decode.shortlist`), the same lists as CTranslate2's vocabulary map
``vmap.txt`` (`write_vmap`), which ``translate_batch(..., use_vmap=True)`` decodes with.
Sources need no ``</s>``: the export sets CTranslate2's ``add_source_eos``, so the pieces of
``source.spm`` go in as they are::

    sp = sentencepiece.SentencePieceProcessor(model_file=f"{DIR}/source.spm")
    out = ctranslate2.Translator(DIR).translate_batch([sp.encode(text, out_type=str)])

The weights go into a CTranslate2 ``TransformerSpec``: post- or pre-norm, the model's
activation, LayerNorm ε and sinusoidal table, embeddings ×√d_model; CTranslate2 decodes the
very same function (tests: fp32 greedy and beam outputs equal aiayn's).

``Translator(DIR)`` (or `CTranslate2Translator`, the same) translates with such a directory, on
the CTranslate2 backend (`aiayn.decode.backends.ctranslate2`): the same `translate` options and
results, CTranslate2's search underneath. What CTranslate2 cannot do
is refused with a clear error: per-head attention maps, and the GNMT length penalty (it
divides by ``|Y| ** α``, aiayn's default ``length_penalty_kind="power"``).

`cached_export` converts a model directory once and keeps the export in a cache
(``$XDG_CACHE_HOME/aiayn/ctranslate2``, ``~/.cache`` by default; ``AIAYN_CT2_CACHE`` to move
it), keyed by the directory's ``checksums.json`` and its files' sizes and modification times:
what ``aiayn translate --backend ctranslate2 -m MODEL_DIR`` decodes. Translating with an export
imports no torch (only exporting does), so such a command starts as fast as CTranslate2's own
API.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from aiayn import __version__
from aiayn.decode.backends import AIAYN_FILE, CTRANSLATE2_FILE, EXTRA_POSITIONS, VMAP_FILE
from aiayn.decode.backends.ctranslate2 import vocabulary
from aiayn.decode.shortlist import Shortlist, model_shortlist
from aiayn.decode.translator import Translator
from aiayn.errors import UserValueError
from aiayn.extras import require
from aiayn.parts import dead_parts, part, remove, remove_dead
from aiayn.text.tokenizer import (
    BOS_ID,
    EOS_ID,
    SOURCE_SPM_FILE,
    TARGET_SPM_FILE,
    load_tokenizer,
    tokenizer_files,
)

if TYPE_CHECKING:  # the exporters import torch where they run: translating needs none
    import torch

    from aiayn.model import Transformer

logger = logging.getLogger(__name__)

QUANTIZATIONS = ("int8", "int8_float32", "int16", "float16", "bfloat16")
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
        raise UserValueError(
            f"quantization ({quantization!r}) must be None or one of {', '.join(QUANTIZATIONS)}"
        )
    require("export", "ctranslate2", needed_by="exporting to CTranslate2")
    from ctranslate2.converters.converter import Converter

    from aiayn.model_dir import load_model_dir

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
    shortlist = model_shortlist(loaded.directory, loaded.config.tgt_vocab_size)
    if shortlist is not None:
        write_vmap(out_dir / VMAP_FILE, shortlist, vocabulary(tokenizer, _vocab_rows(loaded)))
    aiayn = {
        "config": loaded.config.to_dict(),
        "metadata": loaded.metadata,
        "tokenizer": "joint" if len(files) == 1 else "split",
        "quantization": quantization,
    }
    (out_dir / AIAYN_FILE).write_text(json.dumps(aiayn, indent=2) + "\n")
    logger.debug(  # the command line says where the output went; this may be a temporary one
        "exported %s to CTranslate2 (%s) -> %s", model_dir, quantization or "as stored", out_dir
    )
    return out_dir


def _vocab_rows(loaded: Any) -> int:
    return max(loaded.config.src_vocab_size, loaded.config.tgt_vocab_size)


def write_vmap(path: Path, shortlist: Shortlist, tokens: list[str]) -> None:
    """A shortlist as CTranslate2's vocabulary map: one line per source piece, the piece, a
    tab, and its target pieces separated by spaces; first the line of the empty source, whose
    targets CTranslate2 allows for every sentence (the shortlist's always-allowed ids; it adds
    UNK, BOS and EOS itself). `tokens` are the pieces by id. A piece holding a space or a tab
    cannot be written there (SentencePiece's never do): left out."""

    def writable(ids: Any) -> list[str]:
        return [tokens[i] for i in ids.tolist() if not _BLANK.search(tokens[i])]

    lines = ["\t" + " ".join(writable(shortlist.always))]
    for source in range(shortlist.src_vocab_size):
        targets = shortlist.targets_of(source)
        if targets.size and not _BLANK.search(tokens[source]):
            lines.append(tokens[source] + "\t" + " ".join(writable(targets)))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


_BLANK = re.compile(r"\s")


def _array(tensor: torch.Tensor):
    """A NumPy *copy*: the converter quantizes arrays in place, which must not reach our model."""
    return tensor.detach().float().cpu().numpy().copy()


def _linear(spec: Any, *linears: torch.nn.Linear) -> None:
    """Set a CTranslate2 LinearSpec from one or several (fused, row-stacked) nn.Linear."""
    spec.weight = np.concatenate([_array(m.weight) for m in linears])
    if linears[0].bias is not None:
        spec.bias = np.concatenate([_array(m.bias) for m in linears])


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

    from aiayn.model import sinusoidal_positional_encoding

    c = model.config
    if c.positional_encoding != "sinusoidal":
        raise UserValueError(
            f"positional_encoding ({c.positional_encoding!r}): the CTranslate2 export needs "
            "'sinusoidal'"
        )
    if c.d_k * c.n_heads != c.d_model or c.d_v != c.d_k:
        raise UserValueError(
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
    if model.output_projection.bias is not None:  # a target side's (target_side_output)
        spec.decoder.projection.bias = _array(model.output_projection.bias)
    spec.register_source_vocabulary(tokens[: c.src_vocab_size])
    spec.register_target_vocabulary(tokens[: c.tgt_vocab_size])
    return spec


# --------------------------------------------------------------------------------------------
# Converted once: the cache of exports
# --------------------------------------------------------------------------------------------

CACHE_ENTRIES = 4
"""Exports `cached_export` keeps; the least recently used beyond them are removed."""

EXPORT_FORMAT = 1
"""Part of every cache key: raise it when `export_ctranslate2` changes what it writes, so that
exports made by earlier code are converted again."""

CHECKSUMS_FILE = "checksums.json"  # aiayn.model_dir's, named here so that no torch is imported
_KEY = re.compile(r"[0-9a-f]{32}")  # an entry's name; nothing else in the cache is ever removed


def cache_dir() -> Path:
    """Where `cached_export` keeps its exports: ``$AIAYN_CT2_CACHE``, else
    ``$XDG_CACHE_HOME/aiayn/ctranslate2``, else ``~/.cache/aiayn/ctranslate2``."""
    if os.environ.get("AIAYN_CT2_CACHE"):
        return Path(os.environ["AIAYN_CT2_CACHE"])
    root = os.environ.get("XDG_CACHE_HOME")
    if not root:
        try:
            root = Path.home() / ".cache"
        except RuntimeError:  # no home directory
            root = Path(tempfile.gettempdir())
    return Path(root) / "aiayn" / "ctranslate2"


def _cache_key(model_dir: Path) -> str | None:
    """What identifies a model directory's export: its ``checksums.json`` (SHA-256 of every
    file), each file's size and modification time (so a file changed in place, which a load
    would find corrupt, is converted again rather than served stale), `EXPORT_FORMAT` and the
    aiayn and CTranslate2 versions. None for a directory without a readable ``checksums.json``
    or with a file it lists missing."""
    for directory in (model_dir, model_dir / "model"):  # a model or a run directory
        try:
            checksums = json.loads((directory / CHECKSUMS_FILE).read_text())
            stats = {name: (directory / name).stat() for name in sorted(checksums)}
        except (OSError, ValueError, TypeError):
            continue
        [ctranslate2] = require("export", "ctranslate2", needed_by="--backend ctranslate2")
        identity = {
            "checksums": checksums,
            "files": {name: [st.st_size, st.st_mtime_ns] for name, st in stats.items()},
            "format": EXPORT_FORMAT,
            "aiayn": __version__,
            "ctranslate2": ctranslate2.__version__,
        }
        return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:32]
    return None


def _is_export(directory: Path) -> bool:
    try:
        return all((directory / name).is_file() for name in (AIAYN_FILE, CTRANSLATE2_FILE))
    except OSError:  # an unreadable cache: nothing in it
        return False


def find_cached_export(model_dir: str | Path) -> Path | None:
    """The cached export of a model (or run) directory (`cached_export`), if there is one."""
    key = _cache_key(Path(model_dir))
    if key is None or not _is_export(entry := cache_dir() / key):
        return None
    logger.debug("CTranslate2 export of %s from the cache: %s", model_dir, entry)
    return _used(entry)


def drop_cached_export(entry: Path) -> None:
    """Remove an export from the cache (one that proved damaged), so that `cached_export`
    converts the model again; only a cache entry, never another directory."""
    if entry.parent == cache_dir() and _KEY.fullmatch(entry.name):
        _remove(entry)


def _used(entry: Path) -> Path:
    """Mark a cache entry as recently used (what `_evict` keeps)."""
    with contextlib.suppress(OSError):
        os.utime(entry)
    return entry


def cached_export(model_dir: str | Path) -> Path | None:
    """The float32 CTranslate2 export of a model (or run) directory, converted on first use and
    then read from the cache (`cache_dir`; `find_cached_export` only looks).

    Returns None where there is nothing to key a cache by (no ``checksums.json``), the cache
    directory cannot be made, or the model changed while it was converted: the caller converts
    into a temporary directory instead. The most recently used `CACHE_ENTRIES` exports are
    kept. Two processes converting the same model at once both convert; the first to finish
    is kept.

    Raises:
        OSError: Writing the export failed (e.g. a full disk).
    """
    require("export", "ctranslate2", needed_by="--backend ctranslate2")
    model_dir = Path(model_dir)
    key = _cache_key(model_dir)
    if key is None:
        return None
    root = cache_dir()
    entry = root / key
    if _is_export(entry):
        return _used(entry)
    tmp = part(entry)
    try:
        root.mkdir(parents=True, exist_ok=True)
        remove_dead(entry)
        tmp.mkdir()
    except OSError as error:
        logger.warning("cannot write the CTranslate2 cache %s (%s): not kept", root, error)
        return None
    logger.info(
        "converting %s to CTranslate2, once: kept in %s (AIAYN_CT2_CACHE to move it)",
        model_dir,
        root,
    )
    try:
        export_ctranslate2(model_dir, tmp / "model")
        if _cache_key(model_dir) != key:  # e.g. a training run saved a newer model meanwhile
            logger.warning("%s changed while it was converted: not kept", model_dir)
            return None
        _put(tmp / "model", entry)
    finally:
        remove(tmp)
    _evict(root, keep=entry)
    return entry


def _put(export: Path, entry: Path) -> None:
    """Rename a finished export into the cache: one step, so a reader sees all or nothing."""
    try:
        export.rename(entry)
    except OSError:
        if _is_export(entry):  # another process's export of the same model came first
            return
        if not entry.exists():
            raise
        _remove(entry)  # what a killed removal left: replaced
        export.rename(entry)


def _remove(path: Path) -> None:
    """Out of the cache's view in one step (renamed to a dot name, a part), then deleted."""
    gone = part(path, "old")
    try:
        path.rename(gone)
    except OSError:  # already gone (another process), or not ours to move
        return
    remove(gone)


def _evict(root: Path, keep: Path) -> None:
    """Remove the least recently used exports beyond `CACHE_ENTRIES` (never `keep`, never a
    name that is not a cache key), and what killed conversions and removals left (`aiayn.parts`:
    in a cache, no part is the only copy of anything)."""
    for path, _ in dead_parts(root):
        remove(path)
    entries = []
    for path in root.iterdir():
        try:
            if _KEY.fullmatch(path.name) and _is_export(path):
                entries.append((path.stat().st_mtime, path))
        except OSError:  # removed meanwhile by another process
            continue
    entries.sort(reverse=True)
    for _, old in entries[CACHE_ENTRIES:]:
        if old != keep:
            _remove(old)


# --------------------------------------------------------------------------------------------
# Translating with an export
# --------------------------------------------------------------------------------------------


def CTranslate2Translator(
    ct2_dir: str | Path,
    *,
    device: str = "cpu",
    compute_type: str = "default",
    max_tokens: int = 4096,
    threads: int = 0,
    workers: int = 1,
) -> Translator:
    """A `Translator` over a directory written by `export_ctranslate2`, decoded by CTranslate2
    (`aiayn.decode.backends.ctranslate2`, which says what it refuses): the same as
    ``Translator(ct2_dir, ...)``, with CTranslate2's defaults spelled out.

    Args:
        ct2_dir: Written by `export_ctranslate2`.
        device: "cpu", "cuda" or "cuda:N".
        compute_type: CTranslate2's compute type ("default" = as stored, "int8",
            "float32", ...).
        max_tokens: Batch budget, as `Translator`'s.
        threads: CPU threads in all; 0 = CTranslate2's default.
        workers: Batches decoded at once (CTranslate2's ``inter_threads``), sharing
            ``threads``; the outputs are the same.
    """
    return Translator(
        ct2_dir,
        device=device,
        compute_type=compute_type,
        max_tokens=max_tokens,
        threads=threads,
        workers=workers,
    )


__all__ = [
    "QUANTIZATIONS",
    "CTranslate2Translator",
    "cache_dir",
    "cached_export",
    "drop_cached_export",
    "export_ctranslate2",
    "find_cached_export",
]
