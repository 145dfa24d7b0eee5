"""Errors raised when a model file is refused; each message is one line naming the file and what is wrong."""

from __future__ import annotations

from basert.errors import BaseRTError


class ModelValidationError(BaseRTError, ValueError):
    """A model file cannot be served as it stands: it is malformed, or its header contradicts its tensors.

    A fault of the server's setup, never of a request (status 500): its message names a path, so it stays
    in the log and the client gets an error id.
    """


class BaseFormatError(ModelValidationError):
    """A `.base` file cannot be read as the format spec describes."""


class TruncatedFileError(BaseFormatError):
    """The file ends before the data its header describes."""


class BadMagicError(BaseFormatError):
    """The file does not start with the `BASE` magic."""


class UnsupportedVersionError(BaseFormatError):
    """The file's format version is not one this reader understands."""


class HeaderOverflowError(BaseFormatError):
    """The declared header length runs past the end of the file."""


class InvalidHeaderError(BaseFormatError):
    """The header is not UTF-8 JSON, or lacks a required key, or a key has the wrong type."""


class TensorOutOfBoundsError(BaseFormatError):
    """A tensor's payload or one of its regions lies outside the bytes it may use."""


class ChecksumMismatchError(BaseFormatError):
    """A tensor's payload does not hash to its recorded `checksum_xxh64`."""


class UnknownDtypeError(BaseFormatError):
    """A tensor's dtype is not one the format defines."""


class UnsupportedDtypeError(BaseFormatError):
    """A tensor's dtype is defined by the format but not implemented here."""
