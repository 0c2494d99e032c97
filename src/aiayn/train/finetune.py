"""Fine-tuning: a training run that starts from a model directory's weights (`init_from`).

Instead of the random initialisation of a fresh run, the model starts as the one in
`init_from` (a model directory, e.g. one `aiayn import` made of an OPUS-MT model, or a run
directory, whose `model/` is used). What the run may and may not change follows from that:

- the architecture is the directory's `config.json`: a `preset` (other than the default) or a
  `model:` field that builds another architecture is refused naming the field, so the config
  that trained the model fine-tunes it unchanged. Only the regularisation, `model.dropout` and
  `model.attention_dropout`, may differ (unset, they are the directory's own): they change how
  the weights are trained, not their shapes or meaning. `model.init` (how new weights are drawn)
  is not read: the directory's weights are loaded instead;
- the vocabulary is the directory's tokenizer (`tokenizer.model`, or a split tokenizer's
  `source.spm` + `target.spm` + `vocab.json`), copied into the run directory so that its
  checkpoints, `model/` and `best/` carry it; a `tokenizer` or `vocab_size` that disagrees is
  refused;
- Adam and the learning-rate schedule (Eq. 3, with its warm-up) start afresh at step 0.

A `--resume` continues from the run's own checkpoint; `init_from` is then not read at all
(the architecture comes from that checkpoint, the tokenizer is the run's copy), so a run goes
on after the directory it started from has moved.
"""

from __future__ import annotations

import dataclasses
import shutil
from dataclasses import dataclass
from pathlib import Path

from aiayn.config import PRESETS, ConfigError, ModelConfig, TrainConfig
from aiayn.model_dir import (
    TOKENIZER_FILE,
    WEIGHTS_FILE,
    CheckpointError,
    read_metadata,
    read_model_config,
    resolve_model_dir,
    tokenizer_file_of,
    verify,
)
from aiayn.text.tokenizer import (
    VOCAB_FILE,
    SplitTokenizer,
    Tokenizer,
    TokenizerError,
    load_tokenizer,
    tokenizer_files,
)

# Fields of `ModelConfig` a fine-tuning run may change: regularisation, not architecture.
REGULARISATION = ("dropout", "attention_dropout")
NOT_READ = ("init",)  # how new weights are drawn: loaded weights make it moot


@dataclass(frozen=True)
class InitModel:
    """Where a fine-tuning run starts: the model directory it reads, the run's model config
    (the directory's architecture with the run's dropout) and the tokenizer to copy."""

    directory: Path
    model_config: ModelConfig
    tokenizer_file: Path
    vocab_size: int
    languages: dict[str, str] = dataclasses.field(default_factory=dict)
    """`src_lang` / `tgt_lang` as the directory's metadata records them (those it has)."""

    @property
    def weights_file(self) -> Path:
        return self.directory / WEIGHTS_FILE


def read_init_model(config: TrainConfig, directory: str | Path) -> InitModel:
    """The model directory `directory` (or a run directory's `model/`) as the start of a run
    with `config`, verified; every refusal names the field, before anything is written.

    Raises:
        ConfigError: `directory` is not a sound model directory, or `config` asks for another
            architecture or vocabulary than it has.
    """
    try:
        found = resolve_model_dir(directory)
        verify(found)
        architecture = read_model_config(found)
        tokenizer = load_tokenizer(tokenizer_file_of(found))
    except (CheckpointError, TokenizerError) as error:
        raise ConfigError(f"init_from ({str(directory)!r}): {error}") from None
    _check_architecture(config, architecture, found)
    _check_tokenizer(config, tokenizer, found)
    model_config = _model_config(config, architecture)
    return InitModel(
        found, model_config, tokenizer.model_file, tokenizer.vocab_size, _languages(found)
    )


def resumed_model(checkpoint: Path) -> InitModel:
    """What a resumed fine-tuning run is: its own `checkpoint`'s architecture and tokenizer
    (checked against the run's settings by the resume itself, not against `init_from`)."""
    tokenizer = load_tokenizer(tokenizer_file_of(checkpoint))
    model_config = read_model_config(checkpoint)
    return InitModel(
        checkpoint, model_config, tokenizer.model_file, tokenizer.vocab_size, _languages(checkpoint)
    )


def run_languages(config: TrainConfig, init: InitModel | None) -> dict[str, str]:
    """The languages a run records: `config`'s, but where it leaves one at its placeholder
    default ("src", "tgt"), the init model's (an imported OPUS-MT model knows its own)."""
    languages = {}
    for name in ("src_lang", "tgt_lang"):
        value = getattr(config, name)
        if init is not None and value == TrainConfig.__dataclass_fields__[name].default:
            value = init.languages.get(name, value)
        languages[name] = value
    return languages


def _languages(directory: Path) -> dict[str, str]:
    """The language codes in `directory`'s metadata.json (verified with the directory)."""
    metadata = read_metadata(directory)
    return {k: v for k in ("src_lang", "tgt_lang") if isinstance(v := metadata.get(k), str) and v}


def copy_tokenizer(init: InitModel, run_dir: Path, *, keep: bool) -> Tokenizer | SplitTokenizer:
    """The init model's tokenizer, copied into `run_dir` (a joint one as `tokenizer.model`,
    a split one as its three files); `keep` reuses a copy already there (a resumed run)."""
    if init.tokenizer_file.name != VOCAB_FILE:
        return Tokenizer.train_or_reuse(
            run_dir / TOKENIZER_FILE,
            copy_from=init.tokenizer_file,
            vocab_size=init.vocab_size,  # unused: the model is copied, not trained
            seed=0,
            keep=keep,
        )
    target = run_dir / VOCAB_FILE
    if not (keep and target.is_file()):
        for file in tokenizer_files(init.tokenizer_file):
            shutil.copyfile(file, run_dir / file.name)
    return SplitTokenizer.load(target)


def _check_architecture(config: TrainConfig, architecture: ModelConfig, directory: Path) -> None:
    """What `config` sets of the model (a `preset` other than the default, `model:` fields)
    must build `architecture`; the default preset counts as unset. So the config of the run
    that trained the model fine-tunes it unchanged."""
    default = TrainConfig.__dataclass_fields__["preset"].default
    given = {name: "model." + name for name in config.model}
    if config.preset != default:
        given = {name: "preset" for name in PRESETS[config.preset]} | given
    built = config.model_config(architecture.src_vocab_size, pad_id=architecture.pad_id)
    for name, field in given.items():
        ours, theirs = getattr(built, name), getattr(architecture, name)
        if name not in REGULARISATION + NOT_READ and ours != theirs:
            shown = f"preset ({config.preset!r}) has {name}" if field == "preset" else field
            raise ConfigError(
                f"{shown} ({ours!r}) differs from init_from's model {directory} ({theirs!r}): "
                "a fine-tuned model keeps its architecture; only "
                f"model.{' and model.'.join(REGULARISATION)} may be set"
            )


def _check_tokenizer(
    config: TrainConfig, tokenizer: Tokenizer | SplitTokenizer, directory: Path
) -> None:
    """A run's vocabulary is its init model's: another `tokenizer` or `vocab_size` is refused
    (the default `vocab_size` is taken as unset)."""
    if config.tokenizer is not None:
        given = Path(config.tokenizer)
        if not given.is_file() or load_tokenizer(given).sha256 != tokenizer.sha256:
            raise ConfigError(
                f"tokenizer ({config.tokenizer!r}) is not the tokenizer of init_from's model "
                f"{directory}: a fine-tuned model keeps its vocabulary; drop tokenizer"
            )
    default = TrainConfig.__dataclass_fields__["vocab_size"].default
    if config.vocab_size not in (default, tokenizer.vocab_size):
        raise ConfigError(
            f"vocab_size ({config.vocab_size}) differs from the {tokenizer.vocab_size} pieces "
            f"of init_from's model {directory}: a fine-tuned model keeps its vocabulary; drop "
            "vocab_size"
        )


def _model_config(config: TrainConfig, architecture: ModelConfig) -> ModelConfig:
    """`architecture` with the run's `model.dropout` and `model.attention_dropout`, if set."""
    changes = {name: config.model[name] for name in REGULARISATION if name in config.model}
    return architecture.replace(**changes) if changes else architecture
