"""gpufaas: a GPU-enabled Function-as-a-Service control plane for ML inference (shared vocabulary)."""

__version__ = "0.1.0"
