"""The HTTP layer: OpenAI-compatible API on Ray Serve."""
