"""The one error type of the wire formats."""


class RequestError(ValueError):
    """A request or payload the sender got wrong: a receiver answers it with HTTP 400 and
    this message (the built-in engine's request errors are this type too)."""
