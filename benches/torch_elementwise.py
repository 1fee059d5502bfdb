"""PyTorch baselines for benches/elementwise.rs: the same ops, sizes, dtypes and directions,
timed with triton.testing.do_bench (warmup=25, rep=200, median: CUDA events, L2 flushed before
every run), written as the same JSON records as the Rust bench ({"name", "op", "dtype", "n",
"direction", "bytes", "ms", "gbs"}), so that scripts/compare.py joins the two on (op, dtype, n,
direction). The device-to-device copy (`copy`, a clone) is the bandwidth ceiling compare.py
reports.

    python3 benches/torch_elementwise.py torch.json [REGEX]

REGEX (optional) keeps only the records whose name matches, like the bench's filter. The unary
ops, their parameters and PyTorch's version of each come from the library's op table, which
the PyTorch package exports (`kernels_torch._native.UNARY_OPS`): the package must be importable
(the GPU suite installs its wheel first).

Backward baselines are what PyTorch runs for that gradient: the aten backward op where one
exists (gelu_backward, threshold_backward, ...), otherwise torch.autograd.grad over a retained
graph (so the graph's host overhead counts, as it does in training). Note that some gradients
run no kernel at all in PyTorch (add: both gradients alias the incoming one; add_scalar,
sub_scalar: the gradient passes through; add_row: grad_x aliases it), while our ops always
write fresh outputs. The fused baseline is the three-kernel eager sequence act(x * scale + bias),
forward and backward (autograd w.r.t. x, scale and bias). The gated baselines are PyTorch's eager
composition: ``a, b = x.chunk(2, -1); act(a) * b`` (glu_*) or ``act(a) * b`` of two tensors
(glu2_*), forward and backward (autograd w.r.t. x, or a and b).

Bytes are counted as in the Rust bench (each input read once, each output written once):
unary 2N / 3N, binary 3N / 5N, add_row 2N + C / 3N + 2C, fused 2N + 2C / 3N + 4C (C = 1024
columns), copy 2N; the gated ops 3M / 5M on M = rows * GLU_F outputs, rows = N // GLU_F; times the
element size.
"""
from functools import partial

import torch
import torch.nn.functional as F
from kernels_torch import _native

import torch_baseline
from torch_baseline import Case

aten = torch.ops.aten
dev = "cuda"
COLS = 1024
GLU_F = 14336  # the gated ops' F: inputs [rows, 2F] (or two [rows, F]), as benches/elementwise.rs
SIZES = [1 << 28, 1 << 16]
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
# The op table: name -> (activation, ((param, value), ...), from_output, positive, torch, ...).
TABLE = {row[0]: row[1:] for row in _native.UNARY_OPS}
POSITIVE = {name for name, row in TABLE.items() if row[3]} | {"pow_cube"}

g_ = torch.Generator(device=dev).manual_seed(0)


def normal(shape, dt, mean=0.0, std=1.0):
    return (torch.randn(*shape, device=dev, dtype=torch.float32, generator=g_) * std + mean).to(dt)


def positive(shape, dt):
    return (torch.rand(*shape, device=dev, dtype=torch.float32, generator=g_) * 3.9 + 0.1).to(dt)


def autograd_bwd(f, x, g):
    """dL/dx of f at x given dL/dy = g, through autograd over a retained graph."""
    xr = x.detach().requires_grad_(True)
    y = f(xr)
    return lambda: torch.autograd.grad(y, xr, g, retain_graph=True)


def result_bwd(f, aten_bwd):
    """Backward ops that take the forward's result, as PyTorch's autograd calls them."""
    def build(x, g):
        y = f(x)
        return lambda: aten_bwd(g, y)
    return build


def table_op(name):
    """PyTorch's version of op `name` of the table, with the table's parameters."""
    f = eval(TABLE[name][4], {"torch": torch, "F": F})
    params = tuple(v for _, v in TABLE[name][1])
    return lambda x: f(x, *params)


# PyTorch's own backward kernels, called as its autograd calls them, where it has one; every
# other op's backward runs through autograd over a retained graph. Our identity op writes a new
# tensor: the out-of-place equivalent is a copy, both ways.
ATEN_BWD = {
    "identity": lambda x, g: lambda: g.clone(),
    "relu": result_bwd(F.relu, lambda g, y: aten.threshold_backward(g, y, 0)),
    "leaky_relu": lambda x, g: lambda: aten.leaky_relu_backward(g, x, 0.01, False),
    "sigmoid": result_bwd(torch.sigmoid, aten.sigmoid_backward),
    "tanh": result_bwd(torch.tanh, aten.tanh_backward),
    "gelu": lambda x, g: lambda: aten.gelu_backward(g, x),
    "gelu_tanh": lambda x, g: lambda: aten.gelu_backward(g, x, approximate="tanh"),
    "silu": lambda x, g: lambda: aten.silu_backward(g, x),
    "mish": lambda x, g: lambda: aten.mish_backward(g, x),
    "softplus": lambda x, g: lambda: aten.softplus_backward(g, x, 1.0, 20.0),
    "elu": lambda x, g: lambda: aten.elu_backward(g, 1.0, 1, 1, False, x),
    "selu": lambda x, g: lambda: aten.elu_backward(g, 1.6732632423543772, 1.0507009873554805, 1, False, x),
    "celu": lambda x, g: lambda: aten.elu_backward(g, 1.0, 1, 1.0, False, x),
    "hardswish": lambda x, g: lambda: aten.hardswish_backward(g, x),
    "hardsigmoid": lambda x, g: lambda: aten.hardsigmoid_backward(g, x),
}

# name -> (forward, backward builder (x, g) -> thunk, or None for autograd): every op of the
# table (as the Rust bench), and pow's cube.
UNARY = {name: (table_op(name), ATEN_BWD.get(name)) for name in TABLE}
UNARY["identity"] = (torch.clone, ATEN_BWD["identity"])
UNARY["pow_cube"] = (lambda x: torch.pow(x, 3.0), None)
ACTIVATIONS = [name for name, row in TABLE.items() if row[0]]
FROM_OUTPUT = ("sigmoid", "tanh")
BINARY = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div}
FUSED = {"scale_bias_relu": F.relu, "scale_bias_gelu": F.gelu, "scale_bias_silu": F.silu}
GLU_ACT = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda a: F.gelu(a, approximate="tanh")}
# (op, kind, dtype) of the gated cases, in the Rust bench's order.
GLU = [
    ("glu_silu", "glu", "f32"),
    ("glu_silu", "glu", "bf16"),
    ("glu_gelu", "glu", "bf16"),
    ("glu_gelu_tanh", "glu", "bf16"),
    ("glu2_silu", "glu2", "bf16"),
]


def glu_rows(n):
    return max(n // GLU_F, 1)


def cases():
    """(op, kind, dtype, n, direction), in the Rust bench's order."""
    out = []
    for n in SIZES:
        out.append(("copy", "copy", "f32", n, "fwd"))
        for op in UNARY:
            out += [(op, "unary", "f32", n, "fwd"), (op, "unary", "f32", n, "bwd")]
        for op in BINARY:
            out += [(op, "binary", "f32", n, "fwd"), (op, "binary", "f32", n, "bwd")]
        # Ours from the saved output (`unary_backward_from_output`); PyTorch's is the same
        # kernel as for "sigmoid"/"tanh" (its autograd's, from the output too).
        out += [(op + "_y", "unary_y", "f32", n, "bwd") for op in FROM_OUTPUT]
        out += [("add_row", "row", "f32", n, "fwd"), ("add_row", "row", "f32", n, "bwd")]
        for op in FUSED:
            out += [(op, "fused", "f32", n, "fwd"), (op, "fused", "f32", n, "bwd")]
        # Every activation in bf16, some in f16.
        for op in ACTIVATIONS:
            out += [(op, "unary", "bf16", n, "fwd"), (op, "unary", "bf16", n, "bwd")]
        for dt in ("bf16", "f16"):
            if dt == "f16":
                out += [
                    ("gelu", "unary", dt, n, "fwd"),
                    ("gelu", "unary", dt, n, "bwd"),
                    ("gelu_tanh", "unary", dt, n, "fwd"),
                    ("gelu_tanh", "unary", dt, n, "bwd"),
                    ("relu", "unary", dt, n, "fwd"),
                ]
            out += [
                ("exp", "unary", dt, n, "fwd"),
                ("add", "binary", dt, n, "fwd"),
                ("scale_bias_silu", "fused", dt, n, "fwd"),
                ("scale_bias_silu", "fused", dt, n, "bwd"),
            ]
        for op, kind, dt in GLU:
            out += [(op, kind, dt, n, "fwd"), (op, kind, dt, n, "bwd")]
    return out


def nbytes(kind, direction, n, dt):
    size = torch.tensor([], dtype=DTYPES[dt]).element_size()
    c = COLS
    if kind in ("glu", "glu2"):
        return (3 if direction == "fwd" else 5) * glu_rows(n) * GLU_F * size
    elems = {
        ("copy", "fwd"): 2 * n,
        ("unary", "fwd"): 2 * n,
        ("unary", "bwd"): 3 * n,
        ("unary_y", "bwd"): 3 * n,
        ("binary", "fwd"): 3 * n,
        ("binary", "bwd"): 5 * n,
        ("row", "fwd"): 2 * n + c,
        ("row", "bwd"): 3 * n + 2 * c,
        ("fused", "fwd"): 2 * n + 2 * c,
        ("fused", "bwd"): 3 * n + 4 * c,
    }[(kind, direction)]
    return elems * size


def build(op, kind, dt, n, direction):
    """Fresh random inputs (never zeros) and the thunk PyTorch runs for this case."""
    t = DTYPES[dt]
    if kind in ("glu", "glu2"):
        act = GLU_ACT[op.split("_", 1)[1]]
        rows = glu_rows(n)
        if kind == "glu":
            x = normal((rows, 2 * GLU_F), t)

            def f(x):
                a, b = x.chunk(2, dim=-1)
                return act(a) * b

            if direction == "fwd":
                return lambda: f(x)
            return autograd_bwd(f, x, normal((rows, GLU_F), t))
        a, b = normal((rows, GLU_F), t), normal((rows, GLU_F), t)
        if direction == "fwd":
            return lambda: act(a) * b
        g = normal((rows, GLU_F), t)
        ar, br = a.requires_grad_(True), b.requires_grad_(True)
        y = act(ar) * br
        return lambda: torch.autograd.grad(y, (ar, br), g, retain_graph=True)
    shape = (n // COLS, COLS)
    x = positive(shape, t) if op in POSITIVE else normal(shape, t)
    if kind == "copy":
        return lambda: x.clone()
    if kind == "unary_y":
        return UNARY[op.removesuffix("_y")][1](x, normal(shape, t))
    if kind == "unary":
        fwd, bwd = UNARY[op]
        if direction == "fwd":
            return lambda: fwd(x)
        g = normal(shape, t)
        return bwd(x, g) if bwd is not None else autograd_bwd(fwd, x, g)
    if kind == "binary":
        f, b = BINARY[op], normal(shape, t)
        if direction == "fwd":
            return lambda: f(x, b)
        g = normal(shape, t)
        xr, br = x.requires_grad_(True), b.requires_grad_(True)
        y = f(xr, br)
        return lambda: torch.autograd.grad(y, (xr, br), g, retain_graph=True)
    if kind == "row":
        r = normal((COLS,), t)
        if direction == "fwd":
            return lambda: x + r
        g = normal(shape, t)
        xr, rr = x.requires_grad_(True), r.requires_grad_(True)
        y = xr + rr
        return lambda: torch.autograd.grad(y, (xr, rr), g, retain_graph=True)
    if kind == "fused":
        act, s, b = FUSED[op], normal((COLS,), t, 1.0, 0.5), normal((COLS,), t, 0.0, 0.5)
        if direction == "fwd":
            return lambda: act(x * s + b)
        g = normal(shape, t)
        xr, sr, br = x.requires_grad_(True), s.requires_grad_(True), b.requires_grad_(True)
        y = act(xr * sr + br)
        return lambda: torch.autograd.grad(y, (xr, sr, br), g, retain_graph=True)
    raise ValueError(kind)


def main():
    def all_cases():
        for op, kind, dt, n, direction in cases():
            yield Case(f"torch/{dt}/{direction}/{op}/{n}", op, dt, n, direction, nbytes(kind, direction, n, dt),
                       partial(build, op, kind, dt, n, direction))

    torch_baseline.main(all_cases(), 44, header=("cuda", torch.version.cuda))


if __name__ == "__main__":
    main()
