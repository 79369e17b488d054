"""Prefix-cache block identity: a chained digest over full blocks of token ids.

    block 0: h0 = H(namespace, tokens[0:B], extra_keys)
    block 1: h1 = H(h0,        tokens[B:2B])
    block i: hi = H(h(i-1),    tokens[iB:(i+1)B])

Equal digests mean equal token prefixes (up to blake2b collisions), under the same model,
dtype and block size (the namespace), so a block's KV can be reused by any request, on any
worker, whose prefix hashes the same. The router and the Redis prefix index use these exact
functions; changing them requires bumping HASH_VERSION.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

import numpy as np

HASH_VERSION = 1
DIGEST_SIZE = 16  # bytes

BlockHash = bytes  # DIGEST_SIZE bytes


def namespace_digest(model_id: str, block_size: int, dtype: str) -> BlockHash:
    """The root of every chain: blocks of different models, dtypes or block sizes never match."""
    key = f"tandem-prefix-v{HASH_VERSION}\0{model_id}\0{block_size}\0{dtype}".encode()
    return hashlib.blake2b(key, digest_size=DIGEST_SIZE).digest()


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra_keys: Sequence[str | int] = ()) -> BlockHash:
    """Digest of one full block given its parent's digest (or the namespace for block 0)."""
    digest = hashlib.blake2b(parent, digest_size=DIGEST_SIZE)
    digest.update(np.asarray(token_ids, dtype="<u4").tobytes())  # fixed width, little-endian
    if extra_keys:
        digest.update(b"\xffextra" + json.dumps(list(extra_keys), separators=(",", ":")).encode())
    return digest.digest()


def hash_blocks(
    namespace: BlockHash,
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: Sequence[str | int] = (),
    known: Sequence[BlockHash] = (),
) -> list[BlockHash]:
    """Digests of every full block of ``token_ids``; ``known`` digests (a prefix of the
    answer, e.g. computed last step) are reused instead of recomputed. ``extra_keys`` (a
    cache salt, ...) enter block 0 and so every later block through the chain."""
    hashes = list(known)
    parent = hashes[-1] if hashes else namespace
    num_full = len(token_ids) // block_size
    if len(hashes) >= num_full:
        return hashes
    # the same bytes hash_block feeds, converted once for all blocks (the router hashes 4k-token
    # prompts per request)
    data = np.asarray(token_ids[: num_full * block_size], dtype="<u4").tobytes()
    width = 4 * block_size
    extra = b"\xffextra" + json.dumps(list(extra_keys), separators=(",", ":")).encode() if extra_keys else b""
    for index in range(len(hashes), num_full):
        digest = hashlib.blake2b(parent, digest_size=DIGEST_SIZE)
        digest.update(data[index * width : (index + 1) * width])
        if index == 0 and extra:
            digest.update(extra)
        parent = digest.digest()
        hashes.append(parent)
    return hashes
