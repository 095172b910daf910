"""The soak driver: concurrent clients over the base model and many adapters while adapters churn
through the admin API and through YAML hot reload at the same time. Used by tests/server/test_soak.py
(short) and benchmarks/soak.py (long). Loopback only; it stops by itself after `rounds` rounds of
`requests_per_client` requests per client.

Per round:
- `clients` threads each send `requests_per_client` requests: the base model or any adapter (loaded or
  not at that moment), streaming or not, /v1/completions or /generate; `disconnect_ratio` of the
  streams are closed by the client after the first chunk. Every request ends as exactly one of: ok
  (its greedy text equals its adapter's reference, computed alone with peft), disconnected, refused
  404 (the adapter is unloaded at that moment), or a failure (wrong text, any other status, a client
  error or a timeout: "lost or hung").
- An admin thread loads, unloads, pins, unpins and reloads in place (switching between two copies of
  the same weights) the adapters of set A through the admin API.
- A config thread edits adapters/soak.yaml (rename-saves: add, remove, pin, unpin, switch path) for
  set B; the server's watcher reconciles it (reconcile.prune is false, so that set A survives, and a
  name removed from the file stays loaded as documented). At the end of the round the adapters in
  the file must be live with the file's path and pin (a pin that found no slot free under load is
  retried by the periodic resync).
- With `attacks` on, an attacker thread sends tests/server/soak_attacks.py's mix (malformed Unicode and
  JSON, hostile adapters through the admin API, admin races on one name, config bombs and secrets in
  interpolations saved into the watched dir, label growth under adapter churn, never-ending chunked
  bodies, huge stop lists and batches): each must get its expected refusal, and the clients above
  must see none of it (they count any 429 or 5xx as a failure).
- When the traffic is done the server must go idle: no request in flight, zero KV blocks used, no
  slot running a request, nothing retiring. Then the process's RSS is recorded.
There are more adapters than GPU slots and than CPU-tier places, so slots and the CPU tier churn too.
"""

from __future__ import annotations

import json
import random
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import requests

from appliance.config.compose import compose_config
from appliance.reconcile.controller import ConfigSource
from tests.lora.test_lora_engine import NEW, make_adapter
from tests.reconcile.trees import KEY, inventory_yaml, rename_save, write_tree
from tests.server.conftest import ServerThread
from tests.server.soak_attacks import (ATTACK_INVENTORY, CLIENT_KEY, AttackCounts, Attacker, AttackSetup,
                                      label_problems)

PROMPTS = [[1, 504, 3458, 282, 4649, 314], [1, 7477, 2030, 253, 655]]
ADMIN = {"Authorization": f"Bearer {KEY}"}
BASE = "tiny"


@dataclass
class SoakConfig:
    rounds: int = 2
    clients: int = 6
    requests_per_client: int = 20
    adapters: int = 8  # half churned through the admin API (set A), half through the YAML (set B)
    slots: int = 3  # lora.max_loras_per_batch
    cpu_cache: int = 4  # lora.max_loaded_loras
    disconnect_ratio: float = 0.1
    seed: int = 0
    request_timeout_s: float = 120.0  # client side: a request taking longer counts as hung
    attacks: bool = True  # the attacker thread (tests/server/soak_attacks.py) beside the clients
    body_timeout_s: float = 3.0  # server.body_timeout_s: how long a never-ending body holds its socket

    @property
    def max_concurrent(self) -> int:
        """server.max_concurrent_requests: room for the clients and the attacker, not for the
        attacker's never-ending bodies on top."""
        return self.clients + 4


@dataclass
class Counts:
    ok: int = 0
    disconnected: int = 0
    refused_404: int = 0
    failures: list[str] = field(default_factory=list)
    admin_ops: int = 0
    admin_refusals: int = 0  # pin refused with 409/400 (no slot free / limit): expected under load
    config_edits: int = 0
    by_route: dict[str, int] = field(default_factory=dict)
    attacks: AttackCounts = field(default_factory=AttackCounts)

    @property
    def requests(self) -> int:
        return self.ok + self.disconnected + self.refused_404 + len(self.failures)


@dataclass
class RoundReport:
    index: int
    requests: int
    ok: int
    disconnected: int
    refused_404: int
    failures: int
    admin_ops: int
    config_edits: int
    rss_mib: float
    seconds: float


@dataclass
class SoakReport:
    config: SoakConfig
    rounds: list[RoundReport]
    counts: Counts
    peak_rss_mib: float
    idle_checks: list[str]  # problems found when idle (empty = fine)

    def summary(self) -> str:
        c = self.counts
        rss = ", ".join(f"{r.rss_mib:.0f}" for r in self.rounds)
        a = c.attacks
        attacks = (f"; {sum(a.refused.values())} attacks refused as expected "
                   f"({', '.join(f'{k} {v}' for k, v in sorted(a.refused.items()))}), {len(a.failures)} not"
                   if self.config.attacks else "")
        return (f"{c.requests} requests ({c.ok} ok, {c.disconnected} disconnected, {c.refused_404} 404 while "
                f"unloaded, {len(c.failures)} failed); {c.admin_ops} admin operations "
                f"({c.admin_refusals} pins refused), {c.config_edits} config edits; RSS after each round "
                f"[{rss}] MiB, peak {self.peak_rss_mib:.0f} MiB{attacks}")


def rss_mib() -> tuple[float, float]:
    """(current, peak) resident set size of this process in MiB."""
    vals = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        k, _, v = line.partition(":")
        if k in ("VmRSS", "VmHWM"):
            vals[k] = int(v.split()[0]) / 1024
    return vals["VmRSS"], vals["VmHWM"]


def references(model: Path, adapters: dict[str, Path]) -> dict[Optional[str], list[list[int]]]:
    """peft's greedy tokens for each prompt, for the base model (None) and each adapter alone; the base
    model is loaded once and each adapter put on and taken off it (peft's unload restores it)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()

    def greedy(m: torch.nn.Module) -> list[list[int]]:
        with torch.no_grad():
            return [m.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(ids):].tolist() for ids in PROMPTS]

    refs: dict[Optional[str], list[list[int]]] = {None: greedy(base)}
    for name, d in adapters.items():
        m = PeftModel.from_pretrained(base, d).eval()
        refs[name] = greedy(m)
        base = m.unload()
    assert greedy(base) == refs[None], "peft's unload did not restore the base model"
    return refs


class SoakSetup:
    """Adapters (made with peft), their references, and a config tree, under `work`."""

    def __init__(self, work: Path, model: Path, cfg: SoakConfig) -> None:
        self.cfg, self.model = cfg, model
        self.root = work / "adapters"
        self.names = [f"a{i}" for i in range(cfg.adapters)]
        self.set_a = self.names[: cfg.adapters // 2]
        self.set_b = self.names[cfg.adapters // 2:]
        for i, name in enumerate(self.names):
            d = make_adapter(model, self.root / name, seed=100 + i, r=4 + 2 * (i % 3), lora_alpha=16,
                             target_modules=["q_proj", "v_proj", "o_proj", "down_proj"][: 2 + i % 3])
            shutil.copytree(d, self.root / f"{name}-v2")  # same weights: a reload in place must not change answers
        self.refs = references(model, {n: self.root / n for n in self.names})
        distinct = {tuple(r[0]) for r in self.refs.values()}
        assert len(distinct) >= len(self.refs) - 2, "adapters barely change the output: the checks would be weak"
        self.attack = AttackSetup(self.root, self.root / self.names[0]) if cfg.attacks else None
        self.inventory: dict[str, dict] = {n: {"path": self.root / n} for n in self.set_b[:2]}
        self.pinned_in_file: set[str] = set()  # set B names pinned by the file at some point (never removed)
        inventories = {"soak": self.inventory, **({ATTACK_INVENTORY: {}} if cfg.attacks else {})}
        self.tree = write_tree(work / "configs", model, self.root, inventories, max_rank=8,
                               slots=cfg.slots, watch=True, resync_s=2, prune="none")
        text = (self.tree / "config.yaml").read_text()
        text = text.replace(f"  max_loras_per_batch: {cfg.slots}\n",
                            f"  max_loras_per_batch: {cfg.slots}\n  max_loaded_loras: {cfg.cpu_cache}\n")
        text = text.replace("  name: tiny\n", "  name: tiny\n  max_model_len: 256\n  device: cpu\n")
        text = text.replace(f"  admin_key: {KEY}\n", f"  admin_key: {KEY}\n  log_level: warning\n  api_keys: [{CLIENT_KEY}]\n"
                            f"  max_concurrent_requests: {cfg.max_concurrent}\n  body_timeout_s: {cfg.body_timeout_s}\n")
        text += "engine:\n  num_kv_blocks: 256\n  max_num_seqs: 16\n"
        # Fewer label values than adapters: the churn must end in `other`, never in more series.
        text += f"metrics:\n  max_adapter_labels: {self.max_labels}\n"
        (self.tree / "config.yaml").write_text(text)

    @property
    def max_labels(self) -> int:
        return self.cfg.adapters // 2

    def start_server(self) -> ServerThread:
        overrides = ("server.port=0",)
        return ServerThread(compose_config(self.tree, list(overrides)), ConfigSource(self.tree, overrides)).start()


class Soak:
    def __init__(self, setup: SoakSetup, srv: ServerThread) -> None:
        self.s, self.srv, self.cfg = setup, srv, setup.cfg
        self.counts = Counts()
        self._lock = threading.Lock()
        self._traffic_done = threading.Event()
        self.tok = srv.engine.tokenizer
        self.attacker = None if setup.attack is None else Attacker(
            srv.url, ADMIN, setup.tree, setup.attack, {n: setup.root / n for n in setup.names}, setup.refs, PROMPTS,
            NEW, self.cfg.max_concurrent, self.counts.attacks, self.cfg.seed)

    # ------------------------------------------------------------------ the run
    def run(self, on_round: Optional[Callable[[RoundReport], None]] = None) -> SoakReport:
        for name in self.s.set_a:  # set A starts loaded; the admin thread takes it from there
            r = requests.post(self.srv.url + "/load_lora_adapter", headers=ADMIN, timeout=60,
                              json={"lora_name": name, "lora_path": str(self.s.root / name)})
            assert r.status_code == 200, r.text
        rounds, idle_problems, peak = [], [], 0.0
        for i in range(self.cfg.rounds):
            before = self._snapshot_counts()
            t0 = time.monotonic()
            self._traffic_done.clear()
            workers = [threading.Thread(target=self._client, args=(i, c), daemon=True)
                       for c in range(self.cfg.clients)]
            churners = [threading.Thread(target=self._admin_churn, args=(i,), name="admin-churn", daemon=True),
                        threading.Thread(target=self._config_churn, args=(i,), name="config-churn", daemon=True)]
            if self.attacker is not None:
                churners.append(threading.Thread(target=self.attacker.run_round, args=(i, self._traffic_done),
                                                 name="attacker", daemon=True))
            for t in workers + churners:
                t.start()
            for t in workers:
                t.join(self.cfg.request_timeout_s * self.cfg.requests_per_client)
                if t.is_alive():
                    self._fail(f"round {i}: a client thread never finished")
            self._traffic_done.set()
            for t in churners:
                t.join(300)
                if t.is_alive():
                    self._fail(f"round {i}: the {t.name} thread never finished")
            self._converge_config(i)
            if self.attacker is not None:
                self.counts.attacks.failures += [f"round {i}: {p}" for p in label_problems(
                    self.srv.url, set(self.s.names) | {"race"}, self.s.max_labels, self.attacker.churned)]
            idle_problems += [f"round {i}: {p}" for p in self.idle_problems()]
            cur, peak = rss_mib()
            c = self.counts
            r = RoundReport(i, c.requests - before[0], c.ok - before[1], c.disconnected - before[2],
                            c.refused_404 - before[3], len(c.failures) - before[4], c.admin_ops - before[5],
                            c.config_edits - before[6], cur, time.monotonic() - t0)
            rounds.append(r)
            if on_round is not None:
                on_round(r)
        if self.attacker is not None:
            self.attacker.close()
        return SoakReport(self.cfg, rounds, self.counts, peak, idle_problems)

    def _snapshot_counts(self) -> tuple[int, ...]:
        c = self.counts
        return (c.requests, c.ok, c.disconnected, c.refused_404, len(c.failures), c.admin_ops, c.config_edits)

    def _fail(self, why: str) -> None:
        with self._lock:
            self.counts.failures.append(why)

    def _count(self, attr: str, route: Optional[str] = None) -> None:
        with self._lock:
            setattr(self.counts, attr, getattr(self.counts, attr) + 1)
            if route is not None:
                self.counts.by_route[route] = self.counts.by_route.get(route, 0) + 1

    # ------------------------------------------------------------------ clients
    def _client(self, rnd: int, c: int) -> None:
        rng = random.Random(f"{self.cfg.seed}-{rnd}-{c}")
        session = requests.Session()
        session.headers["Authorization"] = f"Bearer {CLIENT_KEY}"  # unscoped: the tenants attack's tenant is not us
        for _ in range(self.cfg.requests_per_client):
            adapter = rng.choice([None, None, *self.s.names])
            p = rng.randrange(len(PROMPTS))
            kind = rng.choice(["completion", "stream", "generate"])
            disconnect = kind == "stream" and rng.random() < self.cfg.disconnect_ratio * 3  # 1/3 are streams
            what = f"{kind} {adapter or 'base'} p{p}"
            try:
                self._one(session, adapter, p, kind, disconnect, what)
            except requests.RequestException as e:
                self._fail(f"{what}: lost or hung: {type(e).__name__}: {e}")

    def _one(self, session: requests.Session, adapter: Optional[str], p: int, kind: str, disconnect: bool,
             what: str) -> None:
        url, timeout = self.srv.url, self.cfg.request_timeout_s
        want = self.tok.decode(self.s.refs[adapter][p])
        if kind == "generate":
            body = {"input_ids": PROMPTS[p], "sampling_params": {"max_new_tokens": NEW, "temperature": 0,
                                                                 "ignore_eos": True}}
            if adapter is not None:
                body["lora_path"] = adapter
            r = session.post(url + "/generate", json=body, timeout=timeout)
            if self._refused(r, what):
                return
            return self._check(r.json()["output_ids"] == self.s.refs[adapter][p], what, "generate")
        body = {"model": adapter or BASE, "prompt": PROMPTS[p], "max_tokens": NEW, "temperature": 0,
                "ignore_eos": True, "stream": kind == "stream"}
        if kind == "completion":
            r = session.post(url + "/v1/completions", json=body, timeout=timeout)
            if self._refused(r, what):
                return
            return self._check(r.json()["choices"][0]["text"] == want, what, "completion")
        with session.post(url + "/v1/completions", json=body, timeout=timeout, stream=True) as r:
            if self._refused(r, what):
                return
            text, done = "", False
            for line in r.iter_lines():
                if not line:
                    continue
                data = line.decode().removeprefix("data: ")
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    return self._fail(f"{what}: stream error event {event['error']}")
                text += event["choices"][0]["text"]
                if disconnect:
                    break  # leaving the `with` closes the connection mid-stream
            if disconnect and not done:
                return self._count("disconnected", "stream-disconnect")
        self._check(done and text == want, what, "stream")

    def _refused(self, r: requests.Response, what: str) -> bool:
        if r.status_code == 200:
            return False
        try:
            err = r.json()["error"]
        except (ValueError, KeyError):
            self._fail(f"{what}: {r.status_code} without the OpenAI error shape: {r.text[:200]}")
            return True
        if r.status_code == 404 and err.get("code") == "model_not_found":
            self._count("refused_404")
        else:
            self._fail(f"{what}: {r.status_code} {err}")
        return True

    def _check(self, ok: bool, what: str, route: str) -> None:
        if ok:
            self._count("ok", route)
        else:
            self._fail(f"{what}: answer differs from the adapter's reference")

    # ------------------------------------------------------------------ admin churn (set A)
    def _admin_churn(self, rnd: int) -> None:
        rng = random.Random(f"{self.cfg.seed}-admin-{rnd}")
        session = requests.Session()
        while not self._traffic_done.is_set():
            live = self._live(session)
            name = rng.choice(self.s.set_a)
            a = live.get(name)
            pinned_a = [n for n in self.s.set_a if live.get(n, {}).get("pinned")]
            if a is None:
                op, body = "load", {"lora_name": name, "lora_path": str(self.s.root / rng.choice([name, f"{name}-v2"]))}
                route = "/load_lora_adapter"
            else:
                op = rng.choice(["unload", "reload", "reload", "pin", "unpin"])
                if op == "pin" and (a["pinned"] or pinned_a):
                    op = "unpin" if a["pinned"] else "reload"  # admin pins at most one at a time
                if op == "unpin" and not a["pinned"]:
                    op = "unload"
                if op == "unload":
                    route, body = "/unload_lora_adapter", {"lora_name": name}
                elif op == "reload":
                    other = f"{name}-v2" if not a["path"].endswith("-v2") else name
                    route, body = "/load_lora_adapter", {"lora_name": name, "lora_path": str(self.s.root / other),
                                                         "load_inplace": True, "pinned": a["pinned"]}
                else:
                    route, body = "/pin_lora_adapter", {"lora_name": name, "pinned": op == "pin"}
            try:
                r = session.post(self.srv.url + route, json=body, headers=ADMIN, timeout=60)
            except requests.RequestException as e:
                self._fail(f"admin {op} {name}: {type(e).__name__}: {e}")
                continue
            self._count("admin_ops")
            if r.status_code != 200:
                if op in ("pin", "reload") and r.status_code in (400, 409) and "pin" in r.text:
                    self._count("admin_refusals")  # no slot free to pin right now, or the pin limit
                else:
                    self._fail(f"admin {op} {name}: {r.status_code} {r.text[:200]}")
            time.sleep(rng.uniform(0.02, 0.15))

    def _live(self, session: requests.Session) -> dict[str, dict]:
        r = session.get(self.srv.url + "/v1/adapters", headers=ADMIN, timeout=60)
        return {a["name"]: a for a in r.json()["data"]}

    # ------------------------------------------------------------------ config churn (set B)
    def _config_churn(self, rnd: int) -> None:
        rng = random.Random(f"{self.cfg.seed}-config-{rnd}")
        inv = self.s.tree / "adapters" / "soak.yaml"
        while not self._traffic_done.is_set():
            name = rng.choice(self.s.set_b)
            cur = self.s.inventory.get(name)
            if cur is None:
                self.s.inventory[name] = {"path": self.s.root / rng.choice([name, f"{name}-v2"])}
            else:
                op = rng.choice(["remove", "path", "path", "pin"])
                # With reconcile.prune off a name taken out of the file stays loaded as it was, pinned
                # too if its unpin had not been applied yet. Such a stray pin plus the config's next pin
                # plus the admin thread's would pass the pin limit (2 of 3 slots), and set B would never
                # converge: a name ever pinned since it was added stays in the file.
                if op == "remove" and name in self.s.pinned_in_file:
                    op = "pin"
                if op == "remove":
                    del self.s.inventory[name]
                elif op == "path":
                    cur["path"] = self.s.root / (f"{name}-v2" if not str(cur["path"]).endswith("-v2") else name)
                elif cur.get("pinned"):
                    cur["pinned"] = False
                elif not any(a.get("pinned") for a in self.s.inventory.values()):
                    cur["pinned"] = True  # the config pins at most one at a time
                    self.s.pinned_in_file.add(name)
            rename_save(inv, inventory_yaml(self.s.inventory))
            self._count("config_edits")
            time.sleep(rng.uniform(0.3, 0.8))

    def _converge_config(self, rnd: int, timeout_s: float = 60.0) -> None:
        """After the traffic: the live set B must reach the last file written (the resync retries a pin
        that found no slot free under load)."""
        want = {n: (str(Path(a["path"]).resolve()), bool(a.get("pinned"))) for n, a in self.s.inventory.items()}
        session = requests.Session()
        deadline = time.monotonic() + timeout_s
        while True:
            live = self._live(session)
            # reconcile.prune is false (set A is loaded behind the config's back), so a name taken out
            # of the file stays loaded as it was: only the names in the file are compared.
            got = {n: (a["path"], a["pinned"]) for n, a in live.items() if n in want}
            if got == want:
                return
            if time.monotonic() > deadline:
                return self._fail(f"round {rnd}: config set B never converged: live {got}, file {want}")
            time.sleep(0.1)

    # ------------------------------------------------------------------ idle state
    def idle_problems(self) -> list[str]:
        """What is not back to zero once no request runs."""
        if not self.srv.wait_idle(60):
            return [f"{self.srv.engine.num_in_flight} request(s) still in flight after the traffic"]
        e = self.srv.engine.engine
        out = []
        if e.block_manager.num_used:
            out.append(f"{e.block_manager.num_used} KV blocks still used")
        if e.seqs or e.has_unfinished():
            out.append(f"the engine still tracks {len(e.seqs)} sequence(s)")
        if set(e.lora.keys) != set(e.lora.current.values()):
            out.append(f"adapter keys without a name: {sorted(set(e.lora.keys) - set(e.lora.current.values()))}")
        busy = [(r.name, r.running) for r in e.lora.pool.residents() if r.running]
        if busy:
            out.append(f"slots still running requests: {busy}")
        state = requests.get(self.srv.url + "/v1/adapters", headers=ADMIN, timeout=60).json()
        if state["retiring"]:
            out.append(f"weights still retiring: {state['retiring']}")
        if any(a["in_flight"] for a in state["data"]):
            out.append(f"adapters with requests in flight: {[a['name'] for a in state['data'] if a['in_flight']]}")
        return out


def has_metrics() -> bool:
    """Whether this checkout has appliance/telemetry/metrics.py. Not importlib.util.find_spec: an editable install
    of another checkout in the same venv answers for a module this one lacks."""
    import appliance

    return (Path(appliance.__file__).parent / "telemetry" / "metrics.py").is_file()


def metrics_problems(url: str, counts: Counts) -> list[str]:
    """Compare the server's request counters (appliance.telemetry.metrics, GET /metrics) with the client's counts.

    Every request that reached the engine finished exactly once: completed ones with stop or length,
    a disconnected one with abort (or with length, when it had finished before the abort arrived).
    The attacker's requests on adapters it loaded count too (`served`); 404s and the attacks' refusals
    never reach the engine; the references ran in peft, not on the server.
    """
    from prometheus_client.parser import text_string_to_metric_families

    r = requests.get(url + "/metrics", timeout=30)
    if r.status_code != 200:
        return [f"GET /metrics answered {r.status_code}"]
    finished: dict[str, float] = {}
    for fam in text_string_to_metric_families(r.text):
        for sample in fam.samples:
            if sample.name == "appliance_requests_total":
                reason = sample.labels["finish_reason"]
                finished[reason] = finished.get(reason, 0) + sample.value
    out = []
    reached = counts.ok + counts.disconnected + counts.attacks.served
    if sum(finished.values()) != reached:
        out.append(f"appliance_requests_total sums to {sum(finished.values())}, the clients saw {reached} "
                   f"requests reach the engine ({finished})")
    if finished.get("stop", 0) + finished.get("length", 0) < counts.ok + counts.attacks.served:
        out.append(f"fewer stop+length finishes than ok answers ({counts.ok}): {finished}")
    if finished.get("abort", 0) > counts.disconnected:
        out.append(f"more aborts than disconnects ({counts.disconnected}): {finished}")
    if finished.get("error", 0):
        out.append(f"{finished['error']} request(s) finished with error")
    return out
