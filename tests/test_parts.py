"""Tests for aiayn.parts: what a killed writer leaves beside its output is removed by the next
writer to the same output, whatever the writer (a line file, a tokenizer, a data cache, a model
directory); a live process's part, and a moved-aside copy whose target is missing, are kept.

Killed writers are played by parts made by hand under the PID of a process that has ended;
tests/integration/test_kills.py kills the commands for real.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from aiayn.model_dir import save_model_dir
from aiayn.parts import dead_parts, part, remove_dead, swap_in
from aiayn.text.corpus import load_or_build
from aiayn.text.lines import output_lines
from aiayn.text.tokenizer import Tokenizer
from model_dirs import CORPUS, tiny_model, train_tokenizer


def dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def leave(target: Path, kind: str, pid: int, directory: bool = False) -> Path:
    """A part of `target` as a writer `pid` leaves it."""
    path = target.with_name(f".{target.name}.{kind}-{pid}")
    if directory:
        path.mkdir()
        (path / "inside").write_text("partial")
    else:
        path.write_text("partial")
    return path


def test_a_dead_writers_parts_go_and_a_live_ones_stay(tmp_path: Path) -> None:
    target = tmp_path / "out"
    target.write_text("done")
    dead, live = dead_pid(), os.getppid()
    gone = [leave(target, "tmp", dead), leave(target, "old", dead, directory=True)]
    kept = [leave(target, "tmp", live), leave(tmp_path / "other", "tmp", dead)]
    mine = leave(target, "tmp", os.getpid())  # an earlier process's, under a reused PID:
    os.utime(mine, (0, 0))  # last changed before this process started
    assert part(target) == mine
    assert {p for p, _ in dead_parts(tmp_path)} == {*gone, mine, kept[1]}
    remove_dead(target)
    assert sorted(tmp_path.iterdir()) == sorted([target, *kept])


def test_a_part_this_process_is_writing_stays(tmp_path: Path) -> None:
    """Another thread's part of another NAME in progress (two threads filling one cache),
    made under this process's PID since it started, is a running writer's: not among the dead
    parts (which a cache's eviction removes), until it is older than the process (an earlier
    process's under a reused PID). A writer of NAME removes its own earlier part of NAME."""
    target = tmp_path / "out"
    mine = leave(target, "tmp", os.getpid())
    assert dead_parts(tmp_path) == []
    os.utime(mine, (0, 0))
    assert dead_parts(tmp_path) == [(mine, "out")]
    os.utime(mine)
    remove_dead(target)
    assert not mine.exists()


def test_a_moved_aside_copy_stays_while_its_target_is_missing(tmp_path: Path) -> None:
    """A kill between moving NAME aside and renaming the new one in leaves no NAME: the moved
    copy may be the only one, and stays until NAME is written again."""
    target = tmp_path / "model"
    old = leave(target, "old", dead_pid(), directory=True)
    tmp = leave(target, "tmp", dead_pid(), directory=True)
    remove_dead(target)
    assert sorted(tmp_path.iterdir()) == [old]
    target.mkdir()
    remove_dead(target)
    assert sorted(tmp_path.iterdir()) == [target]
    assert not tmp.exists()


def test_a_part_named_with_no_real_pid_is_not_a_running_writer(tmp_path: Path) -> None:
    target = tmp_path / "out"
    leave(target, "tmp", 10**30)
    remove_dead(target)
    assert list(tmp_path.iterdir()) == []


def _lines(target: Path) -> None:
    with output_lines(target) as out:
        out.write("a line\n")


def _tokenizer(target: Path) -> None:
    corpus = target.parent / "corpus.txt"
    corpus.write_text("\n".join(CORPUS * 3) + "\n")
    Tokenizer.train([corpus], target, vocab_size=300)


def _model_dir(target: Path) -> None:
    tokenizer = train_tokenizer(target.parent / "tok")
    save_model_dir(
        target,
        tiny_model(tokenizer.vocab_size, preset="tiny", seed=0),
        tokenizer_file=tokenizer.model_file,
    )


@pytest.mark.parametrize(
    "write",
    [_lines, _tokenizer, _model_dir],
    ids=["output_lines", "Tokenizer.train", "save_model_dir"],
)
def test_every_writer_removes_what_a_killed_writer_of_its_output_left(
    tmp_path: Path, write: Callable[[Path], None]
) -> None:
    target = tmp_path / "out" / "target"
    target.parent.mkdir()
    left = [leave(target, "tmp", dead_pid()), leave(target, "tmp", dead_pid(), directory=True)]
    write(target)
    assert target.exists()
    assert not any(p.exists() for p in left)
    assert [p.name for p in target.parent.iterdir() if p.name.startswith(".")] == []


def test_a_data_cache_build_removes_what_a_killed_build_left(tmp_path: Path) -> None:
    src, tgt = tmp_path / "a.en", tmp_path / "a.de"
    src.write_text("a b\nc d\n")
    tgt.write_text("e f\ng h\n")
    tokenizer = train_tokenizer(tmp_path / "tok")
    cache = tmp_path / "cache"
    first, _ = load_or_build(src, tgt, None, tokenizer, cache, max_len=10)
    left = leave(first.directory, "tmp", dead_pid(), directory=True)
    for path in first.directory.iterdir():  # the cache incomplete: built again
        path.unlink()
    load_or_build(src, tgt, None, tokenizer, cache, max_len=10)
    assert not left.exists()
    assert [p.name for p in cache.iterdir()] == [first.directory.name]


def test_a_ctranslate2_conversion_removes_what_killed_conversions_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("ctranslate2", reason="optional: pip install -e '.[export]'")
    from aiayn.interop.ctranslate2 import cached_export
    from model_dirs import tiny_model_dir

    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("AIAYN_CT2_CACHE", str(cache))
    left = [
        leave(cache / ("0" * 32), "tmp", dead_pid(), directory=True),  # a killed conversion
        leave(cache / ("1" * 32), "old", dead_pid(), directory=True),  # a killed removal
    ]
    entry = cached_export(tiny_model_dir(tmp_path / "model"))
    assert entry is not None and [p.name for p in cache.iterdir()] == [entry.name]
    assert not any(p.exists() for p in left)


def test_a_scratch_directory_is_removed_after_its_block_and_after_a_killed_one(
    tmp_path: Path,
) -> None:
    """What a killed process left as its scratch directory (a temporary export in /tmp, a
    corpus split for the tokenizer) is removed by the next process that makes one there."""
    from aiayn.parts import scratch

    target = tmp_path / "aiayn-ct2-export"
    left = leave(target, "tmp", dead_pid(), directory=True)
    with scratch(target) as directory:
        assert directory.is_dir() and not left.exists()
        (directory / "model").mkdir()
    assert list(tmp_path.iterdir()) == []


def test_swap_in_replaces_a_directory_and_leaves_no_part(tmp_path: Path) -> None:
    target = tmp_path / "model"
    target.mkdir()
    (target / "weights").write_text("old")
    new = part(target)
    new.mkdir()
    (new / "weights").write_text("new")
    swap_in(new, target)
    assert (target / "weights").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    fresh = tmp_path / "fresh"
    part(fresh).mkdir()
    swap_in(part(fresh), fresh)
    assert fresh.is_dir() and not part(fresh).exists()


@pytest.mark.parametrize("swap", ["parts.swap_in", "write_replacing"])
def test_a_writer_that_leaves_nothing_to_swap_in_keeps_the_earlier_output(
    tmp_path: Path, swap: str
) -> None:
    """The second rename fails (no part was written): the earlier output, already moved aside,
    is put back rather than lost."""
    from aiayn.cli.output_dir import write_replacing

    target = tmp_path / "export"
    target.mkdir()
    (target / "model.bin").write_text("earlier")
    with pytest.raises(FileNotFoundError):
        if swap == "write_replacing":
            write_replacing(target, lambda tmp: None)
        else:
            swap_in(part(target), target)
    assert (target / "model.bin").read_text() == "earlier"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
