"""Request bodies of the HTTP API, as pydantic models (responses are plain dicts built by the routes)."""
