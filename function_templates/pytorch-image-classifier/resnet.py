"""A ResNet-18-style image classifier in plain torch, with torchvision's parameter names.

`ResNet(layers=(2, 2, 2, 2), width=64)` is torchvision's `resnet18` layer for layer: the same
modules under the same names (`conv1`, `bn1`, `layer1.0.conv1`, `layer2.0.downsample.0`, `fc`, ...),
so a state dict saved from `torchvision.models.resnet18()` loads into it and the other way round.
Other `layers` / `width` values give smaller or larger networks of the same family.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ResNetConfig:
    """The shape of the network: `layers[i]` BasicBlocks in stage i, whose width is `width * 2**i`."""

    layers: tuple[int, ...] = (2, 2, 2, 2)
    width: int = 64
    num_classes: int = 1000

    def __post_init__(self) -> None:
        if not self.layers or any(n < 1 for n in self.layers):
            raise ValueError(f"layers must be one or more positive block counts, got {self.layers}")
        if self.width < 1 or self.num_classes < 1:
            raise ValueError(f"width and num_classes must be positive, got {self.width} and {self.num_classes}")

    @property
    def is_resnet18(self) -> bool:
        return self.layers == (2, 2, 2, 2) and self.width == 64


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection (a 1x1 projection when the shape changes)."""

    expansion = 1

    def __init__(self, in_channels: int, channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(channels, channels, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.downsample: nn.Module | None = None
        if stride != 1 or in_channels != channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, channels, 1, stride=stride, bias=False), nn.BatchNorm2d(channels)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """Stem (7x7 conv, max-pool), one stage of BasicBlocks per entry of `config.layers`, global
    average pooling and a linear classifier: N x 3 x H x W images in, N x num_classes logits out."""

    def __init__(self, config: ResNetConfig) -> None:
        super().__init__()
        self.config = config
        width = config.width
        self.conv1 = nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        in_channels = width
        for stage, num_blocks in enumerate(config.layers):
            channels = width * 2**stage
            blocks = [BasicBlock(in_channels, channels, stride=1 if stage == 0 else 2)]
            blocks += [BasicBlock(channels, channels) for _ in range(num_blocks - 1)]
            self.add_module(f"layer{stage + 1}", nn.Sequential(*blocks))
            in_channels = channels
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_channels, config.num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        for stage in range(len(self.config.layers)):
            x = getattr(self, f"layer{stage + 1}")(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))


def build_model(config: ResNetConfig, *, use_torchvision: bool = True) -> tuple[nn.Module, str]:
    """The network for `config` and the name of its implementation: torchvision's `resnet18` when
    torchvision is installed and `config` is ResNet-18's shape, else this module's `ResNet` (the
    same parameter names either way, so the same weights file loads into both)."""
    if use_torchvision and config.is_resnet18:
        try:
            from torchvision.models import resnet18
        except ImportError:
            pass
        else:
            return resnet18(weights=None, num_classes=config.num_classes), "torchvision.models.resnet18"
    return ResNet(config), "resnet.ResNet"


_BLOCK_KEY = re.compile(r"^layer(\d+)\.(\d+)\.")


def config_from_state_dict(state: Mapping[str, torch.Tensor]) -> ResNetConfig:
    """The `ResNetConfig` a state dict was saved from, read off its tensor names and shapes.
    ValueError naming what is missing when it is not a ResNet-with-BasicBlocks state dict."""
    for key in ("conv1.weight", "fc.weight"):
        if key not in state:
            raise ValueError(f"not a ResNet state dict: no {key!r} (found {len(state)} tensors)")
    blocks: dict[int, set[int]] = {}
    for key in state:
        match = _BLOCK_KEY.match(key)
        if match:
            blocks.setdefault(int(match[1]), set()).add(int(match[2]))
    stages = sorted(blocks)
    if stages != list(range(1, len(stages) + 1)) or not stages:
        raise ValueError(f"not a ResNet state dict: expected stages layer1..layerN, found {stages}")
    if any(key.endswith("conv3.weight") for key in state):
        raise ValueError("Bottleneck ResNets (ResNet-50 and up) are not supported by this template's resnet.py")
    return ResNetConfig(
        layers=tuple(len(blocks[stage]) for stage in stages),
        width=state["conv1.weight"].shape[0],
        num_classes=state["fc.weight"].shape[0],
    )


def random_state_dict(config: ResNetConfig, seed: int) -> dict[str, torch.Tensor]:
    """Freshly initialised weights for `config`, a pure function of (config, seed): torchvision's
    initialisation (Kaiming-normal convolutions, unit BatchNorm, uniform classifier), drawn in
    module order from one seeded generator."""
    generator = torch.Generator().manual_seed(seed)
    model = ResNet(config)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu", generator=generator)
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Linear):
                bound = 1 / math.sqrt(module.in_features)
                nn.init.uniform_(module.weight, -bound, bound, generator=generator)
                nn.init.uniform_(module.bias, -bound, bound, generator=generator)
    return {name: tensor.contiguous() for name, tensor in model.state_dict().items()}


def parse_layers(text: str | Sequence[int]) -> tuple[int, ...]:
    """Block counts from "2,2,2,2" (or from a sequence of ints)."""
    if isinstance(text, str):
        return tuple(int(part) for part in text.split(",") if part.strip())
    return tuple(int(n) for n in text)
