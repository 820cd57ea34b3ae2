"""6. Transforms: jitted JAX kernels (:mod:`.kernels`), online quantization, output targets, and
dequantization for inspection. jax is imported only when a kernel runs."""
