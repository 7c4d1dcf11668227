"""Code generation: derived update programs to PyTorch source, cached on disk and imported.

    source = energy_source(derived)                    # the text `energy compile` writes
    cls = module_class(derived)                        # generated (or found in the cache) and imported
    layer = cls()                                      # an nn.Module

The cache key is the equation hash (derived equations and dims) plus a hash of the code generator's own
source, so an unchanged spec is never regenerated, and any change to the generator invalidates old files.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import importlib.util
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from .. import ir
from ..files import write_whole

if TYPE_CHECKING:
    from torch import nn

    from ..derived import Derived

BACKENDS = ("torch", "triton")


def cache_dir() -> Path:
    """$ENERGYDSL_CACHE, else ~/.cache/energydsl/codegen."""
    env = os.environ.get("ENERGYDSL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "energydsl" / "codegen"


@functools.cache
def generator_version() -> str:
    """A hash of the generator's source files: this package, the kernel templates it copies from, and the
    printers that write the derivation into each file's docstring."""
    digest = hashlib.sha256()
    here = Path(__file__).parent
    printers = [here.parent / "printing.py", here.parent / "derived.py"]
    for path in sorted([*here.glob("*.py"), *(here.parent / "kernels").glob("*.py"), *printers]):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def cache_key(derived: Derived, backend: str, lowering: bool = True) -> str:
    """The generated file's key. Besides the update (`equation_hash`), what its docstring's derivation shows:
    the energy, its norm and gradient and the tied direction, as IR keys (no printing before a cache hit), and
    the spec's names of values, which its code uses."""
    prog, spec = derived.program, derived.spec
    shown = repr([ir.stable_text(e) for e in (spec.energy, spec.via[1] if spec.via else None, prog.gradient,
                                              prog.tied_direction) if e is not None])
    form = backend if lowering else f"{backend}|generic"
    named = sorted((name, ir.stable_text(e)) for e, name in spec.user_names.items())  # the names its code uses
    text = f"{derived.equation_hash()}|{spec.name}|{form}|{generator_version()}|{shown}|{named}"
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def check_backend(backend: object) -> None:
    """`spec.module("MHA", 16)` passes 16 as the backend: say that sizes are keywords."""
    if backend not in BACKENDS:
        from ..errors import UserError

        raise UserError(f"unknown backend `{backend}`", hint=f"backends: {', '.join(BACKENDS)}; sizes are keywords, "
                        "for example .module(\"MHA\", d=16)")


def energy_source(derived: Derived | list[Derived], backend: str = "torch", unfused: list[str] | None = None,
                  lowering: bool = True) -> str:
    """The generated source for one derived energy, or one file with the modules of several. Notes are appended
    to `unfused`: with the torch backend, one for each module that builds T x T tensors; with the triton backend,
    one for each module no kernel family fuses (its forward is the torch path), with the reason where a form
    nearly took a kernel, and one for each that runs partly on torch ops that build T x T tensors.
    `lowering=False` (torch backend only) writes the generic form: every context sum as the einsums of its IR,
    no attention ops (`docs/models.md`, "Generated modules")."""
    from ..errors import SpecError, UserError
    from .torch_module import ModuleWriter, file_source

    check_backend(backend)
    if not lowering and backend != "torch":
        raise UserError("the generic form (lowering=False) is the torch backend's", hint="backend=\"torch\"")
    many = derived if isinstance(derived, list) else [derived]
    names = class_names(many)
    classes: dict[str, Derived] = {}
    for d, cls in zip(many, names, strict=True):
        other = classes.setdefault(cls, d)
        if other is not d:
            raise SpecError(f"energies `{other.name}` (at {other.spec.span}) and `{d.name}` would both be the class "
                            f"`{cls}` of one generated file", d.spec.span,
                            "rename one of them, or compile them apart (`--name`)")
    writers = [ModuleWriter(d.program, d.equation_hash(), backend, lowering, equations=d.equations(), cls=cls)
               for d, cls in zip(many, names, strict=True)]
    text = file_source(writers)
    for d, w in zip(many, writers) if unfused is not None else ():
        why = f": {'; '.join(w.misses)}" if w.misses else ""
        if backend == "torch" and w.quadratic:  # the ops a user cannot see from the spec: memory in T²
            unfused.append(f"{d.name} computes a context sum with T x T tensors ({', '.join(w.quadratic)}): its "
                           "memory grows as T² (docs/models.md, the lowering table)")
        elif backend == "triton" and not w.kernel_requests:
            unfused.append(f"no kernel family matches {d.name}'s update{why}; its forward is the torch backend's")
        elif backend == "triton" and w.misses:
            unfused.append(f"{d.name} runs on the kernels, but not all of it{why}")
    return text


def class_names(derived: list[Derived]) -> list[str]:
    """The class of each derived energy in one file: its name's, and where a model uses one energy at several
    dims (`MLP(d) -> MLP(d, hidden = 2 * d)`), the dims that tell them apart too: `MLP_hidden32`, `MLP_hidden64`
    (one class name for both had the second definition replace the first)."""
    from ..number_text import plain_number
    from .torch_module import class_name

    names = []
    for d in derived:
        same = [o.spec.dim_values for o in derived if o.name == d.name]
        apart = [k for k in d.spec.dim_values if len({dims.get(k) for dims in same}) > 1]
        values = (d.spec.dim_values[k] for k in apart)  # every digit: `eta0_1234567` and `eta0_1234568` stay apart
        names.append(class_name("_".join([d.name, *(f"{k}{plain_number(v) if float(v).is_integer() else repr(v)}"
                                                    for k, v in zip(apart, values, strict=True))])))
    # a name made from dims may be another energy's own (`MLP` at hidden 8 beside an energy `MLP_hidden8`): the
    # energy keeps its name, the made one gets a number
    owners = {name: d for d, name in zip(derived, names, strict=True) if name == class_name(d.name)}
    for i, (d, name) in enumerate(zip(derived, names, strict=True)):
        if name != class_name(d.name) and owners.get(name, d) is not d:  # two energies' own names: refused below
            n = 2
            while f"{name}_{n}" in names:
                n += 1
            names[i] = f"{name}_{n}"
    return names


def runnable_backend(backend: str) -> str:
    """The backend `module_class` builds for `backend`: triton falls back to torch where its kernels cannot run
    (with the notice), and a checkpoint records the backend it was trained on, not the one asked for."""
    return "torch" if backend == "triton" and not _triton_runs() else backend


def module_class(derived: Derived, backend: str = "torch", lowering: bool = True) -> type[nn.Module]:
    """Generate (or reuse from the cache) and import the module class for `derived`.

    The triton backend needs a CUDA device or the Triton interpreter (TRITON_INTERPRET=1); without
    either it falls back to the torch backend (same parameters, so checkpoints still load) with a notice.
    `lowering=False`: the generic form (`energy_source`), the same parameters.
    """
    backend = runnable_backend(backend)
    file_name = f"{derived.spec.name.lower()}_{cache_key(derived, backend, lowering)}.py"
    return _class_of(_generated_module(file_name, lambda: energy_source(derived, backend, lowering=lowering)),
                     derived)


def _generated_module(file_name: str, source: Callable[[], str]) -> ModuleType:
    """The generated file `file_name` (`<energy>_<key>.py`) imported once per process, from the cache, where
    `source()` is written first when the file is not there."""
    mod_name = f"energydsl_generated_{file_name.removesuffix('.py').rsplit('_', 1)[1]}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    path = cache_dir() / file_name
    code = _cached_code(path)
    if code is None:  # absent, or cut short or changed since it was written: written (again)
        code = source()
        text = _stamped(code)
        try:  # whole or not at all: concurrent workers never import a half-written file
            write_whole(path, text, quiet=False)
        except OSError as e:  # a read-only home, a cache path that is a file: build anyway, and say where
            path = _private_dir(e, path.parent) / file_name
            write_whole(path, text, quiet=False)
    spec = importlib.util.spec_from_file_location(mod_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[mod_name]  # not a half-run module for the next call to return
        raise
    _CODE[mod_name] = (file_name, code)
    from torch import nn

    for value in vars(module).values():
        if isinstance(value, type) and issubclass(value, nn.Module) and value.__module__ == mod_name:
            value.__reduce__ = _reduce_generated
    return module


_CODE: dict[str, tuple[str, str]] = {}  # each generated module imported: its file's name and its code


def _reduce_generated(self: nn.Module) -> tuple[Any, ...]:
    """A generated module pickles (and deep-copies) with its file's code, so a fresh process (another machine,
    an empty cache) loads it: by reference, its class was the module `energydsl_generated_<key>`, which only a
    process that had built the same spec could import. The code is the one imported, kept in memory: the cache
    may have been cleared since."""
    file_name, code = _CODE[type(self).__module__]
    return _rebuild_generated, (file_name, code, type(self).__name__), self.__getstate__()


_CHECKSUM = "# energydsl cache checksum: "


def _stamped(text: str) -> str:
    """A cache entry's text with the SHA-256 of the code as its last line: an entry cut short (a full disk, a
    killed copy) or edited by hand is generated again, never imported (it failed with a SyntaxError for good)."""
    return f"{text}{_CHECKSUM}{hashlib.sha256(text.encode()).hexdigest()}\n"


def _unstamped(text: str) -> str | None:
    """The code of a cache entry's text, or None where its checksum line is missing or does not match."""
    code, stamp, digest = text.rpartition(_CHECKSUM)
    return code if stamp and digest == hashlib.sha256(code.encode()).hexdigest() + "\n" else None


def _cached_code(path: Path) -> str | None:
    """The code of the cache entry at `path`; None where there is none, or not as it was written."""
    try:
        return _unstamped(path.read_text())
    except (OSError, UnicodeDecodeError):
        return None


def _rebuild_generated(file_name: str, text: str, class_name: str) -> nn.Module:
    """An empty instance of a pickled generated module's class (its state follows), its file imported first."""
    cls = getattr(_generated_module(file_name, lambda: text), class_name)
    return cls.__new__(cls)


_PRIVATE_DIR: Path | None = None


def _private_dir(error: OSError, cache: Path) -> Path:
    """A temporary folder for this process's generated files (imported from a file: Triton reads a kernel's
    source from it), announced once with why the cache could not be written."""
    global _PRIVATE_DIR
    if _PRIVATE_DIR is None:
        _PRIVATE_DIR = Path(tempfile.mkdtemp(prefix="energydsl-codegen-"))
        atexit.register(shutil.rmtree, _PRIVATE_DIR, ignore_errors=True)
        print(f"energydsl: cannot write the code cache {cache} ({error.strerror or error}): generated modules go "
              f"to {_PRIVATE_DIR} for this process; set ENERGYDSL_CACHE to a folder you can write", file=sys.stderr)
    return _PRIVATE_DIR


def _class_of(module, derived: Derived) -> type[nn.Module]:
    from .torch_module import class_name

    return getattr(module, class_name(derived.spec.name))


_NOTICE_SHOWN = False


def _triton_runs() -> bool:
    """Whether Triton kernels can run here; prints the fallback notice once per process when not."""
    global _NOTICE_SHOWN
    from ..kernels import interpreter_missed, triton_available, use_triton

    late = interpreter_missed()
    if use_triton() and not late:
        return True
    if not _NOTICE_SHOWN:
        _NOTICE_SHOWN = True
        if late:
            why = ("TRITON_INTERPRET was set after triton was imported, and Triton reads it once, at import "
                   "(set it before Python starts)")
        else:
            why = "triton is not installed" if not triton_available() else "no CUDA device and TRITON_INTERPRET is off"
        print(f"energydsl: {why}: the triton backend falls back to torch", file=sys.stderr)
    return False
