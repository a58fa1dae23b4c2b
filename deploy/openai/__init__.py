"""The OpenAI (and vLLM-extension) HTTP protocol: request models and response builders."""
