"""DFlash2's local convolutions: a grouped dynamic causal convolution before and after every
attention and MLP sublayer of the block backbone (speculators 0.9.0, models/dflash2/
model_definitions.py GroupedDynamicCausalConv; vLLM's qwen3_dflash2.py DFlashGroupedConv).

    taps       y_s = sum_{k < K} x_{s-k} * (base_kernel[k] + delta_k(x_s))   per channel group
    delta      kernel_projection(x_s): H -> 2 K (H / G), one set for the input side, one for the output
    blocks     a tap never crosses a block border: slot s of a block reads only slots s-k >= 0
    init       base_kernel[:, 0] = 1, the rest and the projection 0: the identity, so a fresh DFlash2
               computes exactly what DFlash does

The names are speculators' (base_kernel, kernel_projection.weight), so its file is a plain save.
Rows hold whole blocks one after another (the backbone's (B, A * S, H) layout): the slot of
position n is n % block_size, the same rule speculators applies to its flattened batch."""

from __future__ import annotations

from typing import Tuple

import torch
from torch import nn


def grouped_dynamic_conv(
    x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block_size: int, group_size: int
) -> torch.Tensor:
    """x (..., N, H), N a multiple of block_size; delta (..., N, K, H / G); base (K, H) -> (..., N, H).
    A loop over the K taps (static, small): no per-row work, no host read."""
    *lead, N, H = x.shape
    K, groups = base.shape[0], H // group_size
    slot = torch.arange(N, device=x.device).remainder(block_size)  # position inside its block
    grouped = x.reshape(*lead, N, groups, group_size)
    out = torch.zeros_like(grouped)
    for tap in range(K):
        shifted = (
            grouped
            if tap == 0
            else torch.cat([grouped.new_zeros(*lead, tap, groups, group_size), grouped[..., :-tap, :, :]], dim=-3)
        )
        coefficient = base[tap].to(x.dtype).view(groups, group_size) + delta[..., tap, :, None].to(x.dtype)
        valid = (slot >= tap).to(x.dtype).view(N, 1, 1)
        out = out + shifted * coefficient * valid
    return out.reshape(*lead, N, H)


class GroupedDynamicCausalConv(nn.Module):
    """The two convolutions around one sublayer: prepare() on its input, finish() on its output."""

    def __init__(self, hidden_size: int, block_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.block_size, self.kernel_size, self.group_size = block_size, kernel_size, group_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The identity (speculators' reset_parameters): DFlash exactly, until trained."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0].fill_(1.0)
            self.kernel_projection.weight.zero_()

    def prepare(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """The sublayer's input convolved, and the output side's kernel (from the same input)."""
        kernels = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, self.groups)
        convolved = grouped_dynamic_conv(
            x, kernels[..., 0, :, :], self.base_kernel[0], self.block_size, self.group_size
        )
        return convolved, kernels[..., 1, :, :]

    def finish(self, y: torch.Tensor, kernel: torch.Tensor) -> torch.Tensor:
        return grouped_dynamic_conv(y, kernel, self.base_kernel[1], self.block_size, self.group_size)
