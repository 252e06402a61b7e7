"""The logging handlers this process has set up (Prefect's console and API handlers among them)."""

import logging


def every_log_handler() -> list[logging.Handler]:
    """Every handler of the root logger and of every named logger, each once."""
    loggers = [logging.getLogger(), *map(logging.getLogger, list(logging.root.manager.loggerDict))]
    handlers: dict[int, logging.Handler] = {}
    for logger in loggers:
        for handler in getattr(logger, "handlers", []):
            handlers.setdefault(id(handler), handler)
    return list(handlers.values())
