"""LoRA adapters (PEFT's format), served beside the base model by both engines.

An adapter is a directory as PEFT saves it: ``adapter_config.json`` (``peft_type``
``LORA``, ``r``, ``lora_alpha``, ``use_rslora``...) and ``adapter_model.safetensors``
with ``<prefix>.<module path>.lora_A.weight`` ([r, in]) and ``lora_B.weight`` ([out, r])
for each adapted linear layer. A layer's output becomes ``W x + s * B (A x)`` with ``s =
lora_alpha / r`` (``/ sqrt(r)`` under rsLoRA), what PEFT and vLLM compute.

:func:`read_adapter` checks an adapter against what both engines apply (no torch here:
the config validates adapters with it); :func:`load_weights` gives the torch engine its
tensors. vLLM loads adapters itself (``LoRARequest``); the torch engine's native model
applies them per row of a batch (``llama.Linear``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

# The linear layers of a Llama decoder layer an adapter may adapt (vLLM's packed
# qkv_proj / gate_up_proj take the same per-projection weights).
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# vLLM's MaxLoRARanks (vllm.config.lora): max_lora_rank must be one of them.
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# An adapter's name is what a client sends as ``model``.
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-/]{0,127}$")

_KEY_RE = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>model\.layers\.(?P<layer>\d+)\.(?:self_attn|mlp)\.(?P<proj>[a-z_]+))"
    r"\.lora_(?P<ab>[AB])(?:\.[A-Za-z0-9_]+)?\.weight$"
)


@dataclass(frozen=True)
class AdapterInfo:
    name: str
    path: str
    rank: int
    alpha: float
    rslora: bool

    @property
    def scaling(self) -> float:
        return self.alpha / (self.rank**0.5 if self.rslora else self.rank)


def _read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"no {path.name} in {path.parent}") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} cannot be read: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a JSON object")
    return data


def read_adapter(name: str, path: str | Path) -> AdapterInfo:
    """The adapter at ``path`` as both engines apply it; a ValueError that names what is
    not supported (DoRA, extra trained modules, per-layer ranks, biases...)."""
    if not NAME_RE.match(name):
        raise ValueError(f"LoRA adapter name {name!r}: letters, digits and _ . - / only, at most 128")
    path = Path(path).expanduser().resolve()
    if not path.is_dir():
        raise ValueError(f"LoRA adapter {name!r}: {path} is not a directory")
    cfg = _read_json(path / "adapter_config.json")
    where = f"LoRA adapter {name!r} ({path})"
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise ValueError(f"{where}: peft_type {cfg.get('peft_type')!r} is not LORA")
    for key, neutral in (("use_dora", False), ("fan_in_fan_out", False), ("modules_to_save", None),
                         ("layers_to_transform", None), ("rank_pattern", {}), ("alpha_pattern", {})):
        value = cfg.get(key, neutral)
        if value not in (neutral, None, {}, [], False):
            raise ValueError(f"{where}: {key}={value!r} is not supported")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"{where}: bias={cfg.get('bias')!r} is not supported (only 'none')")
    try:
        rank, alpha = int(cfg["r"]), float(cfg.get("lora_alpha", cfg["r"]))
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"{where}: adapter_config.json has no integer 'r'") from None
    if not 1 <= rank <= VLLM_MAX_LORA_RANKS[-1]:
        raise ValueError(f"{where}: rank {rank} is outside 1..{VLLM_MAX_LORA_RANKS[-1]}")
    if not (path / "adapter_model.safetensors").exists():
        raise ValueError(f"{where}: no adapter_model.safetensors (only safetensors weights are read)")
    return AdapterInfo(name=name, path=str(path), rank=rank, alpha=alpha, rslora=bool(cfg.get("use_rslora", False)))


def vllm_max_lora_rank(adapters: list[AdapterInfo]) -> int:
    """The smallest of vLLM's allowed ``max_lora_rank`` values that fits every adapter."""
    most = max((a.rank for a in adapters), default=1)
    return next(r for r in VLLM_MAX_LORA_RANKS if r >= most)


def load_weights(info: AdapterInfo, num_layers: int, shapes: dict[str, tuple[int, int]]) -> dict[str, Any]:
    """``{module path: (A [r, in], B [out, r] times the scaling)}`` of the adapter, each
    checked against the base model: a layer in range, a projection of
    :data:`TARGET_MODULES` and the shapes ``shapes[proj]`` = (in, out)."""
    from safetensors.torch import load_file

    where = f"LoRA adapter {info.name!r} ({info.path})"
    found: dict[str, dict[str, Any]] = {}
    for key, tensor in load_file(str(Path(info.path) / "adapter_model.safetensors")).items():
        m = _KEY_RE.match(key)
        if m is None or m["proj"] not in TARGET_MODULES:
            raise ValueError(f"{where}: weight {key!r} is not a LoRA weight of a supported layer "
                             f"({', '.join(TARGET_MODULES)})")
        if int(m["layer"]) >= num_layers:
            raise ValueError(f"{where}: {key!r} names layer {m['layer']}, the model has {num_layers}")
        found.setdefault(m["module"], {})[m["ab"]] = tensor
    weights = {}
    for module, pair in found.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"{where}: {module} has lora_{''.join(pair)} without its pair")
        a, b = pair["A"].float(), pair["B"].float()
        fan_in, fan_out = shapes[module.rsplit(".", 1)[1]]
        if tuple(a.shape) != (info.rank, fan_in) or tuple(b.shape) != (fan_out, info.rank):
            raise ValueError(
                f"{where}: {module} has A {tuple(a.shape)} and B {tuple(b.shape)}; rank {info.rank} "
                f"on this model needs ({info.rank}, {fan_in}) and ({fan_out}, {info.rank})"
            )
        weights[module] = (a, b * info.scaling)
    if not weights:
        raise ValueError(f"{where}: no LoRA weights in adapter_model.safetensors")
    return weights


def adapter_of(model: str, base_id: str, names) -> Optional[str]:
    """The adapter a request's ``model`` names: an adapter's own name (vLLM's form), or
    ``<base id>:<adapter>`` (Ray Serve LLM's form); None for the base model; KeyError for
    neither."""
    if model == base_id:
        return None
    if model in names:
        return model
    prefix = base_id + ":"
    if model.startswith(prefix) and model[len(prefix):] in names:
        return model[len(prefix):]
    raise KeyError(model)
