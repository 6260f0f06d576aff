"""gpupack: GPU sharing for Kubernetes inference clusters."""

from importlib.metadata import PackageNotFoundError, version

try:
    # The installed distribution's version: pyproject.toml's [project] version.
    __version__: str = version("gpupack")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"
