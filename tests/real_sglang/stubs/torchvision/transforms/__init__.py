"""Test stub (see ../../README.md)."""

from torchvision.transforms.functional import InterpolationMode

__all__ = ["InterpolationMode"]
