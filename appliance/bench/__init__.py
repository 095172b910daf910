"""`appliance bench`: offline and online benchmarks of the engine on the configured model, with synthetic
PEFT adapters, transformers / peft baselines where importable, and a table + JSON + PNG report.

adapters.py (synthetic PEFT dirs), workload.py (prompts, Poisson arrivals, Zipf popularity),
offline.py (throughput sweep, decode-step floor, prefill), online.py (AsyncEngine under open-loop load),
baselines.py (transformers generate, peft mixed-adapter generate), report.py (table, JSON, plots),
suite.py (options, the phases in order, engine construction).
"""
