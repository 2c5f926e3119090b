"""INT4 weight-only quantization (w4a16): packing, quantize CLI (RTN, AWQ), checkpoint loader.

Checkpoint format `edgeinfer-w4a16` is documented in docs/QUANTIZATION.md.
"""
