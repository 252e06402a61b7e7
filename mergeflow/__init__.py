"""mergeflow: turn verl's distributed checkpoints into Hugging Face models."""

__version__ = "0.1.0"
