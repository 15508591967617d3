"""Weight-only quantization: a GGUF checkpoint's quantized blocks served as they are.

formats.py: the block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL) and their reference dequantization;
transcode.py: the other GGUF block formats rewritten at load into those (quants kept, or requantized to Q8_0);
interleave.py: the CPU layout (16 rows side by side) the native kernels read;
activations.py: the int16 quantization of a product's input rows;
weight.py: QuantizedWeight, which a model holds in place of a full-precision matrix.
"""
