"""Serving: `moelora serve` (an OpenAI-compatible HTTP server) and `moelora run-batch` over
one scheduler thread driving the decode engine (moelora.engine). docs/serve.md."""
