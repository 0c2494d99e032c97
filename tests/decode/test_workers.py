"""Tests for aiayn.decode.workers: batches decoded in forked worker processes give exactly what
one process gives, in input order; errors and dead workers reach the caller; an early stop
leaves no process behind; the translator and the CLI refuse workers where they cannot run
(and, on CTranslate2, give the output of one translator).

Forking needs Linux (`fork_missing`); elsewhere these tests skip.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest
import torch

from aiayn.cli import main
from aiayn.decode.translator import Translator
from aiayn.decode.workers import WorkerDiedError, Workers, fork_missing
from aiayn.errors import UserValueError
from aiayn.model_dir import save_model_dir
from aiayn.text.tokenizer import Tokenizer
from model_dirs import CORPUS, EN_DE, tiny_model, train_tokenizer

pytestmark = pytest.mark.skipif(fork_missing() is not None, reason=str(fork_missing()))

SENTENCES = [*CORPUS, "", "the cat", "a dog barked at the cat on the mat", "hello"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("workers")
    tokenizer = train_tokenizer(directory / "tok", CORPUS)
    model = tiny_model(tokenizer.vocab_size, preset="tiny", seed=7, eos_scale=3.0, max_positions=64)
    return save_model_dir(
        directory / "model", model, tokenizer_file=tokenizer.model_file, metadata=EN_DE
    )


def test_workers_translate_exactly_as_one_process(model_dir: Path) -> None:
    torch.set_num_threads(1)  # as each worker runs
    one = Translator(model_dir, max_tokens=40)  # small enough for several batches
    two = Translator(model_dir, max_tokens=40, workers=2)
    assert len(one.batches(SENTENCES)) > 2
    for options in ({"beam_size": 3, "n_best": 2}, {"beam_size": 1}):
        expected = one.translate(SENTENCES, max_len_b=8, **options)
        actual = two.translate(SENTENCES, max_len_b=8, return_attention=True, **options)
        assert [r.text for r in actual] == [r.text for r in expected]
        assert [r.score for r in actual] == [r.score for r in expected]
        assert [[h.token_ids for h in r.hypotheses] for r in actual] == [
            [h.token_ids for h in r.hypotheses] for r in expected
        ]
        with_maps = [r for r in actual if r.token_ids]
        assert with_maps and all(r.attention is not None for r in with_maps)
    # a stream, chunk by chunk, through one pool
    streamed = two.translate_iterable(iter(SENTENCES), chunk_size=5, max_len_b=8, beam_size=3)
    assert [r.text for r in streamed] == [
        r.text for r in one.translate_iterable(SENTENCES, chunk_size=5, max_len_b=8, beam_size=3)
    ]
    # a second call forks again and gives the same
    again = two.translate(SENTENCES, max_len_b=8, beam_size=3)
    assert [r.text for r in again] == [
        r.text for r in one.translate(SENTENCES, max_len_b=8, beam_size=3)
    ]


def test_sampling_stays_in_this_process_so_a_seed_gives_the_same_samples(
    model_dir: Path,
) -> None:
    options = {"sampling": True, "n_best": 2, "max_len_b": 6, "seed": 3}
    one = Translator(model_dir, max_tokens=40).translate(SENTENCES, **options)
    two = Translator(model_dir, max_tokens=40, workers=2).translate(SENTENCES, **options)
    assert [r.text for r in two] == [r.text for r in one]


def test_workers_set_their_own_threads_and_leave_the_callers(model_dir: Path) -> None:
    torch.set_num_threads(2)

    def threads(_: int) -> int:
        return torch.get_num_threads()

    with Workers(threads, workers=2, threads=1) as pool:
        assert list(pool.map([0])) == [2]  # a single item: no worker forked, this process
        assert list(pool.map([0, 1, 2])) == [1, 1, 1]
        assert list(pool.map([0])) == [1]  # the workers, once they exist
    assert torch.get_num_threads() == 2


def test_results_come_in_input_order() -> None:
    def slow_first(i: int) -> int:
        if i == 0:
            import time

            time.sleep(0.3)
        return i * i

    with Workers(slow_first, workers=3) as pool:
        assert list(pool.map(list(range(6)))) == [0, 1, 4, 9, 16, 25]


def test_the_workers_serve_every_map_of_the_pool_until_it_closes() -> None:
    def pid(_: int) -> int:
        import time

        time.sleep(0.02)
        return os.getpid()

    with Workers(pid, workers=2) as pool:
        first = set(pool.map(list(range(8))))
        second = set(pool.map(list(range(8))))
    assert os.getpid() not in first | second
    assert len(first | second) <= 2  # the same two processes for both maps: forked once


class Boom(ValueError):
    pass


def test_an_error_in_a_worker_is_raised_in_the_caller() -> None:
    def fails_on_2(i: int) -> int:
        if i == 2:
            raise Boom(f"item {i}")
        return i

    with Workers(fails_on_2, workers=2) as pool:
        with pytest.raises(Boom, match="item 2"):
            list(pool.map(list(range(5))))
        assert list(pool.map([0, 1])) == [0, 1]  # new workers for the next map


def test_a_worker_that_dies_fails_the_call_instead_of_hanging() -> None:
    def killed_on_1(i: int) -> int:
        if i == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return i

    with Workers(killed_on_1, workers=2) as pool, pytest.raises(WorkerDiedError, match="died"):
        list(pool.map(list(range(4))))


def test_a_dead_worker_leaves_the_pools_thread_nothing_to_print(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The pool's thread fails the items still queued while the caller has already seen the
    first failure: nothing else may touch those futures, or (before Python 3.12) the thread dies
    printing a traceback under the one-line error."""
    thread_errors: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: thread_errors.append(args.exc_value))

    def killed_on_1(i: int) -> int:
        if i == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return i

    for _ in range(10):  # a race: many items queued make it likely
        with Workers(killed_on_1, workers=2) as pool, pytest.raises(WorkerDiedError):
            list(pool.map(list(range(2000))))
    assert thread_errors == []


def test_stopping_early_stops_the_workers() -> None:
    def pid(_: int) -> int:
        import time

        time.sleep(0.05)
        return os.getpid()

    pool = Workers(pid, workers=2)
    results = pool.map(list(range(50)))
    worker = next(results)
    results.close()  # the caller stops reading
    with pytest.raises(ProcessLookupError):
        for _ in range(100):  # killed at once; reaped by the executor
            os.kill(worker, 0)
            import time

            time.sleep(0.05)


def test_the_translator_refuses_workers_it_cannot_run(model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(UserValueError, match=r"workers \(0\) must be a positive integer"):
        Translator(model_dir, workers=0)
    if not torch.cuda.is_available():
        with pytest.raises(UserValueError, match="cuda"):
            Translator(model_dir, device="cuda", workers=2)
    tokenizer = Tokenizer.load(model_dir / "tokenizer.model")
    in_memory = Translator.from_model(
        tiny_model(tokenizer.vocab_size, preset="tiny", seed=0), tokenizer
    )
    assert in_memory.workers == 1  # a model in memory (training's) decodes in its process


def test_cli_workers_give_the_output_of_one_process(model_dir: Path, tmp_path: Path) -> None:
    src = tmp_path / "in.txt"
    src.write_text("\n".join(SENTENCES) + "\n", encoding="utf-8")
    outputs = []
    for workers in ("1", "2"):
        out = tmp_path / f"out{workers}.txt"
        args = ["translate", "-m", str(model_dir), "-i", str(src), "-o", str(out)]
        args += ["--max-tokens", "40", "--max-len-b", "6", "--workers", workers]
        assert main([*args, "--no-progress"]) == 0
        outputs.append(out.read_text(encoding="utf-8"))
    assert outputs[0] == outputs[1]
    assert len(outputs[0].split("\n")) == len(SENTENCES) + 1


def test_cli_workers_on_ctranslate2_give_the_output_of_one(model_dir: Path, tmp_path: Path) -> None:
    """--workers with --backend ctranslate2: that many CTranslate2 translators, one output."""
    pytest.importorskip("ctranslate2")
    src = tmp_path / "in.txt"
    src.write_text("\n".join(SENTENCES) + "\n", encoding="utf-8")
    outputs = []
    for workers in ("1", "2"):
        out = tmp_path / f"out{workers}.txt"
        args = ["translate", "-m", str(model_dir), "-i", str(src), "-o", str(out)]
        args += ["--backend", "ctranslate2", "--max-tokens", "40", "--workers", workers]
        assert main([*args, "--no-progress"]) == 0
        outputs.append(out.read_text(encoding="utf-8"))
    assert outputs[0] == outputs[1]
    assert len(outputs[0].split("\n")) == len(SENTENCES) + 1


@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_cli_workers_must_be_a_positive_integer(
    model_dir: Path, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["translate", "-m", str(model_dir), "--workers", value])
    assert exit_info.value.code == 2
    assert "argument --workers" in capsys.readouterr().err
