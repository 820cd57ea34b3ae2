"""7. Outputs: the torch state a load returns, global JAX arrays, and pre-sharded saves."""
