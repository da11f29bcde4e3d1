"""nanovlm: packed multimodal data, a small VLM with varlen attention, and a Lightning training template."""

__version__ = "0.1.0"
