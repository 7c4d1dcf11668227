import contextlib
import io
import json
import os
import re
import runpy
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# A suite started in the background by a shell without job control (`pytest &` in a script, `nohup`) inherits
# SIGINT ignored, and Python then keeps it so. The Ctrl-C tests send SIGINT and check that the handler the run
# found is given back, so they start from Python's own, as in a terminal.
signal.signal(signal.SIGINT, signal.default_int_handler)


def energy_in_process(*args: object, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """`energy ARGS` run in this process, as `subprocess.run` of `python -m energydsl.cli` reports it (exit
    status, stdout, stderr). A subprocess first imports torch and SymPy, about 5 s on a CI core: hundreds of
    command tests paid it. Tests of signals, closed streams, stdin or the environment keep a subprocess."""
    from energydsl import cli

    return _main_in_process(cli.main, ["energy", *map(str, args)], cwd)


def script_in_process(script: str, *args: object) -> subprocess.CompletedProcess[str]:
    """`python SCRIPT ARGS` (a path under the repository) run in this process, as `energy_in_process` does: for
    scripts that read neither TRITON_INTERPRET nor the environment at import."""
    path = str(ROOT / script)
    return _main_in_process(lambda: runpy.run_path(path, run_name="__main__"), [path, *map(str, args)], ROOT)


def _main_in_process(main: Callable[[], object], argv: list[str], cwd: Path | None) -> subprocess.CompletedProcess[str]:
    out, err = io.StringIO(), io.StringIO()
    saved, code = sys.argv, 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), contextlib.chdir(cwd or os.getcwd()):
        sys.argv = argv
        try:
            main()
        except SystemExit as e:
            if isinstance(e.code, str):  # as Python does at exit: the message on stderr, status 1
                print(e.code, file=sys.stderr)
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
        finally:
            sys.argv = saved
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def compile_for_gpu(script: str) -> None:
    """Run a script that compiles Triton kernels for a GPU target (no GPU needed), outside the interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=1800)
    if "ptxas" in proc.stderr and proc.returncode != 0 and "FileNotFoundError" in proc.stderr:
        pytest.skip("no ptxas in this triton install")
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]


def largest_tensor_made(step) -> int:
    """The most elements of any tensor an op makes while `step()` runs (forward and backward, the outputs of
    custom ops included): a bound on what a layer materialises, T x T or linear in T."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    self.numel = max(self.numel, t.numel())
            return out

    with Largest() as largest:
        step()
    return largest.numel


def multi_head_linear_attention(per_head: bool = True) -> str:
    """The multi-head linear attention example's text: RetNet's decay per head, or one decay shared by all."""
    text = (ROOT / "examples/intrinsic-optimizers/multi-head-linear-attention.energy").read_text(encoding="utf-8")
    if per_head:
        return text
    out = text.replace("param   a[heads] ~ uniform(1.4, 4.6) in (0, 1)", "param   a in (0, 1) = 0.9")
    out = out.replace("a[k]^(i - j)", "a^(i - j)")
    assert out.count("a^(i - j)") == 2 and "a[heads]" not in out
    return out


def strict_json(text: str):
    """json.loads that rejects NaN and Infinity, as strict parsers (JavaScript, jq) do."""
    def reject(name: str):
        raise ValueError(f"not JSON: {name}")
    return json.loads(text, parse_constant=reject)


@pytest.fixture
def one_thread():
    """Tiny models run faster on one thread, and much faster on a busy machine."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A small, learnable character corpus that needs no download (the training tests)."""
    lines = [
        "the quick brown fox jumps over the lazy dog.\n",
        "now is the time for all good men to come to the aid of the party.\n",
        "to be, or not to be, that is the question.\n",
    ]
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("".join(lines[i % 3] for i in range(200)))
    return path


# the energies of tests/data/weighted-context-sums.energy: context sums of an element-wise weight of one score
WEIGHTED_SUMS = ["SigmoidAttention", "ReluSquaredStrict", "SigmoidMeanStrict", "GaussianKernel", "MultiquadricWeights",
                 "SinusoidWeights"]


def lay(t, layout: str):
    """t (B, H, T, D) as a differentiable copy in `layout`, each read by the kernels in place through its strides,
    their gradients written dense: head (t itself, contiguous); token (token-major, (B, T, H, D) in memory, as
    heads split off a projection arrive); sliced (the first D columns of a tensor twice as wide); packed (the
    middle H D columns of a (B, T, 3 H D) product, as k of one fused q | k | v projection)."""
    import torch

    if layout == "token":
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "sliced":
        return torch.cat([t, t.detach()], dim=-1)[..., : t.shape[-1]]
    if layout == "packed":
        B, H, T, D = t.shape
        pad = torch.zeros(B, T, H * D, dtype=t.dtype, device=t.device)
        wide = torch.cat([pad, t.transpose(1, 2).flatten(2), pad], dim=-1)
        return wide[..., H * D : 2 * H * D].unflatten(-1, (H, D)).transpose(1, 2)
    return t


def run_main(*args: str) -> tuple[int, str, str]:
    """`energy ARGS` in this process: (exit status, stdout, stderr)."""
    result = energy_in_process(*args)
    return result.returncode, result.stdout, result.stderr


@contextlib.contextmanager
def within(seconds: int, why: str = "work that should take seconds"):
    """Fail (not hang) when the body takes longer than `seconds` (SIGALRM, main thread): a guard against work
    gone exponential or a spin that never ends, with a wide margin over what the body takes, not a timing."""
    def expired(*_):
        raise TimeoutError(f"took over {seconds} s: {why}")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


_PROGRESS_LINE = re.compile(r"^step \d+/\d+: train loss .*\n", re.M)


def without_progress(err: str) -> str:
    """stderr without the line per evaluation `energy train` prints where stderr is not a terminal."""
    return _PROGRESS_LINE.sub("", err)


# a learned self-token bias under a strict context, which never holds the token itself: it never trains
STRICT_SELF_BIAS = """energy StrictSelf(d = 8) {
  state   x[d]
  context h[j, d] where j < i
  param   WQ[d, d] ~ normal(0, 0.02)
  param   b_self = 0 learn
  local   s[j] = (WQ @ x) . h[j] + b_self * relu(1 - abs(i - j))
  global  E = -logsumexp[j](s[j])
  optimizer gd(eta = 1)
}
"""
