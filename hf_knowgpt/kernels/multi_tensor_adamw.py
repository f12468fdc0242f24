"""The graphed training step's update in three launches for all parameters: the gradients' global-norm clipping,
the step's learning rate from the schedule, and AdamW.

Why: torch's fused AdamW walks its tensor lists in chunks of 65536 elements, one block of threads per chunk,
so the handout model's 3.3M parameters (two groups: decayed and not) give about 60 blocks for the 132
multiprocessors of an H100 or H200: its two launches took 62 µs of the 1.55 ms step (H200 profile,
benchmarks/RESULTS.md), more than twice what their 91 MB of reads and writes need at the memory's speed, and
the clipping's norms and scaling, compiled by inductor, took kernels of their own beside them. Where torch's
chunks fill the card (51M parameters at width 1024), the three launches still take less (benchmarks/RESULTS.md).

How: every block of every parameter gets a program of its own (a few thousand), which reaches the parameter's
gradient through a table of the gradients' addresses: `_squared_sums` sums the squares of its block, `_finish`
(one program) adds those sums into the global norm, turns it into the clipping coefficient, reads the step's
learning rate from the schedule, counts the optimizer's step and computes its bias corrections, and `_update`
applies the clipped gradient to the parameter and its two moments. The gradients are read where autograd left
them: concatenated into one buffer first (`torch.cat`), they cost the handout's step 22 µs on an H200
(benchmarks/RESULTS.md). Where they already lie in one buffer (several processes sum them in one), the kernels
read them there (`step`'s `flat_gradients`). A captured graph's gradients keep their addresses at every replay, so
each capture gets a table of its own, made before it outside the graphs' memory pool and filled once it ends
(`tables_captured`); a step run uncaptured fills one shared table first. Everything the step reads is on the
device, so the three launches can be captured in a CUDA graph and replayed. The moments live in two flat buffers
and the step counts in a third, of which the optimizer's state tensors are views, so that checkpoints save and
load them as before (each parameter's count its own element: torch's optimizer, resuming, counts each); the
parameters keep storages of their own (transformers and accelerate save tensors that share a storage as one
tied weight) and are reached through a table of their addresses. Parameters whose gradient is None at the
first step are left out, as torch's optimizer leaves them, and must stay so.

The arithmetic is torch's AdamW (decoupled weight decay) after `clip_grad_norm_`, in fp32:
`p ← p·(1 − lr·λ) − lr/(1 − β₁ᵗ) · m / (√v / √(1 − β₂ᵗ) + ε)` with `m ← β₁m + (1 − β₁)g`,
`v ← β₂v + (1 − β₂)g²` and `g` the gradient times `min(1, max_norm / (‖g‖ + 10⁻⁶))`; only the order of the norm's
sums and the rounding of the bias corrections differ (tests/test_multi_tensor_adamw.py compares both with
torch's). It runs on a CUDA device, or on the CPU under Triton's interpreter (TRITON_INTERPRET=1).
"""

import itertools

import torch

from .fused_attention import _interpreted, triton

if triton is not None:
    import triton.language as tl

# False: the gradients concatenated into one buffer first (`torch.cat`) and read from there, as a benchmark's
# baseline (benchmarks/diagnostics/step_variants.py's `gradients-concatenated`).
GRADIENTS_IN_PLACE = True
# Elements per program of the squared sums and of the update (one per block of each parameter: about 3300 for the
# handout model, enough to keep every multiprocessor's memory requests in flight).
UPDATE_BLOCK = 1024


def multi_tensor_adamw_applies(optimizer, parameters) -> bool:
    """Whether `MultiTensorAdamW` can take over `optimizer`'s steps for `parameters`: a torch AdamW (decoupled
    weight decay, no amsgrad, not maximizing) whose groups share their betas, eps and one learning-rate tensor
    and hold exactly these parameters, all fp32 and contiguous on one CUDA device (or on the CPU under Triton's
    interpreter)."""
    if triton is None or not isinstance(optimizer, torch.optim.AdamW) or not parameters:
        return False
    device = parameters[0].device
    if not (device.type == "cuda" or (device.type == "cpu" and _interpreted())):
        return False
    groups = optimizer.param_groups
    first = groups[0]
    grouped = [id(p) for group in groups for p in group["params"]]
    return (
        sorted(grouped) == sorted(id(p) for p in parameters)
        and all(p.dtype == torch.float32 and p.is_contiguous() and p.device == device for p in parameters)
        and all(
            not group["amsgrad"]
            and not group["maximize"]
            and group.get("decoupled_weight_decay", True)
            and tuple(group["betas"]) == tuple(first["betas"])
            and group["eps"] == first["eps"]
            and group["lr"] is first["lr"]
            and torch.is_tensor(group["lr"])
            for group in groups
        )
    )


class MultiTensorAdamW:
    """`clip_grad_norm_(parameters, max_norm)`, the learning rate of step `step_counter` from `learning_rates`
    written into `learning_rate` (the optimizer's shared rate tensor), and `optimizer.step()`, in three launches
    that a CUDA graph can capture; `optimizer` keeps the state (its moments and step counts become views of flat
    buffers), so it saves and resumes as before. `max_norm` 0 or None clips nothing. Check
    `multi_tensor_adamw_applies` first."""

    def __init__(self, optimizer, parameters, max_norm, learning_rates: torch.Tensor, learning_rate: torch.Tensor):
        self.optimizer = optimizer
        self.parameters = list(parameters)
        self.max_norm = float(max_norm or 0.0)
        self.learning_rates = learning_rates
        self.learning_rate = learning_rate
        self.updated = None  # the parameters with gradients at the first step: the ones every step updates
        self.uncaptured_table = None  # the gradients' addresses for a step run uncaptured, written before it
        self.captured_tables = []  # (table, addresses) of each captured step: kept, as its graph reads it
        self.unfilled_tables = []  # those of captures not yet ended
        self.spare_table = None  # the table the next capture takes, made outside any capture

    def _bind(self, updated):
        """Flat moments and step counts and the device tables, for the parameters `updated` (first step)."""
        optimizer, device = self.optimizer, updated[0].device
        group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
        self.beta1, self.beta2 = (float(beta) for beta in optimizer.param_groups[0]["betas"])
        self.eps = float(optimizer.param_groups[0]["eps"])
        numels = [p.numel() for p in updated]
        offsets = list(itertools.accumulate(numels, initial=0))
        total = offsets[-1]
        self.exp_avg = torch.zeros(total, dtype=torch.float32, device=device)
        self.exp_avg_sq = torch.zeros(total, dtype=torch.float32, device=device)
        self.step_counts = torch.zeros(len(updated), dtype=torch.float32, device=device)
        counts = set()
        for index, (parameter, start, numel) in enumerate(zip(updated, offsets, numels)):
            state = optimizer.state[parameter]
            for key, flat in (("exp_avg", self.exp_avg), ("exp_avg_sq", self.exp_avg_sq)):
                view = flat[start : start + numel].view_as(parameter)
                if key in state:  # resumed from a checkpoint
                    view.copy_(state[key])
                state[key] = view
            if "step" in state:
                counts.add(float(state["step"]))
            state["step"] = self.step_counts[index]
        if len(counts) > 1:
            raise ValueError(f"the optimizer's parameters took different numbers of steps ({sorted(counts)})")
        self.step_counts.fill_(counts.pop() if counts else 0.0)
        self.scalars = torch.empty(4, dtype=torch.float32, device=device)
        # One program per block of each parameter: which parameter, and where in it the block starts.
        block_tensor, block_start = [], []
        for index, numel in enumerate(numels):
            starts = range(0, numel, UPDATE_BLOCK)
            block_tensor += [index] * len(starts)
            block_start += starts
        self.block_tensor = torch.tensor(block_tensor, dtype=torch.int32, device=device)
        self.partial_sums = torch.empty(len(block_tensor), dtype=torch.float32, device=device)
        self.block_start = torch.tensor(block_start, dtype=torch.int32, device=device)
        self.offsets = torch.tensor(offsets[:-1], dtype=torch.int64, device=device)
        self.numels = torch.tensor(numels, dtype=torch.int32, device=device)
        self.addresses = torch.tensor([p.data_ptr() for p in updated], dtype=torch.int64, device=device)
        decays = [float(group_of[id(p)]["weight_decay"]) for p in updated]
        self.weight_decays = torch.tensor(decays, dtype=torch.float32, device=device)
        self.spare_table = torch.empty(len(updated), dtype=torch.int64, device=device)
        self.updated = updated

    def _gradient_table(self, gradients) -> torch.Tensor:
        """A device table of the gradients' addresses, as the step's kernels will find it when they run."""
        addresses = [gradient.data_ptr() for gradient in gradients]
        device = gradients[0].device
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # Nothing runs while a graph is captured, and a copy from the host cannot be captured: the table is
            # filled once the capture ends, before the graph first replays. It was made outside any capture: one
            # made inside would lie in the graphs' shared pool, maybe where an earlier graph's temporaries are
            # written at its replay, and the table is written only once.
            if self.spare_table is None:
                raise RuntimeError(
                    "MultiTensorAdamW: a second step captured before tables_captured() was called for the first"
                )
            table, self.spare_table = self.spare_table, None
            self.unfilled_tables.append((table, addresses))
            return table
        if self.uncaptured_table is None:
            self.uncaptured_table = torch.empty(len(addresses), dtype=torch.int64, device=device)
        # in the stream's order: an earlier step's kernels have read the table before this copy writes it
        self.uncaptured_table.copy_(torch.tensor(addresses, dtype=torch.int64))
        return self.uncaptured_table

    def _gradients(self) -> list[torch.Tensor]:
        gradients = []
        for parameter in self.updated:
            if parameter.grad is None:
                raise RuntimeError(
                    "a parameter that had a gradient at the first step has none now; the multi-tensor AdamW "
                    "updates the same parameters at every step"
                )
            if parameter.grad.dtype != torch.float32:
                raise RuntimeError(f"the multi-tensor AdamW takes fp32 gradients, got {parameter.grad.dtype}")
            gradients.append(parameter.grad.contiguous())
        return gradients

    def _flat_gradient_table(self, flat: torch.Tensor) -> torch.Tensor:
        """Each gradient's address within one buffer, computed on the device (a captured step repeats it)."""
        return self.offsets * flat.element_size() + flat.data_ptr()

    def tables_captured(self) -> None:
        """Fill the gradient tables of the steps captured since the last call (call after each capture ends)."""
        for table, addresses in self.unfilled_tables:
            table.copy_(torch.tensor(addresses, dtype=torch.int64))
        self.captured_tables += self.unfilled_tables
        self.unfilled_tables = []
        if self.spare_table is None:  # for the next capture, made here, outside any
            self.spare_table = torch.empty_like(self.captured_tables[-1][0])

    def step(self, step_counter: torch.Tensor, flat_gradients: torch.Tensor | None = None) -> None:
        """One step, from the parameters' `.grad` (left as they are, unclipped), or from `flat_gradients`, every
        updated parameter's gradient in one fp32 buffer in their order (as a sum over processes leaves them)."""
        if self.updated is None:
            self._bind([p for p in self.parameters if p.grad is not None])
        if flat_gradients is not None:
            if flat_gradients.dtype != torch.float32 or flat_gradients.shape != (self.exp_avg.numel(),):
                raise ValueError(
                    f"flat_gradients must be one fp32 buffer of the {self.exp_avg.numel()} updated elements, got "
                    f"{flat_gradients.dtype} of shape {tuple(flat_gradients.shape)}"
                )
            table = self._flat_gradient_table(flat_gradients)
        elif GRADIENTS_IN_PLACE:
            gradients = self._gradients()  # held until the kernels are launched: a copy of one may be all there is
            table = self._gradient_table(gradients)
        else:
            flat_gradients = torch.cat([gradient.reshape(-1) for gradient in self._gradients()])  # held likewise
            table = self._flat_gradient_table(flat_gradients)
        blocks = self.block_tensor.numel()
        _squared_sums[(blocks,)](
            table, self.block_tensor, self.block_start, self.numels, self.partial_sums, BLOCK=UPDATE_BLOCK
        )
        _finish[(1,)](
            self.partial_sums, blocks, self.learning_rates, self.learning_rates.numel(),
            step_counter, self.learning_rate, self.step_counts, self.step_counts.numel(), self.scalars, self.max_norm,
            self.beta1, self.beta2,
            CLIP=self.max_norm > 0, BLOCK=1024,
        )  # fmt: skip
        _update[(blocks,)](
            table, self.exp_avg, self.exp_avg_sq, self.addresses, self.block_tensor, self.block_start, self.offsets,
            self.numels, self.weight_decays, self.scalars, self.beta1, self.beta2, self.eps, BLOCK=UPDATE_BLOCK,
        )  # fmt: skip


if triton is not None:

    @triton.jit
    def _squared_sums(GRADIENT_ADDRESSES, BLOCK_TENSOR, BLOCK_START, NUMELS, PARTIAL_SUMS, BLOCK: tl.constexpr):
        """The sum of the squares of one block of one parameter's gradient, in fp32."""
        block = tl.program_id(0)
        tensor = tl.load(BLOCK_TENSOR + block)
        within = tl.load(BLOCK_START + block) + tl.arange(0, BLOCK)
        gradient_pointer = tl.load(GRADIENT_ADDRESSES + tensor).to(tl.pointer_type(tl.float32))
        values = tl.load(gradient_pointer + within, mask=within < tl.load(NUMELS + tensor), other=0.0)
        tl.store(PARTIAL_SUMS + block, tl.sum(values * values))

    @triton.jit
    def _finish(
        PARTIAL_SUMS, n_partial_sums, LEARNING_RATES, n_learning_rates, STEP_COUNTER, LEARNING_RATE, STEP_COUNTS,
        n_step_counts, SCALARS, max_norm, beta1, beta2, CLIP: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        """One program: the clipping coefficient from the blocks' sums, the step's learning rate (the schedule's
        last past its end) written into the optimizer's, the optimizer's step counts advanced (every parameter's
        is the same), and the step size and bias correction that `_update` needs."""
        squares = tl.zeros((BLOCK,), dtype=tl.float32)
        for index in range(0, tl.cdiv(n_partial_sums, BLOCK)):
            offsets = index * BLOCK + tl.arange(0, BLOCK)
            squares += tl.load(PARTIAL_SUMS + offsets, mask=offsets < n_partial_sums, other=0.0)
        coefficient = 1.0
        if CLIP:
            coefficient = tl.minimum(max_norm / (tl.sqrt(tl.sum(squares)) + 1e-6), 1.0)
        step = tl.minimum(tl.load(STEP_COUNTER), n_learning_rates - 1)
        learning_rate = tl.load(LEARNING_RATES + step)
        tl.store(LEARNING_RATE, learning_rate)
        count = tl.load(STEP_COUNTS) + 1.0
        for index in range(0, tl.cdiv(n_step_counts, BLOCK)):
            offsets = index * BLOCK + tl.arange(0, BLOCK)
            tl.store(STEP_COUNTS + offsets, tl.zeros((BLOCK,), dtype=tl.float32) + count, mask=offsets < n_step_counts)
        bias_correction1 = 1.0 - tl.exp(count * tl.log(beta1))
        bias_correction2 = 1.0 - tl.exp(count * tl.log(beta2))
        # in this order: what `_update` reads
        tl.store(SCALARS + 0, coefficient)
        tl.store(SCALARS + 1, learning_rate)
        tl.store(SCALARS + 2, learning_rate / bias_correction1)
        tl.store(SCALARS + 3, tl.sqrt(bias_correction2))

    @triton.jit
    def _update(
        GRADIENT_ADDRESSES, EXP_AVG, EXP_AVG_SQ, ADDRESSES, BLOCK_TENSOR, BLOCK_START, OFFSETS, NUMELS, WEIGHT_DECAYS,
        SCALARS, beta1, beta2, eps, BLOCK: tl.constexpr,
    ):  # fmt: skip
        """AdamW on one block of one parameter, with its clipped gradient, and its moments from the flat buffers."""
        block = tl.program_id(0)
        tensor = tl.load(BLOCK_TENSOR + block)
        within = tl.load(BLOCK_START + block) + tl.arange(0, BLOCK)
        inside = within < tl.load(NUMELS + tensor)
        flat = tl.load(OFFSETS + tensor) + within
        parameter_pointer = tl.load(ADDRESSES + tensor).to(tl.pointer_type(tl.float32))
        gradient_pointer = tl.load(GRADIENT_ADDRESSES + tensor).to(tl.pointer_type(tl.float32))
        weight_decay = tl.load(WEIGHT_DECAYS + tensor)
        coefficient = tl.load(SCALARS + 0)
        learning_rate = tl.load(SCALARS + 1)
        step_size = tl.load(SCALARS + 2)
        bias_correction2_sqrt = tl.load(SCALARS + 3)
        gradient = tl.load(gradient_pointer + within, mask=inside, other=0.0) * coefficient
        parameter = tl.load(parameter_pointer + within, mask=inside, other=0.0)
        exp_avg = tl.load(EXP_AVG + flat, mask=inside, other=0.0)
        exp_avg_sq = tl.load(EXP_AVG_SQ + flat, mask=inside, other=0.0)
        parameter = parameter * (1.0 - learning_rate * weight_decay)
        exp_avg = beta1 * exp_avg + (1.0 - beta1) * gradient
        exp_avg_sq = beta2 * exp_avg_sq + (1.0 - beta2) * gradient * gradient
        denominator = tl.sqrt(exp_avg_sq) / bias_correction2_sqrt + eps
        parameter = parameter - step_size * exp_avg / denominator
        tl.store(parameter_pointer + within, parameter, mask=inside)
        tl.store(EXP_AVG + flat, exp_avg, mask=inside)
        tl.store(EXP_AVG_SQ + flat, exp_avg_sq, mask=inside)


__all__ = ["MultiTensorAdamW", "multi_tensor_adamw_applies"]
