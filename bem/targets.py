"""Which linears of a model BEM wraps: built-in attach points per architecture, or explicit names."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Union

import torch.nn as nn
from transformers.pytorch_utils import Conv1D

from .config import HierarchicalBEMConfig

# Attach points as regexes on a module's full name, one set per naming family.
_LLAMA_LIKE = {
    "mlp": r".*\.mlp\.(gate_proj|up_proj|down_proj)",
    "attention": r".*\.self_attn\.o_proj",
    "qkv": r".*\.self_attn\.(q_proj|k_proj|v_proj)",
}
_GPT2 = {
    "mlp": r".*\.mlp\.(c_fc|c_proj)",
    "attention": r".*\.attn\.c_proj",
    "qkv": r".*\.attn\.c_attn",
}
_GPT_NEOX = {
    "mlp": r".*\.mlp\.(dense_h_to_4h|dense_4h_to_h)",
    "attention": r".*\.attention\.dense",
    "qkv": r".*\.attention\.query_key_value",
}
_PHI3 = {  # fused projections: gate and up in one linear, q, k and v in another
    "mlp": r".*\.mlp\.(gate_up_proj|down_proj)",
    "attention": r".*\.self_attn\.o_proj",
    "qkv": r".*\.self_attn\.qkv_proj",
}
_BERT = {
    "mlp": r".*\.layer\.\d+\.(intermediate\.dense|output\.dense)",
    "attention": r".*\.attention\.output\.dense",
    "qkv": r".*\.attention\.self\.(query|key|value)",
}
_DISTILBERT = {
    "mlp": r".*\.ffn\.(lin1|lin2)",
    "attention": r".*\.attention\.out_lin",
    "qkv": r".*\.attention\.(q_lin|k_lin|v_lin)",
}

# Models named as Llama is (their MLP's gate/up/down and self_attn's q/k/v/o linears). Mixtral's experts are fused
# parameters, not linears: only its attention projections are attach points (attach_mlp must be off).
_LLAMA_NAMED = ("llama", "mistral", "ministral", "qwen2", "qwen3", "mixtral", "gemma", "gemma2", "gemma3_text",
                "smollm3", "olmo2", "olmo3", "granite", "cohere", "helium", "exaone4", "seed_oss", "apertus", "arcee")

ATTACH_POINTS: dict[str, dict[str, str]] = {
    **{name: _LLAMA_LIKE for name in _LLAMA_NAMED},
    "phi3": _PHI3,
    "gpt2": _GPT2,
    "gpt_neox": _GPT_NEOX,
    **{name: _BERT for name in ("bert", "roberta", "xlm-roberta", "electra", "camembert")},
    "distilbert": _DISTILBERT,
}


@dataclass
class TargetPlan:
    names: list[str]  # module names to wrap, in model order
    token_routed: list[str]  # the subset whose codes get the token level


# As in PEFT: every nn.Linear and Conv1D but the output layer.
ALL_LINEAR = "all-linear"


def _is_wrappable(module: nn.Module) -> bool:
    return isinstance(module, (nn.Linear, Conv1D))


def _matches(name: str, selector: Union[list[str], str]) -> bool:
    if selector == ALL_LINEAR:
        return True
    if isinstance(selector, str):
        return re.fullmatch(selector, name) is not None
    return any(name == key or name.endswith("." + key) for key in selector)


def _output_layer_names(model: nn.Module) -> set[str]:
    """The output embedding layer (an LM head), which "all-linear" leaves out as PEFT does."""
    get_output = getattr(model, "get_output_embeddings", None)
    head = get_output() if callable(get_output) else None
    return {name for name, module in model.named_modules() if head is not None and module is head}


def _model_type(model: nn.Module) -> Optional[str]:
    config = getattr(model, "config", None)
    return getattr(config, "model_type", None)


def _check_each_point_matches(names: list[str], model_type: str, attach: dict[str, str], points: list[str]) -> None:
    """An attach point that is on but finds none of the wrappable `names` is an error, not a silent no-op (Mixtral's
    experts, say, are fused parameters in current transformers, so `attach_mlp` has nothing to wrap there)."""
    for point in points:
        if not any(re.fullmatch(attach[point], name) for name in names):
            raise ValueError(
                f"attach_{point} is on, but this {model_type} model has no {point} linear that BEM can wrap (it "
                f"wraps nn.Linear and Conv1D layers; expected names like {attach[point]!r}); set attach_{point}="
                f"False, or choose modules with target_modules"
            )


def plan_targets(model: nn.Module, config: HierarchicalBEMConfig) -> TargetPlan:
    """Names of the modules to wrap, or a ValueError that says why none match."""
    model_type = _model_type(model)
    attach = ATTACH_POINTS.get(model_type or "")
    if config.target_modules is not None:
        selector = config.target_modules
    else:
        if attach is None:
            raise ValueError(
                f"BEM has no built-in attach points for model_type '{model_type}'; "
                f"set target_modules (module names or a regex). Known: {sorted(ATTACH_POINTS)}"
            )
        points = [p for p, on in (("mlp", config.attach_mlp), ("attention", config.attach_attention),
                                  ("qkv", config.attach_qkv)) if on]
        selector = "|".join(f"(?:{attach[p]})" for p in points)

    names, rejected = [], []
    all_linear = selector == ALL_LINEAR
    skipped = _output_layer_names(model) if all_linear else set()
    for name, module in model.named_modules():
        if not name or name in skipped or not _matches(name, selector):
            continue
        if _is_wrappable(module):
            names.append(name)
        elif not all_linear and (isinstance(selector, list) or not list(module.children())):
            rejected.append(f"{name} ({type(module).__name__})")
    if config.target_modules is None:
        _check_each_point_matches(names, model_type, attach, points)
    if rejected and isinstance(selector, list):
        raise ValueError(
            f"target_modules matched modules BEM cannot wrap (only nn.Linear and Conv1D): {rejected[:5]}"
        )
    if not names:
        linears = [n for n, m in model.named_modules() if _is_wrappable(m)]
        raise ValueError(
            f"no module matched the BEM targets {selector!r} in this {type(model).__name__}; "
            f"linear layers it has include: {linears[:8]}"
        )

    if not config.enable_routing or not config.enable_token_routing:
        token_routed: list[str] = []
    elif config.token_routing_modules is not None:
        token_routed = [n for n in names if _matches(n, config.token_routing_modules)]
    elif attach is not None:
        token_routed = [n for n in names if re.fullmatch(attach["mlp"], n)]
    else:
        token_routed = []
    return TargetPlan(names=names, token_routed=token_routed)


def saved_module_names(model: nn.Module, modules_to_save: list[str], bem_targets: list[str]) -> list[str]:
    """The modules `modules_to_save` names (suffix match, the outermost where they nest), or a ValueError:
    none matched, or one holds a BEM target (its copy would not carry the target's BEM module)."""
    names: list[str] = []
    for name, _ in model.named_modules():
        if name and _matches(name, list(modules_to_save)) and not any(name.startswith(n + ".") for n in names):
            names.append(name)
    if not names:
        raise ValueError(f"modules_to_save {list(modules_to_save)} matched no module of this {type(model).__name__}")
    for name in names:
        inside = [t for t in bem_targets if t == name or t.startswith(name + ".")]
        if inside:
            raise ValueError(f"modules_to_save entry '{name}' holds BEM targets {inside[:3]}; save a module "
                             f"outside them, or leave those out of target_modules")
    return names
