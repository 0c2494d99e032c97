"""A shared subword vocabulary for source and target, learned with SentencePiece (§5.1).

The paper encodes WMT 2014 English-German with "byte-pair encoding, which has a shared
source-target vocabulary of about 37000 tokens". A single joint model is what makes the
three-way weight sharing of §3.4 possible, so :meth:`Tokenizer.train` always learns one model
over all the given files, source and target text together.

The first four ids are fixed so that the model, the data pipeline and the decoder can agree on
them without looking at the model file: ``PAD_ID = 0``, ``UNK_ID = 1``, ``BOS_ID = 2``,
``EOS_ID = 3``.

Deviation from the paper: by default the vocabulary uses *byte fallback*, i.e. 256 byte pieces
are reserved, so a character never seen in training (an emoji, a rare script) is encoded as its
UTF-8 bytes instead of ``<unk>`` and decodes back to itself. This costs 256 of the ~37000
entries. Text is NFKC-normalised by SentencePiece ("ﬁ" becomes "fi") and runs of whitespace
collapse to one space, so ``decode(encode(s)) == s`` holds for normalised text.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import shutil
import unicodedata
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import sentencepiece as spm

from aiayn.errors import UserValueError
from aiayn.parts import part, remove_dead, scratch
from aiayn.text.corpus import read_parallel, read_tsv

logger = logging.getLogger(__name__)

PAD_ID = 0
UNK_ID = 1
BOS_ID = 2
EOS_ID = 3

SPECIAL_PIECES = {PAD_ID: "<pad>", UNK_ID: "<unk>", BOS_ID: "<s>", EOS_ID: "</s>"}

# SentencePiece refuses input_sentence_size values in 1..100.
_MIN_SAMPLED_SENTENCES = 101

_TOO_SMALL = re.compile(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)")


def stripped(text: str) -> str:
    """``text`` without the whitespace around it, or "" where nothing but whitespace and format
    characters is left: Unicode category Cf (zero-width space U+200B, zero-width joiner U+200D,
    word joiner U+2060, byte order mark U+FEFF, ...), which show nothing and carry no word.
    Such a text is blank: given one, a model would translate an empty source into invented
    words. Reads a text only up to its first visible character."""
    text = text.strip()
    if all(c.isspace() or unicodedata.category(c) == "Cf" for c in text):
        return ""
    return text


class TokenizerError(UserValueError):
    """A tokenizer cannot be trained or loaded; the message names the file or setting."""


class Tokenizer:
    """A trained SentencePiece model with the fixed special ids of this package.

    Build one with :meth:`train` or :meth:`load`. Encoding never adds BOS/EOS: the model adds
    them where it needs them (see ``aiayn.text.batching.collate``), so lengths reported here are the
    lengths that ``max_len`` limits refer to.

    Attributes:
        model_file: Where the model was loaded from (or written to).
    """

    def __init__(self, model_proto: bytes, model_file: Path) -> None:
        """Wraps serialized model bytes; prefer :meth:`load` or :meth:`train`.

        Args:
            model_proto: The bytes of a ``.model`` file.
            model_file: The path those bytes came from, kept for messages and reuse.

        Raises:
            TokenizerError: The bytes are not a SentencePiece model, or its special ids are not
                the ones this package relies on.
        """
        self.model_file = Path(model_file)
        self._sha256 = hashlib.sha256(model_proto).hexdigest()
        try:
            self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
        except RuntimeError as err:
            raise TokenizerError(
                f"{self.model_file} is not a valid SentencePiece model: {err}"
            ) from err
        actual = {
            PAD_ID: self._sp.pad_id(),
            UNK_ID: self._sp.unk_id(),
            BOS_ID: self._sp.bos_id(),
            EOS_ID: self._sp.eos_id(),
        }
        if any(actual_id != expected for expected, actual_id in actual.items()):
            raise TokenizerError(
                f"{self.model_file} has special ids pad={actual[PAD_ID]}, unk={actual[UNK_ID]}, "
                f"bos={actual[BOS_ID]}, eos={actual[EOS_ID]}; aiayn needs pad={PAD_ID}, "
                f"unk={UNK_ID}, bos={BOS_ID}, eos={EOS_ID} (train it with Tokenizer.train)"
            )

    @classmethod
    def load(cls, model_file: Path) -> Tokenizer:
        """Loads a model written by :meth:`train`.

        The file is read once, and both the processor and :attr:`sha256` come from those same
        bytes, so the hash always describes the model actually in use.

        Raises:
            TokenizerError: The file is missing, unreadable or not a valid model.
        """
        model_file = Path(model_file)
        try:
            model_proto = model_file.read_bytes()
        except FileNotFoundError as err:
            raise TokenizerError(f"tokenizer model {model_file} does not exist") from err
        except OSError as err:
            raise TokenizerError(f"cannot read tokenizer model {model_file}: {err}") from err
        return cls(model_proto, model_file)

    @classmethod
    def train(
        cls,
        input_files: Sequence[Path],
        model_file: Path,
        *,
        vocab_size: int,
        model_type: str = "bpe",
        character_coverage: float = 1.0,
        max_sentences: int = 2_000_000,
        byte_fallback: bool = True,
        max_piece_length: int = 16,
        seed: int = 0,
    ) -> Tokenizer:
        """Learns one joint vocabulary over all ``input_files`` and writes it to ``model_file``.

        Training is deterministic for a given corpus and ``seed``: the sentence sample is drawn
        with SentencePiece's seeded generator. A vocabulary next to the model (same name,
        ``.vocab`` suffix, one ``piece<TAB>score`` per line) is written for people to read.

        If the corpus is too small to yield ``vocab_size`` pieces, training still succeeds with
        a smaller vocabulary and logs a warning; the model config must then use
        :attr:`vocab_size`, not the requested number.

        Args:
            input_files: Plain-text files, one sentence per line; pass both languages.
            model_file: Where to write the model, e.g. ``run/tokenizer.model``.
            vocab_size: Requested number of pieces, special and byte pieces included (the paper
                uses about 37000 for EN-DE and 32000 word-pieces for EN-FR).
            model_type: ``"bpe"`` (the paper's choice) or ``"unigram"``.
            character_coverage: Fraction of characters that get their own piece; 1.0 suits
                alphabetic languages, 0.9995 is the usual choice for CJK.
            max_sentences: Train on a random sample of at most this many lines (reading a
                multi-million-line corpus whole costs memory and time for no gain); 0 uses all.
            byte_fallback: Reserve 256 byte pieces so unseen characters round-trip instead of
                becoming ``<unk>``.
            max_piece_length: The longest piece, in characters (``▁`` included); shorter
                than SentencePiece's 16 keeps a language that writes compounds as one word
                (German numbers) in word-sized pieces.
            seed: Seed of the sentence sampling.

        Returns:
            The trained tokenizer, loaded from the written file.

        Raises:
            TokenizerError: An input file is missing or empty, a setting is out of range, or
                ``vocab_size`` is too small for the characters in the corpus.
        """
        files = [Path(f) for f in input_files]
        model_file = Path(model_file)
        _check_training_inputs(files, vocab_size, max_sentences)
        if max_piece_length < 1:
            raise TokenizerError(f"max_piece_length ({max_piece_length}) must be at least 1")

        model_writer = io.BytesIO()
        spm.set_random_generator_seed(seed)
        try:
            spm.SentencePieceTrainer.train(
                input=[str(f) for f in files],
                model_writer=model_writer,
                vocab_size=vocab_size,
                model_type=model_type,
                character_coverage=character_coverage,
                input_sentence_size=max_sentences,
                shuffle_input_sentence=True,
                byte_fallback=byte_fallback,
                max_sentencepiece_length=max_piece_length,
                hard_vocab_limit=False,
                pad_id=PAD_ID,
                unk_id=UNK_ID,
                bos_id=BOS_ID,
                eos_id=EOS_ID,
                pad_piece=SPECIAL_PIECES[PAD_ID],
                unk_piece=SPECIAL_PIECES[UNK_ID],
                bos_piece=SPECIAL_PIECES[BOS_ID],
                eos_piece=SPECIAL_PIECES[EOS_ID],
                minloglevel=2,
            )
        except RuntimeError as err:
            raise _training_error(err, files, vocab_size, byte_fallback) from err

        tokenizer = cls(model_writer.getvalue(), model_file)
        _write_atomically(model_file, model_writer.getvalue())
        vocab_file = model_file.with_suffix(".vocab")
        if vocab_file != model_file:
            _write_atomically(vocab_file, tokenizer._vocab_text().encode())
        if tokenizer.vocab_size < vocab_size:
            logger.warning(
                "the corpus only supports %d pieces; requested vocab_size=%d "
                "(use tokenizer.vocab_size in the model config)",
                tokenizer.vocab_size,
                vocab_size,
            )
        logger.info(
            "trained a %s vocabulary of %d pieces on %d file(s) -> %s",
            model_type,
            tokenizer.vocab_size,
            len(files),
            model_file,
        )
        return tokenizer

    @classmethod
    def train_or_reuse(
        cls,
        model_file: Path,
        *,
        src: Path | None = None,
        tgt: Path | None = None,
        tsv: Path | None = None,
        copy_from: Path | None = None,
        vocab_size: int,
        seed: int,
        keep: bool = False,
    ) -> Tokenizer:
        """The vocabulary at ``model_file``, made once: copied from ``copy_from``, or trained on
        ``src`` + ``tgt`` (line-aligned files) or on the two columns of ``tsv``.

        What it was made from (the settings, and each file's path and size) is recorded next to
        it (``tokenizer.json``). A vocabulary already there is reused only if it was made from
        the same, and made again otherwise; ``keep`` reuses it whatever it was made from (a
        resumed run: its weights depend on it).

        Raises:
            DataError: Line-aligned files that are not (line counts, UTF-8), checked before
                BPE training, so that a vocabulary of bad files never stays behind.
            TokenizerError: ``copy_from`` is not a valid model, or training failed.
        """
        model_file = Path(model_file)
        record = model_file.with_suffix(".json")
        recipe = _recipe(src, tgt, tsv, copy_from, vocab_size, seed)
        if model_file.exists() and not keep:
            try:
                saved = json.loads(record.read_text(encoding="utf-8")) if record.is_file() else None
            except ValueError as error:  # json.JSONDecodeError, UnicodeDecodeError
                raise TokenizerError(f"{record}: not valid JSON: {error}") from None
            if saved != recipe:
                logger.info("%s was made from other settings or files: remaking it", model_file)
                model_file.unlink()
        if not model_file.exists():
            if copy_from is not None:
                cls.load(copy_from)  # validate before copying
                shutil.copyfile(copy_from, model_file)
            else:
                _train_on_corpus(model_file, src, tgt, tsv, vocab_size=vocab_size, seed=seed)
            record.write_text(json.dumps(recipe, indent=2) + "\n")
        return cls.load(model_file)

    @property
    def vocab_size(self) -> int:
        """Number of pieces, special and byte pieces included; ids are ``0..vocab_size-1``."""
        return self._sp.get_piece_size()

    @property
    def sha256(self) -> str:
        """Hex SHA-256 of the model file's bytes: identifies the vocabulary in cache keys."""
        return self._sha256

    def encode(self, text: str) -> list[int]:
        """Splits one sentence into subword ids, without BOS/EOS."""
        return self._sp.encode(text, out_type=int)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Encodes many sentences at once, in parallel threads inside SentencePiece.

        Starting those threads costs more than encoding a few sentences, so small batches
        (a server request, an interactive line) are encoded on the calling thread.
        """
        if not texts:
            return []
        threads = 1 if len(texts) < 256 else -1  # -1: SentencePiece's default
        return self._sp.encode(list(texts), out_type=int, num_threads=threads)

    def encode_target(self, text: str) -> list[int]:
        """Target text → ids: the same as :meth:`encode`, the vocabulary being joint (§5.1)."""
        return self.encode(text)

    def encode_target_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Many target sentences → ids: the same as :meth:`encode_batch`."""
        return self.encode_batch(texts)

    def decode(self, ids: Sequence[int]) -> str:
        """Turns ids back into text, skipping ``<pad>``, ``<s>`` and ``</s>``.

        Decoding does not stop at the first ``</s>``; truncating a hypothesis is the search's
        job, not the tokenizer's.

        Raises:
            TokenizerError: An id is outside ``0..vocab_size-1``.
        """
        kept = [int(i) for i in ids if int(i) not in (PAD_ID, BOS_ID, EOS_ID)]
        self._check_ids(kept)
        return self._sp.decode(kept)

    def pieces(self, ids: Sequence[int]) -> list[str]:
        """The subword string of each id, specials included, e.g. for attention-plot labels.

        Raises:
            TokenizerError: An id is outside ``0..vocab_size-1``.
        """
        ids = [int(i) for i in ids]
        self._check_ids(ids)
        return [self._sp.id_to_piece(i) for i in ids]

    def piece_table(self) -> tuple[list[str], list[float], list[bool]]:
        """Every id's piece, its score and whether it is a normal piece (not a special, byte or
        unused one): what BPE-dropout segments with (aiayn.text.bpe_dropout.Merges)."""
        sp, ids = self._sp, range(self.vocab_size)
        special = (sp.is_unknown, sp.is_control, sp.is_byte, sp.is_unused)
        return (
            [sp.id_to_piece(i) for i in ids],
            [sp.get_score(i) for i in ids],
            [not any(test(i) for test in special) for i in ids],
        )

    def __repr__(self) -> str:
        return f"Tokenizer({str(self.model_file)!r}, vocab_size={self.vocab_size})"

    def _check_ids(self, ids: Sequence[int]) -> None:
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise TokenizerError(
                f"ids {bad[:5]} are outside the vocabulary of {self.model_file} "
                f"(0..{self.vocab_size - 1})"
            )

    def _vocab_text(self) -> str:
        return "".join(
            f"{self._sp.id_to_piece(i)}\t{self._sp.get_score(i)}\n" for i in range(self.vocab_size)
        )


def _recipe(
    src: Path | None,
    tgt: Path | None,
    tsv: Path | None,
    copy_from: Path | None,
    vocab_size: int,
    seed: int,
) -> dict[str, Any]:
    """What a vocabulary is made from, as `train_or_reuse` records it (the form is that of
    earlier releases' run directories: a same recipe reuses their vocabulary)."""
    if copy_from is not None:
        return {"copied_from": str(Path(copy_from).resolve())}
    files = [tsv] if tsv is not None else [src, tgt]
    return {
        "vocab_size": vocab_size,
        "seed": seed,
        "files": [[str(Path(f).resolve()), Path(f).stat().st_size] for f in files],
    }


def _train_on_corpus(
    model_file: Path,
    src: Path | None,
    tgt: Path | None,
    tsv: Path | None,
    *,
    vocab_size: int,
    seed: int,
) -> None:
    """Train on a parallel corpus: a misaligned or undecodable one must fail before BPE
    training, not after it (the error would cost minutes). A TSV corpus is checked by the one
    pass that splits its columns, which SentencePiece needs as lines without tabs."""
    logger.info("training a joint BPE vocabulary of %d pieces", vocab_size)
    with scratch(model_file.with_name(model_file.name + ".corpus")) as columns:
        if tsv is not None:  # its columns, one file each
            files = [columns / "src.txt", columns / "tgt.txt"]
            with (
                open(files[0], "w", encoding="utf-8") as src_out,
                open(files[1], "w", encoding="utf-8") as tgt_out,
            ):
                for source, target in read_tsv(tsv):
                    src_out.write(source + "\n")
                    tgt_out.write(target + "\n")
        else:
            assert src is not None and tgt is not None
            for _ in read_parallel(src, tgt):  # line counts and UTF-8, naming the file
                pass
            files = [src, tgt]
        Tokenizer.train(files, model_file, vocab_size=vocab_size, seed=seed)


def check_given_tokenizer(model_file: Path, vocab_size: int) -> None:
    """A tokenizer given to training (`tokenizer:`) exists and has `vocab_size` pieces: the
    model's vocabulary is the tokenizer's, so a mismatch would silently train another model
    than the run's settings record."""
    if not model_file.is_file():
        raise TokenizerError(f"tokenizer not found: {model_file}")
    pieces = Tokenizer.load(model_file).vocab_size
    if pieces != vocab_size:
        raise TokenizerError(
            f"tokenizer {model_file} has {pieces} pieces but vocab_size is {vocab_size}; "
            f"set vocab_size to {pieces} to use it"
        )


def _check_training_inputs(files: list[Path], vocab_size: int, max_sentences: int) -> None:
    """Rejects inputs that SentencePiece would fail on with an opaque message."""
    if not files:
        raise TokenizerError("Tokenizer.train needs at least one input file")
    for path in files:
        if not path.is_file():
            raise TokenizerError(f"tokenizer training file {path} does not exist")
        if _is_blank(path):
            raise TokenizerError(f"tokenizer training file {path} is empty")
    if vocab_size <= len(SPECIAL_PIECES):
        raise TokenizerError(
            f"vocab_size ({vocab_size}) must be larger than the "
            f"{len(SPECIAL_PIECES)} special pieces"
        )
    if 0 < max_sentences < _MIN_SAMPLED_SENTENCES:
        raise TokenizerError(
            f"max_sentences ({max_sentences}) must be 0 (use all) or at least "
            f"{_MIN_SAMPLED_SENTENCES} (a SentencePiece limit)"
        )


def _is_blank(path: Path, chunk_bytes: int = 1 << 20) -> bool:
    """True if the file holds only whitespace; reads only until the first non-space byte."""
    with path.open("rb") as f:
        while chunk := f.read(chunk_bytes):
            if chunk.strip():
                return False
    return True


def _training_error(
    err: RuntimeError, files: list[Path], vocab_size: int, byte_fallback: bool
) -> TokenizerError:
    """Translates SentencePiece's internal messages into ones that say what to change."""
    names = ", ".join(str(f) for f in files)
    if match := _TOO_SMALL.search(str(err)):
        needed = int(match.group(2))
        detail = " (256 byte-fallback pieces included)" if byte_fallback else ""
        return TokenizerError(
            f"vocab_size ({vocab_size}) is too small for {names}: the characters of this corpus "
            f"and the special pieces need at least {needed}{detail}"
        )
    return TokenizerError(f"SentencePiece training on {names} failed: {err}")


def _write_atomically(path: Path, data: bytes) -> None:
    """Writes via a temporary file and a rename, so readers never see a half-written model."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = part(path)
    remove_dead(path)  # what killed writers of it left (this process's too)
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# --------------------------------------------------------------------------------------------
# Separate source and target models over one id space (imported OPUS-MT models)
# --------------------------------------------------------------------------------------------

SOURCE_SPM_FILE = "source.spm"
TARGET_SPM_FILE = "target.spm"
VOCAB_FILE = "vocab.json"
SPLIT_TOKENIZER_FILES = (SOURCE_SPM_FILE, TARGET_SPM_FILE, VOCAB_FILE)


class SplitTokenizer:
    """A source and a target SentencePiece model sharing one vocabulary, as Marian models have.

    A model directory imported from Hugging Face Marian (OPUS-MT) carries ``source.spm`` and
    ``target.spm`` next to ``vocab.json``, ``{"pieces": [...]}``: the piece of each model id,
    ids 0-3 being this package's ``<pad> <unk> <s> </s>``. The SentencePiece models only cut
    text into pieces; ``vocab.json`` maps pieces to ids (a piece it lacks is ``<unk>``), as
    ``MarianTokenizer`` does. A leading language token such as ``>>fra<<`` (multilingual
    OPUS-MT targets) is kept whole when the vocabulary has it. Unlike ``MarianTokenizer``,
    no Moses punctuation normalisation is applied first.

    The same interface as :class:`Tokenizer`; ``model_file`` is the ``vocab.json``. Source text
    is cut with ``source.spm`` (:meth:`encode`), target text with ``target.spm``
    (:meth:`encode_target`, what training data and scored targets need).
    """

    def __init__(self, source: bytes, target: bytes, pieces: list[str], model_file: Path) -> None:
        self.model_file = Path(model_file)
        self._sha256 = hashlib.sha256(source + b"\0" + target + "\0".join(pieces).encode())
        try:
            self._source = spm.SentencePieceProcessor(model_proto=source)
            self._target = spm.SentencePieceProcessor(model_proto=target)
        except RuntimeError as err:
            raise TokenizerError(f"{self.model_file.parent}: invalid SentencePiece model") from err
        expected = [SPECIAL_PIECES[i] for i in sorted(SPECIAL_PIECES)]
        if pieces[: len(expected)] != expected:
            raise TokenizerError(
                f"{self.model_file}: the first pieces must be {expected}, not "
                f"{pieces[: len(expected)]}"
            )
        self._pieces = list(pieces)
        self._ids: dict[str, int] = {}
        for i, piece in enumerate(pieces):
            self._ids.setdefault(piece, i)

    @classmethod
    def load(cls, vocab_file: Path) -> SplitTokenizer:
        """Loads ``vocab_file`` (a ``vocab.json``) and the two models next to it."""
        vocab_file = Path(vocab_file)
        directory = vocab_file.parent
        try:
            pieces = json.loads(vocab_file.read_text(encoding="utf-8"))["pieces"]
            source = (directory / SOURCE_SPM_FILE).read_bytes()
            target = (directory / TARGET_SPM_FILE).read_bytes()
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise TokenizerError(f"cannot read the split tokenizer of {directory}: {err}") from err
        return cls(source, target, pieces, vocab_file)

    @property
    def vocab_size(self) -> int:
        return len(self._pieces)

    @property
    def sha256(self) -> str:
        return self._sha256.hexdigest()

    def encode(self, text: str) -> list[int]:
        """Source text → ids with the source model, without BOS/EOS."""
        return self._encode(self._source, text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(text) for text in texts]

    def encode_target(self, text: str) -> list[int]:
        """Target text → ids with the target model (what training and scoring compare the
        model's outputs with), without BOS/EOS."""
        return self._encode(self._target, text)

    def encode_target_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode_target(text) for text in texts]

    def _encode(self, model: spm.SentencePieceProcessor, text: str) -> list[int]:
        code = []
        if (
            text.startswith(">>")
            and (end := text.find("<<")) != -1
            and text[: end + 2] in self._ids
        ):
            code, text = [self._ids[text[: end + 2]]], text[end + 2 :]
        pieces = model.encode(text, out_type=str)
        return code + [self._ids.get(piece, UNK_ID) for piece in pieces]

    def decode(self, ids: Sequence[int]) -> str:
        """Target ids → text with the target model, skipping ``<pad>``, ``<s>`` and ``</s>``."""
        kept = [int(i) for i in ids if int(i) not in (PAD_ID, BOS_ID, EOS_ID)]
        return self._target.decode_pieces(self.pieces(kept))

    def pieces(self, ids: Sequence[int]) -> list[str]:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise TokenizerError(
                f"ids {bad[:5]} are outside the vocabulary of {self.model_file} "
                f"(0..{self.vocab_size - 1})"
            )
        return [self._pieces[i] for i in ids]

    def __repr__(self) -> str:
        return f"SplitTokenizer({str(self.model_file)!r}, vocab_size={self.vocab_size})"


def load_tokenizer(model_file: Path) -> Tokenizer | SplitTokenizer:
    """The tokenizer of a model directory: ``tokenizer.model`` (one joint SentencePiece model)
    or, when ``model_file`` is a ``vocab.json``, a :class:`SplitTokenizer`."""
    model_file = Path(model_file)
    if model_file.name == VOCAB_FILE:
        return SplitTokenizer.load(model_file)
    return Tokenizer.load(model_file)


def tokenizer_files(model_file: Path) -> list[Path]:
    """The files a tokenizer consists of: the model itself, or a split tokenizer's three."""
    model_file = Path(model_file)
    if model_file.name == VOCAB_FILE:
        return [model_file.parent / name for name in SPLIT_TOKENIZER_FILES]
    return [model_file]
