"""A model's composition graph (`ModelPlan.graph`) as Graphviz DOT: what `energy graph --dot` writes."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import networkx as nx

    from .composition import ModelPlan


def dot_text(plan: ModelPlan, g: nx.DiGraph) -> str:
    """Every node and edge with all its attributes; a deep stack drawn once (`g.graph["repeat"] > 1`) sits in a
    dashed box labelled with its number of layers."""
    lines = [f'digraph "{plan.name}" {{', "  rankdir=TB;"]
    repeated = []
    for node, data in g.nodes(data=True):
        label = data.get("label", node)
        if data.get("weights") == "shared" and not data.get("repeat"):  # the box of a deep stack says it
            label += "\\n(shared weights)"
        shown = {"label": label, "shape": _shape(data)} | {k: v for k, v in data.items() if k != "label"}
        (repeated if "repeat" in data else lines).append(f'  "{node}" [{_attributes(shown)}];')
    if repeated:
        weights = "shared weights" if plan.shared else "weights per layer"
        lines += ['  subgraph "cluster_layer" {', f'    label="layer × {plan.layers:,} ({weights})";',
                  "    style=dashed;", *(f"  {line}" for line in repeated), "  }"]
    for a, b, data in g.edges(data=True):  # a stream carried across layers (momentum, nag) is labelled
        shown = {**data, "label": data["across"]} if data.get("across", "residual") != "residual" else data
        lines.append(f'  "{a}" -> "{b}"' + (f" [{_attributes(shown)}]" if shown else "") + ";")
    return "\n".join([*lines, "}"]) + "\n"


def _shape(data: dict) -> str:
    return "box" if data.get("kind") == "stage" else "ellipse"


def _attributes(data: dict) -> str:
    """Attributes as DOT's `key="value", ...` (Graphviz draws label and shape, and keeps the others: kind,
    weights, energies, across, repeat)."""
    def quoted(v: object) -> str:
        return '"' + str(v).replace('"', '\\"') + '"'

    return ", ".join(f"{k}={v if k == 'shape' else quoted(v)}" for k, v in data.items())
