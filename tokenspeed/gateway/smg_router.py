"""The `smg` router as our child process: `python -m tokenspeed.gateway.smg_router [smg launch flags]`.

Why not `smg launch` directly: two things must not be on a command line or
left to chance. The API key comes from the environment
(`TOKENSPEED_SMG_API_KEY`, removed once read), so `ps` never shows it; and
the router exits when the launcher goes (`--parent-pid`, the kernel's
parent-death signal), so a killed launcher leaves no router listening.
"""

from __future__ import annotations

import os
import sys

API_KEY_ENV = "TOKENSPEED_SMG_API_KEY"

# Our parser names -> smg's names for the same formats.
TOOL_CALL_PARSERS = {"hermes": "qwen", "qwen": "qwen", "deepseek_v3": "deepseek"}
REASONING_PARSERS = {"qwen3": "qwen3", "deepseek_r1": "deepseek_r1"}


def main(argv: list[str] | None = None) -> None:
    from smg.launch_router import launch_router, parse_router_args

    from tokenspeed.engine.core_process import exit_with_parent

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--parent-pid" in argv:
        at = argv.index("--parent-pid")
        exit_with_parent(int(argv[at + 1]))
        del argv[at : at + 2]
    router_args = parse_router_args(argv)
    api_key = os.environ.pop(API_KEY_ENV, None)
    if api_key:
        router_args.api_key = api_key
    launch_router(router_args)


if __name__ == "__main__":
    main()
