"""A small GPT in plain PyTorch, written the way a PyTorch user would write one for speed: the
reference for ``side_by_side.py`` that is not a general-purpose library.

GPT-2's architecture (pre-LayerNorm blocks, learned positions, tanh-GELU MLP, tied embedding
and output matrix) with PyTorch's fused ``scaled_dot_product_attention``, so it loads a GPT-2
state dict (Hugging Face names; ``Conv1D`` weights stored ``[in, out]`` are transposed into
``nn.Linear``). Decoding keeps a preallocated heads-first KV cache per layer and writes each
new key and value in place. ``torch.compile`` is the caller's choice (``side_by_side_torch.py
--compile``).

    model = TorchGPT(GPTShape(vocab=65, context=256, width=128, layers=4, heads=4))
    model.load_gpt2_state_dict(safetensors.torch.load_file("dir/model.safetensors"))
    logits_BTV = model(tokens_BT)
    new_BN = model.generate_greedy(prompt_BP, new_tokens=240)
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.nn import functional as F


@dataclasses.dataclass(frozen=True)
class GPTShape:
    vocab: int
    context: int
    width: int
    layers: int
    heads: int
    norm_eps: float = 1e-5


class Block(nn.Module):
    def __init__(self, shape: GPTShape):
        super().__init__()
        c = shape.width
        self.heads = shape.heads
        self.ln_1 = nn.LayerNorm(c, eps=shape.norm_eps)
        self.qkv = nn.Linear(c, 3 * c)
        self.attn_out = nn.Linear(c, c)
        self.ln_2 = nn.LayerNorm(c, eps=shape.norm_eps)
        self.fc = nn.Linear(c, 4 * c)
        self.mlp_out = nn.Linear(4 * c, c)

    def split_heads(self, x_BTC: torch.Tensor) -> torch.Tensor:
        b, t, c = x_BTC.shape
        return x_BTC.view(b, t, self.heads, c // self.heads).transpose(1, 2)  # [B, H, T, D]

    def mlp(self, x_BTC: torch.Tensor) -> torch.Tensor:
        return self.mlp_out(F.gelu(self.fc(self.ln_2(x_BTC)), approximate="tanh"))

    def forward(self, x_BTC: torch.Tensor) -> torch.Tensor:
        q_BTC, k_BTC, v_BTC = self.qkv(self.ln_1(x_BTC)).split(x_BTC.shape[-1], dim=-1)
        y_BHTD = F.scaled_dot_product_attention(
            self.split_heads(q_BTC), self.split_heads(k_BTC), self.split_heads(v_BTC),
            is_causal=True)
        x_BTC = x_BTC + self.attn_out(y_BHTD.transpose(1, 2).flatten(2))
        return x_BTC + self.mlp(x_BTC)

    def forward_cached(self, x_BTC: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
                       start: int) -> torch.Tensor:
        """Attend to the cache's first ``start`` slots plus these ``T`` tokens, after writing
        their keys and values at slots ``start .. start + T`` (caches ``[B, H, S, D]``)."""
        t = x_BTC.shape[1]
        q_BTC, k_BTC, v_BTC = self.qkv(self.ln_1(x_BTC)).split(x_BTC.shape[-1], dim=-1)
        cache_k[:, :, start : start + t] = self.split_heads(k_BTC)
        cache_v[:, :, start : start + t] = self.split_heads(v_BTC)
        k_BHSD, v_BHSD = cache_k[:, :, : start + t], cache_v[:, :, : start + t]
        # A prompt (start 0) is causal over itself; one new token sees every filled slot.
        y_BHTD = F.scaled_dot_product_attention(self.split_heads(q_BTC), k_BHSD, v_BHSD,
                                                is_causal=start == 0 and t > 1)
        x_BTC = x_BTC + self.attn_out(y_BHTD.transpose(1, 2).flatten(2))
        return x_BTC + self.mlp(x_BTC)


class TorchGPT(nn.Module):
    def __init__(self, shape: GPTShape):
        super().__init__()
        self.shape = shape
        self.wte = nn.Embedding(shape.vocab, shape.width)
        self.wpe = nn.Embedding(shape.context, shape.width)
        self.blocks = nn.ModuleList(Block(shape) for _ in range(shape.layers))
        self.ln_f = nn.LayerNorm(shape.width, eps=shape.norm_eps)

    def embed(self, tokens_BT: torch.Tensor, start: int = 0) -> torch.Tensor:
        positions_T = torch.arange(start, start + tokens_BT.shape[1], device=tokens_BT.device)
        return self.wte(tokens_BT) + self.wpe(positions_T)

    def logits(self, x_BTC: torch.Tensor) -> torch.Tensor:
        return F.linear(self.ln_f(x_BTC), self.wte.weight)  # tied output matrix

    def forward(self, tokens_BT: torch.Tensor) -> torch.Tensor:
        x_BTC = self.embed(tokens_BT)
        for block in self.blocks:
            x_BTC = block(x_BTC)
        return self.logits(x_BTC)

    def forward_cached(self, tokens_BT: torch.Tensor, caches: list, start: int) -> torch.Tensor:
        x_BTC = self.embed(tokens_BT, start)
        for block, (cache_k, cache_v) in zip(self.blocks, caches, strict=True):
            x_BTC = block.forward_cached(x_BTC, cache_k, cache_v, start)
        return self.logits(x_BTC[:, -1:])

    def decode_step(self, token_B1: torch.Tensor, cache_k_LBHSD: torch.Tensor,
                    cache_v_LBHSD: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """One new token per row at slot ``position`` (a 0-d tensor), attending to every filled
        slot through a mask over the whole cache: the same shapes at every step, so that
        ``torch.compile`` traces it once. Returns the next greedy tokens ``[B, 1]``."""
        slot_1 = position.view(1)
        x_BTC = self.wte(token_B1) + self.wpe(slot_1)
        slots_S = torch.arange(cache_k_LBHSD.shape[3], device=token_B1.device)
        visible_1S = (slots_S <= position).view(1, -1)
        for i, block in enumerate(self.blocks):
            q_BTC, k_BTC, v_BTC = block.qkv(block.ln_1(x_BTC)).split(x_BTC.shape[-1], dim=-1)
            cache_k_LBHSD[i].index_copy_(2, slot_1, block.split_heads(k_BTC))
            cache_v_LBHSD[i].index_copy_(2, slot_1, block.split_heads(v_BTC))
            y_BHTD = F.scaled_dot_product_attention(block.split_heads(q_BTC), cache_k_LBHSD[i],
                                                    cache_v_LBHSD[i], attn_mask=visible_1S)
            x_BTC = x_BTC + block.attn_out(y_BHTD.transpose(1, 2).flatten(2))
            x_BTC = x_BTC + block.mlp(x_BTC)
        return self.logits(x_BTC).argmax(-1)

    @torch.inference_mode()
    def generate_greedy(self, prompt_BP: torch.Tensor, new_tokens: int,
                        step=None) -> torch.Tensor:
        """Greedy decoding with the KV cache (prefill, then one token per step); returns the
        ``[B, new_tokens]`` new tokens. ``step``: the per-token function, by default the eager
        one that attends to the filled slots only; ``torch.compile(model.decode_step)`` for a
        compiled loop (fixed shapes)."""
        b, p = prompt_BP.shape
        if p + new_tokens > self.shape.context:
            raise ValueError(f"prompt {p} + {new_tokens} new tokens exceed the learned position "
                             f"table ({self.shape.context}): ask for fewer new tokens")
        s, d = self.shape, self.shape.width // self.shape.heads
        cache_k_LBHSD = self.wte.weight.new_zeros(s.layers, b, s.heads, p + new_tokens, d)
        cache_v_LBHSD = torch.zeros_like(cache_k_LBHSD)
        caches = list(zip(cache_k_LBHSD, cache_v_LBHSD, strict=True))
        out_BN = torch.empty(b, new_tokens, dtype=torch.long)
        token_B1 = self.forward_cached(prompt_BP, caches, 0).argmax(-1)
        for i in range(new_tokens):
            out_BN[:, i : i + 1] = token_B1
            if i + 1 < new_tokens:
                if step is None:
                    token_B1 = self.forward_cached(token_B1, caches, p + i).argmax(-1)
                else:
                    token_B1 = step(token_B1, cache_k_LBHSD, cache_v_LBHSD,
                                    torch.tensor(p + i))
        return out_BN

    def load_gpt2_state_dict(self, state: dict) -> None:
        """Load GPT-2's tensors (Hugging Face names, with or without the ``transformer.``
        prefix; ``Conv1D`` weights ``[in, out]``). Every parameter must be found."""
        state = {k.removeprefix("transformer."): v for k, v in state.items()}
        names = {"wte.weight": "wte.weight", "wpe.weight": "wpe.weight",
                 "ln_f.weight": "ln_f.weight", "ln_f.bias": "ln_f.bias"}
        conv1d = set()
        for i in range(self.shape.layers):
            for ours, theirs in (("ln_1", "ln_1"), ("qkv", "attn.c_attn"),
                                 ("attn_out", "attn.c_proj"), ("ln_2", "ln_2"),
                                 ("fc", "mlp.c_fc"), ("mlp_out", "mlp.c_proj")):
                for leaf in ("weight", "bias"):
                    names[f"blocks.{i}.{ours}.{leaf}"] = f"h.{i}.{theirs}.{leaf}"
                if not ours.startswith("ln"):
                    conv1d.add(f"blocks.{i}.{ours}.weight")
        missing = sorted(v for v in names.values() if v not in state)
        if missing:
            raise KeyError(f"GPT-2 state dict lacks {missing[:4]} (and {len(missing) - 4} more)"
                           if len(missing) > 4 else f"GPT-2 state dict lacks {missing}")
        mine = {k: (state[v].t() if k in conv1d else state[v]) for k, v in names.items()}
        self.load_state_dict(mine, strict=True)
