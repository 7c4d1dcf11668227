"""Names a spec may not use because the Python it compiles to could not: keywords, names that Python reads
as another (it normalises identifiers to NFKC, so `𝑥` is `x`), and, for parameters, the attributes every
`nn.Module` (and the generated class) already has. Semantics rejects them where they are declared, with the
span, rather than letting `energy compile` write a file that does not import or silently reads the wrong value.
"""

from __future__ import annotations

import keyword
import unicodedata

# torch.nn.Module's public attributes (torch 2.13; its private ones all start with `_`, refused as a group) and
# the members of the class `energy compile` writes. tests/test_language.py checks these against torch and a
# generated class, so a torch that adds one fails a test rather than a user's spec.
MODULE_ATTRIBUTES = frozenset({
    "T_destination", "add_module", "apply", "bfloat16", "buffers", "call_super_init", "children", "compile", "cpu",
    "cuda", "double", "dump_patches", "eval", "extra_repr", "float", "forward", "get_buffer", "get_extra_state",
    "get_parameter", "get_submodule", "half", "ipu", "load_state_dict", "modules", "mtia", "named_buffers",
    "named_children", "named_modules", "named_parameters", "parameters", "register_backward_hook",
    "register_buffer", "register_forward_hook", "register_forward_pre_hook", "register_full_backward_hook",
    "register_full_backward_pre_hook", "register_load_state_dict_post_hook", "register_load_state_dict_pre_hook",
    "register_module", "register_parameter", "register_state_dict_post_hook", "register_state_dict_pre_hook",
    "requires_grad_", "set_extra_state", "set_submodule", "share_memory", "state_dict", "to", "to_empty", "train",
    "training", "type", "xpu", "zero_grad",
    # the generated class's own
    "context_shape", "equation_hash", "example_input", "example_inputs", "input_shape", "reset_parameters",
    "state_shape", "steps",
})


# the Python API's own keyword arguments beside a declaration's dims (`.module(name, backend, device=, dtype=,
# **dims)`, `.energy(name, **dims)`): a dim by one of these names could never be set from Python
API_ARGUMENTS = frozenset({"self", "name", "backend", "device", "dtype"})


def name_problem(name: str, attribute: bool = False) -> tuple[str, str] | None:
    """(what is wrong, a hint) when `name` cannot be a name of the generated Python; None when it can.
    `attribute`: the name becomes an attribute of the generated nn.Module (a parameter)."""
    if keyword.iskeyword(name):
        return (f"`{name}` is a Python keyword, and the generated module names it in Python",
                f"rename it (`{name}_`, say)")
    normal = unicodedata.normalize("NFKC", name)
    if normal != name:
        return (f"`{name}` is read by Python as `{normal}` (it normalises identifiers to NFKC), so in the "
                f"generated module it would be the same name as `{normal}`",
                f"write `{normal}`, or another name")
    if attribute and (name in MODULE_ATTRIBUTES or name.startswith("_")):
        what = "starts with `_`, as torch's own attributes do" if name.startswith("_") else \
            "is an attribute every generated nn.Module already has"
        return f"`{name}` {what}, so a parameter cannot take it", f"rename it (`{name.strip('_')}_w`, say)"
    return None
