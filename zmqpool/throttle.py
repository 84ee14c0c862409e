"""One rule for logging what a peer can make happen at will: a flood logs a few lines.

Refused registrations, dropped messages, malformed heartbeats and forced
reconnects are each counted; the count's 1st, 2nd, 4th, 8th... occurrence is
logged as a warning, the others at debug level.
"""

from __future__ import annotations

import logging
from typing import Any


def log_throttled(logger: logging.Logger, count: int, message: str, *args: Any) -> None:
    """``logger.warning(message, *args)`` if ``count`` is a power of two, else debug."""
    level = logging.WARNING if count & (count - 1) == 0 else logging.DEBUG
    logger.log(level, message, *args)
