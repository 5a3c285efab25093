"""`export()` moved to `jaxpi.train.export` and the `jaxpi export` command to `jaxpi.cli.export`;
this module re-exports `export` for the callers not yet switched."""

from jaxpi.train.export import export

__all__ = ["export"]
