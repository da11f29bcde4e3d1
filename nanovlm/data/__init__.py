"""Data: records and shards, packing, and the Lightning DataModule that ties them together.

``from nanovlm.data import PackedMultimodalDataModule`` works; it is imported on first use, so importing a light
submodule (``nanovlm.data.demo``, ``nanovlm.data.format``) does not pull in Lightning.
"""

from typing import Any

__all__ = ["PackedMultimodalDataModule"]


def __getattr__(name: str) -> Any:
    if name == "PackedMultimodalDataModule":
        from nanovlm.data.datamodule import PackedMultimodalDataModule

        return PackedMultimodalDataModule
    raise AttributeError(f"module 'nanovlm.data' has no attribute {name!r}")
