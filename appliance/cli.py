"""`appliance` command line: parse, compose the config, hand it to the library. No work happens here.

    appliance serve [--config-dir DIR] [overrides...]
    appliance worker [--config-dir DIR] parallel.node_rank=K [overrides...]   (multi-host tensor parallelism)
    appliance model prepare [--config-dir DIR] [--force] [overrides...]
    appliance config show [--config-dir DIR] [--diff] [overrides...]
    appliance validate [--config-dir DIR] [overrides...]
    appliance plan [--config-dir DIR] [--url URL] [--detailed-exitcode] [--prune MODE] [overrides...]
    appliance apply [--config-dir DIR] [--url URL] [--auto-approve] [--dry-run] [--prune MODE] [overrides...]
    appliance status [--config-dir DIR] [--url URL] [overrides...]
    appliance demo train-adapters [--out DIR] [--steps N] ...
    appliance bench offline|online|all [--config-dir DIR] [bench options] [overrides...]
    appliance bench serve [--config-dir DIR] [--url URL] [serve bench options] [overrides...]

Overrides are Hydra's `key=value` (e.g. `server.port=9000 model.dtype=bfloat16`). Exit codes: 0 ok,
1 a config or model error (printed as `error: ...`), 2 bad arguments (argparse).
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from appliance.config.compose import Composed
from appliance.config.schema import PRUNE_MODES, ApplianceConfig, ConfigError
from appliance.models.prepare import ModelPrepareError  # cheap: torch is imported only to convert


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] == ["demo", "train-adapters"]:
        # Everything after it belongs to the trainer's own parser (--names, --steps, --help...).
        return _train_demo(argparse.Namespace(rest=argv[2:]))
    if argv[:2] == ["bench", "serve"]:
        # Its own options (an HTTP load generator's), not the engine bench's.
        return _parse_and_run(_bench_serve_parser(), argv[2:], argv)
    return _parse_and_run(_parser(), argv, argv)


def _parse_and_run(parser: argparse.ArgumentParser, args_in: list[str], argv: list[str]) -> int:
    """Parse `args_in` (argv, or what follows a subcommand with its own parser) and run its command."""
    try:
        args, extra = parser.parse_known_args(args_in)
        # argparse ends a nargs="*" positional at the first option, so overrides written after
        # --config-dir come back as extras: keep them (in order), refuse unknown options.
        unknown = [a for a in extra if a.startswith("-")]
        if unknown:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    except SystemExit as e:
        # `plan --detailed-exitcode` gives 2 the meaning "changes pending": a usage error there must
        # not look like one, so plan's usage errors exit 1.
        if e.code == 2 and argv[:1] in (["plan"], ["apply"]):
            raise SystemExit(1) from None
        raise
    args.overrides += extra
    args.argv = argv
    try:
        return args.func(args)
    except (ConfigError, ModelPrepareError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="appliance", description="A config-driven multi-LoRA LLM server.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="compose the config and run the HTTP server")
    _config_args(serve)
    serve.set_defaults(func=_serve)

    worker = sub.add_parser("worker", help="run this host's tensor-parallel ranks of a multi-host layout "
                                           "(parallel.nnodes > 1, parallel.node_rank >= 1)")
    _config_args(worker)
    worker.set_defaults(func=_worker)

    model = sub.add_parser("model", help="model files").add_subparsers(dest="action", required=True,
                                                                       metavar="ACTION")
    prepare = model.add_parser("prepare", help="build model.path from model.source (once)")
    prepare.add_argument("--force", action="store_true", help="rebuild even when model.path exists")
    _config_args(prepare)
    prepare.set_defaults(func=_prepare)

    validate = sub.add_parser("validate", help="check the config, the model dir and the listed adapters "
                                               "without a server (exit 0 valid, 1 invalid)")
    _config_args(validate)
    validate.set_defaults(func=_validate)

    plan = sub.add_parser("plan", help="diff the config's adapters against a running server (read-only)")
    _remote_args(plan)
    plan.add_argument("--detailed-exitcode", action="store_true",
                      help="exit 0 when nothing would change, 2 when something would, 1 on error")
    _config_args(plan)
    plan.set_defaults(func=_plan)

    apply = sub.add_parser("apply", help="make a running server's adapters match the config")
    _remote_args(apply)
    apply.add_argument("--auto-approve", action="store_true", help="apply without asking for 'yes'")
    apply.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    _config_args(apply)
    apply.set_defaults(func=_apply)

    status = sub.add_parser("status", help="a running server's config generation, conditions and adapters")
    status.add_argument("--url", default=None, help="server URL (default: http://server.host:server.port)")
    _config_args(status)
    status.set_defaults(func=_status)

    demo = sub.add_parser("demo", help="the demo adapters").add_subparsers(dest="action", required=True,
                                                                         metavar="ACTION")
    train = demo.add_parser("train-adapters", help="train the demo adapters with peft on CPU (needs the dev "
                                                   "extras); the repository ships the result")
    train.add_argument("rest", nargs=argparse.REMAINDER,
                       help="arguments of appliance.demo.train (see `appliance demo train-adapters --help`)")

    bench = sub.add_parser("bench", help="benchmark the engine on the configured model (offline throughput "
                                         "over distinct adapters, decode floor, prefill, online latency, "
                                         "transformers/peft baselines); prints a table, writes JSON and PNGs. "
                                         "`appliance bench serve --help`: the HTTP serving benchmark")
    _bench_args(bench)
    _config_args(bench)
    bench.set_defaults(func=_bench)

    config = sub.add_parser("config", help="inspect the composed config").add_subparsers(
        dest="action", required=True, metavar="ACTION")
    show = config.add_parser("show", help="print the composed, checked config as YAML (secrets masked)")
    _config_args(show)
    show.add_argument("--diff", action="store_true",
                      help="print only the keys whose effective value differs from the packaged defaults")
    show.set_defaults(func=_show)
    return p


def _bench_args(p: argparse.ArgumentParser) -> None:
    from appliance.bench.options import MODES, OVERLAP_CHOICES, SINGLE_CHOICES, BenchOptions

    d = BenchOptions()
    p.add_argument("mode", choices=MODES, help="offline phases, the online phase, or both")
    a = p.add_argument
    a("--out", default=d.out, help=f"directory for bench.json and the PNG plots (default {d.out})")
    a("--batch", type=int, default=d.batch, help="offline: requests decoded together")
    a("--prompt-len", type=int, default=d.prompt_len, help="prompt tokens (random ids)")
    a("--new-tokens", type=int, default=d.new_tokens, help="generated tokens per request (EOS ignored)")
    a("--adapters", type=int, nargs="+", default=d.adapters, help="offline: distinct adapter counts (0 = base)")
    a("--ranks", type=int, nargs="+", default=d.ranks, help="LoRA ranks of the synthetic adapters")
    a("--targets", nargs="+", default=d.targets, help="projections the synthetic adapters target")
    a("--decode-batch", type=int, default=d.decode_batch)
    a("--decode-context", type=int, default=d.decode_context)
    a("--decode-steps", type=int, default=d.decode_steps, help="timed decode steps (0 = skip the phase)")
    a("--decode-adapters", type=int, default=d.decode_adapters)
    a("--profile-decode", action="store_true",
      help="after the timed decode steps, profile 2 more (torch.profiler) and record the top kernels")
    a("--decode-logprobs", type=int, default=None, metavar="K",
      help="also time the decode steps with logprobs=K (top-K alternatives) on every row")
    a("--decode-json-schema", default=None, metavar="NAME|FILE",
      help="also time each decode row with this JSON schema constraining every sequence: a built-in "
           "(record, flat) or a schema file; reports the step time against the unconstrained one")
    a("--prefill-requests", type=int, default=d.prefill_requests, help="0 = skip the prefill phase")
    a("--prefill-len", type=int, default=d.prefill_len)
    a("--prefill-adapters", type=int, default=d.prefill_adapters)
    a("--baseline-batch", type=int, default=d.baseline_batch)
    a("--baseline-adapters", type=int, default=d.baseline_adapters, help="distinct adapters in peft's mixed batch")
    a("--baseline-new-tokens", type=int, default=None, help="default: --new-tokens")
    a("--baseline-hf-new-tokens", type=int, default=None,
      help="transformers / peft generate this many instead (bounds their cost); the engine runs it too, "
           "and their per-token time is extended to --baseline-new-tokens (default: no reduction)")
    a("--skip-baselines", action="store_true", help="no transformers / peft runs (the engine still runs their workload)")
    a("--online-requests", type=int, default=d.online_requests)
    a("--online-rate", type=float, default=d.online_rate, help="Poisson arrival rate, requests/s")
    a("--online-adapters", type=int, default=d.online_adapters, help="adapters the Zipf popularity spans")
    a("--zipf", type=float, default=d.zipf, help="Zipf exponent of adapter popularity")
    a("--online-overlap", choices=list(OVERLAP_CHOICES), default=d.online_overlap,
      help="online: lora.overlap_loading as configured, off, on, or one run each: both (off first), "
           "on-off (on first); or both orders: off-on-on-off, on-off-off-on (each run on a fresh engine)")
    a("--online-single", choices=SINGLE_CHOICES, default=d.online_single,
      help="online: run the same arrivals again with every request on one adapter (the Zipf head), on the "
           "same engine, after each run, the first only, or none; reports the p99 TTFT ratio")
    a("--adapter-dir", default=None, help="write the synthetic adapters here and keep them (default: temp dir)")
    a("--seed", type=int, default=d.seed)
    a("--budget-s", type=float, default=None, help="skip phases not started after this many seconds")
    a("--keep-going", action="store_true", help="record a failing phase and go on (exit 1 at the end)")
    a("--no-progress", dest="progress", action="store_false", help="no progress bars")


def _bench_serve_parser() -> argparse.ArgumentParser:
    from appliance.bench.serve_options import (API_KEY_ENV, ADMIN_KEY_ENV, APIS, LENGTH_DISTS, MIXES, ServeOptions,
                                               float_list, int_list, str_list)

    d = ServeOptions()
    p = argparse.ArgumentParser(
        prog="appliance bench serve",
        description="The serving benchmark: starts `appliance serve` from the same config and overrides (or "
                    "targets --url), drives it over HTTP with streamed requests under closed-loop and Poisson "
                    "load over an adapter mix, and reports throughput, TTFT/ITL/TPOT/e2e percentiles, "
                    "failures by status and the server's /metrics deltas; prints a table, writes serve.json "
                    f"and serve.png. Keys come from {API_KEY_ENV} / {ADMIN_KEY_ENV} (or the config).")
    a = p.add_argument
    a("--out", default=d.out, help=f"directory for serve.json, serve.png and server.log (default {d.out})")
    a("--url", default=None, help="an existing server (default: start one from the config on a free port)")
    a("--api", choices=APIS, default=d.api, help="auto: chat with a chat template, completions with a "
                                                  "tokenizer, else generate (token ids)")
    a("--concurrency", type=int_list, default=None,
      help=f"closed-loop load points, e.g. 8,64,256 (default {','.join(map(str, d.concurrency))}, none with --rate)")
    a("--rate", type=float_list, default=d.rate, help="Poisson load points in requests/s, e.g. 4,16")
    a("--num-requests", type=int, default=d.num_requests, help="measured requests per row")
    a("--warmup-requests", type=int, default=None,
      help="requests before each row, not measured (default: one wave, the concurrency; 16 for rates)")
    a("--seed", type=int, default=d.seed)
    a("--mix", dest="mixes", type=str_list, default=d.mixes,
      help=f"adapter mixes, comma separated: {', '.join(MIXES)} (one = every request on the first adapter)")
    a("--adapters", type=int, default=d.adapters, help="synthetic adapters, loaded through the admin API")
    a("--config-adapters", action="store_true", help="mix over the adapters the config declares instead")
    a("--rank", type=int, default=d.rank, help="rank of the synthetic adapters")
    a("--targets", type=str_list, default=d.targets, help="projections of the synthetic adapters")
    a("--zipf", type=float, default=d.zipf, help="Zipf exponent of the zipf mix")
    a("--adapter-dir", default=None, help="write the synthetic adapters here and keep them (default: temp dir)")
    a("--prompt-len", type=int, default=d.prompt_len, help="mean prompt tokens")
    a("--prompt-dist", choices=LENGTH_DISTS, default=d.prompt_dist)
    a("--shared-prefix-len", type=int, default=d.shared_prefix_len,
      help="tokens of a fixed prefix before every prompt, one per adapter (a shared system prompt); 0 = none")
    a("--output-len", type=int, default=d.output_len, help="mean output tokens (exact per request: ignore_eos)")
    a("--output-dist", choices=LENGTH_DISTS, default=d.output_dist)
    a("--range-ratio", type=float, default=d.range_ratio, help="uniform lengths: mean·(1±r)")
    a("--compare-in-process", dest="compare_in_process", action="store_true", default=None,
      help="run the closed-loop rows again through the engine in this process (default when it starts the server)")
    a("--no-compare-in-process", dest="compare_in_process", action="store_false")
    a("--server-timeout-s", type=float, default=d.server_timeout_s, help="wait this long for /health")
    a("--request-timeout-s", type=float, default=d.request_timeout_s)
    a("--client-procs", type=int, default=d.client_procs,
      help="HTTP client processes (default 0: one per two cores, at most 8)")
    a("--cold-adapters", type=int, default=d.cold_adapters,
      help="run every row again while this many requests each name an adapter not loaded, resolved from "
           "--cold-source on first request (lora.resolver), and send as many at the same times to loaded "
           "adapters in the regular rows; reports the steady streams' p99 ITL ratio")
    a("--cold-source", default=d.cold_source,
      help="moto (start a local S3 API server) or an existing store's s3://BUCKET/PREFIX/{name} (default moto)")
    a("--cold-start-s", type=float, default=d.cold_start_s,
      help="first extra (cold or warm) request, into the measured requests")
    a("--cold-interval-s", type=float, default=d.cold_interval_s, help="between extra requests")
    a("--cold-output-len", type=int, default=d.cold_output_len, help="output tokens of an extra request")
    a("--tenant-rate", type=float, default=d.tenant_rate,
      help="run the two-tenant fairness mix instead of the load rows: each tenant's share in requests/s, "
           "which tenant B offers steadily (docs/tenants.md)")
    a("--tenant-flood", type=float, default=d.tenant_flood, help="what tenant A offers, in multiples of its share")
    a("--no-progress", dest="progress", action="store_false", help="no progress bars")
    _config_args(p)
    p.set_defaults(func=_bench_serve)
    return p


def _remote_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=None, help="server URL (default: http://server.host:server.port)")
    p.add_argument("--prune", choices=PRUNE_MODES, default=None,
                   help="live adapters the config does not list: owned = unload those the config declared, "
                        "keep admin-API loads; all = unload both; none = keep both (default: reconcile.prune)")
    p.add_argument("--no-prune", action="store_true", help="the same as --prune none")


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config-dir", default=None,
                   help="Hydra config dir: a whole tree with config.yaml, or an overrides dir without one, "
                        "layered over the packaged defaults (default: the packaged tree)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="Hydra overrides")


def _compose(args: argparse.Namespace) -> ApplianceConfig:
    from appliance.config.compose import compose_config

    return compose_config(args.config_dir, args.overrides)


def _validated(args: argparse.Namespace) -> Optional[Composed]:
    """The composed config when `appliance validate` finds nothing; else print each problem (values
    from the environment redacted) and return None."""
    from appliance.config.validate import validate_tree

    composed, problems = validate_tree(args.config_dir, args.overrides)
    for p in problems:
        print(f"error: {p}", file=sys.stderr)
    return None if problems else composed


def _validate(args: argparse.Namespace) -> int:
    composed = _validated(args)
    if composed is None:
        return 1
    cfg = composed.cfg
    print(composed.env.redact(f"valid: model {cfg.model.name} at {cfg.model.path}, {len(cfg.adapters)} adapter(s)"))
    return 0


def _plan(args: argparse.Namespace) -> int:
    from appliance.reconcile.plan import render

    got = _remote_plan(args)
    if got is None:
        return 1
    _, p, redact = got
    print(redact(render(p)))
    return 2 if (p.has_changes and args.detailed_exitcode) else 0


def _apply(args: argparse.Namespace) -> int:
    import asyncio

    from appliance.reconcile.apply import execute
    from appliance.reconcile.plan import render

    got = _remote_plan(args)
    if got is None:
        return 1
    client, p, redact = got
    print(redact(render(p)))
    if not p.actions:
        if p.restart:
            print("Nothing to apply live; restart the server for the settings above.")
        return 0
    if args.dry_run:
        print("Dry run: nothing applied.")
        return 0
    if not args.auto_approve:
        print(f"\nApply {len(p.actions)} action(s) to {client.url}? Only 'yes' is accepted: ", end="", flush=True)
        try:
            answer = input()
        except EOFError:
            answer = ""
        if answer.strip() != "yes":
            print("Apply cancelled: nothing changed.", file=sys.stderr)
            return 1
    results = asyncio.run(execute(p.actions, client))
    for r in results:
        print(redact(r.render()))
    failed = [r for r in results if not r.ok]
    print(f"Apply {'complete' if not failed else 'finished with errors'}: {len(results) - len(failed)} done, "
          f"{len(failed)} failed." + (" Restart the server for the settings marked '!'." if p.restart else ""))
    return 1 if failed else 0


def _status(args: argparse.Namespace) -> int:
    from appliance.reconcile.client import AdminClientError
    from appliance.reconcile.status import render_status

    cfg = _compose(args)
    client = _client(cfg, args.url)
    try:
        status, adapters = client.status(), client.adapters()
    except AdminClientError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(render_status(client.url, status, adapters))
    return 0


def _client(cfg: ApplianceConfig, url: Optional[str]):
    import os

    from appliance.reconcile.client import AdminClient

    # The entry point may read the environment (library code does not): the key for a server whose
    # config is not at hand.
    key = cfg.server.admin_key or os.environ.get("APPLIANCE_ADMIN_KEY")
    return AdminClient(url or f"http://{cfg.server.host}:{cfg.server.port}", key)


def _remote_plan(args: argparse.Namespace):
    """Validate the local config, read the server, plan: (client, plan, redact), or None once the
    config's problems or the server's error are printed. `redact` hides values from the environment
    in what is printed (the server already hides its own in /v1/status)."""
    from appliance.config.restart import restart_diff, restart_settings
    from appliance.reconcile.client import AdminClientError
    from appliance.reconcile.live import desired_state, live_adapters
    from appliance.reconcile.plan import plan

    composed = _validated(args)
    if composed is None:
        return None
    cfg, env = composed.cfg, composed.env
    client = _client(cfg, args.url)
    try:
        live = live_adapters(client.adapters())
        status = client.status()
    except AdminClientError as e:
        print(f"error: {e}", file=sys.stderr)
        return None
    restart = restart_diff(status["settings"], restart_settings(cfg, env=env), env) if status else []
    desired, broken = desired_state(cfg)
    prune = "none" if args.no_prune else (args.prune or cfg.reconcile.prune)
    return client, plan(desired, live, prune=prune, broken=broken, restart=restart), env.redact


def _serve(args: argparse.Namespace) -> int:
    from appliance.config.compose import resolve_config_dir

    cfg = _compose(args)
    from appliance.reconcile.controller import ConfigSource
    from appliance.server.run import serve  # lazy: pulls in torch, the engine and uvicorn

    from appliance.config.layers import is_overrides_dir

    cdir = resolve_config_dir(args.config_dir)
    serve(cfg, ConfigSource(cdir, tuple(args.overrides), layered=is_overrides_dir(cdir)))
    return 0


def _worker(args: argparse.Namespace) -> int:
    from appliance.parallel.launcher import run_node  # lazy: pulls in torch

    return run_node(_compose(args))


def _bench(args: argparse.Namespace) -> int:
    import dataclasses
    import shlex

    from appliance.bench.options import BenchOptions
    from appliance.bench.suite import run_bench

    fields = {f.name for f in dataclasses.fields(BenchOptions)}
    opts = BenchOptions(**{k: v for k, v in vars(args).items() if k in fields})
    # The inventory of the config is not what is benchmarked: the bench makes its own adapters.
    cfg = _compose(argparse.Namespace(config_dir=args.config_dir, overrides=["adapters=[]", *args.overrides]))
    return run_bench(cfg, opts, "appliance " + shlex.join(args.argv))


def _bench_serve(args: argparse.Namespace) -> int:
    import dataclasses
    import os
    import shlex

    from appliance.bench.serve import Keys, run_serve_bench
    from appliance.bench.serve_options import ADMIN_KEY_ENV, API_KEY_ENV, ServeOptions

    if args.concurrency is None:  # only the Poisson rows when only rates are given
        args.concurrency = [] if args.rate or args.tenant_rate else ServeOptions().concurrency
    fields = {f.name for f in dataclasses.fields(ServeOptions)}
    opts = ServeOptions(**{k: v for k, v in vars(args).items() if k in fields})
    # The entry point reads the environment (library code does not); keys never go on a command line.
    keys = Keys(os.environ.get(API_KEY_ENV), os.environ.get(ADMIN_KEY_ENV))
    return run_serve_bench(args.config_dir, args.overrides, opts, keys, "appliance " + shlex.join(args.argv))


def _train_demo(args: argparse.Namespace) -> int:
    from pathlib import Path

    from appliance.config.compose import compose_config
    from appliance.demo.train import main as train_main

    rest = list(args.rest)
    if "--model-dir" not in rest:
        # The model the config serves (model.path honours APPLIANCE_CACHE_DIR), not a fixed default.
        rest = ["--model-dir", str(Path(compose_config().model.path).expanduser())] + rest
    return train_main(rest)


def _prepare(args: argparse.Namespace) -> int:
    from appliance.models.prepare import prepare_model

    print(prepare_model(_compose(args).model, force=args.force))
    return 0


def _show(args: argparse.Namespace) -> int:
    import json

    from omegaconf import OmegaConf

    from appliance.config.compose import compose_tree

    composed = compose_tree(args.config_dir, args.overrides)
    data = _shown(composed)
    if args.diff:
        from appliance.config.layers import differences

        # Against the packaged tree with no overrides: what this dir and these overrides change.
        for key, (default, value) in differences(_shown(compose_tree(None, ())), data).items():
            print(composed.env.redact(f"{key}: {json.dumps(value)}  # default: {json.dumps(default)}"))
        return 0
    print(composed.env.redact(OmegaConf.to_yaml(data)), end="")
    return 0


def _shown(composed: "Composed") -> dict:
    """The config as plain data that may be printed: keys masked, values from the environment as
    <from env VAR>."""
    from omegaconf import OmegaConf

    cfg, env = composed.cfg, composed.env
    # Keys come from env interpolation or files; never echo them to a terminal or a CI log.
    cfg.server.api_keys = ["***"] * len(cfg.server.api_keys)
    if cfg.server.admin_key is not None:
        cfg.server.admin_key = "***"
    for tenant in cfg.tenants.values():
        tenant.keys = ["***"] * len(tenant.keys)
    cfg.tracing.headers = {k: "***" for k in cfg.tracing.headers}  # tokens for the trace collector
    data = env.mask_tree(OmegaConf.to_container(OmegaConf.structured(cfg)))  # the rest: <from env VAR>
    assert isinstance(data, dict)
    return data
