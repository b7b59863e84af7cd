"""Moonlight's (Kimi's) tokenizer constants, for building it from Moonshot's `tiktoken.model`.

Moonlight-16B-A3B tokenises with Kimi's tiktoken BPE: 163,584 ranks, then 256
special ids (163584..163839). No PyPI package ships the rank file, so the
preset is token-id-only unless `TOKENSPEED_KIMI_TIKTOKEN` points at the
checkpoint's `tiktoken.model` (see `tokenizers.py`). The pre-tokenizer keeps
runs of Han characters together and splits Latin words on case, with
Oniguruma's `&&` class intersection, which the `tokenizers` regex supports.

Only the markers Moonlight's chat format uses are named; the other special ids
keep Moonshot's `<|reserved_token_{id}|>` spelling (Kimi-K2 later named some
of them: tool-call sections, media, think).
"""

from __future__ import annotations

KIMI_PATTERN = "|".join(
    [
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)

KIMI_FIRST_SPECIAL_ID = 163584
KIMI_NAMED_SPECIAL_TOKENS: dict[int, str] = {
    163584: "[BOS]",
    163585: "[EOS]",
    163586: "<|im_end|>",
    163587: "<|im_user|>",
    163588: "<|im_assistant|>",
    163590: "<|start_header_id|>",
    163591: "<|end_header_id|>",
    163593: "[EOT]",
    163594: "<|im_system|>",
    163601: "<|im_middle|>",
    163838: "[UNK]",
    163839: "[PAD]",
}

KIMI_ADDED_TOKENS: tuple[tuple[str, bool], ...] = tuple(
    (KIMI_NAMED_SPECIAL_TOKENS.get(i, f"<|reserved_token_{i}|>"), True)
    for i in range(KIMI_FIRST_SPECIAL_ID, KIMI_FIRST_SPECIAL_ID + 256)
)
