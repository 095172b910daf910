"""`--compare-in-process`: the same requests through the engine in this process (AsyncEngine, the front
the server itself drives), so the HTTP path's cost is a measured ratio rather than a guess.

Same config as the server (same overrides), same adapters, same token ids: /generate and
/v1/completions send the spec's ids as they are; chat sends text, which the server renders with the chat
template, and so is rendered here with the same tokenizer and template. Greedy with ignore_eos, as the
HTTP requests are.
"""

from __future__ import annotations

import gc
from pathlib import Path
from appliance.bench.offline import greedy
from appliance.bench.serve_client import RequestSpec, Result, Timer
from appliance.config.schema import ApplianceConfig
from appliance.engine.async_engine import AsyncEngine
from appliance.engine.engine import LLMEngine
from appliance.engine.request import EngineError


class InProcessDriver:
    """An engine of `cfg` started on its own thread; call it like the HTTP drivers."""

    def __init__(self, cfg: ApplianceConfig, chat: bool) -> None:
        self.engine = LLMEngine.from_config(cfg)  # the config's own adapters are loaded here
        self.aeng = AsyncEngine(self.engine)
        self.aeng.start()
        self.chat = chat

    async def load(self, adapters: dict[str, Path]) -> None:
        """Load each adapter (name -> dir) on the engine thread, as the admin route does."""
        lora = self.engine.lora
        assert lora is not None, "adapters need lora.enabled"
        for name, path in adapters.items():
            await self.aeng.call(lambda n=name, p=path: lora.load(n, str(p)))

    async def aclose(self) -> None:
        """Nothing per row: the engine serves every row; close() stops it."""

    def prompt_ids(self, spec: RequestSpec) -> list[int]:
        if self.chat:
            return self.engine.tokenizer.apply_chat_template([{"role": "user", "content": spec.text}])
        return spec.prompt_ids

    async def __call__(self, spec: RequestSpec) -> Result:
        t = Timer()
        ids = self.prompt_ids(spec)
        try:
            async for out in self.aeng.generate(ids, greedy(spec.output_len), adapter=spec.adapter):
                t.tokens(len(out.token_ids))
                if out.finish_reason in ("error", "abort"):
                    return t.failed(f"engine:{out.finish_reason}", out.error or "")
        except EngineError as e:
            return t.failed(f"engine:{type(e).__name__}", str(e))
        t.res.prompt_tokens = len(ids)
        return t.done()

    def close(self) -> None:
        """Stop the engine and give its device memory back."""
        self.aeng.shutdown()
        self.engine.close()
        del self.aeng, self.engine
        gc.collect()
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
