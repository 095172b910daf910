"""Request and response models of the native /generate (SGLang's shape). Our own API: an unknown key
is a 400 whatever server.strict_fields says (a typo here is never meant)."""

from __future__ import annotations

from typing import Annotated, Any, Optional, Union

from pydantic import BaseModel, Field

from appliance.server.schemas.base import Closed, array_or_object, one_message
from appliance.engine.request import MAX_LOGPROBS
from appliance.server.schemas.openai import SEED_MAX, CacheSalt, LogitBias, Number, Penalty, Stop, TokenIds


class GenerateSamplingParams(Closed):
    max_new_tokens: Optional[int] = Field(None, ge=1, description="default 128, capped to the context left")
    min_new_tokens: Optional[int] = Field(None, ge=0)
    temperature: Optional[Number] = Field(None, ge=0)
    top_p: Optional[Number] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=-1, description="-1 or 0 = off")
    seed: Optional[int] = Field(None, ge=0, le=SEED_MAX)
    ignore_eos: Optional[bool] = None
    stop: Optional[Stop] = None
    stop_token_ids: Optional[TokenIds] = None
    presence_penalty: Optional[Penalty] = None
    frequency_penalty: Optional[Penalty] = None
    repetition_penalty: Optional[Number] = Field(None, gt=0)
    min_p: Optional[Number] = Field(None, ge=0, le=1)
    logit_bias: Optional[LogitBias] = None
    # Structured outputs (SGLang's names; server/grammar_params.py): at most one of these.
    json_schema: Optional[Union[str, dict[str, Any]]] = Field(
        None, description="a JSON schema (JSON text or an object) the output validates against")
    regex: Optional[str] = Field(None, description="a regex the whole output matches")
    ebnf: Optional[str] = Field(None, description="an EBNF grammar (xgrammar's, root rule `root`)")
    cache_salt: Optional[CacheSalt] = None
    skip_special_tokens: Optional[bool] = Field(None, description="default true: special tokens are left out of the text")


_Text = Annotated[str, Field(min_length=1)]
_Ids = Annotated[TokenIds, Field(min_length=1)]


class GenerateRequest(Closed):
    """POST /generate: exactly one of `text` and `input_ids`, one input or a batch (a list)."""

    text: Optional[Annotated[Union[_Text, Annotated[list[_Text], Field(min_length=1)]],
                             one_message("must be a string or a non-empty array of strings.")]] = None
    input_ids: Optional[Annotated[Union[_Ids, Annotated[list[_Ids], Field(min_length=1)]],
                                  one_message("must be an array of integer token ids, or a non-empty array "
                                              "of them.")]] = None
    sampling_params: Optional[array_or_object(GenerateSamplingParams, list[GenerateSamplingParams])] = Field(
        None, description="one object for every input, or (batch) an array of one object per input")
    stream: Optional[bool] = Field(None, description="SSE events with cumulative text / output_ids per index")
    model: Optional[str] = Field(None, description="the base model or an adapter for every input")
    lora_path: Optional[Annotated[Union[str, list[Optional[str]]],
                                  one_message("must be an adapter name, null, or (for a batch) an array of "
                                              "one adapter name or null per input.")]] = Field(
        None, description="(SGLang) the adapter by name, for every input or one per input")
    return_logprob: Optional[bool] = Field(None, description="meta_info.output_token_logprobs / output_top_logprobs")
    top_logprobs_num: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    return_text_in_logprobs: Optional[bool] = Field(None, description="each logprob with its token's text")


class GenerateMetaInfo(BaseModel):
    id: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: Optional[str]
    output_token_logprobs: Optional[list[list[Union[float, int, Optional[str]]]]] = Field(
        None, description="return_logprob: [logprob, token id, text or null] per generated token")
    output_top_logprobs: Optional[list[list[list[Union[float, int, Optional[str]]]]]] = None


class GenerateItem(BaseModel):
    """One result; a batch answers a list of them, a stream one per event (with `index`)."""

    text: str
    output_ids: list[int]
    meta_info: GenerateMetaInfo
    index: Optional[int] = Field(None, description="streams only: which input")
