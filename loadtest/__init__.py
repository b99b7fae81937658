"""Load tests for the OpenAI-compatible endpoint: a locust file and a headless runner with reports."""
