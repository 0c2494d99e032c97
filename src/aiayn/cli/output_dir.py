"""What ``-o`` may replace: the one rule of ``aiayn average``, ``export`` and ``import``.

An output directory may be

- new, or empty;
- an earlier output of the same kind that holds only the files that kind writes (an earlier
  ``aiayn average`` into ``RUN/averaged``, an earlier CTranslate2 export): it is replaced.

Anything else is refused before the (slow) work, and nothing is changed: a file; a directory
holding anything else, which may be the user's work; a training run directory, and what its
trainer writes there (``model/``, ``best/``, ``checkpoints/``, ``data/``, ``tensorboard/``
and anything inside them), present yet or not. A directory of its own inside a run
(``RUN/averaged``) follows the first two rules, like any other.

The output is written next to its place under a temporary name and then swapped in
(`aiayn.model_dir.save_model_dir` for a model directory, `write_replacing` for the rest), so
a failed write leaves an earlier output as it was, and what a killed one leaves (`aiayn.parts`)
is removed by the next write to the same place.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from aiayn.parts import part, remove, remove_dead, swap_in


@dataclass(frozen=True)
class Kind:
    """What one kind of output directory looks like."""

    name: str  # for messages
    markers: tuple[str, ...]  # files every such directory holds
    files: frozenset[str]  # every file the writer may put there

    def holds(self, directory: Path) -> bool:
        return all((directory / m).is_file() for m in self.markers)


_TOKENIZER_FILES = ("tokenizer.model", "source.spm", "target.spm", "vocab.json")
KINDS = {
    "ctranslate2": Kind(
        "a CTranslate2 export",
        ("model.bin", "aiayn.json"),
        frozenset(
            {
                "model.bin",
                "config.json",
                "aiayn.json",
                "shared_vocabulary.json",
                "source_vocabulary.json",
                "target_vocabulary.json",
                *_TOKENIZER_FILES,
            }
        ),
    ),
    "hf": Kind(
        "a Hugging Face export",
        ("config.json", "model.safetensors", "generation_config.json"),
        frozenset(
            {
                "config.json",
                "generation_config.json",
                "model.safetensors",
                "tokenizer_config.json",
                "special_tokens_map.json",
                "added_tokens.json",
                *_TOKENIZER_FILES,
            }
        ),
    ),
    "onnx": Kind(
        "an ONNX export",
        ("encoder.onnx", "decoder_step.onnx", "aiayn.json"),
        frozenset({"encoder.onnx", "decoder_step.onnx", "aiayn.json", *_TOKENIZER_FILES}),
    ),
    "aiayn": Kind(
        "an aiayn model directory",
        ("config.json", "model.safetensors", "metadata.json"),
        frozenset(
            {
                "config.json",
                "model.safetensors",
                "metadata.json",
                "checksums.json",
                *_TOKENIZER_FILES,
            }
        ),
    ),
}


def check_output_dir(directory: Path, kind: str) -> Path:
    """Refuse an output directory that writing a `kind` output (a key of `KINDS`) must not
    replace (see the module docstring); a new or empty one, or an earlier output of that kind,
    passes. Returns the directory to write: ``directory`` with its symbolic links resolved, so
    that an output given as a link is written where the link points and the link stays.

    The current directory (``-o .``), or one holding it, is refused: an output directory is
    replaced whole, and the command's shell would be left in a deleted directory.
    """
    from aiayn.model_dir import CheckpointError
    from aiayn.train.rundir import owning_run

    given, directory = directory, Path(os.path.realpath(directory))
    cwd = Path.cwd()
    if directory == cwd or directory in cwd.parents:
        which = "is the current directory" if directory == cwd else "holds the current directory"
        raise CheckpointError(
            f"{given} {which}, which writing the output would replace whole; run the command "
            "from another directory or choose another output directory (nothing was changed)"
        )

    if (owner := owning_run(directory)) is not None:
        run, inside = owner
        where = (
            "is a training run directory"
            if inside is None
            else (f"belongs to the training run {run} ({inside} is written by `aiayn train`)")
        )
        raise CheckpointError(
            f"{directory} {where}; choose another output directory (nothing was changed)"
        )
    if not directory.exists():
        return directory
    if not directory.is_dir():
        raise CheckpointError(f"{directory} exists and is not a directory (nothing was changed)")
    names = sorted(p.name for p in directory.iterdir())
    if not names:
        return directory
    wanted = KINDS[kind]
    if not wanted.holds(directory):
        other = next((k.name for k in KINDS.values() if k.holds(directory)), None)
        if other:
            raise CheckpointError(
                f"{directory} holds {other}, not {wanted.name}; choose another output directory "
                "(nothing was changed)"
            )
        foreign = names
    else:
        foreign = [name for name in names if name not in wanted.files]
    if foreign:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise CheckpointError(
            f"{directory} already holds files that are not {wanted.name}'s ({shown}); choose "
            "another output directory (nothing was changed)"
        )
    return directory


def write_replacing(output: Path, write: Callable[[Path], object]) -> None:
    """``write(tmp)`` into a fresh sibling of ``output``, then put it in ``output``'s place
    (the earlier output, already checked by `check_output_dir`, is removed only then). A
    symbolic link is written through: its target is replaced and the link stays."""
    output = Path(os.path.realpath(output))
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = part(output)
    remove_dead(output)  # what killed writers of it left (this process's too)
    try:
        write(tmp)
        swap_in(tmp, output)  # the model directory's swap too (aiayn.model_dir.save_model_dir)
    finally:
        remove(tmp)
