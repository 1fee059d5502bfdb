"""kernels_torch: the `kernels` library's Rust-written GPU kernels as PyTorch operators.

The operators (``torch.ops.rustkernels.*``, with autograd and torch.compile support) run on
PyTorch's own CUDA tensors, on PyTorch's current stream, writing into tensors PyTorch allocated.
The functions below call them; ``kernels_torch.nn`` has modules that fall back to PyTorch for
CPU tensors.

    import torch, kernels_torch
    x = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = kernels_torch.gelu(x)                       # torch.ops.rustkernels.gelu
    y.sum().backward()                              # torch.ops.rustkernels.gelu_backward

``scaled_dot_product_attention`` is ``F.scaled_dot_product_attention`` (bf16/f16, causal, GQA) on
the library's FlashAttention kernels. ``conv2d``, ``batch_norm``, ``max_pool2d``, ``avg_pool2d``
and ``adaptive_avg_pool2d`` are the ``F.`` functions of the same names, NCHW or ``channels_last``.

Without PyTorch installed only ``cuda_status`` and the native layer (``kernels_torch._native``)
are available.
"""

from . import _native

__version__ = "0.1.0"


def cuda_status():
    """``(True, gpu_name)`` if the kernels can run here, else ``(False, reason)``: no driver, no
    device, or a GPU older than compute capability 8.0."""
    return _native.cuda_status()


def cuda_available():
    """Whether the kernels can run here."""
    return _native.cuda_status()[0]


def set_float32_matmul_precision(precision, device=0):
    """How the f32 products of ``kernels_torch.linear`` (and ``nn.Linear``) on CUDA device
    ``device`` (an index) are computed, for the whole process:

    - ``"highest"``: f32 FMAs, the default, as PyTorch's default.
    - ``"tf32x3"``: the tensor cores with f32 accuracy, each operand split into two TF32 parts
      (relative error against float64 measured at the level of f32 FMAs). Products with a short
      K or a small output run the FMA kernel.
    - ``"high"`` (or ``"tf32"``): plain TF32 on the tensor cores, as PyTorch's ``"high"``
      (``torch.backends.cuda.matmul.allow_tf32 = True``): each operand rounded to 10 mantissa
      bits, so each product errs by about ``2**-10`` of itself before the f32 sum, about 1000x
      less exact than the others. An explicit choice of speed: every shape runs it.

    ``get_float32_matmul_precision`` reports ``"high"`` for both spellings."""
    _native.set_f32_matmul_precision(int(device), str(precision))


def get_float32_matmul_precision(device=0):
    """The precision ``set_float32_matmul_precision`` set on device ``device``."""
    return _native.f32_matmul_precision(int(device))


try:
    import torch as _torch  # noqa: F401
except ImportError as _e:  # the native layer stays usable (CI checks it without PyTorch)
    _TORCH_ERROR = _e

    def __getattr__(name):
        raise ImportError(f"kernels_torch.{name} needs PyTorch, which is not installed ({_TORCH_ERROR})")

else:
    from . import _ops, nn
    from ._conv import adaptive_avg_pool2d, avg_pool2d, batch_norm, conv2d, fold_batch_norm, max_pool2d
    from ._ops import (
        ACTIVATIONS,
        LINEAR_ACTIVATIONS,
        UNARY_OPS,
        add_layer_norm,
        add_rms_norm,
        cross_entropy,
        cross_entropy_one_pass,
        embedding,
        geglu,
        glu_act,
        layer_norm,
        linear,
        log_softmax,
        reglu,
        rms_norm,
        rope,
        rope_tables,
        scale_bias_act,
        scaled_dot_product_attention,
        softmax,
        swiglu,
        swish,
    )

    # One function per activation of the op table (``relu``, ``gelu``, ``elu``, ...).
    globals().update({_name: getattr(_ops, _name) for _name in _ops.FUNCTIONS})

    __all__ = [
        "ACTIVATIONS",
        "LINEAR_ACTIVATIONS",
        "UNARY_OPS",
        "adaptive_avg_pool2d",
        "add_layer_norm",
        "add_rms_norm",
        "avg_pool2d",
        "batch_norm",
        "conv2d",
        "cross_entropy",
        "cross_entropy_one_pass",
        "cuda_available",
        "cuda_status",
        "embedding",
        "fold_batch_norm",
        "geglu",
        "get_float32_matmul_precision",
        "glu_act",
        "layer_norm",
        "linear",
        "log_softmax",
        "max_pool2d",
        "nn",
        "reglu",
        "rms_norm",
        "rope",
        "rope_tables",
        "scale_bias_act",
        "scaled_dot_product_attention",
        "set_float32_matmul_precision",
        "softmax",
        "swiglu",
        "swish",
        *_ops.FUNCTIONS,
    ]
