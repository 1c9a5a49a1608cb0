"""The OpenAI wire format: request bodies (validated strictly) and response bodies.

Requests are strict: "16" is not an integer, unknown fields are rejected (as OpenAI does),
so a typo such as `max_token` is a 400 instead of a silently ignored setting. A few fields
clients send routinely but that change nothing here (`user`, `metadata`, `store`, ...) are
accepted. Every string must be valid Unicode: JSON may escape a lone surrogate ("\\ud800"),
which no UTF-8 encoder takes, so it is a 400 naming its field. Ranges are checked by
`SamplingParams.validate`, the single source of truth the offline engine uses too.

`check_call` is everything a server judges of a generation call before model work (schema,
ranges, the prompt's shape, the request headers); the single server's routes and the fleet
front both run it, so a body the one refuses the other refuses the same way, before
anything is forwarded.
"""
from __future__ import annotations

import json
import re
import time
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from sloserve.workers.contract import FRONT_IDS_FIELD
from sloserve.server.errors import APIError, bad_request, param_from_message, validation_message
from sloserve.core.types import SamplingParams, StructuredOutput

MAX_CHOICES = 64  # n x prompts per HTTP request; each choice is one engine request
MAX_REQUEST_ID = 128
REQUEST_ID = re.compile(rf"^[A-Za-z0-9._:\-]{{1,{MAX_REQUEST_ID}}}$")  # X-Request-Id as a client may set it
_SEED_SPAN = 2**64  # seeds are 64-bit


def choice_seed(seed: Optional[int], j: int) -> Optional[int]:
    """The seed of a prompt's j-th sample: n samples must differ even with a seed, so the j-th
    uses seed + j, wrapped into the signed 64-bit range (the same generator seed mod 2**64).
    The worker seeds its choices this way, and the front's split calls (front/fanout.py) too."""
    if seed is None or j == 0:
        return seed
    return (seed + j + _SEED_SPAN // 2) % _SEED_SPAN - _SEED_SPAN // 2


def lone_surrogate(value: Any) -> Optional[tuple[str, int]]:
    """Where the first lone surrogate is in a string, or in the strings (keys too) of nested
    lists and dicts: (the path below `value`, e.g. "[1]", and the character index), else None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return "", exc.start
        return None
    if isinstance(value, (list, tuple)):
        items = enumerate(value)
    elif isinstance(value, dict):
        items = [(key, part) for key, item in value.items() for part in (key, item)]
    else:
        return None
    for key, item in items:
        found = lone_surrogate(item)
        if found is not None:
            return f"[{key!r}]{found[0]}" if isinstance(key, str) else f"[{key}]{found[0]}", found[1]
    return None


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    @field_validator("*", mode="after")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        if isinstance(value, BaseModel):
            return value  # its own fields were checked
        found = lone_surrogate(value)
        if found is not None:
            where, at = found
            raise PydanticCustomError("invalid_unicode",
                                      "contains invalid Unicode (a lone surrogate at character {at}{where})",
                                      {"at": at, "where": f" of {where}" if where else ""})
        return value


class StreamOptions(_Strict):
    include_usage: bool = False


class SamplingFields(_Strict):
    """Fields both endpoints share: OpenAI's, vLLM's extensions, and sloserve's QoS fields."""

    model: Optional[str] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    n: Optional[int] = None
    logit_bias: Optional[dict[str, float]] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # structured outputs: OpenAI's response_format, and vLLM's spellings (guided_*, or the
    # structured_outputs object); at most one of them per call
    response_format: Optional[dict[str, Any]] = None
    guided_json: Optional[Union[dict[str, Any], str]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    structured_outputs: Optional[dict[str, Any]] = None
    # sloserve extensions (also accepted as X-QoS-Class / X-Priority headers)
    priority: Optional[int] = None
    qos_class: Optional[str] = None
    # Set by a fleet's front only (a worker takes it with the fleet secret, and refuses it from
    # anyone else): the prompt's ids as a worker tokenized them for routing, so the worker that
    # serves the call does not tokenize it again.
    sloserve_prompt_ids: Optional[list[int]] = None
    # accepted and ignored: they change nothing about generation here
    user: Optional[str] = None
    metadata: Optional[dict[str, str]] = None
    store: Optional[bool] = None
    service_tier: Optional[str] = None

    def _check_common(self) -> None:
        if self.n is not None and not 1 <= self.n <= MAX_CHOICES:
            raise bad_request(f"n must be in [1, {MAX_CHOICES}], got {self.n}", "n")
        if self.logit_bias:
            raise bad_request("logit_bias is not supported", "logit_bias", "unsupported_parameter")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")

    def _params(self, max_tokens: Optional[int], logprobs: Optional[int],
                structured: Optional[StructuredOutput]) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        fields: dict[str, Any] = dict(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            seed=self.seed,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            structured=structured,
        )
        try:
            return SamplingParams(**fields)
        except ValueError as exc:
            message = str(exc)
            raise bad_request(message, param_from_message(message)) from None

    def structured_output(self) -> Optional[StructuredOutput]:
        """The call's constraint on its output, from whichever field names one (400 for two)."""
        found: list[StructuredOutput] = []
        rf = self.response_format
        if rf is not None:
            kind = rf.get("type", "text")
            if kind == "json_object":
                found.append(StructuredOutput("json_object", source="response_format"))
            elif kind == "json_schema":
                spec = rf.get("json_schema")
                schema = spec.get("schema") if isinstance(spec, dict) else None
                if not isinstance(schema, dict):
                    raise bad_request("response_format json_schema needs json_schema.schema (an object)",
                                      "response_format")
                found.append(StructuredOutput("json", json.dumps(schema), "response_format"))
            elif kind != "text":
                raise bad_request(f"response_format type must be text, json_object or json_schema, got {kind!r}",
                                  "response_format")
        if self.guided_json is not None:
            schema = self.guided_json if isinstance(self.guided_json, str) else json.dumps(self.guided_json)
            found.append(StructuredOutput("json", schema, "guided_json"))
        for kind, value in (("regex", self.guided_regex), ("grammar", self.guided_grammar)):
            if value is not None:
                found.append(StructuredOutput(kind, value, f"guided_{kind}"))
        if self.guided_choice is not None:
            found.append(StructuredOutput("choice", tuple(self.guided_choice), "guided_choice"))
        if self.structured_outputs is not None:
            keys = [k for k in ("json", "regex", "choice", "grammar", "json_object") if
                    self.structured_outputs.get(k) not in (None, False)]
            stray = sorted(set(self.structured_outputs) - {"json", "regex", "choice", "grammar", "json_object"})
            if stray or len(keys) != 1:
                raise bad_request("structured_outputs must name exactly one of json, regex, choice, grammar or "
                                  "json_object", "structured_outputs")
            value = self.structured_outputs[keys[0]]
            if keys[0] == "json" and isinstance(value, dict):
                value = json.dumps(value)
            elif keys[0] == "choice":
                value = tuple(value) if isinstance(value, list) else value
            elif keys[0] == "json_object":
                value = ""
            found.append(StructuredOutput(keys[0], value, "structured_outputs"))
        if len(found) > 1:
            raise bad_request(f"one constraint per call: got {', '.join(c.source for c in found)}", found[1].source)
        if not found:
            return None
        try:
            found[0].validate()
        except ValueError as exc:
            raise bad_request(f"{found[0].source}: {exc}", found[0].source) from None
        return found[0]

    @property
    def num_choices(self) -> int:
        return self.n or 1

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


PromptInput = Union[str, list[int], list[str], list[list[int]]]


def prompt_label(index: int, count: int) -> str:
    """How an error names one prompt of a completions call: `prompt`, or `prompt[i]` in a batch
    (the single server and the front word it alike)."""
    return "prompt" if count == 1 else f"prompt[{index}]"


class CompletionRequest(SamplingFields):
    prompt: PromptInput
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: bool = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None

    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompt field as a list of prompts (a string, token ids, or a batch of either),
        within MAX_CHOICES choices in all."""
        p = self.prompt
        if isinstance(p, str):
            prompts = [p]
        elif not p:
            raise bad_request("prompt must not be empty", "prompt")
        else:
            prompts = [p] if isinstance(p[0], int) else list(p)
        for i, one in enumerate(prompts):
            if not one:
                raise bad_request(f"{prompt_label(i, len(prompts))} is empty", "prompt")
        total = len(prompts) * self.num_choices
        if total > MAX_CHOICES:
            raise bad_request(f"{len(prompts)} prompts x n={self.num_choices} = {total} choices; the limit is "
                              f"{MAX_CHOICES}", "n")
        return prompts  # type: ignore[return-value]

    def sampling_params(self) -> SamplingParams:
        self._check_common()
        if self.echo:
            raise bad_request("echo is not supported", "echo", "unsupported_parameter")
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix", "unsupported_parameter")
        if self.best_of is not None and self.best_of != self.num_choices:
            raise bad_request("best_of other than n is not supported", "best_of", "unsupported_parameter")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise bad_request(f"logprobs must be in [0, 20], got {self.logprobs}", "logprobs")
        return self._params(self.max_tokens, self.logprobs, self.structured_output())


class TextPart(_Strict):
    type: str
    text: Optional[str] = None


FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


class FunctionDef(_Strict):
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text of an object


class ToolCallIn(_Strict):
    """A call an earlier assistant turn made, as the client sends it back."""

    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: Optional[str] = None
    tool_call_id: Optional[str] = None
    tool_calls: Optional[list[ToolCallIn]] = None

    def plain(self, index: int) -> dict[str, Any]:
        """The message as a chat template wants it: role and a text content; an assistant turn's
        calls with their arguments decoded, a tool result's call id."""
        content = self.content
        if self.tool_calls and self.role != "assistant":
            raise bad_request(f"messages[{index}]: only an assistant message has tool_calls",
                              f"messages.{index}.tool_calls")
        if content is None and not self.tool_calls:
            raise bad_request(f"messages[{index}].content is required", f"messages.{index}.content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise bad_request(f"messages[{index}].content[{j}]: only text parts are supported, got {part.type!r}",
                                      f"messages.{index}.content")
                texts.append(part.text)
            content = "".join(texts)
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": content or ""}
        if self.tool_calls:
            calls = []
            for j, call in enumerate(self.tool_calls):
                try:
                    arguments = json.loads(call.function.arguments)
                except json.JSONDecodeError:
                    arguments = None
                if not isinstance(arguments, dict):
                    raise bad_request(f"messages[{index}].tool_calls[{j}].function.arguments must be the JSON text "
                                      "of an object", f"messages.{index}.tool_calls")
                calls.append({"id": call.id, "type": "function",
                              "function": {"name": call.function.name, "arguments": arguments}})
            message["tool_calls"] = calls
        if self.role == "tool" and self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    tools: Optional[list[ToolDef]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None

    def conversation(self) -> list[dict[str, Any]]:
        if not self.messages:
            raise bad_request("messages must be a non-empty list", "messages")
        return [m.plain(i) for i, m in enumerate(self.messages)]

    def tool_mode(self) -> str:
        """How this call uses its tools: "none" (no tools, or tool_choice none: no call read out or
        forced), "auto" (the model may call them), "required" (at least one call) or "named"
        (tool_choice names one); 400 for a tool list or choice that is not well formed."""
        tools = self.tools or []
        names = [t.function.name for t in tools]
        for i, name in enumerate(names):
            if not FUNCTION_NAME.fullmatch(name):
                raise bad_request(f"tools[{i}].function.name must be 1-64 characters of [A-Za-z0-9_-], got {name!r}",
                                  "tools")
            if name in names[:i]:
                raise bad_request(f"tools[{i}].function.name {name!r} is declared twice", "tools")
        choice = self.tool_choice
        if choice is None:
            return "auto" if tools else "none"
        if isinstance(choice, dict):
            function = choice.get("function")
            name = function.get("name") if isinstance(function, dict) else None
            if choice.get("type") != "function" or not isinstance(name, str) or set(choice) - {"type", "function"}:
                raise bad_request('tool_choice must be "none", "auto", "required" or {"type": "function", '
                                  '"function": {"name": ...}}', "tool_choice")
            if name not in names:
                raise bad_request(f"tool_choice names {name!r}, which is not in tools", "tool_choice")
            return "named"
        if choice not in ("none", "auto", "required"):
            raise bad_request(f'tool_choice must be "none", "auto", "required" or a named function, got {choice!r}',
                              "tool_choice")
        if choice != "none" and not tools:
            raise bad_request(f"tool_choice {choice!r} needs tools", "tool_choice")
        return choice

    def forced_tool_calls(self, tool_format: str) -> Optional[StructuredOutput]:
        """The constraint that makes the output the calls `tool_choice` forces, written in
        `tool_format` (a model family's, engine/structured.py); None when nothing is forced."""
        mode = self.tool_mode()
        if mode not in ("required", "named"):
            return None
        tools = self.tools or []
        if mode == "named":
            name = self.tool_choice["function"]["name"]  # type: ignore[index]
            tools = [t for t in tools if t.function.name == name]
        functions = [{"name": t.function.name, "parameters": t.function.parameters or {"type": "object"}}
                     for t in tools]
        parallel = mode == "required" and self.parallel_tool_calls is not False
        return StructuredOutput("tool_calls", json.dumps({"functions": functions, "parallel": parallel,
                                                          "format": tool_format}), "tools")

    def sampling_params(self, tool_format: str = "hermes") -> SamplingParams:
        self._check_common()
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
            if not 0 <= self.top_logprobs <= 20:
                raise bad_request(f"top_logprobs must be in [0, 20], got {self.top_logprobs}", "top_logprobs")
        structured, forced = self.structured_output(), self.forced_tool_calls(tool_format)
        if structured is not None and forced is not None:
            raise bad_request(f"one constraint per call: tool_choice {self.tool_choice!r} forces the output, and so "
                              f"does {structured.source}", structured.source)
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        try:
            return self._params(max_tokens, logprobs, structured or forced)
        except APIError as err:
            if err.param == "max_tokens" and self.max_completion_tokens is not None:
                err.param = "max_completion_tokens"
            raise


class TokenizeRequest(_Strict):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    tools: Optional[list[ToolDef]] = None  # rendered into the prompt as a chat call's would be
    add_generation_prompt: bool = True


class RoutingProbe(TokenizeRequest):
    """What a fleet front asks a worker before it routes a call (worker.py's /internal/tokenize):
    the call's prompt (text or token ids) or messages, and the max_tokens it asks for."""

    prompt: Optional[Union[str, list[int]]] = None
    max_tokens: Optional[int] = None


class DetokenizeRequest(_Strict):
    model: Optional[str] = None
    tokens: list[int]


class LoadLoraAdapterRequest(_Strict):
    """POST /v1/load_lora_adapter, as vLLM names it: serve the PEFT directory at `lora_path`
    (a path on the server) as model `lora_name`."""

    lora_name: str
    lora_path: str


class UnloadLoraAdapterRequest(_Strict):
    lora_name: str
    lora_int_id: Optional[int] = None  # vLLM's clients send it; names are what identify adapters here


GenerationRequest = Union[CompletionRequest, ChatCompletionRequest]


def refuse_front_ids(body: SamplingFields) -> None:
    """The front's own field, sent by someone else: refused as any unknown field is."""
    if body.sloserve_prompt_ids is not None:
        raise bad_request(f"unknown field {FRONT_IDS_FIELD!r}", FRONT_IDS_FIELD)


def header_request_id(value: Optional[str]) -> Optional[str]:
    """A client's X-Request-Id, if it sent a valid one (400 for an invalid one)."""
    if value is not None and not REQUEST_ID.match(value):
        raise bad_request(f"X-Request-Id must be 1-{MAX_REQUEST_ID} characters of [A-Za-z0-9._:-]", "X-Request-Id")
    return value


def header_priority(value: Optional[str]) -> Optional[int]:
    """A client's X-Priority, if it sent one (400 for one that is not an integer)."""
    if value is None:
        return None
    raw = value.strip()
    if not re.fullmatch(r"-?\d{1,9}", raw):
        raise bad_request("X-Priority must be an integer", "X-Priority")
    return int(raw)


def check_call(body: Any, chat: bool, headers: Any) -> tuple[GenerationRequest, SamplingParams]:
    """Judge a generation call as far as it can be judged without the model: the body's schema
    (the route's own validation: a JSON value already decoded), its sampling parameters, the
    prompt's shape or the messages, and the X-Request-Id / X-Priority headers. Raises APIError
    (400 naming the param); the model name, the prompt's length and its tokens are the serving
    instance's to judge."""
    model = ChatCompletionRequest if chat else CompletionRequest
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object (sent with Content-Type: application/json)")
    try:
        call = model.model_validate(body)
    except ValidationError as exc:
        message, param = validation_message(exc.errors())
        raise bad_request(message, param) from None
    params = call.sampling_params()
    if isinstance(call, ChatCompletionRequest):
        call.conversation()
    else:
        call.prompts()
    header_request_id(headers.get("x-request-id"))
    header_priority(headers.get("x-priority"))
    return call, params


# ---------------------------------------------------------------------------- responses


class _Out(BaseModel):
    model_config = ConfigDict(extra="allow")


class PromptTokensDetails(_Out):
    cached_tokens: int = 0


class Usage(_Out):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: Optional[PromptTokensDetails] = None


class CompletionLogprobs(_Out):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Out):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None


class CompletionResponse(_Out):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


class TopLogprob(_Out):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Out):
    content: Optional[list[ChatTokenLogprob]] = None


class ChatResponseMessage(_Out):
    """`tool_calls` (OpenAI's list of {id, type, function: {name, arguments}}) only when the
    answer made calls: an extra field, absent otherwise, as OpenAI omits it."""

    role: str = "assistant"
    content: Optional[str] = None


class ChatChoice(_Out):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None


class ChatCompletionResponse(_Out):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Optional[Usage] = None


class DeltaMessage(_Out):
    """`tool_calls` deltas (index, then id, type and name, then argument fragments) as an extra field."""

    role: Optional[str] = None
    content: Optional[str] = None


class ChatChunkChoice(_Out):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None


class ChatCompletionChunk(_Out):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Optional[Usage] = None


class CompletionChunk(_Out):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


class ModelCard(_Out):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "sloserve"
    root: Optional[str] = None
    parent: Optional[str] = None  # an adapter's base model
    max_model_len: Optional[int] = None


class ModelList(_Out):
    object: Literal["list"] = "list"
    data: list[ModelCard]
