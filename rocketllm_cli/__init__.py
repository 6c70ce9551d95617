"""RocketLLM: stream language models larger than memory through the compute device."""

__version__ = "0.1.0"
