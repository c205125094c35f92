"""The prefix-cache block hashes, computed alike by an engine and by a gateway that routes by them.

A prompt's KV cache is cut into blocks of ``block_size`` tokens; a *full* block ``i`` is named by

    hash(block i) = sha256(hash(block i - 1), tokens of block i, extra keys of block i)

so one hash names the whole prefix up to the block's end. The extra keys are what besides the
tokens makes two KVs differ: the request's ``cache_salt`` and LoRA adapter ``(lora_name,
lora_int_id)`` in the first block (the chain carries them on to every block), and for a block that
covers image tokens each such image's content hash with the offset of the block's first image
token inside that image. The encoding is deterministic and the same on every host (no Python
``hash()``, no pickle), so the engine's KV-cache manager (``services/engine/kv_cache_manager.py``)
and a gateway's ``Router`` get the same bytes for the same request.

Engines publish the blocks they hold as ``digest_key``s: the first 8 bytes of a hash as an unsigned
64-bit integer (a collision between two distinct prefixes is about ``n^2 / 2^65`` likely: it can only
misroute a request, never serve a wrong KV).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Optional

from gridserve.shared.multimodal import ImageFeature

__all__ = ["block_extra_keys", "digest_key", "extend_block_hashes", "hash_block_tokens", "prompt_block_hashes"]


def hash_block_tokens(
    parent_hash: bytes | None, token_ids: Sequence[int], extra_keys: tuple | None = None
) -> bytes:
    """SHA-256 of (parent hash, token ids, extra keys) over a deterministic byte encoding."""
    h = hashlib.sha256()
    # Length-prefix each field so that different splits can never produce the same bytes.
    parent = parent_hash or b""
    h.update(len(parent).to_bytes(4, "little"))
    h.update(parent)
    tokens = struct.pack(f"<{len(token_ids)}q", *token_ids)  # little endian: same on every host
    h.update(len(token_ids).to_bytes(4, "little"))
    h.update(tokens)
    extra = repr(tuple(extra_keys)).encode("utf-8") if extra_keys else b""
    h.update(len(extra).to_bytes(4, "little"))
    h.update(extra)
    return h.digest()


def block_extra_keys(start: int, end: int, cache_salt: Optional[str] = None,
                     lora_key: Optional[tuple[str, int]] = None,
                     images: Sequence[ImageFeature] = ()) -> tuple | None:
    """What besides its tokens keys the block ``[start, end)``: the salt and the LoRA adapter (first
    block only) and the content hash of every image whose tokens it covers, with the offset of the
    block's first one inside the image (an image split across blocks keys each block by its part)."""
    keys: list = [cache_salt] if start == 0 and cache_salt is not None else []
    if start == 0 and lora_key is not None:  # one prompt under two adapters: two KVs
        keys.append(("lora", *lora_key))
    for image in images:
        if image.overlaps(start, end):
            keys.append((image.identifier, max(start, image.offset) - image.offset))
    return tuple(keys) or None


def extend_block_hashes(hashes: list[bytes], token_ids: Sequence[int], block_size: int,
                        cache_salt: Optional[str] = None, lora_key: Optional[tuple[str, int]] = None,
                        images: Sequence[ImageFeature] = ()) -> None:
    """Append to ``hashes`` (the hashes of the first ``len(hashes)`` blocks of ``token_ids``) the
    hash of every further full block."""
    num_full = len(token_ids) // block_size
    while len(hashes) < num_full:
        i = len(hashes)
        start, end = i * block_size, (i + 1) * block_size
        extra = block_extra_keys(start, end, cache_salt, lora_key, images)
        hashes.append(hash_block_tokens(hashes[-1] if hashes else None, token_ids[start:end], extra))


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, cache_salt: Optional[str] = None,
                        lora_key: Optional[tuple[str, int]] = None,
                        images: Sequence[ImageFeature] = ()) -> list[bytes]:
    """The hash of every full block of a prompt, as the engine computes them."""
    hashes: list[bytes] = []
    extend_block_hashes(hashes, token_ids, block_size, cache_salt, lora_key, images)
    return hashes


def digest_key(block_hash: bytes) -> int:
    """The 64-bit key an engine publishes for a block it holds (the hash's first 8 bytes)."""
    return int.from_bytes(block_hash[:8], "little")
