"""gpupack: GPU sharing for Kubernetes inference clusters."""

from importlib.metadata import PackageNotFoundError, version

try:
    # Stamped at install time from the git tag (setuptools-scm); pyproject.toml says how.
    __version__: str = version("gpupack")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"
