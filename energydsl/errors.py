"""Errors a user can act on, with their source location.

Every stage raises `SpecError` (or its subclasses) for problems in the user's input: the CLI prints
`file:line:col: error: message`, the source line, a caret under the column and a hint, and exits
with status 2. Anything else is an internal error: one line naming the spec, exit status 70.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass, field


def first_few(names: list[str], shown: int = 4, sep: str = ", ") -> str:
    """The first `shown` names of a list a message cites, and how many more: `a, b, c, d and 3 more`."""
    more = len(names) - shown
    tail = "" if more <= 0 else f" and {more} more" if sep == ", " else f"{sep}and {more} more"
    return sep.join(names[:shown]) + tail


def _visible(text: str) -> str:
    """`text` with its control characters (ESC, backspace, bell: a binary file read as a spec) shown as their
    Unicode pictures (␛), one column each, so that quoting a line cannot drive the terminal; tabs kept."""
    return "".join(chr(0x2400 + ord(c)) if ord(c) < 0x20 and c != "\t" else "\u2421" if c == "\x7f" else c
                   for c in text)


def _blank(text: str) -> str:
    """Blanks as wide on a terminal as `text`: its tabs kept (so that the caret line meets the same tab
    stops as the source line above it), two spaces for a wide character, none for a zero-width one."""
    out = []
    for ch in text:
        if ch == "\t":
            out.append("\t")
        elif unicodedata.combining(ch) or unicodedata.category(ch) in ("Mn", "Me", "Cf"):
            continue
        else:
            out.append("  " if unicodedata.east_asian_width(ch) in ("W", "F") else " ")
    return "".join(out)


@dataclass(frozen=True)
class Span:
    """A position in a source text (1-based line and column)."""

    file: str
    line: int
    column: int
    source: str | None = field(default=None, repr=False, compare=False)  # whole text, to quote the line
    end_column: int | None = field(default=None, compare=False)

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.column}"


class UserError(Exception):
    """A problem with what the user gave us (spec, flag, file, data path): exit status 2."""

    exit_code = 2

    def __init__(self, message: str, span: Span | None = None, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.span = span
        self.hint = hint

    def render(self) -> str:
        """The message as printed on the terminal: location, source line with a caret, hint."""
        lines = []
        where = f"{self.span}: " if self.span else ""
        lines.append(f"{where}error: {self.message}")
        if self.span and self.span.source is not None:
            text_lines = self.span.source.split("\n")  # lines as the parser counts them (not at \f or \u2028)
            if 1 <= self.span.line <= len(text_lines):
                src = text_lines[self.span.line - 1].rstrip("\r")
                if len(src) > 200:  # keep megabyte-long lines readable
                    start = max(0, self.span.column - 100)
                    src, col = src[start : start + 200], self.span.column - start
                else:
                    col = self.span.column
                col = max(1, col)
                width = 1
                if self.span.end_column and self.span.end_column > self.span.column:
                    width = min(self.span.end_column - self.span.column, max(1, len(src) - col + 1))
                under = _blank(src[col - 1 : col - 1 + width]).replace("\t", " ")
                lines.append(f"  {_visible(src)}")
                lines.append("  " + _blank(src[: col - 1]) + "^" * max(1, len(under)))
        if self.hint:
            lines.append(f"hint: {self.hint}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.render()


class SpecError(UserError):
    """An error in a `.energy` spec: syntax, names, shapes, indices, differentiability."""


class HoleError(SpecError):
    """A search hole (`choice{...}`, `int a..b`, `float a..b`) where only `energy search` fills it: the declaration
    is a template of a search space."""


class UnknownName(SpecError):
    """A size expression reads a name nothing gives it (`hidden = hh`); `name` is that name, for the hint a caller
    that knows where it could come from adds."""

    def __init__(self, message: str, span: Span | None, hint: str | None, name: str):
        super().__init__(message, span, hint)
        self.name = name


class DataError(UserError):
    """A missing or unreadable data file, an unknown dataset, an impossible size."""


class TrainingDiverged(Exception):
    """The loss became NaN or exploded (`reason` says how); the last good checkpoint is kept.

    An outcome of the user's settings, not a bug: the CLI reports it in one line and exits with 1.
    """

    def __init__(self, step: int, loss: float, checkpoint: str | None = None, reason: str | None = None,
                 checkpoint_step: int | None = None, checkpoint_val_loss: float | None = None,
                 remedy: str = "a lower --lr"):
        self.reason = reason or f"the loss is {loss}"
        where = f"; last good checkpoint kept at {checkpoint}" if checkpoint else ""
        super().__init__(f"training diverged at step {step}: {self.reason}{where}; try {remedy}")
        self.step = step
        self.loss = loss
        self.checkpoint_step = checkpoint_step
        self.checkpoint_val_loss = checkpoint_val_loss
        self.checkpoint = checkpoint
        self.remedy = remedy  # the setting to change, as the CLI spells it: "a lower --lr"


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM) during a training with a run directory: the run was evaluated and saved at `step`
    first.

    A KeyboardInterrupt, so a notebook stops as usual; `checkpoint` names the `last` checkpoint written and
    `signum` the signal that asked (the CLI exits 128 + signum: 130, or 143 for SIGTERM).
    """

    def __init__(self, step: int, checkpoint: str | None, signum: int = 2):
        super().__init__(f"training interrupted at step {step}; saved {checkpoint}")
        self.step = step
        self.checkpoint = checkpoint
        self.signum = signum
