"""The KV wire format: frames of a small protobuf header plus the tensor's raw bytes.

    frame = [uint32 little-endian n][n bytes: KVMessage][payload bytes]

A layer's KV for a run of positions is split by positions into chunks of at most
``max_chunk_bytes``; each chunk's header names its request, layer, position range, dtype and
shape and carries an xxh3-64 checksum of its payload (a
cryptographic digest would be the bottleneck of this path; this one runs at tens of GB/s). The payload is the tensor's memory (little-endian),
copied once into the frame and read back without a copy; decoding checks every field and the
checksum before a tensor is built. First tokens and aborts are frames without payload.
No pickle anywhere.
"""

from __future__ import annotations

import struct
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import xxhash

from proto import kv_transfer_pb2 as pb
from proto.rpc import MAX_MESSAGE_BYTES

MAX_CHUNK_BYTES = MAX_MESSAGE_BYTES // 4  # payload per frame on gRPC (1 MiB: messages stay far below the limit)
MAX_HEADER_BYTES = 1 << 16
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_LENGTH = struct.Struct("<I")

if sys.byteorder != "little":  # payloads are raw memory; a big-endian peer would misread them
    raise ImportError("tandem's KV wire format needs a little-endian machine")


class CorruptChunkError(ValueError):
    """A frame failed validation (length, checksum, dtype or shape); its KV must not be used."""


@dataclass(frozen=True, slots=True)
class DecodedChunk:
    request_id: str
    layer: int
    start_pos: int
    kv: torch.Tensor  # [num_tokens, 2 * kv_heads, head_dim]; read-only (shares the frame's bytes)


def frame(message: pb.KVMessage, payload=b"") -> bytes:
    header = message.SerializeToString()
    return b"".join((_LENGTH.pack(len(header)), header, payload))


def chunk_header(request_id: str, layer: int, start_pos: int, part: torch.Tensor, checksum: int) -> pb.KVMessage:
    """The header of one chunk: ``part`` [num_tokens, 2 * kv_heads, head_dim] at ``start_pos``."""
    header = pb.KVMessage()
    chunk = header.chunk
    chunk.request_id = request_id
    chunk.layer = layer
    chunk.start_pos = start_pos
    chunk.num_tokens = part.shape[0]
    chunk.dtype = DTYPE_NAMES[part.dtype]
    chunk.shape.extend(part.shape)
    chunk.checksum = checksum
    chunk.payload_bytes = part.numel() * part.element_size()
    return header


def chunk_parts(kv: torch.Tensor, max_chunk_bytes: int) -> Iterator[tuple[int, torch.Tensor]]:
    """kv [num_tokens, 2 * kv_heads, head_dim] cut by positions into contiguous parts of at most
    ``max_chunk_bytes`` (at least one position each): (offset, part)."""
    if kv.dtype not in DTYPE_NAMES or kv.dim() != 3:
        raise ValueError(f"cannot encode KV of shape {tuple(kv.shape)} and dtype {kv.dtype}")
    per_token = kv[0].numel() * kv.element_size()
    tokens_per_chunk = max(1, max_chunk_bytes // per_token)
    for offset in range(0, kv.shape[0], tokens_per_chunk):
        yield offset, kv[offset : offset + tokens_per_chunk].contiguous()


def encode_layer(
    request_id: str, layer: int, start_pos: int, kv: torch.Tensor, max_chunk_bytes: int = MAX_CHUNK_BYTES
) -> Iterator[bytes]:
    """kv [num_tokens, 2 * kv_heads, head_dim] -> frames covering every position."""
    for offset, part in chunk_parts(kv, max_chunk_bytes):
        part = part.cpu()  # the frame is host bytes
        payload = memoryview(part.view(torch.uint8).numpy())  # no copy until the frame is joined
        header = chunk_header(request_id, layer, start_pos + offset, part, xxhash.xxh3_64_intdigest(payload))
        yield frame(header, payload)


def parse_frame(data) -> tuple[pb.KVMessage, memoryview]:
    """Split a frame into its header message and its payload (a view, not a copy)."""
    view = memoryview(data)
    if view.nbytes < _LENGTH.size:
        raise CorruptChunkError("frame shorter than its length prefix")
    (header_len,) = _LENGTH.unpack_from(view)
    if header_len > MAX_HEADER_BYTES or _LENGTH.size + header_len > view.nbytes:
        raise CorruptChunkError(f"frame header length {header_len} does not fit the frame")
    try:
        message = pb.KVMessage.FromString(view[_LENGTH.size : _LENGTH.size + header_len])
    except Exception as exc:  # protobuf's DecodeError
        raise CorruptChunkError(f"unreadable frame header: {exc}") from exc
    if message.WhichOneof("kind") is None:
        raise CorruptChunkError("frame header carries no message")
    return message, view[_LENGTH.size + header_len :]


def check_chunk_header(chunk: pb.KVChunk, dtype: torch.dtype, token_shape: tuple[int, int]) -> tuple[int, int, int]:
    """A chunk header against the receiver's cache geometry: its shape, if it fits."""
    if chunk.dtype != DTYPE_NAMES.get(dtype):
        raise CorruptChunkError(f"chunk dtype {chunk.dtype!r}, this cache holds {DTYPE_NAMES.get(dtype)}")
    shape = tuple(chunk.shape)
    if len(shape) != 3 or shape[0] != chunk.num_tokens or shape[0] < 1 or shape[1:] != tuple(token_shape):
        raise CorruptChunkError(f"chunk shape {shape} does not fit [num_tokens={chunk.num_tokens}, *{token_shape}]")
    expected_bytes = shape[0] * shape[1] * shape[2] * torch.tensor([], dtype=dtype).element_size()
    if chunk.payload_bytes != expected_bytes:
        raise CorruptChunkError(f"chunk says {chunk.payload_bytes} payload bytes, its shape needs {expected_bytes}")
    return shape


def decode_chunk(chunk: pb.KVChunk, payload: memoryview, dtype: torch.dtype, token_shape: tuple[int, int]) -> DecodedChunk:
    """Validate a chunk against the receiver's cache geometry and view its payload as KV."""
    shape = check_chunk_header(chunk, dtype, token_shape)
    if payload.nbytes != chunk.payload_bytes:
        raise CorruptChunkError(f"payload is {payload.nbytes} bytes, its shape needs {chunk.payload_bytes}")
    if xxhash.xxh3_64_intdigest(payload) != chunk.checksum:
        raise CorruptChunkError("payload checksum mismatch")
    with warnings.catch_warnings():  # a read-only view of the frame's bytes; never written to
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(payload, dtype=torch.uint8)
    return DecodedChunk(chunk.request_id, chunk.layer, chunk.start_pos, raw.view(dtype).view(shape))
