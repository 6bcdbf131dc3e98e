"""labrun: a configuration-driven experiment runner for a deep-learning lab."""

__version__ = "0.1.0"
