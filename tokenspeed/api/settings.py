"""`ServerSettings`: what the HTTP layer is configured with, independent of argparse.

Tests and embedders build it directly; `args.py` builds it from the command line.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenspeed.engine.segment_cache import DEFAULT_TOKENIZER_CACHE_TOKENS

# 8 MiB holds a 1M-token prompt as JSON text (~4 bytes a token) with room for tools and history;
# more than that is a mistake or an attack, and parsing it would stall every other request.
DEFAULT_MAX_REQUEST_BODY_BYTES = 8 * 2**20
# Prompts in one /v1/completions request: each is tokenised and run as its own engine request.
DEFAULT_MAX_PROMPTS_PER_REQUEST = 256
# Responses kept for `previous_response_id` (an LRU); an agent session needs only its latest one.
DEFAULT_MAX_STORED_RESPONSES = 1024


@dataclass(slots=True)
class ServerSettings:
    served_model_names: list[str] = field(default_factory=lambda: ["embedded"])
    api_key: str | None = None
    tool_call_parser: str | None = None  # a key of parsers.TOOL_FORMATS
    reasoning_parser: str | None = None  # a key of parsers.REASONING_PARSERS
    chat_template: str | None = None  # template text (args.py reads a file path)
    metrics_require_auth: bool = False  # /metrics behind the API key too
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST
    max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES
    tokenizer_cache_tokens: int = DEFAULT_TOKENIZER_CACHE_TOKENS  # chat prompt segments kept tokenised; 0: off

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]
