"""OpenAI request bodies (pydantic, strict) and OpenAI-style error responses.

Bodies are validated from the raw JSON in strict mode, so a field of the wrong type (`"0.5"` for
`temperature`, `1` for `stream`) is a 400, not a silent conversion. Unknown fields are ignored,
as OpenAI's server does; known fields this server cannot honour (`n > 1`, `logprobs`, penalties)
are a 400 that names the field. Extensions, spelled as in vLLM: `top_k`, `min_p`,
`stop_token_ids`, `ignore_eos`, `return_token_ids`.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

MAX_SEED = 2**32
MAX_STOPS = 16  # stop strings per request
MAX_STOP_CHARS = 256  # characters per stop string
MAX_STOP_IDS = 64  # stop token ids per request (stop_token_ids + ids in stop)


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with `status`."""

    def __init__(self, status: int, message: str, *, param: str | None = None, kind: str = "",
                 headers: dict[str, str] | None = None):  # fmt: skip
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind or _KIND.get(status, "invalid_request_error")
        self.headers = headers

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, param=self.param, kind=self.kind,
                              headers=self.headers)  # fmt: skip


_KIND = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
    504: "timeout_error",
}
# seconds a client should wait before retrying a 429 (queue full) / 503 (draining)
RETRY_AFTER = {429: "1", 503: "5"}


def error_response(
    status: int, message: str, *, param: str | None = None, kind: str = "", headers=None
) -> JSONResponse:
    if status in RETRY_AFTER:
        headers = {"Retry-After": RETRY_AFTER[status], **(headers or {})}
    body = {
        "error": {
            "message": message,
            "type": kind or _KIND.get(status, "invalid_request_error"),
            "param": param,
            "code": status,
        }
    }
    return JSONResponse(body, status_code=status, headers=headers)


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # 0 or -1: off (vLLM spelling)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=MAX_SEED)
    stop: str | list[str | int] | None = None  # strings, or token ids
    stop_token_ids: list[int] = Field(default_factory=list)
    n: int = 1
    best_of: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    logprobs: Any = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None

    @model_validator(mode="after")
    def _supported(self):
        if self.n != 1:
            raise ValueError(f"n={self.n} is not supported; this server returns one choice (n=1)")
        if self.best_of not in (None, 1):
            raise ValueError("best_of is not supported; leave it unset or 1")
        if self.logprobs not in (None, False, 0):
            raise ValueError("logprobs are not supported; leave logprobs unset")
        if self.presence_penalty != 0.0 or self.frequency_penalty != 0.0:
            raise ValueError("presence_penalty / frequency_penalty are not supported; use 0")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        stops = self.stop_strings()
        if len(stops) > MAX_STOPS:
            raise ValueError(f"{len(stops)} stop strings; at most {MAX_STOPS} are allowed")
        for s in stops:
            if not s:
                raise ValueError("stop strings must be non-empty")
            if len(s) > MAX_STOP_CHARS:
                raise ValueError(f"a stop string has {len(s)} characters; at most "
                                 f"{MAX_STOP_CHARS} are allowed")  # fmt: skip
        if len(self.extra_stop_ids()) > MAX_STOP_IDS:
            raise ValueError(f"{len(self.extra_stop_ids())} stop token ids; at most "
                             f"{MAX_STOP_IDS} are allowed")  # fmt: skip
        return self

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        if isinstance(self.stop, str):
            return [self.stop]
        return [s for s in self.stop if isinstance(s, str)]

    def extra_stop_ids(self) -> list[int]:
        ids = list(self.stop_token_ids)
        if isinstance(self.stop, list):
            ids += [s for s in self.stop if isinstance(s, int)]
        return ids

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    # a string, a list of token ids, or a one-element list of either
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    suffix: str | None = None

    @model_validator(mode="after")
    def _one_prompt(self):
        if self.echo:
            raise ValueError("echo is not supported; leave it false")
        if self.suffix:
            raise ValueError("suffix is not supported; leave it unset")
        p = self.prompt
        if isinstance(p, list) and p and not isinstance(p[0], int):
            if len(p) != 1:
                raise ValueError(
                    f"prompt holds {len(p)} prompts; send one prompt per request (n=1)"
                )
        return self

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and not isinstance(p[0], int):
            return p[0]
        return p


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    add_generation_prompt: bool = True
    tools: Any = None

    @model_validator(mode="after")
    def _chat_supported(self):
        if self.tools:
            raise ValueError("tools are not supported by this server")
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise ValueError("max_tokens and max_completion_tokens disagree; send one")
            self.max_tokens = self.max_completion_tokens
        return self

    def template_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


def parse_body(model: type[_Body], raw: bytes) -> Any:
    """Validate a raw JSON body; raise APIError(400) naming the first bad field."""
    if not raw.strip():
        raise APIError(400, "the request body is empty; send a JSON object")
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        loc = ".".join(str(x) for x in err.get("loc", ()))
        if err.get("type") == "json_invalid":
            raise APIError(400, f"malformed JSON body: {err.get('msg')}") from None
        if err.get("type") == "model_type":
            raise APIError(400, "the request body must be a JSON object") from None
        msg = err.get("msg", "invalid value").removeprefix("Value error, ")
        where = f"field {loc!r}: " if loc else ""
        raise APIError(400, f"{where}{msg}", param=loc or None) from None
