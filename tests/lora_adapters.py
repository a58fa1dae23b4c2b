"""LoRA adapters made in the tests with PEFT (the reference), and PEFT's own outputs."""

from __future__ import annotations

from pathlib import Path

import torch

ATTENTION = ["q_proj", "v_proj"]
ALL_SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base: str, folder: Path, targets: list[str], r: int = 8, alpha: float = 16, seed: int = 0,
                 std: float = 0.3, **config) -> str:
    """A PEFT LoRA adapter of ``base`` saved into ``folder``, its A and B drawn at
    random (``std``) so that its outputs differ visibly from the base model's."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    folder = Path(folder)
    if (folder / "adapter_config.json").exists():
        return str(folder)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, **config))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    peft.save_pretrained(folder)
    return str(folder)


def peft_model(base: str, adapter: str | None):
    """transformers' model of ``base`` with PEFT's ``adapter`` on it (None: the base):
    PEFT's LoRA layers injected into the model, which is returned itself (its own
    ``generate`` and generation config, the adapter active)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    return model if adapter is None else PeftModel.from_pretrained(model, adapter).eval().get_base_model()
