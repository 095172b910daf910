"""One read of an adapter directory's two files, through descriptors confined to lora.adapter_roots.

The files may change between any two system calls, so nothing is opened by a name that was not just
checked, and nothing is read twice: the directory is opened component by component from its root with
O_NOFOLLOW (a swapped-in symlink fails with ELOOP), files relative to it (symlink targets resolved and
opened the same way from their root); sizes are checked before reading and the safetensors header is
validated (`check`) before the body. Everything after comes from these bytes: what is checked is loaded.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import mmap
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT writes ~1 KB; a rank_pattern naming every module of a 100-layer model is ~60 KB.
MAX_CONFIG_BYTES = 1 << 20
MAX_HEADER_BYTES = 4 << 20  # the safetensors JSON header: ~150 bytes a tensor (the format allows 100 MB)
MAX_JSON_DEPTH = 32  # PEFT configs nest 3 deep; deeper is refused before json parses it (no RecursionError)
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4,
                "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1}
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)  # a JSON string (the unrolled loop: linear)
_BRACKETS = str.maketrans({c: None for c in map(chr, range(128)) if c not in "[]{}"})

T = TypeVar("T")


class AdapterError(ValueError):
    """An adapter directory that cannot be served; the message names the file/key (HTTP 400)."""


@dataclass(frozen=True)
class TensorInfo:
    dtype: str  # safetensors dtype name, "F32", "BF16", ...
    shape: tuple[int, ...]
    begin: int = 0  # its bytes are body[begin:end] (data_offsets, checked to tile the body)
    end: int = 0


@dataclass(frozen=True)
class AdapterFiles:
    path: Path  # the directory's real path (inside a root)
    config_bytes: bytes
    config: dict[str, Any]
    header_bytes: bytes  # adapter_model.safetensors' first 8 + n bytes: the length, then the JSON header
    tensors: dict[str, TensorInfo]  # the parsed header: name -> dtype, shape, span of `body`
    body: bytearray | mmap.mmap  # the rest of the file: every tensor's bytes (read once, never copied whole)

    @property
    def checksum(self) -> str:
        """sha256 of adapter_config.json's bytes then adapter_model.safetensors' bytes."""
        h = hashlib.sha256(self.config_bytes)
        h.update(self.header_bytes)
        h.update(self.body)  # hashlib releases the GIL over large buffers
        return h.hexdigest()


def resolve_adapter_path(path: str | os.PathLike, roots: Sequence[str]) -> Path:
    """The real directory `path` names, refused unless it lies inside one of `roots`.

    Symlinks and `..` are resolved first, so neither can escape a root; nothing is read. This is the
    check; `read_adapter_files` opens what it returns without following any symlink."""
    real, _ = _confine(path, roots, what=str(path))
    if not real.exists():
        raise AdapterError(f"{path}: does not exist")
    if not real.is_dir():
        raise AdapterError(f"{path}: is not a directory (expected a PEFT adapter directory)")
    return real


def read_adapter_files(path: str | os.PathLike, roots: Sequence[str],
                       check: Callable[[dict[str, Any], dict[str, TensorInfo], Path], T]) -> tuple[AdapterFiles, T]:
    """Read the adapter dir at `path` once (module docstring). `check(config, header, weights_path)` runs
    after the header is read and before the body is; it raises AdapterError to refuse, and what it
    returns is handed back beside the files."""
    real = resolve_adapter_path(path, roots)
    dir_fd = _open_confined(real, _root_of(real, roots, str(path)), os.O_RDONLY | os.O_DIRECTORY, str(path))
    try:
        cfg_path, wpath = real / CONFIG_FILE, real / WEIGHTS_FILE
        cfg_fd = _open_in_dir(dir_fd, real, CONFIG_FILE, roots)
        if cfg_fd is None:
            raise AdapterError(f"{real}: no {CONFIG_FILE} (not a PEFT adapter directory)")
        try:
            cfg_bytes = _read_bounded(cfg_fd, cfg_path, MAX_CONFIG_BYTES)
        finally:
            os.close(cfg_fd)
        config = load_json(cfg_bytes, cfg_path)
        if not isinstance(config, dict):
            raise AdapterError(f"{cfg_path}: expected a JSON object, got {type(config).__name__}")
        w_fd = _open_in_dir(dir_fd, real, WEIGHTS_FILE, roots)
        if w_fd is None:
            names = os.listdir(dir_fd)
            if any(n.endswith((".bin", ".pt")) for n in names):
                raise AdapterError(f"{real}: only pickle weights (adapter_model.bin) found; pickle is never "
                                   "read: save the adapter with safe_serialization=True")
            raise AdapterError(f"{real}: no {WEIGHTS_FILE}")
        try:
            head, header, body, checked = _read_safetensors(w_fd, wpath, lambda h: check(config, h, wpath))
        finally:
            os.close(w_fd)
    except OSError as e:  # fstat, listdir: what the helpers do not name themselves
        raise AdapterError(f"{real}: cannot read: {e}") from e
    finally:
        os.close(dir_fd)
    return AdapterFiles(real, cfg_bytes, config, head, header, body), checked


def load_json(raw: bytes, where: Path) -> Any:
    """JSON from bytes, refused with AdapterError (never RecursionError) when nested deeper than
    MAX_JSON_DEPTH: the depth is counted on the brackets outside strings before json sees the text."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise AdapterError(f"{where}: not valid JSON: {e}") from e
    depth = 0
    opened = text.count("[") + text.count("{")
    for c in _STRING.sub("", text).translate(_BRACKETS) if opened > MAX_JSON_DEPTH else "":
        depth += 1 if c in "[{" else -1 if c in "]}" else 0  # (non-ASCII outside strings: invalid anyway)
        if depth > MAX_JSON_DEPTH:
            raise AdapterError(f"{where}: JSON nested deeper than {MAX_JSON_DEPTH} levels; refused")
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, ints over Python's digit limit
        raise AdapterError(f"{where}: not valid JSON: {e}") from e


# ------------------------------------------------------------------ internals

def _confine(path: str | os.PathLike, roots: Sequence[str], what: str) -> tuple[Path, Path]:
    """(real path, the real root holding it), or AdapterError."""
    if not roots:
        raise AdapterError(f"{what}: refused: lora.adapter_roots is empty, so no adapter path is allowed")
    if not str(path).strip():
        raise AdapterError("adapter path is empty")
    try:
        real = Path(path).expanduser().resolve(strict=False)
    except (OSError, RuntimeError, ValueError) as e:  # symlink loop, NUL byte, unknown ~user
        raise AdapterError(f"{what}: cannot resolve: {e}") from e
    return real, _root_of(real, roots, what)


def _root_of(real: Path, roots: Sequence[str], what: str) -> Path:
    """The real root that holds the (already resolved) `real`, which is not resolved again."""
    try:
        real_roots = [Path(r).expanduser().resolve(strict=False) for r in roots]
    except (OSError, RuntimeError, ValueError) as e:
        raise AdapterError(f"{what}: cannot resolve lora.adapter_roots: {e}") from e
    for r in real_roots:
        if real.is_relative_to(r):
            return r
    raise AdapterError(f"{what}: resolves to {real}, outside lora.adapter_roots {list(roots)}")


def _open_confined(real: Path, root: Path, flags: int, what: str) -> int:
    """A descriptor of `real` (a resolved path inside the real `root`, both checked by _confine), opened
    from the root one component at a time without following symlinks: the object opened is the one at
    the checked path, or none. `real` is not resolved again."""
    parts = real.relative_to(root).parts
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise AdapterError(f"{what}: cannot open adapter root {root}: {e.strerror}") from e
    try:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            f = (flags if last else os.O_RDONLY | os.O_DIRECTORY) | os.O_NOFOLLOW | os.O_CLOEXEC
            nxt = os.open(part, f, dir_fd=fd)
            os.close(fd)
            fd = nxt
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise AdapterError(f"{what}: {real} changed while it was opened (a symlink or a file where the "
                               "checked directory was); refused") from e
        raise AdapterError(f"{what}: cannot open: {e.strerror}") from e
    return fd


def _open_in_dir(dir_fd: int, real_dir: Path, name: str, roots: Sequence[str]) -> int | None:
    """A descriptor of the regular file `name` in the opened directory (None: there is none). A symlink
    is followed only to a target inside the roots, opened from its root like the directory was."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC  # non-blocking: a FIFO must not hang the open
    try:
        fd = os.open(name, flags | os.O_NOFOLLOW, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise AdapterError(f"{real_dir / name}: cannot read: {e.strerror}") from e
        try:
            link = os.readlink(name, dir_fd=dir_fd)
            target = (real_dir / link).resolve(strict=True)
        except FileNotFoundError:
            return None
        except (OSError, RuntimeError) as e2:
            raise AdapterError(f"{real_dir / name}: cannot resolve: {e2}") from e2
        try:
            _, root = _confine(target, roots, str(real_dir / name))
        except AdapterError as e2:
            raise AdapterError(f"{real_dir}: {name} resolves to {target}, outside lora.adapter_roots "
                               f"{list(roots)}") from e2
        fd = _open_confined(target, root, flags, str(real_dir / name))
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise AdapterError(f"{real_dir}: no {name} (what has that name is not a regular file)")
    return fd


def _read_exact(fd: int, n: int, where: Path) -> bytes:
    return bytes(_read_into(fd, n, where))


def _read_into(fd: int, n: int, where: Path) -> bytearray | mmap.mmap:
    """Exactly `n` bytes, read straight into the buffer returned. Anonymous memory, not bytearray(n),
    whose zero-fill would hold the GIL: its pages are faulted in by os.readv, which runs without it."""
    buf = mmap.mmap(-1, n) if n else bytearray()
    view = memoryview(buf)
    got = 0
    try:
        while got < n:
            k = os.readv(fd, [view[got:]])
            if k == 0:
                raise AdapterError(f"{where}: corrupt or truncated: ended after {got} of {n} bytes")
            got += k
    except OSError as e:
        raise AdapterError(f"{where}: cannot read: {e.strerror}") from e
    return buf


def _at_eof(fd: int, where: Path) -> None:
    try:
        extra = os.read(fd, 1)
    except OSError as e:
        raise AdapterError(f"{where}: cannot read: {e.strerror}") from e
    if extra:
        raise AdapterError(f"{where}: grew while it was read; refused")


def _read_bounded(fd: int, where: Path, limit: int) -> bytes:
    size = os.fstat(fd).st_size
    if size > limit:
        raise AdapterError(f"{where}: {size} bytes, more than the {limit} an adapter config may have")
    data = _read_exact(fd, size, where)
    _at_eof(fd, where)
    return data


def _read_safetensors(fd: int, where: Path, check: Callable[[dict[str, TensorInfo]], T]
                      ) -> tuple[bytes, dict[str, TensorInfo], bytearray | mmap.mmap, T]:
    """The file read through `fd` once: the 8-byte header length, the header (parsed and `check`ed),
    then exactly the body the header declares (the file's size must match it). Returns (length +
    header bytes, parsed header, body, what `check` returned)."""
    size = os.fstat(fd).st_size
    if size < 8:
        raise AdapterError(f"{where}: corrupt or truncated safetensors: {size} bytes")
    head = _read_exact(fd, 8, where)
    n = int.from_bytes(head, "little")
    if n > min(MAX_HEADER_BYTES, size - 8):
        raise AdapterError(f"{where}: corrupt or truncated safetensors: header of {n} bytes in a file of {size}")
    raw = _read_exact(fd, n, where)
    header, body = _parse_header(raw, where)
    checked = check(header)  # shapes within the model's and max_lora_rank: `body` is bounded by them
    if size < 8 + n + body:
        raise AdapterError(f"{where}: corrupt or truncated safetensors: {size} bytes, but its header declares "
                           f"{8 + n + body}")
    if size > 8 + n + body:  # bytes no tensor covers: refused unread, whatever their size
        raise AdapterError(f"{where}: {size} bytes, more than the {8 + n + body} its header declares; refused")
    data = _read_into(fd, body, where)
    _at_eof(fd, where)
    return head + raw, header, data, checked


def _parse_header(raw: bytes, where: Path) -> tuple[dict[str, TensorInfo], int]:
    """Tensor name -> TensorInfo, and the body's size; the tensors must tile the body exactly."""
    obj = load_json(raw, where)
    if not isinstance(obj, dict):
        raise AdapterError(f"{where}: corrupt safetensors header (not a JSON object)")
    out: dict[str, TensorInfo] = {}
    spans: list[tuple[int, int, str]] = []
    for key, v in obj.items():
        if key == "__metadata__":
            continue
        bad = f"{where}: corrupt safetensors header: {key!r}"
        if not isinstance(v, dict) or v.get("dtype") not in _DTYPE_BYTES:
            raise AdapterError(f"{bad}: missing or unknown dtype")
        shape, offs = v.get("shape"), v.get("data_offsets")
        if (not isinstance(shape, list) or len(shape) > 8
                or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
            raise AdapterError(f"{bad}: shape {shape!r}")
        if (not isinstance(offs, list) or len(offs) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)):
            raise AdapterError(f"{bad}: data_offsets {offs!r}")
        if offs[1] - offs[0] != math.prod(shape) * _DTYPE_BYTES[v["dtype"]]:
            raise AdapterError(f"{bad}: data_offsets {offs} do not hold shape {shape} of {v['dtype']}")
        out[key] = TensorInfo(v["dtype"], tuple(shape), offs[0], offs[1])
        spans.append((offs[0], offs[1], key))
    pos = 0
    for start, end, key in sorted(spans):
        if start != pos:
            raise AdapterError(f"{where}: corrupt safetensors header: {key!r} starts at {start}, expected {pos}")
        pos = end
    return out, pos
