"""The adapter registry: which names the server answers to, and what each one points at.

Pure Python, no torch, no file access: the adapter reader (lora/adapter.py) validates a PEFT directory
and computes checksum, rank and targets; this class only records the result under a name. Every method
checks everything before it changes anything, so a refused call leaves the registry exactly as it was
(the admin API and the reconciler rely on that: a bad request must not half-apply).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Collection, Iterable

from appliance.lora.names import name_problem, shown


class LoRAStateError(Exception):
    """A refused LoRA operation. `status` is the HTTP code the admin API answers with:
    400 bad request (invalid name, pin limit), 404 unknown adapter, 409 conflicts with live state
    (duplicate name, adapter still has running requests)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class AdapterEntry:
    name: str
    path: str  # the resolved adapter directory
    pinned: bool
    id: int  # increasing, never reused: a re-added name gets a new id, so stale ids can't alias it
    checksum: str  # content hash of the weights, shown by /v1/adapters so the reconciler sees changes
    rank: int  # largest rank over the adapter's modules (rank_pattern included)
    target_modules: tuple[str, ...]
    base_model_name: str  # as the adapter's config states it; informational
    generation: int = 0  # bumped by every in-place reload
    revision: str = ""  # a remote adapter's revision (etag:..., commit:...); "" for a local dir

    @property
    def cache_key(self) -> str:
        """Key for the CPU tier (lora/cache.py). It carries the generation so that weights cached
        before an in-place reload can never be returned for the reloaded adapter."""
        return f"{self.name}@{self.generation}"


# Fields an in-place reload may change. name, id and generation are the registry's own bookkeeping.
_REPLACEABLE = frozenset({"path", "pinned", "checksum", "rank", "target_modules", "base_model_name", "revision"})


def check_name(name: str) -> None:
    """LoRAStateError 400 unless `name` follows the adapter name rule."""
    problem = name_problem(name)  # the one rule (lora/names.py), also applied to the YAML inventory
    if problem is not None:
        raise LoRAStateError(f"invalid adapter name {shown(name)}: {problem}", 400)


class Registry:
    """Adapter name -> AdapterEntry. Not thread-safe: its owner serialises calls. `published` is the
    exception: a tuple of the names, replaced whole on every change, so any thread may read it."""

    def __init__(self) -> None:
        self._entries: dict[str, AdapterEntry] = {}  # insertion order = id order
        self._next_id = 1
        self.published: tuple[str, ...] = ()

    def _publish(self) -> None:
        self.published = tuple(self._entries)

    def add(self, name: str, path: str, *, checksum: str, rank: int, target_modules: Iterable[str],
            base_model_name: str, pinned: bool = False, revision: str = "") -> AdapterEntry:
        check_name(name)
        if name in self._entries:
            raise LoRAStateError(f"adapter {name!r} is already loaded (from "
                                 f"{self._entries[name].path}); unload it first or use load_inplace", 409)
        entry = AdapterEntry(name=name, path=path, pinned=pinned, id=self._next_id, checksum=checksum,
                             rank=rank, target_modules=tuple(target_modules),
                             base_model_name=base_model_name, revision=revision)
        self._entries[name] = entry
        self._next_id += 1
        self._publish()
        return entry

    def get(self, name: str) -> AdapterEntry:
        entry = self._entries.get(name)
        if entry is None:
            raise LoRAStateError(f"adapter {shown(name)} is not loaded; loaded: {_listing(self._entries)}", 404)
        return entry

    def remove(self, name: str) -> AdapterEntry:
        entry = self.get(name)
        del self._entries[name]
        self._publish()
        return entry

    def replace(self, name: str, /, **changes: object) -> AdapterEntry:
        """In-place reload: same name and id, new fields, generation + 1 (even if nothing else changed:
        the weights were read again and must not be served from a cache of the old generation)."""
        old = self.get(name)
        bad = sorted(set(changes) - _REPLACEABLE)
        if bad:
            raise LoRAStateError(f"replace({name!r}): cannot change {', '.join(bad)}; "
                                 f"changeable: {', '.join(sorted(_REPLACEABLE))}", 400)
        if "target_modules" in changes:
            changes["target_modules"] = tuple(changes["target_modules"])  # type: ignore[arg-type]
        new = dataclasses.replace(old, generation=old.generation + 1, **changes)  # type: ignore[arg-type]
        self._entries[name] = new
        return new

    def restore(self, entry: AdapterEntry) -> None:
        """Put back an entry exactly as it was (same id and generation): the rollback of a `replace` or
        `remove` whose follow-up step failed. Only entries this registry issued, and never over another
        entry, so ids stay unique."""
        current = self._entries.get(entry.name)
        if current is not None and current.id != entry.id:
            raise LoRAStateError(f"restore({entry.name!r}): the name now belongs to adapter id "
                                 f"{current.id}, not {entry.id}", 409)
        if current is None and (entry.id >= self._next_id
                                or any(e.id == entry.id for e in self._entries.values())):
            raise LoRAStateError(f"restore({entry.name!r}): id {entry.id} was not issued to it here", 409)
        self._entries[entry.name] = entry
        self._publish()

    def set_pinned(self, name: str, pinned: bool) -> AdapterEntry:
        """Change only the pinned flag: no reload, so the generation stays."""
        new = dataclasses.replace(self.get(name), pinned=pinned)
        self._entries[name] = new
        return new

    def names(self) -> list[str]:
        return list(self._entries)

    def entries(self) -> list[AdapterEntry]:
        return list(self._entries.values())

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def resolve_model(self, model: str, base_name: str) -> str | None:
        return resolve_model_name(model, base_name, self._entries)



def resolve_model_name(model: str, base_name: str, names: Collection[str]) -> str | None:
    """Map an OpenAI `model` to an adapter name among `names`, or None for the base model.

    Accepted: the base name; an adapter name; "<base>:<adapter>". The base name wins over an
    adapter of the same name. The split is at the last ':' because base names may contain one
    (e.g. "llama3:8b") while adapter names may not. Unknown: LoRAStateError 404.
    """
    if model == base_name:
        return None
    if model in names:
        return model
    base, sep, adapter = model.rpartition(":")
    if sep:
        if base != base_name:
            raise LoRAStateError(f"model {shown(model)}: base {shown(base)} is not served here "
                                 f"(the base model is {base_name!r})", 404)
        if adapter in names:
            return adapter
        raise LoRAStateError(f"model {shown(model)}: adapter {shown(adapter)} is not loaded; "
                             f"loaded: {_listing(names)}", 404)
    raise LoRAStateError(f"model {shown(model)} is neither the base model {base_name!r} nor a "
                         f"loaded adapter; loaded: {_listing(names)}", 404)


def _listing(names: Collection[str], limit: int = 20) -> str:
    """At most `limit` names (each at most MAX_NAME_CHARS long), so a 404 stays small."""
    listed = list(names)
    if not listed:
        return "none"
    more = f" (+{len(listed) - limit} more; GET /v1/models lists them all)" if len(listed) > limit else ""
    return ", ".join(listed[:limit]) + more
