"""On-disk quantized formats, each behind one small protocol."""
