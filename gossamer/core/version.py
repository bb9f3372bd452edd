"""The package version, for every layer that reports it."""

__version__ = "0.1.0"
