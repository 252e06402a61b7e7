"""Python's cyclic garbage collector paused while a process imports its libraries: an import makes hundreds of
thousands of objects that live as long as the process, and the collector would walk them again at every one of
its runs (about 13 % of the CPU of importing Prefect's server here)."""

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def paused_for_imports() -> Iterator[None]:
    """Pause the collector for the block, then move what exists by then out of its sight (`gc.freeze`) and resume
    it. For blocks that import and set up what lives on; garbage the block made in cycles is never freed."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.freeze()
            gc.enable()
