"""gpupack: GPU sharing for Kubernetes inference clusters."""

__version__ = "0.1.0"
