"""An independent, plain re-statement of the CS224N handouts' GPT, for tests and the speed anchor.

It keeps the handouts' parameter names and shapes (what `torch.save(model.state_dict())` writes there)
and their arithmetic (unfused attention, masked_fill with -1e10, complex-number RoPE, the synthesizer's
w2 of width block_size - 1, the perceiver per the 2023 hints), so the converter and our attention
variants can be checked against it. With `pdrop` it drops out where the handouts do (embeddings,
attention weights, both residual branches), and `handout_init` sets their initial values; so
`benchmarks/handout_loop.py` trains it as their code does.
"""

import math

import torch
from torch import nn
from torch.nn import functional as F


class Config:
    def __init__(
        self, vocab_size, block_size, n_layer=4, n_head=8, n_embd=256, variant="vanilla", bottleneck_dim=32, pdrop=0.0
    ):
        self.vocab_size, self.block_size = vocab_size, block_size
        self.n_layer, self.n_head, self.n_embd = n_layer, n_head, n_embd
        self.variant, self.bottleneck_dim, self.pdrop = variant, bottleneck_dim, pdrop


def rope_cache(dim, max_positions):
    theta = 10000.0 ** (-torch.arange(0, dim, 2).float() / dim)
    angles = torch.arange(max_positions).float()[:, None] * theta[None]
    return torch.stack([angles.cos(), angles.sin()], dim=-1)  # (T, dim/2, 2)


def apply_rope(x, cache):
    T = x.shape[-2]
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2).contiguous())
    rotation = torch.view_as_complex(cache[:T].contiguous())
    return torch.view_as_real(pairs * rotation).flatten(-2)


class SelfAttention(nn.Module):
    def __init__(self, c, rope=False):
        super().__init__()
        self.key, self.query, self.value = (nn.Linear(c.n_embd, c.n_embd) for _ in range(3))
        self.proj = nn.Linear(c.n_embd, c.n_embd)
        self.register_buffer(
            "mask", torch.tril(torch.ones(c.block_size, c.block_size)).view(1, 1, c.block_size, c.block_size)
        )
        self.rope = rope
        if rope:
            self.register_buffer("rope_cache", rope_cache(c.n_embd // c.n_head, c.block_size))
        self.n_head = c.n_head
        self.attn_drop, self.resid_drop = nn.Dropout(c.pdrop), nn.Dropout(c.pdrop)

    def forward(self, x):
        B, T, C = x.shape
        k = self.key(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = self.query(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = self.value(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if self.rope:
            q, k = apply_rope(q, self.rope_cache), apply_rope(k, self.rope_cache)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.mask[:, :, :T, :T] == 0, -1e10)
        y = self.attn_drop(F.softmax(att, dim=-1)) @ v
        return self.resid_drop(self.proj(y.transpose(1, 2).contiguous().view(B, T, C)))


class SynthesizerAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.w1 = nn.Linear(c.n_embd, c.n_embd)
        self.w2 = nn.Parameter(torch.zeros(c.n_embd // c.n_head, c.block_size - 1))
        self.b2 = nn.Parameter(torch.zeros(c.block_size - 1))
        self.value = nn.Linear(c.n_embd, c.n_embd)
        self.proj = nn.Linear(c.n_embd, c.n_embd)
        self.register_buffer(
            "mask", torch.tril(torch.ones(c.block_size, c.block_size)).view(1, 1, c.block_size, c.block_size)
        )
        self.n_head = c.n_head
        self.attn_drop, self.resid_drop = nn.Dropout(c.pdrop), nn.Dropout(c.pdrop)
        nn.init.uniform_(self.w2, -0.001, 0.001)

    def forward(self, x):
        B, T, C = x.shape
        d_k = C // self.n_head
        relu_out = F.relu(self.w1(x)).view(B, T, self.n_head, d_k).transpose(1, 2)
        v = self.value(x).view(B, T, self.n_head, d_k).transpose(1, 2)
        scores = (relu_out @ self.w2[:, :T]) + self.b2[:T]
        scores = scores.masked_fill(self.mask[:, :, :T, :T] == 0, -1e10)
        y = self.attn_drop(F.softmax(scores, dim=-1)) @ v
        return self.resid_drop(self.proj(y.transpose(1, 2).contiguous().view(B, T, C)))


class CrossAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.key, self.query, self.value = (nn.Linear(c.n_embd, c.n_embd) for _ in range(3))
        self.proj = nn.Linear(c.n_embd, c.n_embd)
        self.register_buffer(
            "mask", torch.tril(torch.ones(c.block_size, c.block_size)).view(1, 1, c.block_size, c.block_size)
        )
        self.n_head = c.n_head
        self.attn_drop, self.resid_drop = nn.Dropout(c.pdrop), nn.Dropout(c.pdrop)

    def forward(self, x_kv, x_q):
        Bk, Tk, C = x_kv.shape
        Bq, Tq, _ = x_q.shape
        k = self.key(x_kv).view(Bk, Tk, self.n_head, C // self.n_head).transpose(1, 2)
        q = self.query(x_q).view(Bq, Tq, self.n_head, C // self.n_head).transpose(1, 2)
        v = self.value(x_kv).view(Bk, Tk, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.mask[:, :, :Tq, :Tk] == 0, -1e10)
        y = self.attn_drop(F.softmax(att, dim=-1)) @ v
        return self.resid_drop(self.proj(y.transpose(1, 2).contiguous().view(max(Bk, Bq), Tq, C)))


def mlp(c):
    return nn.Sequential(
        nn.Linear(c.n_embd, 4 * c.n_embd), nn.GELU(), nn.Linear(4 * c.n_embd, c.n_embd), nn.Dropout(c.pdrop)
    )


class Block(nn.Module):
    def __init__(self, c, attention):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(c.n_embd), nn.LayerNorm(c.n_embd)
        self.attn = attention
        self.mlp = mlp(c)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class DownProjectBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.C = nn.Parameter(nn.init.xavier_uniform_(torch.empty(1, c.bottleneck_dim, c.n_embd)))
        self.ln1, self.ln2 = nn.LayerNorm(c.n_embd), nn.LayerNorm(c.n_embd)
        self.attn = CrossAttention(c)
        self.mlp = mlp(c)

    def forward(self, x_input):
        x = self.C + self.attn(x_input, self.ln1(self.C))
        return x + self.mlp(self.ln2(x))


class UpProjectBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(c.n_embd), nn.LayerNorm(c.n_embd)
        self.attn = CrossAttention(c)
        self.mlp = mlp(c)

    def forward(self, y, x_input):
        x = x_input + self.attn(self.ln1(y), x_input)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.variant = c.variant
        self.tok_emb = nn.Embedding(c.vocab_size, c.n_embd)
        if c.variant != "rope":
            self.pos_emb = nn.Parameter(torch.zeros(1, c.block_size, c.n_embd))
        if c.variant == "perceiver":
            self.down_block = DownProjectBlock(c)
            latent = Config(c.vocab_size, c.bottleneck_dim, n_head=c.n_head, n_embd=c.n_embd, pdrop=c.pdrop)
            self.blocks = nn.Sequential(*[Block(latent, SelfAttention(latent)) for _ in range(c.n_layer - 2)])
            self.up_block = UpProjectBlock(c)
        else:
            make = {
                "vanilla": lambda: SelfAttention(c),
                "rope": lambda: SelfAttention(c, rope=True),
                "synthesizer": lambda: SynthesizerAttention(c),
            }[c.variant]
            self.blocks = nn.Sequential(*[Block(c, make()) for _ in range(c.n_layer)])
        self.drop = nn.Dropout(c.pdrop)
        self.ln_f = nn.LayerNorm(c.n_embd)
        self.head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        with torch.no_grad():  # non-trivial values everywhere, so a mis-mapped tensor shows
            for name, p in self.named_parameters():
                if name.endswith("bias") or "pos_emb" in name or name.endswith("b2"):
                    p.normal_(0, 0.02)

    def handout_init(self):
        """The handouts' initial values: weights of linear layers and embeddings from N(0, 0.02), biases and
        the position embedding zero, layer norms the identity."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.data.normal_(mean=0.0, std=0.02)
                if isinstance(module, nn.Linear) and module.bias is not None:
                    module.bias.data.zero_()
            elif isinstance(module, nn.LayerNorm):
                module.bias.data.zero_()
                module.weight.data.fill_(1.0)
        if self.variant != "rope":
            self.pos_emb.data.zero_()
        return self

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok_emb(idx)
        if self.variant != "rope":
            x = x + self.pos_emb[:, :t, :]
        x = self.drop(x)
        if self.variant == "perceiver":
            return self.head(self.ln_f(self.up_block(self.blocks(self.down_block(x)), x)))
        return self.head(self.ln_f(self.blocks(x)))
