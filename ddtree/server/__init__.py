"""`ddtree serve`: the OpenAI-compatible HTTP server over one DDTreeEngine (docs/interfaces.md section 11)."""
