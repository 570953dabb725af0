"""Linears on quantized frozen weights with BEM's update inside: bitsandbytes' 4-bit layout (NF4, FP4, with or
without double quantization) read straight from the layer at decode sizes.

- `reference.py`: the layout in PyTorch (what the kernel computes, in any dtype, float64 for the tests);
- `ops.py`: what a wrapped layer hands the kernel, and when the kernel takes the call; bitsandbytes' own layer
  with the update beside it takes every other call and is the kernel's oracle.
"""
