"""Bodies and answers of the LoRA admin routes (SGLang's and vLLM's names, plus `managed`, ours)."""

from __future__ import annotations

from typing import Annotated, Literal, Optional

from pydantic import BaseModel, Field

from appliance.server.schemas.base import Closed, one_message

_Name = Annotated[str, Field(min_length=1, description="1..128 printable characters, no ':' (lora/names.py)")]


class LoadLoRAAdapterRequest(Closed):
    lora_name: _Name
    lora_path: Annotated[str, Field(min_length=1, description="a dir under lora.adapter_roots, or an s3:// or "
                                                              "hf:// URI under lora.allowed_sources")]
    pinned: Optional[bool] = None
    load_inplace: Optional[bool] = Field(None, description="reload an existing name with new weights")
    managed: Optional[bool] = Field(None, description="the config owns it (appliance apply)")


class UnloadLoRAAdapterRequest(Closed):
    lora_name: _Name


class PinLoRAAdapterRequest(Closed):
    lora_name: _Name
    pinned: Annotated[bool, one_message("must be true or false.")]
    managed: Optional[bool] = None


# ------------------------------------------------------------------------------------------ answers

class AdapterView(BaseModel):
    """One adapter as GET /v1/adapters and the admin answers show it (admin.adapter_view)."""

    name: str
    path: str
    pinned: bool
    id: int
    rank: int
    target_modules: list[str]
    checksum: str
    base_model_name: Optional[str]
    generation: int = Field(description="bumped by every in-place reload")
    tier: Literal["gpu", "cpu", "disk", "remote"]
    slot: Optional[int]
    in_flight: int = Field(description="requests (waiting or running) on its current weights")
    managed: bool = Field(description="the config owns it (reconcile.prune: owned may unload it)")
    revision: Optional[str] = Field(None, description="a remote adapter's revision: etag:... (s3) or "
                                                      "commit:... (hf); null for a local dir")


class AdapterChange(BaseModel):
    """POST /load_lora_adapter and /pin_lora_adapter."""

    success: Literal[True]
    message: str
    adapter: AdapterView


class AdapterUnloaded(BaseModel):
    success: Literal[True]
    message: str
    in_flight: int = Field(description="requests still running on it; its weights are freed when they end")


class Retiring(BaseModel):
    key: str
    in_flight: int
    slot: Optional[int]


class SlotPool(BaseModel):
    slots: int
    used: int
    pinned: int
    pinned_limit: int
    evictions: int


class HostCache(BaseModel):
    entries: int
    capacity: int
    loads: int
    evictions: int


class AdapterList(BaseModel):
    """GET /v1/adapters: what `appliance plan` diffs against."""

    object: Literal["list"]
    enabled: bool
    data: list[AdapterView]
    retiring: list[Retiring] = Field(description="weights replaced or unloaded that requests still run on")
    pool: Optional[SlotPool]
    cache: Optional[HostCache]
