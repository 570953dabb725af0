"""`create_hierarchical_bem` and `BEMModel`: wrap a pretrained model's linears with BEM modules."""

from __future__ import annotations

import contextlib
import inspect
import os
import re
import types
import warnings
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import torch
import torch.nn as nn

from .config import HierarchicalBEMConfig
from .modules.adapter_pack import AdapterPack
from .modules.bem_linear import BEMLinear, RoutingContext
from .modules.controller import HierarchicalController
from .modules.joint_weights import input_groups
from .modules.mixers import MixerBlock, attach as attach_mixers, resolve_layers
from .modules.trainable_copy import TrainableCopy
from .call_hooks import CallHooks
from .call_inputs import capture_generate_masks
from .lora_bridge import apply_peft_lora, read_peft_lora, save_as_peft_lora
from .persistence import apply_adapter, read_adapter, save_adapter
from .stats import routing_stats
from .targets import plan_targets, saved_module_names


def _hidden_size(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    for attr in ("hidden_size", "n_embd", "d_model", "dim"):
        value = getattr(config, attr, None)
        if isinstance(value, int):
            return value
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embeddings is not None and hasattr(embeddings, "weight"):
        return embeddings.weight.shape[1]
    raise ValueError("could not tell the model's hidden size (no config.hidden_size and no input embeddings)")


def _decoder_blocks(model: nn.Module, target_names: list[str]) -> nn.ModuleList:
    """The list of blocks the embeddings pass through: the ModuleList that holds the first wrapped layer."""
    first = target_names[0]
    match = re.match(r"^(.*?)\.(\d+)\.", first + ".")
    if match is None:
        raise ValueError(
            f"BEM routes from the hidden states entering the first block, but '{first}' is not inside a list "
            f"of blocks (expected a name like 'model.layers.0.mlp.up_proj')"
        )
    blocks = model.get_submodule(match.group(1))
    if not isinstance(blocks, nn.ModuleList) or len(blocks) == 0:
        raise ValueError(f"'{match.group(1)}' is not a list of blocks; cannot find where routing reads from")
    return blocks


def _routed_model(model: nn.Module, first_block: nn.Module) -> nn.Module:
    """The module whose call starts a pass over the blocks: the HF backbone (`model.base_model`,
    e.g. `LlamaModel` inside `LlamaForCausalLM`) when it holds the blocks, so that calling the
    backbone directly routes too; the model itself otherwise."""
    backbone = getattr(model, "base_model", None)
    if isinstance(backbone, nn.Module) and any(m is first_block for m in backbone.modules()):
        return backbone
    return model


_CLASSIFIER_MODELS = ("ForSequenceClassification", "ForTokenClassification")
_HEAD_NAMES = ("classifier", "score")


def _warn_on_frozen_heads(model: nn.Module, saved: list[str]) -> None:
    """A classification model's head, usually freshly initialised, would stay frozen unless saved."""
    if not type(model).__name__.endswith(_CLASSIFIER_MODELS):
        return
    heads = [name for name, _ in model.named_children() if name in _HEAD_NAMES and name not in saved]
    if heads:
        warnings.warn(f"{type(model).__name__}'s head {heads} stays frozen as loaded; set modules_to_save={heads} "
                      f"to train it with BEM (PEFT's task_type does the same)", UserWarning, stacklevel=4)


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def _forward_signature(base_model: nn.Module) -> Optional[inspect.Signature]:
    """The base model's forward signature with `side_signals` added (keyword-only, before **kwargs), and
    `self` first; None where the base's cannot be read."""
    try:
        parameters = list(inspect.signature(base_model.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    kept = [p for p in parameters if p.name not in ("self", "side_signals") and p.kind != p.VAR_KEYWORD]
    var_keyword = [p for p in parameters if p.kind == p.VAR_KEYWORD]
    this = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    side = inspect.Parameter("side_signals", inspect.Parameter.KEYWORD_ONLY, default=None)
    return inspect.Signature([this, *kept, side, *var_keyword])


def _signed_forward(model: "BEMModel") -> Optional[types.MethodType]:
    """`model.forward` that shows the base model's arguments to whoever reads its signature: transformers'
    Trainer keeps only the batch keys a model's forward names, and `BEMModel.forward` takes **kwargs."""
    signature = _forward_signature(model.base_model)
    if signature is None:
        return None

    def forward(self: "BEMModel", *args: Any, **kwargs: Any) -> Any:
        return BEMModel.forward(self, *args, **kwargs)

    forward.__signature__ = signature  # type: ignore[attr-defined]
    forward.__doc__ = BEMModel.forward.__doc__
    return types.MethodType(forward, model)


class BEMModel(nn.Module):
    """A Hugging Face model whose target linears carry BEM modules, plus one routing controller.

    Call it like the base model; attributes the wrapper lacks are read from the base model.
    """

    def __init__(self, base_model: nn.Module, config: HierarchicalBEMConfig) -> None:
        super().__init__()
        self.base_model = base_model
        self.bem_config = config
        plan = plan_targets(base_model, config)
        self.context = RoutingContext()
        self._pack: Optional[AdapterPack] = None  # made at the first generate: none kept without one
        self._pack_form: tuple[bool, bool] = (True, True)  # the pack's (joint_weights, joint_groups)
        # generate's compiled step computes plain linears as one GEMM of [W; Vᵀ] (modules/joint_weights.py);
        # BEM_JOINT_WEIGHTS=0 keeps the fused kernels there instead
        self.joint_weights: bool = os.environ.get("BEM_JOINT_WEIGHTS", "1") != "0"
        # ... and the layers that take one input (q, k, v; gate, up) as one GEMM; BEM_JOINT_GROUPS=0: each alone
        self.joint_groups: bool = os.environ.get("BEM_JOINT_GROUPS", "1") != "0"
        for param in base_model.parameters():
            param.requires_grad_(False)
        self.bem_module_names: list[str] = plan.names
        for index, name in enumerate(plan.names):
            _replace(base_model, name, BEMLinear(base_model.get_submodule(name), config.rank, config.alpha,
                                                 config.dropout, index, self.context, config.use_fused_kernels,
                                                 name=name))
        self.saved_module_names: list[str] = (
            [] if config.modules_to_save is None else saved_module_names(base_model, config.modules_to_save, plan.names)
        )
        for name in self.saved_module_names:
            _replace(base_model, name, TrainableCopy(base_model.get_submodule(name), self.context))
        _warn_on_frozen_heads(base_model, self.saved_module_names)
        if config.enable_routing:
            token_indices = [plan.names.index(n) for n in plan.token_routed]
            reference_weight = self.bem_modules()[0][1].base_layer.weight
            self.controller: Optional[HierarchicalController] = HierarchicalController(
                hidden_size=_hidden_size(base_model), num_modules=len(plan.names), rank=config.rank,
                token_module_indices=token_indices, controller_dim=config.controller_dim,
                chunk_size=config.chunk_size, max_prefix_tokens=config.max_prefix_tokens,
                ema_decay=config.ema_decay, code_clamp_value=config.code_clamp_value,
                enable_uncertainty=config.enable_uncertainty, enable_token_routing=config.enable_token_routing,
                side_signal_dim=config.side_signal_dim,
            ).to(device=reference_weight.device).train(base_model.training)
        else:
            self.controller = None
        self.token_routed_names: list[str] = plan.token_routed
        blocks = _decoder_blocks(base_model, plan.names)
        self.mixers = self._make_mixers(base_model, blocks, config)
        self._hooks = CallHooks(_routed_model(base_model, blocks[0]), blocks[0], self.controller, self.context,
                                stateful_blocks=len(self.mixers))
        self._mixer_handles = attach_mixers(blocks, {int(i): block for i, block in self.mixers.items()},
                                            lambda: self._hooks.call, lambda: self.context.enabled)
        signed = _signed_forward(self)
        if signed is not None:
            self.forward = signed
        self._look_up_kernels()

    @staticmethod
    def _make_mixers(base_model: nn.Module, blocks: nn.ModuleList, config: HierarchicalBEMConfig) -> nn.ModuleDict:
        """One mixer block after each chosen decoder block (none without `config.mixer`), in the base's dtype."""
        if config.mixer is None:
            return nn.ModuleDict()
        reference = next(p for p in base_model.parameters() if p.is_floating_point())
        hidden = _hidden_size(base_model)
        return nn.ModuleDict({
            str(index): MixerBlock(hidden, config, index).to(device=reference.device, dtype=reference.dtype)
            for index in resolve_layers(config.mixer_layers, len(blocks))
        }).train(base_model.training)

    def _look_up_kernels(self) -> None:
        """On a CUDA model, look up (maybe build) the kernels now: done inside a first call that torch.compile
        traces, the lookup would break the graph."""
        if self.bem_config.use_fused_kernels:
            weight = self.bem_modules()[0][1].base_layer.weight
            if weight.is_cuda:
                from .kernels import ops

                ops.kernels_available()

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> "BEMModel":
        if self._pack is not None and self._pack.joint_weights is not None:
            self._pack.joint_weights.release()  # the weights move out of their joint buffers: hold none back
        moved = super()._apply(fn, *args, **kwargs)
        self._look_up_kernels()  # `.to("cuda")`, `.cuda()` reach here
        return moved

    # ------------------------------------------------------------------ calling
    def forward(self, *args: Any, side_signals: Optional[torch.Tensor] = None, labels: Any = None,
                **kwargs: Any) -> Any:
        """The base model's forward with BEM active; `side_signals` (batch, side_signal_dim) if configured.
        `labels` is named here (and passed on when given) because transformers' Trainer finds a model's
        label names in its class's forward signature."""
        if labels is not None:
            kwargs["labels"] = labels
        self._hooks.pending_side_signals = side_signals
        try:
            return self.base_model(*args, **kwargs)
        finally:
            self._hooks.pending_side_signals = None

    def generate(self, *args: Any, side_signals: Optional[torch.Tensor] = None, **kwargs: Any) -> Any:
        """`base_model.generate` with BEM active; BEM's state rides along with the KV cache. Every cache
        implementation works (dynamic, static, and generate's compiled decoding of static caches)."""
        self._hooks.pending_side_signals = side_signals
        self._hooks.side_signals_follow_expansion = True  # generate repeats rows for beams and samples
        self.context.pack = self._adapter_pack() if self.context.enabled else None
        try:
            with capture_generate_masks(self.base_model, self._hooks.generate_masks):
                return self.base_model.generate(*args, **kwargs)
        finally:
            self._hooks.pending_side_signals = None
            self._hooks.side_signals_follow_expansion = False
            self.context.pack, self.context.weights = None, None

    def _adapter_pack(self) -> Optional[AdapterPack]:
        """The adapters in one buffer, up to date, for generate's compiled decoding step; None where they are not
        plain tensors of one dtype and device."""
        wanted = (self.joint_weights, self.joint_groups)
        if self._pack is None or self._pack_form != wanted:
            if self._pack is not None and self._pack.joint_weights is not None:
                self._pack.joint_weights.unjoin()  # the new form re-homes the weights its own way
            self._pack = AdapterPack([module for _, module in self.bem_modules()], joint=self.joint_weights,
                                     groups=input_groups(self.bem_module_names, self.joint_groups))
            self._pack_form = wanted
        return self._pack if self._pack.refresh() else None

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "base_model":
                raise
            return getattr(self.base_model, name)

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs: Optional[dict] = None,
                                        **kwargs: Any) -> None:
        """Checkpoint the base model's blocks. Only the non-reentrant variant keeps the controller's
        gradients: its codes feed every block, so a reentrant recompute would cut them off."""
        options = dict(activation_checkpointing_kwargs or {})
        if options.get("use_reentrant", False):
            raise ValueError(
                "BEM needs non-reentrant activation checkpointing (use_reentrant=False): with use_reentrant=True "
                "the routing controller would receive no gradient"
            )
        options["use_reentrant"] = False
        enable = getattr(self.base_model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs=options, **kwargs)
        else:  # transformers releases before the rename
            self.base_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options, **kwargs)

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: Optional[dict] = None, **kwargs: Any) -> None:
        """`activation_checkpointing_enable` under its older transformers name."""
        self.activation_checkpointing_enable(gradient_checkpointing_kwargs, **kwargs)

    @contextlib.contextmanager
    def disable_bem(self) -> Iterator[None]:
        """Run the exact base model inside the block (no controller, no update)."""
        previous = self.context.enabled
        self.context.enabled = False
        try:
            yield
        finally:
            self.context.enabled = previous

    disable_adapter = disable_bem  # PEFT's name

    def get_base_model(self) -> nn.Module:
        """The wrapped model (its linears carry the BEM modules), as PEFT's `get_base_model`."""
        return self.base_model

    # ------------------------------------------------------------------ parameters
    def bem_modules(self) -> list[tuple[str, BEMLinear]]:
        return [(name, self.base_model.get_submodule(name)) for name in self.bem_module_names]

    def saved_modules(self) -> list[tuple[str, TrainableCopy]]:
        return [(name, self.base_model.get_submodule(name)) for name in self.saved_module_names]

    def adapter_parameters(self) -> list[nn.Parameter]:
        """What trains: every module's V and U, the controller's, the mixers' and the saved modules' copies'
        parameters."""
        params = [p for _, m in self.bem_modules() for p in (m.bem_V, m.bem_U)]
        params += [] if self.controller is None else list(self.controller.parameters())
        params += list(self.mixers.parameters())
        return params + [p for _, m in self.saved_modules() for p in m.trained.parameters()]

    def bem_state_dict(self) -> dict[str, torch.Tensor]:
        """Adapter weights only: `modules.<name>.V|U`, `controller.<param>`, `mixers.<block>.<param>` and
        `saved.<name>.<param>`."""
        state: dict[str, torch.Tensor] = {}
        for name, module in self.bem_modules():
            state[f"modules.{name}.V"] = module.bem_V.detach()
            state[f"modules.{name}.U"] = module.bem_U.detach()
        if self.controller is not None:
            for key, value in self.controller.state_dict().items():
                state[f"controller.{key}"] = value.detach()
        for key, value in self.mixers.state_dict().items():
            state[f"mixers.{key}"] = value.detach()
        for name, module in self.saved_modules():
            for key, value in module.trained.state_dict().items():
                state[f"saved.{name}.{key}"] = value.detach()
        return state

    def load_bem_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load adapter weights, checking every name and shape first; nothing is changed on error."""
        expected = self.bem_state_dict()
        missing = sorted(set(expected) - set(state))
        unexpected = sorted(set(state) - set(expected))
        if missing or unexpected:
            raise ValueError(
                f"adapter weights do not fit this model: missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
            )
        for key, value in state.items():
            if tuple(value.shape) != tuple(expected[key].shape):
                module = key.rsplit(".", 1)[0]
                raise ValueError(
                    f"adapter weight '{key}' has shape {tuple(value.shape)} but module '{module}' of this base "
                    f"model needs {tuple(expected[key].shape)}; was the adapter trained on another base model?"
                )
        with torch.no_grad():
            for name, module in self.bem_modules():
                module.bem_V.copy_(state[f"modules.{name}.V"])
                module.bem_U.copy_(state[f"modules.{name}.U"])
            if self.controller is not None:
                self.controller.load_state_dict(
                    {k[len("controller."):]: v for k, v in state.items() if k.startswith("controller.")}
                )
            if len(self.mixers):
                self.mixers.load_state_dict({k[len("mixers."):]: v for k, v in state.items() if k.startswith("mixers.")})
            for name, module in self.saved_modules():
                prefix = f"saved.{name}."
                module.trained.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})

    def get_nb_trainable_parameters(self) -> tuple[int, int]:
        trainable = sum(p.numel() for p in self.parameters() if p.requires_grad)
        total = sum(p.numel() for p in self.parameters())
        return trainable, total

    def print_trainable_parameters(self) -> None:
        trainable, total = self.get_nb_trainable_parameters()
        mixers = sum(p.numel() for p in self.mixers.parameters() if p.requires_grad)
        split = f" (of which mixers: {mixers:,d})" if len(self.mixers) else ""
        print(f"trainable params: {trainable:,d}{split} || all params: {total:,d} || "
              f"trainable%: {100 * trainable / max(total, 1):.4f}")

    # ------------------------------------------------------------------ diagnostics
    def routing_stats(self) -> dict[str, Any]:
        """Statistics of the last forward's codes: per module norms and level contributions, gate mean."""
        return routing_stats(self)

    # ------------------------------------------------------------------ persistence
    def save_pretrained(self, save_directory: Union[str, Path], **_: Any) -> None:
        save_adapter(self, Path(save_directory))

    @classmethod
    def from_pretrained(cls, base_model: nn.Module, adapter_directory: Union[str, Path],
                        is_trainable: bool = False, **config_overrides: Any) -> "BEMModel":
        config, state = read_adapter(base_model, Path(adapter_directory), **config_overrides)
        model = create_hierarchical_bem(base_model, config)
        apply_adapter(model, state, is_trainable)
        return model

    @classmethod
    def from_peft_lora(cls, base_model: nn.Module, lora_directory: Union[str, Path],
                       enable_routing: bool = True, **config_overrides: Any) -> "BEMModel":
        """A BEM whose update equals a saved PEFT LoRA adapter's (A -> V^T, B -> U), routing neutral."""
        adapter = read_peft_lora(Path(lora_directory), enable_routing=enable_routing, **config_overrides)
        model = create_hierarchical_bem(base_model, adapter.config)
        apply_peft_lora(model, adapter)
        return model

    def save_as_peft_lora(self, save_directory: Union[str, Path]) -> None:
        """Write a PEFT LoRA adapter (routing must be off) that `PeftModel.from_pretrained` loads."""
        save_as_peft_lora(self, Path(save_directory))

    def merge_and_unload(self) -> nn.Module:
        """Fold each module's update into its frozen weight (W += s U V^T), put the saved modules' trained
        copies in place of their originals, and give back the bare base model, as PEFT's
        `merge_and_unload`. Only a BEM with routing off has an update that does not depend on the context."""
        if len(self.mixers):
            raise ValueError(
                f"this BEM has {self.bem_config.mixer} mixer blocks, which are layers of their own, not updates of "
                f"a weight: they cannot be merged (unload() removes BEM, mixers included, without merging)"
            )
        if self.controller is not None:
            raise ValueError(
                "this BEM routes its codes per token, so its update depends on the context and cannot be folded "
                "into the weights; only a BEM with enable_routing=False can be merged (unload() removes BEM "
                "without merging)"
            )
        modules = [module for _, module in self.bem_modules()]
        for module in modules:  # all checked before any weight changes
            module.check_mergeable()
        for module in modules:
            module.merge_into_base()
        return self._remove_bem(keep_trained_copies=True)

    def unload(self) -> nn.Module:
        """Remove every BEM module, mixer and hook and give back the bare base model (saved modules' originals)."""
        return self._remove_bem(keep_trained_copies=False)

    def _remove_bem(self, keep_trained_copies: bool) -> nn.Module:
        self._hooks.remove()
        if self._pack is not None and self._pack.joint_weights is not None:
            self._pack.joint_weights.unjoin()  # each weight back in a storage of its own size
            self._pack = None
        for handle in self._mixer_handles:
            handle.remove()
        self._mixer_handles = []
        for name, module in self.bem_modules():
            _replace(self.base_model, name, module.base_layer)
        for name, saved in self.saved_modules():
            _replace(self.base_model, name, saved.trained if keep_trained_copies else saved.original)
        return self.base_model


def create_hierarchical_bem(model: nn.Module, config: Optional[HierarchicalBEMConfig] = None) -> BEMModel:
    """Wrap `model` in place with BEM modules; the base weights are frozen, BEM's are trainable."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"create_hierarchical_bem expects a torch nn.Module, got {type(model).__name__}")
    if isinstance(model, BEMModel):
        raise ValueError("this model is already wrapped with BEM")
    if any(isinstance(m, BEMLinear) for m in model.modules()):
        raise ValueError("this model already contains BEM modules")
    peft_layers = sorted({type(m).__name__ for m in model.modules() if type(m).__module__.startswith("peft.")})
    if peft_layers:
        # BEM would wrap the linears PEFT left alone and skip the ones it adapted: two adapters, half each
        raise ValueError(f"this model holds PEFT modules ({', '.join(peft_layers[:4])}); wrap the base model itself "
                         f"(PEFT's get_base_model() after unload(), or merge_and_unload() to keep a LoRA's update)")
    config = config or HierarchicalBEMConfig()
    if not isinstance(config, HierarchicalBEMConfig):
        raise TypeError(f"config must be a HierarchicalBEMConfig, got {type(config).__name__}")
    if config.base_model_name_or_path is None:
        name = getattr(getattr(model, "config", None), "_name_or_path", None)
        if name:
            config.base_model_name_or_path = str(name)
    return BEMModel(model, config)


__all__ = ["BEMModel", "create_hierarchical_bem"]
