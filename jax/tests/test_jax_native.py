"""The native layer without JAX or a GPU: the capsules, and the handlers called through the XLA
FFI's C ABI with call frames built here (ctypes, laid out as ``xla/ffi/api/c_api.h``), as XLA
calls them: the registration's metadata query, and calls that each handler must refuse with an
XLA error (created through the API table's ``XLA_FFI_Error_Create``) before touching a device."""

import ctypes as C

import pytest

from kernels_jax import _jax_native as _native


class ExtensionBase(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("type", C.c_int), ("next", C.c_void_p)]


class ApiVersion(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("extension_start", C.c_void_p), ("major", C.c_int), ("minor", C.c_int)]


class Metadata(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("api_version", ApiVersion), ("traits", C.c_uint32)]


class MetadataExtension(C.Structure):
    _fields_ = [("base", ExtensionBase), ("metadata", C.POINTER(Metadata))]


class Buffer(C.Structure):
    _fields_ = [
        ("struct_size", C.c_size_t), ("extension_start", C.c_void_p), ("dtype", C.c_int),
        ("data", C.c_void_p), ("rank", C.c_int64), ("dims", C.POINTER(C.c_int64)),
    ]  # fmt: skip


class Args(C.Structure):
    _fields_ = [
        ("struct_size", C.c_size_t), ("extension_start", C.c_void_p), ("size", C.c_int64),
        ("types", C.POINTER(C.c_int)), ("args", C.POINTER(C.c_void_p)),
    ]  # fmt: skip


class ByteSpan(C.Structure):
    _fields_ = [("ptr", C.c_char_p), ("len", C.c_size_t)]


class Scalar(C.Structure):
    _fields_ = [("dtype", C.c_int), ("value", C.c_void_p)]


class Attrs(C.Structure):
    _fields_ = [
        ("struct_size", C.c_size_t), ("extension_start", C.c_void_p), ("size", C.c_int64),
        ("types", C.POINTER(C.c_int)), ("names", C.POINTER(C.POINTER(ByteSpan))), ("attrs", C.POINTER(C.c_void_p)),
    ]  # fmt: skip


class CallFrame(C.Structure):
    _fields_ = [
        ("struct_size", C.c_size_t), ("extension_start", C.c_void_p), ("api", C.c_void_p), ("ctx", C.c_void_p),
        ("stage", C.c_int), ("args", Args), ("rets", Args), ("attrs", Attrs), ("future", C.c_void_p),
    ]  # fmt: skip


class ErrorCreateArgs(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("extension_start", C.c_void_p), ("message", C.c_char_p), ("errc", C.c_int)]


class StreamGetArgs(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("extension_start", C.c_void_p), ("ctx", C.c_void_p), ("stream", C.c_void_p)]


ERROR_CREATE = C.CFUNCTYPE(C.c_void_p, C.POINTER(ErrorCreateArgs))
STREAM_GET = C.CFUNCTYPE(C.c_void_p, C.POINTER(StreamGetArgs))


class Api(C.Structure):
    _fields_ = [
        ("struct_size", C.c_size_t), ("extension_start", C.c_void_p), ("api_version", ApiVersion),
        ("internal_api", C.c_void_p), ("error_create", ERROR_CREATE), ("error_get_message", C.c_void_p),
        ("error_destroy", C.c_void_p), ("handler_register", C.c_void_p), ("stream_get", STREAM_GET),
    ]  # fmt: skip


HANDLER = C.CFUNCTYPE(C.c_void_p, C.POINTER(CallFrame))
F32, S32, BF16 = 11, 4, 16
EXECUTE, BUFFER, SCALAR = 3, 1, 3


def handlers():
    get = C.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = C.c_void_p, [C.py_object, C.c_char_p]
    return {name: HANDLER(get(cap, None)) for name, cap in _native.targets()}


def test_layouts_are_the_headers():
    # x86-64 / aarch64 Linux sizes of the header's structs, which the Rust side asserts too.
    assert (C.sizeof(Buffer), C.sizeof(Args), C.sizeof(Attrs), C.sizeof(Metadata)) == (48, 40, 48, 40)
    assert CallFrame.attrs.offset == 120 and Api.stream_get.offset == 80


def test_targets_are_capsules_of_handlers():
    t = dict(_native.targets())
    ops = ("unary_fwd", "unary_bwd", "softmax_fwd", "softmax_bwd", "norm_fwd", "norm_bwd", "cross_entropy_fwd", "cross_entropy_bwd",
           "linear_fwd", "linear_bwd", "attention_fwd", "attention_bwd")
    for op in ops:
        assert type(t[f"kernels_{op}"]).__name__ == "PyCapsule", op
    assert all(h for h in handlers().values())


def test_unary_table():
    names = [row[0] for row in _native.UNARY_OPS]
    assert {"gelu", "silu", "relu", "tanh", "exp"} <= set(names) and len(names) == len(set(names))


def test_api_version_setting():
    before = _native.api_version()
    try:
        _native.set_api_version(0, 3)
        assert _native.api_version() == (0, 3)
        with pytest.raises(ValueError, match="API 1.0"):
            _native.set_api_version(1, 0)
        assert _native.api_version() == (0, 3)
    finally:
        _native.set_api_version(*before)


def metadata_query(handler, api=None):
    md = Metadata(struct_size=C.sizeof(Metadata) - 4)  # the header's size: up to `traits`
    md.api_version.struct_size = C.sizeof(ApiVersion)
    ext = MetadataExtension(ExtensionBase(C.sizeof(MetadataExtension), 1, None), C.pointer(md))
    frame = CallFrame(struct_size=CallFrame.future.offset, extension_start=C.addressof(ext), stage=EXECUTE)
    frame.api = None if api is None else C.addressof(api)
    err = handler(C.byref(frame))
    return err, md


@pytest.mark.parametrize("minor", [1, 2, 5])
def test_metadata_query_reports_the_set_version(minor):
    # The version the registration of the other tests' targets set is restored after.
    before = _native.api_version()
    try:
        _native.set_api_version(0, minor)
        for name, h in handlers().items():
            err, md = metadata_query(h)
            assert err is None, name
            assert (md.api_version.major, md.api_version.minor, md.traits) == (0, minor, 0), name
            assert md.api_version.struct_size == C.sizeof(ApiVersion)
    finally:
        _native.set_api_version(*before)


class FakeXla:
    """An API table whose error constructor records the messages, and whose stream getter gives
    a null stream: what a handler sees before it reaches the driver."""

    def __init__(self):
        self.errors = []
        self._create = ERROR_CREATE(self.create)
        self._stream = STREAM_GET(self.stream)
        self.api = Api(struct_size=C.sizeof(Api), error_create=self._create, stream_get=self._stream)
        self.api.api_version = ApiVersion(C.sizeof(ApiVersion), None, 0, 1)

    def create(self, args):
        self.errors.append((args.contents.errc, args.contents.message.decode()))
        return 0x1000 + len(self.errors)  # an opaque non-null handle

    def stream(self, args):
        args.contents.stream = None
        return None


def buffers(specs, keep):
    """An ``XLA_FFI_Args`` of buffers ``(dtype, dims)`` with fake addresses."""
    bufs = []
    for dtype, dims in specs:
        d = (C.c_int64 * len(dims))(*dims)
        b = Buffer(C.sizeof(Buffer), None, dtype, 0x10000, len(dims), d)
        keep += [d, b]
        bufs.append(C.addressof(b))
    types = (C.c_int * len(specs))(*([BUFFER] * len(specs)))
    ptrs = (C.c_void_p * len(specs))(*bufs)
    keep += [types, ptrs]
    return Args(C.sizeof(Args), None, len(specs), types, ptrs)


def attributes(attrs, keep):
    """An ``XLA_FFI_Attrs`` of scalars ``name -> (dtype, value)``."""
    names, vals = [], []
    for name, (dtype, value) in sorted(attrs.items()):
        raw = name.encode()
        span = ByteSpan(raw, len(raw))
        v = (C.c_int32 if dtype == S32 else C.c_float)(value)
        s = Scalar(dtype, C.addressof(v))
        keep += [raw, span, v, s]
        names.append(C.pointer(span))
        vals.append(C.addressof(s))
    n = len(attrs)
    types = (C.c_int * n)(*([SCALAR] * n))
    name_arr = (C.POINTER(ByteSpan) * n)(*names)
    val_arr = (C.c_void_p * n)(*vals)
    keep += [types, name_arr, val_arr]
    return Attrs(C.sizeof(Attrs), None, n, types, name_arr, val_arr)


def call(target, args, rets, attrs, size=None):
    xla, keep = FakeXla(), []
    frame = CallFrame(
        struct_size=size or C.sizeof(CallFrame), api=C.addressof(xla.api), stage=EXECUTE,
        args=buffers(args, keep), rets=buffers(rets, keep), attrs=attributes(attrs, keep),
    )  # fmt: skip
    err = handlers()[f"kernels_{target}"](C.byref(frame))
    return err, xla.errors


CODE = {r[0]: i for i, r in enumerate(_native.UNARY_OPS)}
GELU = {"op": (S32, [r[0] for r in _native.UNARY_OPS].index("gelu")), "a": (F32, 0.0), "b": (F32, 0.0)}
INVALID_ARGUMENT = 3


@pytest.mark.parametrize(
    "target,args,rets,attrs,message",
    [
        ("unary_fwd", [(S32, [4, 8])], [(S32, [4, 8])], GELU, "unary_fwd: operand 0 has dtype int32; expected float32"),
        ("unary_fwd", [(F32, [4])], [(F32, [4])], {}, "unary_fwd: missing attribute op"),
        ("unary_fwd", [(F32, [4]), (F32, [4])], [(F32, [4])], GELU, "unary_fwd: 2 operands and 1 results; expected 1 and 1"),
        ("unary_fwd", [(F32, [4])], [(F32, [4])], {**GELU, "op": (S32, 999)}, "unknown unary op code 999"),
        ("unary_fwd", [(F32, [4, 8])], [(F32, [8, 4])], GELU, "result 0 has shape [8, 4]; expected [4, 8]"),
        ("unary_bwd", [(F32, [4]), (BF16, [4])], [(F32, [4])], GELU, "unary_bwd: operand 1 has dtype bfloat16; expected F32"),
        ("softmax_fwd", [(F32, [])], [(F32, [])], {"log": (S32, 0)}, "softmax_fwd: a scalar"),
        ("norm_fwd", [(F32, [4, 8])], [(F32, [4, 8]), (F32, [4])], {"layer": (S32, 0), "weight": (S32, 0), "bias": (S32, 1), "eps": (F32, 1e-5)}, "RMS norm has no bias"),
        ("norm_fwd", [(F32, [4, 8]), (F32, [7])], [(F32, [4, 8]), (F32, [4])], {"layer": (S32, 0), "weight": (S32, 1), "bias": (S32, 0), "eps": (F32, 1e-5)}, "operand 1 has shape [7]; expected 8 elements"),
        ("cross_entropy_fwd", [(F32, [4, 8]), (S32, [4])], [(F32, []), (F32, [4]), (F32, [1])], {"reduction": (S32, 1), "ignore_index": (S32, -100), "label_smoothing": (F32, 0.0)}, "operand 1 (the targets) has dtype int32 and shape [4]; expected int64 [4] or int32 [4, 2]"),
        ("cross_entropy_fwd", [(F32, [4, 8]), (S32, [4, 2])], [(F32, [4]), (F32, [4]), (F32, [1])], {"reduction": (S32, 1), "ignore_index": (S32, -100), "label_smoothing": (F32, 0.0)}, "result 0 has shape [4]; expected 1 elements ([])"),
        ("linear_fwd", [(F32, [4, 8]), (F32, [3, 7])], [(F32, [4, 3])], {"act": (S32, CODE["identity"]), "bias": (S32, 0)}, "operand 1 (the weight) has shape [3, 7]; expected [out, 8]"),
        ("linear_fwd", [(F32, [4, 8]), (F32, [3, 8])], [(F32, [4, 3])], {"act": (S32, CODE["mish"]), "bias": (S32, 0)}, "activation mish is not fused into the GEMM"),
        ("linear_bwd", [(F32, [4, 8]), (F32, [3, 8]), (F32, [4, 3])], [(F32, [4, 8]), (F32, [8, 3])], {"bias": (S32, 0)}, "result 1 has shape [8, 3]; expected [3, 8]"),
        ("attention_fwd", [(BF16, [1, 4, 2]), (BF16, [1, 4, 2, 8]), (BF16, [1, 4, 2, 8])], [(BF16, [1, 4, 2]), (F32, [1, 2, 4])],
         {"layout": (S32, 1), "causal": (S32, 0), "scale": (F32, 0.0), "window_left": (S32, -1), "window_right": (S32, -1)}, "operand 0 has shape [1, 4, 2]; expected rank 4"),
    ],
)  # fmt: skip
def test_handlers_refuse_bad_calls_with_an_xla_error(target, args, rets, attrs, message):
    err, errors = call(target, args, rets, attrs)
    assert err is not None, "the handler accepted a bad call"
    assert len(errors) == 1 and errors[0][0] == INVALID_ARGUMENT, errors
    assert message in errors[0][1], errors[0][1]


def test_a_too_small_call_frame_is_refused():
    err, errors = call("unary_fwd", [(F32, [4])], [(F32, [4])], GELU, size=64)
    assert err is not None and "XLA_FFI_CallFrame of 64 bytes is too small" in errors[0][1], errors
