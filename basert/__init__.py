"""BaseRT: an OpenAI-compatible LLM inference server with its own model format and CPU engine."""

from __future__ import annotations

__version__ = "0.2.0"

__all__ = ["ChatDelta", "ChatReply", "GenerationStats", "Model", "__version__"]


def __getattr__(name: str):
    # Importing the engine loads the compiled kernels; the CLI and the converter do not need them.
    if name in __all__:
        from basert import api

        return getattr(api, name)
    raise AttributeError(f"module 'basert' has no attribute {name!r}")
