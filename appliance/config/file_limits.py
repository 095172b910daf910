"""Bounds on the YAML of a config dir, checked before Hydra composes it.

OmegaConf builds a Python object per YAML node (about 0.5 ms each on a busy CPU) and expands every
alias into a copy, so a small file can cost minutes and gigabytes: a 306-byte alias bomb took 111 s
and +1.3 GB, a 1 MiB list 84 s, and a 50 MiB comment 14-30 s just to read. Before composing, every
`*.yaml` / `*.yml` under the config dir is checked:

- at most MAX_FILE_BYTES bytes (from its size, nothing read);
- at most MAX_NODES YAML nodes in all the files together, aliases counted as the nodes they expand
  to, found from libyaml's event stream (no object is built, an alias costs one lookup).

A file beyond either is a ConfigError that names it. The limits are constants, not config keys: they
guard the parsing of the config itself. Real trees are far below them (the shipped one: about 300
nodes; an inventory of 1,000 adapters with three keys each: about 4,000).
"""

from __future__ import annotations

from pathlib import Path

import yaml

from appliance.config.schema import ConfigError

MAX_FILE_BYTES = 1024 * 1024
MAX_NODES = 20_000


def check_config_files(config_dir: Path) -> None:
    """ConfigError naming the first file under `config_dir` beyond the limits above."""
    files = sorted(p for p in config_dir.rglob("*") if p.suffix in (".yaml", ".yml") and p.is_file())
    for f in files:
        size = f.stat().st_size
        if size > MAX_FILE_BYTES:
            raise ConfigError(f"{f}: {size} bytes; a config file may hold at most {MAX_FILE_BYTES} "
                              "(config/file_limits.py)")
    total = 0
    for f in files:
        total += _expanded_nodes(f, MAX_NODES - total)


def _expanded_nodes(path: Path, budget: int) -> int:
    """YAML nodes of `path` with aliases expanded; ConfigError as soon as they pass `budget`."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    sizes: dict[str, int] = {}  # anchor -> nodes it stands for
    open_: list[tuple[str | None, int]] = []  # collections being read: (anchor, count at their start)
    count = 0
    try:
        with open(path, "rb") as stream:
            for ev in yaml.parse(stream, Loader=loader):
                if isinstance(ev, yaml.AliasEvent):
                    count += sizes.get(ev.anchor, 1)
                elif isinstance(ev, yaml.ScalarEvent):
                    count += 1
                    if ev.anchor is not None:
                        sizes[ev.anchor] = 1
                elif isinstance(ev, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
                    count += 1
                    open_.append((ev.anchor, count - 1))
                elif isinstance(ev, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
                    anchor, start = open_.pop()
                    if anchor is not None:
                        sizes[anchor] = count - start
                if count > budget:
                    raise ConfigError(f"{path}: more than {MAX_NODES} YAML nodes in the config dir (aliases "
                                      "counted expanded); a config may hold at most that many "
                                      "(config/file_limits.py)")
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: {' '.join(str(e).split())}") from None
    return count
