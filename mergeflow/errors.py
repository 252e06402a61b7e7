"""The errors mergeflow raises for bad input: each names the file and the problem."""


class MergeflowError(Exception):
    """Base class: a problem with the input or the options, reported without a traceback."""

    def __init__(self, message: str, *, hint: str | None = None):
        super().__init__(message)
        self.hint = hint
        """What to do about it, when the message alone does not say (the CLI prints it on a line of its own)."""

    def __reduce__(self):
        """Pickled with its attributes (a Dask worker's error reaches the flow with its hint)."""
        return _restored, (type(self), str(self), self.__dict__)


def _restored(cls: type[MergeflowError], message: str, attributes: dict) -> MergeflowError:
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    error.__dict__.update(attributes)
    return error


class CheckpointError(MergeflowError):
    """The checkpoint on disk is missing, incomplete, unsafe or not what it claims to be."""


class PlanError(MergeflowError):
    """The checkpoint's tensors cannot be mapped onto the Hugging Face model."""


class OutputError(MergeflowError):
    """The target directory cannot be written as asked."""


def quoted(names) -> str:
    """Sorted, quoted, comma-separated names, for error messages."""
    return ", ".join(f'"{name}"' for name in sorted(names))


class OptionError(MergeflowError):
    """An option's value is not one mergeflow accepts."""


class ValidationError(MergeflowError):
    """A merged model is incomplete, or differs from its reference."""


class UploadError(MergeflowError):
    """The Hub refused or failed an upload; `transient` failures may succeed when retried."""

    def __init__(self, message: str, *, transient: bool = False, retry_after: float | None = None):
        super().__init__(message, hint=None)
        self.transient = transient
        self.retry_after = retry_after
        """Seconds the Hub asked to wait (HTTP 429 Retry-After), if it said."""
