"""The request and response bodies of the OpenAI API the server speaks (the subset it implements),
as pydantic models: requests are validated strictly (a string where a number belongs is refused, not
coerced), fields the server does not know are ignored, as OpenAI's own clients may send them."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

# Bounds that say "absurd" rather than "big": OpenAI's own limits where it states them.
MAX_CHOICES = 16
MAX_STOP_STRINGS = 4
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes


def _unicode(text: str) -> str:
    """JSON's ``\\ud800`` escapes make strings no tokenizer can encode (lone surrogates): refused here,
    saying where, rather than failing inside the tokenizer."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(
            f"must be valid Unicode, got a lone surrogate {text[error.start]!r} at {error.start}"
        ) from None
    return text


# Text the server tokenizes or matches: valid Unicode.
Text = Annotated[str, AfterValidator(_unicode)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class SamplingFields(BaseModel):
    """What completions and chat completions share: the model, how many choices, streaming, sampling."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=1)] | None = None  # not OpenAI's: vLLM's and llama.cpp's extension
    seed: Annotated[int, Field(ge=SEED_RANGE[0], le=SEED_RANGE[1])] | None = None
    stop: Text | list[Text] | None = None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop):
        strings = [stop] if isinstance(stop, str) else stop or []
        if len(strings) > MAX_STOP_STRINGS or any(not s for s in strings):
            raise ValueError(f"stop must be up to {MAX_STOP_STRINGS} non-empty strings, got {stop!r}")
        return strings

    def stop_strings(self) -> list[str]:
        return list(self.stop or [])


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: ``prompt`` as text or as token ids."""

    prompt: Annotated[str, Field(min_length=1), AfterValidator(_unicode)] | Annotated[list[int], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = 16  # OpenAI's default for completions


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | Annotated[list[TextPart], Field(min_length=1)]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``: ``max_completion_tokens`` is the current name of ``max_tokens``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: Literal["stop", "length"] | None
    logprobs: None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: Literal["stop", "length"]
    logprobs: None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    finish_reason: Literal["stop", "length"] | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvcache_ext"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
