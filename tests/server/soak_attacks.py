"""The soak's attack mix (issue 29): hostile clients and a careless operator beside the normal clients.

One attacker thread per round runs the attack classes below in turn, each a few times over its
variants, while the soak's clients and churners run (tests/server/soak.py). Every attack must get
its expected refusal (status, error code, message), asserted here; a wrong answer is recorded as an
attack failure. The normal clients must see nothing of it: no 429, no 5xx, no wrong text.

- unicode: an unpaired surrogate escape in a prompt, chat content, /generate text, `model`,
  `lora_path`, an admin name, an unknown field's name: 400 "not valid Unicode text";
- json: truncated, 100,000 deep, NaN literals, invalid UTF-8, not an object: 400;
- stop_list: 10,000 stop strings, or one of a megabyte: 400 naming `stop`;
- big_batch: a /generate of 1,000 prompts: 400 naming the prompt field;
- hostile_adapter: NaN/Inf weights, an overflowing alpha, a nested or sparse 2 GiB config, bytes past
  the tensors, 10,000 rank_pattern keys, a backtracking key, weights that contradict the base model,
  loaded through the admin API (pinned or not): 400 invalid_adapter, never registered;
- admin_race: loads, in-place reloads and unloads of one name at once: each 200 or its 404/409, and
  the name ends loaded with one of the paths sent (answering as that path's weights) or not at all;
- label_churn: fresh adapter names loaded, served once and unloaded, and a model name shaped like a
  metric line: the `adapter` label stays within metrics.max_adapter_labels (checked after each round);
- endless_bodies: more never-ending chunked bodies than server.max_concurrent_requests: each 408
  after server.body_timeout_s, while the clients keep their slots;
- config_bomb: an alias bomb, or a file over 1 MiB, saved into the watched config dir: ConfigValid
  False naming the file, the admin API answering meanwhile, valid again once the file is restored;
- env_secret: an adapter path written as ${oc.env:VAR} in the watched config: the failed load shows
  `<from env VAR>`, the value is in no answer and no log record;
- tenants: a tenant written into the watched tenants file with a fresh key (a sha256 digest) and
  fresh random limits floods the server at several times its rate: every answer is 200 with the
  right text or 429 with Retry-After, the 200s never exceed burst + rate x time, another adapter
  answers as a nonexistent one; then the key rotates (the old one gets 401) and the file empties.
  The normal clients carry one of server.api_keys (unscoped) and see none of it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import secrets
import shutil
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import requests

from tests.reconcile.test_config_bombs import ALIAS_BOMB
from tests.server.test_adapter_attacks import ATTACKS as ADAPTER_DAMAGE
from tests.server.test_hostile_input import NESTED, with_surrogate

ATTACK_CLASSES = ("unicode", "json", "stop_list", "big_batch", "hostile_adapter", "admin_race", "label_churn",
                  "endless_bodies", "config_bomb", "env_secret", "tenants")
# The normal clients' key (server.api_keys): unscoped, so tenants written by the attack touch them not.
CLIENT_KEY = "soak-client-key"
SECRET_VAR = "APPLIANCE_SOAK_SECRET"
ATTACK_INVENTORY = "attack"  # adapters/attack.yaml: the config attacks' file, `{}` between attacks


@dataclass
class AttackCounts:
    refused: dict[str, int] = field(default_factory=dict)  # class -> attacks answered as expected
    failures: list[str] = field(default_factory=list)
    served: int = 0  # the attacker's own well-formed requests that reached the engine (the metrics check)


class AttackSetup:
    """The attack material made once: damaged copies of an adapter under the roots, and the secret."""

    def __init__(self, root: Path, template: Path) -> None:
        from tests.lora.test_adapter_hardening import wrong_shape_copy

        self.hostile: dict[str, tuple[Path, str]] = {}
        for kind, (damage, needle) in ADAPTER_DAMAGE.items():
            d = Path(shutil.copytree(template, root / f"hostile-{kind}"))
            damage(d)
            self.hostile[kind] = (d, needle)
        d = Path(shutil.copytree(template, root / "hostile-wrong_shape"))
        wrong_shape_copy(d, d / "adapter_model.safetensors")
        self.hostile["wrong_shape"] = (d, "do not fit this base model")
        # A path outside the roots: its load fails, so every reconcile retries it and reports it.
        self.secret = f"/soak-secret-{secrets.token_hex(8)}"
        os.environ[SECRET_VAR] = self.secret


class _SecretLog(logging.Handler):
    """Records any log record whose text holds the secret (at the server's log level)."""

    def __init__(self, secret: str) -> None:
        super().__init__(logging.DEBUG)
        self.secret, self.leaks = secret, []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage() + (logging.Formatter().formatException(record.exc_info) if record.exc_info else "")
        if self.secret in text:
            self.leaks.append(f"{record.name}: {text[:200]}")


class Attacker:
    """Runs the attack classes in turn against `url`; `admin` holds the admin headers, `tree` the
    watched config dir, `adapters` the normal adapters (name -> dir) and `refs` their answers."""

    def __init__(self, url: str, admin: dict[str, str], tree: Path, setup: AttackSetup, adapters: dict[str, Path],
                 refs: dict[Optional[str], list[list[int]]], prompts: list[list[int]], new_tokens: int,
                 max_concurrent: int, counts: AttackCounts, seed: int) -> None:
        self.url, self.admin, self.tree, self.s = url, admin, tree, setup
        self.adapters, self.refs, self.prompts, self.new = adapters, refs, prompts, new_tokens
        self.max_concurrent, self.counts, self.seed = max_concurrent, counts, seed
        self.session = requests.Session()
        self.session.headers["Authorization"] = f"Bearer {CLIENT_KEY}"
        self.churned: list[str] = []  # label_churn's names, in order
        self.ran: set[str] = set()  # attack classes run so far (every one runs in the first round)
        self._lock = threading.Lock()
        self._log = _SecretLog(setup.secret)
        logging.getLogger().addHandler(self._log)

    def close(self) -> None:
        logging.getLogger().removeHandler(self._log)

    # ------------------------------------------------------------------ driving
    def run_round(self, rnd: int, done: threading.Event) -> None:
        """Attack classes in turn until `done`; the first round goes on until each class ran once."""
        rng = random.Random(f"{self.seed}-attack-{rnd}")
        i = rnd  # later rounds start elsewhere in the cycle
        while not done.is_set() or len(self.ran) < len(ATTACK_CLASSES):
            cls = ATTACK_CLASSES[i % len(ATTACK_CLASSES)]
            try:
                getattr(self, f"_{cls}")(rng)
            except (requests.RequestException, OSError, ValueError, AssertionError) as e:
                self._fail(cls, f"{type(e).__name__}: {e}")
            self.ran.add(cls)
            i += 1
        for leak in self._log.leaks:
            self._fail("env_secret", f"the secret's value was logged: {leak}")
        self._log.leaks.clear()

    def _fail(self, cls: str, why: str) -> None:
        with self._lock:
            self.counts.failures.append(f"attack {cls}: {why}")

    def _ok(self, cls: str) -> None:
        with self._lock:
            self.counts.refused[cls] = self.counts.refused.get(cls, 0) + 1

    def _post(self, path: str, body: Any = None, raw: Optional[bytes] = None, admin: bool = False,
              timeout: float = 120) -> requests.Response:
        headers = {"Content-Type": "application/json", **(self.admin if admin else {})}
        data = raw if raw is not None else json.dumps(body).encode()
        return self.session.post(self.url + path, data=data, headers=headers, timeout=timeout)

    def _expect(self, cls: str, what: str, r: requests.Response, status: int | tuple[int, ...],
                needle: str = "", param: Optional[str] = "-", code: Optional[str] = None) -> bool:
        """Whether `r` is the refusal wanted: status, the OpenAI error shape, and its fields."""
        statuses = (status,) if isinstance(status, int) else status
        try:
            err = r.json()["error"]
            shaped = set(err) == {"message", "type", "param", "code"}
        except (ValueError, KeyError, TypeError):
            err, shaped = {}, False
        problems = []
        if r.status_code not in statuses:
            problems.append(f"status {r.status_code}, wanted {statuses}")
        if not shaped:
            problems.append("not the OpenAI error shape")
        elif needle not in err["message"] or (param != "-" and err["param"] != param) or \
                (code is not None and err["code"] != code):
            problems.append(f"wanted param {param!r} code {code!r} and {needle!r} in the message")
        if problems:
            self._fail(cls, f"{what}: {'; '.join(problems)}: {r.text[:300]}")
            return False
        self._ok(cls)
        return True

    # ------------------------------------------------------------------ request bodies
    def _unicode(self, rng: random.Random) -> None:
        name = rng.choice(sorted(self.adapters))
        prompt = {"model": "tiny", "prompt": "hi", "max_tokens": 1}
        cases = [
            ("/v1/completions", with_surrogate(prompt, "prompt"), False, "prompt"),
            ("/v1/completions", with_surrogate(prompt, "model"), False, "model"),
            ("/v1/chat/completions", with_surrogate({"model": "tiny", "max_tokens": 1, "messages": [
                {"role": "user", "content": "hi"}]}, "messages", 0, "content"), False, "messages[0].content"),
            ("/generate", with_surrogate({"text": "hi", "sampling_params": {"max_new_tokens": 1}}, "text"), False,
             "text"),
            ("/generate", with_surrogate({"text": "hi", "lora_path": name}, "lora_path"), False, "lora_path"),
            ("/v1/completions", json.dumps(prompt)[:-1] + ', "\\ud800": 1}', False, None),
            ("/load_lora_adapter", with_surrogate({"lora_name": "n", "lora_path": str(self.adapters[name])},
                                                  "lora_name"), True, "lora_name"),
            ("/load_lora_adapter", with_surrogate({"lora_name": "n", "lora_path": "/x"}, "lora_path"), True,
             "lora_path"),
        ]
        for path, raw, admin, param in rng.sample(cases, 3):
            self._expect("unicode", f"{path} {raw[:60]}", self._post(path, raw=raw.encode(), admin=admin), 400,
                         "not valid Unicode text", param)

    def _json(self, rng: random.Random) -> None:
        cases = [b'{"model": "tiny", "prompt": "hi"', NESTED["arrays"].encode(), NESTED["objects"].encode(),
                 b'{"model": "tiny", "prompt": "hi", "temperature": NaN}', b'{"model": "\xff\xfe"}', b"[1, 2]",
                 b'{"model": "tiny", "prompt": "hi", "max_tokens": Infinity}', b""]
        for raw in rng.sample(cases, 3):
            path = rng.choice(["/v1/completions", "/v1/chat/completions", "/generate"])
            self._expect("json", f"{path} {raw[:40]!r}", self._post(path, raw=raw), 400, "request body")

    def _stop_list(self, rng: random.Random) -> None:
        stop = rng.choice([[f"s{i}" for i in range(10_000)], ["x" * 1_000_000], ["ab"] * 17])
        if rng.random() < 0.5:
            r = self._post("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 4, "stop": stop})
            self._expect("stop_list", "completions", r, 400, "server.max_stop_", "stop")
        else:
            r = self._post("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 4, "stop": stop}})
            self._expect("stop_list", "generate", r, 400, "server.max_stop_", "sampling_params.stop")

    def _big_batch(self, rng: random.Random) -> None:
        if rng.random() < 0.5:
            body, param = {"input_ids": [self.prompts[0]] * 1000, "sampling_params": {"max_new_tokens": 4}}, \
                "input_ids"
        else:
            body, param = {"text": ["hi"] * 1000, "sampling_params": {"max_new_tokens": 4}}, "text"
        self._expect("big_batch", param, self._post("/generate", body), 400, "server.max_prompts_per_request",
                     param)

    # ------------------------------------------------------------------ adapters and the admin API
    def _hostile_adapter(self, rng: random.Random) -> None:
        for kind in rng.sample(sorted(self.s.hostile), 2):
            d, needle = self.s.hostile[kind]
            r = self._post("/load_lora_adapter", {"lora_name": "hostile", "lora_path": str(d),
                                                  "pinned": rng.random() < 0.5}, admin=True)
            self._expect("hostile_adapter", kind, r, 400, needle, "lora_path", "invalid_adapter")
        if "hostile" in self._live():
            self._fail("hostile_adapter", "a refused adapter is registered")

    def _admin_race(self, rng: random.Random) -> None:
        a, b = rng.sample(sorted(self.adapters), 2)
        ops = [("load", a), ("load", b), ("inplace", a), ("inplace", b), ("unload", None), ("unload", None)]
        rng.shuffle(ops)
        wanted = {"load": (200, 409), "inplace": (200, 404), "unload": (200, 404)}
        answers: list[tuple[str, requests.Response]] = []
        barrier = threading.Barrier(len(ops))

        def one(op: str, src: Optional[str]) -> None:
            s = requests.Session()
            barrier.wait(30)
            if op == "unload":
                r = s.post(self.url + "/unload_lora_adapter", headers=self.admin, json={"lora_name": "race"},
                           timeout=120)
            else:
                r = s.post(self.url + "/load_lora_adapter", headers=self.admin, timeout=120,
                           json={"lora_name": "race", "lora_path": str(self.adapters[src]),
                                 "load_inplace": op == "inplace"})
            answers.append((op, r))

        threads = [threading.Thread(target=one, args=op, daemon=True) for op in ops]
        for t in threads:
            t.start()
        for t in threads:
            t.join(150)
        for op, r in answers:
            if r.status_code not in wanted[op] or (r.status_code != 200 and "error" not in r.json()):
                self._fail("admin_race", f"{op}: {r.status_code} {r.text[:200]}")
        if len(answers) != len(ops):
            self._fail("admin_race", f"{len(ops) - len(answers)} admin call(s) never answered")
        live = self._live().get("race")
        if live is not None:
            src = next((n for n, d in self.adapters.items() if str(d.resolve()) == live["path"]), None)
            if src is None:
                self._fail("admin_race", f"'race' ended on a path nobody sent: {live['path']}")
            else:
                self._served(rng, "race", src, "admin_race")
            r = self._post("/unload_lora_adapter", {"lora_name": "race"}, admin=True)
            if r.status_code != 200:
                self._fail("admin_race", f"final unload: {r.status_code} {r.text[:200]}")
        self._ok("admin_race")

    def _label_churn(self, rng: random.Random) -> None:
        name = f"churn{len(self.churned)}"
        src = rng.choice(sorted(self.adapters))
        self.churned.append(name)
        r = self._post("/load_lora_adapter", {"lora_name": name, "lora_path": str(self.adapters[src])}, admin=True)
        if r.status_code != 200:
            return self._fail("label_churn", f"load {name}: {r.status_code} {r.text[:200]}")
        served = self._served(rng, name, src, "label_churn")
        r2 = self._post("/unload_lora_adapter", {"lora_name": name}, admin=True)
        if r2.status_code != 200:
            return self._fail("label_churn", f"unload {name}: {r2.status_code} {r2.text[:200]}")
        r3 = self._post("/v1/completions", {"model": "x\nfake_metric 1", "prompt": "hi", "max_tokens": 1})
        if served:
            self._expect("label_churn", "a model named like a metric line", r3, 404, "", "model", "model_not_found")

    def _served(self, rng: random.Random, name: str, src: str, cls: str) -> bool:
        """One greedy request on `name` (loaded from `src`'s dir) must answer as `src` does."""
        p = rng.randrange(len(self.prompts))
        r = self._post("/generate", {"input_ids": self.prompts[p], "lora_path": name, "sampling_params": {
            "max_new_tokens": self.new, "temperature": 0, "ignore_eos": True}})
        if r.status_code != 200:
            # Another attacker op may have unloaded it (the race): a 404 is fine, nothing reached the engine.
            if not (cls == "admin_race" and r.status_code == 404):
                self._fail(cls, f"request on {name}: {r.status_code} {r.text[:200]}")
            return False
        with self._lock:
            self.counts.served += 1
        if r.json()["output_ids"] != self.refs[src][p]:
            self._fail(cls, f"{name} (loaded from {src}) answered {r.json()['output_ids']}, not {src}'s reference")
            return False
        return True

    def _live(self) -> dict[str, dict]:
        r = self.session.get(self.url + "/v1/adapters", headers=self.admin, timeout=60)
        return {a["name"]: a for a in r.json()["data"]}

    # ------------------------------------------------------------------ connections
    def _endless_bodies(self, rng: random.Random) -> None:
        """More unfinished bodies than concurrency slots; each is answered 408, and the clients (which
        count any 429 as a failure) go on meanwhile."""
        host, port = self.url.removeprefix("http://").split(":")
        socks = []
        for _ in range(self.max_concurrent + 2):
            s = socket.create_connection((host, int(port)), timeout=60)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Authorization: Bearer " + CLIENT_KEY.encode() + b"\r\n"
                      b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"mod\r\n")
            socks.append(s)
        for s in socks:
            data = b""
            try:
                while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
                    chunk = s.recv(65536)
                    if not chunk:
                        break
                    data += chunk
            finally:
                s.close()
            head, _, body = data.partition(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 408") or b"server.body_timeout_s" not in body:
                return self._fail("endless_bodies", f"an unfinished body got {data[:200]!r}")
        self._ok("endless_bodies")

    # ------------------------------------------------------------------ the watched config
    def _status(self) -> dict:
        return self.session.get(self.url + "/v1/status", headers=self.admin, timeout=60).json()

    def _condition(self, status: dict, type_: str) -> dict:
        return next(c for c in status["conditions"] if c["type"] == type_)

    def _write_attack_file(self, text: str) -> None:
        path = self.tree / "adapters" / f"{ATTACK_INVENTORY}.yaml"
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)

    def _until(self, what: str, pred: Callable[[dict], bool], timeout_s: float = 60) -> Optional[dict]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            st = self._status()
            if pred(st):
                return st
            time.sleep(0.1)
        raise AssertionError(f"not within {timeout_s} s: {what}")

    def _restore(self, cls: str) -> None:
        self._write_attack_file("{}\n")
        self._until("ConfigValid again after the file was restored",
                    lambda st: self._condition(st, "ConfigValid")["status"] == "True")

    def _config_bomb(self, rng: random.Random) -> None:
        text, needle = rng.choice([(ALIAS_BOMB, "YAML nodes"), ("#" + "c" * (1 << 20) + "\n", "at most 1048576")])
        name = f"{ATTACK_INVENTORY}.yaml"
        self._write_attack_file(text)
        try:
            st = self._until("ConfigValid False naming the bomb", lambda st: (
                self._condition(st, "ConfigValid")["status"] == "False"
                and name in self._condition(st, "ConfigValid")["message"]))
            msg = self._condition(st, "ConfigValid")["message"]
            if needle not in msg:
                self._fail("config_bomb", f"ConfigValid's message lacks {needle!r}: {msg[:300]}")
            # The reconcile lock is not held while a config is parsed: the admin API answers.
            r = self.session.get(self.url + "/v1/adapters", headers=self.admin, timeout=30)
            if r.status_code != 200:
                self._fail("config_bomb", f"/v1/adapters during the bomb: {r.status_code}")
            else:
                self._ok("config_bomb")
        finally:
            self._restore("config_bomb")

    def _env_secret(self, rng: random.Random) -> None:
        shown = f"<from env {SECRET_VAR}>"
        self._write_attack_file(f"leak:\n  path: ${{oc.env:{SECRET_VAR}}}\n")
        try:
            st = self._until(f"a reconcile reporting {shown}", lambda st: shown in json.dumps(st))
            texts = [json.dumps(st), self.session.get(self.url + "/v1/models", timeout=30).text,
                     self.session.get(self.url + "/v1/adapters", headers=self.admin, timeout=30).text,
                     self.session.get(self.url + "/metrics", timeout=30).text]
            if any(self.s.secret in t for t in texts):
                self._fail("env_secret", "the secret's value is in /v1/status, /v1/models, /v1/adapters or /metrics")
            else:
                self._ok("env_secret")
        finally:
            self._restore("env_secret")


    def _write_tenants(self, text: str) -> None:
        path = self.tree / "tenants" / "default.yaml"
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)

    def _models_status(self, key: str) -> int:
        return requests.get(self.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30).status_code

    def _until_key(self, key: str, status: int, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while self._models_status(key) != status:
            if time.monotonic() > deadline:
                raise AssertionError(f"the tenant key did not answer {status} on /v1/models within {timeout_s} s")
            time.sleep(0.1)

    def _tenants(self, rng: random.Random) -> None:
        key, new_key = f"soak-tenant-{secrets.token_hex(12)}", f"soak-tenant-{secrets.token_hex(12)}"
        rate, burst = rng.choice([1.0, 2.0]), rng.choice([2, 3])
        other = rng.choice(sorted(self.adapters))  # the tenant may use the base model only

        def file(*keys: str) -> str:
            digests = ", ".join(hashlib.sha256(k.encode()).hexdigest() for k in keys)
            return (f"flood:\n  key_sha256: [{digests}]\n  adapters: []\n  limits: {{requests_per_s: {rate}, "
                    f"burst: {burst}, max_concurrent: {rng.choice([1, 2])}, max_tokens_per_request: {self.new}}}\n")

        self._write_tenants(file(key))
        try:
            self._until_key(key, 200)
            answers: list[tuple[float, requests.Response, int]] = []
            lock = threading.Lock()
            t0 = time.monotonic()

            def flood(i: int) -> None:
                p = i % len(self.prompts)
                r = requests.post(self.url + "/generate", headers={"Authorization": f"Bearer {key}"}, timeout=120,
                                  json={"input_ids": self.prompts[p], "sampling_params": {
                                      "max_new_tokens": self.new, "temperature": 0, "ignore_eos": True}})
                with lock:
                    answers.append((time.monotonic(), r, p))

            threads = [threading.Thread(target=flood, args=(i,)) for i in range(4 * burst + 4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=180)
            elapsed = max(t for t, _, _ in answers) - t0
            ok = [(r, p) for _, r, p in answers if r.status_code == 200]
            with self._lock:
                self.counts.served += len(ok)  # they reached the engine: the metrics check counts them
            for r, p in ok:
                if r.json()["output_ids"] != self.refs[None][p]:
                    self._fail("tenants", "a flood answer differs from the reference")
            refused = [r for _, r, _ in answers if r.status_code != 200]
            for r in refused:
                if r.status_code != 429 or "Retry-After" not in r.headers:
                    self._fail("tenants", f"flood: {r.status_code} without Retry-After: {r.text[:200]}")
                else:
                    self._expect("tenants", "flood over the limit", r, 429, code=r.json()["error"]["code"])
            if len(answers) != len(threads):
                self._fail("tenants", f"{len(threads) - len(answers)} flood requests lost")
            if len(ok) > burst + rate * elapsed + 1e-9:
                self._fail("tenants", f"{len(ok)} answered in {elapsed:.2f} s: over burst {burst} + {rate}/s")
            if not refused:
                self._fail("tenants", "a flood at several times the rate got no 429")
            # Another adapter answers as one that does not exist (same body, name aside).
            bodies = []
            for model in (other, f"nope-{secrets.token_hex(4)}"):
                self._until_key(key, 200)  # one request/s at least: the bucket refills
                r = self._post_as(key, model)
                while r.status_code == 429:
                    time.sleep(float(r.headers.get("Retry-After", "1")))
                    r = self._post_as(key, model)
                bodies.append((r.status_code, r.text.replace(model, "NAME")))
            if bodies[0] != bodies[1] or bodies[0][0] != 404:
                self._fail("tenants", f"an adapter outside the tenant answers unlike a missing one: {bodies}")
            # Rotate: the new key beside the old, then the old one out.
            self._write_tenants(file(key, new_key))
            self._until_key(new_key, 200)
            self._write_tenants(file(new_key))
            self._until_key(key, 401)
            self._ok("tenants")
        finally:
            self._write_tenants("{}\n")
            self._until_key(new_key, 401)

    def _post_as(self, key: str, model: str) -> requests.Response:
        return requests.post(self.url + "/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=120,
                             json={"model": model, "prompt": self.prompts[0], "max_tokens": 1})


def label_problems(url: str, known: set[str], max_labels: int, churned: list[str]) -> list[str]:
    """The `adapter` label's values: registered names (first come), `base` and `other`, at most
    `max_labels` names of their own however many adapters came and went; /metrics stays small."""
    text = requests.get(url + "/metrics", timeout=30).text
    # appliance_lora_adapter_resident names adapters in memory by their own name: bounded by the tiers,
    # not by max_adapter_labels (telemetry/metrics.py), so it is left out of this count.
    labels = {line.split('adapter="')[1].split('"')[0] for line in text.splitlines()
              if 'adapter="' in line and not line.startswith("appliance_lora_adapter_resident")}
    own = labels - {"base", "other"}
    out = []
    if not own <= known | set(churned):
        out.append(f"adapter label values that are no adapter's name: {sorted(own - known - set(churned))}")
    if len(own) > max_labels:
        out.append(f"{len(own)} adapter label values, more than metrics.max_adapter_labels ({max_labels})")
    if len(known | set(churned)) > max_labels and "other" not in labels:
        out.append("more adapters than metrics.max_adapter_labels came and went, yet no 'other' label")
    if "fake_metric" in text:
        out.append("a model name became a metric line")
    if len(text) > 1 << 20:
        out.append(f"/metrics is {len(text)} bytes")
    return out
