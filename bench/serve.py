"""Serving under load: requests/s and latency of `aiayn serve`, with and without batching.

`make bench-serve`; each run appends one record to bench/results/serve.jsonl (bench/runner.py).

Starts `aiayn serve` as a subprocess on 127.0.0.1 (so the load generator does not share its
Python interpreter), then, for each setting (server-side batching on, then off) and each number
of concurrent clients, sends `--requests` requests from that many asyncio clients, each request
one sentence. Two workloads:

- **What a user serves** (``-m MODEL --texts FILE``): a trained model directory, and requests
  drawn at random from the lines of FILE (a real test set); the server's own length limit
  (§6.1: input length + 50), so each output ends where the model ends it.
- **A fixed load** (the default, a microbenchmark): a model with **random weights** (a
  `--preset` Transformer and a SentencePiece vocabulary trained on English and German number
  words) and English number sentences. Random weights rarely emit EOS, so outputs run to the
  length limit, `--out-len` tokens: each request does about the same work whatever the model
  prefers (the report says how many did).

Reports requests/s, p50 and p99 latency, errors (any answer but 200, or a failed connection:
the run fails if there is one), and how many requests the server put in each model call on
average (from `GET /health`). Each cell is bounded in count (`--requests`) and time
(`--max-seconds`: no new requests after that).

    python bench/serve.py -m MODEL --texts DATA/valid.en --requests 200 --max-seconds 60
    python bench/serve.py --no-record                     # random weights, 1000 requests a cell

``--hammer N`` measures fairness instead: the latency of one client's short requests while N
clients send costly ones (``--hammer-texts`` texts of ``--hammer-chars`` characters at beam 16,
length penalty 5) and hang up after ``--hammer-hangup-s``, as a hostile client would:

    python bench/serve.py -m MODEL --texts DATA/valid.en --hammer 2 --max-seconds 30

``--hostile`` measures what one request of at most ``--max-body-bytes`` (4 MiB) can cost the
server at its default limits: its answer, time, hold on the event loop and peak memory (Linux;
about 40 s; docs/serving.md, "What one request can cost", says how):

    python bench/serve.py --hostile --beam-size 1
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import httpx
import torch
from num2words import num2words

import runner
from aiayn.config import preset
from aiayn.decode.costs import DecodingCosts
from aiayn.decode.translator import Translator
from aiayn.errors import CheckpointError, UserError
from aiayn.model import Transformer
from aiayn.model_dir import resolve_model_dir, save_model_dir
from aiayn.text.lines import read_lines
from aiayn.text.tokenizer import Tokenizer


def build_model_dir(directory: Path, preset_name: str) -> Path:
    """A model directory with random weights and a vocabulary of number words."""
    numbers = range(0, 10_000, 7)
    lines = [num2words(n, lang="en") for n in numbers] + [num2words(n, lang="de") for n in numbers]
    corpus = directory / "corpus.txt"
    corpus.write_text("\n".join(lines) + "\n", encoding="utf-8")
    tokenizer = Tokenizer.train([corpus], directory / "tokenizer.model", vocab_size=1000)
    torch.manual_seed(0)
    config = preset(preset_name, src_vocab_size=tokenizer.vocab_size, dropout=0.0)
    return save_model_dir(
        directory / "model",
        Transformer(config),
        tokenizer_file=tokenizer.model_file,
        metadata={"src_lang": "en", "tgt_lang": "de"},
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def serving(
    model_dir: Path, args: argparse.Namespace, batching: bool
) -> Iterator[tuple[subprocess.Popen, str]]:
    """`aiayn serve` in a process of its own while the block runs: (its process, its URL)."""
    port = free_port()
    command = [
        *runner.AIAYN, "serve", "-m", str(model_dir), "--port", str(port),
        "--beam-size", str(args.beam_size), "--threads", str(args.threads),
        "--batch-wait-ms", str(args.batch_wait_ms), "--max-queue", "4096",
        "--log-level", "warning",
    ]  # fmt: skip
    if args.max_batch_cost is not None:
        command += ["--max-batch-cost", str(args.max_batch_cost)]
    if args.model is None:  # random weights: every output runs to --out-len
        command += ["--max-len-a", "0", "--max-len-b", str(args.out_len)]
    if not batching:
        command.append("--no-batching")
    if not args.onednn:
        command.append("--no-onednn")
    process = subprocess.Popen(command, preexec_fn=runner.ends_with_benchmark)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"`{' '.join(command)}` did not start")
        time.sleep(0.2)
    try:
        yield process, url
    finally:
        process.terminate()
        process.wait(30)


def read_texts(path: Path) -> list[str]:
    """The non-blank lines of ``path``: the sentences requests are drawn from."""
    try:
        texts = [line.strip() for line in read_lines(path) if line.strip()]
    except UserError as error:  # missing, or a line that is not UTF-8 (file and line named)
        sys.exit(f"--texts: {error}")
    if not texts:
        sys.exit(f"--texts {path}: no sentence in it")
    return texts


def sentences(args: argparse.Namespace, count: int, seed: int) -> list[str]:
    """``count`` request texts: lines of ``--texts`` drawn at random (with replacement), or
    English number sentences (`num2words` of 1–99,999) for the random-weight model."""
    rng = random.Random(seed)
    if args.texts is not None:
        return rng.choices(args.lines, k=count)
    return [num2words(rng.randrange(1, 100_000), lang="en") for _ in range(count)]


def short_sentence(args: argparse.Namespace, rng: random.Random) -> str:
    """A short request: one of the shortest quarter of ``--texts``, or a number below 100."""
    if args.texts is not None:
        return rng.choice(args.short_lines)
    return num2words(rng.randrange(1, 100), lang="en")


async def load(url: str, texts: list[str], concurrency: int, max_seconds: float) -> dict:
    """Sends every text once from `concurrency` clients; latency per request, errors."""
    pending = iter(texts)
    latencies: list[float] = []
    errors: list[str] = []
    out_lens: list[int] = []
    stop_at = time.monotonic() + max_seconds
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async def client(http: httpx.AsyncClient) -> None:
        for text in pending:
            if time.monotonic() > stop_at:
                return
            start = time.perf_counter()
            try:
                response = await http.post("/translate", json={"text": text})
                if response.status_code != 200:
                    errors.append(f"{response.status_code}: {response.text[:200]}")
                    continue
            except httpx.HTTPError as error:
                errors.append(repr(error))
                continue
            latencies.append(time.perf_counter() - start)
            out_lens.append(len(response.json()["translations"][0]["tokens"]))

    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        start = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    return {"latencies": latencies, "errors": errors, "elapsed": elapsed, "out_lens": out_lens}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run(args: argparse.Namespace, model_dir: Path) -> tuple[list[dict], list[int]]:
    """A row per setting (batching on, then off) and number of clients, as the record shows
    it; and the length of every answer, in tokens."""
    rows, out_lens = [], []
    for batching in (True, False):
        with serving(model_dir, args, batching) as (_, url):
            asyncio.run(load(url, sentences(args, 8, seed=99), 2, 60))  # warm-up
            for concurrency in args.concurrency:
                before = httpx.get(url + "/health").json()
                texts = sentences(args, args.requests, seed=concurrency)
                result = asyncio.run(load(url, texts, concurrency, args.max_seconds))
                after = httpx.get(url + "/health").json()
                latencies, errors = result["latencies"], result["errors"]
                req_s = len(latencies) / result["elapsed"]
                p50, p99 = 1000 * statistics.median(latencies), 1000 * percentile(latencies, 0.99)
                calls = after["model_calls"] - before["model_calls"]
                per_call = (after["requests"] - before["requests"]) / max(calls, 1)
                out_lens += result["out_lens"]
                rows.append({
                    "batching": "on" if batching else "off", "clients": concurrency,
                    "requests": len(latencies) + len(errors), "errors": len(errors),
                    "requests_per_s": round(req_s, 1), "p50_ms": round(p50), "p99_ms": round(p99),
                    "per_call": round(per_call, 1),
                })  # fmt: skip
                print(f"batching={rows[-1]['batching']:3} clients={concurrency:3d} "
                      f"{rows[-1]['requests']:5d} requests {len(errors)} errors "
                      f"{req_s:7.1f} req/s  p50 {p50:7.1f} ms  p99 {p99:7.1f} ms  "
                      f"{per_call:.1f} requests/call", flush=True)  # fmt: skip
                for error in errors[:5]:
                    print("   ", error, file=sys.stderr)
    return rows, out_lens


async def hammered(url: str, args: argparse.Namespace) -> dict:
    """Short requests from one client while ``args.hammer`` clients send costly ones and hang
    up after ``args.hammer_hangup_s``; latencies of the short ones, hang-ups counted."""
    rng = random.Random(7)
    long_text = " ".join(sentences(args, 40, seed=3))[: args.hammer_chars]
    costly = {"texts": [long_text] * args.hammer_texts, "beam_size": 16, "length_penalty": 5.0}
    stop_at = time.monotonic() + args.max_seconds
    latencies: list[float] = []
    errors: list[str] = []
    hangups = 0

    async def hammer() -> None:
        nonlocal hangups
        while time.monotonic() < stop_at:
            async with httpx.AsyncClient(base_url=url, timeout=args.hammer_hangup_s) as http:
                try:
                    response = await http.post("/translate", json=costly)
                    if response.status_code != 200:
                        errors.append(f"hammer {response.status_code}: {response.text[:200]}")
                        await asyncio.sleep(1)
                except httpx.TimeoutException:
                    hangups += 1

    async def short() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=600) as http:
            await asyncio.sleep(args.hammer_hangup_s)  # let the hammers fill the queue
            while time.monotonic() < stop_at:
                text = short_sentence(args, rng)
                start = time.perf_counter()
                response = await http.post("/translate", json={"text": text})
                if response.status_code == 200:
                    latencies.append(time.perf_counter() - start)
                else:
                    errors.append(f"short {response.status_code}: {response.text[:200]}")

    await asyncio.gather(short(), *(hammer() for _ in range(args.hammer)))
    return {"latencies": latencies, "errors": errors, "hangups": hangups}


def run_hammered(args: argparse.Namespace, model_dir: Path) -> dict:
    with serving(model_dir, args, batching=True) as (_, url):
        result = asyncio.run(hammered(url, args))
    lat = result["latencies"]
    if not lat:
        sys.exit(f"no short request finished; errors: {result['errors'][:3]}")
    print(
        f"{args.hammer} hammering clients ({args.hammer_texts} texts of {args.hammer_chars} "
        f"characters, beam 16, hang-up after {args.hammer_hangup_s} s; {result['hangups']} "
        f"hang-ups): {len(lat)} short requests, p50 {1000 * statistics.median(lat):.0f} ms, "
        f"p99 {1000 * percentile(lat, 0.99):.0f} ms, max {1000 * max(lat):.0f} ms; "
        f"{len(result['errors'])} errors"
    )
    for error in result["errors"][:5]:
        print("   ", error, file=sys.stderr)
    return {
        "budget": "the default" if args.max_batch_cost is None else str(args.max_batch_cost),
        "answered": len(lat),
        "median": f"{statistics.median(lat):.1f} s",
        "slowest": f"{max(lat):.1f} s",
    }


def hostile_requests(model_dir: Path, args: argparse.Namespace) -> dict[str, tuple[str, bytes]]:
    """(Content-Type, body) of each request measured by ``--hostile``, at the default limits:
    4 MiB bodies, 64 texts of 5000 characters, 2**21 attention values."""
    size, texts, chars, attention_values = 4 * 1024 * 1024, 64, 5000, 2**21

    def filled(start: bytes, unit: bytes, end: bytes) -> bytes:
        """``start``, ``unit`` repeated (less its last separator), ``end``: ``size`` bytes."""
        items = unit * ((size - len(start) - len(end)) // len(unit))
        return start + (items[:-1] if unit.endswith((b",", b"&")) else items) + end

    boundary = b"b0undary"
    part = b"--" + boundary + b'\r\nContent-Disposition: form-data; name="q"\r\n\r\na\r\n'
    emoji = "\U0001f600"  # 12 bytes as a JSON surrogate pair, 12 percent-encoded
    escaped_text = json.dumps(emoji * chars)  # "\ud83d\ude00..."
    largest_json = ('{"texts": [' + ", ".join([escaped_text] * texts) + "]}").encode()
    largest_form = "&".join([f"q={quote(emoji * chars)}"] * texts).encode()
    # the full attention maps of as many long texts as --max-attention-values allows
    translator = Translator(model_dir)
    long_text = " ".join(sentences(args, 400, seed=5))[:chars]
    config = translator.model.config
    costs = DecodingCosts(translator.tokenizer, translator.source_limits)
    [(s, t)] = costs.search_bounds([long_text], max_len_a=0, max_len_b=args.out_len)
    maps = config.n_decoder_layers * config.n_heads
    fitting = attention_values // (s * t * maps)
    attention = {"texts": [long_text] * fitting, "return_attention": True, "full_attention": True}
    form, json_type = "application/x-www-form-urlencoded", "application/json"
    return {
        "baseline: one short text": (json_type, b'{"text": "one hundred and two"}'),
        "JSON: two million numbers": (json_type, filled(b'{"texts":[', b"1,", b"]}")),
        "JSON: 1.4 million empty lists": (json_type, filled(b'{"texts":[', b"[],", b"]}")),
        "JSON: a million empty strings": (json_type, filled(b'{"texts":[', b'"",', b"]}")),
        "JSON: 400k unknown fields": (json_type, filled(b'{"text":"a"', b',"":0', b"}")),
        "JSON: one text of 4 MiB of commas": (json_type, filled(b'{"text":"', b",", b'"}')),
        "form: a million fields": (form, filled(b"q=a&", b"x=&", b"")),
        "form: 1.4 million %XX escapes": (form, filled(b"q=", b"%41", b"")),
        "multipart: 60k parts": (
            f"multipart/form-data; boundary={boundary.decode()}",
            filled(b"", part, b"--" + boundary + b"--\r\n"),
        ),
        "largest JSON accepted: 64 texts of 5000 escaped emoji": (json_type, largest_json),
        "largest form accepted: 64 texts of 5000 %XX emoji": (form, largest_form),
        f"largest answer: full attention of {fitting} texts, {fitting * s * t * maps} values": (
            json_type,
            json.dumps(attention).encode(),
        ),
    }


def measure_one(pid: int, port: int, content_type: str, body: bytes) -> dict:
    """One request's answer, time, longest /health wait meanwhile, and peak memory."""
    longest = 0.0
    done = threading.Event()

    def probe() -> None:
        nonlocal longest
        health = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        while not done.is_set():
            start = time.perf_counter()
            health.request("GET", "/health")
            health.getresponse().read()
            longest = max(longest, time.perf_counter() - start)
            time.sleep(0.005)
        health.close()

    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = runner.proc_kib(pid, "VmRSS")
    prober = threading.Thread(target=probe)
    prober.start()
    time.sleep(0.05)
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    start = time.perf_counter()
    connection.request("POST", "/translate", body, {"Content-Type": content_type})
    response = connection.getresponse()
    answer = response.read()
    elapsed = time.perf_counter() - start
    time.sleep(0.05)
    done.set()
    prober.join()
    connection.close()
    error = json.loads(answer).get("error", "") if response.status != 200 else ""
    return {
        "body_mb": round(len(body) / 1e6, 2),
        "answer": str(response.status) + (f" {error[:60]}…" if error else ""),
        "answer_kb": round(len(answer) / 1e3, 1),
        "seconds": round(elapsed, 2),
        "health_ms": round(1000 * longest),
        "peak_mib": round((runner.proc_kib(pid, "VmHWM") - before) / 1024),
    }


def run_hostile(args: argparse.Namespace, model_dir: Path) -> list[dict]:
    """A row per request of `hostile_requests`, each sent once to a server at its defaults."""
    requests = hostile_requests(model_dir, args)
    rows = []
    with serving(model_dir, args, batching=True) as (process, url):
        port = int(url.rsplit(":", 1)[1])
        measure_one(process.pid, port, "application/json", b'{"text": "one two"}')  # warm
        for name, (content_type, body) in requests.items():
            rows.append({"request": name, **measure_one(process.pid, port, content_type, body)})
            print(f"{name}: {rows[-1]['answer']}, {rows[-1]['seconds']} s", flush=True)
    return rows


HAMMER_COLUMNS = [("budget", "call budget (`--max-batch-cost`)"),
                  ("answered", "short requests answered"), ("median", "median latency"),
                  ("slowest", "slowest")]  # fmt: skip
HOSTILE_COLUMNS = [("request", "request"), ("body_mb", "body (MB)"), ("answer", "answer"),
                   ("answer_kb", "answer (kB)"), ("seconds", "time (s)"),
                   ("health_ms", "longest /health (ms)"),
                   ("peak_mib", "peak memory above idle (MiB)")]  # fmt: skip
HOSTILE_NOTE = (
    "Each request sent once while another thread asks `GET /health` every 5 ms and keeps its "
    "longest wait (how long the event loop was held); peak memory: the server's `VmHWM` above "
    "its resident memory before the request."
)
COLUMNS = [
    ("batching", "server-side batching"), ("clients", "concurrent clients"),
    ("requests", "requests"), ("errors", "errors"), ("requests_per_s", "requests/s"),
    ("p50_ms", "p50 latency, ms"), ("p99_ms", "p99 latency, ms"),
    ("per_call", "requests per model call"),
]  # fmt: skip


def record(
    rows: list[dict], out_lens: list[int], args: argparse.Namespace, load: float | None
) -> dict:
    """The run's record: a row per setting and number of clients, the workload in its notes."""
    search = "greedy search" if args.beam_size == 1 else f"beam {args.beam_size}"
    if args.model is not None:
        setup = args.setup or args.model.resolve().name
        median = statistics.median(out_lens)
        workload = (f"One line of `{args.texts.name}` a request; outputs of {min(out_lens)}–"
                    f"{max(out_lens)} tokens (median {median:.0f}).")  # fmt: skip
    else:
        setup = f"`{args.preset}` with random weights, outputs of {args.out_len} tokens"
        workload = "One English number sentence a request (a microbenchmark)."
    most = max(args.concurrency)
    on, off = (next(r for r in rows if r["clients"] == most and r["batching"] == b)
               for b in ("on", "off"))  # fmt: skip
    return runner.record(
        "serve",
        table=f"one text a request, {search}, server on {args.threads} thread(s)",
        setup=setup,
        columns=COLUMNS,
        rows=rows,
        summary=f"one text a request: {on['requests_per_s']} requests/s with {most} clients "
        f"and server-side batching against {off['requests_per_s']} without",
        peers=("httpx",),
        machine_name=args.machine,
        load=load,
        notes=[workload, "The load generator runs on the same machine as the server."],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # fmt: off
    parser.add_argument("-m", "--model", type=Path,
                        help="a trained model directory (with --texts): what a user serves")
    parser.add_argument("--texts", type=Path,
                        help="with --model: requests are lines of this file (a test set)")
    parser.add_argument("--preset",
                        help="without --model: a random-weight model of this preset (default tiny)")
    parser.add_argument("--requests", type=int, default=1000, help="requests per cell (1000)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--max-seconds", type=float, default=300, help="time bound per cell")
    parser.add_argument("--beam-size", type=int, default=4, help="1 = greedy (default 4)")
    parser.add_argument("--out-len", type=int, help="without --model: output tokens (default 16)")
    parser.add_argument("--threads", type=int, default=1, help="server torch threads (1)")
    parser.add_argument("--batch-wait-ms", type=float, default=5.0)
    parser.add_argument("--max-batch-cost", type=int,
                        help="the server's budget of one model call (its default)")
    parser.add_argument("--hammer", type=int, default=0, help="costly clients (fairness run)")
    parser.add_argument("--hostile", action="store_true", help="what one request can cost")
    parser.add_argument("--no-onednn", dest="onednn", action="store_false",
                        help="serve with PyTorch's own nn.Linear (aiayn serve --no-onednn)")
    parser.add_argument("--hammer-texts", type=int, default=8, help="texts per costly request")
    parser.add_argument("--hammer-chars", type=int, default=400, help="characters per text")
    parser.add_argument("--hammer-hangup-s", type=float, default=2.0)
    # fmt: on
    runner.add_arguments(parser)
    args = parser.parse_args()
    if args.model is not None:
        for flag, value in (("--preset", args.preset), ("--out-len", args.out_len)):
            if value is not None:
                parser.error(f"{flag} is the random-weight model's: not with --model")
        if args.texts is None:
            parser.error("--model needs --texts: the sentences to send it")
        if args.hostile:
            parser.error("--hostile measures the random-weight model at its bounded lengths")
        try:
            args.model_dir = resolve_model_dir(args.model)  # a run directory: its model/
        except CheckpointError as error:
            parser.error(f"--model {args.model}: {error}")
        if not (args.model_dir / "config.json").is_file():
            parser.error(f"--model {args.model}: not an aiayn model directory (nor a run's)")
    elif args.texts is not None:
        parser.error("--texts goes with --model (the random-weight model knows number words)")
    args.preset = args.preset or "tiny"
    args.out_len = 16 if args.out_len is None else args.out_len
    args.lines = read_texts(args.texts) if args.texts is not None else []
    args.short_lines = sorted(args.lines, key=len)[: max(1, len(args.lines) // 4)]
    runner.stop_children_on_sigterm()
    load = runner.check_idle(args.busy_ok)
    with tempfile.TemporaryDirectory(prefix="bench_server_") as tmp:
        model_dir = args.model_dir if args.model else build_model_dir(Path(tmp), args.preset)
        if args.hammer or args.hostile:
            if args.hammer:
                table = (f"a short request while {args.hammer} clients send costly requests "
                         "and hang up")  # fmt: skip
                columns, rows, notes = HAMMER_COLUMNS, [run_hammered(args, model_dir)], []
            else:
                table = "what one request of at most 4 MiB costs a server at its default limits"
                columns, rows, notes = HOSTILE_COLUMNS, run_hostile(args, model_dir), [HOSTILE_NOTE]
            setup = args.setup or (args.model.resolve().name if args.model else args.preset)
            rec = runner.record("serve", table=table, setup=setup, columns=columns, rows=rows,
                                summary="", machine_name=args.machine, load=load,
                                notes=notes)  # fmt: skip
            return runner.write(rec, args)
        rows, out_lens = run(args, model_dir)
    errors = sum(r["errors"] for r in rows)
    if errors:
        sys.exit(f"{errors} requests failed")
    runner.write(record(rows, out_lens, args, load), args)


if __name__ == "__main__":
    main()
