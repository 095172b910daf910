"""Registry: names, ids, in-place reload, `model` resolution; refused calls change nothing."""

import pytest

from appliance.lora.registry import AdapterEntry, LoRAStateError, Registry, resolve_model_name

BASE = "SmolLM2-135M-Instruct"


def add(reg: Registry, name: str, **kw) -> AdapterEntry:
    fields = dict(checksum=f"sha-{name}", rank=8, target_modules=["q_proj", "v_proj"],
                  base_model_name=BASE)
    fields.update(kw)
    return reg.add(name, f"/adapters/{name}", **fields)


def snapshot(reg: Registry):
    return reg.entries(), reg.names(), len(reg)


def refused(reg: Registry, status: int, call, *args, **kwargs) -> LoRAStateError:
    before = snapshot(reg)
    with pytest.raises(LoRAStateError) as e:
        call(*args, **kwargs)
    assert e.value.status == status
    assert snapshot(reg) == before
    return e.value


@pytest.fixture
def reg() -> Registry:
    r = Registry()
    add(r, "sql")
    add(r, "chat", pinned=True)
    return r


def test_add_and_get(reg):
    e = reg.get("sql")
    assert e == AdapterEntry(name="sql", path="/adapters/sql", pinned=False, id=1, checksum="sha-sql",
                             rank=8, target_modules=("q_proj", "v_proj"), base_model_name=BASE,
                             generation=0)
    assert reg.get("chat").id == 2 and reg.get("chat").pinned
    assert reg.names() == ["sql", "chat"] and "sql" in reg and "x" not in reg
    assert e.cache_key == "sql@0"


def test_ids_are_never_reused(reg):
    reg.remove("chat")
    assert add(reg, "chat").id == 3
    refused(reg, 409, add, reg, "sql")
    assert add(reg, "new").id == 4  # the refused add consumed no id


def test_duplicate_name_is_409_and_changes_nothing(reg):
    err = refused(reg, 409, add, reg, "sql", rank=4)
    assert "already loaded" in str(err) and "load_inplace" in str(err)


@pytest.mark.parametrize("name", ["", " sql", "base:x", "a:b"])
def test_invalid_names_are_400(reg, name):
    refused(reg, 400, add, reg, name)


def test_unknown_name_is_404(reg):
    err = refused(reg, 404, reg.get, "nope")
    assert "'nope' is not loaded" in str(err) and "sql, chat" in str(err)
    refused(reg, 404, reg.remove, "nope")
    refused(reg, 404, reg.replace, "nope", rank=4)
    refused(reg, 404, reg.set_pinned, "nope", True)


def test_remove(reg):
    assert reg.remove("sql").name == "sql"
    assert reg.names() == ["chat"]


def test_replace_keeps_name_and_id_and_bumps_generation(reg):
    new = reg.replace("sql", path="/adapters/sql-v2", checksum="sha-2", rank=16,
                      target_modules=["q_proj"])
    assert (new.name, new.id, new.generation) == ("sql", 1, 1)
    assert (new.path, new.checksum, new.rank, new.target_modules) == ("/adapters/sql-v2", "sha-2", 16,
                                                                      ("q_proj",))
    assert reg.get("sql") == new and new.cache_key == "sql@1"
    assert reg.replace("sql").generation == 2  # a reload re-reads weights even if nothing changed
    assert reg.names() == ["sql", "chat"]


@pytest.mark.parametrize("field", ["name", "id", "generation", "colour"])
def test_replace_refuses_bookkeeping_fields(reg, field):
    err = refused(reg, 400, reg.replace, "sql", rank=4, **{field: 99})
    assert field in str(err)


def test_set_pinned_keeps_generation(reg):
    e = reg.set_pinned("sql", True)
    assert e.pinned and e.generation == 0 and reg.get("sql").pinned


def test_resolve_model(reg):
    assert reg.resolve_model(BASE, BASE) is None
    assert reg.resolve_model("sql", BASE) == "sql"
    assert reg.resolve_model(f"{BASE}:chat", BASE) == "chat"
    err = refused(reg, 404, reg.resolve_model, "nope", BASE)
    assert BASE in str(err) and "sql" in str(err)
    err = refused(reg, 404, reg.resolve_model, "other-base:sql", BASE)
    assert "'other-base' is not served" in str(err)
    err = refused(reg, 404, reg.resolve_model, f"{BASE}:nope", BASE)
    assert "'nope' is not loaded" in str(err)


def test_resolve_model_base_with_colon():
    reg = Registry()
    add(reg, "sql")
    assert reg.resolve_model("llama3:8b", "llama3:8b") is None
    assert reg.resolve_model("llama3:8b:sql", "llama3:8b") == "sql"
    with pytest.raises(LoRAStateError):
        reg.resolve_model("llama3:sql", "llama3:8b")


def test_restore_rolls_back_replace_and_remove(reg):
    old = reg.get("sql")
    reg.replace("sql", rank=16)
    reg.restore(old)
    assert reg.get("sql") == old
    chat = reg.remove("chat")
    reg.restore(chat)
    assert reg.get("chat") == chat and reg.names() == ["sql", "chat"]


def test_restore_refuses_foreign_entries(reg):
    chat = reg.remove("chat")
    add(reg, "chat")  # id 3 now owns the name
    refused(reg, 409, reg.restore, chat)
    refused(reg, 409, reg.restore, AdapterEntry("x", "/x", False, 99, "c", 8, ("q_proj",), BASE))
    refused(reg, 409, reg.restore, AdapterEntry("x", "/x", False, 1, "c", 8, ("q_proj",), BASE))


def test_error_carries_status_and_message():
    e = LoRAStateError("busy", 409)
    assert e.status == 409 and str(e) == "busy" and e.message == "busy"


def test_published_names_follow_every_change():
    """The HTTP thread resolves names from `published` without the engine: it must follow add,
    remove and restore, and be a new immutable object each time (never mutated in place)."""
    r = Registry()
    assert r.published == ()
    add(r, "a")
    add(r, "b")
    before = r.published
    assert before == ("a", "b")
    removed = r.remove("a")
    assert r.published == ("b",) and before == ("a", "b")
    r.restore(removed)
    assert set(r.published) == {"a", "b"}
    r.replace("b", path="/b2")  # a reload in place keeps the name
    assert set(r.published) == {"a", "b"}
    assert resolve_model_name("b", BASE, r.published) == "b"
    with pytest.raises(LoRAStateError):
        resolve_model_name("gone", BASE, r.published)
