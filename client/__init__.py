"""tandem's Python gRPC client SDK. Needs only grpcio and protobuf (no torch, ray or engine):

    from client import TandemClient, SamplingParams

    with TandemClient("localhost:50051") as tandem:
        for chunk in tandem.generate("The sea is", SamplingParams(max_tokens=16)):
            print(chunk.text, end="")
"""

from client.aio import AsyncTandemClient
from client.params import SamplingParams
from client.sync import TandemClient
from client.types import Chunk, Choice, Completion, ModelCard, TandemError, TokenLogprob, Usage

__all__ = ["AsyncTandemClient", "Chunk", "Choice", "Completion", "ModelCard", "SamplingParams", "TandemClient",
           "TandemError", "TokenLogprob", "Usage"]
