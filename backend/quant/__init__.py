"""The offline INT4 quantizer (w4a16): `edgeinfer model quantize` (quantize.py: RTN, AWQ, GPTQ), calibrated by
running the engine's ModelRunner (calib.py). It sits above the engine, as ops/ does; reading a quantized
checkpoint (its format, packing and loader) belongs to backend/model/ (quant_format.py, packing.py,
quant_loader.py).

Checkpoint format `edgeinfer-w4a16` is documented in docs/QUANTIZATION.md.
"""
