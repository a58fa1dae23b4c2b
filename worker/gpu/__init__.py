"""The GPU path: FlexAttention over the paged pool, CUDA graphs for decode steps, the
host-built plans they upload, and the RMSNorms compiled inside them (``backend.py``
puts them to work on a loaded model)."""
