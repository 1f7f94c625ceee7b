"""An exponential moving average of a model's weights (Polyak averaging; timm's ModelEmaV2 is the common form).

After every optimiser step: average = decay x average + (1 - decay) x weights, for parameters and floating-point
buffers alike (others are copied), starting from a copy of the weights. The blend is torch's own EMA update
(torch.optim.swa_utils.get_ema_multi_avg_fn, one fused lerp over all tensors); AveragedModel around it is not used,
as its update reads its step counter back from the device every step, and the loop must not wait on the device.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.optim.swa_utils import get_ema_multi_avg_fn


class WeightAverage:
    """A copy of `module` on `device` that follows its weights as an EMA. `module` (this copy) is what the
    evaluators score and what a run exports; state_dict/load_state_dict make it a checkpointed object."""

    def __init__(self, module: nn.Module, decay: float, device: torch.device | str | None = None):
        self.decay = decay
        self.module = copy.deepcopy(module).to(device).requires_grad_(False)
        self.blend = get_ema_multi_avg_fn(decay)

    @torch.no_grad()
    def update(self, module: nn.Module) -> None:
        """Blend `module`'s current weights (the same architecture as the copy) into the average."""
        averaged, current = [], []
        for mine, theirs in zip([*self.module.parameters(), *self.module.buffers()], [*module.parameters(), *module.buffers()], strict=True):
            if mine.is_floating_point():
                averaged.append(mine)
                current.append(theirs.detach())
            else:
                mine.copy_(theirs)
        if averaged:
            self.blend(averaged, current, None)

    def state_dict(self) -> dict:
        return self.module.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state)
