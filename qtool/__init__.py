"""qtool: quantize model checkpoints to int8/uint8, exactly, fast and safely."""

__version__ = "0.1.0"
