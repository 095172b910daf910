"""The long soak: tests/server/soak.py's rounds, more of them, more clients, more adapters.

Not part of `make test` (its short variant is tests/server/test_soak.py). Loopback only, on the tiny
random model (the soak checks correctness and resources, not speed); stops by itself after --rounds.
Exit status 1 when any request failed or was lost, any attack of the mix (tests/server/soak_attacks.py)
did not get its expected refusal, the server did not go idle, RSS grew by more than
--max-rss-growth-mib from the first round to the last, or (when appliance.telemetry.metrics exists) the
server's request counters disagree with the clients'. Rewrites its section of docs/reliability.md.

    .venv/bin/python benchmarks/soak.py [--rounds 6] [--clients 8] [--requests-per-client 60] \\
        [--adapters 12] [--slots 3] [--cpu-cache 5] [--no-attacks] [--no-write]
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.conftest import default_config, make_tiny_model  # noqa: E402
from tests.server.soak import RoundReport, Soak, SoakConfig, SoakSetup, has_metrics, metrics_problems  # noqa: E402
from tests.server.soak_attacks import ATTACK_CLASSES  # noqa: E402

BEGIN, END = "<!-- soak:begin -->", "<!-- soak:end -->"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests-per-client", type=int, default=60)
    ap.add_argument("--adapters", type=int, default=12)
    ap.add_argument("--slots", type=int, default=3)
    ap.add_argument("--cpu-cache", type=int, default=5)
    ap.add_argument("--disconnect-ratio", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-rss-growth-mib", type=float, default=64)
    ap.add_argument("--no-attacks", action="store_true", help="no attacker thread beside the clients")
    ap.add_argument("--no-write", action="store_true", help="do not rewrite docs/reliability.md")
    a = ap.parse_args()
    cfg = SoakConfig(rounds=a.rounds, clients=a.clients, requests_per_client=a.requests_per_client,
                     adapters=a.adapters, slots=a.slots, cpu_cache=a.cpu_cache,
                     disconnect_ratio=a.disconnect_ratio, seed=a.seed, attacks=not a.no_attacks)
    from appliance.models.prepare import prepare_model

    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        work = Path(tmp)
        model = make_tiny_model(work / "tiny", prepare_model(default_config().model),
                                attention_bias=True, tie_word_embeddings=False)
        t0 = time.monotonic()
        setup = SoakSetup(work, model, cfg)
        print(f"setup: {len(setup.names)} adapters made and their references computed in "
              f"{time.monotonic() - t0:.0f} s", flush=True)
        srv = setup.start_server()
        try:
            soak = Soak(setup, srv)
            t0 = time.monotonic()
            report = soak.run(on_round=lambda r: print(_round_line(r), flush=True))
            seconds = time.monotonic() - t0
            metrics = metrics_problems(srv.url, report.counts) if has_metrics() else None
        finally:
            srv.stop()
    c = report.counts
    growth = report.rounds[-1].rss_mib - report.rounds[0].rss_mib
    problems = c.failures + c.attacks.failures + report.idle_checks + (metrics or [])
    missing = set(ATTACK_CLASSES) - set(c.attacks.refused)
    if cfg.attacks and missing:
        problems.append(f"attack classes that never got their refusal: {sorted(missing)}")
    if growth > a.max_rss_growth_mib:
        problems.append(f"RSS grew by {growth:.0f} MiB from the first round to the last")
    print("soak:", report.summary())
    for p in problems[:20]:
        print("PROBLEM:", p)
    section = _section(a, report, seconds, growth, metrics, problems)
    if not a.no_write:
        _write(REPO / "docs" / "reliability.md", section)
    return 1 if problems else 0


def _round_line(r: RoundReport) -> str:
    return (f"round {r.index}: {r.requests} requests ({r.ok} ok, {r.disconnected} disconnected, {r.refused_404} "
            f"404, {r.failures} failed), {r.admin_ops} admin ops, {r.config_edits} config edits, "
            f"RSS {r.rss_mib:.0f} MiB, {r.seconds:.0f} s")


def _section(a: argparse.Namespace, report, seconds: float, growth: float, metrics, problems: list[str]) -> str:
    c = report.counts
    cmd = " ".join(["benchmarks/soak.py", *sys.argv[1:]])
    rows = "\n".join(f"| {r.index} | {r.requests} | {r.ok} | {r.disconnected} | {r.refused_404} | {r.failures} | "
                     f"{r.admin_ops} | {r.config_edits} | {r.rss_mib:.0f} |" for r in report.rounds)
    load = os.getloadavg()
    at = c.attacks
    aline = ("off (--no-attacks)" if not report.config.attacks else
             f"{sum(at.refused.values())} refused as expected ({', '.join(f'{k} {v}' for k, v in sorted(at.refused.items()))}); "
             f"**not as expected: {len(at.failures)}**; {at.served} attacker requests served on adapters it loaded "
             "(answers equal to the adapter's reference)")
    mline = ("not checked (appliance.telemetry.metrics does not exist in this build)" if metrics is None
             else "match the clients' counts" if not metrics else f"MISMATCH: {metrics}")
    return f"""{BEGIN}
Last run: {date.today().isoformat()}, `.venv/bin/python {cmd}`, {platform.machine()} with {os.cpu_count()} cores
(load average {load[0]:.1f} at the end), {seconds:.0f} s of traffic. Tiny random Llama (2 layers), {a.adapters}
peft adapters (half churned through the admin API, half through YAML hot reload), {a.slots} GPU slots,
CPU tier of {a.cpu_cache}, {a.clients} clients x {a.requests_per_client} requests per round, {"without the attack mix"
 if a.no_attacks else "with the attack mix beside them (tests/server/soak_attacks.py)"}.

| round | requests | ok | disconnected | 404 (unloaded) | failed | admin ops | config edits | RSS MiB |
|---|---|---|---|---|---|---|---|---|
{rows}

- Requests: {c.requests}; answers equal to the adapter's peft reference: {c.ok}; disconnected mid-stream:
  {c.disconnected}; refused 404 because the adapter was unloaded at that moment: {c.refused_404};
  **errors / lost / hung: {len(c.failures)}**.
- Adapters churned: {c.admin_ops} admin operations (load, unload, pin, unpin, reload in place;
  {c.admin_refusals} pins refused with "no slot free" under load, as documented) and {c.config_edits}
  edits of the YAML inventory (rename-saves), each picked up by hot reload
  (edits within the debounce window reconcile together).
- Attacks: {aline}.
- Idle after every round (no request in flight, 0 KV blocks, no slot running, nothing retiring):
  {"yes" if not report.idle_checks else report.idle_checks}.
- RSS: first round {report.rounds[0].rss_mib:.0f} MiB, final {report.rounds[-1].rss_mib:.0f} MiB (growth
  {growth:+.0f} MiB), peak {report.peak_rss_mib:.0f} MiB. RSS is the whole process: server, engine and the
  client threads.
- Metrics counters: {mline}.
- Result: {"PASS" if not problems else "FAIL (" + str(len(problems)) + " problems)"}.
{END}"""


def _write(path: Path, section: str) -> None:
    text = path.read_text() if path.exists() else ""
    if BEGIN in text and END in text:
        text = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: section, text, flags=re.S)
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    path.write_text(text)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
