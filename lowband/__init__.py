"""lowband: train LLMs across many devices while moving fewer bytes and keeping less state per device."""

__version__ = "0.1.0"
