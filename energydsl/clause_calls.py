"""The calls a clause takes, with their keywords: optimizers, preconditioners, optimizers across layers.

One table that the energy semantics, the model composition and the search's load-time check all read, so
a name or keyword the language refuses in a spec is refused at the same place in a search's options,
before any trial is spent on it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import Span, SpecError


@dataclass(frozen=True)
class CallKind:
    what: str  # as the messages name it: "optimizer", "preconditioner", "optimizer across layers"
    takes: dict[str, dict[str, float]]  # each call's keywords, with their defaults
    hint: str  # what to write instead of an unknown name
    suffix: str = ""  # after the call's name in a message about its keywords

    def check(self, name: str, name_span: Span | None, keywords: list[tuple[str, Span | None]]) -> None:
        """Refuse an unknown call, or a keyword it does not take, at its place."""
        if name not in self.takes:
            raise SpecError(f"unknown {self.what} `{name}`", name_span, self.hint)
        for key, span in keywords:
            if key not in self.takes[name]:
                takes = ", ".join(sorted(self.takes[name])) or "no parameters"
                raise SpecError(f"`{name}`{self.suffix} has no parameter `{key}`", span, f"it takes {takes}")


OPTIMIZER = CallKind("optimizer", {
    "gd": {"eta": 1}, "momentum": {"eta": 1, "beta": 0.9}, "nag": {"eta": 1, "beta": 0.9},
    "newton": {"eta": 1, "taylor": 1, "damping": 0},
}, "use gd, momentum, nag or newton")

PRECONDITIONER = CallKind("preconditioner", {
    "scalar": {}, "diag": {}, "dplr": {"rank": 1}, "psd": {"rank": 1}, "full": {}, "covariance": {"tau": 0.01},
}, "use scalar, diag, dplr(rank), psd(rank), full or covariance(tau)")

ACROSS_LAYERS = CallKind("optimizer across layers", {
    "momentum": {"beta": 0.9, "eta": 1.0}, "nag": {"beta": 0.9, "eta": 1.0},
}, "use momentum, nag or none", " across layers")
