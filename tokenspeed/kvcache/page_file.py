"""The on-disk form of one KV page, and the stores that hold those files.

A page file is a 80-byte header then the page's bytes, exactly as the
executor's host slot holds them:

    magic "TSKVPAG1" | layout fingerprint (16) | chained page hash (16) |
    payload length (u64 LE) | reserved (16, zero) | blake2b-128 of everything else

The checksum covers the header fields and the payload, so a truncated file, a
flipped bit, a file written for another model, dtype, page size or layer
count, or one renamed to another page's hash reads as a MISS (`decode_page`
returns None), never as somebody else's KV. Files are written to a temporary
name and renamed into place, so a crash leaves either the old state or a
complete file, never a half-written page under a real name.

`PageFileStore` is the narrow interface the disk tier needs (write, read,
delete, list); `DirectoryStore` is the real one, and every method is safe to
call from the executor's IO thread while the scheduler thread uses the index,
because the index never touches a file a copy in flight is using.
"""

from __future__ import annotations

import contextlib
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from hashlib import blake2b
from typing import Protocol

MAGIC = b"TSKVPAG1"
_HEAD = struct.Struct("<8s16s16sQ16s")  # magic, fingerprint, page hash, payload length, reserved
_DIGEST = 16
HEADER_BYTES = _HEAD.size + _DIGEST
FILE_SUFFIX = ".kvpage"
TEMP_SUFFIX = ".tmp"


@dataclass(slots=True, frozen=True)
class KVLayout:
    """What one page's bytes mean; pages written under another layout are never read back."""

    model: str  # model id or path
    dtype: str  # KV cache dtype, e.g. "bfloat16", "fp8_e4m3"
    page_size: int  # tokens per page
    num_layers: int
    bytes_per_page: int  # all layers, K and V (or the MLA latent), of this rank's shard
    shard: str = ""  # e.g. "tp0of2" when each tensor-parallel rank keeps its own slice

    def __post_init__(self) -> None:
        if self.page_size < 1 or self.num_layers < 1 or self.bytes_per_page < 1:
            raise ValueError(f"a KV layout needs positive page_size, num_layers and bytes_per_page: {self}")

    def fingerprint(self) -> bytes:
        text = f"{self.model}|{self.dtype}|{self.page_size}|{self.num_layers}|{self.bytes_per_page}|{self.shard}"
        return blake2b(text.encode(), digest_size=_DIGEST).digest()

    @property
    def file_bytes(self) -> int:
        return HEADER_BYTES + self.bytes_per_page


def page_file_name(page_hash: bytes) -> str:
    return page_hash.hex() + FILE_SUFFIX


def encode_header(layout: KVLayout, page_hash: bytes, payload: bytes | memoryview) -> bytes:
    """The header to write before `payload` (its checksum covers the payload)."""
    head = _HEAD.pack(MAGIC, layout.fingerprint(), page_hash, len(payload), bytes(16))
    digest = blake2b(head, digest_size=_DIGEST)
    digest.update(payload)
    return head + digest.digest()


def decode_page(layout: KVLayout, page_hash: bytes, blob: bytes) -> bytes | None:
    """The payload if `blob` is a whole, intact page file for `page_hash` under `layout`; else None."""
    if len(blob) != layout.file_bytes:
        return None
    head, stored = blob[: _HEAD.size], blob[_HEAD.size : HEADER_BYTES]
    magic, fingerprint, found_hash, length, _reserved = _HEAD.unpack(head)
    if magic != MAGIC or fingerprint != layout.fingerprint() or found_hash != page_hash:
        return None
    if length != layout.bytes_per_page:
        return None
    payload = blob[HEADER_BYTES:]
    digest = blake2b(head, digest_size=_DIGEST)
    digest.update(payload)
    return payload if digest.digest() == stored else None


@dataclass(slots=True, frozen=True)
class StoredFile:
    name: str
    size: int
    mtime: float


class PageFileStore(Protocol):
    """Where page files live (a directory; tests use an in-memory dict)."""

    def write(self, name: str, parts: Sequence[bytes | memoryview]) -> None:
        """Store the concatenation of `parts` under `name`, atomically (raises OSError on failure)."""

    def read(self, name: str) -> bytes | None:
        """The whole file, or None if it is missing or unreadable."""

    def delete(self, name: str) -> None:
        """Remove `name` if it exists."""

    def list(self) -> list[StoredFile]:
        """Every file in the store."""


class DirectoryStore:
    """Page files in one directory (created if missing)."""

    __slots__ = ("path",)

    def __init__(self, path: str) -> None:
        self.path = path
        os.makedirs(path, exist_ok=True)

    def write(self, name: str, parts: Sequence[bytes | memoryview]) -> None:
        final = os.path.join(self.path, name)
        temp = f"{final}.{os.getpid()}{TEMP_SUFFIX}"
        try:
            with open(temp, "wb") as file:
                for part in parts:
                    file.write(part)
            os.replace(temp, final)
        except BaseException:
            self.delete(os.path.basename(temp))
            raise

    def read(self, name: str) -> bytes | None:
        try:
            with open(os.path.join(self.path, name), "rb") as file:
                return file.read()
        except OSError:
            return None

    def delete(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self.path, name))

    def list(self) -> list[StoredFile]:
        found: list[StoredFile] = []
        with os.scandir(self.path) as entries:
            for entry in entries:
                if entry.is_file(follow_symlinks=False):
                    stat = entry.stat(follow_symlinks=False)
                    found.append(StoredFile(entry.name, stat.st_size, stat.st_mtime))
        return found
