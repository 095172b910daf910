"""`appliance bench serve`: the serving benchmark. It drives the HTTP server exactly as clients do
(streamed OpenAI chat / completions through the `openai` client, or streamed /generate with token ids)
under closed-loop and Poisson load, over an adapter mix, and reports client-side latency percentiles,
throughput, failures by HTTP status and the server's own /metrics counters over each row; then, with
`--compare-in-process`, the same requests through the engine in this process for the HTTP overhead.
With `--tenant-rate`, the two-tenant fairness mix (serve_tenants.py) runs instead of the load rows.

The server is started from the same Hydra config and overrides `appliance serve` takes (a subprocess
on a free 127.0.0.1 port, stopped after), or is an existing one (`--url`). Synthetic adapters
(adapters.py) are loaded through the admin API, so the server is started with their directory in
lora.adapter_roots, room for them in lora.max_loaded_loras and rank in lora.max_lora_rank; hot reload
and the periodic resync are off (with reconcile.prune: all a resync would unload them mid-run).
"""

from __future__ import annotations

import asyncio
import datetime
import platform
import re
import secrets
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from appliance.bench import report, serve_tenants
from appliance.bench.serve_client import (Driver, HttpTarget, RequestSpec, Result, closed_loop, drive_processes,
                                          httpx_module, import_openai, open_loop)
from appliance.bench.serve_cold import ColdMix, ColdRows, failed, render_cold
from appliance.bench.serve_options import ADMIN_KEY_ENV, API_KEY_ENV, ServeOptions
from appliance.bench.serve_process import ServerApi, ServerProcess, free_port
from appliance.bench.serve_report import plots, render
from appliance.bench.serve_stats import counter_deltas, counter_samples, server_summary, summarize
from appliance.bench.workload import (poisson_arrivals, prompts_of_lengths, sample_lengths, uniform_choices,
                                      zipf_choices)
from appliance.config.compose import compose_config
from appliance.config.schema import ConfigError

# Chat prompts grow by the template's tokens: leave this much of the context for them.
CHAT_TEMPLATE_ROOM = 64
WARMUP_OUTPUT_LEN = 8


@dataclass
class Keys:
    """Keys the caller found in the environment (cli.py reads it; the library does not)."""

    api_key: Optional[str] = None
    admin_key: Optional[str] = None


class ServeBench:
    def __init__(self, config_dir: Optional[str], overrides: Sequence[str], opts: ServeOptions, keys: Keys,
                 command: str) -> None:
        opts.check()
        # Fail before a server starts, with the install hint: chat/completions need the openai
        # client, /generate only its HTTP library.
        import_openai() if opts.api in ("chat", "completions", "auto") else httpx_module()
        self.opts, self.config_dir, self.keys = opts, config_dir, keys
        self.out = Path(opts.out)
        # A benchmark keeps the adapter set still: no hot reload, no resync (prune=all would unload ours); a
        # synthetic set replaces the config's inventory. The user's overrides come after and win.
        self.prepend = ["reconcile.watch=false", "reconcile.resync_s=0"]
        if not opts.config_adapters:
            self.prepend.insert(0, "adapters=[]")
        self.user = list(overrides)
        self.cfg = compose_config(config_dir, [*self.prepend, *self.user])
        self.adapter_root: Optional[Path] = None
        self.adapter_dirs: dict[str, Path] = {}
        self.cold: Optional[ColdMix] = None
        self.tenant_plan: Optional[serve_tenants.TenantPlan] = None  # --tenant-rate: the two-tenant mix
        self.res: dict[str, Any] = {"meta": self._meta(command), "workload": {}, "server": {}, "adapters": {},
                                    "rows": [], "plots": [], "errors": {}}

    def _meta(self, command: str) -> dict:
        now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        return {"command": masked([command])[0], "date": now,
                "python": platform.python_version(), "host": platform.node(), "model": self.cfg.model.name,
                "model_init": self.cfg.model.init, "options": asdict(self.opts)}

    # ------------------------------------------------------------------ set-up
    def _tokenizer(self) -> Any:
        from appliance.engine.tokenizer import Tokenizer, has_tokenizer

        path = Path(self.cfg.model.path).expanduser()
        return Tokenizer(path) if has_tokenizer(path) else None

    def _route(self, tok: Any) -> str:
        api = self.opts.api
        if api == "auto":
            return "generate" if tok is None else ("chat" if tok.has_chat_template else "completions")
        if api in ("chat", "completions") and tok is None:
            raise ConfigError(f"bench serve --api {api}: the model has no tokenizer (a shape-only model "
                              "streams token ids, no text): use --api generate")
        if api == "chat" and not tok.has_chat_template:
            raise ConfigError("bench serve --api chat: the model has no chat template; use completions")
        return api

    def _synthetic_adapters(self) -> dict[str, Path]:
        import torch

        from appliance.bench.adapters import make_adapters, served_shape

        o = self.opts
        args, std, dtype = served_shape(Path(self.cfg.model.path), self.cfg.model.dtype)
        self.adapter_root = Path(o.adapter_dir or tempfile.mkdtemp(prefix="appliance-bench-serve-")).resolve()
        return make_adapters(self.adapter_root, args, o.rank, o.adapters, o.targets, std, dtype, torch.device("cpu"),
                             self.cfg.model.name, o.progress)

    def _server_overrides(self) -> list[str]:
        """What the started server (and the in-process engine) get after the user's overrides."""
        c = self.cfg.lora
        extra: list[str] = []
        if self.adapter_dirs:
            roots = ",".join(f"'{r}'" for r in [*c.adapter_roots, str(self.adapter_root)])
            extra += ["lora.enabled=true", f"lora.adapter_roots=[{roots}]",
                      f"lora.max_loaded_loras={max(c.max_loaded_loras, len(self.adapter_dirs))}",
                      f"lora.max_lora_rank={max(c.max_lora_rank, self.opts.rank)}"]
        # A closed loop at exactly server.max_concurrent_requests might race it (a client's next request
        # may arrive before the server has counted its last one out) and measure spurious 429s.
        limit, top = self.cfg.server.max_concurrent_requests, max(self.opts.concurrency, default=0)
        if self.opts.url is None and limit and limit < 2 * top:
            extra.append(f"server.max_concurrent_requests={2 * top}")
        return [*self.prepend, *self.user, *extra]

    def _workload(self, route: str, tok: Any, max_model_len: int, names: list[str]) -> tuple[dict, dict]:
        """(specs per mix, warm-up specs per mix): the same prompts and lengths for every mix."""
        o = self.opts
        vocab = tok.vocab_size if tok is not None else self._vocab()
        n, w = self.tenant_plan.specs_needed if self.tenant_plan else o.num_requests, self._max_warmup()
        room = max_model_len - 1 - (CHAT_TEMPLATE_ROOM if route == "chat" else 0) - o.shared_prefix_len
        if room < 2:
            raise ConfigError(f"bench serve --shared-prefix-len {o.shared_prefix_len}: leaves no room for a "
                              f"prompt and a reply in model.max_model_len {max_model_len}")
        out = sample_lengths(n + w, o.output_len, o.output_dist, o.seed + 1, o.range_ratio, cap=max(1, room // 2))
        plen = sample_lengths(n + w, o.prompt_len, o.prompt_dist, o.seed + 2, o.range_ratio, cap=room)
        plen = [max(1, min(p, room - k)) for p, k in zip(plen, out)]
        prompts = prompts_of_lengths(plen, vocab, o.seed + 3)
        # One shared prefix per adapter name and one for the base model (key None), fixed by the seed.
        keys: list[Optional[str]] = [None, *names]
        prefixes = dict(zip(keys, prompts_of_lengths([o.shared_prefix_len] * len(keys), vocab, o.seed + 5)))

        def text(ids: list[int]) -> str:
            return tok.decode(ids) if route == "chat" else ""

        def assign(mix: str, k: int, seed: int) -> list[Optional[str]]:
            if mix == "base":
                return [None] * k
            if mix == "one":
                return [names[0]] * k
            pick = (uniform_choices(k, len(names), seed) if mix == "uniform"
                    else zipf_choices(k, len(names), o.zipf, seed))
            return [names[i] for i in pick]

        specs, warm = {}, {}
        for mix in o.mixes:
            a = assign(mix, n + w, o.seed + 4)
            full = [prefixes[a[i]] + prompts[i] for i in range(n + w)]
            specs[mix] = [RequestSpec(full[i], text(full[i]), out[i], a[i]) for i in range(n)]
            warm[mix] = [RequestSpec(full[i], text(full[i]), min(out[i], WARMUP_OUTPUT_LEN), a[i])
                         for i in range(n, n + w)]
        self.res["workload"] = {
            "api": route, "num_requests": n, "seed": o.seed, "mixes": o.mixes, "zipf_s": o.zipf,
            "prompt_len": {"dist": o.prompt_dist, "mean": o.prompt_len, "min": min(plen[:n]), "max": max(plen[:n])},
            "shared_prefix_len": o.shared_prefix_len,
            "output_len": {"dist": o.output_dist, "mean": o.output_len, "min": min(out[:n]), "max": max(out[:n])},
            "range_ratio": o.range_ratio, "ignore_eos": True, "temperature": 0.0}
        return specs, warm

    def _vocab(self) -> int:
        from appliance.models.weights import read_hf_config

        return int(read_hf_config(Path(self.cfg.model.path).expanduser())["vocab_size"])

    def _max_warmup(self) -> int:
        points = [*self.opts.concurrency, *([16] * len(self.opts.rate))] or [16]  # or the tenant mix
        return max(self._warmup_count(p) for p in points)

    def _warmup_count(self, wave: int) -> int:
        w = self.opts.warmup_requests
        return min(wave, self.opts.num_requests) if w is None else w

    # ------------------------------------------------------------------ the run
    def run(self) -> int:
        try:
            self._run()
        finally:
            if self.adapter_root is not None and self.opts.adapter_dir is None:
                shutil.rmtree(self.adapter_root, ignore_errors=True)
            if self.cold is not None:
                self.cold.close()
        self.res["plots"] = plots(self.res, self.out)
        report.write_json(self.res, self.out / "serve.json")
        if "tenants" in self.res:
            print(serve_tenants.render(self.res["tenants"], self.cfg.model.name))
            print(f"JSON: {self.out / 'serve.json'}")
            return 1 if serve_tenants.failed(self.res["tenants"]) else 0
        print(render(self.res))
        if "cold" in self.res:
            print("\n" + render_cold(self.res))
        for p in self.res["plots"]:
            print(p)
        print(f"JSON: {self.out / 'serve.json'}")
        return 1 if any(r["failures"] for r in self.res["rows"]) or failed(self.res) else 0

    def _run(self) -> None:
        o = self.opts
        tok = self._tokenizer()
        route = self._route(tok)
        if o.adapters:
            self.adapter_dirs = self._synthetic_adapters()
        overrides = self._server_overrides()
        if o.cold_adapters:  # the cold-adapter mix (serve_cold.py): its store, adapters and server settings
            self.cold = ColdMix(o, self.out, len(self._points()))
            self.res["cold"] = self.cold.prepare(Path(self.cfg.model.path), self.cfg.model.dtype, self.cfg.model.name,
                                                 self.cfg.lora)
            if o.url is None:
                overrides += self.cold.server_overrides(self.cfg.lora, len(self.adapter_dirs))
        self.cfg = compose_config(self.config_dir, overrides)  # checks the config the server gets
        api_key = self.cfg.server.api_keys[0] if self.cfg.server.api_keys else self.keys.api_key
        admin_key = self.cfg.server.admin_key or self.keys.admin_key
        server: Optional[ServerProcess] = None
        api: Optional[ServerApi] = None
        try:
            url = o.url
            if url is None:
                env: dict[str, str] = self.cold.server_env if self.cold is not None else {}
                if self.adapter_dirs and admin_key is None:
                    admin_key = secrets.token_urlsafe(24)  # this run's only: in the child's environment
                if admin_key is not None and self.cfg.server.admin_key != admin_key:
                    env[ADMIN_KEY_ENV] = admin_key
                    overrides = [*overrides, "server.admin_key=${oc.env:" + ADMIN_KEY_ENV + "}"]
                if o.tenant_rate:
                    api_key, tenant_keys = self._tenant_setup(overrides, env, api_key)
                port = free_port()
                url = f"http://127.0.0.1:{port}"
                server = ServerProcess(self.config_dir, [*overrides, "server.host=127.0.0.1",
                                                         f"server.port={port}"], env, self.out / "server.log")
                print(f"[bench serve] starting the server on {url} (log: {server.log_path})", file=sys.stderr)
                server.wait_healthy(url, o.server_timeout_s)
            api = ServerApi(url, api_key, admin_key)
            card = api.base_card()
            names = self._load_adapters(api)
            self.res["server"] = {"url": url, "started": server is not None, "base_model": card["id"],
                                  "max_model_len": card.get("max_model_len"), "overrides": masked(overrides),
                                  "log": str(server.log_path) if server else None}
            specs, warm = self._workload(route, tok, card.get("max_model_len") or self.cfg.model.max_model_len,
                                         names)
            if self.tenant_plan is not None:
                self._tenant_mix(api, route, card["id"], specs, warm, url, api_key, tenant_keys)
            elif self.cold is None:
                self._http_rows(api, route, card["id"], specs, warm, url, api_key)
            else:  # the rows with K extra requests to warm adapters, then again on fresh prompts to cold ones
                cw = self.cold.workload(specs, tok.vocab_size if tok is not None else self._vocab(),
                                        tok.decode if route == "chat" else None)
                target = HttpTarget(route, url, api_key, card["id"], o.request_timeout_s)
                self._http_rows(api, route, card["id"], specs, warm, url, api_key,
                                ColdRows(cw.warm, target, o, self.res, cold=False))
                self._http_rows(api, route, card["id"], cw.steady, warm, url, api_key,
                                ColdRows(cw.cold, target, o, self.res, cold=True))
        finally:
            if api is not None:
                api.close()
            if server is not None:
                self.res["server"]["exit_status"] = server.stop(self.cfg.server.shutdown_timeout_s + 30)
            report.write_json(self.res, self.out / "serve.json")
        if o.in_process and o.concurrency:
            self._in_process(route, specs, warm)

    def _tenant_setup(self, overrides: list[str], env: dict[str, str],
                      api_key: Optional[str]) -> tuple[str, dict[str, str]]:
        """The two-tenant mix's server: its tenants file and keys (in `overrides` and `env`, in place),
        and an unscoped key of the bench's own for warm-up and scrapes. Returns that key and the tenants'."""
        self.tenant_plan = serve_tenants.TenantPlan.of(self.opts, self.cfg.engine.max_num_seqs)
        extra, tenant_env, tenant_keys = serve_tenants.server_setup(
            self.tenant_plan, self.out / "tenants-config", self.cfg.server.max_concurrent_requests)
        overrides += extra
        env.update(tenant_env)
        if api_key is None:
            api_key = self.keys.api_key or secrets.token_urlsafe(24)
            env[API_KEY_ENV] = api_key
            overrides.append("server.api_keys=['${oc.env:" + API_KEY_ENV + "}']")
        return api_key, tenant_keys

    def _tenant_mix(self, api: ServerApi, route: str, base: str, specs: dict, warm: dict, url: str,
                    api_key: str, tenant_keys: dict[str, str]) -> None:
        t = self.opts.request_timeout_s
        mix = serve_tenants.TenantMix(
            self.tenant_plan, {n: HttpTarget(route, url, k, base, t) for n, k in tenant_keys.items()},
            HttpTarget(route, url, api_key, base, t), self.opts.client_processes(), api.metrics)
        for name in self.opts.mixes:
            mix.run(name, specs[name], warm[name][:self._warmup_count(16)],
                    lambda s: print(f"[bench serve] tenant mix {s}", file=sys.stderr))
            self.res["tenants"] = mix.report()
            report.write_json(self.res, self.out / "serve.json")

    def _load_adapters(self, api: ServerApi) -> list[str]:
        if self.opts.config_adapters:
            names = api.adapter_names()
            if not names:
                raise ConfigError("bench serve --config-adapters: the server lists no adapters")
            self.res["adapters"] = {"source": "config", "names": names}
            return names
        for name, path in self.adapter_dirs.items():
            if not api.load_adapter(name, path):
                print(f"[bench serve] adapter {name} was already loaded; using it", file=sys.stderr)
        self.res["adapters"] = {"source": "synthetic" if self.adapter_dirs else "none",
                                "count": len(self.adapter_dirs), "rank": self.opts.rank, "targets": self.opts.targets,
                                "dir": str(self.adapter_root) if self.adapter_root else None}
        return list(self.adapter_dirs)

    def _points(self) -> list[tuple[str, float]]:
        return [*(("closed", c) for c in self.opts.concurrency), *(("poisson", r) for r in self.opts.rate)]

    def _drive(self, make: Callable[[], Driver], specs: list[RequestSpec], warm: list[RequestSpec], load: str,
               x: float, desc: str,
               measuring: Optional[Callable[[], None]] = None) -> tuple[list[Result], float, float]:
        """The warm-up wave (not measured), `measuring()`, then the measured requests, in one event loop;
        `make` builds the driver inside it (an HTTP client belongs to the loop it first runs in).
        Returns the results, the wall time and this process's CPU time over the measured requests."""
        from tqdm import tqdm

        o = self.opts
        wave = int(x) if load == "closed" else 16
        arrivals = poisson_arrivals(len(specs), x, o.seed + 5) if load == "poisson" else []
        bar = tqdm(total=len(specs), desc=desc, disable=not o.progress, leave=False)

        async def both() -> tuple[list[Result], float, float]:
            send = make()
            try:
                await closed_loop(send, warm[:self._warmup_count(wave)], wave)
                if measuring is not None:
                    measuring()  # nothing in flight: a blocking call is fine here
                cpu0 = time.process_time()
                if load == "closed":
                    results, wall = await closed_loop(send, specs, int(x), lambda: bar.update(1))
                else:
                    results, wall = await open_loop(send, specs, arrivals, lambda: bar.update(1))
                return results, wall, time.process_time() - cpu0
            finally:
                await send.aclose()

        try:
            return asyncio.run(both())
        finally:
            bar.close()

    def _http_rows(self, api: ServerApi, route: str, base: str, specs: dict, warm: dict, url: str,
                   api_key: Optional[str], cold: Optional[ColdRows] = None) -> None:
        """One row per mix and load point; with `cold`, each row's extra requests run beside it and
        `cold.finish` files the row (serve_cold.py)."""
        target = HttpTarget(route, url, api_key, base, self.opts.request_timeout_s)
        procs = self.opts.client_processes()
        for mix in self.opts.mixes:
            for load, x in self._points():
                label = f"{mix} {load} {x:g}" + (f" {cold.label}" if cold is not None else "")
                before: dict[str, float] = {}

                def measuring() -> None:
                    before.update(counter_samples(api.metrics()))
                    if cold is not None:
                        cold.start()

                if procs > 1:
                    wave = int(x) if load == "closed" else 16
                    arrivals = (poisson_arrivals(len(specs[mix]), x, self.opts.seed + 5)
                                if load == "poisson" else None)
                    d = drive_processes(target, specs[mix], warm[mix][:self._warmup_count(wave)],
                                        int(x) if load == "closed" else None, arrivals, procs, measuring)
                    results, wall, util = d.results, d.wall_s, d.client_cpu_util
                else:
                    results, wall, cpu = self._drive(target.driver, specs[mix], warm[mix], load, x,
                                                     f"http {label}", measuring)
                    util = cpu / wall
                if cold is not None:
                    cold.wait()  # before the scrape: the row's counters include its extras' loads
                deltas = counter_deltas(before, counter_samples(api.metrics()))
                row = {"mix": mix, "load": load, "concurrency": int(x) if load == "closed" else None,
                       "rate_rps": x if load == "poisson" else None,
                       **summarize(results, wall, [s.output_len for s in specs[mix]]),
                       # Near 1: the busiest client process may be what limits the row, not the server.
                       "client_cpu_util": round(util, 3), "client_processes": procs,
                       "server": server_summary(deltas), "metrics_delta": deltas}
                if cold is None:
                    self.res["rows"].append(row)
                else:
                    cold.finish(row)
                report.write_json(self.res, self.out / "serve.json")
                print(f"[bench serve] {label}: {row['out_tok_s']} tok/s, failures {row['failures'] or 'none'}",
                      file=sys.stderr)

    def _in_process(self, route: str, specs: dict, warm: dict) -> None:
        from appliance.bench.serve_inproc import InProcessDriver

        print("[bench serve] the same closed-loop rows in process", file=sys.stderr)
        drv = InProcessDriver(self.cfg, chat=route == "chat")
        try:
            asyncio.run(drv.load(self.adapter_dirs))
            for row in self.res["rows"]:
                if row["load"] != "closed":
                    continue
                c, mix = row["concurrency"], row["mix"]
                results, wall, _ = self._drive(lambda: drv, specs[mix], warm[mix], "closed", c, f"in-process {mix} {c}")
                s = summarize(results, wall, [x.output_len for x in specs[mix]])
                row["in_process"] = {k: s[k] for k in ("requests", "ok", "failures", "wall_s", "req_s", "out_tok_s",
                                                       "ttft_ms", "itl_ms", "tpot_ms", "e2e_ms")}
                row["http_vs_in_process"] = round(row["out_tok_s"] / s["out_tok_s"], 4) if s["out_tok_s"] else None
                report.write_json(self.res, self.out / "serve.json")
        finally:
            drv.close()


def masked(overrides: Sequence[str]) -> list[str]:
    """`overrides` with literal key values replaced by *** (an interpolation such as ${oc.env:...} stays):
    what the report may show of server.api_keys / server.admin_key."""
    return [re.sub(r"(server\.(?:api_keys|admin_key)=)(?!\$\{)\S+", r"\1***", o) for o in overrides]


def run_serve_bench(config_dir: Optional[str], overrides: Sequence[str], opts: ServeOptions, keys: Keys,
                    command: str) -> int:
    return ServeBench(config_dir, overrides, opts, keys, command).run()
