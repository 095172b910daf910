"""vLLM's utility routes, so its clients and scripts work unchanged:

    POST /tokenize     {model?, prompt | messages, add_special_tokens?, add_generation_prompt?,
                        continue_final_message?, tools?, chat_template_kwargs?, return_token_strs?}
                       -> {count, max_model_len, tokens, token_strs}
    POST /detokenize   {model?, tokens} -> {prompt}
    GET  /version      {version}

`model` may name an adapter (404 if it is not loaded); adapters share the base model's tokenizer, so
the answer is the same. /tokenize renders `messages` (and `tools`) exactly as /v1/chat/completions
does (chat_template.chat_prompt), so `count` is the prompt_tokens a chat request with the same fields
(and tool_choice auto) is charged. Inference
keys apply (server.api_keys or a tenant's, which sees only its adapters); /version is open.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable, Optional

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from appliance.engine.request import RequestError
from appliance.engine.tokenizer import Tokenizer
from appliance.server.tenants import TenantAuth
from appliance.server.errors import bad_request
from appliance.server.chat_template import chat_prompt, template_options
from appliance.server.protocol import in_vocab
from appliance.server.schemas.base import extra_fields, unknown_field_error, validate
from appliance.server.schemas.utility import DetokenizeRequest, TokenizeRequest

Resolve = Callable[[list[Optional[str]], str, Any], list[Optional[str]]]  # names, param, tenant


class UtilityApi:
    def __init__(self, tokenizer: Tokenizer, max_model_len: int, auth: TenantAuth,
                 read_json: Callable[[Request], Awaitable[dict]], resolve_model: Resolve,
                 strict_fields: bool, ignored_header: Callable[[list[str], str], dict[str, str]]) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.auth = auth
        self.read_json = read_json
        self.resolve_model = resolve_model
        self.strict_fields = strict_fields
        self.ignored_header = ignored_header

    def routes(self) -> list[Route]:
        return [Route("/tokenize", self.tokenize, methods=["POST"]),
                Route("/detokenize", self.detokenize, methods=["POST"]),
                Route("/version", self.version, methods=["GET"])]

    async def tokenize(self, request: Request) -> Response:
        tenant = self.auth.check(request)
        req = validate(TokenizeRequest, await self.read_json(request), "/tokenize")
        self.resolve_model([req.model], "model", tenant)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("Send exactly one of 'prompt' and 'messages'.", "prompt")
        unknown = []
        try:
            if req.messages is not None:
                unknown = extra_fields(req)
                if unknown and self.strict_fields:
                    raise unknown_field_error(unknown)
                options = template_options(req.add_generation_prompt, req.continue_final_message,
                                           req.add_special_tokens, req.chat_template_kwargs, self.tokenizer)
                tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
                ids = chat_prompt(req.messages, self.tokenizer, options, tools=tools)
            else:
                for key in ("add_generation_prompt", "continue_final_message", "tools", "chat_template_kwargs"):
                    if getattr(req, key) is not None:
                        raise bad_request(f"'{key}' applies to 'messages' only.", key)
                ids = self.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
        except RequestError as e:  # a shape-only model dir has no tokenizer
            raise bad_request(str(e), "prompt") from None
        body = {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
                "token_strs": self.tokenizer.token_strs(ids) if req.return_token_strs else None}
        return JSONResponse(body, headers=self.ignored_header(unknown, "tokenize"))

    async def detokenize(self, request: Request) -> Response:
        tenant = self.auth.check(request)
        req = validate(DetokenizeRequest, await self.read_json(request), "/detokenize")
        self.resolve_model([req.model], "model", tenant)
        ids = in_vocab(req.tokens, "tokens", self.tokenizer.vocab_size)
        return JSONResponse({"prompt": self.tokenizer.decode(ids, skip_special_tokens=False)})

    async def version(self, request: Request) -> Response:
        from appliance import __version__

        return JSONResponse({"version": __version__})
