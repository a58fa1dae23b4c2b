"""The CPU backend: ``csrc/`` (the C++ kernels: paged attention, the fused layer ops,
the panel linear), ``kernels`` (builds and loads them as one extension),
``paged_attention`` (the attention kernel as the attention plan calls it),
``packed_linear`` (linear layers over prepacked weights), ``fused_decoder`` (the Llama,
Qwen, Phi-3 and Gemma families' decoder layers as a few fused calls) and ``backend``
(puts them to work on a loaded
model). The torch paths of ``worker/runner`` are the reference each is tested against."""
