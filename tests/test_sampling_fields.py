"""The sampling fields have one list (proto/sampling.py: the worker proto's SamplingParams).
Every copy of them (the engine's SamplingParams, the SDK's, the HTTP models, the public gRPC
API) must carry every field of that list and convert it: a field added to the proto and
forgotten in one place fails here. Each check sends a non-default value for every field and
compares what arrives with what was sent."""

from __future__ import annotations

from dataclasses import fields

from client.params import SamplingParams as ClientParams
from engine.sampling_params import GenerationDefaults, SamplingParams
from proto import generation_pb2
from proto.convert import params_from_proto, params_to_proto
from proto.sampling import FIELD_NAMES, sampling_from_proto, sampling_to_proto
from router.grpc_api import _request_body
from router.protocol import ChatCompletionRequest, CompletionRequest

# a value unlike the default for every field (floats exact in float32, as the proto holds them)
SENT = {
    "temperature": 0.5, "top_p": 0.75, "top_k": 7, "min_p": 0.125, "seed": 1234, "stop": ("STOP", "END"),
    "stop_token_ids": (5, 9), "ignore_eos": True, "max_tokens": 33, "min_tokens": 2, "logprobs": 3,
    "prompt_logprobs": 1, "repetition_penalty": 1.25, "presence_penalty": 0.5, "frequency_penalty": -0.5,
    "skip_special_tokens": False, "include_stop_str_in_output": True,
}
# the copies that leave a field out, and why
SDK_LACKS = {"prompt_logprobs"}  # the public gRPC API refuses it (the HTTP API has echo)
HTTP_SPELLING = {"prompt_logprobs": "echo"}  # completions: echo + logprobs scores the prompt
CHAT_SPELLING = {"logprobs": "top_logprobs", "prompt_logprobs": None}  # OpenAI's chat names; no prompt scores


def test_the_test_covers_every_field():
    assert set(SENT) == set(FIELD_NAMES), "add the new field to SENT (and to every copy below)"


def test_the_engine_carries_every_field_and_converts_both_ways():
    assert {f.name for f in fields(SamplingParams)} == set(FIELD_NAMES) | {"n"}  # n: choices, not a wire field
    params = SamplingParams(**SENT)
    assert params_from_proto(params_to_proto(params)) == params
    assert sampling_from_proto(params_to_proto(params)) == SENT


def test_unset_optional_fields_stay_unset_on_the_wire():
    received = sampling_from_proto(params_to_proto(SamplingParams(max_tokens=None, top_k=0)))
    assert "max_tokens" not in received and received["top_k"] == 0
    assert params_from_proto(params_to_proto(SamplingParams(max_tokens=None))).max_tokens is None


def test_the_sdk_carries_every_field_it_can_send():
    assert {f.name for f in fields(ClientParams)} == set(FIELD_NAMES) - SDK_LACKS
    sent = {name: value for name, value in SENT.items() if name not in SDK_LACKS}
    assert sampling_from_proto(ClientParams(**sent).to_proto()) == sent


def _engine_params(body: CompletionRequest | ChatCompletionRequest, logprobs, prompt_logprobs) -> SamplingParams:
    return body.sampling_params(GenerationDefaults(), body.max_tokens, logprobs, prompt_logprobs)


def test_the_http_models_carry_every_field():
    for model, spelling in ((CompletionRequest, HTTP_SPELLING), (ChatCompletionRequest, CHAT_SPELLING)):
        for name in FIELD_NAMES:
            http_name = spelling.get(name, name)
            assert http_name is None or http_name in model.model_fields, f"{model.__name__} lacks {name}"
    body = CompletionRequest(model="m", prompt="hi", echo=True,
                             **{k: list(v) if isinstance(v, tuple) else v for k, v in SENT.items()
                                if k != "prompt_logprobs"})
    params = _engine_params(body, body.logprobs, body.logprobs)
    assert {name: getattr(params, name) for name in FIELD_NAMES} == {**SENT, "prompt_logprobs": SENT["logprobs"]}


def test_the_public_grpc_api_carries_every_field_it_accepts():
    sent = {name: value for name, value in SENT.items() if name not in SDK_LACKS}
    request = generation_pb2.GenerationRequest(model="m", text="hi", params=sampling_to_proto(ClientParams(**sent)))
    body = CompletionRequest(**_request_body(request))
    params = _engine_params(body, body.logprobs, None)
    assert {name: getattr(params, name) for name in sent} == sent
