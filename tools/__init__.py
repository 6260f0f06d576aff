"""Developer tools, run from the repository root (`python -m tools.<name>`).

Not part of the product: `pip install .` and the image leave this folder out (pyproject's
[tool.setuptools.packages.find], .dockerignore); mypy checks it ([tool.mypy] files).
"""
