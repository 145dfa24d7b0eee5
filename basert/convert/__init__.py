"""Converters from GGUF files and HF safetensors directories to .base model files."""

from basert.convert.pipeline import ConvertReport, convert, open_source
from basert.convert.source import ConvertError
from basert.convert.targets import TARGETS

__all__ = ["TARGETS", "ConvertError", "ConvertReport", "convert", "open_source"]
