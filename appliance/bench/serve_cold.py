"""The cold-adapter mix of `appliance bench serve` (`--cold-adapters K`): how much loading adapters from
a remote store on their first request disturbs the streams that are already running (issue 33).

Both sides of the comparison serve K extra requests beside each row's steady streams, `cold_start_s`
into its measured requests and `cold_interval_s` apart, of the same prompt and output lengths; only
their adapters differ, so the only difference between the sides is the load. The regular rows (the
"no loads" side) send them to adapters the server already holds (the row's mix's adapters in turn;
the base model for the `base` mix). Then every row runs again on fresh prompts of the same lengths
(a repeat would hit the prefix cache), its extras each naming an adapter the server has never seen:
the server looks each up through lora.resolver.sources, fetches it from the store into its disk
cache, reads it and serves it, while the row's steady streams decode. Each row reports the steady
requests' ITL and TTFT with and without the loads (the extra requests are timed apart from them on
both sides), the warm and the cold extras' TTFT (the cold ones' add lookup + fetch + read + slot
load), the server's fetches and reads over each side, and p99 ITL with loads over p99 ITL without,
against COLD_ITL_LIMIT.

The store is a local S3 API server (moto's, a subprocess on a free 127.0.0.1 port; one-off fake
credentials go to the server in its environment) or an existing one named by its resolver template
(`s3://BUCKET/PREFIX/{name}`, credentials from the standard AWS environment, an S3-compatible store's
endpoint from lora.s3_endpoint_url); the bench uploads its synthetic adapters there under names of
this run and deletes them after.
"""

from __future__ import annotations

import asyncio
import importlib.util
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from appliance.bench.report import table
from appliance.bench.serve_client import HttpTarget, RequestSpec, Result
from appliance.bench.serve_options import ServeOptions
from appliance.bench.serve_process import free_port
from appliance.bench.serve_report import failures_text, load_label
from appliance.bench.serve_stats import counter_total, latency_ms, summarize
from appliance.bench.workload import prompts_of_lengths
from appliance.config.schema import ConfigError, LoRAConfig

# Issue 33's target: p99 ITL of the running streams with cold loads over the same run without.
COLD_ITL_LIMIT = 1.2
MOTO = "moto"
MOTO_BUCKET, MOTO_PREFIX, MOTO_REGION = "appliance-bench", "cold", "us-east-1"
FIELD = "{name}"
# The steady figures a row's "no loads" side keeps from the regular row.
STEADY_KEYS = ("requests", "ok", "failures", "out_tok_s", "ttft_ms", "itl_ms", "tpot_ms")
COLUMNS = ["mix", "load", "loads", "ok", "failures", "out_tok_s", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99",
           "extras", "extra_ok", "overlapped", "extra_ttft_p50", "extra_ttft_max", "fetched", "itl_p99_x", "limit",
           "met"]


def check_cold_options(o: ServeOptions) -> None:
    """The --cold-* options (ServeOptions.check calls it)."""
    if o.cold_adapters < 0:
        raise ConfigError(f"bench serve --cold-adapters: must be >= 0, got {o.cold_adapters}")
    if o.cold_start_s < 0 or o.cold_interval_s < 0:
        raise ConfigError(f"bench serve --cold-start-s / --cold-interval-s: must be >= 0, got {o.cold_start_s} / "
                          f"{o.cold_interval_s}")
    if o.cold_output_len < 1:
        raise ConfigError(f"bench serve --cold-output-len: must be >= 1, got {o.cold_output_len}")
    if not o.cold_adapters:
        return
    if o.cold_source == MOTO:
        if o.url is not None:
            raise ConfigError("bench serve --cold-source moto: only a server the bench starts can be pointed at "
                              "its S3 server; with --url give the s3:// template the server's lora.resolver.sources "
                              "holds")
        return
    t = o.cold_source
    if not t.startswith("s3://") or t.count(FIELD) != 1 or not t.endswith(FIELD):
        raise ConfigError(f"bench serve --cold-source: {t!r} is neither 'moto' nor an s3:// template ending in "
                          f"{FIELD} (s3://BUCKET/PREFIX/{FIELD}): the bench uploads its adapters there")


def allowed_entry(template: str) -> str:
    """The lora.allowed_sources entry a template's URIs lie under: s3://BUCKET/PREFIX of
    s3://BUCKET/PREFIX/{name}."""
    return template[:-len(FIELD)].rstrip("/")


def _s3_client(endpoint_url: Optional[str], region: Optional[str], **creds: str) -> Any:
    import boto3

    return boto3.session.Session().client("s3", endpoint_url=endpoint_url, region_name=region, **creds)


class ColdStore:
    """The store the cold adapters are uploaded to and fetched from: `template` is the resolver's URI
    template; `client` the bench's own S3 client. For moto: its process, the endpoint and the
    credentials the started server gets (`server_env`)."""

    def __init__(self, template: str, client: Any, endpoint_url: Optional[str] = None,
                 server_env: Optional[dict[str, str]] = None, proc: Optional[subprocess.Popen] = None) -> None:
        self.template, self.client, self.endpoint_url = template, client, endpoint_url
        self.server_env = server_env or {}
        self.proc = proc
        self.uploaded: list[tuple[str, str]] = []  # (bucket, key), deleted after from an existing store

    @classmethod
    def moto(cls, log_path: Path, timeout_s: float = 120.0) -> "ColdStore":
        """moto's standalone S3 API server (`python -m moto.server`) on a free port of 127.0.0.1, with
        its bucket made. A process of its own: it serves the fetches without taking this process's GIL."""
        for module in ("moto", "flask", "boto3"):
            if importlib.util.find_spec(module) is None:
                raise ConfigError(f"bench serve --cold-source moto needs moto's server ({module} is missing): "
                                  "pip install 'appliance[bench]'")
        port = free_port()
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "wb") as log:
            proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                    stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        # moto takes any credentials; these exist for this run only, and never leave the environments.
        creds = {"aws_access_key_id": "AKIA" + secrets.token_hex(8).upper(),
                 "aws_secret_access_key": secrets.token_urlsafe(30)}
        store = cls(f"s3://{MOTO_BUCKET}/{MOTO_PREFIX}/{FIELD}", _s3_client(url, MOTO_REGION, **creds), url,
                    {"AWS_ACCESS_KEY_ID": creds["aws_access_key_id"],
                     "AWS_SECRET_ACCESS_KEY": creds["aws_secret_access_key"]}, proc)
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-20:])
                raise ConfigError(f"moto's S3 server exited with status {proc.returncode}; {log_path}:\n{tail}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    store.close()
                    raise ConfigError(f"moto's S3 server did not listen on {url} within {timeout_s:.0f} s; "
                                      f"see {log_path}") from None
                time.sleep(0.2)
        store.client.create_bucket(Bucket=MOTO_BUCKET)
        return store

    @classmethod
    def existing(cls, template: str, lora: LoRAConfig) -> "ColdStore":
        """An existing store: boto3's standard credential chain, lora.s3_endpoint_url / s3_region."""
        return cls(template, _s3_client(lora.s3_endpoint_url, lora.s3_region))

    def upload(self, name: str, adapter_dir: Path) -> None:
        from appliance.lora.sources.resolver import fill
        from appliance.lora.sources.s3 import FILES
        from appliance.lora.sources.uri import parse_uri

        uri = parse_uri(fill(self.template, name))
        for f in FILES:
            # put_object: one part, so the ETag is the MD5 the server checks the download against.
            self.client.put_object(Bucket=uri.root, Key=uri.key(f), Body=(adapter_dir / f).read_bytes())
            self.uploaded.append((uri.root, uri.key(f)))

    def close(self) -> None:
        if self.proc is not None:  # moto holds the objects in memory: they go with it
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(15)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            return
        for bucket, key in self.uploaded:
            try:
                self.client.delete_object(Bucket=bucket, Key=key)
            except Exception as e:  # noqa: BLE001 - one left behind is reported, the rest still deleted
                print(f"[bench serve] could not delete s3://{bucket}/{key}: {type(e).__name__}", file=sys.stderr)
        self.uploaded.clear()


@dataclass
class ColdWorkload:
    """What the two passes send: `steady` the second pass's steady specs per mix (fresh prompts), and per
    row (mix-major, then load point, as ServeBench._http_rows runs them) the K extra requests, `warm` to
    adapters already loaded (first pass) and `cold` to never-seen ones (second pass), of equal lengths."""

    steady: dict[str, list[RequestSpec]]
    warm: list[list[RequestSpec]]
    cold: list[list[RequestSpec]]


class ColdMix:
    """The cold adapters of one run: K synthetic adapters, uploaded under fresh names for each row (every
    mix at each of its `points` load points; a name is loaded once: the next row needs new ones), the
    store and the server settings."""

    def __init__(self, opts: ServeOptions, out: Path, points: int) -> None:
        self.opts, self.out, self.points = opts, out, points
        token = secrets.token_hex(3)  # names of this run only: an existing store or server never saw them
        self.names = [[f"cold-{token}-{j}-{i}" for i in range(opts.cold_adapters)]
                      for j in range(len(opts.mixes) * points)]
        self.dir: Optional[Path] = None
        self.cache_dir: Optional[Path] = None
        self.store: Optional[ColdStore] = None
        self.adapter_bytes = 0

    def prepare(self, model_path: Path, dtype: str, model_name: str, lora: LoRAConfig) -> dict:
        """Write the adapters, start or open the store, upload every row's names; returns the report's
        `cold` section (its rows filled in later)."""
        import torch

        from appliance.bench.adapters import served_shape, write_adapter

        o = self.opts
        args, std, torch_dtype = served_shape(model_path, dtype)
        self.dir = (Path(o.adapter_dir) / "cold" if o.adapter_dir
                    else Path(tempfile.mkdtemp(prefix="appliance-bench-cold-"))).resolve()
        dirs = []
        for i in range(o.cold_adapters):
            d = self.dir / f"r{o.rank}-{i:04d}"
            if not (d / "adapter_model.safetensors").is_file():
                write_adapter(d, args, o.rank, o.targets, zlib.crc32(f"cold-{o.rank}-{i}".encode()), std,
                              torch_dtype, torch.device("cpu"), model_name)
            dirs.append(d)
        self.adapter_bytes = sum(f.stat().st_size for f in dirs[0].iterdir()) if dirs else 0
        self.store = (ColdStore.moto(self.out / "moto.log") if o.cold_source == MOTO
                      else ColdStore.existing(o.cold_source, lora))
        print(f"[bench serve] uploading {len(self.names) * len(dirs)} cold adapters to {self.store.template}",
              file=sys.stderr)
        for names in self.names:
            for name, d in zip(names, dirs):
                self.store.upload(name, d)
        return {"source": o.cold_source, "template": self.store.template, "adapters": o.cold_adapters,
                "rank": o.rank, "targets": o.targets, "adapter_bytes": self.adapter_bytes,
                "start_s": o.cold_start_s, "interval_s": o.cold_interval_s, "output_len": o.cold_output_len,
                "limit": COLD_ITL_LIMIT, "rows": []}

    @property
    def server_env(self) -> dict[str, str]:
        return dict(self.store.server_env) if self.store else {}

    def server_overrides(self, lora: LoRAConfig, warm: int) -> list[str]:
        """What a started server needs to resolve the cold names: the template first among the resolver's
        sources, its prefix allowed, a disk cache of its own (empty: every load is a fetch), room for
        every adapter in host memory, and moto's endpoint."""
        assert self.store is not None
        t = self.store.template
        self.cache_dir = Path(tempfile.mkdtemp(prefix="appliance-bench-cold-cache-"))

        def quoted(xs: Sequence[str]) -> str:
            return "[" + ",".join(f"'{x}'" for x in xs) + "]"

        out = ["lora.enabled=true", f"lora.allowed_sources={quoted([*lora.allowed_sources, allowed_entry(t)])}",
               f"lora.resolver.sources={quoted([t, *(s for s in lora.resolver.sources if s != t)])}",
               f"lora.adapter_cache_dir={self.cache_dir}",
               f"lora.max_lora_rank={max(lora.max_lora_rank, self.opts.rank)}",
               f"lora.max_loaded_loras={max(lora.max_loaded_loras, warm + sum(map(len, self.names)))}"]
        if self.store.endpoint_url is not None:
            out += [f"lora.s3_endpoint_url={self.store.endpoint_url}", f"lora.s3_region={MOTO_REGION}"]
        return out

    def workload(self, specs: dict[str, list[RequestSpec]], vocab: int,
                 decode: Optional[Callable[[list[int]], str]]) -> ColdWorkload:
        """The steady specs again with fresh prompt tokens after the shared prefix (same lengths and
        adapters), and each row's warm and cold extra requests: the sides differ only by the loads."""
        o = self.opts
        seed = o.seed + 7
        fresh: dict[str, list[RequestSpec]] = {}
        for mix, ss in specs.items():
            tails = prompts_of_lengths([len(s.prompt_ids) - o.shared_prefix_len for s in ss], vocab, seed)
            seed += 1
            fresh[mix] = [self._spec(s.prompt_ids[:o.shared_prefix_len] + t, s.output_len, s.adapter, decode)
                          for s, t in zip(ss, tails)]
        # A cold request as long in all as a steady one (so it fits the context), most of it prompt.
        first = next(iter(specs.values()))
        total = [len(first[i % len(first)].prompt_ids) + first[i % len(first)].output_len
                 for i in range(o.cold_adapters)]
        out = [min(o.cold_output_len, max(1, n - 1)) for n in total]
        lengths = [n - k for n, k in zip(total, out)]
        rows = len(self.names)
        warm, cold = [], []
        for j, names in enumerate(self.names):
            # The adapters the row's mix already serves, in order of first use (None: the base model).
            held = list(dict.fromkeys(s.adapter for s in specs[o.mixes[j // self.points]]))
            # Prompts of their own on each side: neither side's extras find the other's in the prefix cache.
            prompts = prompts_of_lengths(lengths, vocab, o.seed + 100 + rows + j)
            warm.append([self._spec(p, k, held[i % len(held)], decode) for i, (p, k) in enumerate(zip(prompts, out))])
            prompts = prompts_of_lengths(lengths, vocab, o.seed + 100 + j)
            cold.append([self._spec(p, k, name, decode) for p, k, name in zip(prompts, out, names)])
        return ColdWorkload(fresh, warm, cold)

    @staticmethod
    def _spec(ids: list[int], output_len: int, adapter: Optional[str],
              decode: Optional[Callable[[list[int]], str]]) -> RequestSpec:
        return RequestSpec(ids, decode(ids) if decode else "", output_len, adapter)

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
        if self.cache_dir is not None:
            shutil.rmtree(self.cache_dir, ignore_errors=True)
        if self.dir is not None and not self.opts.adapter_dir:
            shutil.rmtree(self.dir, ignore_errors=True)


class ColdRows:
    """Either pass's hook into ServeBench._http_rows: `start` when a row's measured requests start (sends
    that row's extra requests from a thread of their own, so any client layout keeps running), `wait`
    once they ended, `finish` with the row. `cold` False: the first pass, whose extras name warm
    adapters; its rows are the regular rows, with those extras in `extras`. `cold` True: the second
    pass, whose rows go to the cold section, each paired with the regular row of its load point."""

    def __init__(self, extras: list[list[RequestSpec]], target: HttpTarget, opts: ServeOptions, res: dict,
                 cold: bool) -> None:
        self.extras, self.target, self.opts, self.res, self.cold = extras, target, opts, res, cold
        self.kind = "cold" if cold else "warm"
        self.row = -1
        self.t0 = 0.0
        self.window_s = 0.0
        self.thread: Optional[threading.Thread] = None
        self.sent: list[tuple[float, Result]] = []
        self.error: Optional[BaseException] = None

    @property
    def label(self) -> str:
        """What the progress lines add to a row's name."""
        return f"with {self.opts.cold_adapters} {'cold loads' if self.cold else 'warm extras'}"

    def start(self) -> None:
        self.row += 1
        self.sent, self.error = [], None
        self.t0 = time.perf_counter()
        self.thread = threading.Thread(target=self._send, args=(self.extras[self.row],), daemon=True)
        self.thread.start()

    def _send(self, specs: list[RequestSpec]) -> None:
        o = self.opts

        async def one(send: Any, i: int, spec: RequestSpec) -> tuple[float, Result]:
            await asyncio.sleep(max(0.0, self.t0 + o.cold_start_s + i * o.cold_interval_s - time.perf_counter()))
            at = time.perf_counter() - self.t0
            return at, await send(spec)

        async def run() -> list[tuple[float, Result]]:
            send = self.target.driver()
            try:
                return list(await asyncio.gather(*(one(send, i, s) for i, s in enumerate(specs))))
            finally:
                await send.aclose()

        try:
            self.sent = asyncio.run(run())
        except BaseException as e:  # noqa: BLE001 - raised again by wait(), in the bench's thread
            self.error = e

    def wait(self) -> None:
        """After the row's steady requests: the window's length, then the extra requests' ends."""
        self.window_s = time.perf_counter() - self.t0
        assert self.thread is not None
        self.thread.join()
        if self.error is not None:
            raise RuntimeError(f"the {self.kind} extra requests failed: {type(self.error).__name__}: {self.error}")

    def finish(self, row: dict) -> None:
        extras = self._summary(row["metrics_delta"])
        if not self.cold:
            self.res["rows"].append({**row, "extras": extras})
            return
        key = (row["mix"], row["load"], row["concurrency"], row["rate_rps"])
        base = next((r for r in self.res["rows"] if (r["mix"], r["load"], r["concurrency"], r["rate_rps"]) == key),
                    None)
        warm = base.get("extras") if base is not None else None
        ratio = None
        if base is not None and base.get("itl_ms") and row.get("itl_ms") and base["itl_ms"]["p99"] > 0:
            ratio = round(row["itl_ms"]["p99"] / base["itl_ms"]["p99"], 4)
        n = len(self.extras[self.row])
        # Not judged unless every extra request of both sides had its first token before the steady
        # requests ended: a later load (or warm prefill) is not in the ratio.
        seen = extras["in_window"] == n and warm is not None and warm["in_window"] == n
        self.res["cold"]["rows"].append({
            "mix": row["mix"], "load": row["load"], "concurrency": row["concurrency"], "rate_rps": row["rate_rps"],
            "no_loads": {k: base.get(k) for k in STEADY_KEYS} if base is not None else None,
            "with_loads": row, "warm": warm, "cold": extras, "itl_p99_ratio": ratio, "limit": COLD_ITL_LIMIT,
            "met": None if ratio is None or not seen else ratio <= COLD_ITL_LIMIT})

    def _summary(self, d: dict) -> dict:
        """This row's extra requests, and what the server loaded over the row (`d`: its metrics_delta)."""
        specs = self.extras[self.row]
        results = [r for _, r in self.sent]
        s = summarize(results, max(self.window_s, 1e-9), [x.output_len for x in specs])
        fetch_n = counter_total(d, "appliance_lora_load_duration_seconds_count", tier="disk")
        return {
            "kind": self.kind, "names": [x.adapter for x in specs], "requests": len(results), "ok": s["ok"],
            "failures": s["failures"], "first_errors": s["first_errors"], "ttft_ms": s["ttft_ms"],
            "ttft_max_ms": max((round(r.ttft_s * 1e3, 3) for r in results if r.ttft_s is not None), default=None),
            "sent_s": [round(at, 4) for at, _ in self.sent], "window_s": round(self.window_s, 4),
            # Extra requests that had their first token before the steady requests ended: in the ratio.
            "in_window": sum(1 for at, r in self.sent if r.ttft_s is not None and at + r.ttft_s <= self.window_s),
            # The server's remote -> disk fetches and disk -> host reads over the row (each adapter once).
            "fetches": int(counter_total(d, "appliance_lora_loads_total", tier="disk", result="success")),
            "reads": int(counter_total(d, "appliance_lora_loads_total", tier="cpu", result="success")),
            "load_errors": int(counter_total(d, "appliance_lora_loads_total", result="error")),
            "fetch_mean_ms": (round(1e3 * counter_total(d, "appliance_lora_load_duration_seconds_sum", tier="disk")
                                    / fetch_n, 3) if fetch_n else None)}


def failed(res: dict) -> bool:
    """Any extra request of a regular row, or any steady or extra request of a cold row, failed."""
    rows = (res.get("cold") or {}).get("rows") or []
    return (any((r.get("extras") or {}).get("failures") for r in res.get("rows") or [])
            or any(r["with_loads"]["failures"] or r["cold"]["failures"] for r in rows))


def render_cold(res: dict) -> str:
    """Two lines per load point: its steady streams with K extra requests to warm adapters (no loads)
    and with K to cold ones (loads); the extra_* and fetched columns are each line's extras."""
    c = res.get("cold")
    if not c:
        return ""

    def p(d: Optional[dict], q: str) -> Optional[float]:
        return (d or {}).get(q)

    def side(r: dict, s: dict, loads: str, x: Optional[dict]) -> dict:
        line = {"mix": r["mix"], "load": load_label(r), "loads": loads, "ok": f"{s['ok']}/{s['requests']}",
                "failures": failures_text(s["failures"]), "out_tok_s": s["out_tok_s"],
                "ttft_p50": p(s["ttft_ms"], "p50"), "ttft_p99": p(s["ttft_ms"], "p99"),
                "itl_p50": p(s["itl_ms"], "p50"), "itl_p99": p(s["itl_ms"], "p99")}
        if x is not None:
            line.update({"extras": f"{x['requests']} {x['kind']}", "extra_ok": f"{x['ok']}/{x['requests']}",
                         "overlapped": f"{x['in_window']}/{x['requests']}", "extra_ttft_p50": p(x["ttft_ms"], "p50"),
                         "extra_ttft_max": x["ttft_max_ms"], "fetched": x["fetches"]})
        return line

    lines = []
    for r in c["rows"]:
        if r["no_loads"] is not None:
            lines.append(side(r, r["no_loads"], "none", r.get("warm")))
        k = r["cold"]
        lines.append({**side(r, r["with_loads"], f"{k['requests']} cold", k), "itl_p99_x": r["itl_p99_ratio"],
                      "limit": f"<= {r['limit']}", "met": r["met"]})
    head = (f"## cold loads: {c['adapters']} rank-{c['rank']} adapters ({c['adapter_bytes'] / 2**20:.1f} MiB each) "
            f"from {c['template']} on first request, the first {c['start_s']:g} s into each row, "
            f"{c['interval_s']:g} s apart; the no-loads line sends as many requests to warm adapters at the "
            "same times (steady streams' latencies apart from the extras'; in ms)")
    return "\n".join([head, "", table(lines, COLUMNS)])
