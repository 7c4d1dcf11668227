"""The training settings of a search: their names, the embedded defaults, and the checks that refuse a
value training would refuse, before any trial runs (`check_settings`, used by energydsl.search.dsl).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import lark

from energydsl.errors import Span, SpecError, UserError
from energydsl.search.holes import INT_SETTINGS, _convert, _File, _Hole, _kids, _pos, _Value
from energydsl.syntax import tokens, without_comments

#: `train` keys (and `--set` keys) -> TrainConfig fields
TRAIN_KEYS = {
    "lr": "lr", "min_lr": "min_lr", "batch": "batch_size", "batch_size": "batch_size", "block": "block_size",
    "block_size": "block_size", "warmup": "warmup_steps", "warmup_steps": "warmup_steps",
    "weight_decay": "weight_decay", "grad_clip": "grad_clip", "eval_interval": "eval_interval",
    "eval_iters": "eval_iters", "seed": "seed", "dtype": "dtype",
}
#: the embedded defaults: small, so that a space trains on a CPU in minutes
DEFAULTS: dict[str, Any] = {"data": "shakespeare_char", "steps": 200, "batch_size": 16, "lr": 1e-3,
                            "weight_decay": 0.1, "grad_clip": 1.0, "eval_iters": 20, "seed": 1337,
                            "dtype": "float32"}
SET_KEYS = ("search", "data", "steps", "trials", "timeout", *TRAIN_KEYS)


def check_settings(settings: dict[str, _Value]) -> None:
    """Every training setting as training will take it, before any trial runs: each fixed value and each
    value a setting's hole can take (its bounds, its options), so that a bad one is an error located
    where it is written (or naming the --set), not every trial failing."""
    for key in dict.fromkeys(["data", *settings]):
        for value, span, given in possible_values(settings, key):
            _check_value(key, value, span, given)


def possible_values(settings: dict[str, _Value], key: str) -> list[tuple[Any, Span | None, str | None]]:
    """The values setting `key` can take that decide whether training accepts it (a hole's bounds and
    options), each with where it is written (a span in the search, or the --set it came from); the
    default when the search leaves it out."""
    v = settings.get(key)
    if v is None:
        return [(DEFAULTS[key], None, None)] if key in DEFAULTS else []
    if v.file is None:
        return [(v.fixed, v.span, v.given)]
    hole = v.holes[0] if len(v.holes) == 1 else None
    if hole is None or (hole.start, hole.end) != (v.start, v.end):
        raise SpecError(f"`{key}` takes a number or one hole (`int a..b`, `float a..b`, `choice{{...}}`)",
                        v.file.span_at(v.start, v.end))
    return [(value, span, None) for value, span in _hole_values(key, hole)]


def _given(given: str, convert: Callable[[], Any]) -> Any:
    """`convert()`, its error naming the --set it came from."""
    try:
        return convert()
    except UserError as e:
        raise UserError(f"{given}: {e.message}", hint=e.hint) from None


def _hole_values(key: str, h: _Hole) -> list[tuple[Any, Span]]:
    """The values a setting's hole can take that decide whether training accepts them: an int or float
    hole's bounds, each option of a choice (each as converted for setting `key`, with where it is written)."""
    if h.kind == "float" and key in INT_SETTINGS:
        raise SpecError(f"`{key}` must be a whole number: use `int a..b`", h.span)
    if h.kind in ("int", "float"):
        return [(int(b) if h.kind == "int" else float(b), h.span) for b in (h.low, h.high)]
    out: list[tuple[Any, Span]] = []
    for o in h.options:
        if len(o.holes) == 1 and (o.holes[0].start, o.holes[0].end) == (o.start, o.end):
            out += _hole_values(key, o.holes[0])
            continue
        span = h.file.span_at(o.start, o.end)
        out.append((_convert(key, h.file.text[o.start:o.end], span), span))
    return out


def _check_value(key: str, value: Any, span: Span | None, given: str | None) -> None:
    try:
        check_setting(key, value)
    except UserError as e:
        if span is not None:
            raise SpecError(e.message, span, e.hint) from None
        raise UserError(f"{given}: {e.message}" if given else e.message, hint=e.hint) from None


def check_setting(key: str, value: Any) -> None:
    """Raise a UserError when training would refuse `value` for setting `key` (a TrainConfig field or `data`):
    TrainConfig's own validation, the dataset found (not loaded), and at least one step."""
    import dataclasses

    from energydsl.training import TrainConfig
    from energydsl.training.data import check_dataset

    if key == "data":
        check_dataset(str(value))
        return
    if key == "steps" and value < 1:  # training accepts 0 steps; a trial must train
        raise UserError(f"steps must be at least 1, got {value}")
    if key not in {f.name for f in dataclasses.fields(TrainConfig)}:
        return
    base = TrainConfig()
    extra: dict[str, Any] = {}
    if key == "lr":
        extra["min_lr"] = 0.0  # a candidate's min_lr is at most its lr
    elif key == "min_lr":
        extra["lr"] = max(base.lr, value)
    dataclasses.replace(base, **{key: value, **extra}).validate()


HOLE = "hole: "  # how a fingerprint marks a setting that is a hole
OPTIONS = "options"  # the fingerprint's hash of the choices' options (a key studies recorded only later)
DECLARATIONS = "declarations"  # each declaration's hash: names what an edit of `text` touched (not compared)
OPTION_HOLES = "option_holes"  # each choice's hash of its options: names the hole an edit of `options` touched

# the search's clauses its fingerprint's text hash leaves out: settings (compared one by one), objectives
# (compared by open_study), the budget (may change between runs)
_UNHASHED = ("search_data", "search_train", "objectives", "trials")


def fingerprint(files: Sequence[_File], search: lark.Tree, settings: dict[str, _Value],
                holes: Sequence[_Hole]) -> dict[str, str]:
    """What a trial's result depends on besides its hole values, so that a rerun with other settings is
    refused rather than mixing incomparable trials in one study: each training setting as it is given (a
    value or the default; for a hole, HOLE and its text: its range may change as any hole's may), and `text`, a
    hash of the space's files outside the holes and outside the search's settings, objectives and
    `trials`, comments and spacing ignored; `options`, a hash of what the choices' options fix."""
    out: dict[str, str] = {}
    for key in sorted({*DEFAULTS, *settings}):
        v = settings.get(key)
        if v is None:
            out[key] = str(DEFAULTS[key])
        else:
            out[key] = HOLE + " ".join(v.file.text[v.start:v.end].split()) if v.file is not None else str(v.fixed)
    digest = hashlib.sha256()
    parts: list[str] = []
    for f in files:
        cuts = [(h.start, h.end) for h in holes if h.file is f]
        for item in _kids(f.tree):
            if item.data == "search_decl":  # another search in the file does not matter; this one's clauses do
                cuts += [_pos(c) for c in _kids(item)[1:] if c.data in _UNHASHED] if item is search else [_pos(item)]
        digest.update(_outside(f.text, cuts, 0, len(f.text)).encode() + b"\0")
        for item in _kids(f.tree):  # which declaration an edit is in, to name it when a rerun is refused
            if item.data in ("energy_decl", "block_decl", "model_decl") or item is search:
                start, end = _pos(item)
                text = _outside(f.text, [c for c in cuts if start <= c[0] and c[1] <= end], start, end)
                parts.append(f"{item.data.removesuffix('_decl')} {item.children[0]}="
                             f"{hashlib.sha256(text.encode()).hexdigest()[:8]}")
    out["text"] = digest.hexdigest()[:16]
    out[DECLARATIONS] = ";".join(parts)
    out[OPTIONS], out[OPTION_HOLES] = _options_digest(holes)
    return out


def edited_option_holes(old: dict[str, str], now: dict[str, str]) -> list[str] | None:
    """The choices in both fingerprints whose options differ, by hole name; None when either fingerprint has
    no per-hole hashes (a study recorded before they were). A hole in one only (a `--set` that replaced it, a
    hole added to the text) is not an edit of its options: the settings or the text say what changed."""
    if OPTION_HOLES not in old or OPTION_HOLES not in now:
        return None
    before, after = (dict(p.split("=") for p in f[OPTION_HOLES].split(";") if p) for f in (old, now))
    return [n for n in before if n in after and before[n] != after[n]]


def edited_declarations(old: dict[str, str], now: dict[str, str]) -> str:
    """The declarations whose text differs between two fingerprints (` (energy `MHA`, model `M`)`), or "" when
    either fingerprint has no per-declaration hashes (a study recorded before they were)."""
    if DECLARATIONS not in old or DECLARATIONS not in now:
        return ""
    before, after = (dict(p.split("=") for p in f[DECLARATIONS].split(";") if p) for f in (old, now))
    names = [n for n in dict.fromkeys([*before, *after]) if before.get(n) != after.get(n)]
    return " (" + ", ".join(f"{n.split()[0]} `{n.split()[1]}`" + (
        "" if n in before and n in after else " added" if n in after else " removed") for n in names) + ")" \
        if names else ""


def _outside(text: str, cuts: list[tuple[int, int]], start: int, end: int) -> str:
    """text[start:end] with each cut (a hole, a setting) as ` ? `, comments and spacing normalised."""
    parts, pos = [], start
    for a, b in sorted(cuts):
        if a >= pos:
            parts += [text[pos:a], " ? "]
        pos = max(pos, b)
    parts.append(text[pos:end])
    return " ".join(without_comments("".join(parts)).split())


def _options_digest(holes: Sequence[_Hole]) -> tuple[str, str]:
    """A hash of every choice's options as written, their own holes cut out: the text hash above leaves a
    whole `choice{...}` out, and an optimizer option is recorded by its name alone, so without this
    `momentum(beta = 0.9)` edited to `momentum(beta = 0.1)` would mix two optimizers under one name. And each
    choice's own hash (`name=hash;...`), to name the one edited."""
    digest = hashlib.sha256()
    each = []
    seen: set[int] = set()
    for top in holes:
        for h in top.walk():
            if id(h) in seen or not h.options:
                continue
            seen.add(id(h))
            own = hashlib.sha256()
            for o in h.options:
                parts, pos = [], o.start
                for start, end in sorted((n.start, n.end) for n in o.holes):
                    parts.append(tokens(h.file.text[pos:start]))
                    pos = end
                parts.append(tokens(h.file.text[pos:o.end]))
                text = f"{h.name}: {' ? '.join(parts)}".encode() + b"\0"
                digest.update(text)
                own.update(text)
            each.append(f"{h.name}={own.hexdigest()[:8]}")
    return digest.hexdigest()[:16], ";".join(each)
