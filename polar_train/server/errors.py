"""Request errors of the server: defined in :mod:`polar_train.wire.errors` (shared with the addon)."""

from ..wire.errors import ApiError, BadRequest, NotFound

__all__ = ["ApiError", "BadRequest", "NotFound"]
