"""Search spaces written in the language: a `.energy` file with holes and a `search` declaration.

    space = load_search("search/quickstart.energy", steps="20")     # energydsl.api.load_search
    run_search(SpaceRef("search/quickstart.energy", {"steps": "20"}))

A hole is `choice{...}`, `int a..b`, `float a..b` or `float a..b log` anywhere an expression may stand
in an `energy`, `block` or `model`, or a `choice{...}` of whole optimizers, preconditioners or
across-layer optimizers. The `search` declaration adds holes and overrides of its own:

    model M(d = choice{32, 64})            the defaults of M's header dims (M: the model trained)
    energy E(heads = choice{2, 4})         the defaults of E's header dims
    across layers choice{none, nag(...)}   M's `across layers` clause (`none`: no clause)
    optimizer E: choice{gd, nag(...)}      the optimizer of E's `optimizer` clause (modifiers kept)
    precondition E: choice{none, diag}     the preconditioner of E's optimizer (`none`: no preconditioner)
    data NAME, steps N                     the dataset and training steps ("chars:PATH" quoted: a file)
    train lr = float 1e-4..1e-2 log, ...   training settings (see energydsl.search.settings)
    objective minimize val_loss, ...       see OBJECTIVES; TPE for one, NSGA-II for several
    trials N                               the default budget

Every hole has a stable name (`Model.d`, `MHA.optimizer`, `MHA.optimizer.nag.beta`, `train.lr`): the
Optuna parameter it is sampled as. A candidate is the file's text with every hole's source span replaced
by the sampled value's text, the search-level overrides written into the model and energy declarations,
imports inlined and `search` declarations dropped: a plain `.energy` file (`Candidate.source()`), which
is what gets loaded, built, checked and trained. The holes and the filled text are `holes.py`'s, the
search-level overrides `overrides.py`'s, the refusals of holes that could not do what they say
`space_checks.py`'s; `docs/search.md` is the user's guide.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lark

from energydsl import syntax
from energydsl.errors import Span, SpecError, UserError
from energydsl.search.candidate import DslCandidate
from energydsl.search.holes import (  # source files, holes and filling them
    _AnyValues,
    _Collector,
    _convert,
    _File,
    _Filler,
    _fmt_float,
    _Hole,
    _kids,
    _Placement,
    _pos,
    _read_files,
    _setting,
    _Value,
)
from energydsl.search.overrides import across_override, header_override, optimizer_override, step_claims_dropped
from energydsl.search.report import NOTES
from energydsl.search.settings import (
    DEFAULTS,
    SET_KEYS,
    TRAIN_KEYS,
    _given,
    check_settings,
    fingerprint,
    possible_values,
)
from energydsl.search.space_checks import (
    refuse_dead_holes,
    refuse_errors_no_hole_changes,
    refuse_float_holes_needing_whole_numbers,
)

OBJECTIVES = ("val_loss", "train_loss", "best_val_loss", "params", "params_non_embedding", "flops_per_token",
              "step_time", "tokens_per_s")


_CLAUSE_WORDS = {"objectives": "objective", "across": "across layers"}  # rule names that differ from the keywords


# ----------------------------------------------------------------------------- the space


class DslSpace:
    """A `search` declaration: implements `energydsl.search.space.SearchSpace`."""

    def __init__(self, path: str, files: list[_File], search: lark.Tree, sets: dict[str, Any]):
        self.path = path
        self.files = files
        self.search_file = files[0]
        self.name = str(search.children[0])
        self.placements: list[_Placement] = []
        self.settings: dict[str, _Value] = {}
        self.objectives: list[tuple[str, str]] = [("val_loss", "minimize")]
        self.trials: int | None = None
        self.model_name = ""
        self._datasets: dict[str, Any] = {}
        self._search = search
        self._build(search, sets)
        self._check_data()
        refuse_float_holes_needing_whole_numbers(self)
        refuse_errors_no_hole_changes(self)
        steps = self.settings.get("steps")
        top_steps = int(steps.fixed) if steps and steps.file is None else self._max_steps()
        self.budget: dict[str, Any] = {"trials": self.trials if self.trials is not None else 20, "steps": top_steps}
        interval = self.settings.get("eval_interval")
        if interval is None or interval.file is None:  # the pruner's first rung: the first evaluation
            self.budget["min_steps"] = int(interval.fixed) if interval else max(1, top_steps // 4)
        if sets.get("timeout") not in (None, ""):
            raw = str(sets["timeout"])
            timeout = _given(f"--set timeout={raw}", lambda: _convert("timeout", raw, None))
            if not timeout > 0:
                raise UserError(f"--set timeout={raw}: the timeout must be a positive number of seconds")
            self.budget["timeout"] = timeout

    # -- building ------------------------------------------------------------------------------------

    def _decls(self) -> dict[str, tuple[_File, lark.Tree]]:
        out = {}
        for f in self.files:
            for item in _kids(f.tree):
                if item.data in ("energy_decl", "block_decl", "model_decl"):
                    out[str(item.children[0])] = (f, item)
        return out

    def _build(self, search: lark.Tree, sets: dict[str, Any]) -> None:
        sf = self.search_file
        col = _Collector(sf)
        decls = self._decls()
        models = [n for n, (_, t) in decls.items() if t.data == "model_decl"]
        overrides: list[_Placement] = []
        opt_over: dict[str, tuple[lark.Tree, Span]] = {}
        pre_over: dict[str, tuple[lark.Tree, Span]] = {}
        across: lark.Tree | None = None
        seen: dict[str, Span] = {}
        model_ref: lark.Tree | None = None
        for clause in _kids(search)[1:]:
            kind = clause.data
            span = sf.span(clause)
            key = kind
            if kind in ("search_optimizer", "search_precondition"):
                key = f"{kind.removeprefix('search_')} {clause.children[0]}"
            elif kind == "search_energy":
                key = f"energy {clause.children[0].children[0]}"
            if key in seen:
                written = _CLAUSE_WORDS.get(key, key.removeprefix("search_"))  # as the spec writes the clause
                raise SpecError(f"`{written}` is given twice in search `{self.name}` (first at "
                                f"{seen[key]})", span)
            seen[key] = span
            if kind == "search_model":
                model_ref = clause.children[0]
            elif kind == "search_energy":
                overrides += header_override(sf, clause.children[0], "energy_decl", decls, col)
            elif kind == "across":
                across = clause
            elif kind in ("search_optimizer", "search_precondition"):
                target = str(clause.children[0])
                if target not in decls or decls[target][1].data != "energy_decl":
                    energies = [n for n, (_, t) in decls.items() if t.data == "energy_decl"]
                    raise SpecError(f"no energy named `{target}`", sf.span(clause.children[0]),
                                    f"energies: {', '.join(energies) or 'none'}")
                (opt_over if kind == "search_optimizer" else pre_over)[target] = (clause.children[1], span)
            elif kind == "search_data":
                self.settings["data"] = _Value(fixed=_dataset_name(clause.children[0], sf.path),
                                               span=sf.span(clause.children[0]))
                if clause.children[1] is not None:
                    self.settings["steps"] = _setting(col, clause.children[1], "steps", "steps")
            elif kind == "search_train":
                for kw in _kids(clause):
                    k = str(kw.children[0])
                    if k not in TRAIN_KEYS:
                        raise SpecError(f"unknown training setting `{k}`", sf.span(kw),
                                        f"known: {', '.join(TRAIN_KEYS)}")
                    if TRAIN_KEYS[k] in self.settings:
                        raise SpecError(f"`{k}` is given twice", sf.span(kw))
                    if kw.children[2] is not None:  # the grammar shares optimizer keywords' `learn` / `fixed`
                        raise SpecError(f"`{kw.children[2]}` does not apply to a training setting",
                                        sf.span(kw.children[2]), "`learn` and `fixed` mark an optimizer's "
                                        "hyper-parameters; a training setting is a number or a hole")
                    self.settings[TRAIN_KEYS[k]] = _setting(col, kw.children[1], TRAIN_KEYS[k], f"train.{k}")
            elif kind == "objectives":
                objs = []
                for o in _kids(clause):
                    direction, name = str(o.children[0]), str(o.children[1])
                    if name not in OBJECTIVES:
                        raise SpecError(f"unknown objective `{name}`", sf.span(o.children[1]),
                                        f"known: {', '.join(OBJECTIVES)}")
                    if name in [n for n, _ in objs]:
                        raise SpecError(f"objective `{name}` is given twice", sf.span(o))
                    objs.append((name, direction))
                self.objectives = objs
            elif kind == "trials":
                node = clause.children[0]
                if node.data != "number" or not float(node.children[0]).is_integer():
                    raise SpecError("`trials` takes a whole number", sf.span(node))
                self.trials = int(float(node.children[0]))
                if self.trials < 1:
                    raise SpecError(f"`trials` must be at least 1, got {self.trials}", sf.span(node))
        # the model trained
        if model_ref is not None:
            self.model_name = str(model_ref.children[0])
            if self.model_name not in models:
                raise SpecError(f"no model named `{self.model_name}`", sf.span(model_ref),
                                f"models: {', '.join(models) or 'none'}")
            overrides += header_override(sf, model_ref, "model_decl", decls, col)
        else:
            # the file's own model, as `energy info` and `train` take it; with none of its own, an import's
            own = [n for n in models if decls[n][0] is sf]
            candidates = own or models
            if len(candidates) != 1:
                found = f" (it declares {', '.join(own)})" if own else \
                    f" (its imports declare {', '.join(models)})" if models else ""
                raise SpecError(f"search `{self.name}` must name the model it trains{found}" if models else
                                f"search `{self.name}`: the file declares no `model` to train",
                                sf.span(search.children[0]), "add `model NAME` to the search" if models else
                                "declare a `model` (see docs/language.md)")
            self.model_name = candidates[0]
        if across is not None:
            overrides.append(across_override(across, decls[self.model_name], col))
        for energy in dict.fromkeys([*opt_over, *pre_over]):
            overrides.append(optimizer_override(decls[energy], opt_over.get(energy), pre_over.get(energy), col))
            overrides += step_claims_dropped(decls[energy])
        # the file's own holes, unless an override replaces the text they stand in
        placements: list[_Placement] = list(overrides)
        for f in self.files:
            fc = _Collector(f)
            for item in _kids(f.tree):
                if item.data in ("search_decl", "import_decl"):
                    s, e = _pos(item)
                    placements.append(_Placement(f, s, e, [], lambda _f: "", "delete"))
                    continue
                for h in fc.decl(item):
                    s, e = h.place
                    if any(p.file is f and p.start <= s and e <= p.end for p in overrides):
                        continue
                    placements.append(_Placement(f, s, e, [h], lambda fl, h=h: fl.value(h)))
        self.placements = placements
        refuse_dead_holes(placements, decls, self.model_name)
        self._apply_sets(sets)
        self._unique_names()

    def _apply_sets(self, sets: dict[str, Any]) -> None:
        for key, raw in sets.items():
            given = f"--set {key}={raw}"
            if key in ("search", "trials", "timeout"):
                if key == "trials" and raw not in (None, ""):
                    self.trials = _given(given, lambda raw=raw: _convert("trials", str(raw), None))
                    if self.trials < 1:
                        raise UserError(f"{given}: trials must be at least 1")
                continue
            field_ = TRAIN_KEYS.get(key, key)
            value = _given(given, lambda raw=raw, field_=field_: _convert(field_, str(raw), None))
            self.settings[field_] = _Value(fixed=value, given=given)
        check_settings(self.settings)

    def _check_data(self) -> None:
        """Every dataset the trials can train on fits the model: its tokens fit the vocab, and it serves the block
        the trials train on (`block`, capped at the model's context: a task's examples must fit it, a text file's
        splits must be longer). An error here, not every trial failing; a searched vocab or context is left to
        each trial."""
        from energydsl.training.data import block_check, dataset_vocab

        searched = {h.name for h in self.holes()}
        try:  # any candidate: vocab and context are the same in all of them unless searched
            plan = self.suggest(_AnyValues()).spec().plan(self.model_name)
        except UserError:
            return  # that candidate is invalid; the trials report why
        model = f"model `{self.model_name}`"
        vocab, context = int(plan.vocab), int(plan.context)
        blocks = possible_values(self.settings, "block_size") or [(context, None, None)]
        for data, span, given in possible_values(self.settings, "data"):
            try:  # reading the data: a file that is not UTF-8 text, say, is located like the other data errors
                need = dataset_vocab(str(data)) if f"{self.model_name}.vocab" not in searched else 0
                check_block = block_check(str(data))
            except UserError as e:
                _refuse(e.message, span, given, e.hint)
            if need > vocab:
                _refuse(f"dataset {data} has {need} tokens, more than {model}'s vocab {vocab}", span, given,
                        f"write `model {self.model_name}(vocab = {need})` in the search")
            if f"{self.model_name}.context" in searched:
                continue
            for block, bspan, bgiven in blocks:
                try:
                    check_block(min(int(block), context))
                except UserError as e:
                    where = f"{model}'s context {context}" if bspan is None and bgiven is None else \
                        f"block {block}" + (f", capped at {model}'s context {context}" if int(block) > context else "")
                    at = (span, given) if span is not None or given else (bspan, bgiven)
                    _refuse(f"data {data} with {where}: {e.message}", *at, e.hint)

    def check_device(self, device: str, local: bool = True) -> None:
        """Fail now for a device the trials could not train on (training's own check), not in every trial.
        `local`: trials run on this machine (else on Ray nodes: only the name is checked here)."""
        from energydsl.training.config import TrainConfig

        if local:  # the device, and each dtype a trial may take on it (float16 needs CUDA)
            for dtype, span, given in possible_values(self.settings, "dtype"):
                try:
                    TrainConfig(device=device, dtype=str(dtype)).resolve_device({"device": "--device"})
                except UserError as e:
                    _refuse(e.message, span, given, e.hint)
            return
        import torch

        try:
            kind = torch.device(device).type if device != "auto" else "cpu"
        except RuntimeError:
            kind = ""
        if kind not in ("cpu", "cuda"):
            raise UserError(f"unknown device {device!r}", hint="use cpu, cuda, cuda:N or auto")

    def fingerprint(self) -> dict[str, str]:
        """The settings and text a trial's result depends on (`energydsl.search.settings.fingerprint`)."""
        return fingerprint(self.files, self._search, self.settings, self.holes())

    def distributions(self) -> dict[str, tuple[Any, Span]]:
        """Each hole's Optuna distribution, as `suggest` samples it, and where the hole is written."""
        from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

        out: dict[str, tuple[Any, Span]] = {}
        for h in self.holes():
            if h.kind == "int":
                d: Any = IntDistribution(int(h.low), int(h.high))
            elif h.kind == "float":
                d = FloatDistribution(h.low, h.high, log=h.log)
            else:
                d = CategoricalDistribution([o.label for o in h.options])
            out[h.name] = (d, h.span)
        return out

    def _unique_names(self) -> None:
        seen: dict[str, int] = {}
        for h in self.holes():
            if h.name in seen:
                seen[h.name] += 1
                h.name = f"{h.name}#{seen[h.name]}"
            else:
                seen[h.name] = 1

    def _max_steps(self) -> int:
        v = self.settings.get("steps")
        hs = v.holes if v else []
        if len(hs) == 1 and hs[0].kind == "int" and v and (v.start, v.end) == (hs[0].start, hs[0].end):
            return int(hs[0].high)
        return int(DEFAULTS["steps"])

    # -- the protocol ---------------------------------------------------------------------------------

    def holes(self) -> list[_Hole]:
        """Every hole, nested ones included, in sampling order (placements first, then settings)."""
        out: list[_Hole] = []
        for p in sorted(self.placements, key=lambda p: (self.files.index(p.file), p.start)):
            for h in p.holes:
                out += h.walk()
        for v in self.settings.values():
            for h in v.holes:
                out += h.walk()
        return out

    def describe(self) -> list[tuple[str, str, str]]:
        """(name, values, where) for every hole: what `energy search --holes` prints."""
        return [(h.name, h.describe(), str(h.span)) for h in self.holes()]

    def suggest(self, trial: Any) -> DslCandidate:
        filler = _Filler(trial)
        texts = []
        for f in self.files:
            ps = sorted((p for p in self.placements if p.file is f), key=lambda p: (p.start, p.end))
            out, pos = [], 0
            for p in ps:
                if p.start < pos:  # overlapping edits: a bug in building the space
                    raise AssertionError(f"overlapping edits at {f.path}:{p.start}")
                out.append(f.text[pos:p.start])
                out.append(p.render(filler))
                pos = p.end
            out.append(f.text[pos:])
            texts.append(re.sub(r"\n[ \t]*\n(?:[ \t]*\n)+", "\n\n", "".join(out)).strip("\n"))
        settings: dict[str, Any] = {}
        for key, v in self.settings.items():
            settings[key] = _convert(key, v.text(filler), None) if v.file is not None else v.fixed
        settings = self._complete(settings)
        return DslCandidate(self.model_name, dict(filler.params), self._assemble(texts, filler.params, settings),
                            settings, [(f.path, f.text) for f in self.files])

    def _complete(self, s: dict[str, Any]) -> dict[str, Any]:
        out = {**DEFAULTS, **s}
        steps = int(out["steps"])
        out.setdefault("min_lr", float(out["lr"]) / 10)
        out["min_lr"] = min(float(out["min_lr"]), float(out["lr"]))
        out.setdefault("warmup_steps", min(100, steps // 10))
        out.setdefault("eval_interval", max(1, steps // 4))
        return out

    def _assemble(self, texts: list[str], params: dict[str, Any], settings: dict[str, Any]) -> str:
        head = [f"# A candidate of search `{self.name}` ({self.path}), every hole filled:"]
        line = "#  "
        for k, v in params.items():
            item = f" {k} = {_fmt_float(v) if isinstance(v, float) else v},"
            if len(line) + len(item) > 100:
                head.append(line.rstrip(","))
                line = "#  "
            line += item
        if params:
            head.append(line.rstrip(","))
        parts = ["\n".join(head), texts[0]]
        for f, t in zip(self.files[1:], texts[1:], strict=True):
            parts.append(f"# ---- from {f.path} (imported) ----\n{t}")
        return "\n\n".join(parts)  # DslCandidate.source() adds how the trial trains it

    def evaluate(self, candidate: DslCandidate, report: Callable[[int, float], bool], device: str
                 ) -> dict[str, float]:
        import optuna
        import torch

        from energydsl.training import TrainConfig, load_dataset, train

        s = candidate.trained_settings()
        model = candidate.model()
        block = int(s.get("block_size") or model.block_size)
        if s["data"] not in self._datasets:
            self._datasets[s["data"]] = load_dataset(s["data"])
        data = self._datasets[s["data"]]
        if data.vocab_size > model.vocab_size:
            raise UserError(f"model `{self.model_name}` has vocab {model.vocab_size}, the dataset {s['data']} "
                            f"needs {data.vocab_size}", hint=f"set the model's vocab to {data.vocab_size}")
        steps = int(s["steps"])
        config = TrainConfig(
            steps=steps, batch_size=int(s["batch_size"]), block_size=block, lr=float(s["lr"]),
            min_lr=float(s["min_lr"]), warmup_steps=int(s["warmup_steps"]), weight_decay=float(s["weight_decay"]),
            grad_clip=float(s["grad_clip"]), eval_interval=int(s["eval_interval"]), eval_iters=int(s["eval_iters"]),
            seed=int(s["seed"]), device=device, dtype=str(s["dtype"]), log_interval=max(1, min(10, steps)),
        )
        stopped: list[tuple[int, float]] = []
        notes: list[str] = []  # training's notices (parameters that never train): the trial keeps them

        def on_eval(step: int, val: float) -> bool:
            if report(step, val) and step < steps:  # a trial that trained all its steps completed
                stopped.append((step, val))
                return True
            return False

        try:
            result = train(model, data, config, None, metadata={}, progress=False, on_eval=on_eval,
                           notify=notes.append)
            if stopped:
                step, val = stopped[0]
                raise optuna.TrialPruned(f"pruned at step {step} (val_loss {val:.4f})")
            info = model.info()
        finally:
            candidate.release()
        trained = max(1, int(result["steps"]) - int(result.get("resumed_from") or 0))
        return {
            "val_loss": float(result["val_loss"]), "train_loss": float(result["train_loss"]),
            "best_val_loss": float(result["best_val_loss"]), "params": float(info["params"]),
            "params_non_embedding": float(info.get("params_non_embedding", info["params"])),
            "flops_per_token": float(info.get("flops_per_token", math.nan)),
            "step_time": float(result["train_time_s"]) / trained, "tokens_per_s": float(result["tokens_per_s"]),
            "threads": float(torch.get_num_threads()),  # a bit-for-bit rerun on the CPU needs as many
        } | ({NOTES: notes} if notes else {})


def _refuse(message: str, span: Span | None, given: str | None, hint: str | None) -> None:
    """A setting training would refuse: located where the search writes it, else named by its --set."""
    if span is not None:
        raise SpecError(message, span, hint)
    raise UserError(f"{given}: {message}" if given else message, hint=hint)


def _dataset_name(token: lark.Token, file: str) -> str:
    """A `data` clause's dataset: a name (`shakespeare_char`), or a quoted one that holds a path
    (`"chars:corpus.txt"`), whose relative path is read from the search file's folder, as an import's is."""
    from energydsl.training.data import file_dataset

    if token.type != "STRING":
        return str(token)
    name = str(token)[1:-1]
    kind, rest = file_dataset(name) or ("", "")
    if rest and not Path(rest).expanduser().is_absolute():
        return f"{kind}:{syntax.shown_path(Path(file).parent, rest)}"
    return name


# ----------------------------------------------------------------------------- entry point


def load_search(path: str | Path, **sets: Any) -> DslSpace:
    """The search space of a `.energy` file with `search` declarations.

    `sets` (strings from `--set KEY=VALUE`, or Python values): `search` picks the declaration when the file
    has several; `data`, `steps`, `trials`, `timeout` and the training settings (`lr`, `batch`, `block`,
    `warmup`, `min_lr`, `weight_decay`, `grad_clip`, `eval_interval`, `eval_iters`, `seed`, `dtype`)
    replace what the search says (a replaced setting is no longer a hole)."""
    unknown = sorted(set(sets) - set(SET_KEYS))
    if unknown:
        raise UserError(f"unknown search setting `{unknown[0]}`", hint=f"known: {', '.join(SET_KEYS)}")
    p = Path(path)
    if not p.is_file():
        raise UserError(f"no search spec {str(path)!r}", hint="give a .energy file with a `search` declaration")
    files = _read_files(p)
    searches = [item for item in _kids(files[0].tree) if item.data == "search_decl"]
    names = [str(s.children[0]) for s in searches]
    if not searches:
        raise SpecError(f"{path} declares no `search`", Span(str(path), 1, 1),
                        "add `search NAME { ... }` (see docs/search.md)")
    wanted = sets.get("search")
    if wanted:
        if wanted not in names:
            raise UserError(f"no search named `{wanted}` in {path}", hint=f"searches: {', '.join(names)}")
        search = searches[names.index(wanted)]
    elif len(searches) > 1:
        raise UserError(f"{path} declares {len(searches)} searches ({', '.join(names)})",
                        hint="pick one with --set search=NAME")
    else:
        search = searches[0]
    # every setting (the dataset too: a missing corpus) is checked now, not found by every trial failing
    return DslSpace(str(path), files, search, {k: v for k, v in sets.items() if v is not None})
