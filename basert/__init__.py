"""BaseRT: an OpenAI-compatible LLM inference server with its own model format and CPU engine."""

__version__ = "0.2.0"
