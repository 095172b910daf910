"""Tuned launch tiles as data: one JSON file per device in kernels/configs/, entries keyed by shape.

Pure Python (no torch, no triton): the launchers ask `for_device(name)` with the device's name
(`torch.cuda.get_device_name`, or "cpu" for the interpreter); `NVIDIA H200` reads NVIDIA_H200.json,
a device without a file reads default.json. Format and how to add a device: docs/performance.md.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

CONFIG_DIR = Path(__file__).with_name("configs")
DEFAULT_FILE = "default.json"


@dataclasses.dataclass(frozen=True)
class GemmTiles:
    """lora_gemm's launch configuration; block_n shrinks to divide the slice boundaries."""

    block_m: int  # BLOCK_M rows of a tile
    block_n: int  # BLOCK_N columns of a tile (at most)
    block_k: int  # BLOCK_K, the main loop's K step
    num_warps: int
    num_stages: int  # the main loop's pipeline depth
    group_m: Optional[int] = None  # row tiles sweeping the columns together; None = GemmRules
    persistent: Optional[bool] = None  # None = for outputs over GemmRules.persistent_min_out columns
    block_ks: Optional[int] = None  # the fused shrink's K step; None = block_k
    shrink_stages: Optional[int] = None  # its pipeline depth; None = 4 where A's block is <= 32 rows, else 3


@dataclasses.dataclass(frozen=True)
class GemmRules:
    """How lora_gemm fills a GemmTiles' None fields from the output's shape."""

    persistent_min_out: int  # a persistent grid for outputs wider than this many columns
    group_m: int  # row tiles grouped to sweep the columns together
    group_m_wide: int  # ... on a grid of at least wide_min_col_tiles column tiles, one tile a program
    wide_min_col_tiles: int


@dataclasses.dataclass(frozen=True)
class ApplyTiles:
    """lora_apply's TMA body: the default K and column steps, pipeline depth and warps."""

    block_k: int
    block_n: int
    num_stages: int
    num_warps: int


@dataclasses.dataclass(frozen=True)
class GemmLaunch:
    """What lora_gemm launches with for one shape: every choice resolved."""

    block_m: int
    block_n: int  # 0: no column tile divides the slice boundaries
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int
    persistent: bool
    block_ks: int
    shrink_stages: int


@dataclasses.dataclass(frozen=True)
class DeviceTiles:
    """One device file, validated."""

    path: Path
    gemm_default: GemmTiles
    gemm_rules: GemmRules
    gemm_shapes: Mapping[tuple[int, int], GemmTiles]  # (N, K) -> tiles
    apply_tma: ApplyTiles

    def gemm(self, N: int, K: int) -> GemmTiles:
        """lora_gemm's tiles for an [N, K] weight: its shape's entry, else the file's default."""
        return self.gemm_shapes.get((N, K), self.gemm_default)

    def gemm_launch(self, tiles: GemmTiles, out_offsets: Sequence[int], R: int) -> GemmLaunch:
        """`tiles` resolved for an output sliced at out_offsets and a max rank R."""
        N, n = out_offsets[-1], len(out_offsets) - 1
        rules = self.gemm_rules
        persistent = N > rules.persistent_min_out if tiles.persistent is None else tiles.persistent
        block_n = block_n_for(out_offsets, tiles.block_n)
        group_m = tiles.group_m
        if group_m is None:
            wide = block_n and -(-N // block_n) >= rules.wide_min_col_tiles and not persistent
            group_m = rules.group_m_wide if wide else rules.group_m
        shrink_stages = tiles.shrink_stages
        if shrink_stages is None:
            shrink_stages = 4 if max(16, _next_pow2(n * R)) <= 32 else 3
        return GemmLaunch(tiles.block_m, block_n, tiles.block_k, tiles.num_warps, tiles.num_stages, group_m,
                          persistent, tiles.block_ks or tiles.block_k, shrink_stages)


def block_n_for(out_offsets: Sequence[int], block_n: int) -> int:
    """The widest power-of-two BLOCK_N <= block_n (>= 16) dividing every inner slice boundary, or 0."""
    bounds = list(out_offsets[1:-1])
    while block_n >= 16:
        if all(o % block_n == 0 for o in bounds):
            return block_n
        block_n //= 2
    return 0


def _next_pow2(v: int) -> int:
    return 1 << max(v - 1, 0).bit_length()


def file_stem(device_name: str) -> str:
    """`NVIDIA H200` -> `NVIDIA_H200`: the device's file name without .json."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", device_name.strip())


@functools.lru_cache(maxsize=None)
def for_device(device_name: str, config_dir: Path = CONFIG_DIR) -> DeviceTiles:
    """The tiles for a device by name: its own file when there is one, else default.json."""
    path = config_dir / f"{file_stem(device_name)}.json"
    return load(path if path.is_file() else config_dir / DEFAULT_FILE)


def load(path: Path) -> DeviceTiles:
    """Read and validate one device file; a bad entry raises ValueError naming the file and the key."""
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read tile config: {e}") from None
    where = _Where(path)
    top = where.mapping(raw, "", {"lora_gemm", "lora_apply_tma"})
    gemm = where.mapping(top["lora_gemm"], "lora_gemm", {"default", "rules", "shapes"}, optional={"shapes"})
    default = where.build(GemmTiles, gemm["default"], "lora_gemm.default")
    shapes = {}
    for key, entry in where.mapping(gemm.get("shapes", {}), "lora_gemm.shapes", None).items():
        m = re.fullmatch(r"N=(\d+),K=(\d+)", key)
        if m is None:
            raise ValueError(f"{path}: lora_gemm.shapes.{key}: a shape key is 'N=<out>,K=<in>'")
        merged = {**dataclasses.asdict(default), **where.mapping(entry, f"lora_gemm.shapes.{key}", None)}
        shapes[(int(m[1]), int(m[2]))] = where.build(GemmTiles, merged, f"lora_gemm.shapes.{key}")
    return DeviceTiles(Path(path), default, where.build(GemmRules, gemm["rules"], "lora_gemm.rules"), shapes,
                       where.build(ApplyTiles, top["lora_apply_tma"], "lora_apply_tma"))


class _Where:
    """Validation that names the file and the key path in every error."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def fail(self, key: str, msg: str) -> ValueError:
        return ValueError(f"{self.path}: {key or '<top>'}: {msg}")

    def mapping(self, value: Any, key: str, allowed: Optional[set], optional: frozenset = frozenset()) -> dict:
        if not isinstance(value, dict):
            raise self.fail(key, f"expected an object, got {type(value).__name__}")
        if allowed is not None:
            unknown, missing = set(value) - allowed, allowed - set(value) - set(optional)
            if unknown:
                raise self.fail(key, f"unknown key(s) {sorted(unknown)} (known: {sorted(allowed)})")
            if missing:
                raise self.fail(key, f"missing key(s) {sorted(missing)}")
        return value

    def build(self, cls: type, value: Any, key: str) -> Any:
        fields = {f.name: f for f in dataclasses.fields(cls)}
        required = {n for n, f in fields.items() if f.default is dataclasses.MISSING}
        value = self.mapping(value, key, set(fields), optional=frozenset(set(fields) - required))
        for name, v in value.items():
            want_bool = name == "persistent"
            ok = isinstance(v, bool) if want_bool else (isinstance(v, int) and not isinstance(v, bool) and v > 0)
            if not ok and not (v is None and name not in required):
                kind = "true, false or null" if want_bool else "a positive integer" + \
                    ("" if name in required else " or null")
                raise self.fail(f"{key}.{name}", f"expected {kind}, got {v!r}")
        return cls(**value)
