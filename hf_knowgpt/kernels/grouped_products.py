"""A compiled training step's weight gradients taken together at the end of its backward pass: every linear layer's
`gradientᵀ · input` product (bf16 or fp16 operands, fp32 results) in one Triton launch.

Why: at the handout's size each of the sixteen weight-gradient products (four layers, four linear layers each) has
4–16 output tiles of 128 × 128 for 132 multiprocessors, so cuBLAS splits its 7680 tokens into parts and adds them in
a reduce kernel of its own: 0.17–0.19 ms of the 1.37 ms step, 120–340 TFLOP/s (H200, benchmarks/RESULTS.md).
Together they have 192 tiles. The backward pass does not need them until the update, so they can wait for each other.
The tiles' last wave leaves multiprocessors idle, where the wide layers' bias gradients (column sums of the same
gradients, eight launches of `column_sums`'s kernel, 45 µs a step) can run as programs of the same launch.

How: `WeightGradientsTogether` is a pass over inductor's backward graph (`post_grad_custom_post_pass`). It finds the
products the package's linear layers write in fp32 (`torch.mm(gradᵀ, input, out_dtype=torch.float32)`,
`layers_knowgpt.WEIGHT_GRADIENT_IN_FP32`) and puts one `knowgpt::transposed_products` call in their place, after the
last of their operands is computed, its flat fp32 result viewed as each product's; with `COLUMN_SUMS_TOGETHER`, it
also takes the `column_sums` of those gradients into the call. That op's kernel gives every program one tile of one
product, or one block of one gradient's column sums, after all tiles, over one part of the tokens (`SPLITS` parts,
summed after in a fixed order: no atomics, so a seeded run repeats); it reaches each product's operands through the
tuple of tensors it is handed (no table of addresses, so a captured CUDA graph replays it as it is). Where the kernel
does not apply (no Triton, a CPU tensor without Triton's interpreter, operands not contiguous or not 16-aligned) the
op runs the products and sums in torch.

On an H100 the launch with the sums took 116 µs where cuBLAS's sixteen products took 210 µs and, with
`column_sums`'s eight, 319 µs (`benchmarks/diagnostics/grouped_weight_gradients.py`), and the handout recipe's steps
19.8-20.1 s against 22.0-22.4 s (`GraphedStepper.WEIGHT_GRADIENTS_TOGETHER`, on; benchmarks/RESULTS.md).
"""

import math
import operator
import warnings

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from . import column_sums as column_sums_kernels
from .column_sums import column_sums, weight_gradient
from .fused_attention import _interpreted, triton

if triton is not None:
    import triton.language as tl

# Output tile, tokens per load, token parts, warps and pipeline stages of the kernel: the fastest with the sums of nine
# configurations timed on an H100 (116 µs; 128 × 256 tiles took 107 µs without the sums, 142 µs with them).
BLOCK_M, BLOCK_N, BLOCK_K, SPLITS, NUM_WARPS, NUM_STAGES = 128, 128, 64, 1, 8, 3
OPERAND_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # fp32: the interpreter's tests (it has no bf16)
# The pass also takes into the launch the column sums that `column_sums.column_sums` computes with a kernel of its own
# (the wide linear layers' bias gradients) where their gradient is one of the products'.
COLUMN_SUMS_TOGETHER = True
# Tokens per load of a column-sum block (its loop is not pipelined as the products' is): 116 µs for the launch with
# 128, 115 µs with 64, 153 µs with 256 (H100).
SUM_BLOCK_TOKENS = 128


if triton is not None:

    @triton.jit
    def _product_tile(
        tile, begin, end, GRADIENTS, INPUTS, out,
        OUT_FEATURES: tl.constexpr, IN_FEATURES: tl.constexpr, FIRST_TILES: tl.constexpr,
        TILE_COLUMNS: tl.constexpr, OFFSETS: tl.constexpr, PRODUCTS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr,
    ):  # fmt: skip
        """Tile `tile`, of the product whose tiles begin at the last FIRST_TILES at or below it: out[the product's
        offset + row · columns + column] = Σ over tokens [begin, end) of gradient[token, row] · input[token, column]."""
        gradient, states = GRADIENTS[0], INPUTS[0]
        out_features, in_features, first_tile = OUT_FEATURES[0], IN_FEATURES[0], FIRST_TILES[0]
        tile_columns, offset = TILE_COLUMNS[0], OFFSETS[0]
        for product in tl.static_range(1, PRODUCTS):  # selects, not branches: one pointer and size each
            later = tile >= FIRST_TILES[product]
            gradient = tl.where(later, GRADIENTS[product], gradient)
            states = tl.where(later, INPUTS[product], states)
            out_features = tl.where(later, OUT_FEATURES[product], out_features)
            in_features = tl.where(later, IN_FEATURES[product], in_features)
            first_tile = tl.where(later, FIRST_TILES[product], first_tile)
            tile_columns = tl.where(later, TILE_COLUMNS[product], tile_columns)
            offset = tl.where(later, OFFSETS[product], offset)
        within = tile - first_tile
        rows = (within // tile_columns) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = (within % tile_columns) * BLOCK_N + tl.arange(0, BLOCK_N)
        accumulated = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for start in range(begin, end, BLOCK_K):
            token = (start + tl.arange(0, BLOCK_K)).to(tl.int64)
            gradient_block = gradient + token[:, None] * out_features + rows[None, :]
            input_block = states + token[:, None] * in_features + cols[None, :]
            if EVEN:
                a = tl.load(gradient_block)
                b = tl.load(input_block)
            else:
                a = tl.load(gradient_block, mask=(token[:, None] < end) & (rows[None, :] < out_features), other=0.0)
                b = tl.load(input_block, mask=(token[:, None] < end) & (cols[None, :] < in_features), other=0.0)
            accumulated = tl.dot(tl.trans(a), b, accumulated)
        written = out + offset + rows[:, None] * in_features + cols[None, :]
        tl.store(written, accumulated, mask=(rows[:, None] < out_features) & (cols[None, :] < in_features))

    @triton.jit
    def _column_sum_block(
        block, begin, end, GRADIENTS, out, OUT_FEATURES: tl.constexpr, SUMMED: tl.constexpr,
        FIRST_SUM_BLOCKS: tl.constexpr, SUM_OFFSETS: tl.constexpr, SUMS: tl.constexpr,
        BLOCK_M: tl.constexpr, SUM_BLOCK_TOKENS: tl.constexpr,
    ):  # fmt: skip
        """Block `block` of BLOCK_M columns of gradient SUMMED[s], s the last FIRST_SUM_BLOCKS at or below it:
        out[SUM_OFFSETS[s] + column] = Σ over tokens [begin, end) of gradient[token, column]."""
        gradient, width = GRADIENTS[SUMMED[0]], OUT_FEATURES[SUMMED[0]]
        first_block, offset = FIRST_SUM_BLOCKS[0], SUM_OFFSETS[0]
        for summed in tl.static_range(1, SUMS):
            later = block >= FIRST_SUM_BLOCKS[summed]
            gradient = tl.where(later, GRADIENTS[SUMMED[summed]], gradient)
            width = tl.where(later, OUT_FEATURES[SUMMED[summed]], width)
            first_block = tl.where(later, FIRST_SUM_BLOCKS[summed], first_block)
            offset = tl.where(later, SUM_OFFSETS[summed], offset)
        columns = (block - first_block) * BLOCK_M + tl.arange(0, BLOCK_M)
        total = tl.zeros((SUM_BLOCK_TOKENS, BLOCK_M), tl.float32)
        for start in range(begin, end, SUM_BLOCK_TOKENS):
            token = (start + tl.arange(0, SUM_BLOCK_TOKENS)).to(tl.int64)
            mask = (token[:, None] < end) & (columns[None, :] < width)
            total += tl.load(gradient + token[:, None] * width + columns[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(out + offset + columns, tl.sum(total, 0), mask=columns < width)

    @triton.jit
    def _transposed_products(
        GRADIENTS, INPUTS, OUT, tokens, split_tokens, split_stride,
        OUT_FEATURES: tl.constexpr, IN_FEATURES: tl.constexpr, FIRST_TILES: tl.constexpr,
        TILE_COLUMNS: tl.constexpr, OFFSETS: tl.constexpr, PRODUCTS: tl.constexpr, PRODUCT_TILES: tl.constexpr,
        SUMMED: tl.constexpr, FIRST_SUM_BLOCKS: tl.constexpr, SUM_OFFSETS: tl.constexpr, SUMS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLITS: tl.constexpr,
        EVEN: tl.constexpr, SUM_BLOCK_TOKENS: tl.constexpr,
    ):  # fmt: skip
        """Program p takes work item p // SPLITS over token part p % SPLITS, writing to OUT + part · split_stride:
        below PRODUCT_TILES a product's tile, from there on a block of a gradient's column sums (SUMS of them; none:
        no branch at all). The sums are memory-bound and come last, into the slots the tiles' last wave leaves free.
        EVEN: every part whole loads of BLOCK_K tokens and every product whole tiles, so no product's load needs a
        mask."""
        program = tl.program_id(0)
        item, part = program // SPLITS, program % SPLITS
        begin = part * split_tokens
        end = tl.minimum(begin + split_tokens, tokens)
        out = OUT + part.to(tl.int64) * split_stride
        if SUMS == 0:
            _product_tile(
                item, begin, end, GRADIENTS, INPUTS, out, OUT_FEATURES, IN_FEATURES, FIRST_TILES, TILE_COLUMNS,
                OFFSETS, PRODUCTS, BLOCK_M, BLOCK_N, BLOCK_K, EVEN,
            )  # fmt: skip
        elif item < PRODUCT_TILES:
            _product_tile(
                item, begin, end, GRADIENTS, INPUTS, out, OUT_FEATURES, IN_FEATURES, FIRST_TILES, TILE_COLUMNS,
                OFFSETS, PRODUCTS, BLOCK_M, BLOCK_N, BLOCK_K, EVEN,
            )  # fmt: skip
        else:
            _column_sum_block(
                item - PRODUCT_TILES, begin, end, GRADIENTS, out, OUT_FEATURES, SUMMED, FIRST_SUM_BLOCKS,
                SUM_OFFSETS, SUMS, BLOCK_M, SUM_BLOCK_TOKENS,
            )  # fmt: skip


def _kernel_applies(gradients, inputs) -> bool:
    if triton is None:
        return False
    first = gradients[0]
    tensors = (*gradients, *inputs)
    on_cpu = first.device.type == "cpu"  # Triton's interpreter: its memory holds no bf16, so fp32 only there
    return (
        (first.device.type == "cuda" or (on_cpu and _interpreted()))
        and (first.dtype == torch.float32 if on_cpu else first.dtype in OPERAND_DTYPES)
        and all(t.device == first.device and t.dtype == first.dtype and t.is_contiguous() for t in tensors)
        and all(t.data_ptr() % 16 == 0 and t.shape[1] % 16 == 0 for t in tensors)  # 16-byte loads
    )


def _products_in_torch(gradients, inputs, summed) -> torch.Tensor:
    if gradients[0].is_cuda and gradients[0].dtype != torch.float32:  # as the linear layers write them
        products = [weight_gradient(g, x, in_fp32=True) for g, x in zip(gradients, inputs)]
    else:  # torch.mm takes out_dtype on CUDA only
        products = [g.t().float() @ x.float() for g, x in zip(gradients, inputs)]
    sums = [column_sums(gradients[index]) for index in summed]  # as the linear layers sum them
    return torch.cat([product.flatten() for product in products] + sums)


def _check_operands(gradients, inputs, summed):
    if len(gradients) != len(inputs) or not gradients:
        raise ValueError(f"{len(gradients)} gradients and {len(inputs)} inputs: one of each per product, at least one")
    tokens = gradients[0].shape[0]
    if any(t.dim() != 2 or t.shape[0] != tokens for t in (*gradients, *inputs)):
        raise ValueError("every gradient and input must be a (tokens, features) matrix, with the same tokens")
    if any(not 0 <= index < len(gradients) for index in summed):
        raise ValueError(f"summed names gradients {list(summed)}; there are {len(gradients)}")


@torch.library.custom_op("knowgpt::transposed_products", mutates_args=())
def transposed_products(
    gradients: list[torch.Tensor], inputs: list[torch.Tensor], summed: list[int] | None = None
) -> torch.Tensor:
    """`gradients[i]ᵀ · inputs[i]` for every i, in fp32, flattened one after another into one tensor: each (tokens,
    out_featuresᵢ) gradient and (tokens, in_featuresᵢ) input gives out_featuresᵢ × in_featuresᵢ elements; then, for
    each index j of `summed`, the column sums of gradients[j] (a linear layer's bias gradient), out_featuresⱼ more."""
    summed = list(summed or ())
    _check_operands(gradients, inputs, summed)
    tokens = gradients[0].shape[0]
    if not _kernel_applies(gradients, inputs):
        if gradients[0].is_cuda and triton is not None:  # correct, but not what the pass was put there for
            warnings.warn(
                "knowgpt::transposed_products: the kernel takes contiguous bf16 or fp16 operands at 16-byte aligned "
                "addresses with widths a multiple of 16; these run as torch's products one after another",
                stacklevel=2,
            )
        return _products_in_torch(gradients, inputs, summed)
    out_features = tuple(g.shape[1] for g in gradients)
    in_features = tuple(x.shape[1] for x in inputs)
    tile_columns = tuple(triton.cdiv(n, BLOCK_N) for n in in_features)
    first_tiles, offsets, tiles, total = [], [], 0, 0
    for rows, cols, columns in zip(out_features, in_features, tile_columns):
        first_tiles.append(tiles)
        offsets.append(total)
        tiles += triton.cdiv(rows, BLOCK_M) * columns
        total += rows * cols
    first_sum_blocks, sum_offsets, sum_blocks = [], [], 0
    for index in summed:
        first_sum_blocks.append(sum_blocks)
        sum_offsets.append(total)
        sum_blocks += triton.cdiv(out_features[index], BLOCK_M)
        total += out_features[index]
    # each part whole loads of BLOCK_K tokens, so that only the last part may end inside one
    split_tokens = max(BLOCK_K, triton.cdiv(triton.cdiv(tokens, SPLITS), BLOCK_K) * BLOCK_K)
    even = tokens % split_tokens == 0 and all(
        rows % BLOCK_M == 0 and cols % BLOCK_N == 0 for rows, cols in zip(out_features, in_features)
    )
    out = torch.empty(SPLITS * total, dtype=torch.float32, device=gradients[0].device)
    _transposed_products[((tiles + sum_blocks) * SPLITS,)](
        tuple(gradients), tuple(inputs), out, tokens, split_tokens, total,
        OUT_FEATURES=out_features, IN_FEATURES=in_features, FIRST_TILES=tuple(first_tiles), TILE_COLUMNS=tile_columns,
        OFFSETS=tuple(offsets), PRODUCTS=len(gradients), PRODUCT_TILES=tiles, SUMMED=tuple(summed) or (0,),
        FIRST_SUM_BLOCKS=tuple(first_sum_blocks) or (0,), SUM_OFFSETS=tuple(sum_offsets) or (0,), SUMS=len(summed),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, SPLITS=SPLITS, EVEN=even,
        SUM_BLOCK_TOKENS=SUM_BLOCK_TOKENS, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )  # fmt: skip
    return out if SPLITS == 1 else out.view(SPLITS, total).sum(0)


@transposed_products.register_fake
def _(gradients, inputs, summed=None):
    summed = list(summed or ())
    _check_operands(gradients, inputs, summed)
    total = sum(g.shape[1] * x.shape[1] for g, x in zip(gradients, inputs))
    total += sum(gradients[index].shape[1] for index in summed)
    return gradients[0].new_empty((total,), dtype=torch.float32)


def _weight_gradient_operands(node: torch.fx.Node):
    """(gradient, input) nodes where `node` is `torch.mm(gradientᵀ, input, out_dtype=torch.float32)` of 16-bit
    (tokens, features) matrices whose features are not symbols, as the package's linear layers write their weight
    gradients; else None."""
    aten = torch.ops.aten
    if node.op != "call_function" or node.target is not aten.mm.dtype or len(node.args) < 3:
        return None
    transposed, states, out_dtype = node.args[:3]
    if (
        out_dtype != torch.float32
        or not isinstance(transposed, torch.fx.Node)
        or not isinstance(states, torch.fx.Node)
    ):
        return None
    is_transpose = transposed.target is aten.t.default or (
        transposed.target is aten.permute.default and list(transposed.args[1]) == [1, 0]
    )
    if not is_transpose:
        return None
    gradient = transposed.args[0]
    values = [getattr(n, "meta", {}).get("val") for n in (gradient, states)]
    if any(v is None or v.dim() != 2 or v.dtype not in (torch.bfloat16, torch.float16) for v in values):
        return None
    if not all(isinstance(v.shape[1], int) for v in values):  # the kernel is built for each product's shape
        return None
    return gradient, states


def _column_sums_operand(node: torch.fx.Node):
    """(gradient, nodes computing the sum) where `node` gives the column sums that `column_sums`'s kernel computes
    for a gradient: its op `knowgpt::column_sums` itself, or, as inductor's graphs have it (the op decomposed), the
    `sum(0)` of the partial sums that the kernel's functional wrapper wrote into an empty buffer; else None."""
    if node.op != "call_function":
        return None
    if hasattr(torch.ops.knowgpt, "column_sums") and node.target is torch.ops.knowgpt.column_sums.default:
        return node.args[0], (node,)
    if node.target is not torch.ops.aten.sum.dim_IntList or list(node.args[1:]) != [[0]] or node.kwargs:
        return None
    partial = node.args[0]
    if not (
        isinstance(partial, torch.fx.Node) and partial.target is operator.getitem and partial.args[1] == "PARTIAL"
    ):
        return None
    wrapper = partial.args[0]
    if wrapper.target is not torch.ops.higher_order.triton_kernel_wrapper_functional:
        return None
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    kernel = kernel_side_table.get_kernel(wrapper.kwargs["kernel_idx"])
    strip_sums = getattr(column_sums_kernels, "_strip_sums", None)
    if strip_sums is None or not (kernel is strip_sums or getattr(kernel, "fn", None) is strip_sums):
        return None  # (inductor keeps a user's kernel wrapped in an autotuner, `fn` the kernel itself)
    arguments = wrapper.kwargs["kwargs"]
    return arguments["MATRIX"], (node, partial, wrapper, arguments["PARTIAL"])


class WeightGradientsTogether(CustomGraphPass):
    """Inductor's post-grad pass: a backward graph's fp32 weight-gradient products of one token count (two or more)
    become one `knowgpt::transposed_products` call, placed after the last of their operands, and views of its result;
    with `column_sums` (default: COLUMN_SUMS_TOGETHER), the column sums of their gradients that `column_sums`'s
    kernel computes too. Products of another token count (the perceiver's latent layers beside its input layers)
    make a call of their own."""

    def __init__(self, column_sums: bool | None = None):
        self.column_sums = COLUMN_SUMS_TOGETHER if column_sums is None else column_sums

    def __call__(self, graph: torch.fx.Graph) -> None:
        from torch._inductor.pattern_matcher import stable_topological_sort

        by_tokens = {}  # the products' token count (a number or a symbol's expression, as text): [(node, operands)]
        for node in graph.nodes:
            if operands := _weight_gradient_operands(node):
                by_tokens.setdefault(str(operands[0].meta["val"].shape[0]), []).append((node, operands))
        groups = [found for found in by_tokens.values() if len(found) >= 2]
        if not groups:
            return
        for found in groups:
            self._take_together(graph, found)
        stable_topological_sort(graph)  # a product's users may have come before its operands' last
        graph.lint()

    def _take_together(self, graph: torch.fx.Graph, found) -> None:
        """One call for the products `found` ((node, (gradient, input)) of one token count), and the sums."""
        order = {node: position for position, node in enumerate(graph.nodes)}
        gradients = [gradient for _, (gradient, _) in found]
        inputs = [states for _, (_, states) in found]
        sums = []  # (index of the gradient, the nodes computing its sum), where column_sums's kernel sums a gradient
        if self.column_sums:
            index_of = {gradient: index for index, gradient in reversed(list(enumerate(gradients)))}
            for node in graph.nodes:
                if (summed := _column_sums_operand(node)) and summed[0] in index_of:
                    sums.append((index_of[summed[0]], summed[1]))
        last = max((*gradients, *inputs), key=order.__getitem__)
        op = torch.ops.knowgpt.transposed_products.default
        summed = [index for index, _ in sums]
        with graph.inserting_after(last):
            together = graph.call_function(op, (gradients, inputs, summed))
        together.meta["val"] = op([g.meta["val"] for g in gradients], [x.meta["val"] for x in inputs], summed)
        replaced = [(node, node.meta["val"].shape) for node, _ in found]
        replaced += [(computed[0], computed[0].meta["val"].shape) for _, computed in sums]
        offset, previous = 0, together
        for node, shape in replaced:
            size = math.prod(shape)
            with graph.inserting_after(previous):
                part = graph.call_function(torch.ops.aten.slice.Tensor, (together, 0, offset, offset + size))
            part.meta["val"] = together.meta["val"][offset : offset + size]
            with graph.inserting_after(part):
                result = graph.call_function(torch.ops.aten.view.default, (part, list(shape)))
            result.meta["val"] = part.meta["val"].view(shape)
            node.replace_all_uses_with(result)
            offset, previous = offset + size, result
        unused = [node.args[0] for node, _ in found] + [node for node, _ in found]
        unused += [node for _, computed in sums for node in computed]
        for node in reversed(sorted(set(unused), key=order.__getitem__)):  # users before what they use
            if not node.users:
                graph.erase_node(node)

    def uuid(self) -> str:
        return get_hash_for_files((__file__,)).hex() + ("-column-sums" if self.column_sums else "")

    def __repr__(self) -> str:  # part of the compiled step's key (fast_path's artifacts file): the code, no address
        return f"{type(self).__name__}({self.uuid()[:16]}, column_sums={self.column_sums})"

    def __eq__(self, other) -> bool:  # the same code and settings: the same pass (options compare equal)
        return isinstance(other, WeightGradientsTogether) and other.uuid() == self.uuid()

    def __hash__(self) -> int:
        return hash(self.uuid())


__all__ = ["WeightGradientsTogether", "transposed_products"]
