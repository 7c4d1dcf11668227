"""What lowering buys: a generated model against the same model with lowering off, same run, same weights.

The peer is the generic form every context sum has without lowering: the masked T x T reductions
(`masked_softmax`, `masked_reduce`). The lowered model runs its recognised sums as
`scaled_dot_product_attention` or chunked linear attention. Prints forward+backward time per step (median)
for both, the ratio lowered / generic, and the largest relative difference of the logits.

    python benchmarks/lowering.py                                    # CEM, context 256, batch 4
    python benchmarks/lowering.py --spec examples/models/rmt.energy --context 128
    python benchmarks/lowering.py --spec examples/intrinsic-optimizers/mha2nd1st.energy --set d=64 heads=4

A file without a model times its energy (`--name`, where it declares several) as one layer instead:
forward+backward of a loss on the layer's displacement, same weights on both sides; it also prints each
float32 layer's difference from the generic layer run in float64, to tell whose rounding a difference is (and a
model's logits, likewise, against the generic model in float64).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.model_vs_reference import step_time  # noqa: E402
from energydsl import load  # noqa: E402
from energydsl.codegen import module_class  # noqa: E402
from energydsl.derived import Derived  # noqa: E402
from energydsl.errors import UserError  # noqa: E402
from energydsl.runtime.model import LanguageModel  # noqa: E402


def generic_twin(model: LanguageModel) -> LanguageModel:
    """The same plan and stages, every stage generated with lowering off."""
    classes = [module_class(info.derived, lowering=False) for info in model.stage_info]
    twin = LanguageModel(model.plan, classes, model.stage_info)
    twin.load_state_dict(model.state_dict())
    return twin


def generic_layer(layer: torch.nn.Module, derived: Derived) -> torch.nn.Module:
    """The same energy's layer generated with lowering off, with `layer`'s weights."""
    twin = module_class(derived, lowering=False)()
    twin.load_state_dict(layer.state_dict())
    return twin


def layer_step_time(layer: torch.nn.Module, x: torch.Tensor, w: torch.Tensor) -> float:
    t0 = time.perf_counter()
    (layer(x, delta=True) * w).sum().backward()
    layer.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", default=str(ROOT / "examples/models/cem.energy"))
    ap.add_argument("--name", help="the model, or in a file without a model the energy, when it declares several")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--set", nargs="+", action="extend", default=[], metavar="NAME=VALUE",
                    help="dims (of the model or the energy): --set d=64 heads=4, or --set d=64 --set heads=4")
    args = ap.parse_args()
    torch.manual_seed(0)
    try:
        dims = {k: float(v) for k, v in (kv.split("=", 1) for kv in args.set)}
    except ValueError:
        print(f"error: --set takes NAME=NUMBER pairs; got {args.set}", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        spec = load(args.spec)
        if not spec.model_names:  # an energy: its layer
            derived, lowered = spec.energy(args.name, **dims), spec.module(args.name, **dims)
        else:
            lowered = spec.model(args.name, **{"context": args.context, **dims})
    except UserError as e:
        print(e.render(), file=sys.stderr)
        raise SystemExit(2) from None
    if not spec.model_names:
        return layer_main(derived, lowered, args)
    generic = generic_twin(lowered)
    idx = torch.randint(0, lowered.vocab_size, (args.batch, args.context))
    targets = torch.randint(0, lowered.vocab_size, (args.batch, args.context))
    print(f"{Path(args.spec).name}, context {args.context}, batch {args.batch}, "
          f"{torch.get_num_threads()} threads, fwd+bwd median of {args.repeats}")
    compare(lowered, generic, lambda m: m(idx), lambda m: step_time(m, idx, targets), args.repeats, "model",
            "logit ")


def layer_main(derived: Derived, lowered: torch.nn.Module, args: argparse.Namespace) -> None:
    """One energy's layer, lowered against generic (the file declares no model)."""
    with torch.no_grad():  # away from the tiny init, so that the softmax is not uniform
        for p in lowered.parameters():
            p.add_(0.5 * torch.randn_like(p))
    generic = generic_layer(lowered, derived)
    x = lowered.example_input(args.batch, args.context)
    w = torch.randn(x.shape)
    shown = ", ".join(f"{k}={v:g}" for k, v in derived.spec.dims().items())
    print(f"{Path(args.spec).name}: {derived.spec.name}({shown}), context {args.context}, batch {args.batch}, "
          f"{torch.get_num_threads()} threads, fwd+bwd median of {args.repeats}")
    compare(lowered, generic, lambda m: m(x.to(next(m.parameters()).dtype), delta=True),
            lambda m: layer_step_time(m, x, w), args.repeats, "layer")


def compare(lowered: torch.nn.Module, generic: torch.nn.Module, forward: Callable[[torch.nn.Module], torch.Tensor],
            step: Callable[[torch.nn.Module], float], repeats: int, what: str, outputs: str = "") -> None:
    """Print the two forms' fwd+bwd times (median of `repeats`, after a warm-up), their ratio, how far apart
    their outputs are, and each one's error against the generic form in float64 (whose rounding is it)."""
    with torch.no_grad():
        a, b = forward(lowered), forward(generic)
        exact = forward(copy.deepcopy(generic).double())
    diff = ((a - b).abs().max() / b.abs().max()).item()
    errors = [((y.double() - exact).abs().max() / exact.abs().max()).item() for y in (a, b)]
    times = {}
    for label, m in (("lowered", lowered), ("generic", generic)):
        step(m)  # warm-up
        times[label] = statistics.median(step(m) for _ in range(repeats))
    print(f"  lowered  {times['lowered'] * 1e3:9.1f} ms")
    print(f"  generic  {times['generic'] * 1e3:9.1f} ms   (masked T x T form, the peer)")
    print(f"  ratio lowered / generic: {times['lowered'] / times['generic']:.3f}   "
          f"max relative {outputs}difference {diff:.1e}")
    print(f"  against the generic {what} in float64: lowered {errors[0]:.1e}, generic {errors[1]:.1e}")


if __name__ == "__main__":
    main()
