"""Test stub (see ../README.md): what sglang's model configs import from torchvision."""
