"""`--shard i/n`: a stable partition of a manifest by a hash of each row's id.

The hash is SHA-256, not Python's hash(), so every process and machine puts a row in the same
shard; the shards of one n are disjoint and together hold every row, including rows that fail.
"""
from __future__ import annotations

import hashlib
import re

from ..errors import TTSError


def parse_shard(spec: str) -> tuple[int, int]:
    """'i/n' -> (i, n), 0 <= i < n."""
    match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", spec)
    if not match or not 0 <= int(match.group(1)) < int(match.group(2)):
        raise TTSError(f"--shard {spec!r}: expected i/n with 0 <= i < n, e.g. 0/4")
    return int(match.group(1)), int(match.group(2))


def stable_id_number(row_id: str) -> int:
    """A 64-bit number from the id, the same in every process and on every machine."""
    digest = hashlib.sha256(row_id.encode("utf-8", errors="surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big")


def shard_of(row_id: str, shard_count: int) -> int:
    return stable_id_number(row_id) % shard_count
