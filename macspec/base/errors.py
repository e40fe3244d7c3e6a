"""The project's own exceptions: library code raises these, the CLI turns them into messages."""


class MacspecError(Exception):
    """Base class of every error macspec raises on purpose."""

    exit_code = 1


class ModelError(MacspecError):
    """A model directory, file or store entry is missing, unreadable or unsupported."""


class OptionError(MacspecError, ValueError):
    """An option or argument has an invalid value."""

    exit_code = 2


class PromptError(MacspecError, ValueError):
    """The prompt is empty, out of the vocabulary's range or too long for the context."""


class CompatError(MacspecError):
    """Draft and target do not share a tokenizer, so speculation would not be exact."""


class ConvertError(ModelError):
    """Fetching or converting a model failed; nothing was written to the store."""


class CacheError(MacspecError):
    """A model's cache could not be brought to the length a round needs; going on would make
    the output silently differ from the target's own."""


class ConstraintError(MacspecError):
    """A constraint (grammar, JSON schema) was asked about ids it forbids, or allows nothing: the
    output would no longer be what the constraint promises."""


class MacspecWarning(UserWarning):
    """Base class of macspec's warnings: something works, but slower or worse than it could."""
