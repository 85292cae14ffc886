"""Serving an engine: generation over its slot API (text in and out, stops, streaming), the scheduler
(continuous batching), the OpenAI-compatible HTTP server, its request schema and its metrics."""
