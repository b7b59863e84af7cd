"""The HTTP API layer: OpenAI- and Anthropic-compatible routes over `AsyncEngine`.

Kept import-light (no FastAPI here) so `tokenspeed serve --help` is instant;
`app.build_app` builds the application and `server.run_server` serves it.
"""
