"""The frozen target: loaded once with transformers, never trained, run under no_grad."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from specdraft.errors import SpecdraftError
from specdraft.target.checks import (
    check_tokenizer,
    load_target_config,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
AUTO_DTYPE = "auto"  # the checkpoint's own torch_dtype (config.json)


def load_target_tokenizer(model_dir):
    """The target's tokenizer; a directory without one is one line, not a transformers traceback."""
    from transformers import AutoTokenizer

    check_tokenizer(model_dir, "target")
    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError) as err:
        raise SpecdraftError(
            f"target: the tokenizer in {model_dir} does not load ({str(err).splitlines()[0]})"
        ) from None


def load_frozen_target(target_dir: str, precision: str = "fp32", device: Optional[torch.device] = None) -> nn.Module:
    """AutoModelForCausalLM from a local directory, every parameter requires_grad=False.

    precision: fp32 / bf16 / fp16, or "auto" for the checkpoint's own dtype. device None: left on
    the CPU (a training engine moves it).
    """
    load_target_config(target_dir)
    if precision != AUTO_DTYPE and precision not in DTYPES:
        raise SpecdraftError(f"dtype {precision!r}: choose one of {AUTO_DTYPE}, {', '.join(DTYPES)}")
    model = AutoModelForCausalLM.from_pretrained(
        target_dir, dtype=AUTO_DTYPE if precision == AUTO_DTYPE else DTYPES[precision]
    )
    if device is not None:
        model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model


def hold_weights_as_buffers(module: nn.Module) -> None:
    """Turn every (frozen) parameter of `module` into a non-persistent buffer of the same name.

    ZeRO-3 partitions the parameters of the module it wraps and gathers them again on every
    micro-batch; buffers it leaves whole on every rank. A frozen target held this way is
    replicated outside the partition: no gather per layer, at the cost of its full size on
    every device. The modules compute exactly as before (a buffer is read as `self.weight` too);
    the state dict never held the target (frozen parameters are excluded from checkpoints).
    """
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is not None:
                del sub._parameters[name]
                sub.register_buffer(name, param.detach(), persistent=False)
