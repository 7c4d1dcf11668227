"""`energy info`'s activation estimate against what autograd keeps, per layer and token, for each example model.

`activation_bytes_per_token` counts, per stage of a layer, the stream and its displacement in fp32 (docs/models.md,
"activation_bytes_per_token"): a floor, which `energy train` checks a batch against before building the model.
The named peer is autograd itself: the bytes of the distinct storages its saved-tensor hooks see during one forward
pass, at 2 and at 4 layers, so the difference halved is one layer's share (the embedding, final norm and logits
cancel). The ratio says how far above the floor a model's real activations are.

    python benchmarks/activation_memory.py                              # every model under examples/models
    python benchmarks/activation_memory.py examples/models/nrgpt.energy --context 128
"""

from __future__ import annotations

import argparse
import glob

import torch

from energydsl import load


def saved_bytes(model: torch.nn.Module, idx: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd keeps for the backward pass of one forward."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = max(storages.get(storage.data_ptr(), 0), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(idx)
    return sum(storages.values())


def per_layer(path: str, batch: int, context: int | None) -> tuple[str, float, float]:
    """(model, autograd's bytes per token and layer, the estimate's)."""
    spec = load(path)
    kept, estimated = {}, {}
    for layers in (2, 4):
        dims = {"layers": layers} | ({"context": context} if context else {})
        torch.manual_seed(0)
        model = spec.model(**dims)
        tokens = model.plan.context
        idx = torch.randint(0, model.vocab_size, (batch, tokens))
        kept[layers] = saved_bytes(model, idx) / (batch * tokens)
        estimated[layers] = 4 * model.activation_floats_per_token(layers=layers)
    return model.plan.name, (kept[4] - kept[2]) / 2, (estimated[4] - estimated[2]) / 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", help="model specs (default: examples/models/*.energy)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--context", type=int, default=None, help="default: each model's own")
    args = parser.parse_args()
    print(f"{'model':<14} {'autograd B/token/layer':>24} {'estimate':>10} {'ratio':>7}")
    for path in args.paths or sorted(glob.glob("examples/models/*.energy")):
        name, kept, estimate = per_layer(path, args.batch, args.context)
        print(f"{name:<14} {kept:>24.0f} {estimate:>10.0f} {kept / estimate:>6.1f}x")


if __name__ == "__main__":
    main()
