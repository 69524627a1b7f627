"""The package version, in a leaf module: anything may import it without importing the package upward."""

__version__ = "0.1.0.dev0"
