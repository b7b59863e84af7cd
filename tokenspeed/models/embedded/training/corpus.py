"""Training and held-out text: Python sources that exist on any machine with Python, split by file.

Sources (no download): the running interpreter's standard library and,
unless left out, the `.py` files of the packages installed beside it
(site-packages / dist-packages). Installed packages give the many tokens a
GPU run consumes in minutes (the stdlib of a distribution Python, without its
test suite, is only a few million tokens), but a few giants (torch, sympy,
transformers) would dominate, so each top-level package is capped and the
whole site share is capped too.

The split is by file and decided by the file's content: a file is held out
when the first 32 bits of its sha256, modulo 1000, fall below
`held_out_per_mille`. The same file lands on the same side on every machine,
and exact copies of one file (vendored packages) never straddle the split.
Copies are also dropped before anything else, so each text counts once.
Which files are taken under a cap is decided by the same hash order, so caps
sample packages evenly rather than alphabetically.

Tokenisation uses the embedded BPE tokenizer with special-token text in the
sources read as plain text (sources that mention `<|endoftext|>` stay text);
every file is followed by `<|endoftext|>`, the separator the model learns to
emit at the end of a file. Each token's byte length is known exactly (a
byte-level BPE token is one byte per character; the separator has none), so
bits per byte are computed over exactly the bytes of the scored tokens.
"""

from __future__ import annotations

import hashlib
import logging
import site
import sysconfig
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

logger = logging.getLogger("tokenspeed.models")

SOURCES = ("stdlib", "site-packages")
SEPARATOR_TOKEN = "<|endoftext|>"
_SKIPPED_DIRS = frozenset({"__pycache__", "site-packages", "dist-packages"})


@dataclass(frozen=True, slots=True)
class CorpusOptions:
    """Everything that decides which files are read; recorded with the results so a run can be matched."""

    sources: tuple[str, ...] = SOURCES
    held_out_per_mille: int = 20
    max_file_bytes: int = 300_000  # larger files are mostly generated tables or text
    max_line_chars: int = 2_000  # a longer line marks data (base64, tables), not code
    site_budget_bytes: int = 96_000_000
    per_package_bytes: int = 12_000_000
    total_budget_bytes: int | None = None  # smoke runs: a small, still-representative sample

    def to_dict(self) -> dict[str, object]:
        return {f: getattr(self, f) for f in self.__slots__}  # type: ignore[attr-defined]


@dataclass(frozen=True, slots=True)
class SourceFile:
    source: str  # "stdlib" | "site-packages"
    relpath: str  # posix path below the source root
    sha256: str
    size: int
    held_out: bool
    path: Path = field(compare=False)


def is_held_out(sha256_hex: str, per_mille: int) -> bool:
    """The split rule: by the file's content hash, so it is stable and copies agree."""
    return int(sha256_hex[:8], 16) % 1000 < per_mille


def source_roots(sources: Sequence[str]) -> list[tuple[str, Path]]:
    unknown = sorted(set(sources) - set(SOURCES))
    if unknown:
        raise ValueError(f"unknown corpus sources {unknown}; choose from {', '.join(SOURCES)}")
    roots: list[tuple[str, Path]] = []
    if "stdlib" in sources:
        roots.append(("stdlib", Path(sysconfig.get_paths()["stdlib"]).resolve()))
    if "site-packages" in sources:
        candidates = [*site.getsitepackages(), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
        seen: set[Path] = set()
        for candidate in candidates:
            path = Path(candidate).resolve()
            if path.is_dir() and path not in seen:
                seen.add(path)
                roots.append(("site-packages", path))
    return roots


def _readable_code(data: bytes, max_line_chars: int) -> bool:
    if b"\0" in data:
        return False
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return all(len(line) <= max_line_chars for line in text.splitlines())


def _take_in_hash_order(files: Iterable[SourceFile], budget: int | None) -> list[SourceFile]:
    taken: list[SourceFile] = []
    used = 0
    for f in sorted(files, key=lambda f: f.sha256):
        if budget is not None and used + f.size > budget:
            continue
        taken.append(f)
        used += f.size
    return taken


def discover(options: CorpusOptions) -> list[SourceFile]:
    """The corpus files, deduplicated by content, in (source, relpath) order."""
    by_hash: dict[str, SourceFile] = {}
    for source, root in source_roots(options.sources):
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root)
            if _SKIPPED_DIRS.intersection(rel.parts[:-1]) or not path.is_file():
                continue
            size = path.stat().st_size
            if size == 0 or size > options.max_file_bytes:
                continue
            data = path.read_bytes()
            if not _readable_code(data, options.max_line_chars):
                continue
            digest = hashlib.sha256(data).hexdigest()
            if digest not in by_hash:
                held_out = is_held_out(digest, options.held_out_per_mille)
                by_hash[digest] = SourceFile(source, rel.as_posix(), digest, size, held_out, path)
    files = list(by_hash.values())
    stdlib = [f for f in files if f.source == "stdlib"]
    packages: dict[str, list[SourceFile]] = {}
    for f in files:
        if f.source == "site-packages":
            packages.setdefault(f.relpath.split("/", 1)[0], []).append(f)
    site_files = [f for group in packages.values() for f in _take_in_hash_order(group, options.per_package_bytes)]
    chosen = stdlib + _take_in_hash_order(site_files, options.site_budget_bytes)
    chosen = _take_in_hash_order(chosen, options.total_budget_bytes)
    return sorted(chosen, key=lambda f: (f.source, f.relpath))


def files_digest(files: Sequence[SourceFile]) -> str:
    """sha256 of the file list (source, path, content hash, split): the identity of the training data."""
    digest = hashlib.sha256()
    for f in sorted(files, key=lambda f: (f.source, f.relpath)):
        digest.update(f"{f.source}/{f.relpath}\t{f.sha256}\t{'held-out' if f.held_out else 'train'}\n".encode())
    return digest.hexdigest()


def load_tokenizer(path: Path) -> object:
    """The `tokenizers` tokenizer of a model folder, reading special-token text in sources as text."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.encode_special_tokens = True
    return tokenizer


def token_byte_lengths(tokenizer: object) -> np.ndarray:
    """Bytes of text each token id stands for (byte-level BPE: one byte per character; control tokens 0)."""
    vocab_size = tokenizer.get_vocab_size()  # type: ignore[attr-defined]
    lengths = np.zeros(vocab_size, dtype=np.int64)
    added = tokenizer.get_added_tokens_decoder()  # type: ignore[attr-defined]
    for token_id in range(vocab_size):
        entry = added.get(token_id)
        if entry is not None:
            lengths[token_id] = 0 if entry.special else len(entry.content.encode("utf-8"))
        else:
            lengths[token_id] = len(tokenizer.id_to_token(token_id))  # type: ignore[attr-defined]
    return lengths


@dataclass(slots=True)
class TokenisedCorpus:
    files: list[SourceFile]
    train: np.ndarray  # int32 token ids: each train file then the separator
    held_out: np.ndarray  # the same for held-out files
    token_bytes: np.ndarray  # bytes per token id
    options: CorpusOptions

    def summary(self) -> dict[str, object]:
        held = [f for f in self.files if f.held_out]
        return {
            "files": len(self.files),
            "held_out_files": len(held),
            "bytes": sum(f.size for f in self.files),
            "held_out_bytes": sum(f.size for f in held),
            "train_tokens": int(self.train.size),
            "held_out_tokens": int(self.held_out.size),
            "sources": {s: sum(1 for f in self.files if f.source == s) for s in self.options.sources},
            "data_files_sha256": files_digest(self.files),
            "options": self.options.to_dict(),
        }


def _encode(tokenizer: object, files: Sequence[SourceFile], separator: int) -> np.ndarray:
    texts = [f.path.read_bytes().decode("utf-8") for f in files]
    pieces: list[np.ndarray] = []
    chunk = 512  # bounded memory; the Rust side parallelises each batch over all cores
    sep = np.array([separator], dtype=np.int32)
    for start in range(0, len(texts), chunk):
        for encoding in tokenizer.encode_batch(texts[start : start + chunk], add_special_tokens=False):  # type: ignore[attr-defined]
            pieces.append(np.asarray(encoding.ids, dtype=np.int32))
            pieces.append(sep)
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)


def build_corpus(tokenizer_path: Path, options: CorpusOptions) -> TokenisedCorpus:
    files = discover(options)
    if not any(f.held_out for f in files) or all(f.held_out for f in files):
        raise ValueError(f"the corpus needs train and held-out files; got {len(files)} files from {options.sources}")
    tokenizer = load_tokenizer(tokenizer_path)
    separator = tokenizer.token_to_id(SEPARATOR_TOKEN)  # type: ignore[attr-defined]
    train = _encode(tokenizer, [f for f in files if not f.held_out], separator)
    held_out = _encode(tokenizer, [f for f in files if f.held_out], separator)
    corpus = TokenisedCorpus(files, train, held_out, token_byte_lengths(tokenizer), options)
    logger.info("corpus: %s", {k: v for k, v in corpus.summary().items() if k != "options"})
    return corpus


def eval_windows(stream: np.ndarray, window: int, max_windows: int | None) -> np.ndarray:
    """Non-overlapping `window`-token slices spread evenly over `stream`, `[n, window]` int64.

    Position 0 of each window is context only; positions 1.. are scored given
    the tokens before them in the window. Spreading the windows (rather than
    taking the first ones) keeps every package of the held-out set represented.
    """
    total = stream.size // window
    if total == 0:
        raise ValueError(f"held-out stream of {stream.size} tokens is shorter than one window of {window}")
    count = total if max_windows is None else min(total, max_windows)
    starts = (np.arange(count, dtype=np.int64) * total // count) * window
    return np.stack([stream[s : s + window] for s in starts]).astype(np.int64)


def held_out_windows(
    tokenizer_path: Path, options: CorpusOptions, window: int, max_windows: int | None
) -> tuple[np.ndarray, np.ndarray, dict[str, object]]:
    """(windows, bytes per token id, what was read): the held-out evaluation set, without tokenising the rest."""
    files = discover(options)
    held = [f for f in files if f.held_out]
    tokenizer = load_tokenizer(tokenizer_path)
    stream = _encode(tokenizer, held, tokenizer.token_to_id(SEPARATOR_TOKEN))  # type: ignore[attr-defined]
    about = {"held_out_files": len(held), "held_out_tokens": int(stream.size), "data_files_sha256": files_digest(files)}
    return eval_windows(stream, window, max_windows), token_byte_lengths(tokenizer), about
