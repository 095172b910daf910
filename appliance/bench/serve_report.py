"""`appliance bench serve`'s report: a short Markdown table (printed last) and serve.png (matplotlib
optional): output tok/s and TTFT p50/p99 over the closed-loop concurrency, one line per adapter mix,
HTTP solid and in-process dashed."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from appliance.bench.report import table

COLUMNS = ["mix", "load", "requests", "ok", "failures", "req_s", "out_tok_s", "in_process_tok_s",
           "http_vs_in_process", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "tpot_p50", "e2e_p99",
           "slot_evictions", "preemptions", "client_cpu_util"]


def load_label(r: dict) -> str:
    """A row's load point as the tables print it."""
    return f"{r['concurrency']} concurrent" if r["load"] == "closed" else f"{r['rate_rps']:g} req/s"


def failures_text(failures: dict) -> str:
    """Failures by kind as the tables print them ("0" for none)."""
    return ", ".join(f"{k}: {v}" for k, v in failures.items()) or "0"


def _flat(r: dict) -> dict:
    def p(key: str, q: str) -> Optional[float]:
        return (r.get(key) or {}).get(q)

    srv = r.get("server") or {}
    return {**r, "load": load_label(r), "failures": failures_text(r["failures"]),
            "in_process_tok_s": (r.get("in_process") or {}).get("out_tok_s"),
            "ttft_p50": p("ttft_ms", "p50"), "ttft_p99": p("ttft_ms", "p99"), "itl_p50": p("itl_ms", "p50"),
            "itl_p99": p("itl_ms", "p99"), "tpot_p50": p("tpot_ms", "p50"), "e2e_p99": p("e2e_ms", "p99"),
            "slot_evictions": srv.get("slot_evictions"), "preemptions": srv.get("preemptions")}


def render(res: dict) -> str:
    w, s = res.get("workload") or {}, res.get("server") or {}
    head = (f"## bench serve: {res['meta']['model']} via {w.get('api')} at {s.get('url')}, "
            f"{w.get('num_requests')} requests per row, prompt {w.get('prompt_len', {}).get('dist')} "
            f"~{w.get('prompt_len', {}).get('mean')}, output {w.get('output_len', {}).get('dist')} "
            f"~{w.get('output_len', {}).get('mean')} tokens (latencies in ms)")
    parts = [head, "", table([_flat(r) for r in res.get("rows") or []], COLUMNS)]
    if res.get("cold"):  # the cold mix's no-loads side (serve_cold.py)
        parts.append(f"Each row also served {res['cold']['adapters']} extra requests to warm adapters, timed apart "
                     "from its requests (the cold table's no-loads side).")
    for phase, err in (res.get("errors") or {}).items():
        parts.append(f"ERROR in {phase}: {err}")
    return "\n".join(parts)


def plots(res: dict, out_dir: Path) -> list[str]:
    """serve.png from the closed-loop rows; returns the files written, or why none."""
    rows = [r for r in res.get("rows") or [] if r["load"] == "closed"]
    if not rows:
        return []
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ["plots skipped: matplotlib is not installed (pip install 'appliance[bench]')"]
    fig, (tp, lat) = plt.subplots(1, 2, figsize=(10, 4))
    for mix in dict.fromkeys(r["mix"] for r in rows):
        mine = sorted((r for r in rows if r["mix"] == mix), key=lambda r: r["concurrency"])
        xs = [r["concurrency"] for r in mine]
        line, = tp.plot(xs, [r["out_tok_s"] for r in mine], "o-", label=f"{mix}, HTTP")
        inproc = [(r["concurrency"], r["in_process"]["out_tok_s"]) for r in mine if r.get("in_process")]
        if inproc:
            tp.plot(*zip(*inproc), "x--", color=line.get_color(), label=f"{mix}, in process")
        for q, ls in (("p50", "o-"), ("p99", "^:")):
            ys = [(r["concurrency"], (r.get("ttft_ms") or {}).get(q)) for r in mine]
            ys = [y for y in ys if y[1] is not None]
            if ys:
                lat.plot(*zip(*ys), ls, color=line.get_color(), label=f"{mix} TTFT {q}")
    ticks = sorted({r["concurrency"] for r in rows})
    for ax, ylabel in ((tp, "output tokens / s"), (lat, "time to first token (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("concurrent requests (closed loop)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    lat.set_yscale("log")
    fig.suptitle(f"bench serve: {res['meta']['model']} via {(res.get('workload') or {}).get('api')}")
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "serve.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [str(path)]
