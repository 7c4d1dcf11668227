"""Validity checks of a candidate's stages (`energy check` at small dims), remembered in this process and
on disk.

Why: checking an energy the search has not seen yet costs a few hundred milliseconds (SymPy
differentiates an explicit instance), more than all the rest of a trial's own work. Candidates repeat the
same few energies, and every worker process and every rerun of a study would check them again. A verdict
is a pure function of the declaration (its text and the position of every node: `api.declaration_key`,
so a reason that cites `file:line:col` is right for the candidate that reads it), the dims it is checked
at, and the code that derives and checks; it is stored under a hash of all of them, so a changed compiler,
torch or SymPy never reads an old verdict. Files are written whole (rename), so concurrent workers are
safe: at worst two of them check the same energy once each.

`ENERGYDSL_CHECK_CACHE` names the directory (default: `checks/` under the code generator's cache,
`$ENERGYDSL_CACHE` or `~/.cache/energydsl/codegen`); `off` keeps verdicts in memory only.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from energydsl.errors import UserError
from energydsl.files import cache_setting, read_record, write_record
from energydsl.number_text import plain_number

SHRINK = (4, 8, 16, 32)  # checks run at small dims: sizes above the bound are halved while whole
FORMAT = 1  # of the files; part of the hash


@dataclass(frozen=True)
class Verdict:
    """What checking one energy at one set of dims found."""

    fits: bool  # False: the energy does not derive at these (shrunk) dims; the next bound is tried
    reason: str | None = None  # why the candidate is invalid; None when every check passed


_MEMORY: dict[str, Verdict] = {}  # digest -> verdict, this process


def cache_dir() -> Path | None:
    """Where verdicts are kept across processes; None when `ENERGYDSL_CHECK_CACHE` is `off`."""
    return cache_setting("ENERGYDSL_CHECK_CACHE", "checks")


@functools.cache
def code_version() -> str:
    """A hash of what a verdict depends on besides the declaration (`verdict_sources`) and the torch and
    SymPy versions."""
    import sympy
    import torch

    digest = hashlib.sha256(f"{FORMAT}|{torch.__version__}|{sympy.__version__}".encode())
    for path in verdict_sources():
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def verdict_sources() -> list[Path]:
    """The files a verdict depends on: the modules that parse, derive and check (the package's top level), the
    code generator and the runtime ops its layers call (the `compiled` row runs the generated layer), this
    module and the grammar. Training and the rest of the search play no part."""
    from energydsl.syntax import GRAMMAR_PATH

    root = Path(__file__).resolve().parent.parent
    generated = [*sorted((root / "codegen").glob("*.py")), *sorted((root / "runtime").glob("*.py"))]
    return [*sorted(root.glob("*.py")), *generated, Path(__file__).resolve(), GRAMMAR_PATH]


def forget() -> None:
    """Drop this process's verdicts (the disk keeps its own): for benchmarks of a first search."""
    _MEMORY.clear()


def shrink(dims: dict[str, float], bound: int) -> dict[str, float]:
    """Halve every size above `bound` while it stays whole."""
    out = {}
    for k, v in dims.items():
        v = float(v)
        while v.is_integer() and v > bound and (v / 2).is_integer():
            v /= 2
        out[k] = v
    return out


def _digest(decl_key: tuple[Any, ...], dims: dict[str, float]) -> str:
    text = repr((code_version(), decl_key, tuple(sorted((k, float(v)) for k, v in dims.items()))))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _lookup(digest: str) -> Verdict | None:
    found = _MEMORY.get(digest)
    if found is not None:
        return found
    where = cache_dir()
    if where is None:
        return None
    data = read_record(where / f"{digest}.json", FORMAT)
    if data is None or not isinstance(data.get("fits"), bool):
        return None
    reason = data.get("reason")
    if reason is not None and not isinstance(reason, str):
        return None
    found = _MEMORY.setdefault(digest, Verdict(data["fits"], reason))
    return found


def _remember(digest: str, verdict: Verdict, name: str, dims: dict[str, float]) -> None:
    _MEMORY[digest] = verdict
    where = cache_dir()
    if where is None:
        return
    record = {"format": FORMAT, "energy": name, "dims": dims, "fits": verdict.fits, "reason": verdict.reason}
    write_record(where / f"{digest}.json", record)


def _quoted(detail: str, derived: Any) -> str:
    """A check's detail with each `expect` clause's location (`<string>:10:3`, a line of the filled candidate, which
    the search file does not have and which moves from candidate to candidate) replaced by the clause's text."""
    for _, span in derived.program.spec.expects.values():
        lines = span.source.splitlines() if span is not None and span.source else []
        if 1 <= span.line <= len(lines):
            clause = " ".join(lines[span.line - 1].split())
            detail = detail.replace(f"at {span}", f"at `{clause[:120]}`")
    return detail


def stage_check(decl: Any, dims: dict[str, float]) -> str | None:
    """Run `energy check` on one stage's energy at small dims; the failure reason, or None.

    Derivations do not depend on the sizes, and the model was already built at the real dims, so the
    checks run with every size above 4 halved while it stays whole (then above 8, 16, 32, and last the
    real dims, when the smaller ones do not fit the energy); widths that shrink alike share one check.
    A declaration that does not derive even at its real dims raises its own `UserError`."""
    from energydsl.derived import declaration_key, derive

    key = declaration_key(decl)
    derived, used, digest = None, dims, ""
    for bound in (*SHRINK, None):
        used = dims if bound is None else shrink(dims, bound)
        digest = _digest(key, used)
        known = _lookup(digest)
        if known is not None and known.fits:
            return known.reason
        if known is not None and bound is not None:
            continue  # known not to derive at these dims
        try:
            derived = derive(decl, used)
            break
        except UserError:
            if bound is None:
                raise
            _remember(digest, Verdict(False), decl.name, used)
    assert derived is not None
    failed = [r for r in derived.check() if r.status == "fail"]
    reason = None
    if failed:
        at = ", ".join(f"{k}={plain_number(v)}" for k, v in used.items())
        reason = "; ".join(f"check `{r.name}` failed: {_quoted(r.detail, derived)}" for r in failed) + \
            f" (checked at {at})"
    _remember(digest, Verdict(True, reason), decl.name, used)
    return reason
