"""Tiny convolutional models for the end-to-end tests: a CNN with batch norm, a stack of
residual conv + batch norm blocks, and a ViT-style patch embedding."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


class TinyCNN(nn.Module):
    """conv -> batch norm -> relu -> max pool (with indices) -> grouped conv -> relu ->
    1x1 conv down to fewer channels -> adaptive average pool -> linear (the last three are
    linear: a Partial sum from a split contraction may flow through them). The first conv has no bias, as
    in ResNets: batch norm subtracts the mean right after, so a bias there would have a
    zero gradient up to rounding, which Adam blows up into updates that differ with any
    summation order."""

    def __init__(self, channels: int = 8, classes: int = 4) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)
        self.pool = nn.MaxPool2d(2, return_indices=True)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, groups=2)
        self.conv3 = nn.Conv2d(channels, channels // 2, 1)
        self.head = nn.Linear(channels // 2, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, _ = self.pool(F.relu(self.bn(self.conv1(x))))
        x = self.conv3(F.relu(self.conv2(x)))
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


class ConvBlock(nn.Module):
    """A residual conv -> batch norm -> relu block (its conv without bias, as in ResNets)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.relu(self.bn(self.conv(x)))


class BlocksCNN(nn.Module):
    """A conv stem, repeated ``ConvBlock``s (``blocks.i``: what checkpointing recomputes) and a
    linear head. (Not ``momentum=None``: its factor ``1 / num_batches_tracked`` is a Python
    float of a tensor, which torch.export cannot capture.)"""

    def __init__(self, channels: int = 4, classes: int = 3) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1, bias=False)
        self.blocks = nn.ModuleList(ConvBlock(channels) for _ in range(2))
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean((2, 3)))


class PatchEmbedClassifier(nn.Module):
    """A ViT's patch embedding (Conv2d with stride = kernel), tokens flattened, a layer
    norm, mean over tokens and a linear head (no transformer blocks)."""

    def __init__(self, patch: int = 4, dim: int = 16, classes: int = 4) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, dim, patch, stride=patch)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.proj(x).flatten(2).transpose(1, 2)
        return self.head(self.norm(tokens).mean(1))


def _images(batch: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return torch.randn(batch, 3, size, size, generator=gen), torch.randint(0, 4, (batch,), generator=gen)


def build_cnn() -> tuple[nn.Module, tuple[Any, ...], Any, tuple[Any, ...]]:
    torch.manual_seed(0)
    x, y = _images(8, 8)
    return TinyCNN(), (x,), F.cross_entropy, (y,)


def build_blocks_cnn() -> tuple[nn.Module, tuple[Any, ...], Any, tuple[Any, ...]]:
    torch.manual_seed(0)
    x, y = _images(8, 6)
    return BlocksCNN(), (x,), F.cross_entropy, (y % 3,)


def build_patch_embed() -> tuple[nn.Module, tuple[Any, ...], Any, tuple[Any, ...]]:
    torch.manual_seed(0)
    x, y = _images(8, 16)
    return PatchEmbedClassifier(), (x,), F.cross_entropy, (y,)


def _logits_cross_entropy(output: Any, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.logits, labels)


def build_hf_resnet() -> tuple[nn.Module, tuple[Any, ...], Any, tuple[Any, ...]]:
    """Hugging Face's ResNetForImageClassification, tiny: two stages of one basic block each
    (``resnet.encoder.stages.i``, the blocks checkpointing recomputes), batch norm after every
    conv, the second stage's shortcut a strided 1x1 conv and batch norm. The loss is
    ``loss_fn`` on the logits, so that micro-batches can be compared with one device's
    gradient accumulation."""
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)
    config = ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic",
                          num_labels=3)
    x, y = _images(8, 16)
    return ResNetForImageClassification(config), (x,), _logits_cross_entropy, (y % 3,)
