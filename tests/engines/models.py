"""The models the test engine runs: ``prefill(ids) -> (state, token)``, ``decode(state, token)
-> (state, token)``, greedy.

- :class:`HashLM`: pure Python, for the CPU tests: the next token is a hash of everything before
  it, so any token lost, repeated or taken from another request changes the rest.
- :class:`LlamaLM`: a Llama-shaped model (transformers' ``LlamaForCausalLM``) with random weights
  from a seed, bf16 on the GPU, with a KV cache; for the device tests.
"""

from __future__ import annotations

import hashlib
import time


class HashLM:
    vocab = 32000

    def _next(self, state: bytes) -> tuple[bytes, int]:
        digest = hashlib.blake2b(state, digest_size=16).digest()
        return digest, int.from_bytes(digest[:4], "little") % self.vocab

    def prefill(self, ids: list[int]) -> tuple[bytes, int]:
        return self._next(b"p" + b"".join(i.to_bytes(4, "little") for i in ids))

    def decode(self, state: bytes, token: int) -> tuple[bytes, int]:
        return self._next(state + token.to_bytes(4, "little"))


class LlamaLM:
    def __init__(self, layers: int = 8, hidden: int = 2048, heads: int = 16, kv_heads: int = 8,
                 vocab: int = 32000, seed: int = 0, device: str = "cuda") -> None:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        t0 = time.perf_counter()
        self.torch = torch
        self.device = device
        config = LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                             num_hidden_layers=layers, num_attention_heads=heads,
                             num_key_value_heads=kv_heads, vocab_size=vocab,
                             max_position_embeddings=4096)
        torch.manual_seed(seed)
        with torch.device(device):
            self.model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
        torch.cuda.synchronize()
        self.load_s = time.perf_counter() - t0
        self.params = sum(p.numel() for p in self.model.parameters())

    def _forward(self, ids: list[int], cache: object) -> tuple[object, int]:
        torch = self.torch
        with torch.no_grad():
            out = self.model(torch.tensor([ids], device=self.device), past_key_values=cache,
                             use_cache=True)
            return out.past_key_values, int(out.logits[0, -1].argmax())  # .item(): synchronized

    def prefill(self, ids: list[int]) -> tuple[object, int]:
        return self._forward(list(ids), None)

    def decode(self, state: object, token: int) -> tuple[object, int]:
        return self._forward([token], state)


def make(kind: str):  # noqa: ANN201
    return LlamaLM() if kind == "llama" else HashLM()
