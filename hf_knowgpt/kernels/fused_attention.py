"""A fused causal attention kernel for short bf16 sequences, its softmax and sums in fp32, written in Triton.

Why: under bf16 the handouts' recipe trains like fp32 only when the attention kernel runs in fp32
(`KnowGPTConfig.attention_kernel_dtype`), and PyTorch's only fused fp32 kernel with dropout (the
memory-efficient one) is tuned for long sequences: on an H200 it took 1.56 of the 3.5 ms of a
training step at the handouts' 128 positions, four times what the bf16 flash kernel takes.

How: as FlashAttention-2, in blocks of `BLOCK_SIZE` positions. The forward pass gives each block of
queries of each (batch, head) a program that runs an online softmax over the key blocks it sees; the
backward pass gives each block index a program that computes the gradients of that block's keys and
values (over the query blocks that see them) and then of that block's queries (over the key blocks they
see), so no two programs write one gradient and no atomics are needed. Told each sequence's length
(packed training), both skip the blocks that hold only padding. The two products of bf16 operands (Q Kᵀ
and dO Vᵀ) run on tensor cores exactly (products of bf16 numbers are exact in fp32, and accumulate in
fp32). The products with an fp32 operand — the weights P or the score gradient dS against V, dO, K or Q —
split that operand into `splits` bf16 parts (x ≈ x₁ + x₂ + x₃, each the rounding of what is left), so
three parts give fp32's 24 bits, two (the default) about 16, one what the flash kernel keeps. The dropout mask is
regenerated from the call's seed in the backward pass instead of being stored (eight adjacent keys' 16-bit
uniforms from each Philox evaluation, the stream `dropout_masks` draws; the mask written as bits by the forward
kernel and read back was no faster, benchmarks/RESULTS.md), and the softmax correction Σⱼ Pᵢⱼ dPᵢⱼ = dOᵢ·Oᵢ comes
from an fp32 copy of the output rather than from the rounded one.

`fused_causal_attention(query, key, value, scale, dropout_p, lengths=None)` takes (B, H, T, D) bf16
tensors (any strides) and returns the attended values in bf16, in the memory order of `query`; with
`starts=` and `seq_len=` it reads and writes packed tokens (tokens, H, D) directly, the sequences lying
back to back (packed training: no scatter into a padded grid and gather back). Rope's rotation
(`rotary=`: the forward kernel rotates each block as it loads it and writes the rotated copies for the
backward kernel) and the synthesizer's keys by position with a bias (`key` a (T, D) table, `bias=`) are
done inside. It applies to causal self-attention without a padding mask (training) with T ≤ 256 and D a
power of two ≥ 16; `supports_fused_attention` says whether a call qualifies. It needs Triton and a CUDA
device (or Triton's interpreter).

One file, a little over 600 lines: the backward kernel is read against the forward one (the same blocks,
masks, dropout stream and rotation, recomputed), and both against the op that launches them; split apart,
a reader would go back and forth between files to check that they agree.
"""

import contextlib
import os

import torch

try:  # Triton ships with CUDA builds of torch; CPU builds go without it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installed torch
    triton = None

# The longest sequence: the knowledge recipe's block of 192 positions fits (blocks of 16 positions loop
# over up to 16 blocks; the dropout mask's row stride is 256).
MAX_SEQ_LEN = 256
# Half-precision parts of the fp32 operand of P·V, Pᵀ·dO, dS·K and dSᵀ·Q: 3 is fp32's accuracy. Two answered
# as three did over ten runs a side of the knowledge recipe (84.62 ± 0.79% against 84.53 ± 0.64% on held-out
# training questions) and take 0.3 s off the handout recipe's steps; one part trains the knowledge recipe 5%
# faster but answered 0.5 points less over ten runs (benchmarks/RESULTS.md).
DEFAULT_SPLITS = 2
# Positions per block of queries or keys, and warps per program of the forward and correction kernels for each
# block size (tuned with benchmarks/bench_attention.py; see benchmarks/RESULTS.md). Blocks of 16 on one warp
# instead of two: 4–6% less of the kernels' time on an H100 and an H200, and 0.2 s less of the handout's steps in
# each of three pairs of whole runs on an H100 (five of six pairs with those on an H200).
BLOCK_SIZE = 16
NUM_WARPS = {16: 1, 32: 2, 64: 4, 128: 8}
# Triton's software-pipelining stages of the forward kernel (None: Triton's default), and the backward
# kernel's own settings (None: the forward's block size and stages). Its blocks of 16 keep two warps: one was no
# faster.
NUM_STAGES = None
BACKWARD_BLOCK_SIZE = None
BACKWARD_NUM_WARPS = {16: 2, 32: 2, 64: 4, 128: 8}
BACKWARD_NUM_STAGES = None
# The most registers a thread of the forward (and correction) or the backward kernel may take (Triton's `maxnreg`;
# None: as many as the compiler wants). Built for sm_90 the backward kernel takes 118 a thread, so 8 of its 2-warp
# programs share a multiprocessor; caps of 96 to 64 let 10 to 16, spill, and ran the kernels as fast or slower (0.090 to
# 0.096 ms against 0.089, H200, benchmarks/bench_attention.py --groups registers; benchmarks/RESULTS.md). For the
# kernels launched alone: a compiled step's launches go through inductor's wrapper of Triton calls, which takes
# num_warps and num_stages out of a call's arguments but not maxnreg, and a cap is untried there.
MAX_REGISTERS = None
BACKWARD_MAX_REGISTERS = None
# The backward pass's softmax correction dOᵢ·Oᵢ computed once per query by a kernel of its own (True), or
# by every backward program that reads the query's block: 0.105 against 0.117 ms (bench_attention.py
# --groups correction, H100).
PRECOMPUTED_CORRECTION = True
# Dropout uniforms taken from each Philox evaluation: 8 (its four 32-bit outputs' 16-bit halves, as `dropout_masks`
# draws the residual stream's masks), 4 (the 32-bit outputs) or 1. Four made the kernel 7% faster than one (0.117
# against 0.126 ms forward + backward, benchmarks/bench_attention.py --groups dropout, H100); eight took 0.09-0.12 s
# off the handout's steps against four in three pairs of whole runs, H100 (benchmarks/RESULTS.md).
UNIFORMS_PER_DRAW = 8
# The values a 16-bit uniform takes (the rule of `_dropout_rule` and of `dropout_masks`).
UNIFORM_LEVELS = 2**16


def fused_attention_available() -> bool:
    return triton is not None and torch.cuda.is_available()


def supports_fused_attention(query, key, value, mask, is_causal, seq_len: int | None = None) -> bool:
    """Whether `fused_causal_attention` computes this call: causal bf16 self-attention over at most 256
    positions, without a padding mask; (B, H, T, D) tensors, or packed (tokens, H, D) ones whose
    sequences are at most `seq_len` long; the keys may be a (≥ T, D) table of keys by position. (fp16 is
    not offered: on the GPU its value gradients came out NaN in a test, a fault not found yet.)"""
    if triton is None or mask is not None or not is_causal or not (query.is_cuda or _interpreted()):
        return False
    if query.dim() == 3 and seq_len is not None:
        length, head_dim = seq_len, query.shape[-1]
    elif query.dim() == 4 and seq_len is None:
        batch, heads, length, head_dim = query.shape
        if batch * heads * _block(length) ** 2 >= 2**31:  # dropout offsets are int32
            return False
    else:
        return False
    key_table = key.dim() == 2 and key.shape[0] >= length and key.shape[1] == head_dim
    return (
        (key.shape == query.shape or key_table)
        and value.shape == query.shape
        and query.dtype == torch.bfloat16
        and key.dtype == query.dtype
        and value.dtype == query.dtype
        and length <= MAX_SEQ_LEN
        and head_dim >= 16
        and head_dim & (head_dim - 1) == 0
    )


def _interpreted() -> bool:
    """Triton's interpreter (TRITON_INTERPRET=1) runs the kernels on CPU tensors: how the tests check them
    without a GPU."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def draw_seed(device) -> torch.Tensor:
    """One seed for a kernel's call (its dropout), drawn from torch's generator of the device: captured CUDA graphs
    and torch.compile both replay it with a fresh value, and torch.manual_seed reproduces it. The package's kernels
    that draw dropout masks all take their seeds from here."""
    return torch.randint(0, 2**31 - 1, (1,), device=device, dtype=torch.int64)


def _capturing(tensor) -> bool:
    return tensor.is_cuda and torch.cuda.is_current_stream_capturing()


def launch_warps(backward: bool, block: int) -> int:
    """Warps per program of the backward kernel (`backward`) or the forward and correction kernels, for blocks of
    `block` positions."""
    return ((BACKWARD_NUM_WARPS if backward else None) or NUM_WARPS).get(block, 4)


def _block(length: int) -> int:
    return max(16, 1 << (length - 1).bit_length())


def _dropout_rule(dropout_p: float, uniforms_per_draw: int) -> tuple[int, float]:
    """The kernels' dropout at rate `dropout_p`, drawing `uniforms_per_draw` uniforms from each Philox evaluation: how
    many of a 16-bit uniform's levels drop a weight, and what kept weights are multiplied by. With eight,
    `layers_knowgpt.dropped_levels` and `kept_scale`, the rule of every 16-bit mask of the package, restated here
    because the kernels sit below the model's files (which import them, and which a checkpoint carries without them);
    a test holds the two equal. With one or four, uniforms in [0, 1) kept from p on (no levels) and scaled by
    1 / (1 − p)."""
    if dropout_p == 0:
        return 0, 1.0
    if uniforms_per_draw == 8:
        dropped = round(dropout_p * UNIFORM_LEVELS)
        return dropped, UNIFORM_LEVELS / (UNIFORM_LEVELS - dropped) if dropped < UNIFORM_LEVELS else 0.0
    return 0, 1.0 / (1.0 - dropout_p)


if triton is not None:

    @triton.jit
    def _offsets(b, h, stride_b, stride_h, stride_t, stride_d, rows, dims):
        return b * stride_b + h * stride_h + rows[:, None] * stride_t + dims[None, :] * stride_d

    @triton.jit
    def _load(pointer, b, h, stride_b, stride_h, stride_t, stride_d, rows, dims, length, start):
        """Positions `rows` of the sequence that begins at token `start`; rows at or beyond `length`
        (padding) read as zeros."""
        offsets = _offsets(b, h, stride_b, stride_h, stride_t, stride_d, start + rows, dims)
        return tl.load(pointer + offsets, mask=(rows < length)[:, None], other=0.0)

    @triton.jit
    def _store(pointer, values, b, h, stride_b, stride_h, stride_t, stride_d, rows, dims, length, start, limit):
        """Every row before `limit`, zeros from `length` on."""
        offsets = _offsets(b, h, stride_b, stride_h, stride_t, stride_d, start + rows, dims)
        values = tl.where((rows < length)[:, None], values, 0.0)
        tl.store(pointer + offsets, values.to(pointer.dtype.element_ty), mask=(rows < limit)[:, None])

    @triton.jit
    def _rotate(x, positions, COS, SIN, seq_len, HEAD_DIM: tl.constexpr, ROTARY: tl.constexpr, INVERSE: tl.constexpr):
        """Rotary embedding: each adjacent feature pair (x₂ᵢ, x₂ᵢ₊₁) of the row at position t turned by the
        angle whose cos and sin are COS[t, i] and SIN[t, i] (backwards when INVERSE: the gradient's way),
        in fp32 and rounded to x's precision. Without ROTARY, x as it is."""
        rotated = x
        if ROTARY:
            pairs = tl.arange(0, HEAD_DIM // 2)
            offsets = positions[:, None] * (HEAD_DIM // 2) + pairs[None, :]
            inside = (positions < seq_len)[:, None]
            cos = tl.load(COS + offsets, mask=inside, other=1.0)
            sin = tl.load(SIN + offsets, mask=inside, other=0.0)
            if INVERSE:
                sin = -sin
            even, odd = tl.split(tl.reshape(x.to(tl.float32), (positions.shape[0], HEAD_DIM // 2, 2)))
            turned = tl.join(even * cos - odd * sin, even * sin + odd * cos)
            rotated = tl.reshape(turned, (positions.shape[0], HEAD_DIM)).to(x.dtype)
        return rotated

    @triton.jit
    def _dropout_keep_at(seed_pointer, offsets, dropout_p):
        """Whether the elements numbered `offsets` survive dropout: a uniform (Philox) per number from the
        call's seed, so a backward kernel regenerates the mask instead of reading a stored one."""
        return tl.rand(tl.load(seed_pointer), offsets) >= dropout_p

    @triton.jit
    def _four_uniforms(seed, counters):
        """Uniforms for four adjacent columns from each Philox evaluation: (R, C) counters give (R, 4C) uniforms,
        columns 4c … 4c + 3 taking counter c's first, third, second and fourth outputs (tl.join's layout).
        `fused_layers` draws its masks this way too."""
        first, second, third, fourth = tl.rand4x(seed, counters)
        quads = tl.join(tl.join(first, second), tl.join(third, fourth))
        return tl.reshape(quads, (counters.shape[0], 4 * counters.shape[1]))

    @triton.jit
    def _eight_uniforms(seed, counters):
        """16-bit uniforms, integers in [0, 2¹⁶), for eight adjacent columns from each Philox evaluation: (R, C)
        counters give (R, 8C), column 8c + 2k + h taking half h (0: the low 16 bits) of counter c's output k, as
        `dropout_masks` lays out its elements. (tl.join adds its pair as the last dimension, so joining the
        outputs 0 and 2, then 1 and 3, puts output k at 2·(k // 2) + k mod 2 = k.)"""
        first, second, third, fourth = tl.randint4x(seed, counters)
        words = tl.join(tl.join(first, third), tl.join(second, fourth)).to(tl.uint32, bitcast=True)
        halves = tl.join(words & 0xFFFF, words >> 16)
        return tl.reshape(halves, (counters.shape[0], 8 * counters.shape[1]))

    @triton.jit
    def _dropout_keep(
        seed_pointer, program, rows, first_col, COLS: tl.constexpr, ROW_STRIDE: tl.constexpr, dropout_p,
        dropped_levels, UNIFORMS: tl.constexpr,
    ):  # fmt: skip
        """Which weights of keys first_col … first_col + COLS − 1 survive dropout: one uniform per
        (batch·head, query, key) from the call's seed, drawn identically by the forward and the backward
        kernel, whatever their block size. With UNIFORMS 4, each Philox evaluation's four outputs serve
        four adjacent keys (a quarter of the generator's work); with 8, their 16-bit halves serve eight, each
        kept where its uniform is at least `dropped_levels` (`layers_knowgpt.dropped_levels`), `dropout_masks`'
        rule and layout: key k of query r of program n takes uniform (n·ROW_STRIDE + r)·ROW_STRIDE + k of that
        module's stream for the seed; with 1, each key takes the first output of its own evaluation."""
        if UNIFORMS == 8:
            octets = first_col // 8 + tl.arange(0, COLS // 8)
            offsets = (program * ROW_STRIDE + rows[:, None]) * (ROW_STRIDE // 8) + octets[None, :]
            uniforms = _eight_uniforms(tl.load(seed_pointer), offsets)
            keep = uniforms >= dropped_levels
        elif UNIFORMS == 4:
            quads = first_col // 4 + tl.arange(0, COLS // 4)
            offsets = (program * ROW_STRIDE + rows[:, None]) * (ROW_STRIDE // 4) + quads[None, :]
            keep = _four_uniforms(tl.load(seed_pointer), offsets) >= dropout_p
        else:
            cols = first_col + tl.arange(0, COLS)
            offsets = (program * ROW_STRIDE + rows[:, None]) * ROW_STRIDE + cols[None, :]
            keep = _dropout_keep_at(seed_pointer, offsets, dropout_p)
        return keep

    @triton.jit
    def _dot(a, b, acc, INTERPRETED: tl.constexpr):
        """acc + a·b of half-precision operands, products exact and sums in fp32 (tensor cores). The
        interpreter multiplies bf16 bit patterns as integers, so there the same values go in as fp32."""
        if INTERPRETED:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        return tl.dot(a, b, acc)

    @triton.jit
    def _split_dot(a, b, acc, SPLITS: tl.constexpr, INTERPRETED: tl.constexpr):
        """acc + a·b for fp32 `a` and half-precision `b`: `a` as a sum of SPLITS half-precision parts."""
        part = a.to(b.dtype)
        acc = _dot(part, b, acc, INTERPRETED)
        if SPLITS > 1:
            rest = a - part.to(tl.float32)
            part = rest.to(b.dtype)
            acc = _dot(part, b, acc, INTERPRETED)
            if SPLITS > 2:
                acc = _dot((rest - part.to(tl.float32)).to(b.dtype), b, acc, INTERPRETED)
        return acc

    @triton.jit
    def _causal_scores(
        q, k, BIAS, rows, cols, length, SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, INTERPRETED: tl.constexpr
    ):
        """Q Kᵀ · scale (+ the keys' bias) for a block of queries against a block of keys, −∞ where the key
        comes after the query."""
        scores = _dot(q, tl.trans(k), tl.zeros((rows.shape[0], cols.shape[0]), tl.float32), INTERPRETED) * SCALE
        if HAS_BIAS:
            scores += tl.load(BIAS + cols, mask=cols < length, other=0.0)[None, :]
        return tl.where(cols[None, :] <= rows[:, None], scores, float("-inf"))

    # Each kernel reads its sequence's length (HAS_LENGTHS) and first token (PACKED) itself rather than through a
    # helper: torch.compile's analysis of what a kernel writes follows a helper's results back to every argument
    # the helper was handed, so a store at offsets from a helper given LENGTHS and STARTS counted as writing both,
    # and the compiled step copied them before each launch (tests/test_kernel_writes.py).

    @triton.jit
    def _key_start(start, KEY_TABLE: tl.constexpr):
        """Where a sequence's keys start: a table of keys by position (KEY_TABLE) is the same for all."""
        if KEY_TABLE:
            return 0
        return start

    @triton.jit
    def _forward_kernel(
        Q, K, V, OUT, OUT32, LSE, SEED, LENGTHS, STARTS, COS, SIN, BIAS, QR, KR,
        sq_b, sq_h, sq_t, sq_d, sk_b, sk_h, sk_t, sk_d, sv_b, sv_h, sv_t, sv_d, so_b, so_h, so_t, so_d,
        sqr_b, sqr_h, sqr_t, sqr_d, skr_b, skr_h, skr_t, skr_d,
        n_head, seq_len,
        SCALE: tl.constexpr, DROPOUT_P: tl.constexpr, DROPPED_LEVELS: tl.constexpr, KEEP_SCALE: tl.constexpr,
        HEAD_DIM: tl.constexpr, ROW_STRIDE: tl.constexpr,
        BLOCK: tl.constexpr, SPLITS: tl.constexpr, HAS_LENGTHS: tl.constexpr, PACKED: tl.constexpr,
        ROTARY: tl.constexpr, KEY_TABLE: tl.constexpr, HAS_BIAS: tl.constexpr, UNIFORMS: tl.constexpr,
        INTERPRETED: tl.constexpr,
    ):  # fmt: skip
        """One block of queries of one (batch, head): online softmax over the key blocks it sees. With
        ROTARY it also writes its rotated queries, and the rotated keys of its own block, to QR and KR for
        the backward pass."""
        query_block, program = tl.program_id(0), tl.program_id(1)
        b, h = program // n_head, program % n_head
        length = tl.minimum(tl.load(LENGTHS + b), seq_len) if HAS_LENGTHS else seq_len
        start = tl.load(STARTS + b) if PACKED else 0
        limit = length if PACKED else seq_len  # the rows its outputs cover: its own when packed
        key_start = _key_start(start, KEY_TABLE)
        rows, dims = query_block * BLOCK + tl.arange(0, BLOCK), tl.arange(0, HEAD_DIM)
        row_max = tl.full((BLOCK,), float("-inf"), tl.float32)
        row_sum = tl.zeros((BLOCK,), tl.float32)
        out = tl.zeros((BLOCK, HEAD_DIM), tl.float32)
        if query_block * BLOCK < length:  # blocks of padding only are skipped (and written as zeros)
            q = _load(Q, b, h, sq_b, sq_h, sq_t, sq_d, rows, dims, length, start)
            q = _rotate(q, rows, COS, SIN, seq_len, HEAD_DIM, ROTARY, False)
            for key_block in range(0, query_block + 1):
                cols = key_block * BLOCK + tl.arange(0, BLOCK)
                k = _load(K, b, h, sk_b, sk_h, sk_t, sk_d, cols, dims, length, key_start)
                k = _rotate(k, cols, COS, SIN, seq_len, HEAD_DIM, ROTARY, False)
                v = _load(V, b, h, sv_b, sv_h, sv_t, sv_d, cols, dims, length, start)
                scores = _causal_scores(q, k, BIAS, rows, cols, length, SCALE, HAS_BIAS, INTERPRETED)
                new_max = tl.maximum(row_max, tl.max(scores, 1))
                rescale = tl.exp(row_max - new_max)
                weights = tl.exp(scores - new_max[:, None])
                row_sum = row_sum * rescale + tl.sum(weights, 1)
                if DROPOUT_P > 0:
                    keep = _dropout_keep(
                        SEED, program, rows, key_block * BLOCK, BLOCK, ROW_STRIDE, DROPOUT_P, DROPPED_LEVELS, UNIFORMS
                    )
                    weights = tl.where(keep, weights, 0.0)
                out = _split_dot(weights, v, out * rescale[:, None], SPLITS, INTERPRETED)
                row_max = new_max
            if ROTARY:  # rotated once here, the backward pass reads them as they are
                _store(QR, q, b, h, sqr_b, sqr_h, sqr_t, sqr_d, rows, dims, length, start, limit)
                k = _load(K, b, h, sk_b, sk_h, sk_t, sk_d, rows, dims, length, start)
                k = _rotate(k, rows, COS, SIN, seq_len, HEAD_DIM, ROTARY, False)
                _store(KR, k, b, h, skr_b, skr_h, skr_t, skr_d, rows, dims, length, start, limit)
        real = rows < length
        out = out * (KEEP_SCALE / tl.where(real, row_sum, 1.0))[:, None]  # a division per row, not per element
        _store(OUT, out, b, h, so_b, so_h, so_t, so_d, rows, dims, length, start, limit)
        # The fp32 output gives the backward pass its softmax correction Σⱼ Pᵢⱼ dPᵢⱼ = dOᵢ·Oᵢ unrounded.
        head_stride = seq_len * HEAD_DIM
        _store(OUT32, out, b, h, n_head * head_stride, head_stride, HEAD_DIM, 1, rows, dims, length, 0, seq_len)
        lse = tl.where(real, row_max + tl.log(tl.where(real, row_sum, 1.0)), 0.0)
        tl.store(LSE + program * seq_len + rows, lse, mask=rows < seq_len)

    @triton.jit
    def _correction(OUT32, grad_out, b, h, rows, dims, length, seq_len, n_head, HEAD_DIM: tl.constexpr):
        """The softmax correction Σⱼ Pᵢⱼ dPᵢⱼ = dOᵢ·Oᵢ of a block of queries (0 past the sequence), from
        their output gradient and the fp32 output."""
        head_stride = seq_len * HEAD_DIM
        out = _load(OUT32, b, h, n_head * head_stride, head_stride, HEAD_DIM, 1, rows, dims, length, 0)
        return tl.sum(grad_out.to(tl.float32) * out, 1)

    @triton.jit
    def _correction_kernel(
        GRAD_OUT, OUT32, CORRECTION, LENGTHS, STARTS, sg_b, sg_h, sg_t, sg_d, n_head, seq_len,
        HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, HAS_LENGTHS: tl.constexpr, PACKED: tl.constexpr,
    ):  # fmt: skip
        """Each block of queries' correction, once, for the backward programs that would each recompute it
        from dO and the fp32 output (PRECOMPUTED_CORRECTION)."""
        query_block, program = tl.program_id(0), tl.program_id(1)
        b, h = program // n_head, program % n_head
        length = tl.minimum(tl.load(LENGTHS + b), seq_len) if HAS_LENGTHS else seq_len
        start = tl.load(STARTS + b) if PACKED else 0
        rows, dims = query_block * BLOCK + tl.arange(0, BLOCK), tl.arange(0, HEAD_DIM)
        grad_out = _load(GRAD_OUT, b, h, sg_b, sg_h, sg_t, sg_d, rows, dims, length, start)
        correction = _correction(OUT32, grad_out, b, h, rows, dims, length, seq_len, n_head, HEAD_DIM)
        tl.store(CORRECTION + program * seq_len + rows, correction, mask=rows < seq_len)

    @triton.jit
    def _query_terms(
        Q, GRAD_OUT, OUT32, CORRECTION, LSE, program, b, h, rows, dims, length, start, seq_len, n_head,
        sq_b, sq_h, sq_t, sq_d, sg_b, sg_h, sg_t, sg_d, HEAD_DIM: tl.constexpr, PRECOMPUTED: tl.constexpr,
    ):  # fmt: skip
        """What the backward pass needs of a block of queries: Q, dO, the log-sum-exp and the correction
        dOᵢ·Oᵢ (read from CORRECTION when PRECOMPUTED)."""
        q = _load(Q, b, h, sq_b, sq_h, sq_t, sq_d, rows, dims, length, start)
        grad_out = _load(GRAD_OUT, b, h, sg_b, sg_h, sg_t, sg_d, rows, dims, length, start)
        lse = tl.load(LSE + program * seq_len + rows, mask=rows < length, other=0.0)
        if PRECOMPUTED:
            correction = tl.load(CORRECTION + program * seq_len + rows, mask=rows < length, other=0.0)
        else:
            correction = _correction(OUT32, grad_out, b, h, rows, dims, length, seq_len, n_head, HEAD_DIM)
        return q, grad_out, lse, correction

    @triton.jit
    def _weight_gradients(
        q, k, v, grad_out, lse, correction, BIAS, rows, first_col, length, SEED, program,
        SCALE: tl.constexpr, DROPOUT_P: tl.constexpr, DROPPED_LEVELS: tl.constexpr, KEEP_SCALE: tl.constexpr,
        BLOCK: tl.constexpr, ROW_STRIDE: tl.constexpr, HAS_BIAS: tl.constexpr, UNIFORMS: tl.constexpr,
        INTERPRETED: tl.constexpr,
    ):  # fmt: skip
        """For a block of queries against a block of keys: the weights after dropout (what multiplied V)
        and the gradient of the scores (bias included) dS = P ∘ (dP − Σⱼ Pᵢⱼ dPᵢⱼ), all in fp32; the
        gradient of Q Kᵀ is dS · scale. The keys are first_col … first_col + BLOCK − 1."""
        cols = first_col + tl.arange(0, BLOCK)
        scores = _causal_scores(q, k, BIAS, rows, cols, length, SCALE, HAS_BIAS, INTERPRETED)
        weights = tl.exp(scores - lse[:, None])
        grad_weights = _dot(grad_out, tl.trans(v), tl.zeros((rows.shape[0], cols.shape[0]), tl.float32), INTERPRETED)
        if DROPOUT_P > 0:
            keep = _dropout_keep(
                SEED, program, rows, first_col, BLOCK, ROW_STRIDE, DROPOUT_P, DROPPED_LEVELS, UNIFORMS
            )
            kept_weights = tl.where(keep, weights * KEEP_SCALE, 0.0)
            grad_weights = tl.where(keep, grad_weights * KEEP_SCALE, 0.0)
        else:
            kept_weights = weights
        return kept_weights, weights * (grad_weights - correction[:, None])

    @triton.jit
    def _backward_kernel(
        Q, K, V, OUT32, CORRECTION, GRAD_OUT, LSE, SEED, LENGTHS, STARTS, COS, SIN, BIAS,
        GRAD_Q, GRAD_K, GRAD_V, GRAD_BIAS,
        sq_b, sq_h, sq_t, sq_d, sk_b, sk_h, sk_t, sk_d, sv_b, sv_h, sv_t, sv_d, sg_b, sg_h, sg_t, sg_d,
        sgq_b, sgq_h, sgq_t, sgq_d, sgk_b, sgk_h, sgk_t, sgk_d, sgv_b, sgv_h, sgv_t, sgv_d,
        n_head, seq_len,
        SCALE: tl.constexpr, DROPOUT_P: tl.constexpr, DROPPED_LEVELS: tl.constexpr, KEEP_SCALE: tl.constexpr,
        HEAD_DIM: tl.constexpr, ROW_STRIDE: tl.constexpr,
        BLOCK: tl.constexpr, SPLITS: tl.constexpr, HAS_LENGTHS: tl.constexpr, PACKED: tl.constexpr,
        ROTARY: tl.constexpr, KEY_TABLE: tl.constexpr, HAS_BIAS: tl.constexpr, UNIFORMS: tl.constexpr,
        PRECOMPUTED: tl.constexpr, PART_STRIDE: tl.constexpr, INTERPRETED: tl.constexpr,
    ):  # fmt: skip
        """Block i of one (batch, head): the gradients of keys and values i (over the query blocks that see
        them), then of queries i (over the key blocks they see), so no two programs write one gradient.
        With ROTARY, Q and K are the forward pass's rotated copies. With KEY_TABLE, each program writes its
        share of the keys' gradient (and with HAS_BIAS of the bias's) for the caller to sum. With PART_STRIDE,
        GRAD_Q is one stacked gradient of queries, keys and values, the keys' PART_STRIDE elements after the
        queries' and the values' as many after the keys' (GRAD_K and GRAD_V are not read)."""
        if PART_STRIDE > 0:
            GRAD_K = GRAD_Q + PART_STRIDE
            GRAD_V = GRAD_Q + 2 * PART_STRIDE
        block, program = tl.program_id(0), tl.program_id(1)
        b, h = program // n_head, program % n_head
        length = tl.minimum(tl.load(LENGTHS + b), seq_len) if HAS_LENGTHS else seq_len
        start = tl.load(STARTS + b) if PACKED else 0
        limit = length if PACKED else seq_len  # the rows its outputs cover: its own when packed
        key_start = _key_start(start, KEY_TABLE)
        positions, dims = block * BLOCK + tl.arange(0, BLOCK), tl.arange(0, HEAD_DIM)
        grad_k = tl.zeros((BLOCK, HEAD_DIM), tl.float32)
        grad_v = tl.zeros((BLOCK, HEAD_DIM), tl.float32)
        grad_q = tl.zeros((BLOCK, HEAD_DIM), tl.float32)
        grad_scores_sum = tl.zeros((BLOCK, BLOCK), tl.float32)  # over query blocks; summed over rows at the end
        if block * BLOCK < length:
            k = _load(K, b, h, sk_b, sk_h, sk_t, sk_d, positions, dims, length, key_start)
            v = _load(V, b, h, sv_b, sv_h, sv_t, sv_d, positions, dims, length, start)
            for query_block in range(block, tl.cdiv(length, BLOCK)):
                rows = query_block * BLOCK + tl.arange(0, BLOCK)
                q, grad_out, lse, correction = _query_terms(
                    Q, GRAD_OUT, OUT32, CORRECTION, LSE, program, b, h, rows, dims, length, start, seq_len, n_head,
                    sq_b, sq_h, sq_t, sq_d, sg_b, sg_h, sg_t, sg_d, HEAD_DIM, PRECOMPUTED,
                )  # fmt: skip
                kept_weights, grad_scores = _weight_gradients(
                    q, k, v, grad_out, lse, correction, BIAS, rows, block * BLOCK, length, SEED, program,
                    SCALE, DROPOUT_P, DROPPED_LEVELS, KEEP_SCALE, BLOCK, ROW_STRIDE, HAS_BIAS, UNIFORMS,
                    INTERPRETED,
                )  # fmt: skip
                grad_v = _split_dot(tl.trans(kept_weights), grad_out, grad_v, SPLITS, INTERPRETED)
                grad_k = _split_dot(tl.trans(grad_scores), q, grad_k, SPLITS, INTERPRETED)
                if HAS_BIAS:
                    grad_scores_sum += grad_scores
            q, grad_out, lse, correction = _query_terms(
                Q, GRAD_OUT, OUT32, CORRECTION, LSE, program, b, h, positions, dims, length, start, seq_len, n_head,
                sq_b, sq_h, sq_t, sq_d, sg_b, sg_h, sg_t, sg_d, HEAD_DIM, PRECOMPUTED,
            )  # fmt: skip
            for key_block in range(0, block + 1):
                cols = key_block * BLOCK + tl.arange(0, BLOCK)
                k = _load(K, b, h, sk_b, sk_h, sk_t, sk_d, cols, dims, length, key_start)
                v = _load(V, b, h, sv_b, sv_h, sv_t, sv_d, cols, dims, length, start)
                _, grad_scores = _weight_gradients(
                    q, k, v, grad_out, lse, correction, BIAS, positions, key_block * BLOCK, length, SEED, program,
                    SCALE, DROPOUT_P, DROPPED_LEVELS, KEEP_SCALE, BLOCK, ROW_STRIDE, HAS_BIAS, UNIFORMS,
                    INTERPRETED,
                )  # fmt: skip
                grad_q = _split_dot(grad_scores, k, grad_q, SPLITS, INTERPRETED)
        # The scores' gradients times the scale: those of Q Kᵀ. Rotated queries' and keys' gradients are
        # turned back: those of the inputs.
        grad_k = _rotate(grad_k * SCALE, positions, COS, SIN, seq_len, HEAD_DIM, ROTARY, True)
        grad_q = _rotate(grad_q * SCALE, positions, COS, SIN, seq_len, HEAD_DIM, ROTARY, True)
        if KEY_TABLE:  # every position's row of this program's share, zeros past the sequence
            _store(GRAD_K, grad_k, b, h, sgk_b, sgk_h, sgk_t, sgk_d, positions, dims, length, 0, seq_len)
        else:
            _store(GRAD_K, grad_k, b, h, sgk_b, sgk_h, sgk_t, sgk_d, positions, dims, length, start, limit)
        if HAS_BIAS:
            grad_bias = tl.sum(grad_scores_sum, 0)
            tl.store(GRAD_BIAS + program * seq_len + positions, grad_bias, mask=positions < seq_len)
        _store(GRAD_V, grad_v, b, h, sgv_b, sgv_h, sgv_t, sgv_d, positions, dims, length, start, limit)
        _store(GRAD_Q, grad_q, b, h, sgq_b, sgq_h, sgq_t, sgq_d, positions, dims, length, start, limit)

    def _layout(query, starts, seq_len):
        """(batch, heads, length, head_dim) of a call, and how to read a tensor's (b, h, t, d) strides:
        packed tensors are (tokens, H, D) whose sequence b starts at token starts[b]; a (T, D) table of keys
        by position is the same for every sequence and head."""
        if starts is None:
            shape = query.shape
            grid_strides = lambda tensor: tensor.stride()  # noqa: E731
        else:
            shape = (starts.shape[0], query.shape[1], seq_len, query.shape[2])
            grid_strides = lambda tensor: (0, tensor.stride(1), tensor.stride(0), tensor.stride(2))  # noqa: E731
        return shape, lambda tensor: (0, 0, *tensor.stride()) if tensor.dim() == 2 else grid_strides(tensor)

    def _launch(
        kernel, shape, lengths, starts, rotary, key_table, bias, scale, dropout_p, splits, block_size, part_stride=0
    ):
        """The kernel over a grid of (block, batch·head) programs, with those of the shared options it takes."""
        batch, heads, length, head_dim = shape
        row_stride = _block(length)
        block = min(block_size, row_stride)
        dropped, keep_scale = _dropout_rule(dropout_p, UNIFORMS_PER_DRAW)
        options = dict(
            SCALE=scale, DROPOUT_P=dropout_p, DROPPED_LEVELS=dropped, KEEP_SCALE=keep_scale, HEAD_DIM=head_dim,
            ROW_STRIDE=row_stride, BLOCK=block, SPLITS=splits, HAS_LENGTHS=lengths is not None,
            PACKED=starts is not None, ROTARY=rotary, KEY_TABLE=key_table, HAS_BIAS=bias is not None,
            UNIFORMS=UNIFORMS_PER_DRAW,
            PRECOMPUTED=PRECOMPUTED_CORRECTION, PART_STRIDE=part_stride, INTERPRETED=_interpreted(),
        )  # fmt: skip
        options = {name: value for name, value in options.items() if name in kernel.arg_names}
        backward = kernel is _backward_kernel
        options["num_warps"] = launch_warps(backward, block)
        stages = (BACKWARD_NUM_STAGES if backward else None) or NUM_STAGES
        if stages is not None:
            options["num_stages"] = stages
        registers = BACKWARD_MAX_REGISTERS if backward else MAX_REGISTERS
        if registers is not None:
            options["maxnreg"] = registers
        if _recording is not None:  # `recorded_launches`: what the kernel would be handed, by argument name
            return lambda *arguments: _recording.append(
                (kernel, {**dict(zip(kernel.arg_names, (*arguments, heads, length))), **options})
            )
        launcher = torch.library.wrap_triton(kernel)[(triton.cdiv(length, block), batch * heads)]
        return lambda *arguments: launcher(*arguments, heads, length, **options)

    def _pointers(device, *optional):
        """Absent optional tensors as pointers the kernel never touches (its constexpr flags say so): one
        tensor of their own, shared by no input or output. torch.compile's functionalization of a Triton
        kernel gives every argument its analysis takes for written (conservatively, at times an unused one)
        a copy made before the launch, then rebinds the argument's tensor to that copy, argument after
        argument; an output passed twice could end up rebound to a copy the kernel never wrote. (Passing
        `out32` and `grad_q` here trained the perceiver's compiled latent blocks wrongly.)"""
        unused = torch.empty(1, device=device)
        return [unused if tensor is None else tensor for tensor in optional]

    @torch.library.triton_op("knowgpt::causal_attention_forward", mutates_args=())
    def _causal_attention_forward(
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        seed: torch.Tensor,
        lengths: torch.Tensor | None,
        starts: torch.Tensor | None,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
        bias: torch.Tensor | None,
        seq_len: int,
        scale: float,
        dropout_p: float,
        splits: int,
        block_size: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The output, its fp32 copy, the log-sum-exp, and rotated copies of query and key (empty without rotary).
        Without key and value, `query` holds queries, keys and values stacked: (tokens, 3, H, D)."""
        if key is None:
            query, key, value = query.unbind(1)
        shape, strides = _layout(query, starts, seq_len)
        batch, heads, length, head_dim = shape
        rotary = cos is not None
        # Outputs and gradients in the inputs' memory order: for the model's (B, T, H·D) views that makes
        # merging the heads a view and gathering the packed tokens a read of contiguous rows.
        out = torch.empty_like(query)
        out32 = torch.empty(shape, device=query.device, dtype=torch.float32)
        lse = torch.empty(batch * heads, length, device=query.device, dtype=torch.float32)
        # Rotated queries and keys for the backward pass (empty without rotary).
        rotated_query = torch.empty_like(query) if rotary else query.new_empty(0)
        rotated_key = torch.empty_like(key) if rotary else key.new_empty(0)
        rotated_strides = [*strides(rotated_query), *strides(rotated_key)] if rotary else [0] * 8  # never read
        _launch(
            _forward_kernel, shape, lengths, starts, rotary, key.dim() == 2, bias, scale, dropout_p, splits, block_size
        )(
            query, key, value, out, out32, lse, seed,
            *_pointers(query.device, lengths, starts, cos, sin, bias, *((rotated_query, rotated_key) if rotary else (None, None))),
            *strides(query), *strides(key), *strides(value), *strides(out), *rotated_strides,
        )  # fmt: skip
        return out, out32, lse, rotated_query, rotated_key

    @torch.library.triton_op("knowgpt::causal_attention_backward", mutates_args=())
    def _causal_attention_backward(
        grad_out: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        out32: torch.Tensor,
        lse: torch.Tensor,
        seed: torch.Tensor,
        lengths: torch.Tensor | None,
        starts: torch.Tensor | None,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
        bias: torch.Tensor | None,
        seq_len: int,
        scale: float,
        dropout_p: float,
        splits: int,
        block_size: int,
        stacked: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gradients of query, key, value and bias (empty without one); with rotary tables, `query` and `key`
        are the forward pass's rotated copies. `stacked` (packed tokens): one (tokens, 3, H, D) gradient of all
        three, in the query's place (the keys' and values' empty), written by the kernel where it lies; for a
        stacked input, where separate ones would be concatenated after."""
        shape, strides = _layout(query, starts, seq_len)
        batch, heads, length, head_dim = shape
        key_table = key.dim() == 2
        block_size = BACKWARD_BLOCK_SIZE or block_size
        grad_out = grad_out.to(query.dtype)
        part_stride = 0
        if stacked:
            grad_q = query.new_empty(query.shape[0], 3, *query.shape[1:])
            part_stride = grad_q.stride(1)
            gradient_strides = strides(grad_q[:, 0]) * 3
            grad_k, grad_v = (value.new_empty(0) for _ in range(2))
        else:
            grad_q, grad_v = torch.empty_like(query), torch.empty_like(value)
            # A shared table's gradient sums every sequence's and head's share: each program writes its own.
            grad_k = (
                torch.empty(batch, heads, length, head_dim, device=key.device) if key_table else torch.empty_like(key)
            )
            gradient_strides = (
                *strides(grad_q), *(grad_k.stride() if key_table else strides(grad_k)), *strides(grad_v)
            )  # fmt: skip
        grad_bias = torch.empty(batch * heads, length, device=key.device) if bias is not None else key.new_empty(0)
        launch = lambda kernel: _launch(  # noqa: E731
            kernel, shape, lengths, starts, cos is not None, key_table, bias, scale, dropout_p, splits, block_size,
            part_stride,
        )  # fmt: skip
        correction = None
        if PRECOMPUTED_CORRECTION:
            correction = torch.empty(batch * heads, length, device=query.device, dtype=torch.float32)
            launch(_correction_kernel)(
                grad_out, out32, correction, *_pointers(query.device, lengths, starts), *strides(grad_out)
            )
        launch(_backward_kernel)(
            query, key, value, *_pointers(query.device, None if PRECOMPUTED_CORRECTION else out32, correction),
            grad_out, lse, seed, *_pointers(query.device, lengths, starts, cos, sin, bias),
            grad_q, *(_pointers(query.device, None, None) if stacked else (grad_k, grad_v)),
            *_pointers(query.device, grad_bias if bias is not None else None),
            *strides(query), *strides(key), *strides(value), *strides(grad_out), *gradient_strides,
        )  # fmt: skip
        if key_table:
            grad_k = grad_k.sum((0, 1)).to(key.dtype)
            grad_bias = grad_bias.sum(0) if bias is not None else grad_bias
        return grad_q, grad_k, grad_v, grad_bias

    def _setup_context(ctx, inputs, output):
        query, key, value, seed, lengths, starts, cos, sin, bias, *options = inputs
        ctx.stacked = key is None
        if ctx.stacked:
            query, key, value = query.unbind(1)
        _, out32, lse, rotated_query, rotated_key = output
        if cos is not None:  # the backward pass reads the rotated copies instead
            query, key = rotated_query, rotated_key
        ctx.save_for_backward(query, key, value, out32, lse, seed, lengths, starts, cos, sin, bias)
        ctx.mark_non_differentiable(out32, lse, rotated_query, rotated_key)
        ctx.options = options

    def _backward(ctx, grad_out, *unused_grads):
        query, key, value, out32, lse, seed, lengths, starts, cos, sin, bias = ctx.saved_tensors
        grad_q, grad_k, grad_v, grad_bias = _causal_attention_backward(
            grad_out, query, key, value, out32, lse, seed, lengths, starts, cos, sin, bias, *ctx.options, ctx.stacked
        )
        if ctx.stacked:  # the stacked input's gradient; its key and value were None
            grad_k = grad_v = None
        # No gradients for the seed, lengths, starts, rotary tables and the options.
        return grad_q, grad_k, grad_v, *[None] * 5, grad_bias if bias is not None else None, *[None] * 5

    _causal_attention_forward.register_autograd(_backward, setup_context=_setup_context)


def fused_causal_attention(
    query,
    key,
    value,
    scale: float,
    dropout_p: float = 0.0,
    splits: int | None = None,
    seed=None,
    lengths=None,
    block_size: int | None = None,
    starts=None,
    seq_len: int | None = None,
    rotary=None,
    bias=None,
):
    """Causal softmax(Q Kᵀ · scale + bias) V with dropout on the weights, its softmax and sums in fp32; see the
    module docstring.

    `splits` (1–3, default `DEFAULT_SPLITS`): half-precision parts of the fp32 operands. `seed` (an int64
    tensor of one element on the inputs' device) fixes the dropout mask; by default each call draws one.
    `lengths` (B integers on the inputs' device, optional): positions from lengths[b] on are right padding:
    their outputs come back as zeros, their output gradients are ignored, and blocks made only of them are
    skipped (the real positions' results are those of the whole sequence, since no real query sees them).
    `block_size` (a power of two ≥ 16, default `BLOCK_SIZE`): positions per block of queries or keys.

    Packed sequences (`starts` and `seq_len` given, with `lengths`): query, key and value are (tokens, H, D)
    and hold B sequences back to back, sequence b being tokens starts[b] … starts[b] + lengths[b] − 1,
    each at most `seq_len` long; every token must belong to one sequence. The result is (tokens, H, D),
    the same numbers (same dropout mask for the same seed) as the (B, H, seq_len, D) call with `lengths`
    gives for the real positions, without moving the tokens into that grid and back.

    `rotary` (optional): (cos, sin) fp32 tables of shape (T, D/2): queries and keys are first rotated as
    rotary position embedding does, the feature pair (2i, 2i+1) at position t by the angle of
    cos[t, i], sin[t, i], in fp32 and rounded to the inputs' precision (as rotating them beforehand
    would), and their gradients are those of the unrotated inputs.

    Keys by position (the synthesizer's): `key` may be a (T', D) table, T' ≥ T, whose row t is the key of
    position t in every sequence and head; its gradient sums theirs. `bias` (optional, T' values): added to
    the score of every key at position t (computed in fp32), with its gradient.

    Stacked (packed sequences only): with `key` and `value` None, `query` is (tokens, 3, H, D), queries, keys and
    values stacked, as one projection of the three gives them; its gradient is written as one tensor, where three
    separate ones would be concatenated after."""
    packed = starts is not None or seq_len is not None
    if packed and (starts is None or seq_len is None or lengths is None):
        raise ValueError("packed sequences need all of lengths, starts and seq_len")
    stacked = query if key is None and value is None else None
    if stacked is not None:
        if not packed or query.dim() != 4 or query.shape[1] != 3:
            raise ValueError(
                "without key and value, query must stack queries, keys and values of packed sequences: "
                f"(tokens, 3, H, D) with lengths, starts and seq_len; got {tuple(query.shape)}"
            )
        query, key, value = stacked.unbind(1)
    if not supports_fused_attention(query, key, value, None, True, seq_len=seq_len if packed else None):
        layout = f"(tokens, H, D) with seq_len ≤ {MAX_SEQ_LEN}" if packed else f"(B, H, T ≤ {MAX_SEQ_LEN}, D)"
        raise ValueError(
            f"fused_causal_attention needs Triton and bf16 CUDA tensors of one shape {layout} (keys: or a (≥ T, D) table) "
            f"with D a power of two ≥ 16; got {tuple(query.shape)} {query.dtype} on {query.device}"
        )
    splits = DEFAULT_SPLITS if splits is None else splits
    if splits not in (1, 2, 3):
        raise ValueError(f"splits must be 1, 2 or 3, got {splits!r}")
    block_size = BLOCK_SIZE if block_size is None else block_size
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two ≥ 16, got {block_size!r}")
    batch = lengths.shape[0] if packed else query.shape[0]
    for name, tensor in (("lengths", lengths), ("starts", starts)):
        if tensor is not None and (tensor.shape != (batch,) or tensor.device != query.device):
            raise ValueError(
                f"{name} must hold one integer per sequence ({batch}) on {query.device}, "
                f"got shape {tuple(tensor.shape)} on {tensor.device}"
            )
    if packed and batch * query.shape[1] * _block(seq_len) ** 2 >= 2**31:
        raise ValueError("too many sequences for the kernel's int32 dropout offsets")
    if packed and not (torch.compiler.is_compiling() or _capturing(query)):  # compiled and graphed code trusts it
        covered = int(lengths.sum())
        if covered != query.shape[0]:
            raise ValueError(
                f"packed sequences must cover every token: lengths sum to {covered}, not {query.shape[0]}"
            )
    if seed is None:
        seed = draw_seed(query.device)
    lengths = lengths.to(torch.int32) if lengths is not None else None
    starts = starts.to(torch.int32) if starts is not None else None
    seq_len = seq_len if packed else query.shape[2]
    cos, sin = (None, None) if rotary is None else (table.float().contiguous() for table in rotary)
    if cos is not None and (cos.shape != (seq_len, query.shape[-1] // 2) or sin.shape != cos.shape):
        raise ValueError(
            f"rotary tables must be (T, D/2) = {(seq_len, query.shape[-1] // 2)}, "
            f"got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    if key.dim() == 2:
        if cos is not None:
            raise ValueError("rotary needs keys per token, not a table of keys by position")
        key = key[:seq_len]
    if bias is not None:
        if bias.dim() != 1 or bias.shape[0] < seq_len or bias.device != query.device:
            raise ValueError(
                f"bias must hold one value per key position (at least {seq_len}) on {query.device}, "
                f"got shape {tuple(bias.shape)} on {bias.device}"
            )
        bias = bias[:seq_len].float()
    inputs = (query, key, value) if stacked is None else (stacked, None, None)
    out, *_ = _causal_attention_forward(
        *inputs, seed, lengths, starts, cos, sin, bias, seq_len, float(scale), float(dropout_p), int(splits),
        int(block_size),
    )  # fmt: skip
    return out


_recording: list | None = None


@contextlib.contextmanager
def recorded_launches():
    """Record the kernels' launches instead of running them, for tests and diagnostics (Triton needed, no
    GPU): a list of (kernel, {argument name: value}) pairs, the constexpr options included."""
    global _recording
    _recording = []
    try:
        yield _recording
    finally:
        _recording = None


def dropout_keep_mask(seed: torch.Tensor, batch: int, heads: int, length: int, dropout_p: float):
    """The (B, H, T, T) boolean mask of the weights the kernels keep for `seed`, for tests and debugging."""
    block = _block(length)
    keep = torch.empty(batch * heads, block, block, dtype=torch.int8, device=seed.device)
    dropped, _ = _dropout_rule(dropout_p, UNIFORMS_PER_DRAW)
    _mask_kernel[(batch * heads,)](seed, keep, dropout_p, dropped, ROW_STRIDE=block, UNIFORMS=UNIFORMS_PER_DRAW)
    return keep[:, :length, :length].bool().view(batch, heads, length, length)


if triton is not None:

    @triton.jit
    def _mask_kernel(SEED, KEEP, dropout_p, dropped_levels, ROW_STRIDE: tl.constexpr, UNIFORMS: tl.constexpr):
        program = tl.program_id(0)
        rows = tl.arange(0, ROW_STRIDE)
        keep = _dropout_keep(SEED, program, rows, 0, ROW_STRIDE, ROW_STRIDE, dropout_p, dropped_levels, UNIFORMS)
        offsets = program * ROW_STRIDE * ROW_STRIDE + rows[:, None] * ROW_STRIDE + rows[None, :]
        tl.store(KEEP + offsets, keep.to(tl.int8))


__all__ = [
    "DEFAULT_SPLITS",
    "dropout_keep_mask",
    "fused_attention_available",
    "fused_causal_attention",
    "supports_fused_attention",
]
