"""The server's request bodies (pydantic, strict: unknown fields, coercions and NaN are 400s) and its errors in
OpenAI's shape. A request field is declared here once; the sampling fields come from lily.sampling."""
import functools
import json
from typing import Any

from .. import sampling

class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or {401: "authentication_error", 429: "rate_limit_error"}.get(
            status, "invalid_request_error" if status < 500 else "server_error")
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def error_bytes(status: int, message: str, **kw) -> bytes:
    return json.dumps(APIError(status, message, **kw).body()).encode()


@functools.lru_cache(maxsize=None)
def request_schemas(model_names: tuple[str, ...]):
    """The request bodies as pydantic models for a server answering to `model_names` (built on first use:
    pydantic comes with the [server] extra)."""
    from typing import Literal, Optional, Union

    from pydantic import BaseModel, ConfigDict, Field, create_model

    class _Strict(BaseModel):
        # Unknown fields are an error (OpenAI: "Unrecognized request argument supplied"); no type coercion
        # ("0.5" is not a number); NaN and infinities are refused.
        model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    class TextPart(_Strict):
        type: Literal["text", "input_text", "image_url", "input_audio", "file", "refusal"]
        text: Optional[str] = None
        image_url: Optional[Any] = None
        input_audio: Optional[Any] = None
        file: Optional[Any] = None
        refusal: Optional[str] = None

    class FunctionCall(_Strict):
        name: str
        arguments: Union[str, dict] = "{}"

    class ToolCall(_Strict):
        id: Optional[str] = None
        type: Literal["function"] = "function"
        function: FunctionCall

    class Message(_Strict):
        role: Literal["system", "developer", "user", "assistant", "tool"]
        content: Union[str, list[TextPart], None] = None
        name: Optional[str] = None
        tool_calls: Optional[list[ToolCall]] = None
        tool_call_id: Optional[str] = None
        reasoning_content: Optional[str] = None
        refusal: Optional[str] = None

    class FunctionDef(_Strict):
        name: str = Field(pattern=r"^[a-zA-Z0-9_.\-]{1,64}$")
        description: Optional[str] = None
        parameters: Optional[dict[str, Any]] = None
        strict: Optional[bool] = None

    class Tool(_Strict):
        type: Literal["function"]
        function: FunctionDef

    class NamedFunction(_Strict):
        name: str

    class NamedToolChoice(_Strict):
        type: Literal["function"]
        function: NamedFunction

    class StreamOptions(_Strict):
        include_usage: Optional[bool] = None

    class ResponseFormat(_Strict):
        type: Literal["text", "json_object", "json_schema"]
        json_schema: Optional[dict[str, Any]] = None

    # The sampling options (lily.sampling) with their API bounds, and OpenAI's other common fields. `model` lists
    # the served names in the OpenAPI document; another name is a 404 (worker.LilyServer.check_model).
    _Sampling = create_model(
        "_Sampling", __base__=_Strict, **sampling.api_fields(),
        model=(str, Field(max_length=256, json_schema_extra={"enum": list(model_names)})),
        stream=(Optional[bool], False), stream_options=(Optional[StreamOptions], None),
        n=(Optional[int], Field(None, ge=1, le=128)), logit_bias=(Optional[dict[str, float]], None),
        user=(Optional[str], None), metadata=(Optional[dict[str, Any]], None), store=(Optional[bool], None),
        service_tier=(Optional[str], None), prompt_cache_key=(Optional[str], None),
        safety_identifier=(Optional[str], None))

    class ChatCompletionRequest(_Sampling):
        messages: list[Message] = Field(min_length=1)
        max_completion_tokens: Optional[int] = Field(None, ge=1)
        logprobs: Optional[bool] = None
        top_logprobs: Optional[int] = Field(None, ge=0, le=20)
        tools: Optional[list[Tool]] = Field(None, max_length=256)
        tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
        parallel_tool_calls: Optional[bool] = None
        response_format: Optional[ResponseFormat] = None
        chat_template_kwargs: Optional[dict[str, Any]] = None
        enable_thinking: Optional[bool] = None     # as chat_template_kwargs.enable_thinking (vLLM, SGLang)
        preserve_thinking: Optional[bool] = None   # as chat_template_kwargs.preserve_thinking
        reasoning_effort: Optional[Literal["none", "minimal", "low", "medium", "high"]] = None
        modalities: Optional[list[str]] = None
        audio: Optional[dict[str, Any]] = None
        prediction: Optional[dict[str, Any]] = None
        web_search_options: Optional[dict[str, Any]] = None

    class CompletionRequest(_Sampling):
        prompt: Union[str, list[str], list[int], list[list[int]]]
        logprobs: Optional[int] = Field(None, ge=0, le=20)
        echo: Optional[bool] = None
        best_of: Optional[int] = Field(None, ge=1, le=128)
        suffix: Optional[str] = None

    for m in (TextPart, FunctionCall, ToolCall, Message, FunctionDef, Tool, NamedFunction, NamedToolChoice,
              StreamOptions, ResponseFormat, ChatCompletionRequest, CompletionRequest):
        m.model_rebuild()
    return ChatCompletionRequest, CompletionRequest


def _is_union_tag(p: str) -> bool:
    """Whether a pydantic error location step names a union member (a type or model), not a field."""
    return "[" in p or "-" in p or p in ("str", "int", "float", "bool", "dict", "list", "none") or p[:1].isupper()


def validation_body(errors) -> dict:
    """FastAPI's validation errors as one OpenAI-shaped error naming the first offending parameter."""
    # Of a union's alternatives, the one that got furthest names the offending field best.
    e = max(errors, key=lambda x: len([p for p in x.get("loc", ()) if not (isinstance(p, str) and _is_union_tag(p))]),
            default={})
    loc = [p for p in e.get("loc", ()) if p != "body"]
    param = ""
    for p in loc:
        if isinstance(p, int):
            param += f"[{p}]"
        elif isinstance(p, str) and not _is_union_tag(p):
            param += ("." if param else "") + p
    kind = e.get("type", "")
    if kind == "json_invalid":
        msg = "We could not parse the JSON body of your request. (HINT: This likely means you aren't using your " \
              "HTTP library correctly. The OpenAI API expects a JSON payload.)"
    elif kind == "extra_forbidden":
        msg = f"Unrecognized request argument supplied: {param}"
    elif not param:
        msg = "The request body must be a JSON object (Content-Type: application/json)."
    elif kind == "missing":
        msg = f"Missing required parameter: '{param}'."
    else:
        msg = f"Invalid value for '{param}': {e.get('msg', 'invalid')}"
    if kind == "json_invalid":
        param = ""
    return APIError(400, msg, param=param or None,
                    code="invalid_json" if kind == "json_invalid" else
                    "unknown_parameter" if kind == "extra_forbidden" else "invalid_value").body()

