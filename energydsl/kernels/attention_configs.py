"""What the softmax family's kernels are tuned over on a GPU, and how the backward's mode is chosen.

The autotuner (`launch.maybe_autotune`) times every config of a list on the first call of each tuning key;
the lists here hold, per kernel, configs checked to fit in registers on sm_90 (`benchmarks/
kernel_resources.py`). The narrow backward's mode, split or fused, is timed per shape by
`AttentionOps._fuse_dq` (`attention.py`) and recorded as a `BackwardChoice`. Under the interpreter nothing
here is used: `attention.py` passes fixed tiles.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import triton

from .launch import next_power_of_2

__all__ = ["AUTOTUNE_CONFIGS", "TUNE_KEYS", "BackwardChoice", "tune_bucket"]


def _configs(shapes: list[tuple[int, ...]], **fixed: Any) -> list[triton.Config]:
    """Configs from (BLOCK_M, BLOCK_N, num_warps, num_stages), or with BLOCK_D third for the wide kernels;
    `fixed`: further meta-parameters, the same in each."""
    names = ("BLOCK_M", "BLOCK_N") if len(shapes[0]) == 4 else ("BLOCK_M", "BLOCK_N", "BLOCK_D")
    return [
        triton.Config(dict(zip(names, s[:-2])) | fixed, num_warps=s[-2], num_stages=s[-1]) for s in shapes
    ]


# Each list holds, for every variant (head dims 64 and 128, with and without biases), configs that fit in
# registers on sm_90: `benchmarks/kernel_resources.py` compiles every config and prints its registers and
# spills (no GPU needed); `--check` fails when a kernel variant has no spill-free config. Configs that need
# more shared memory than the device has fail with OutOfResources and are skipped by the autotuner.
# (BLOCK_M, BLOCK_N, num_warps, num_stages)
_FWD_CONFIGS = _configs([(128, 64, 8, 3), (128, 32, 4, 3), (64, 64, 4, 3), (64, 32, 4, 2), (32, 32, 4, 2)])
# The dK/dV configs with 128 keys per program and the last dQ config are the Triton tutorial's Hopper backward
# tiles (128 keys per dK/dV program, 128 queries per dQ program), at 8 warps (at 4 they spill). Added, not yet
# timed, after the first H100 run found the backward 1.5-1.7x FA2's at long T with tiles of at most 64
# (benchmarks/RESULTS.md). The dK/dV kernel holds its tiles keys x queries, so BLOCK_N is its matmuls' M: at
# 128 keys they run as Hopper wgmma (a 32-row M ran as mma.sync) and fit in registers at head dims 64 and 128
# (CEM's score terms at 128 still spill 32 bytes).
_DKDV_CONFIGS = _configs([(64, 64, 8, 2), (32, 64, 8, 2), (64, 32, 8, 2), (32, 32, 4, 2), (16, 32, 4, 1),
                          (32, 128, 8, 3), (16, 128, 8, 2), (64, 128, 8, 2)])
# The fused backward's dK/dV configs (DQ_ATOMIC: the program also adds each block's dQ_i into fp32 with atomics,
# FlashAttention-2's dQ, and no dQ kernel runs). Added after the same H100 run, not yet timed: the two-kernel
# backward recomputes the scores, p and dP for dQ, 7 matmuls per block against FA2's 5. Compiled for sm_90 the
# fused block costs about a quarter fewer instructions than a dK/dV block plus a dQ block of the same pairs
# (337 against 258 + 197 at 32 x 128 / 128 x 32, d64), its dQ additions vector reductions (RED, 4 floats each);
# whether the atomic traffic eats that is for a GPU to show, so `_fuse_dq` times both backwards per shape.
# More keys per program mean fewer additions to each dQ row (T / BLOCK_N in all).
_FUSED_DKDV_CONFIGS = _configs([(32, 128, 8, 3), (16, 128, 8, 2), (64, 128, 8, 2), (32, 64, 8, 2)], DQ_ATOMIC=True)
_DQ_CONFIGS = _configs([(64, 64, 8, 2), (32, 64, 4, 2), (64, 32, 4, 2), (32, 32, 4, 2), (16, 32, 4, 1),
                        (128, 32, 8, 3)])
# the wide kernels tune their feature tile too (it sets the grid's third axis): (BLOCK_M, BLOCK_N, BLOCK_D,
# num_warps, num_stages). A wider BLOCK_D means fewer programs recomputing the scores, at more registers.
_WIDE_FWD_CONFIGS = _configs([(64, 64, 64, 8, 2), (64, 64, 128, 8, 2), (32, 64, 128, 8, 2), (64, 32, 64, 8, 2),
                              (32, 32, 64, 4, 2)])
_WIDE_DKDV_CONFIGS = _configs([(32, 64, 64, 8, 2), (64, 32, 64, 8, 2), (64, 64, 32, 8, 2), (32, 32, 64, 8, 2),
                               (32, 32, 32, 4, 2), (32, 32, 256, 8, 2)], FEATURE_LOOP=False) + _configs(
    [(64, 64, 64, 8, 2), (32, 64, 64, 4, 2), (32, 128, 64, 8, 2), (64, 64, 128, 8, 2)], FEATURE_LOOP=True)
_WIDE_DQ_CONFIGS = _configs([(64, 64, 64, 8, 2), (32, 64, 64, 8, 2), (64, 32, 64, 8, 2), (32, 32, 128, 8, 2),
                             (32, 32, 64, 4, 2), (32, 32, 256, 8, 2), (64, 32, 128, 8, 2)], FEATURE_LOOP=False
                            ) + _configs(
    [(64, 64, 64, 8, 2), (64, 32, 64, 4, 2), (128, 64, 64, 8, 2), (128, 32, 64, 8, 2), (64, 64, 128, 8, 2)],
    FEATURE_LOOP=True)
# The 256-wide feature tiles of the wide backward (4 programs recompute CEM's 832-wide scores instead of 13)
# and the FEATURE_LOOP configs (one program per row block computes each score tile once and adds its products
# to every feature tile of fp32 outputs in memory: about 3x fewer FLOPs than 256-wide tiles at CEM's 832, for
# a read and a write of each output tile per block) were added after the first H100 run found that
# recomputation made its backward 4.7x slower than the T x T torch reference at T = 2k (benchmarks/RESULTS.md).
# ptxas fits the loop configs without spilling (the 256-wide tiles spill 8-12 bytes); none is timed yet.
# what the autotuner tries for (forward, dK/dV, dQ), by `wide`
AUTOTUNE_CONFIGS = {
    False: (_FWD_CONFIGS, _DKDV_CONFIGS + _FUSED_DKDV_CONFIGS, _DQ_CONFIGS),
    True: (_WIDE_FWD_CONFIGS, _WIDE_DKDV_CONFIGS, _WIDE_DQ_CONFIGS),
}
# tuned once per head-dim pair (padded for the narrow kernels), variant (dtypes are added to the key by triton)
# and sequence-length bucket (`tune_bucket`): the best tiles depend on T (how many programs fill the GPU, how
# long each runs), but tuning at every length would retune at every step of generation
# DELTA_PASS: the dQ kernel's pass for the second moment's row term, tuned apart from its dQ
TUNE_KEYS = {False: ["BLOCK_DK", "BLOCK_DV", "SECOND", "DELTA_PASS", "T_TUNE"],
             True: ["D_QK", "D_V", "SECOND", "DELTA_PASS", "T_TUNE"]}
_SHORTEST_BUCKET = 1024


class BackwardChoice(NamedTuple):
    """How one shape's backward runs (`AttentionOps._fuse_dq`), and the median times it was chosen on."""

    fused: bool
    split_ms: float
    fused_ms: float

    @classmethod
    def time(cls, split: Callable[[], Any], fused: Callable[[], Any]) -> "BackwardChoice":
        """Time both backwards on the call's own tensors (each writes fresh outputs, so reruns are harmless);
        a first call of each lets the autotuner tune its kernels outside the timing."""
        from triton.testing import do_bench

        split()
        fused()
        split_ms = do_bench(split, warmup=10, rep=50, return_mode="median")
        fused_ms = do_bench(fused, warmup=10, rep=50, return_mode="median")
        return cls(fused_ms < split_ms, split_ms, fused_ms)

    @classmethod
    def read(cls, record: dict[str, Any] | None) -> "BackwardChoice | None":
        """A choice stored by `tuning.store(..., choice._asdict())`, or None if `record` is not one."""
        if record is None or not isinstance(record.get("fused"), bool):
            return None
        times = record.get("split_ms"), record.get("fused_ms")
        if not all(isinstance(t, float) for t in times):
            return None
        return cls(record["fused"], *times)


def tune_bucket(T: int) -> int:
    """The sequence-length bucket the autotuner keys on: T rounded up to a power of two, at least 1024 (one
    tuning for every short sequence). Keyed on head dims alone, the first H100 run's attention rows at
    T = 2k-16k ran the tiles tuned at T = 1k."""
    return max(_SHORTEST_BUCKET, next_power_of_2(T))
