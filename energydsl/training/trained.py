"""A trained checkpoint back as a model and its codec: the spec and dims travel in the checkpoint's metadata.

What `energy sample` loads. Every field is checked before use, so a damaged or hand-edited `best.json` is a
message that names the field, not an exception where the value is first used.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from energydsl.errors import SpecError, UserError
from energydsl.files import read_text
from energydsl.number_text import is_count

from .checkpoint import checkpoint_file, checkpoint_paths, load_checkpoint
from .sampling import Codec, codec_from_json

_RESTORE = "restore the spec files as they were when it was trained, or train again"
_OTHER = "sample the run's other checkpoint if it is whole, or train again"


def load_trained(checkpoint: str) -> tuple[Any, Codec, dict[str, Any]]:
    """(model with the trained weights, the codec it was trained with, the checkpoint's metadata)."""
    from energydsl.api import Spec, load
    from energydsl.syntax import parse_module
    from energydsl.training import load_dataset

    state, meta = load_checkpoint(checkpoint)
    if "model" not in meta:
        weights, sidecar = checkpoint_paths(checkpoint, "best")
        if checkpoint_file(sidecar) is None:  # a run's weights whose .json was lost, or weights from elsewhere
            other = weights.with_name({"best": "last", "last": "best"}.get(weights.stem, "last") + ".safetensors")
            instead = f"`energy sample {other}` if that checkpoint is whole, or " if other.is_file() else ""
            raise UserError(f"{weights} has no metadata beside it ({sidecar.name} is missing), so the model it "
                            "holds is unknown", hint=f"a run written by `energy train` has both files: "
                            f"{instead}train again")
        raise UserError(f"{checkpoint} was not written by `energy train` (no model in its metadata)")
    if not isinstance(meta["model"], str) or not isinstance(meta.get("dims"), dict):
        raise UserError(f"the metadata of {checkpoint} is damaged: it lacks the model's name or dims that "
                        "`energy train` writes", hint=_OTHER)
    path, source = meta.get("spec_path", ""), meta.get("spec_source")
    training = meta.get("training", {})
    dataset = training.get("dataset", {}) if isinstance(training, dict) else None
    context, config = meta.get("context", 1), training.get("config", {}) if isinstance(training, dict) else {}
    wrong = ("spec_path" if not isinstance(path, str) else "spec_source" if not isinstance(source, str | None)
             else "context" if not is_count(context)  # the tokens the model reads when sampling
             else "training.config" if not isinstance(config, dict) or not is_count(config.get("block_size", 1))
             else "training.dataset" if not isinstance(dataset, dict)
             else "training.dataset.codec" if not isinstance(dataset.get("codec", {}), dict) else None)
    if wrong:
        raise UserError(f"the metadata of {checkpoint} is damaged: its {wrong} is not what `energy train` writes",
                        hint=_OTHER)
    # the spec as trained travels in the checkpoint: the file at spec_path may have been edited since (its
    # path is used only while it still holds that text, so that its imports resolve next to it)
    path = Path(path)
    unchanged = path.is_file() and (source is None or read_text(str(path)) == source)
    kept = f"{checkpoint}'s spec_source"  # how the spec's own spans name the text the checkpoint keeps
    try:
        spec = load(path) if unchanged or not source else Spec(parse_module(source, name=kept, base=path.parent))
    except SpecError as e:
        if unchanged or not source:
            raise
        if _in_an_import(e, kept, source):  # the files it imports are read as they are now: not damage
            raise SpecError(e.message, e.span, hint=f"the spec kept in {checkpoint} imports this file, read from "
                            f"where it was trained ({path.parent}): {_RESTORE}") from None
        raise UserError(f"the metadata of {checkpoint} is damaged: the spec it holds (spec_source) does not load: "
                        f"{e.message}", hint=_OTHER) from None
    model = spec.model(meta["model"], **meta["dims"])
    # an imported file is read as it is now: the model must still be the one trained
    trained = meta.get("equation_hash")
    if trained is not None and model.equation_hash() != trained:
        raise UserError(f"{checkpoint}: the model its spec builds now is not the one trained, its equations "
                        "changed (the spec travels in the checkpoint, but the files it imports are read as they are "
                        "now)", hint=_RESTORE)
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        # the model is the one trained (its equations, and the spec file too): the weights are from elsewhere
        same = trained is not None and unchanged
        raise UserError(f"{checkpoint}: its weights do not fit the model its spec builds now: "
                        f"{str(e).strip().splitlines()[-1].strip()[:200]}",
                        hint="its weights and its metadata are from different saves: use a checkpoint's own pair "
                             "(X.safetensors with X.json), or train again" if same else _RESTORE) from None
    if "codec" not in dataset:
        return model, load_dataset(dataset.get("name", "")), meta
    try:
        return model, codec_from_json(dataset["codec"]), meta
    except UserError as e:
        raise UserError(f"the metadata of {checkpoint} is damaged: its {e.message}", hint=_OTHER) from None


def _in_an_import(e: SpecError, kept: str, source: str) -> bool:
    """Is a spec error of the kept text about a file it imports: in that file, or at an `import` line that names
    one missing or unreadable?"""
    if e.span is None:
        return False
    if e.span.file != kept:
        return True
    lines = source.split("\n")
    return 1 <= e.span.line <= len(lines) and lines[e.span.line - 1].lstrip().startswith("import")


def divergence_note(checkpoint: str, meta: dict[str, Any]) -> str | None:
    """A line for a run whose last attempt diverged (its `diverged.json`, which a good resume removes): the
    weights sampled are then from before the divergence, maybe from its very start."""
    import json

    weights, _ = checkpoint_paths(checkpoint, "best")
    found = checkpoint_file(weights.parent / "diverged.json")  # gone with a commit not yet completed
    try:
        record = json.loads(found.read_text()) if found is not None else None
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict):
        return None
    at = f" at step {record['step']}" if isinstance(record.get("step"), int) else ""
    why = f" ({record['reason']})" if isinstance(record.get("reason"), str) else ""
    training = meta.get("training")
    step = training.get("step") if isinstance(training, dict) else None
    held = f"from step {step}" if isinstance(step, int) and step >= 0 else "from before it"
    return f"this run diverged{at}{why}; {weights.name} holds the weights {held}"
