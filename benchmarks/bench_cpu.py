"""CPU benchmark: our engine vs transformers' generate offline, then requests/s and TTFT over loopback.

    .venv/bin/python benchmarks/bench_cpu.py [--config-dir DIR] [--new-tokens 64] [--requests 32]
        [--concurrency 8] [--skip-online] [--out docs/performance.md] [--note TEXT] [KEY=VALUE ...]

Part 1 (offline, in process): the same chat prompts, greedy, EOS banned, --new-tokens each; batch 1 (one
prompt at a time) and batch 8 (all at once), for LLMEngine and for AutoModelForCausalLM.generate.
Part 2 (online): `appliance serve` in a subprocess on a free 127.0.0.1 port, a closed loop of streaming
chat completions at --concurrency, then SIGTERM and a check that the server exits 0.
A measurement, not a test: it prints tables and rewrites its section of --out; it asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import gc
import math
import os
import platform
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import torch

from appliance.config.compose import compose_config
from appliance.engine.engine import LLMEngine
from appliance.engine.request import SamplingParams

# Varied real prompts (question, instruction, code, summary...): the prompt lengths differ, as in use.
PROMPTS = [
    "What is the capital of France, and why did it become the capital?",
    "Write a short poem about the sea at night.",
    "Explain in simple terms how a refrigerator keeps food cold.",
    "Give me three tips for writing clear emails at work.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "What are the main differences between a virus and a bacterium?",
    "Suggest a simple vegetarian dinner recipe for two people.",
]
B1_PROMPTS = 3  # batch 1 runs this many prompts one after another and reports the mean
BEGIN, END = "<!-- bench_cpu:begin -->", "<!-- bench_cpu:end -->"


@dataclass
class OfflineRow:
    impl: str
    batch: int
    tokens: int  # generated tokens, all requests
    wall_s: float  # add/generate call to the last token
    ttft_ms: float  # mean time to the first token (prefill + first sample)
    decode_tps: float  # tokens after each request's first / time after the first (steady decode)
    match: str  # greedy tokens identical to transformers at batch 1 (a correctness sanity check)


def run_engine(engine: LLMEngine, prompts: list[list[int]], n: int) -> tuple[list[list[int]], float, float, float]:
    """Generate for all `prompts` together; return (tokens per prompt, wall s, mean ttft s, last first-token s)."""
    t0 = time.monotonic()
    for i, ids in enumerate(prompts):
        # min_tokens = max_tokens bans EOS like transformers' min_new_tokens; ignore_eos would instead
        # keep EOS as a token and go on, so greedy outputs would part at the first EOS.
        engine.add_request(f"b{i}", ids, SamplingParams(max_tokens=n, temperature=0.0, min_tokens=n),
                           arrival_time=t0)
    out: dict[str, list[int]] = {f"b{i}": [] for i in range(len(prompts))}
    first: dict[str, float] = {}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.token_ids
            if o.first_token_time is not None:
                first.setdefault(o.request_id, o.first_token_time)
    wall = time.monotonic() - t0
    ttfts = [t - t0 for t in first.values()]
    return [out[f"b{i}"] for i in range(len(prompts))], wall, statistics.mean(ttfts), max(ttfts)


def run_hf(model: torch.nn.Module, prompts: list[list[int]], n: int, pad: int) -> tuple[list[list[int]], float]:
    """transformers generate on the same ids: left padding (pad = eos) with an attention mask, greedy,
    min_new_tokens = max_new_tokens so EOS cannot end it early (our min_tokens)."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    t0 = time.monotonic()
    with torch.inference_mode():
        gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=pad)
    return gen[:, width:].tolist(), time.monotonic() - t0


def offline(cfg_dir: Optional[str], overrides: list[str], n: int) -> list[OfflineRow]:
    from transformers import AutoModelForCausalLM

    cfg = compose_config(cfg_dir, overrides)
    engine = LLMEngine(cfg)
    prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    pad = min(engine.tokenizer.eos_token_ids)
    model = AutoModelForCausalLM.from_pretrained(Path(cfg.model.path).expanduser(), dtype=torch.float32).eval()
    # Warm-up: first calls pay for lazy init, allocator growth and (for us) any kernel compilation.
    run_engine(engine, prompts[:2], 4)
    run_hf(model, prompts[:2], 4, pad)

    rows: list[OfflineRow] = []
    ref: list[list[int]] = []  # transformers batch-1 tokens, the reference for the match column
    # Each batch size runs both implementations back to back, so drifting machine load hits them alike.
    for batch in (1, 8):
        for impl in ("transformers", "appliance"):
            groups = [[p] for p in prompts[:B1_PROMPTS]] if batch == 1 else [prompts[:batch]]
            toks: list[list[int]] = []
            wall = ttft = decode_s = 0.0
            for g in groups:
                if impl == "appliance":
                    t, w, mean_first, last_first = run_engine(engine, g, n)
                else:
                    t, w = run_hf(model, g, n, pad)
                    # Prefill = a 1-token generate on the same batch; every row gets its first token together.
                    _, mean_first = run_hf(model, g, 1, pad)
                    last_first = mean_first
                toks += t
                wall += w
                ttft += mean_first / len(groups)
                decode_s += w - last_first
            if impl == "transformers" and batch == 1:
                ref = toks
            same = sum(a == b for a, b in zip(toks, ref))  # over the batch-1 prompts only
            total = sum(len(t) for t in toks)
            rows.append(OfflineRow(impl, batch, total, wall, ttft * 1e3,
                                   (total - len(toks)) / decode_s, f"{same}/{len(ref)}"))
    del engine, model
    gc.collect()
    return rows


# ---------------------------------------------------------------------------------------------- online
@dataclass
class OnlineResult:
    requests: int
    concurrency: int
    ok: int = 0
    failures: int = 0
    wall_s: float = 0.0
    out_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)  # request sent -> first content chunk
    e2e_s: list[float] = field(default_factory=list)  # request sent -> end of stream
    exit_code: Optional[int] = None  # the server's exit status after SIGTERM (0 = clean drain)
    first_error: str = ""


def free_port() -> int:
    # Bind to port 0 and give it back; another process taking it in between is possible but unlikely.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float, log_path: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before /health; log:\n"
                               + log_path.read_text()[-3000:])
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:  # refused while starting, or 503 while loading: keep polling
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server not healthy after {timeout_s:.0f} s; log:\n" + log_path.read_text()[-3000:])


async def load(base_url: str, model: str, requests: int, concurrency: int, max_tokens: int) -> OnlineResult:
    """Closed loop: `concurrency` workers, each sends its next request when the previous one ends."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="unused", timeout=300, max_retries=0)
    res = OnlineResult(requests, concurrency)
    todo = iter(range(requests))

    async def one(i: int) -> None:
        t0 = time.monotonic()
        first: Optional[float] = None
        tokens = chunks = 0
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
            max_tokens=max_tokens, temperature=0, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})  # every request costs the same number of tokens
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first if first is not None else time.monotonic()
                chunks += 1
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        if first is None:
            raise RuntimeError("stream ended without content")
        res.ttft_s.append(first - t0)
        res.e2e_s.append(time.monotonic() - t0)
        res.out_tokens += tokens or chunks

    async def worker() -> None:
        for i in todo:
            try:
                await one(i)
                res.ok += 1
            except Exception as e:  # noqa: BLE001 - a failed request is a figure to report, not a crash
                res.failures += 1
                res.first_error = res.first_error or f"{type(e).__name__}: {e}"[:200]

    await one(0)  # warm-up, not counted
    t0 = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    res.wall_s = time.monotonic() - t0
    await client.close()
    return res


def online(cfg_dir: Optional[str], overrides: list[str], requests: int, concurrency: int) -> OnlineResult:
    port = free_port()
    cmd = [sys.executable, "-m", "appliance", "serve", *(["--config-dir", cfg_dir] if cfg_dir else []),
           *overrides, "server.host=127.0.0.1", f"server.port={port}", "server.api_keys=[]"]
    model = compose_config(cfg_dir, overrides).model.name
    with tempfile.NamedTemporaryFile("w+", prefix="bench-serve-", suffix=".log", delete=False) as log:
        log_path = Path(log.name)
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}/health", 300, log_path)
        res = asyncio.run(load(f"http://127.0.0.1:{port}/v1", model, requests, concurrency, 32))
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            code: Optional[int] = proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            code = None  # shown as "timeout": it did not drain in time
    res.exit_code = code
    if code != 0:
        print(f"server exit status {code}; log: {log_path}", file=sys.stderr)
    else:
        log_path.unlink()
    return res


# ---------------------------------------------------------------------------------------------- report
def pct(xs: Sequence[float], p: float) -> float:
    """Nearest-rank percentile (no interpolation): with 32 samples p99 is the slowest request."""
    s = sorted(xs)
    return s[max(0, math.ceil(p / 100 * len(s)) - 1)] if s else float("nan")


def table(head: list[str], rows: list[list[str]]) -> str:
    """A Markdown table; it reads fine as plain text on stdout too."""
    return "\n".join("| " + " | ".join(r) + " |" for r in [head, ["---"] * len(head), *rows])


def machine() -> str:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor() or "unknown")
    import transformers

    return (f"{cpu}, {os.cpu_count()} cores; torch {torch.__version__} ({torch.get_num_threads()} threads), "
            f"transformers {transformers.__version__}, Python {platform.python_version()}")


def report(args: argparse.Namespace, rows: list[OfflineRow], on: Optional[OnlineResult]) -> str:
    parts = [f"## CPU, {datetime.date.today().isoformat()}", "",
             f"- Machine: {machine()}",
             # Other processes on the machine skew CPU figures; the load average shows how much.
             f"- Load average (1 min): {args.load_start:.1f} at start, {os.getloadavg()[0]:.1f} at end",
             f"- Command: `{args.command}`"]
    if args.note:
        parts.append(f"- Note: {args.note}")
    parts += ["", f"### Offline: greedy, EOS banned, {args.new_tokens} new tokens per prompt", "",
              table(["impl", "batch", "tokens", "wall s", "tok/s", "decode tok/s", "TTFT ms", "same as HF b1"],
                    [[r.impl, str(r.batch), str(r.tokens), f"{r.wall_s:.2f}", f"{r.tokens / r.wall_s:.1f}",
                      f"{r.decode_tps:.1f}", f"{r.ttft_ms:.0f}", r.match] for r in rows]),
              "", f"Batch 1 is the mean over {B1_PROMPTS} prompts run one after another; batch 8 runs all 8 "
              "at once. tok/s = generated tokens / wall time; decode tok/s leaves out each request's "
              "first token and the time to it. TTFT for transformers is a 1-token generate on the same batch."]
    if on is not None:
        ms = lambda xs, p: f"{pct(xs, p) * 1e3:.0f}"  # noqa: E731
        parts += ["", f"### Online: {on.requests} streaming chat completions, max_tokens 32 (ignore_eos), "
                  f"closed loop at concurrency {on.concurrency}, loopback", "",
                  table(["req/s", "out tok/s", "TTFT p50 ms", "TTFT p99 ms", "e2e p50 ms", "e2e p99 ms",
                         "failures", "server exit"],
                        [[f"{on.ok / on.wall_s:.2f}", f"{on.out_tokens / on.wall_s:.1f}", ms(on.ttft_s, 50),
                          ms(on.ttft_s, 99), ms(on.e2e_s, 50), ms(on.e2e_s, 99), str(on.failures),
                          "timeout" if on.exit_code is None else str(on.exit_code)]])]
        if on.first_error:
            parts.append(f"\nFirst failure: `{on.first_error}`")
    return "\n".join(parts) + "\n"


def write_doc(path: Path, section: str) -> None:
    """Replace the text between our markers (or append it), leaving the rest of the file alone."""
    block = f"{BEGIN}\n{section}{END}\n"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if BEGIN in text and END in text:
        text = text[:text.index(BEGIN)] + block + text[text.index(END) + len(END):].lstrip("\n")
    else:
        text = text.rstrip("\n") + "\n\n" + block
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config-dir", default=None, help="Hydra config dir (default: the repository's configs/)")
    p.add_argument("--out", default="docs/performance.md", help="Markdown file whose bench_cpu section is rewritten")
    p.add_argument("--new-tokens", type=int, default=64, help="offline: tokens generated per prompt")
    p.add_argument("--requests", type=int, default=32, help="online: requests in total")
    p.add_argument("--concurrency", type=int, default=8, help="online: requests in flight")
    p.add_argument("--skip-online", action="store_true", help="offline part only")
    p.add_argument("--note", default="", help="a line for the doc, e.g. about the machine's load")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="Hydra overrides for engine and server")
    # As in appliance/cli.py: overrides written after an option come back as extras; keep them.
    args, extra = p.parse_known_args(argv)
    if [a for a in extra if a.startswith("-")]:
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    args.overrides += extra
    args.command = shlex.join([os.path.relpath(sys.executable), *sys.argv]) if argv is None else ""

    args.load_start = os.getloadavg()[0]
    rows = offline(args.config_dir, args.overrides, args.new_tokens)
    on = None if args.skip_online else online(args.config_dir, args.overrides, args.requests, args.concurrency)
    section = report(args, rows, on)
    print(section)
    write_doc(Path(args.out), section)
    return 0 if on is None or (on.failures == 0 and on.exit_code == 0) else 1


if __name__ == "__main__":
    sys.exit(main())
