"""Public API of RocketLLM: `from rocketllm import AutoModel, HardwareProfile`."""

from rocketllm_cli import __version__

__all__ = ["AutoModel", "HardwareProfile", "__version__"]


def __getattr__(name: str):
    # Lazy, so `import rocketllm` stays cheap and imports torch only when a model is made.
    if name == "AutoModel":
        from rocketllm_cli.auto import AutoModel

        return AutoModel
    if name == "HardwareProfile":
        from rocketllm_cli.profiles import HardwareProfile

        return HardwareProfile
    raise AttributeError(f"module 'rocketllm' has no attribute {name!r}")
