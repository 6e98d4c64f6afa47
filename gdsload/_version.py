"""The package version (a leaf: writers and the server stamp it without importing the package root)."""

__version__ = "0.1.0"
