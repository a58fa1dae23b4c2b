"""Tensor kernels used by the sampler; each works on a whole batch at once."""
