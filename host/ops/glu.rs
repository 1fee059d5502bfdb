//! Gated activations (host side of `kernels-gpu/src/glu.rs`): `act(a) * b`, SwiGLU
//! (`Activation::Silu`), GeGLU (`Gelu`, `GeluTanh`), GLU (`Sigmoid`), ReGLU (`Relu`) or any other
//! activation, from one fused input `[.., 2F]` ([`glu`]) or two tensors ([`glu2`]), forward and
//! backward, each one pass over the memory.

use super::elementwise::Activation;
use super::{check_same_device, check_same_dtype, check_same_shape, with_elem};
use crate::error::{Error, Result};
use crate::launch;
use crate::tensor::Tensor;
use kernels_gpu::Elem;
use kernels_gpu::glu::{GluBwdArgs, GluElem, GluFwdArgs};

/// The fused input's rows: `(rows, F)` of `x: [.., 2F]`; an error for a scalar or an odd last
/// dimension.
fn halves(op: &'static str, x: &Tensor) -> Result<(u64, u64)> {
    let Some(&last) = x.shape().last() else {
        return Err(Error::InvalidArgument {
            op,
            message: "needs a tensor [.., 2F] (its halves are a and b), got a scalar".into(),
        });
    };
    if !last.is_multiple_of(2) {
        return Err(Error::InvalidArgument {
            op,
            message: format!("the last dimension must be even (a, b = its halves), got shape {:?}", x.shape()),
        });
    }
    let rows = x.numel().checked_div(last).unwrap_or(0);
    Ok((rows as u64, last as u64 / 2))
}

/// The shape of `x: [.., 2F]` with its last dimension halved.
fn half_shape(x: &Tensor) -> Vec<usize> {
    let mut s = x.shape().to_vec();
    if let Some(l) = s.last_mut() {
        *l /= 2;
    }
    s
}

/// Two same-shaped tensors' rows `(rows, F)` over the last dimension (a scalar is one row of one).
fn rows_of(x: &Tensor) -> (u64, u64) {
    let cols = x.last_dim();
    ((x.numel().checked_div(cols).unwrap_or(0)) as u64, cols as u64)
}

fn check_pair(name: &'static str, a: &Tensor, b: &Tensor, detail: &'static str) -> Result<()> {
    check_same_device(name, a, b)?;
    check_same_dtype(name, a, b)?;
    check_same_shape(name, a, b, detail)
}

/// `act(a) * b` with `a = x[.., :F]`, `b = x[.., F:]` (PyTorch's `F.glu` split of `x: [.., 2F]`),
/// shape `[.., F]`: SwiGLU with `Activation::Silu`, GeGLU with `Gelu` or `GeluTanh`, GLU with
/// `Sigmoid`, ReGLU with `Relu`.
pub fn glu(x: &Tensor, act: Activation) -> Result<Tensor> {
    let name = "glu";
    halves(name, x)?;
    let mut out = Tensor::alloc(name, x.device(), &half_shape(x), x.dtype())?;
    glu_out(x, act, &mut out)?;
    Ok(out)
}

/// [`glu`] into `out` (shape `[.., F]`, the dtype of `x`).
pub fn glu_out(x: &Tensor, act: Activation, out: &mut Tensor) -> Result<()> {
    let name = "glu_out";
    act.validate(name)?;
    let (rows, f) = halves(name, x)?;
    check_same_device(name, x, out)?;
    check_same_dtype(name, x, out)?;
    super::check::shapes_match(name, &half_shape(x), out.shape(), "the output is [.., F] of x: [.., 2F]")?;
    let xp = x.dev_ptr_u64();
    let bp = xp + f * x.dtype().size() as u64;
    launch_fwd(name, x, xp, bp, out, rows, f, 2 * f, act)
}

/// `act(a) * b` of two tensors of one shape.
pub fn glu2(a: &Tensor, b: &Tensor, act: Activation) -> Result<Tensor> {
    let name = "glu2";
    check_pair(name, a, b, "a and b must have one shape")?;
    let mut out = a.alloc_like(name)?;
    glu2_out(a, b, act, &mut out)?;
    Ok(out)
}

/// [`glu2`] into `out` (the shape and dtype of `a`).
pub fn glu2_out(a: &Tensor, b: &Tensor, act: Activation, out: &mut Tensor) -> Result<()> {
    let name = "glu2_out";
    act.validate(name)?;
    check_pair(name, a, b, "a and b must have one shape")?;
    check_pair(name, a, out, "the output has the shape of a")?;
    let (rows, f) = rows_of(a);
    launch_fwd(name, a, a.dev_ptr_u64(), b.dev_ptr_u64(), out, rows, f, f, act)
}

/// Launches the forward: `rows` rows of `f` outputs from `a`, `b` at `ap`, `bp` (rows of `ld`,
/// inside `x`, which the callers checked against `out` and the shapes).
#[allow(clippy::too_many_arguments)]
fn launch_fwd(
    name: &'static str,
    x: &Tensor,
    ap: u64,
    bp: u64,
    out: &mut Tensor,
    rows: u64,
    f: u64,
    ld: u64,
    act: Activation,
) -> Result<()> {
    let (k, p0, p1) = act.kernel();
    with_elem!(x.dtype(), |T| {
        let Some(cfg) = launch::glu(name, rows, f, T::VEC as u64)? else { return Ok(()) };
        let kernel = k.glu_kernels::<T>().fwd;
        let args: GluFwdArgs<T> = (ap as *const T, bp as *const T, out.dev_ptr_mut()?, rows, f, ld, p0, p1);
        // SAFETY: a and b are rows of `ld` elements (the first `f` of each read) inside tensors of
        // `rows * ld` elements from `ap` (the fused input, b its second half) or of `rows * f`
        // (two tensors, ld = f); out holds rows * f elements; out is a tensor of its own (taken
        // `&mut`), so it overlaps no input.
        unsafe { x.device().launch(kernel, cfg, args) }
    })
}

/// Gradient of [`glu`]'s input `x: [.., 2F]` given the output's gradient `grad: [.., F]`:
/// `[grad * b * act'(a), grad * act(a)]` along the last dimension.
pub fn glu_backward(x: &Tensor, grad: &Tensor, act: Activation) -> Result<Tensor> {
    let name = "glu_backward";
    halves(name, x)?;
    let mut dx = x.alloc_like(name)?;
    glu_backward_out(x, grad, act, &mut dx)?;
    Ok(dx)
}

/// [`glu_backward`] into `dx` (the shape and dtype of `x`).
pub fn glu_backward_out(x: &Tensor, grad: &Tensor, act: Activation, dx: &mut Tensor) -> Result<()> {
    let name = "glu_backward";
    act.validate(name)?;
    let (rows, f) = halves(name, x)?;
    check_same_device(name, x, grad)?;
    check_same_dtype(name, x, grad)?;
    super::check::shapes_match(name, &half_shape(x), grad.shape(), "the gradient is [.., F] of x: [.., 2F]")?;
    check_pair(name, x, dx, "the input's gradient has the shape of x")?;
    let size = x.dtype().size() as u64;
    let xp = x.dev_ptr_u64();
    let dp = dx.dev_ptr_mut::<u8>()? as u64;
    launch_bwd(name, x, [xp, xp + f * size], grad, [dp, dp + f * size], rows, f, 2 * f, act)
}

/// Gradients `(da, db)` of [`glu2`] given the output's gradient `grad`: `grad * b * act'(a)` and
/// `grad * act(a)`.
pub fn glu2_backward(a: &Tensor, b: &Tensor, grad: &Tensor, act: Activation) -> Result<(Tensor, Tensor)> {
    let name = "glu2_backward";
    check_pair(name, a, b, "a and b must have one shape")?;
    let (mut da, mut db) = (a.alloc_like(name)?, a.alloc_like(name)?);
    glu2_backward_out(a, b, grad, act, &mut da, &mut db)?;
    Ok((da, db))
}

/// [`glu2_backward`] into `da` and `db` (the shape and dtype of `a`).
pub fn glu2_backward_out(
    a: &Tensor,
    b: &Tensor,
    grad: &Tensor,
    act: Activation,
    da: &mut Tensor,
    db: &mut Tensor,
) -> Result<()> {
    let name = "glu2_backward";
    act.validate(name)?;
    check_pair(name, a, b, "a and b must have one shape")?;
    check_pair(name, a, grad, "the gradient has the shape of a")?;
    check_pair(name, a, da, "a's gradient has the shape of a")?;
    check_pair(name, a, db, "b's gradient has the shape of a")?;
    let (rows, f) = rows_of(a);
    let dap = da.dev_ptr_mut::<u8>()? as u64;
    let dbp = db.dev_ptr_mut::<u8>()? as u64;
    launch_bwd(name, a, [a.dev_ptr_u64(), b.dev_ptr_u64()], grad, [dap, dbp], rows, f, f, act)
}

/// Launches the backward: inputs at `ab`, their gradients at `dab` (rows of `ld`), `grad` rows of
/// `f`; the callers checked the shapes, dtypes and devices.
#[allow(clippy::too_many_arguments)]
fn launch_bwd(
    name: &'static str,
    x: &Tensor,
    ab: [u64; 2],
    grad: &Tensor,
    dab: [u64; 2],
    rows: u64,
    f: u64,
    ld: u64,
    act: Activation,
) -> Result<()> {
    let (k, p0, p1) = act.kernel();
    with_elem!(x.dtype(), |T| launch_bwd_t::<T>(name, x, ab, grad, dab, rows, f, ld, k, p0, p1))
}

#[allow(clippy::too_many_arguments)]
fn launch_bwd_t<T: GluElem>(
    name: &'static str,
    x: &Tensor,
    ab: [u64; 2],
    grad: &Tensor,
    dab: [u64; 2],
    rows: u64,
    f: u64,
    ld: u64,
    k: kernels_gpu::ops::Activation,
    p0: f32,
    p1: f32,
) -> Result<()> {
    let Some(cfg) = launch::glu(name, rows, f, T::VEC as u64)? else { return Ok(()) };
    let kernel = k.glu_kernels::<T>().bwd;
    let args: GluBwdArgs<T> =
        (ab[0] as *const T, ab[1] as *const T, grad.dev_ptr(), dab[0] as *mut T, dab[1] as *mut T, rows, f, ld, p0, p1);
    // SAFETY: the inputs and their gradients are rows of `ld` elements (the first `f` of each
    // touched) inside tensors of `rows * ld` (fused, the second half `f` elements on) or
    // `rows * f` elements (ld = f); grad holds rows * f. The gradients were taken `&mut` (their
    // own memory), so they overlap no input, and da and db are disjoint halves or two tensors.
    unsafe { x.device().launch(kernel, cfg, args) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each activation's gated kernels carry its name, and every dtype its own.
    #[test]
    fn activations_select_their_own_kernels() {
        fn names<T: GluElem>() -> Vec<(String, &'static str)> {
            let s = T::DTYPE.suffix();
            let mut v = Vec::new();
            for a in Activation::ALL {
                let k = a.kernel().0.glu_kernels::<T>();
                v.push((format!("glu_{}_fwd_{s}", a.name()), k.fwd.name()));
                v.push((format!("glu_{}_bwd_{s}", a.name()), k.bwd.name()));
            }
            v
        }
        for (want, got) in
            names::<f32>().into_iter().chain(names::<kernels_gpu::F16>()).chain(names::<kernels_gpu::BF16>())
        {
            assert_eq!(want, got);
        }
    }
}
