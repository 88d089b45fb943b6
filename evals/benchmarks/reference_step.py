"""A reference decode step in nano-vLLM's shape, for `kvarena bench step` to compare against on
the same device with the same random weights.

What it is: the Llama-family forward (Llama, Qwen3's q/k RMSNorm, Qwen2's qkv bias) written
plainly with fused q/k/v and gate/up weights, a contiguous KV cache per sequence
[layers, batch, kv_heads, capacity, head_dim] written in place, attention by
`torch.nn.functional.scaled_dot_product_attention` over each row's cache with a length mask,
no policy and no signals, and sampling on the device (greedy argmax, or temperature with the
exponential race nano-vLLM's sampler uses). On CUDA a decode step is one captured CUDA graph per
batch size: copy the step's tokens and positions in, replay, read the sampled tokens back (the
host sync a serving loop needs). On CPU the same function runs eagerly.

Why it is a fair bar: it does the same arithmetic per step as the engine's FullKV decode (one
pass over the weights, the KV of each row's context, the LM head, a sample) with none of the
engine's paging, scheduling or policy machinery. Attention reads the cache up to `capacity`
(the benchmark sizes it to prompt + new tokens) under a mask, so its KV reads are those of the
longest context it serves.

GQA runs without copying K/V: the query heads of one KV head are folded into the query length,
q [B, KH, T * G, d] against K/V [B, KH, L, d], with the mask repeated per group.

Weights come from `engine.models.random_tensors` with the engine's seed on the same device, so
the reference and the engine compute with identical tensors (tests/test_reference_step.py
checks their logits agree in fp32).
"""

from __future__ import annotations

import statistics
import time

import torch
from torch.nn import functional as F


class ReferenceStep:
    """hf_config: a transformers config (model_type llama, mistral, qwen2 or qwen3, default
    RoPE); max_batch: rows of the cache; capacity: tokens per row (prompt + new tokens)."""

    def __init__(self, hf_config, device, dtype: torch.dtype, seed: int, max_batch: int,
                 capacity: int):
        from engine.models import build_model, random_tensors
        from engine.models.llama import head_dim_of
        from engine.models.rope import rope_parameters

        cfg = hf_config
        if cfg.model_type not in ("llama", "mistral", "qwen2", "qwen3"):
            raise ValueError(f"reference step: model_type {cfg.model_type!r} is not supported")
        theta, scaling = rope_parameters(cfg)
        kind = scaling.get("rope_type", scaling.get("type", "default")) or "default"
        if kind != "default":
            raise ValueError(f"reference step: rope scaling {kind!r} is not supported (default "
                             "RoPE only, as the random shapes use)")
        self.device, self.dtype = torch.device(device), dtype
        self.H, self.KH = cfg.num_attention_heads, cfg.num_key_value_heads
        self.d = head_dim_of(cfg)
        self.eps = cfg.rms_norm_eps
        self.layers_n = cfg.num_hidden_layers
        self.max_batch, self.capacity = max_batch, capacity
        # Same parameter names and draw order as the engine's model, hence the same tensors.
        meta = build_model(cfg, capacity, self.device, dtype)
        w = {name: t.to(dtype) for name, t in random_tensors(meta, seed, self.device)}
        del meta

        def cat(*names):
            present = [w.pop(n) for n in names if n in w]
            return torch.cat(present) if present else None

        self.embed = w.pop("model.embed_tokens.weight")
        self.head = w.pop("lm_head.weight", self.embed)
        self.norm = w.pop("model.norm.weight")
        self.layers = []
        for i in range(self.layers_n):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            self.layers.append(dict(
                ln1=w.pop(p + "input_layernorm.weight"), ln2=w.pop(p + "post_attention_layernorm.weight"),
                qkv=cat(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),
                qkv_bias=cat(a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"),
                o=w.pop(a + "o_proj.weight"), q_norm=w.pop(a + "q_norm.weight", None),
                k_norm=w.pop(a + "k_norm.weight", None),
                gate_up=cat(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                down=w.pop(p + "mlp.down_proj.weight")))
        if w:
            raise ValueError(f"reference step: unused weights {sorted(w)[:5]}")
        inv = 1.0 / theta ** (torch.arange(0, self.d, 2, dtype=torch.float32,
                                           device=self.device) / self.d)
        freqs = torch.outer(torch.arange(capacity, dtype=torch.float32, device=self.device), inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos, self.sin = emb.cos(), emb.sin()  # [capacity, d] fp32
        shape = (self.layers_n, max_batch, self.KH, capacity, self.d)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        self.graphs: dict[tuple[int, float], tuple] = {}

    # -- the forward ----------------------------------------------------------------------------
    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * xf.to(x.dtype)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, T, heads, d]; cos/sin [B, T, 1, d]."""
        half = self.d // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return (x.float() * cos + rotated.float() * sin).to(x.dtype)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, row0: int = 0) -> torch.Tensor:
        """tokens, positions [B, T] (rows row0..row0+B-1 of the cache) -> logits of the last
        token [B, vocab]. Writes each token's K/V at its position and attends to positions <= its
        own."""
        B, T = tokens.shape
        H, KH, d = self.H, self.KH, self.d
        G = H // KH
        x = self.embed[tokens]  # [B, T, hidden]
        cos, sin = self.cos[positions][:, :, None], self.sin[positions][:, :, None]
        rows = torch.arange(row0, row0 + B, device=self.device)[:, None]
        keys = torch.arange(self.capacity, device=self.device)
        mask = keys[None, None, :] <= positions[:, :, None]  # [B, T, L]
        mask = mask[:, :, None].expand(B, T, G, self.capacity).reshape(B, 1, T * G, -1)
        for i, lw in enumerate(self.layers):
            h = self._rms(x, lw["ln1"])
            qkv = F.linear(h, lw["qkv"], lw["qkv_bias"])
            q = qkv[..., :H * d].view(B, T, H, d)
            k = qkv[..., H * d:(H + KH) * d].view(B, T, KH, d)
            v = qkv[..., (H + KH) * d:].view(B, T, KH, d)
            if lw["q_norm"] is not None:
                q, k = self._rms(q, lw["q_norm"]), self._rms(k, lw["k_norm"])
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            self.k_cache[i][rows, :, positions] = k  # [B, T, KH, d] into [B, KH, L, d]
            self.v_cache[i][rows, :, positions] = v
            # GQA without copying K/V: a KV head's G query heads join the query length.
            qg = q.view(B, T, KH, G, d).permute(0, 2, 1, 3, 4).reshape(B, KH, T * G, d)
            out = F.scaled_dot_product_attention(qg, self.k_cache[i, row0:row0 + B],
                                                 self.v_cache[i, row0:row0 + B], attn_mask=mask)
            out = out.view(B, KH, T, G, d).permute(0, 2, 1, 3, 4).reshape(B, T, H * d)
            x = x + F.linear(out, lw["o"])
            gate, up = F.linear(self._rms(x, lw["ln2"]), lw["gate_up"]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, lw["down"])
        return F.linear(self._rms(x[:, -1], self.norm), self.head)

    def _sample(self, logits: torch.Tensor, temperature: float) -> torch.Tensor:
        if temperature == 0:
            return logits.argmax(-1)
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        return (probs / torch.empty_like(probs).exponential_(1)).argmax(-1)

    # -- serving -------------------------------------------------------------------------------
    def prefill(self, prompts: list[list[int]]) -> torch.Tensor:
        """Prompts into rows 0..len-1, one row per pass (bounded memory: the mask and any
        fallback attention's scores are one row's) -> logits of their last tokens [B, vocab]."""
        out = []
        for row, prompt in enumerate(prompts):
            ids = torch.tensor([prompt], device=self.device)
            pos = torch.arange(len(prompt), device=self.device)[None]
            out.append(self.forward(ids, pos, row0=row))
        return torch.cat(out)

    def capture(self, batch: int, temperature: float = 0.0) -> None:
        """CUDA: one graph of a decode step at `batch` rows: forward, then the sample. Warm-up
        writes K/V at position 0 (a prefill afterwards overwrites it)."""
        tokens = torch.zeros(batch, 1, dtype=torch.long, device=self.device)
        positions = torch.zeros(batch, 1, dtype=torch.long, device=self.device)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._sample(self.forward(tokens, positions), temperature)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self._sample(self.forward(tokens, positions), temperature)
        self.graphs[batch, temperature] = (graph, tokens, positions, out)

    def step(self, tokens: list[int], positions: list[int], temperature: float = 0.0) -> list[int]:
        """One decode step of rows 0..len(tokens)-1 -> their sampled tokens (on the host)."""
        ids = torch.tensor(tokens, dtype=torch.long)[:, None]
        pos = torch.tensor(positions, dtype=torch.long)[:, None]
        key = (len(tokens), temperature)
        if key in self.graphs:
            graph, g_ids, g_pos, out = self.graphs[key]
            g_ids.copy_(ids, non_blocking=True)
            g_pos.copy_(pos, non_blocking=True)
            graph.replay()
            return out.tolist()
        logits = self.forward(ids.to(self.device), pos.to(self.device))
        return self._sample(logits, temperature).tolist()


def reference_step_ms(ref: ReferenceStep, prompts: list[list[int]], new_tokens: int,
                      temperature: float = 0.0) -> float:
    """Median ms of a decode step over `new_tokens` steps after prefilling `prompts` (equal
    length), graphs captured first on CUDA (the first step is left out of the median)."""
    batch, start = len(prompts), len(prompts[0])
    if start + new_tokens > ref.capacity:
        raise ValueError(f"{start} + {new_tokens} tokens exceed the capacity {ref.capacity}")
    if ref.device.type == "cuda" and (batch, temperature) not in ref.graphs:
        ref.capture(batch, temperature)
    tokens = ref._sample(ref.prefill(prompts), temperature).tolist()
    gaps = []
    for n in range(new_tokens):
        begin = time.perf_counter()
        tokens = ref.step(tokens, [start + n] * batch, temperature)
        gaps.append(time.perf_counter() - begin)
    return statistics.median(gaps[1:] or gaps) * 1000
