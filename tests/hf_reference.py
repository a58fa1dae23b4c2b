"""An independent reference for HTTP tests: the same tiny model run by ``transformers``
itself (float32, one full forward per question), never through raydecode."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


class HFReference:
    def __init__(self, path: str) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    @torch.no_grad()
    def logprobs(self, ids: Sequence[int]) -> torch.Tensor:
        """[len(ids), vocab]: row i is the log-distribution of the token after ids[:i+1]."""
        logits = self.model(torch.tensor([list(ids)])).logits[0].float()
        return torch.log_softmax(logits, dim=-1)

    def token_logprobs(self, ids: Sequence[int]) -> list[float]:
        """Logprob of each token given the ones before it (from the second token on)."""
        lp = self.logprobs(ids)
        return [float(lp[i - 1, ids[i]]) for i in range(1, len(ids))]

    @torch.no_grad()
    def greedy(self, prompt: Sequence[int], n: int,
               adjust: Callable[[torch.Tensor, list[int]], torch.Tensor] | None = None) -> list[int]:
        """``n`` greedy tokens; ``adjust(logits, output_so_far)`` may edit each step's logits."""
        ids, out = list(prompt), []
        for _ in range(n):
            logits = self.model(torch.tensor([ids])).logits[0, -1].float()
            if adjust is not None:
                logits = adjust(logits.clone(), out)
            token = int(torch.argmax(logits))
            ids.append(token)
            out.append(token)
        return out
