"""Request bodies of the LoRA admin routes (SGLang's and vLLM's names, plus `managed`, ours)."""

from __future__ import annotations

from typing import Annotated, Optional

from pydantic import Field

from appliance.server.schemas.base import Closed, one_message

_Name = Annotated[str, Field(min_length=1, description="1..128 printable characters, no ':' (lora/names.py)")]


class LoadLoRAAdapterRequest(Closed):
    lora_name: _Name
    lora_path: Annotated[str, Field(min_length=1, description="a dir under lora.adapter_roots")]
    pinned: Optional[bool] = None
    load_inplace: Optional[bool] = Field(None, description="reload an existing name with new weights")
    managed: Optional[bool] = Field(None, description="the config owns it (appliance apply)")


class UnloadLoRAAdapterRequest(Closed):
    lora_name: _Name


class PinLoRAAdapterRequest(Closed):
    lora_name: _Name
    pinned: Annotated[bool, one_message("must be true or false.")]
    managed: Optional[bool] = None
