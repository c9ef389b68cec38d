"""Research and calibration scripts of the repository (tools/README.md), not installed with the package:
run from the repository root as ``python -m tools.NAME``."""
