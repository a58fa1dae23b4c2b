"""What a worker computes, Ray-free: ``model_runner`` (``ModelRunner``: one step message
in, one reply out), ``model_loader`` (a causal LM from a path, hub id, GGUF file or the
embedded default), ``input_batch`` (the persistent batch following each
``BatchUpdate``), ``kv_pool`` (the paged KV storage), ``attention_plan`` (how a step's
packed tokens map onto rows, blocks and slots), ``attention`` (the paged attention
transformers calls, and its torch reference path), ``backend`` (what runs a step on the
device: the CPU kernels or the torch paths), ``structured_output`` (grammar-constrained
decoding with llguidance), ``ngram_proposer`` (prompt-lookup drafts), and model
parallelism: ``parallel_layout`` (which part of the model each rank of a group holds),
``sharded_loader`` (a rank's shard from the checkpoint) and ``parallel_group`` (the
group's collectives)."""
