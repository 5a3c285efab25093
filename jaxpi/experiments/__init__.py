"""Studies built on the library: each registers what it adds (bases, SFT data sources) through
the entry points in pyproject.toml, so the trainers never import an experiment."""
