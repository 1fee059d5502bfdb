"""The native layer alone, without PyTorch (what CI can check on a machine without a GPU)."""

import pytest

from kernels_torch import _native

# gelu's code: its row in the op table the native module exports.
GELU = [row[0] for row in _native.UNARY_OPS].index("gelu")


def test_imports_and_reports_cuda_status():
    ok, why = _native.cuda_status()
    assert isinstance(ok, bool) and isinstance(why, str) and why
    assert _native.ALIGNMENT == 16
    assert _native.PTX_ARCH.startswith("sm_")


def test_the_op_table_is_exported():
    names = [row[0] for row in _native.UNARY_OPS]
    assert len(names) == len(set(names)) and {"neg", "gelu", "elu", "softsign"} <= set(names)
    for name, activation, params, from_output, positive, torch_fn, module, doc in _native.UNARY_OPS:
        assert isinstance(activation, bool) and isinstance(positive, bool) and doc
        assert from_output in ("y", "yx", "y1", "-") and torch_fn
        assert all(isinstance(p, str) and isinstance(v, float) for p, v in params)
    assert set(_native.LINEAR_ACTIVATIONS) <= {n for n, a, *_ in _native.UNARY_OPS if a}


def test_an_op_without_cuda_says_so():
    ok, why = _native.cuda_status()
    if ok:
        pytest.skip(f"CUDA is available here ({why}); this checks the message without it")
    # f32 gelu of 4 elements at made-up addresses: refused before any address is used.
    with pytest.raises(RuntimeError) as e:
        _native.activation_fwd(0, 0, 0, GELU, 0.0, 0.0, 0x1000, 0x2000, 4)
    msg = str(e.value)
    assert "no CUDA driver" in msg or "no CUDA device" in msg, msg
    assert msg == why or msg.startswith("no CUDA"), msg


def test_bad_codes_are_refused():
    ok, _ = _native.cuda_status()
    if not ok:
        pytest.skip("the device is initialised before the codes are read")
    with pytest.raises(TypeError, match="dtype code 7"):
        _native.activation_fwd(0, 0, 7, GELU, 0.0, 0.0, 0, 0, 0)
    with pytest.raises(ValueError, match="unary op code 99"):
        _native.activation_fwd(0, 0, 0, 99, 0.0, 0.0, 0, 0, 0)
    with pytest.raises(ValueError, match="is not an activation"):
        _native.activation_fwd(0, 0, 0, 0, 0.0, 0.0, 0, 0, 0)  # row 0 is a math op
    with pytest.raises(ValueError, match="unary op code 200"):
        _native.unary_fwd(0, 0, 0, 200, 0.0, 0.0, 0, 0, 0)
    with pytest.raises(ValueError, match="binary op code 4"):
        _native.binary_fwd(0, 0, 0, 4, 0, 0, 0, 0)
