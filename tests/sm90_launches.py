"""The kernel launches one fused_moe_lora call makes, captured without a GPU, and what Triton
compiles for each on sm_90 (the H200 / H100): the whole kernel, or its shared memory.

Capture: every `*_kernel` JIT function of moelora.kernels is swapped for a recorder, and
the forward runs on CPU tensors with an explicit config, so each launcher checks, sizes
and passes its arguments (constexprs, strides, TMA descriptors, num_warps / num_stages)
exactly as on the GPU; nothing runs. Compile: the arguments are specialised as the JIT
does at launch, by its own binder (ints of 1 become constants, pointers and ints divisible
by 16 get the divisibility hint, which is what lets Triton vectorise and multi-buffer the
loads; a tuple argument's fields alike), and the options are the launch's (num_warps,
num_stages, launch_pdl). compiled_launch then
compiles all of Triton's sm_90 stages, as the JIT would; shared_bytes runs them through
make_llir's MLIR passes and stops before the LLVM translation: the shared memory is
allocated by then, and that attribute is what make_llir stores as metadata["shared"] (the
same bytes as a full compile's, checked on the up kernel in bf16 and fp32 at rank 128;
the LLVM and ptxas stages take minutes in fp32).

Run in a child process with TRITON_INTERPRET=0 (tests/sm90_child.py).
"""

from __future__ import annotations

import contextlib

import torch

from benchmarks.launch_diff import kernels_recording
from moelora.call import MoECall

SM90 = ("cuda", 90, 32)
NOT_COMPILED = ("_align_kernel", "_topk_reduce_kernel")  # no LoRA tiles, no pipeline


@contextlib.contextmanager
def _recorded():
    """Every moelora.kernels `*_kernel` JIT function records its launches instead of
    running; yields the list of (kernel, kwargs)."""
    calls = []
    with kernels_recording(lambda fn, grid, kwargs: calls.append((fn, kwargs))):
        yield calls


def forward_launches(
    cfg, dtype: torch.dtype, rank: int, num_slots: int, *, bias: bool = False, fp8: str = ""
) -> list[tuple]:
    """[(kernel, kwargs)] of one fused_moe_lora call with `cfg`: a Qwen3-30B-A3B layer
    (H 2048, I 768, K 8) cut to 8 experts, 512 tokens (4096 pairs), LoRA on with every
    token on slot 0 (rank 0: LoRA-free), the expert biases with `bias`, e4m3 experts in
    the format `fp8` names (fp8_block: 128x128 blocks; "": the serving dtype). The compiled code
    does not depend on those sizes beyond their divisibility."""
    from moelora.activations import Activation
    from moelora.backends.triton import fused_moe_lora
    from moelora.config import MoEShape
    from moelora.weights import ExpertWeights, LoRABank

    experts, top_k, hidden, inter, tokens = 8, 8, 2048, 768, 512
    empty = lambda *shape: torch.empty(*shape, dtype=dtype)  # noqa: E731 (never read)
    biases = (empty(experts, 2 * inter), empty(experts, hidden)) if bias else ()
    w13, w2 = empty(experts, 2 * inter, hidden), empty(experts, hidden, inter)
    weights = ExpertWeights(w13, w2, *biases)
    if fp8:
        from moelora.quant.fp8_experts import FP8ExpertWeights, scale_shape
        from moelora.quantization import QuantConfig, Quantization

        quant, e4m3 = QuantConfig(Quantization(fp8)), torch.float8_e4m3fn
        w13, w2 = w13.to(e4m3), w2.to(e4m3)
        s13 = torch.ones(scale_shape(quant, experts, 2 * inter, hidden))
        s2 = torch.ones(scale_shape(quant, experts, hidden, inter))
        weights = FP8ExpertWeights(quant, w13, w2, s13, s2, *biases)
    bank = slots = None
    if rank:
        bank = LoRABank(
            empty(num_slots, experts, 2, rank, hidden),
            empty(num_slots, experts, 2, inter, rank),
            empty(num_slots, experts, rank, inter),
            empty(num_slots, experts, hidden, rank),
        )
        slots = torch.zeros(tokens, dtype=torch.int32)
    shape = MoEShape(experts, top_k, hidden, inter, Activation.SILU, dtype=dtype)
    ids = torch.zeros(tokens, top_k, dtype=torch.int32)
    x, w = empty(tokens, hidden), torch.empty(tokens, top_k)
    with _recorded() as calls:
        fused_moe_lora(MoECall(x, ids, w, slots, bank), weights, shape, config=cfg)
    return [(fn, kw) for fn, kw in calls if fn.__name__ not in NOT_COMPILED]


def launch_source(fn, kwargs: dict):
    """(ASTSource, CUDAOptions) that the JIT compiles for sm_90 when `fn` is launched with
    `kwargs`: its signature, constexprs and divisibility hints (those of a tuple argument's
    fields too), and the launch's options (module docstring). The JIT's own binder and
    argument packing compute them, as at a launch."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(GPUTarget(*SM90))
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(**kwargs)
    options, signature, constexprs, attrs = fn._pack_args(
        backend, kwargs, bound, specialization, options
    )
    return ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs), options


def compiled_launch(fn, kwargs: dict):
    """The CompiledKernel (ttir to cubin) of `fn` launched with `kwargs` on sm_90: what the
    JIT compiles at that launch."""
    import triton
    from triton.backends.compiler import GPUTarget

    src, options = launch_source(fn, kwargs)
    return triton.compile(src, target=GPUTarget(*SM90), options=options.__dict__)


def shared_bytes(fn, kwargs: dict) -> int:
    """Shared memory (bytes per block) of `fn` launched with `kwargs`, compiled for sm_90
    up to its shared-memory allocation (module docstring)."""
    import triton.backends.nvidia.compiler as nvidia_compiler
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    target = GPUTarget(*SM90)
    backend = make_backend(target)
    src, options = launch_source(fn, kwargs)
    stages = {}
    backend.add_stages(stages, options, src.language)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    codegen = backend.get_codegen_implementation(options)
    module = src.make_ir(target, options, codegen, backend.get_module_map(), context)
    metadata = {"target": target, **options.__dict__}
    for stage in ("ttir", "ttgir"):
        module = stages[stage](module, metadata)
    return _allocated(stages["llir"], module, metadata, nvidia_compiler.llvm)


class _Allocated(Exception):
    """Raised where make_llir leaves MLIR for LLVM: the shared memory is allocated."""


def _allocated(make_llir, module, metadata: dict, llvm) -> int:
    """Run make_llir on `module` up to its LLVM translation; the ttg.shared it allocated."""
    translate = llvm.to_module

    def stop(*args, **kwargs):
        raise _Allocated

    llvm.to_module = stop
    try:
        make_llir(module, metadata)
    except _Allocated:
        pass
    finally:
        llvm.to_module = translate
    return module.get_int_attr("ttg.shared")
