"""The report: Markdown tables on stdout, one JSON file, and PNG plots (matplotlib optional)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Sequence


# Issue targets for a decode variant's step over the plain step, by variant name less its digits.
VARIANT_LIMITS = {"logprobs": 1.05}


def table(rows: Sequence[dict], cols: Sequence[str]) -> str:
    """A Markdown table of `cols` from each row (missing = blank); reads fine as plain text too."""
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join("" if r.get(c) is None else str(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def targets(res: dict) -> list[dict]:
    """Issue 7's targets, each with the measured value and met true/false (absent data: not listed)."""
    out: list[dict] = []

    def add(name: str, value: Optional[float], op: str, limit: float) -> None:
        if value is not None:
            out.append({"target": name, "value": round(value, 3), "limit": f"{op} {limit}",
                        "met": value <= limit if op == "<=" else value >= limit})

    for r in res.get("decode_step") or []:
        what = "base" if r["adapters"] == 0 else f"{r['adapters']} distinct rank-{r['rank']} adapters"
        variant = r.get("variant", "plain")
        limit = VARIANT_LIMITS.get(variant.rstrip("0123456789"))
        if r.get("json_schema") is not None:
            add(f"decode step with JSON schema {r['json_schema']!r} on every row / unconstrained, {what}, batch "
                f"{r['batch']}, context {r['context']}", r["x_unconstrained"], "<=", 1.10)
        elif variant == "plain":
            add(f"decode step / floor, {what}, batch {r['batch']}, context {r['context']}", r["x_floor"], "<=", 1.25)
        elif limit is not None:
            add(f"decode step {variant} / plain, {what}, batch {r['batch']}", r["x_unconstrained"], "<=", limit)
    b = res.get("baselines") or {}
    rows = b.get("rows", [])
    ours = {(r["adapters"], r["new_tokens"]): r["tok_s"] for r in rows if r["impl"] == "appliance"}
    for impl, theirs_d, limit in (("peft mixed", None, 100), ("transformers", 0, 5)):
        for r in (x for x in rows if x["impl"] == impl):
            d = r["adapters"] if theirs_d is None else max((k[0] for k in ours), default=0)
            what = (f"appliance / peft mixed generate, {d} distinct adapters" if impl == "peft mixed" else
                    f"appliance ({d} distinct adapters) / transformers base generate")
            mine = ours.get((d, r["new_tokens"]))
            if mine:
                add(f"{what}, {r['new_tokens']} new tokens (same run)", mine / r["tok_s"], ">=", limit)
            est = r.get("est_tok_s")
            mine = ours.get((d, r.get("est_new_tokens")))
            if est and mine:
                add(f"{what}, {r['est_new_tokens']} new tokens ({impl} extended from its {r['new_tokens']}-token "
                    "run)", mine / est, ">=", limit)
    pre = {r["adapters"]: r["prefill_tok_s"] for r in res.get("prefill") or []}
    lora = [k for k in pre if k > 0]
    if 0 in pre and lora:
        add(f"prefill tok/s, {lora[0]} distinct adapters / base", pre[lora[0]] / pre[0], ">=", 0.9)
    for i, r in enumerate(res.get("online_runs") or []):
        if r.get("ttft_p99_vs_single") is not None:
            add(f"online p99 TTFT, Zipf churn / one adapter, run {i + 1} (overlap loading "
                f"{'on' if r.get('overlap_loading') else 'off'})", r["ttft_p99_vs_single"], "<=", 3)
    return out


def render(res: dict) -> str:
    parts = []
    sections: list[tuple[str, Any, Sequence[str]]] = [
        ("Offline throughput", res.get("offline"),
         ["rank", "adapters", "requests", "batch", "prompt_len", "new_tokens", "tokens", "wall_s", "tok_s"]),
        ("Decode step vs floor", [{**r, "step_ms_blocks": " / ".join(map(str, r.get("step_ms_blocks", [])))}
                                  for r in res.get("decode_step") or []],
         ["variant", "batch", "context", "adapters", "rank", "json_schema", "step_ms", "step_ms_blocks",
          "step_ms_serial", "x_unconstrained", "floor_ms", "x_floor", "weight_gb", "kv_gb", "adapter_gb",
          "compiled_during"]),
        ("Prefill", res.get("prefill"),
         ["label", "adapters", "requests", "prompt_len", "wall_s", "prefill_tok_s"]),
        ("Engine start-up (model, KV cache, graph capture, kernel warm-up)", res.get("startup"),
         ["engine", "build_s", "warmup_steps", "warmup_s", "warmup_compiled"]),
        ("Same workload: appliance vs transformers / peft", (res.get("baselines") or {}).get("rows"),
         ["impl", "adapters", "batch", "new_tokens", "tokens", "wall_s", "tok_s", "prefill_s", "token_ms",
          "est_new_tokens", "est_tok_s"]),
        ("Online (Poisson arrivals, Zipf adapters; single = the same arrivals all on one adapter)",
         [_online_row(r) for r in res.get("online_runs") or ([res["online"]] if res.get("online", {}).get("requests")
                                                             else [])],
         ["run", "overlap_loading", "requests", "failures", "distinct_adapters_used", "offered_rate_rps", "req_s",
          "out_tok_s", "ttft_p50_ms", "ttft_p99_ms", "single_ttft_p50_ms", "single_ttft_p99_ms",
          "ttft_p99_vs_single", "itl_p50_ms", "itl_p99_ms", "slot_evictions", "cold_reads", "cold_read_p50_ms",
          "slot_loads", "load_failures", "compiled_during_run"]),
        ("Targets (issue 7)", res.get("targets"), ["target", "value", "limit", "met"]),
    ]
    for title, rows, cols in sections:
        if rows:
            parts += [f"## {title}", "", table(rows, cols), ""]
    b = res.get("baselines") or {}
    if b.get("greedy_match"):
        parts.append(f"peft one-adapter greedy tokens identical to the engine's: {b['greedy_match']} requests "
                     f"(first {b.get('greedy_match_tokens', '?')} tokens)")
    c = res.get("ceilings") or {}
    if c.get("copy_gb_s"):
        parts.append(f"copy bandwidth (read + write): {c['copy_gb_s']} GB/s")
    for phase, err in (res.get("errors") or {}).items():
        parts.append(f"ERROR in {phase}: {err}")
    return "\n".join(parts)


def _online_row(r: dict) -> dict:
    one = r.get("single") or {}
    return {**r, "single_ttft_p50_ms": one.get("ttft_p50_ms"), "single_ttft_p99_ms": one.get("ttft_p99_ms")}


def write_json(res: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(res, indent=1))
    tmp.replace(path)


def plots(res: dict, out_dir: Path) -> list[str]:
    """throughput_vs_adapters.png and ttft_cdf.png; returns the files written, or why none."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ["plots skipped: matplotlib is not installed (pip install matplotlib, or the dev extra)"]
    written = []
    off = res.get("offline") or []
    rows = (res.get("baselines") or {}).get("rows") or []
    if off or rows:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for rank in sorted({r["rank"] for r in off if r["adapters"] > 0}):
            pts = sorted((r["adapters"], r["tok_s"]) for r in off if r["rank"] in (rank, 0))
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"appliance, rank {rank}")
        for impl, marker in (("transformers", "s"), ("peft", "^"), ("peft mixed", "v"), ("appliance", "x")):
            pts = [(r["adapters"], r["tok_s"]) for r in rows if r["impl"] == impl]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker, ms=8, ls="none",
                        label=f"{impl} (batch {rows[0]['batch']})")
        ax.set_xscale("symlog", linthresh=1)
        ax.set_yscale("log")
        ax.set_xlabel("distinct adapters in the batch (0 = base)")
        ax.set_ylabel("generated tokens / s")
        ax.set_title(f"Offline throughput, {res['meta']['model']}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / "throughput_vs_adapters.png", dpi=110)
        plt.close(fig)
        written.append(str(out_dir / "throughput_vs_adapters.png"))
    runs = [r for r in (res.get("online_runs") or [res.get("online") or {}]) if r.get("ttft_ms_all")]
    if runs:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for k, r in enumerate(runs, start=1):
            label = f"run {k}: overlap loading {'on' if r.get('overlap_loading') else 'off'}"
            curves = [(r["ttft_ms_all"], label, "-")]
            if (r.get("single") or {}).get("ttft_ms_all"):
                curves.append((r["single"]["ttft_ms_all"], f"run {k}: one adapter", ":"))
            for xs, lab, ls in curves:
                ttft = sorted(xs)
                ax.step(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], where="post", label=lab, ls=ls)
        if len(runs) > 1 or runs[0].get("single"):
            ax.legend(fontsize=7)
        ax.set_xscale("log")
        ax.set_xlabel("time to first token (ms)")
        ax.set_ylabel("fraction of requests")
        on = res["online"]
        ax.set_title(f"TTFT CDF: {on['requests']} requests, {on.get('offered_rate_rps')} req/s offered")
        ax.grid(True, which="both", alpha=0.3)
        fig.tight_layout()
        fig.savefig(out_dir / "ttft_cdf.png", dpi=110)
        plt.close(fig)
        written.append(str(out_dir / "ttft_cdf.png"))
    return written
