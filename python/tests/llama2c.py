"""A llama2.c model (../shared/data/stories260K.bin) in torch with a paged KV cache:
each layer writes its new K/V into vLLM-layout blocks, then attends over the blocks, so a
loaded prefix is used exactly as vLLM would use it."""

from __future__ import annotations

import struct

import torch


class Llama2c:
    def __init__(self, path: str):
        with open(path, "rb") as f:
            data = f.read()
        dim, hidden, layers, heads, kv_heads, vocab, seq = struct.unpack_from("<7i", data, 0)
        self.dim, self.layers, self.heads, self.kv_heads = dim, layers, heads, kv_heads
        self.head = dim // heads
        w = torch.frombuffer(bytearray(data[28:]), dtype=torch.float32)
        o = 0

        def take(*shape):
            nonlocal o
            n = 1
            for s in shape:
                n *= s
            t = w[o : o + n].view(*shape)
            o += n
            return t

        vocab = abs(vocab)
        self.emb = take(vocab, dim)
        self.rms_att = take(layers, dim)
        self.wq = take(layers, dim, dim)
        self.wk = take(layers, kv_heads * self.head, dim)
        self.wv = take(layers, kv_heads * self.head, dim)
        self.wo = take(layers, dim, dim)
        self.rms_ffn = take(layers, dim)
        self.w1 = take(layers, hidden, dim)
        self.w2 = take(layers, dim, hidden)
        self.w3 = take(layers, hidden, dim)
        self.rms_final = take(dim)

    @staticmethod
    def _rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w

    def _rope(self, x, pos):
        # x: [T, H, D]; pairs (2i, 2i+1), angle pos * 10000^(-2i/D)
        d = self.head
        freq = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
        ang = pos[:, None].float() * freq[None, :]
        cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
        a, b = x[..., 0::2], x[..., 1::2]
        out = torch.empty_like(x)
        out[..., 0::2] = a * cos - b * sin
        out[..., 1::2] = a * sin + b * cos
        return out

    @torch.no_grad()
    def forward_paged(self, tokens, start, block_ids, caches, names, spec, wait):
        """Computes positions [start, len(tokens)); returns their logits [T, vocab]."""
        n = len(tokens)
        bs = spec.block_size
        pos = torch.arange(start, n)
        x = self.emb[torch.tensor(tokens[start:n])]
        blk = torch.tensor([block_ids[p // bs] for p in range(n)])
        off = torch.arange(n) % bs
        for l in range(self.layers):
            wait(names[l])
            cache = caches[names[l]]
            h = self._rms(x, self.rms_att[l])
            q = self._rope((h @ self.wq[l].T).view(-1, self.heads, self.head), pos)
            k = self._rope((h @ self.wk[l].T).view(-1, self.kv_heads, self.head), pos)
            v = (h @ self.wv[l].T).view(-1, self.kv_heads, self.head)
            if cache.dim() == 4:
                # vLLM from 0.26: [B, kv_heads, N, K|V], N a kernel block (block b = kernel blocks b*r ..)
                kn = cache.shape[2]
                kb, ko, d = blk * (bs // kn) + off // kn, off % kn, self.head
                cache[kb[start:], :, ko[start:], :d] = k.to(cache.dtype)
                cache[kb[start:], :, ko[start:], d:] = v.to(cache.dtype)
                K = cache[kb, :, ko, :d].float()  # [n, kv_heads, head]
                V = cache[kb, :, ko, d:].float()
            else:  # [2, num_blocks, bs, kv_heads, head]
                cache[0, blk[start:], off[start:]] = k.to(cache.dtype)
                cache[1, blk[start:], off[start:]] = v.to(cache.dtype)
                K = cache[0, blk, off].float()  # [n, kv_heads, head]
                V = cache[1, blk, off].float()
            rep = self.heads // self.kv_heads
            K = K.repeat_interleave(rep, dim=1)
            V = V.repeat_interleave(rep, dim=1)
            att = torch.einsum("thd,shd->hts", q, K) / (self.head**0.5)
            mask = torch.arange(n)[None, :] > pos[:, None]
            att = att.masked_fill(mask[None], float("-inf")).softmax(-1)
            out = torch.einsum("hts,shd->thd", att, V).reshape(-1, self.dim)
            x = x + out @ self.wo[l].T
            h = self._rms(x, self.rms_ffn[l])
            x = x + (torch.nn.functional.silu(h @ self.w1[l].T) * (h @ self.w3[l].T)) @ self.w2[l].T
        return self._rms(x, self.rms_final) @ self.emb.T
