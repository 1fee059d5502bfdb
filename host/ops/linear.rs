//! The linear layer, `y = act(x @ W^T + b)` (PyTorch's `act(F.linear(x, W, b))`), forward and
//! backward, built on the GEMM of [`mod@super::gemm`] and the element-wise kernels. No kernels
//! of its own, so it has no device-side file.
//!
//! - Inference ([`linear`]): one GEMM whose store adds the bias and applies the activation
//!   (relu, GELU, GELU-tanh, SiLU; another activation costs one element-wise pass more).
//! - Training ([`linear_train`]): the backward of GELU and SiLU needs the pre-activation
//!   `z = x @ W^T + b`, so the GEMM stores `z` and an element-wise pass writes `act(z)`; both are
//!   returned, `z` in [`LinearSaved`]. The extra pass moves `2 * rows * out` floats, about 1% of
//!   the GEMM's time at 8192 x 4096 by 4096 x 4096. Relu and identity need no `z` (relu'(z) is
//!   read off y > 0, as PyTorch does) and stay one kernel.
//! - Backward ([`linear_backward`]): `dz = act'(z) * dy` (element-wise), `dx = dz @ W`,
//!   `dW = dz^T @ x` (the GEMM reads dz transposed in place) and `db = sum of dz over the rows`.
//!
//! Dtypes: f32 (the f32 GEMM), or bf16 or f16 throughout (x, weight, bias, dy, the outputs and
//! the gradients): the products run on the tensor cores with f32 accumulation and round once
//! to the dtype, the epilogue (bias, activation) in f32 before that rounding; `z`, `dz` and the
//! non-fused activations are stored in the dtype (as PyTorch's autocast keeps them), and `db`
//! sums in f32 and rounds once. Mixed dtypes are an [`Error::InvalidArgument`].

use super::gemm::{Gemm, gemm_dims};
use super::{Activation, ReduceOp, check_same_device, reduce_leading_dims, unary_, unary_backward};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// What [`linear_train`] keeps for the backward: the pre-activation `z` when the activation's
/// derivative needs it (all but identity and relu).
pub struct LinearSaved {
    /// `z = x @ W^T + b`, `[rows, out]`, where the activation's derivative needs it.
    pub pre: Option<Tensor>,
    act: Activation,
}

/// Gradients of a linear layer.
pub struct LinearGrads {
    /// Of the input, `x`'s shape.
    pub x: Tensor,
    /// Of the weight, `[out, in]`.
    pub weight: Tensor,
    /// Of the bias, `[out]` (when the layer has one).
    pub bias: Option<Tensor>,
}

/// `(rows, in, out)` of `x [..., in] @ W^T` with `W [out, in]`, checked: `x`, `weight` and `bias`
/// all f32, all bf16 or all f16 (the dtype of the result and of every gradient).
fn shapes(op: &'static str, x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<(usize, usize, usize)> {
    for (name, t) in [("weight", w)].into_iter().chain(bias.map(|b| ("bias", b))) {
        if t.dtype() != x.dtype() {
            return Err(Error::InvalidArgument {
                op,
                message: format!(
                    "x is {:?} but {name} is {:?} (shape {:?}): x, weight and bias must share one dtype \
                     (cast first)",
                    x.dtype(),
                    t.dtype(),
                    t.shape()
                ),
            });
        }
        check_same_device(op, x, t)?;
    }
    let &[out, inp] = w.shape() else {
        return Err(Error::InvalidArgument {
            op,
            message: format!("weight must be [out, in], got shape {:?}", w.shape()),
        });
    };
    let Some(&xin) = x.shape().last() else {
        return Err(Error::InvalidArgument { op, message: "x must have at least one dimension, got a scalar".into() });
    };
    if xin != inp {
        return Err(Error::InvalidArgument {
            op,
            message: format!(
                "x's last dimension ({xin}) must equal weight's in ({inp}): x {:?}, weight {:?}",
                x.shape(),
                w.shape()
            ),
        });
    }
    if let Some(b) = bias
        && b.shape() != [out]
    {
        return Err(Error::InvalidArgument {
            op,
            message: format!("bias must have shape [{out}], got {:?}", b.shape()),
        });
    }
    // The leading dimensions' product, not numel / in: with in = 0 the rows still count.
    let rows = x.shape()[..x.shape().len() - 1].iter().product();
    Ok((rows, inp, out))
}

/// `x @ W^T + b` (then `act`, fused when it can be) into a new `[..., out]` tensor.
fn forward(op: &'static str, x: &Tensor, w: &Tensor, bias: Option<&Tensor>, fused: Activation) -> Result<Tensor> {
    let (rows, inp, out) = shapes(op, x, w, bias)?;
    let mut shape = x.shape().to_vec();
    *shape.last_mut().expect("checked: at least one dimension") = out;
    // y of x's dtype; bf16 and f16 accumulate in f32 on the tensor cores and round once.
    let mut y = Tensor::alloc(op, x.device(), &shape, x.dtype())?;
    // x [..., in] as the matrix [rows, in], y as [rows, out].
    let wd = (None, out, inp);
    gemm_dims(op, (x, (None, rows, inp)), (w, wd), (&mut y, (None, rows, out)), Gemm::new(false, true), bias, fused)?;
    Ok(y)
}

/// `act(x @ W^T + b)`: `x` is `[..., in]`, `weight` `[out, in]` (PyTorch's layout), `bias` `[out]`;
/// the result is `[..., out]`. One kernel for identity, relu, GELU, GELU-tanh and SiLU.
pub fn linear(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>, act: Activation) -> Result<Tensor> {
    let op = "linear";
    if super::gemm::fused_activation(act).is_some() {
        return forward(op, x, weight, bias, act);
    }
    let mut y = forward(op, x, weight, bias, Activation::Identity)?;
    unary_(&mut y, act)?;
    Ok(y)
}

/// [`linear`] for training: returns `y` and what [`linear_backward`] needs.
pub fn linear_train(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    act: Activation,
) -> Result<(Tensor, LinearSaved)> {
    let op = "linear_train";
    if matches!(act, Activation::Identity | Activation::Relu) {
        let y = forward(op, x, weight, bias, act)?;
        return Ok((y, LinearSaved { pre: None, act }));
    }
    let z = forward(op, x, weight, bias, Activation::Identity)?;
    let mut y = z.try_clone()?;
    unary_(&mut y, act)?;
    Ok((y, LinearSaved { pre: Some(z), act }))
}

/// Gradients of `y = act(x @ W^T + b)` given `dy` (y's shape): `x`, `weight` and `y` as in the
/// forward (`y` is read for relu, `saved.pre` for the other activations), `bias` the forward's:
/// its gradient is returned if given (the bias's value is not needed, only whether there is one).
pub fn linear_backward(
    x: &Tensor,
    weight: &Tensor,
    y: &Tensor,
    saved: &LinearSaved,
    dy: &Tensor,
    bias: Option<&Tensor>,
) -> Result<LinearGrads> {
    let op = "linear_backward";
    let (rows, inp, out) = shapes(op, x, weight, bias)?;
    for (name, t) in [("y", y), ("dy", dy)] {
        if t.numel() != rows * out || t.shape().last() != Some(&out) || t.dtype() != x.dtype() {
            return Err(Error::InvalidArgument {
                op,
                message: format!(
                    "{name} must be {:?} (x's dtype) [..., {out}] with {rows} rows, got {:?} {:?}",
                    x.dtype(),
                    t.dtype(),
                    t.shape()
                ),
            });
        }
        check_same_device(op, x, t)?;
    }
    // dz = act'(z) * dy. Relu's derivative from y: y > 0 exactly where z > 0 (relu(z) = z there),
    // and relu's backward at x = y gives dy where y > 0 and 0 elsewhere.
    let dz_owned;
    let dz: &Tensor = match (saved.act, &saved.pre) {
        (Activation::Identity, _) => dy,
        (Activation::Relu, _) => {
            dz_owned = unary_backward(y, dy, Activation::Relu)?;
            &dz_owned
        }
        (act, Some(z)) => {
            dz_owned = unary_backward(z, dy, act)?;
            &dz_owned
        }
        (act, None) => {
            return Err(Error::InvalidArgument {
                op,
                message: format!(
                    "{act:?} needs the pre-activation, which this LinearSaved lacks (made by linear_train?)"
                ),
            });
        }
    };
    let (dzd, xd, wd) = ((None, rows, out), (None, rows, inp), (None, out, inp));
    // dx [rows, in] = dz [rows, out] @ W [out, in].
    let mut dx = Tensor::alloc(op, x.device(), x.shape(), x.dtype())?;
    gemm_dims(op, (dz, dzd), (weight, wd), (&mut dx, xd), Gemm::default(), None, Activation::Identity)?;
    // dW [out, in] = dz^T @ x: dz read transposed in place.
    let mut dw = Tensor::alloc(op, x.device(), &[out, inp], x.dtype())?;
    gemm_dims(op, (dz, dzd), (x, xd), (&mut dw, wd), Gemm::new(true, false), None, Activation::Identity)?;
    // db = the column sums of dz over all its leading dimensions, accumulated in f32 (bf16 and
    // f16 too) in a fixed order and rounded once.
    let db = if bias.is_some() { Some(reduce_leading_dims(dz, ReduceOp::Sum)?) } else { None };
    Ok(LinearGrads { x: dx, weight: dw, bias: db })
}
