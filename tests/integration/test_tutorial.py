"""docs/tutorial.md, run as written at a tiny scale, so that the page cannot rot.

Every block the page marks runnable runs in order, in one folder laid out like a reader's
checkout (`.venv/bin/aiayn`, `recipes/`): the real corpus of `aiayn prepare bible-en-es`, cut to
a few hundred pairs, then the recipe's training with the flags of `TINY_TRAINING` added, then
averaging, evaluation, translation, the server (started in the background, on a free port) and
the export. The corpus needs Debian's SWORD modules (`make bible-deps`, which CI runs): where
they are missing, the test skips and says so.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from aiayn.text.prepare import bible

from .doc_blocks import ROOT, CodeBlock, code_blocks, reader_checkout, run_block

TUTORIAL = ROOT / "docs" / "tutorial.md"
PREPARE = ".venv/bin/aiayn prepare bible-en-es data/bible-en-es"
CORPUS = "data/bible-en-es"
PAIRS = {"train": 300, "valid": 20}  # what is kept of each split
# Added to the recipe's own settings (flags after -c win): seconds instead of half an hour,
# still five checkpoints for `average --last 5` and a validation on the way.
TINY_TRAINING = (
    "--preset tiny --vocab-size 400 --max-tokens 1024 --max-steps 6 --save-every 1 "
    "--valid-every 3 --log-every 1 --no-progress"
)
RECIPE = "-c recipes/bible-en-es-cpu.yaml"
PAGE_PORT = "8000"

SWORD_CONF = bible.DEFAULT_SWORD_DIR / "mods.d"
MODULES_INSTALLED = all((SWORD_CONF / f"{m.name}.conf").is_file() for m in bible.MODULES.values())


def scaled(text: str, port: int) -> str:
    """A block as the test runs it: the tiny training and the free port."""
    text = text.replace(RECIPE, f"{RECIPE} {TINY_TRAINING}")
    return text.replace(f"--port {PAGE_PORT}", f"--port {port}").replace(
        f"localhost:{PAGE_PORT}", f"localhost:{port}"
    )


def cut_corpus(folder: Path) -> None:
    """Keep the first few hundred pairs of each split (both sides and the references)."""
    for split, pairs in PAIRS.items():
        for path in folder.glob(f"{split}.*"):
            lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
            path.write_text("".join(lines[:pairs]), encoding="utf-8")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_healthy(server: subprocess.Popen, port: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert server.poll() is None, f"the server exited ({server.returncode})"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as answer:
                if answer.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"the server did not answer /health within {timeout:.0f} s")


def runnable_blocks() -> list[CodeBlock]:
    return [b for b in code_blocks(TUTORIAL, "sh", "python") if b.runnable]


def test_the_tutorial_marks_each_step_runnable() -> None:
    """The steps the page promises are among the blocks the test runs (no SWORD needed)."""
    text = "\n".join(block.text for block in runnable_blocks())
    for step in (PREPARE, RECIPE, "aiayn average", "aiayn evaluate", "aiayn translate"):
        assert step in text, step
    for step in ("aiayn serve", "curl", "aiayn export", "Translator("):
        assert step in text, step
    servers = [b for b in runnable_blocks() if "background" in b.before]
    assert [b.text.split()[1] for b in servers] == ["serve"]
    assert f"--port {PAGE_PORT}" in servers[0].text


@pytest.mark.slow
@pytest.mark.skipif(
    not MODULES_INSTALLED,
    reason=f"SWORD modules not installed in {SWORD_CONF} (make bible-deps, or: "
    f"{bible.INSTALL_COMMAND})",
)
def test_the_tutorial_runs_as_written_at_a_tiny_scale(tmp_path: Path) -> None:
    pytest.importorskip("pysword", reason="pysword is not installed (the `data` extra)")
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed: the page asks the server with it")
    env = reader_checkout(tmp_path)
    (tmp_path / "recipes").symlink_to(ROOT / "recipes")
    port = free_port()
    server = None
    try:
        for block in runnable_blocks():
            text = scaled(block.text, port)
            if "background" in block.before:
                server = subprocess.Popen(
                    ["bash", "-euo", "pipefail", "-c", text],
                    cwd=tmp_path,
                    env=env,
                    start_new_session=True,  # its own process group, stopped as one below
                )
                wait_until_healthy(server, port)
                continue
            out = run_block(text, tmp_path, env, language=block.language)
            if PREPARE in text:
                check_prepare_output(out, tmp_path / CORPUS)
                cut_corpus(tmp_path / CORPUS)
            elif text.startswith("curl"):
                [translation] = json.loads(out)["translations"]
                assert len(translation["hypotheses"]) == 2  # the page asks for "n_best": 2
            elif "aiayn evaluate" in text:
                assert "BLEU|" in out and "chrF2|" in out
    finally:
        if server is not None:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=30)
    assert server is not None, "the page starts no server"


def check_prepare_output(out: str, corpus: Path) -> None:
    """What `prepare` printed is what the page shows, where the Debian packages are the ones
    the page's counts come from (bookworm's)."""
    manifest = json.loads((corpus / "manifest.json").read_text(encoding="utf-8"))
    modules = manifest["source"]["modules"]
    if (modules["en"]["version"], modules["es"]["version"]) == ("426.0", "2.60"):
        page = TUTORIAL.read_text(encoding="utf-8")
        for line in out.splitlines():
            assert line in page, f"prepare printed a line the tutorial does not show: {line}"
