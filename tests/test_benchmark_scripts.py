"""The GPU benchmark scripts keep working on machines without a GPU, so that a lent GPU's run does not fail.

`benchmarks/kernels.py` and `benchmarks/modules.py` time the fused kernels on CUDA only. Here they run their
CPU modes: `--interpret-smoke` (every case once at a tiny shape, interpreted, checked against the float64
reference: the same case builders, peers and comparisons the GPU run uses) and the plain call, which must
say that there is no GPU and exit 0.
"""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import script_in_process

ROOT = Path(__file__).resolve().parent.parent
# not imported here: triton read in this process before TRITON_INTERPRET=1 breaks the interpreted kernel tests
# that share the worker (they set it before their own first import)
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)


def _run(*args: str, interpret: bool = False) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def _run_here(script: str, *args: str) -> subprocess.CompletedProcess:
    """A script that runs on the torch backend, in this process (no 3 s of imports); it must not import triton
    (see above), which would break the interpreted tests that run later in this worker."""
    had_triton = "triton" in sys.modules
    out = script_in_process(script, *args)
    assert had_triton or "triton" not in sys.modules, f"{script} imported triton"
    return out


def test_kernels_benchmark_interpret_smoke() -> None:
    """Every family's cases, the wide (CEM diagonal) attention included, agree with the reference."""
    out = _run("benchmarks/kernels.py", "--interpret-smoke")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "0 failed" in out.stdout and "cem-diagonal" in out.stdout


def test_modules_benchmark_interpret_smoke() -> None:
    out = _run("benchmarks/modules.py", "--interpret-smoke", interpret=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "0 failed" in out.stdout


def test_precision_script_prints_each_magnitude() -> None:
    out = _run("benchmarks/precision.py", "--magnitudes", "1,30", "--shape", "1,1,9,8", interpret=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("max|s|")]
    assert len(rows) == 2 and all(f" {name} " in rows[0] for name in ("out", "dq", "dk", "dv", "du"))
    assert "[" not in rows[0]  # the second moment has no peer
    first = _run("benchmarks/precision.py", "--op", "attention", "--magnitudes", "1", "--shape", "1,1,9,8",
                 interpret=True)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    row = next(line for line in first.stdout.splitlines() if line.startswith("max|s|"))
    assert len(re.findall(r"=\d+\.\dx \[\d+\.\dx\]", row)) == 4, row  # out, dq, dk, dv: ours and SDPA's ratio
    if not torch.cuda.is_available():  # and not interpreted: says how, and exits 0 as the other GPU scripts do
        skipped = _run("benchmarks/precision.py")
        assert skipped.returncode == 0 and "no GPU" in skipped.stdout and "TRITON_INTERPRET=1" in skipped.stdout


@pytest.mark.slow
def test_profile_script_profiles_every_kernel_and_peer_interpreted(tmp_path) -> None:
    """The GPU profiling script's own code paths, on tiny interpreted shapes: a summary row and a trace for the
    kernel and the peer of each case."""
    out = _run("benchmarks/profile_kernels.py", "--device", "cpu", "--families", "attention,linear", "--steps",
               "1", "--trace", str(tmp_path), interpret=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    # attention: 3 kernels + 2 SDPA peers; linear: 2 kernels + 2 chunked torch peers
    assert "profiled 9 implementations" in out.stdout
    assert len(list(tmp_path.glob("*.json"))) == 9
    # the generated layers: each of modules.py's 11 on the kernels and on the torch backend
    out = _run("benchmarks/profile_kernels.py", "--device", "cpu", "--families", "layers", "--steps", "1",
               interpret=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "profiled 22 implementations" in out.stdout and "MomenMHA" in out.stdout


@pytest.mark.slow
def test_host_overhead_script_times_every_op_and_layer_with_launches_stubbed() -> None:
    """The CPU host-time script: 13 op cases (its own TRITON_INTERPRET=1) and the 11 generated layers."""
    out = _run("benchmarks/host_overhead.py", "--min-run-time", "0.01")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "measured 24 cases" in out.stdout and "MomenMHA" in out.stdout and "torch backend" in out.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU this is the benchmark itself")
@pytest.mark.parametrize("script", ["benchmarks/kernels.py", "benchmarks/modules.py", "benchmarks/profile_kernels.py"])
def test_without_a_gpu_the_benchmarks_say_so_and_exit_0(script: str) -> None:
    out = _run(script)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "no CUDA device" in out.stdout


@pytest.mark.slow
def test_kernel_resources_wide_second_moment_has_a_spill_free_config() -> None:
    """ptxas' allocation for sm_90 (no GPU needed): the tightest variant, the wide kernels' second moment, has
    a config for each kernel, and each backward mode, that fits in registers (the whole table: `-m slow`).
    27 = 5 + 10 + 12 wide configs (attention_configs.AUTOTUNE_CONFIGS[True], not imported here: it would load the
    kernels outside the interpreter)."""
    out = _run("benchmarks/kernel_resources.py", "--check", "--variants", "wide second", "--jobs", "2")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "every kernel variant has a spill-free config (27 compilations)" in out.stdout


@pytest.mark.slow
def test_kernel_resources_linear_kernels_have_a_spill_free_config() -> None:
    """The four linear-attention kernels (chunk states, outputs, dq/dk, dv) with a decay gate at head dim 128:
    each has a config that fits in registers. 24 = 4 kernels x 6 configs (linear._CONFIGS)."""
    out = _run("benchmarks/kernel_resources.py", "--check", "--variants", "linear d128 gated", "--jobs", "2")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "every kernel variant has a spill-free config (24 compilations)" in out.stdout


@pytest.mark.slow
def test_kernel_resources_pointwise_kernels_have_a_spill_free_config() -> None:
    """The pointwise kernels at head dim 128 with ALiBi slopes and their gradient, the tightest: each of the three
    has a config that fits in registers. 19 = 5 + 8 + 6 configs (the softmax family's split lists). With the
    first lists of 64- and 128-row tiles, the dK/dV kernel spilled in every config."""
    out = _run("benchmarks/kernel_resources.py", "--check", "--variants", "pointwise d128 sigmoid+alibi", "--jobs", "2")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "every kernel variant has a spill-free config (19 compilations)" in out.stdout


def _compiled_rows(condition: str) -> list[dict]:
    """kernel_resources' rows (registers, loop sizes, ...) of the autotune jobs `j` meeting `condition`, compiled
    for sm_90 in a process of their own (outside the interpreter)."""
    script = (
        "import json, sys; sys.path.insert(0, 'benchmarks')\n"
        "from kernel_resources import VARIANTS, compile_job, jobs\n"
        f"todo = [j for j in jobs() if {condition}]\n"
        "print(json.dumps([compile_job(j) for j in todo]))\n"
    )
    out = _run("-c", script)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.slow
def test_blocks_off_the_diagonal_cost_fewer_instructions() -> None:
    """Each narrow kernel visits the blocks wholly off the diagonal in a loop of its own, without the mask and
    the self-bias term: compiled for sm_90 (CEM's score terms, 64 x 32 tiles), it has two block loops, and
    the first, unmasked one costs at least 10% fewer instructions per block than the diagonal's."""
    rows = _compiled_rows("VARIANTS[j.variant].name == 'd64 alibi+self' and j.tiles == {'BLOCK_M': 64, 'BLOCK_N': 32}")
    assert [r["role"] for r in rows] == ["fwd", "dkdv", "dq"]
    for r in rows:
        unmasked, diagonal = r["loop_instructions"]
        assert unmasked < 0.9 * diagonal, r


@pytest.mark.slow
def test_pointwise_blocks_off_the_diagonal_cost_fewer_instructions() -> None:
    """The pointwise kernels visit the blocks wholly off the diagonal without the mask (and the self term):
    compiled for sm_90 (sigmoid, row bias, 64 x 64 tiles), the unmasked loop, which runs all but one or two
    blocks per program at long T, costs at least 10% fewer instructions per block than the masked ones."""
    rows = _compiled_rows("VARIANTS[j.variant].name == 'pointwise d64 sigmoid' and "
                          "j.tiles == {'BLOCK_M': 64, 'BLOCK_N': 64}")
    assert [r["role"] for r in rows] == ["fwd", "dkdv", "dq"]
    for r in rows:
        unmasked, *masked = r["loop_instructions"]
        assert len(masked) == (2 if r["role"] == "dkdv" else 1) and unmasked < 0.9 * min(masked), r


@pytest.mark.slow
def test_dkdv_blocks_stage_nothing_through_shared_memory() -> None:
    """The dK/dV kernel holds its score tiles keys x queries, so p and dS enter the dV and dK matmuls as
    they are: compiled for sm_90 with 64 keys per program or more (Hopper wgmma), its block loops store
    nothing to shared memory. Held queries x keys, each block staged both transposed tiles there (8 STSM
    and 4 STS per block at 64 x 64, with a barrier each)."""
    rows = _compiled_rows("j.role == 'dkdv' and VARIANTS[j.variant].name in ('d64 plain', 'd64 second') and "
                          "j.tiles in ({'BLOCK_M': 64, 'BLOCK_N': 64}, {'BLOCK_M': 32, 'BLOCK_N': 128})")
    assert len(rows) == 4
    for r in rows:
        assert len(r["loop_shared_stores"]) == 2 and not any(r["loop_shared_stores"]), r


@pytest.mark.slow
def test_fused_dkdv_adds_dq_by_vector_reductions() -> None:
    """The fused backward's dK/dV kernel adds each block's dQ with relaxed atomics whose results it never reads:
    compiled for sm_90, reductions of 4 floats each (REDG, 2 per thread per block at 32 x 128, d64, 8 warps) and
    no ATOMG, which returns the old value and, ordered acq_rel, adds fences and cache flushes to every block."""
    rows = _compiled_rows("j.role == 'dkdv' and VARIANTS[j.variant].name == 'd64 plain' and "
                          "j.tiles == {'BLOCK_M': 32, 'BLOCK_N': 128, 'DQ_ATOMIC': True}")
    assert len(rows) == 1
    assert rows[0]["loop_reductions"] == [2, 2] and rows[0]["loop_atomics"] == [0, 0], rows[0]


@pytest.mark.slow
def test_kernel_resources_every_variant_has_a_spill_free_config() -> None:
    out = _run("benchmarks/kernel_resources.py", "--check")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


def test_kernel_resources_names_an_unknown_variant() -> None:
    out = _run("benchmarks/kernel_resources.py", "--variants", "d64 plain,d96")
    assert out.returncode == 2 and "unknown variant(s) d96" in out.stderr and "Traceback" not in out.stderr


def test_lowering_benchmark_compares_a_model_with_its_generic_twin_in_float64() -> None:
    """A file with a model: the timing and the logits of both float32 models against the generic one in
    float64."""
    out = _run_here("benchmarks/lowering.py", "--spec", "examples/models/rmt.energy", "--context", "32",
                    "--repeats", "1", "--set", "layers=1", "dk=8", "dv=8", "heads=2")
    assert out.returncode == 0, out.stderr[-3000:]
    found = re.search(r"against the generic model in float64: lowered (\S+), generic (\S+)", out.stdout)
    assert found and "ratio lowered / generic" in out.stdout, out.stdout
    assert all(float(e) < 1e-4 for e in found.groups()), found.groups()


def test_lowering_benchmark_times_a_named_energy_of_a_file_with_several() -> None:
    """`--name` picks the energy (or model) of a file that declares several; without it the script says so."""
    args = ("benchmarks/lowering.py", "--spec", "tests/data/weighted-context-sums.energy", "--context", "16",
            "--repeats", "1", "--set", "d=8", "heads=2")
    out = _run_here(*args, "--name", "SigmoidAttention")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "SigmoidAttention(d=8, heads=2" in out.stdout and "ratio lowered / generic" in out.stdout
    assert "against the generic layer in float64: lowered" in out.stdout
    out = _run_here(*args)
    assert out.returncode == 2 and "declares 6 energies" in out.stderr and "--name" in out.stderr


@pytest.mark.slow
def test_model_vs_reference_times_both_models_eager_and_compiled() -> None:
    """`--compile` adds the compiled pair (Inductor, C++ on the CPU) to the same run and prints its ratios."""
    out = _run("benchmarks/model_vs_reference.py", "--compile", "--batch", "1", "--context", "8", "--d", "16",
               "--layers", "1", "--heads", "2", "--repeats", "1")
    assert out.returncode == 0, out.stderr[-2000:]
    for line in ("generated, compiled:", "hand-written, compiled:", "ratio generated / hand-written: ",
                 "ratio generated / hand-written, both compiled: ", "generated compiled / eager: ",
                 "hand-written compiled / eager: "):
        assert line in out.stdout, line


@pytest.mark.slow
def test_op_counts_counts_each_layer_and_compares_with_another_run(tmp_path) -> None:
    """Counts for every energy of the specs given, written as JSON; a --compare run prints the rows that differ.
    A doctored count in the other run's file shows up as one differing row. The triton backend counts its
    Triton launches in place of the torch ops they replace: fewer for NRGPT's attention (its strict context,
    j < i, is a T x T mask and a zeroed first row in the torch backend, several ops each way)."""
    counts = tmp_path / "counts.json"
    spec = "examples/models/nrgpt.energy"
    out = _run("benchmarks/op_counts.py", spec, "--json", str(counts))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    got = json.loads(counts.read_text())
    assert set(got) == {"models/nrgpt.energy:NRGPTAttention", "models/nrgpt.energy:NRGPTFF2W"}, got
    assert all(0 < fwd < both for fwd, both in got.values()), got
    got["models/nrgpt.energy:NRGPTFF2W"][0] += 7
    counts.write_text(json.dumps(got))
    out = _run("benchmarks/op_counts.py", spec, "--compare", str(counts))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert re.search(r"\| models/nrgpt\.energy:NRGPTFF2W \| (\d+) \| (\d+) \|", out.stdout), out.stdout
    assert "(1 layers unchanged)" in out.stdout, out.stdout
    out = _run("benchmarks/op_counts.py", spec, "--backend", "triton", "--json", str(tmp_path / "triton.json"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    triton = json.loads((tmp_path / "triton.json").read_text())
    assert all(0 < fwd < both for fwd, both in triton.values()), triton
    fused, plain = triton["models/nrgpt.energy:NRGPTAttention"], got["models/nrgpt.energy:NRGPTAttention"]
    assert fused[0] < plain[0] and fused[1] < plain[1], (fused, plain)


def test_op_counts_names_a_bad_spec_or_compare_file_and_exits_2(tmp_path) -> None:
    """A spec that does not load gets its file:line:col and a caret, a --compare file that is not one of this
    script's gets its path; exit status 2 and no traceback either way."""
    bad = tmp_path / "bad.energy"
    bad.write_text("energy E(d = 4) {\n  state z[d]\n  global F = sum(z * q)\n  optimizer gd(eta = 1)\n}\n")
    out = _run("benchmarks/op_counts.py", str(bad))
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert f"{bad}:3:22: error: undefined name `q`" in out.stderr and "^" in out.stderr, out.stderr
    (tmp_path / "not.json").write_text("[1, 2]")
    for compare in (tmp_path / "missing.json", tmp_path / "not.json"):
        out = _run("benchmarks/op_counts.py", "--compare", str(compare), "examples/hopfield/modern.energy")
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert f"error: --compare {compare}: not a --json file" in out.stderr, out.stderr


def test_activation_memory_prints_autograds_bytes_against_the_estimate_a_floor() -> None:
    """The estimate `energy train` checks a batch against is a floor of what autograd keeps per layer (above it,
    a batch that fits would be refused); the docs quote this script's ratios."""
    out = _run_here("benchmarks/activation_memory.py", "examples/models/gpt.energy", "examples/models/nrgpt.energy",
                    "--batch", "2", "--context", "16")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = re.findall(r"^(GPT|NRGPT)\s+(\d+)\s+(\d+)\s+([\d.]+)x$", out.stdout, re.M)
    assert [r[0] for r in rows] == ["GPT", "NRGPT"], out.stdout
    assert all(int(kept) >= int(estimate) > 0 for _, kept, estimate, _ in rows), rows
