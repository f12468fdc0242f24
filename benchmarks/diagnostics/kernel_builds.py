#!/usr/bin/env python
"""The package's Triton kernels built for a GPU architecture without a GPU (`triton.compile` for a target, as a
CPU machine with Triton can): whether each builds, its SASS instruction count (static, not a speed), the
registers a thread takes and its stack (spills among it), its shared memory, and whether its products run on wgmma
and its loads are staged asynchronously. For the attention kernels at the handout step's launch (packed, blocks of
16, head size 32, dropout 0.1), their dropout taking four uniforms from each Philox evaluation and eight, and with
eight under caps on the registers a thread may take (`REGISTER_CAPS`); for the residual + dropout + LayerNorm
kernels at the handout's width under autocast (fp32 residual stream, bf16 branch and normalized output), their
dropout drawn one Philox evaluation per four elements and per element, or stored by the forward kernel; for the
dropout-mask kernel (eight elements per evaluation) with four warps and eight; for the multi-tensor update's AdamW
kernel. A table is printed last.

    pip install -e ".[triton]" && python benchmarks/diagnostics/kernel_builds.py [--arch 90]

Integer arguments are built as Triton specializes them at a launch on the handout's shapes: strides of 1 as
constants, and sizes and pointers known to be multiples of 16.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hf_knowgpt.kernels import dropout_masks, fused_attention, fused_layers, multi_tensor_adamw  # noqa: E402

POINTER_TYPES = {
    "SEED": "*i64", "LENGTHS": "*i32", "STARTS": "*i32", "LSE": "*fp32", "OUT32": "*fp32",
    "CORRECTION": "*fp32", "COS": "*fp32", "SIN": "*fp32", "BIAS": "*fp32", "GRAD_BIAS": "*fp32",
}  # fmt: skip


def build(kernel, constants, pointers, multiples_of_16, num_warps, num_stages, arch, max_registers=None):
    """`kernel` compiled for `arch` with `constants` as constexprs; `pointers` the arguments that are pointers (a
    list, typed by POINTER_TYPES or else bf16, or a dict of their types); at most `max_registers` a thread where
    given (Triton's `maxnreg`)."""
    names = kernel.arg_names
    types = pointers if isinstance(pointers, dict) else {name: POINTER_TYPES.get(name, "*bf16") for name in pointers}
    signature = {name: "constexpr" if name in constants else types.get(name, "i32") for name in names}
    attributes = {
        (names.index(name),): [["tt.divisibility", 16]]
        for name in multiples_of_16
        if name in names and name not in constants
    }
    source = ASTSource(
        fn=kernel,
        signature=signature,
        constexprs={(names.index(name),): value for name, value in constants.items()},
        attrs=attributes,
    )
    target = GPUTarget("cuda", arch, 32)
    options = dict(num_warps=num_warps, num_stages=num_stages)
    if max_registers is not None:
        options["maxnreg"] = max_registers
    return triton.compile(source, target=target, options=options)


def cubin_tool(compiled, tool: str, *flags: str) -> str:
    """What Triton's copy of `tool` (nvdisasm, cuobjdump) prints for the kernel's cubin."""
    executable = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / tool
    with tempfile.TemporaryDirectory() as folder:
        cubin = Path(folder) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        return subprocess.run([str(executable), *flags, str(cubin)], capture_output=True, text=True, check=True).stdout


def sass_instructions(compiled) -> int:
    listing = cubin_tool(compiled, "nvdisasm", "-c")
    return sum(1 for line in listing.splitlines() if re.match(r"\s*/\*[0-9a-f]{4}\*/\s+\S", line))


def registers_and_stack(compiled) -> tuple[int, int]:
    """Registers a thread takes, and its stack bytes (spilled registers among them), as ptxas allotted them: the
    registers bound how many programs share a multiprocessor (65,536 registers each on sm_90)."""
    usage = cubin_tool(compiled, "cuobjdump", "--dump-resource-usage")
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    return int(found[1]), int(found[2])


# Caps on the registers a thread of the attention kernels may take, built beside the compiler's own choice.
REGISTER_CAPS = {"_forward_kernel": (72, 64), "_backward_kernel": (96, 80, 72, 64)}


def attention_builds(arch):
    """(name, compiled) of the attention's forward and backward kernels, their dropout taking four uniforms from each
    Philox evaluation and eight (`UNIFORMS_PER_DRAW` picks which the library launches)."""
    pointers = [name for name in fused_attention._backward_kernel.arg_names if name.isupper() and len(name) > 1]
    pointers += ["Q", "K", "V", "QR", "KR", "OUT"]
    strides_of_one = {"sq_d": 1, "sk_d": 1, "sv_d": 1, "so_d": 1, "sg_d": 1, "sgq_d": 1, "sgk_d": 1, "sgv_d": 1}
    settings = dict(
        SCALE=32**-0.5, DROPOUT_P=0.1, HEAD_DIM=32, ROW_STRIDE=128, BLOCK=16, SPLITS=fused_attention.DEFAULT_SPLITS,
        HAS_LENGTHS=True, PACKED=True, ROTARY=False, KEY_TABLE=False, HAS_BIAS=False,
        PRECOMPUTED=True, INTERPRETED=False,
        PART_STRIDE=8 * 128 * 32,  # the stacked gradient's parts apart: heads × positions × head size
    )  # fmt: skip
    for uniforms in (4, 8):
        dropped, keep_scale = fused_attention._dropout_rule(settings["DROPOUT_P"], uniforms)  # as the launch takes it
        for kernel in (fused_attention._forward_kernel, fused_attention._backward_kernel):
            given = {
                **settings, **strides_of_one, "UNIFORMS": uniforms, "DROPPED_LEVELS": dropped, "KEEP_SCALE": keep_scale
            }  # fmt: skip
            constants = {name: value for name, value in given.items() if name in kernel.arg_names}
            multiples = [name for name in kernel.arg_names if name in pointers or name.startswith("s")]
            warps = fused_attention.launch_warps(kernel is fused_attention._backward_kernel, settings["BLOCK"])
            compiled = build(kernel, constants, pointers, multiples, warps, 3, arch)
            yield f"attention {kernel.fn.__name__.strip('_')}, {uniforms} uniforms per Philox", compiled
            # registers capped (`MAX_REGISTERS`, `BACKWARD_MAX_REGISTERS`), with the library's eight uniforms
            for cap in REGISTER_CAPS[kernel.fn.__name__] if uniforms == 8 else ():
                compiled = build(kernel, constants, pointers, multiples, warps, 3, arch, max_registers=cap)
                yield f"attention {kernel.fn.__name__.strip('_')}, ≤ {cap} registers", compiled


def residual_layer_norm_builds(arch):
    """(name, compiled) of the residual + dropout + LayerNorm kernels forward and backward at 256 wide, as the model
    launches them under bf16 autocast (`fused_layers._tile`, the branch's bias added), with four elements per Philox
    evaluation or one, with the mask stored as bytes by the forward kernel and read by the backward one, and with the
    backward kernel's column sums kept per row until its last tile."""
    block_rows, block_cols, num_warps = fused_layers._tile(256)
    pointers = {
        "RESIDUAL": "*fp32", "BRANCH": "*bf16", "BRANCH_BIAS": "*fp32", "WEIGHT": "*fp32", "BIAS": "*fp32",
        "SEED": "*i64", "NEW_RESIDUAL": "*fp32", "NORMALIZED": "*bf16", "MEAN": "*fp32", "RSTD": "*fp32",
        "GRAD_NEW": "*fp32", "GRAD_NORMALIZED": "*bf16", "GRAD_RESIDUAL": "*fp32", "GRAD_BRANCH": "*bf16",
        "GRAD_PARTS": "*fp32", "KEEP": "*i8",
    }  # fmt: skip
    ways = {  # name: (four elements per Philox evaluation, mask stored, column sums at the end)
        "4 per Philox": (True, False, False), "1 per Philox": (False, False, False),
        "mask stored": (True, True, False), "column sums at end": (True, False, True),
    }  # fmt: skip
    for way, (quads, stored, sums_at_end) in ways.items():
        for kernel in (fused_layers._residual_layer_norm_forward, fused_layers._residual_layer_norm_backward):
            if sums_at_end and kernel is fused_layers._residual_layer_norm_forward:
                continue  # the forward kernel sums no columns
            constants = dict(
                DROPOUT_P=0.1, BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols, QUADS=quads, HAS_BRANCH_BIAS=True,
                MASK_STORED=stored, ACC_ROWS=block_rows if sums_at_end else 1,
            )  # fmt: skip
            constants = {name: value for name, value in constants.items() if name in kernel.arg_names}
            types = {name: kind for name, kind in pointers.items() if name in kernel.arg_names} | {"eps": "fp32"}
            multiples = [*(name for name in types if name.isupper()), "n_rows", "n_cols", "offset"]  # 7680, 256, 0
            compiled = build(kernel, constants, types, multiples, num_warps, 3, arch)
            yield f"residual LayerNorm {kernel.fn.__name__.split('_')[-1]}, {way}", compiled


def dropout_mask_builds(arch):
    """(name, compiled) of the dropout-mask kernel as `dropout_masks.dropout_keep_mask` launches it, and with eight
    warps."""
    for num_warps in (4, 8):
        constants = {"COUNTERS": dropout_masks.COUNTERS_PER_PROGRAM}
        pointers = {"SEED": "*i64", "KEEP": "*i8"}
        compiled = build(
            dropout_masks._keep_mask_kernel, constants, pointers, ["SEED", "KEEP", "numel"], num_warps, 3, arch
        )
        yield f"dropout mask, {num_warps} warps", compiled


def update_builds(arch):
    """(name, compiled) of the multi-tensor update's AdamW kernel as `MultiTensorAdamW.step` launches it."""
    pointers = {
        "GRADIENT_ADDRESSES": "*i64", "EXP_AVG": "*fp32", "EXP_AVG_SQ": "*fp32", "ADDRESSES": "*i64",
        "BLOCK_TENSOR": "*i32", "BLOCK_START": "*i32", "OFFSETS": "*i64", "NUMELS": "*i32", "WEIGHT_DECAYS": "*fp32",
        "SCALARS": "*fp32", "beta1": "fp32", "beta2": "fp32", "eps": "fp32",
    }  # fmt: skip
    constants = {"BLOCK": multi_tensor_adamw.UPDATE_BLOCK}
    addresses = [name for name, kind in pointers.items() if kind.startswith("*")]
    yield "AdamW update", build(multi_tensor_adamw._update, constants, pointers, addresses, 4, 3, arch)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="compute capability × 10 (90: H100, H200)")
    args = parser.parse_args()
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's default, without its warning
    rows = []
    builds = [*attention_builds(args.arch), *residual_layer_norm_builds(args.arch), *dropout_mask_builds(args.arch),
              *update_builds(args.arch)]  # fmt: skip
    for name, compiled in builds:
        ttgir = compiled.asm["ttgir"]
        rows.append(
            (
                name,
                sass_instructions(compiled),
                *registers_and_stack(compiled),
                compiled.metadata.shared,
                "warp_group_dot" in ttgir,
                "async_copy_global_to_local" in ttgir,
            )
        )
        print(rows[-1], flush=True)
    print(f"\nTriton {triton.__version__}, built for sm_{args.arch} (static counts, not speeds)")
    width = max(len("kernel"), *(len(row[0]) for row in rows)) + 2
    print(
        f"{'kernel':<{width}}{'SASS instructions':>19}{'registers':>11}{'stack bytes':>13}{'shared bytes':>14}"
        f"{'wgmma':>7}{'async loads':>13}"
    )
    for name, instructions, registers, stack, shared, wgmma, asynchronous in rows:
        print(
            f"{name:<{width}}{instructions:>19}{registers:>11}{stack:>13}{shared:>14}{wgmma!s:>7}{asynchronous!s:>13}"
        )


if __name__ == "__main__":
    main()
