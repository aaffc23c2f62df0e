"""Test stub (see ../README.md)."""
