"""raydecode's driver (work in progress, issue 4).

Modules, one idea each:
  outputs      RequestOutput, CompletionOutput, RequestMetrics
  detokenizer  incremental detokenization and stop strings for one sequence
  sequence     one sample of a request: tokens, text, logprobs, finish rules
"""
