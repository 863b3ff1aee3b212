"""Errors the engine raises for bad models or bad requests.

Contract: every error a user can cause (a broken checkpoint, a bad request) is an `EngineError`
subclass whose message is one line naming the file, tensor or field at fault, so front ends can
print it without a traceback.
"""


class EngineError(Exception):
    """Base class of user-facing engine errors."""


class ConfigError(EngineError):
    """config.json is missing, malformed, or describes an unsupported model."""


class WeightError(EngineError):
    """A checkpoint file or tensor is missing, truncated or of the wrong shape."""


class RequestError(EngineError):
    """A generation request is invalid (empty prompt, bad sampling parameters, too long)."""


class CapacityError(EngineError):
    """The request cannot fit in the KV / state memory the engine was given."""
