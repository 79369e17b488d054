"""The KV wire format: a protobuf header per chunk plus the tensor's raw bytes.

A layer's KV for a run of positions is split by positions into chunks of at most
``max_chunk_bytes`` (so that every gRPC message stays far below its size limit); each chunk
names its request, layer, position range, dtype and shape, and carries a crc32 of its
payload. Payload bytes are the tensor's memory, little-endian; decoding checks every field
and the checksum before a tensor is built. No pickle anywhere.
"""

from __future__ import annotations

import sys
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from proto import kv_transfer_pb2 as pb

MAX_CHUNK_BYTES = 1 << 20
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}

if sys.byteorder != "little":  # payloads are raw memory; a big-endian peer would misread them
    raise ImportError("tandem's KV wire format needs a little-endian machine")


class CorruptChunkError(ValueError):
    """A chunk failed validation (checksum, dtype, shape or size); its KV must not be used."""


@dataclass(frozen=True, slots=True)
class DecodedChunk:
    request_id: str
    layer: int
    start_pos: int
    kv: torch.Tensor  # [num_tokens, 2 * kv_heads, head_dim]


def encode_layer(
    request_id: str, layer: int, start_pos: int, kv: torch.Tensor, max_chunk_bytes: int = MAX_CHUNK_BYTES
) -> Iterator[pb.KVMessage]:
    """kv [num_tokens, 2 * kv_heads, head_dim] -> KVMessage chunks covering every position."""
    if kv.dtype not in DTYPE_NAMES or kv.dim() != 3:
        raise ValueError(f"cannot encode KV of shape {tuple(kv.shape)} and dtype {kv.dtype}")
    per_token = kv[0].numel() * kv.element_size()
    tokens_per_chunk = max(1, max_chunk_bytes // per_token)
    for offset in range(0, kv.shape[0], tokens_per_chunk):
        part = kv[offset : offset + tokens_per_chunk].contiguous()
        payload = part.view(torch.uint8).numpy().tobytes()
        yield pb.KVMessage(
            chunk=pb.KVChunk(
                request_id=request_id,
                layer=layer,
                start_pos=start_pos + offset,
                num_tokens=part.shape[0],
                dtype=DTYPE_NAMES[kv.dtype],
                shape=list(part.shape),
                crc32=zlib.crc32(payload),
                payload=payload,
            )
        )


def decode_chunk(chunk: pb.KVChunk, dtype: torch.dtype, token_shape: tuple[int, int]) -> DecodedChunk:
    """Validate a chunk against the receiver's cache geometry and rebuild its tensor."""
    if chunk.dtype != DTYPE_NAMES.get(dtype):
        raise CorruptChunkError(f"chunk dtype {chunk.dtype!r}, this cache holds {DTYPE_NAMES.get(dtype)}")
    shape = tuple(chunk.shape)
    if len(shape) != 3 or shape[0] != chunk.num_tokens or shape[0] < 1 or shape[1:] != tuple(token_shape):
        raise CorruptChunkError(f"chunk shape {shape} does not fit [num_tokens={chunk.num_tokens}, *{token_shape}]")
    expected_bytes = shape[0] * shape[1] * shape[2] * torch.tensor([], dtype=dtype).element_size()
    if len(chunk.payload) != expected_bytes:
        raise CorruptChunkError(f"payload is {len(chunk.payload)} bytes, its shape needs {expected_bytes}")
    if zlib.crc32(chunk.payload) != chunk.crc32:
        raise CorruptChunkError("payload checksum mismatch")
    raw = torch.frombuffer(bytearray(chunk.payload), dtype=torch.uint8)
    return DecodedChunk(chunk.request_id, chunk.layer, chunk.start_pos, raw.view(dtype).view(shape))
