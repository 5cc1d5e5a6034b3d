"""ddtree: ahead-of-time compiled Kimi K2.x inference with DDTree tree speculative decoding."""

__version__ = "0.1.0"
