"""fedrun: a command-line runner for federated-learning experiments."""

__version__ = "0.1.0"
