"""What the SDK returns (plain dataclasses, converted from the protobuf messages)."""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from proto import generation_pb2 as pb


class TandemError(Exception):
    """A call failed; ``code`` is the gRPC status (INVALID_ARGUMENT, UNAVAILABLE, ...) and
    ``param`` the request field at fault, when the server named one."""

    def __init__(self, code: grpc.StatusCode, details: str, param: str | None = None) -> None:
        super().__init__(f"{code.name}: {details}" + (f" (param: {param})" if param else ""))
        self.code = code
        self.details = details
        self.param = param

    @classmethod
    def from_rpc(cls, error: grpc.RpcError) -> "TandemError":
        trailer = dict(error.trailing_metadata() or ())
        return cls(error.code(), error.details(), trailer.get("tandem-error-param"))


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    rank: int
    token: str


@dataclass(frozen=True, slots=True)
class Chunk:
    """Part of one choice, as it streams."""

    index: int  # choice index
    token_ids: list[int]
    text: str  # text delta
    logprobs: list[list[TokenLogprob]]  # per token: the chosen one first, then the top-N
    finish_reason: str | None  # set on the choice's last chunk


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(slots=True)
class Choice:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[list[TokenLogprob]] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass(frozen=True, slots=True)
class Completion:
    request_id: str
    choices: list[Choice]
    usage: Usage


@dataclass(frozen=True, slots=True)
class ModelCard:
    id: str
    max_model_len: int
    owned_by: str
    created: int


def chunk_from_proto(message: pb.GenerationChunk) -> Chunk:
    logprobs = [[TokenLogprob(e.token_id, e.logprob, e.rank, e.decoded_token) for e in position.entries]
                for position in message.logprobs]
    return Chunk(message.index, list(message.token_ids), message.text, logprobs, message.finish_reason or None)


def usage_from_proto(message: pb.Usage) -> Usage:
    return Usage(message.prompt_tokens, message.completion_tokens, message.cached_tokens)


class CompletionBuilder:
    """Accumulates a Generate stream into a Completion."""

    def __init__(self) -> None:
        self.choices: dict[int, Choice] = {}
        self.usage: Usage | None = None
        self.request_id = ""

    def add(self, response: pb.GenerationResponse) -> Chunk | None:
        self.request_id = response.request_id
        if response.WhichOneof("kind") == "final":
            self.usage = usage_from_proto(response.final.usage)
            return None
        chunk = chunk_from_proto(response.chunk)
        choice = self.choices.setdefault(chunk.index, Choice(chunk.index))
        choice.text += chunk.text
        choice.token_ids += chunk.token_ids
        choice.logprobs += chunk.logprobs
        choice.finish_reason = chunk.finish_reason or choice.finish_reason
        return chunk

    def build(self) -> Completion:
        if self.usage is None:
            raise TandemError(grpc.StatusCode.UNKNOWN, "the stream ended without its final message")
        return Completion(self.request_id, [self.choices[i] for i in sorted(self.choices)], self.usage)
