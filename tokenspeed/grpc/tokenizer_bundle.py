"""`GetTokenizer`: the model's tokenizer files as one zip, streamed in chunks.

A gateway on another host cannot read the replica's model folder, so it
asks for the files that build the tokenizer and the chat template. The zip
is built once (in a worker thread: deflating a large `tokenizer.json` takes
a while), kept in memory, and sent in 64 KiB chunks; the last chunk carries
the SHA-256 of the whole archive so the receiver can check what it joined.
"""

from __future__ import annotations

import hashlib
import io
import zipfile
from collections.abc import Iterator
from pathlib import Path

from smg_grpc_proto.generated import common_pb2

CHUNK_BYTES = 64 * 1024
_NAMES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "config.json",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "tiktoken.model",  # Kimi-K2's BPE ranks (its tokenizer class is remote code, which is not sent)
    "chat_template.json",
)
_PATTERNS = ("*.jinja", "*.tiktoken")


def tokenizer_files(folder: Path) -> list[Path]:
    files = [folder / name for name in _NAMES if (folder / name).is_file()]
    for pattern in _PATTERNS:
        files.extend(sorted(p for p in folder.glob(pattern) if p.is_file() and p not in files))
    return files


def build_bundle(folder: Path) -> tuple[bytes, str]:
    """The zip of `folder`'s tokenizer files and its SHA-256 (hex); FileNotFoundError if there are none."""
    files = tokenizer_files(folder)
    if not files:
        raise FileNotFoundError(f"No tokenizer files in {folder}.")
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for path in files:
            archive.write(path, path.name)
    data = buffer.getvalue()
    return data, hashlib.sha256(data).hexdigest()


def bundle_chunks(data: bytes, sha256: str) -> Iterator[common_pb2.GetTokenizerChunk]:
    for start in range(0, len(data), CHUNK_BYTES):
        last = start + CHUNK_BYTES >= len(data)
        yield common_pb2.GetTokenizerChunk(data=data[start : start + CHUNK_BYTES], sha256=sha256 if last else "")
