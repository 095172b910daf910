"""Bounds on the YAML of a config dir, checked before Hydra composes it.

OmegaConf builds a Python object per YAML node (about 0.5 ms each on a busy CPU) and expands every
alias into a copy, so a small file can cost minutes and gigabytes: a 306-byte alias bomb took 111 s
and +1.3 GB, a 1 MiB list 84 s, and a 50 MiB comment 14-30 s just to read. Before composing, every
`*.yaml` / `*.yml` under the config dir (symlinked dirs followed, once each) is read once and checked:

- at most MAX_FILE_BYTES bytes (from its size, nothing read; a file that grows while read is cut
  at one byte more and refused too), a regular file;
- at most MAX_NODES YAML nodes in all the files together, aliases counted as the nodes they expand
  to, found from libyaml's event stream (no object is built, an alias costs one lookup).

A file beyond either is a ConfigError that names it. The bytes checked are copied into a private
snapshot dir, and Hydra composes that: a file saved between the check and the compose (a hot
reload's rename-save) cannot put unchecked bytes into the compose; it waits for the next reconcile.
The limits are constants, not config keys: they guard the parsing of the config itself. Real trees are far below them (the shipped one: about 300
nodes; an inventory of 1,000 adapters with three keys each: about 4,000).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import yaml

from appliance.config.schema import ConfigError

MAX_FILE_BYTES = 1024 * 1024
MAX_NODES = 20_000


def snapshot_config_files(config_dir: Path, dest: Path) -> None:
    """Every config file under `config_dir`, read once, checked, and written to the same relative
    path under `dest`; ConfigError naming the first file beyond the limits above."""
    files = [(f, _read_bounded(f)) for f in _yaml_files(config_dir)]
    total = 0
    for f, data in files:
        if data is None:
            continue  # removed since the listing: the compose goes without it, as it would a moment later
        total += _expanded_nodes(f, data, MAX_NODES - total)
    for f, data in files:
        if data is not None:
            out = dest / f.relative_to(config_dir)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(data)


def _yaml_files(root: Path) -> list[Path]:
    """*.yaml / *.yml under `root`, following symlinked dirs (a Kubernetes ConfigMap mounts its files
    through them) but entering each real dir once, so a symlink loop ends."""
    out: list[Path] = []
    seen: set[tuple[int, int]] = set()
    stack = [root]
    while stack:
        d = stack.pop()
        try:
            st = d.stat()
            entries = sorted(d.iterdir())
        except FileNotFoundError:
            continue
        if (st.st_dev, st.st_ino) in seen:
            continue
        seen.add((st.st_dev, st.st_ino))
        for p in entries:
            if p.is_dir():
                stack.append(p)
            elif p.suffix in (".yaml", ".yml") and p.is_file():
                out.append(p)
    return sorted(out)


def _read_bounded(path: Path) -> bytes | None:
    """The file's bytes through one descriptor (None if it is gone); ConfigError beyond MAX_FILE_BYTES
    or when it is no regular file (a FIFO would block the read)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{path}: not a regular file")
        if st.st_size > MAX_FILE_BYTES:
            raise ConfigError(f"{path}: {st.st_size} bytes; a config file may hold at most {MAX_FILE_BYTES} "
                              "(config/file_limits.py)")
        data = f.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError(f"{path}: more than {MAX_FILE_BYTES} bytes; a config file may hold at most "
                          f"{MAX_FILE_BYTES} (config/file_limits.py)")
    return data


def _expanded_nodes(path: Path, data: bytes, budget: int) -> int:
    """YAML nodes of `data` (read from `path`) with aliases expanded; ConfigError as soon as they pass
    `budget`."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    sizes: dict[str, int] = {}  # anchor -> nodes it stands for
    open_: list[tuple[str | None, int]] = []  # collections being read: (anchor, count at their start)
    count = 0
    try:
        for ev in yaml.parse(data, Loader=loader):
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
