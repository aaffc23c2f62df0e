"""Test stub (see ../../README.md): the enum sglang's model configs name at import."""

import enum


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
