"""lowband: train LLMs across many devices while moving fewer bytes and keeping less state per device.

``lowband.load_trained(run_dir)`` rebuilds the model a training run exported (:mod:`lowband.train.trained`).
"""

__version__ = "0.1.0"

__all__ = ["__version__", "load_trained"]


def __getattr__(name: str) -> object:  # lazy, so ``import lowband`` stays free of torch until a model is loaded
    if name == "load_trained":
        from lowband.train.trained import load_trained

        return load_trained
    raise AttributeError(f"module 'lowband' has no attribute {name!r}")
