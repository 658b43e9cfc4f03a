"""A LoRA adapter's format: PEFT's directory (`adapter_config.json`, `adapter_model.safetensors`, low-rank pairs for
some of each layer's q/k/v/o and gate/up/down projections), and its checks against what a model's workers take.

The API checks an adapter before it is known and a worker reads it with the same names and shapes, so a load that
passes here serves everywhere its files are. Plain Python: the engine, which runs without the service's packages,
takes its `LoraSpec` from here.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from chatq.core.errors import BadRequest

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# A PEFT tensor's name: base_model.model.model.layers.{layer}.{self_attn|mlp}.{module}.lora_{A|B}.weight
_TENSOR = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# A safetensors header over this is no adapter's: it is refused before it is read.
_MAX_HEADER = 64 * 1024 * 1024


@dataclass(frozen=True)
class LoraSpec:
    """What a model's workers take as adapters: ranks up to `max_rank`, `max_loras` at once, on `layers` layers whose
    projections have these (in, out) features."""

    max_rank: int
    max_loras: int
    layers: int
    shapes: dict[str, tuple[int, int]]


def spec_of(config: dict, max_rank: int, max_loras: int) -> LoraSpec:
    """The spec of a Llama-style model from its config.json: the attention's projections, and the MLP's where it is
    gated (SwiGLU), which the forward pass runs with adapters."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = (config.get("num_key_value_heads") or heads) * head_dim
    shapes = {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv), "v_proj": (hidden, kv)}
    shapes["o_proj"] = (heads * head_dim, hidden)
    if config.get("hidden_act") == "silu":
        inter = config["intermediate_size"]
        shapes |= {"gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    return LoraSpec(max_rank=max_rank, max_loras=max_loras, layers=config["num_hidden_layers"], shapes=shapes)


@dataclass(frozen=True)
class LoraConfig:
    """The fields of adapter_config.json the weights are read with."""

    rank: int
    scaling: float  # lora_alpha / rank, or / sqrt(rank) with rsLoRA


class AdapterInvalid(BadRequest):
    def __init__(self, path: str, why: str):
        super().__init__(f"The LoRA adapter at '{path}' cannot be loaded: {why}.", "lora_path")


def tensor_of(name: str) -> tuple[int, str, str] | None:
    """(layer, module, "A" or "B") of a PEFT tensor name; None for a tensor that is no layer's LoRA pair."""
    m = _TENSOR.search(name)
    return (int(m[1]), m[2], m[3]) if m else None


def read_config(path: str) -> LoraConfig:
    """The adapter's rank and scaling; AdapterInvalid for a config chatq cannot serve as it was trained."""
    try:
        config = json.loads((Path(path) / CONFIG).read_text())
    except (OSError, ValueError) as e:
        raise AdapterInvalid(path, f"its {CONFIG} cannot be read ({type(e).__name__})") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise AdapterInvalid(path, "it is not a LoRA adapter")
    unsupported = [
        k for k in ("use_dora", "fan_in_fan_out", "rank_pattern", "alpha_pattern", "modules_to_save") if config.get(k)
    ]
    if config.get("bias", "none") != "none":
        unsupported.append("bias")
    if unsupported:
        raise AdapterInvalid(path, f"{', '.join(unsupported)} in its {CONFIG} are not supported")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, int | float):
        raise AdapterInvalid(path, f"its {CONFIG} has no valid `r` and `lora_alpha`")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return LoraConfig(rank, float(scaling))


def read_shapes(path: str) -> dict[str, list[int]]:
    """Each tensor's shape, from the safetensors header. Read by hand, as the format lays it out (an 8-byte length,
    then JSON): the API has neither torch nor numpy, which safetensors' readers load tensors into."""
    try:
        with open(Path(path) / WEIGHTS, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 0 < size <= _MAX_HEADER:
                raise ValueError("header size")
            header = json.loads(f.read(size))
        return {k: list(v["shape"]) for k, v in header.items() if k != "__metadata__"}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise AdapterInvalid(path, f"its {WEIGHTS} cannot be read ({type(e).__name__})") from None


def check(path: str, spec: LoraSpec | None, model: str) -> LoraConfig:
    """The adapter's config, once its files fit `model`'s layers (`spec`) and ranks; AdapterInvalid if not."""
    if spec is None:
        raise AdapterInvalid(path, f"the workers of {model} serve no adapters")
    config = read_config(path)
    if config.rank > spec.max_rank:
        raise AdapterInvalid(path, f"its rank {config.rank} is above the workers' CHATQ_MAX_LORA_RANK {spec.max_rank}")
    shapes = read_shapes(path)
    if not shapes:
        raise AdapterInvalid(path, "it holds no tensors")
    for name, shape in shapes.items():
        if (why := _misfit(name, shape, config.rank, spec)) is not None:
            raise AdapterInvalid(path, f"{name}: {why}; the adapter is not one of {model}")
    return config


def _misfit(name: str, shape: list[int], rank: int, spec: LoraSpec) -> str | None:
    """Why one tensor does not fit the model, if it does not."""
    found = tensor_of(name)
    if found is None:
        return "not a LoRA pair of a decoder layer's projection"
    layer, module, half = found
    if module not in spec.shapes:
        return f"{module} takes no adapter here (only {', '.join(spec.shapes)})"
    if layer >= spec.layers:
        return f"layer {layer} is beyond the model's {spec.layers}"
    features_in, features_out = spec.shapes[module]
    want = [rank, features_in] if half == "A" else [features_out, rank]
    return None if shape == want else f"shape {shape}, where the model takes {want}"
