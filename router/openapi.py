"""The /openapi.json this server publishes states its own bounds, not only the request
models' types: the one model name it serves, token ids within its vocabulary, the context
length, and the limits of router/limits.py. A client generated from it (or a fuzzer, see
tests/router/test_fuzz.py) then knows what this server accepts; the server still checks all
of it, and fields it declares only to refuse them are documented as null-only."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from router.protocol import UNSUPPORTED_FIELDS
from router.state import RouterState


def install(app: FastAPI, state: RouterState) -> None:
    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            describe_bounds(schema["components"]["schemas"], state)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


def describe_bounds(components: dict, state: RouterState) -> None:
    """Rewrite the request schemas in place with this server's bounds."""
    limits, vocab, context = state.config.limits, state.vocab_size, state.config.max_model_len
    model = {"type": "string", "enum": [state.config.served_model_name], "title": "Model"}
    token_id = {"type": "integer", "minimum": 0, "maximum": vocab - 1}
    token_ids = {"type": "array", "items": token_id, "minItems": 1, "maxItems": context - 1}
    text = {"type": "string", "maxLength": limits.max_input_chars}
    stop_string = {"type": "string", "minLength": 1, "maxLength": limits.max_stop_len}
    length = {"anyOf": [{"type": "integer", "minimum": 1, "maximum": context - 1}, {"type": "null"}]}
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        properties = components[name]["properties"]
        properties["model"] = model
        properties["n"] = {**properties["n"], "maximum": limits.max_n}
        properties["stop"] = {"anyOf": [stop_string, {"type": "array", "items": stop_string, "maxItems": limits.max_stop},
                                        {"type": "null"}], "default": None}
        properties["stop_token_ids"] = {"anyOf": [{"type": "array", "items": token_id}, {"type": "null"}],
                                        "default": None}
        properties["max_tokens"] = {**length, "default": properties["max_tokens"].get("default")}
        properties["min_tokens"] = {"type": "integer", "minimum": 0, "maximum": context - 1, "default": 0}
        for field in UNSUPPORTED_FIELDS + (("chat_template",) if name.startswith("Chat") else ()):
            properties[field] = {"type": "null", "default": None, "description": "not supported by this server"}
    completion = components["CompletionRequest"]["properties"]
    completion["prompt"] = {"title": "Prompt", "anyOf": [
        text, {"type": "array", "items": text, "minItems": 1, "maxItems": limits.max_prompts}, token_ids,
        {"type": "array", "items": token_ids, "minItems": 1, "maxItems": limits.max_prompts}]}
    components["ChatCompletionRequest"]["properties"]["max_completion_tokens"] = {**length, "default": None}
    text_part = {"type": "object", "properties": {"type": {"const": "text"}, "text": text}, "required": ["type", "text"],
                 "additionalProperties": False}
    components["ChatMessage"]["properties"]["content"] = {
        "anyOf": [text, {"type": "array", "items": text_part}, {"type": "null"}], "default": None}
    components["TokenizeRequest"]["properties"]["model"] = {"anyOf": [model, {"type": "null"}], "default": None}
    components["TokenizeRequest"]["properties"]["prompt"] = {"anyOf": [text, {"type": "null"}], "default": None}
    detokenize = components["DetokenizeRequest"]["properties"]
    detokenize["model"] = {"anyOf": [model, {"type": "null"}], "default": None}
    detokenize["tokens"] = {"type": "array", "items": token_id}
