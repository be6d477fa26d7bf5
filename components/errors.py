"""One error type for bad user input, shared by every CLI command and component."""

from __future__ import annotations

import re

from kfp_nvrx.components.redaction import REDACTED, redact

#: A field a message refers to: `nodes`, or `job_api=pytorchjob` (a value to set it to).
_REFERENCE = re.compile(r"`([a-z_][a-z0-9_]*)(?:=([^`\s]*))?`")


class UserError(Exception):
    """Bad input: reported as a single line naming the field and the fix, exit code 2.

    Args:
        field: The setting that is wrong, by its domain name (``train.steps``, ``nodes``); the
            surface that reports it words it for its user (:class:`Surface`).
        message: What is wrong and how to fix it.
    """

    exit_code = 2

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def one_line(self) -> str:
        """The error as one line (newlines folded)."""
        return " ".join(str(self).split())


# One redaction for the whole process (components/redaction.py); re-exported here, where every
# caller already imports UserError from.
__all__ = ["REDACTED", "UserError", "redact"]


class Surface:
    """How one surface (the CLI, a KFP component, a pipeline) names the fields its user sets.

    The libraries raise :class:`UserError` naming the domain field (``nodes``, ``pvc``,
    ``train.steps``); each surface words it for its own user once, where it reports the error.

    A message refers to another field as `` `nodes` `` or `` `job_api=pytorchjob` ``; the surface
    writes that as its user sets it (``--job-api pytorchjob``, ``job_api=pytorchjob``).

    Args:
        words: Domain field -> the name this surface's user typed.
        prefix: Put before every field (``--param `` for pipeline parameters).
        config_key: How a trainer config key (``train.steps``) reads, ``{}`` the key.
        assign: How a field is set to a value, ``{name}`` and ``{value}`` (``--job-api trainjob``).
    """

    #: The trainer config's sections: a field ``<section>.<key>`` is a config key.
    CONFIG_SECTIONS = ("model", "data", "train", "checkpoint", "resilience")

    def __init__(self, words: dict[str, str], prefix: str = "", config_key: str = "{}",
                 assign: str = "{name}={value}") -> None:
        self.words, self.prefix, self.config_key = words, prefix, config_key
        self.assign = assign

    def word(self, field: str) -> str:
        """The name of ``field`` on this surface."""
        if field.partition(".")[0] in self.CONFIG_SECTIONS and "." in field:
            return self.prefix + self.config_key.format(field)
        return self.prefix + self.words.get(field, field)

    def _reference(self, match: re.Match[str]) -> str:
        field, value = match.groups()
        if field not in self.words:
            return match.group(0)  # quoted text, not a field
        name = self.word(field)
        return name if value is None else self.assign.format(name=name, value=value)

    def reword(self, err: UserError) -> UserError:
        """The same error, naming the field (and those its message refers to) as here."""
        return UserError(self.word(err.field), _REFERENCE.sub(self._reference, err.message))
