"""`--shard i/n`: a stable partition of a manifest by a hash of each row's id.

The hash is SHA-256, not Python's hash(), so every process and machine puts a row in the same
shard; the shards of one n are disjoint and together hold every row, including rows that fail.
"""
from __future__ import annotations

import hashlib

from ..errors import TTSError
from ..recipe import ascii_whole_number


def parse_shard(spec: str) -> tuple[int, int]:
    """'i/n' -> (i, n), 0 <= i < n, in ASCII digits (as --rows)."""
    index, _, count = spec.partition("/")
    index, count = ascii_whole_number(index.strip()), ascii_whole_number(count.strip())
    if index is None or count is None or not 0 <= index < count:
        raise TTSError(f"--shard {spec!r}: expected i/n with 0 <= i < n, e.g. 0/4")
    return index, count


def stable_id_number(row_id: str) -> int:
    """A 64-bit number from the id, the same in every process and on every machine."""
    digest = hashlib.sha256(row_id.encode("utf-8", errors="surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big")


def shard_of(row_id: str, shard_count: int) -> int:
    return stable_id_number(row_id) % shard_count
