//! Indexing along one dimension (host side of `kernels-gpu/src/index.rs`), as PyTorch's:
//! [`index_select`] and its gradient [`index_select_backward`] (an [`index_add`] into zeros),
//! [`gather`] and its gradient [`gather_backward`] (a [`scatter_add`] into zeros), each with
//! `_out` or in-place (`_`) forms and `Tensor` methods; and [`IndexTensor::randint`].
//!
//! Indices are int64 ([`IndexTensor`]). An index outside `[0, size)` of the indexed dimension,
//! a negative one included (PyTorch does not wrap them here either), is an
//! [`Error::InvalidArgument`] naming its position: the kernels flag it on the device, as
//! [`embedding_checked`](super::embedding_checked) does, and the op reads the flag back, so
//! every call of these ops waits for the device once. The sums ([`index_add`],
//! [`scatter_add`] and the backward passes) check before they write: on that error an in-place
//! target is left unchanged.
//!
//! The sums are deterministic, with no float atomics: each output element is its own value (or
//! +0.0) plus the contributions of the indices that name it, added in f32 in increasing position
//! of the index (row-major) and rounded once to the dtype. The same inputs give the same bits on
//! every run and every GPU. The work is a sort of the indices (`embedding_backward`'s bitonic
//! sort) and one pass over the output.

use super::check::{check_same_device, check_same_dtype, shapes_match, with_elem};
use super::embedding::{MAX_BACKWARD_INDICES, MAX_ROWS, row_starts, sort_keys};
use crate::device::{Device, LaunchConfig};
use crate::error::{Error, Result};
use crate::launch;
use crate::tensor::{IndexTensor, Tensor};
use kernels_gpu::broadcast::{MAX_RANK, StridedGeom};
use kernels_gpu::embedding::row_items;
use kernels_gpu::index::{
    GatherArgs, IndexAddArgs, IndexCheckArgs, IndexElem, IndexSelectArgs, ScatterAddArgs, ScatterGeom, index_check,
};

/// `dim` must be a dimension of `shape` (rank at least 1).
fn check_dim(op: &'static str, shape: &[usize], dim: usize) -> Result<()> {
    if dim >= shape.len() {
        return Err(Error::InvalidArgument {
            op,
            message: format!("dimension {dim} of a tensor of rank {} (shape {shape:?})", shape.len()),
        });
    }
    Ok(())
}

/// The rank must be at most the strided kernels' [`MAX_RANK`].
fn check_rank(op: &'static str, shape: &[usize]) -> Result<()> {
    if shape.len() > MAX_RANK {
        return Err(Error::InvalidArgument {
            op,
            message: format!("rank {} (shape {shape:?}) is above the index kernels' {MAX_RANK}", shape.len()),
        });
    }
    Ok(())
}

fn check_idx_device(op: &'static str, t: &Tensor, idx: &IndexTensor) -> Result<()> {
    if idx.device() != t.device() {
        return Err(Error::DeviceMismatch { op, expected: t.device().ordinal(), got: idx.device().ordinal() });
    }
    Ok(())
}

/// The index of `index_select` and `index_add`: rank 0 or 1.
fn check_vector(op: &'static str, idx: &IndexTensor) -> Result<()> {
    if idx.shape().len() > 1 {
        return Err(Error::InvalidArgument {
            op,
            message: format!("the index must have rank 0 or 1, got shape {:?}", idx.shape()),
        });
    }
    Ok(())
}

/// `(outer, size, inner)`: the products of the dimensions before `dim`, `dim`'s, and after.
fn around(shape: &[usize], dim: usize) -> (usize, usize, usize) {
    (shape[..dim].iter().product(), shape[dim], shape[dim + 1..].iter().product())
}

/// `shape` with dimension `dim` set to `size`.
fn with_dim(shape: &[usize], dim: usize, size: usize) -> Vec<usize> {
    let mut s = shape.to_vec();
    s[dim] = size;
    s
}

/// Row-major strides of `shape`.
fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        s[d] = s[d + 1] * shape[d + 1];
    }
    s
}

/// The shapes of tensors indexed together along `dim` (one rank), with neighbouring dimensions
/// other than `dim` merged where every tensor has the same size in the later one: the merged
/// dimension's coordinate is then the same row-major number in every tensor, so offsets, lines
/// and the index's bounds read the same (fewer divisions a thread). Returns the new `dim`.
fn collapse(dim: usize, shapes: &[&[usize]]) -> (usize, Vec<Vec<usize>>) {
    let mut out: Vec<Vec<usize>> = shapes.iter().map(|s| vec![s[0]]).collect();
    let mut cdim = 0;
    for d in 1..shapes[0].len() {
        let merge = d != dim && d - 1 != dim && shapes.iter().all(|s| s[d] == shapes[0][d]);
        for (o, s) in out.iter_mut().zip(shapes) {
            if merge {
                *o.last_mut().expect("one dimension at least") *= s[d];
            } else {
                o.push(s[d]);
            }
        }
        if d == dim {
            cdim = out[0].len() - 1;
        }
    }
    (cdim, out)
}

/// A grid of one item a thread over `n` for `kernel`.
fn grid(dev: &Device, kernel: &str, n: u64) -> Result<Option<LaunchConfig>> {
    Ok(launch::elementwise(n, 1, 1, dev.sm_count(), dev.blocks_per_sm_256(kernel)?))
}

/// The flag the kernels set to a bad position plus one.
fn flag(dev: &Device) -> Result<(IndexTensor, *mut u64)> {
    let mut bad = IndexTensor::zeros(dev, &[1])?;
    let p = bad.dev_ptr_mut() as *mut u64;
    Ok((bad, p))
}

/// Reads the flag back (a synchronisation): the error naming a bad position, if one was seen.
fn report(op: &'static str, bad: &IndexTensor, dim: usize, size: usize) -> Result<()> {
    let at = bad.to_vec()?.first().copied().unwrap_or(0);
    if at != 0 {
        return Err(Error::InvalidArgument {
            op,
            message: format!(
                "the index at flat position {} is outside [0, {size}), the size of dimension {dim}",
                at - 1
            ),
        });
    }
    Ok(())
}

/// Checks the indices against `[0, size)` where no kernel reads them (an empty output).
fn check_indices(op: &'static str, dev: &Device, idx: &IndexTensor, dim: usize, size: usize) -> Result<()> {
    let n = idx.numel() as u64;
    let Some(cfg) = grid(dev, index_check.name(), n)? else { return Ok(()) };
    let (bad, bp) = flag(dev)?;
    let args: IndexCheckArgs = (idx.dev_ptr(), bp, n, size as u64);
    // SAFETY: idx holds n indices, bad one u64.
    unsafe { dev.launch(index_check, cfg, args) }?;
    report(op, &bad, dim, size)
}

// --- index_select and index_add ---------------------------------------------------------------

/// Checks `index_select`'s operands; returns `(outer, size, inner)` around `dim`.
fn check_select(op: &'static str, x: &Tensor, dim: usize, idx: &IndexTensor) -> Result<(usize, usize, usize)> {
    check_dim(op, x.shape(), dim)?;
    check_vector(op, idx)?;
    check_idx_device(op, x, idx)?;
    Ok(around(x.shape(), dim))
}

/// Launches `index_select` into `out` (operands checked), then reports a bad index.
fn select(op: &'static str, x: &Tensor, dim: usize, idx: &IndexTensor, out: &mut Tensor) -> Result<()> {
    let (outer, v, inner) = around(x.shape(), dim);
    let dev = x.device().clone();
    let n = idx.numel() as u64;
    let total = (outer as u64).saturating_mul(n).saturating_mul(row_items(x.dtype(), inner as u64));
    if total == 0 {
        return check_indices(op, &dev, idx, dim, v);
    }
    let (bad, bp) = flag(&dev)?;
    with_elem!(x.dtype(), |T| {
        let kernel = <T as IndexElem>::SELECT;
        let Some(cfg) = grid(&dev, kernel.name(), total)? else { return Ok(()) };
        let args: IndexSelectArgs<T> =
            (x.dev_ptr(), idx.dev_ptr(), out.dev_ptr_mut()?, bp, outer as u64, n, v as u64, inner as u64);
        // SAFETY: x holds outer * v * inner elements of T, idx n indices and out outer * n *
        // inner (its shape, checked), whole allocations (16-byte aligned); bad one u64. out's
        // memory is its own (`dev_ptr_mut`), so the launch writes nothing it reads.
        unsafe { dev.launch(kernel, cfg, args) }
    })?;
    report(op, &bad, dim, v)
}

/// The elements of `x` at the indices `idx` along `dim`, as `torch.index_select(x, dim, idx)`:
/// `x`'s shape with dimension `dim` of size `idx.numel()`, bit for bit (a copy). Any rank of at
/// least 1, f32, f16 or bf16; `idx` of rank 0 or 1, any order, repeats allowed. An index outside
/// `[0, x.shape[dim])` is an error (see the module's note; it waits for the device).
pub fn index_select(x: &Tensor, dim: usize, idx: &IndexTensor) -> Result<Tensor> {
    let op = "index_select";
    check_select(op, x, dim, idx)?;
    let mut out = Tensor::alloc(op, x.device(), &with_dim(x.shape(), dim, idx.numel()), x.dtype())?;
    select(op, x, dim, idx, &mut out)?;
    Ok(out)
}

/// [`index_select`] into `out` (the result's shape, `x`'s dtype and device). On an error for a
/// bad index, `out`'s contents are unspecified.
pub fn index_select_out(x: &Tensor, dim: usize, idx: &IndexTensor, out: &mut Tensor) -> Result<()> {
    let op = "index_select_out";
    check_select(op, x, dim, idx)?;
    check_same_device(op, x, out)?;
    check_same_dtype(op, x, out)?;
    shapes_match(
        op,
        &with_dim(x.shape(), dim, idx.numel()),
        out.shape(),
        "out must be x's shape with dim the index's length",
    )?;
    select(op, x, dim, idx, out)
}

/// Checks `index_add`'s index and source against an output of `shape`; returns `(outer, size,
/// inner)` around `dim`.
fn check_add(
    op: &'static str,
    shape: &[usize],
    dim: usize,
    idx: &IndexTensor,
    src: &Tensor,
) -> Result<(usize, usize, usize)> {
    check_dim(op, shape, dim)?;
    check_vector(op, idx)?;
    check_idx_device(op, src, idx)?;
    shapes_match(
        op,
        &with_dim(shape, dim, idx.numel()),
        src.shape(),
        "src must be the output's shape with dim the index's length",
    )?;
    if shape[dim] > MAX_ROWS {
        return Err(Error::InvalidArgument {
            op,
            message: format!("dimension {dim} has {} rows, more than the sort's {MAX_ROWS}", shape[dim]),
        });
    }
    if idx.numel() > MAX_BACKWARD_INDICES {
        return Err(Error::InvalidArgument {
            op,
            message: format!("{} indices, more than the sort's {MAX_BACKWARD_INDICES}", idx.numel()),
        });
    }
    Ok(around(shape, dim))
}

/// Runs `index_add` into `out` (operands checked): `base` is the device address of the tensor
/// added to (`out`'s own for in place), or `None` for zeros. The indices are checked before
/// anything is written.
fn add_rows(
    op: &'static str,
    dim: usize,
    idx: &IndexTensor,
    src: &Tensor,
    base: Option<u64>,
    out: &mut Tensor,
) -> Result<()> {
    let (outer, v, inner) = around(out.shape(), dim);
    let dev = src.device().clone();
    let n = idx.numel() as u64;
    let total = (outer as u64).saturating_mul(v as u64).saturating_mul(row_items(out.dtype(), inner as u64));
    if outer == 0 || inner == 0 {
        return check_indices(op, &dev, idx, dim, v);
    }
    // No index: every row's range is empty (and the keys are never read).
    let (keys, starts) = if n == 0 {
        let z = IndexTensor::zeros(&dev, &[v + 1])?;
        (z.clone(), z)
    } else {
        let (bad, bp) = flag(&dev)?;
        let keys = sort_keys(op, &dev, idx, v as u64, -1, (n, 1), bp)?;
        report(op, &bad, dim, v)?;
        let starts = row_starts(op, &dev, &keys, v as u64, 1)?;
        (keys, starts)
    };
    with_elem!(out.dtype(), |T| {
        let kernel = <T as IndexElem>::ADD;
        let Some(cfg) = grid(&dev, kernel.name(), total)? else { return Ok(()) };
        let dst = base.map_or(std::ptr::null(), |p| p as *const T);
        let args: IndexAddArgs<T> = (
            dst,
            src.dev_ptr(),
            keys.dev_ptr() as *const u64,
            starts.dev_ptr() as *const u64,
            out.dev_ptr_mut()?,
            outer as u64,
            v as u64,
            n,
            inner as u64,
        );
        // SAFETY: out (and dst, if any: a tensor of out's shape, or out itself) hold outer * v *
        // inner elements of T, src outer * n * inner; starts holds v + 1 bounds of sorted keys
        // whose positions are below n; whole allocations. out's memory is its own
        // (`dev_ptr_mut`); where dst is out, each element is read and written by one thread.
        unsafe { dev.launch(kernel, cfg, args) }
    })
}

/// `dst` plus `src`'s slices added at the indices along `dim`, as `dst.index_add(dim, idx,
/// src)`: `out[.., idx[j], ..] += src[.., j, ..]` for each `j`, repeated indices summed. `src`
/// has `dst`'s shape with dimension `dim` of size `idx.numel()`, and its dtype and device; `idx`
/// rank 0 or 1. Deterministic (see the module's note): f32 from `dst`'s value, the `j` in
/// increasing order, rounded once. An index outside `[0, dst.shape[dim])` is an error.
pub fn index_add(dst: &Tensor, dim: usize, idx: &IndexTensor, src: &Tensor) -> Result<Tensor> {
    let op = "index_add";
    check_add(op, dst.shape(), dim, idx, src)?;
    check_same_device(op, dst, src)?;
    check_same_dtype(op, dst, src)?;
    let mut out = dst.alloc_like(op)?;
    add_rows(op, dim, idx, src, Some(dst.dev_ptr_u64()), &mut out)?;
    Ok(out)
}

/// [`index_add`] in place. On an error `dst` is unchanged.
pub fn index_add_(dst: &mut Tensor, dim: usize, idx: &IndexTensor, src: &Tensor) -> Result<()> {
    let op = "index_add_";
    check_add(op, dst.shape(), dim, idx, src)?;
    check_same_device(op, dst, src)?;
    check_same_dtype(op, dst, src)?;
    let p = dst.dev_ptr_mut::<u8>()? as u64;
    add_rows(op, dim, idx, src, Some(p), dst)
}

/// The gradient of [`index_select`]'s input, of shape `grad`'s with dimension `dim` of size
/// `dim_size` (the input's): [`index_add`] of `grad` into zeros, every element written (a row
/// no index names is +0.0). Deterministic; an index outside `[0, dim_size)` is an error.
pub fn index_select_backward(grad: &Tensor, dim: usize, idx: &IndexTensor, dim_size: usize) -> Result<Tensor> {
    let op = "index_select_backward";
    check_dim(op, grad.shape(), dim)?;
    let shape = with_dim(grad.shape(), dim, dim_size);
    check_add(op, &shape, dim, idx, grad)?;
    let mut out = Tensor::alloc(op, grad.device(), &shape, grad.dtype())?;
    add_rows(op, dim, idx, grad, None, &mut out)?;
    Ok(out)
}

// --- gather and scatter_add -------------------------------------------------------------------

/// Checks `gather`'s operands (also `gather_backward`'s, with the input's shape `x`).
fn check_gather(op: &'static str, x: &[usize], dim: usize, idx: &IndexTensor) -> Result<()> {
    check_rank(op, x)?;
    check_dim(op, x, dim)?;
    let i = idx.shape();
    if i.len() != x.len() || i.iter().zip(x).enumerate().any(|(d, (a, b))| d != dim && a > b) {
        return Err(Error::ShapeMismatch {
            op,
            expected: x.to_vec(),
            got: i.to_vec(),
            detail: "the index must have the input's rank and be no larger in every dimension but dim",
        });
    }
    Ok(())
}

/// A gather's geometry (the index's shape of rank `1..=MAX_RANK` against the input's, checked):
/// the index's shape with the input's strides, 0 along `dim`; the input's stride and size along
/// `dim`. Dimensions collapsed where they can be.
fn gather_geom(dim: usize, idx: &[usize], x: &[usize]) -> (StridedGeom, u64, u64) {
    let (cdim, shapes) = collapse(dim, &[idx, x]);
    let (is, xs) = (&shapes[0], &shapes[1]);
    let xst = strides(xs);
    let mut g = StridedGeom { rank: is.len() as u32, pad: 0, shape: [1; MAX_RANK], strides: [0; MAX_RANK] };
    for d in 0..is.len() {
        g.shape[d] = is[d] as u64;
        g.strides[d] = if d == cdim { 0 } else { xst[d] as u64 };
    }
    (g, xst[cdim] as u64, xs[cdim] as u64)
}

/// Launches `gather` into `out` (operands checked), then reports a bad index.
fn gather_into(op: &'static str, x: &Tensor, dim: usize, idx: &IndexTensor, out: &mut Tensor) -> Result<()> {
    let dev = x.device().clone();
    let n = idx.numel() as u64;
    if n == 0 {
        return Ok(());
    }
    let (g, dim_stride, dim_size) = gather_geom(dim, idx.shape(), x.shape());
    let (bad, bp) = flag(&dev)?;
    with_elem!(x.dtype(), |T| {
        let kernel = <T as IndexElem>::GATHER;
        let Some(cfg) = grid(&dev, kernel.name(), n)? else { return Ok(()) };
        let args: GatherArgs<T> = (x.dev_ptr(), idx.dev_ptr(), out.dev_ptr_mut()?, bp, g, dim_stride, dim_size, n);
        // SAFETY: the index is no larger than x in every dimension but dim, so every offset of
        // an index in [0, x.shape[dim]) is inside x; idx and out hold n elements (out's shape,
        // checked); bad one u64. out's memory is its own (`dev_ptr_mut`).
        unsafe { dev.launch(kernel, cfg, args) }
    })?;
    report(op, &bad, dim, x.shape()[dim])
}

/// The elements of `x` picked along `dim` by `idx`, as `torch.gather(x, dim, idx)`:
/// `out[p] = x[p with coordinate dim replaced by idx[p]]`, shape `idx.shape`, bit for bit. `idx`
/// has `x`'s rank (1 to 8) and is no larger than `x` in every dimension but `dim`. An index
/// outside `[0, x.shape[dim])` is an error (see the module's note; it waits for the device).
pub fn gather(x: &Tensor, dim: usize, idx: &IndexTensor) -> Result<Tensor> {
    let op = "gather";
    check_gather(op, x.shape(), dim, idx)?;
    check_idx_device(op, x, idx)?;
    let mut out = Tensor::alloc(op, x.device(), idx.shape(), x.dtype())?;
    gather_into(op, x, dim, idx, &mut out)?;
    Ok(out)
}

/// [`gather`] into `out` (`idx`'s shape, `x`'s dtype and device). On an error for a bad index,
/// `out`'s contents are unspecified.
pub fn gather_out(x: &Tensor, dim: usize, idx: &IndexTensor, out: &mut Tensor) -> Result<()> {
    let op = "gather_out";
    check_gather(op, x.shape(), dim, idx)?;
    check_idx_device(op, x, idx)?;
    check_same_device(op, x, out)?;
    check_same_dtype(op, x, out)?;
    shapes_match(op, idx.shape(), out.shape(), "out must have the index's shape")?;
    gather_into(op, x, dim, idx, out)
}

/// Checks `scatter_add`'s index and source against an output of `shape`.
fn check_scatter(op: &'static str, shape: &[usize], dim: usize, idx: &IndexTensor, src: &Tensor) -> Result<()> {
    check_rank(op, shape)?;
    check_dim(op, shape, dim)?;
    check_idx_device(op, src, idx)?;
    let (i, s) = (idx.shape(), src.shape());
    let fits = i.len() == shape.len()
        && s.len() == shape.len()
        && (0..i.len()).all(|d| i[d] <= s[d] && (d == dim || i[d] <= shape[d]));
    if !fits {
        return Err(Error::ShapeMismatch {
            op,
            expected: shape.to_vec(),
            got: i.to_vec(),
            detail: "the index must have the output's and src's rank, be no larger than src, and no larger than \
                     the output in every dimension but dim",
        });
    }
    let n = idx.numel();
    if n > MAX_BACKWARD_INDICES {
        return Err(Error::InvalidArgument {
            op,
            message: format!("{n} indices, more than the sort's {MAX_BACKWARD_INDICES}"),
        });
    }
    // Each line of the index (its elements that differ only along dim) owns shape[dim] rows.
    let rows = (n.checked_div(i[dim]).unwrap_or(0) as u128) * shape[dim] as u128;
    if rows > MAX_ROWS as u128 {
        return Err(Error::InvalidArgument {
            op,
            message: format!(
                "{rows} rows (the index's lines times dimension {dim}'s size), more than the sort's {MAX_ROWS}"
            ),
        });
    }
    Ok(())
}

/// A scatter's geometry (shapes of rank `1..=MAX_RANK` checked), dimensions collapsed where
/// they can be; the sort's lines are `(k, b)` = `(geom.k, geom.b)`, `n / k` of them of `geom.v`
/// rows each.
fn scatter_geom(dim: usize, out: &[usize], idx: &[usize], src: &[usize]) -> ScatterGeom {
    let (cdim, shapes) = collapse(dim, &[out, idx, src]);
    let (os, is, ss) = (&shapes[0], &shapes[1], &shapes[2]);
    let without: Vec<usize> = is.iter().enumerate().filter(|&(d, _)| d != cdim).map(|(_, &s)| s).collect();
    let (lst, sst) = (strides(&without), strides(ss));
    let mut g = ScatterGeom {
        rank: os.len() as u32,
        dim: cdim as u32,
        shape: [1; MAX_RANK],
        limit: [1; MAX_RANK],
        line_strides: [0; MAX_RANK],
        src_strides: [0; MAX_RANK],
        src_dim_stride: sst[cdim] as u64,
        k: is[cdim] as u64,
        b: is[cdim + 1..].iter().product::<usize>() as u64,
        v: os[cdim] as u64,
    };
    for d in 0..os.len() {
        g.shape[d] = os[d] as u64;
        if d == cdim {
            g.limit[d] = u64::MAX;
        } else {
            g.limit[d] = is[d] as u64;
            g.line_strides[d] = lst[if d < cdim { d } else { d - 1 }] as u64;
            g.src_strides[d] = sst[d] as u64;
        }
    }
    g
}

/// Runs `scatter_add` into `out` (operands checked, at least one index): `base` as in
/// [`add_rows`]. The indices are checked before anything is written.
fn scatter_into(
    op: &'static str,
    dim: usize,
    idx: &IndexTensor,
    src: &Tensor,
    base: Option<u64>,
    out: &mut Tensor,
) -> Result<()> {
    let dev = src.device().clone();
    let n = idx.numel() as u64;
    let g = scatter_geom(dim, out.shape(), idx.shape(), src.shape());
    let (bad, bp) = flag(&dev)?;
    let keys = sort_keys(op, &dev, idx, g.v, -1, (g.k, g.b), bp)?;
    report(op, &bad, dim, g.v as usize)?;
    let starts = row_starts(op, &dev, &keys, n / g.k, g.v)?;
    let total = out.numel() as u64;
    with_elem!(out.dtype(), |T| {
        let kernel = <T as IndexElem>::SCATTER_ADD;
        let Some(cfg) = grid(&dev, kernel.name(), total)? else { return Ok(()) };
        let dst = base.map_or(std::ptr::null(), |p| p as *const T);
        let args: ScatterAddArgs<T> = (
            dst,
            src.dev_ptr(),
            keys.dev_ptr() as *const u64,
            starts.dev_ptr() as *const u64,
            out.dev_ptr_mut()?,
            g,
            total,
        );
        // SAFETY: out (and dst, if any: a tensor of out's shape, or out itself) hold `total`
        // elements of T; the index is no larger than src, so each position's source offset is
        // inside src; starts holds the n / k lines' bounds of the sorted keys. out's memory is
        // its own (`dev_ptr_mut`); where dst is out, each element is read and written by one
        // thread.
        unsafe { dev.launch(kernel, cfg, args) }
    })
}

/// `dst` plus `src`'s elements added where `idx` points along `dim`, as
/// `dst.scatter_add(dim, idx, src)`: `out[p with coordinate dim replaced by idx[p]] += src[p]`
/// for every position `p` of `idx`, repeated targets summed. `idx`, `src` and `dst` have one
/// rank (1 to 8); `idx` is no larger than `src` in every dimension, and no larger than `dst` in
/// every dimension but `dim`; `src` has `dst`'s dtype and device. Deterministic, unlike
/// PyTorch's CUDA `scatter_add_` (see the module's note): f32 from `dst`'s value, the positions
/// `p` in increasing row-major order, rounded once. An index outside `[0, dst.shape[dim])` is an
/// error.
pub fn scatter_add(dst: &Tensor, dim: usize, idx: &IndexTensor, src: &Tensor) -> Result<Tensor> {
    let op = "scatter_add";
    check_scatter(op, dst.shape(), dim, idx, src)?;
    check_same_device(op, dst, src)?;
    check_same_dtype(op, dst, src)?;
    if idx.numel() == 0 {
        return dst.try_clone();
    }
    let mut out = dst.alloc_like(op)?;
    scatter_into(op, dim, idx, src, Some(dst.dev_ptr_u64()), &mut out)?;
    Ok(out)
}

/// [`scatter_add`] in place. On an error `dst` is unchanged.
pub fn scatter_add_(dst: &mut Tensor, dim: usize, idx: &IndexTensor, src: &Tensor) -> Result<()> {
    let op = "scatter_add_";
    check_scatter(op, dst.shape(), dim, idx, src)?;
    check_same_device(op, dst, src)?;
    check_same_dtype(op, dst, src)?;
    if idx.numel() == 0 {
        return Ok(());
    }
    let p = dst.dev_ptr_mut::<u8>()? as u64;
    scatter_into(op, dim, idx, src, Some(p), dst)
}

/// The gradient of [`gather`]'s input, of shape `x_shape`: [`scatter_add`] of `grad` (the
/// index's shape) into zeros, every element written (one no index names is +0.0).
/// Deterministic; an index outside `[0, x_shape[dim])` is an error.
pub fn gather_backward(grad: &Tensor, dim: usize, idx: &IndexTensor, x_shape: &[usize]) -> Result<Tensor> {
    let op = "gather_backward";
    check_gather(op, x_shape, dim, idx)?;
    shapes_match(op, idx.shape(), grad.shape(), "grad must have the index's shape")?;
    check_scatter(op, x_shape, dim, idx, grad)?;
    if idx.numel() == 0 {
        return Tensor::zeros(grad.device(), x_shape, grad.dtype());
    }
    let mut out = Tensor::alloc(op, grad.device(), x_shape, grad.dtype())?;
    scatter_into(op, dim, idx, grad, None, &mut out)?;
    Ok(out)
}

/// The index ops as methods.
impl Tensor {
    /// [`index_select`]: this tensor's elements at `idx` along `dim`.
    pub fn index_select(&self, dim: usize, idx: &IndexTensor) -> Result<Tensor> {
        index_select(self, dim, idx)
    }
    /// [`index_add`]: this tensor plus `src`'s slices at `idx` along `dim`.
    pub fn index_add(&self, dim: usize, idx: &IndexTensor, src: &Tensor) -> Result<Tensor> {
        index_add(self, dim, idx, src)
    }
    /// [`index_add_`]: [`Tensor::index_add`] in place.
    pub fn index_add_(&mut self, dim: usize, idx: &IndexTensor, src: &Tensor) -> Result<()> {
        index_add_(self, dim, idx, src)
    }
    /// [`gather`]: this tensor's elements picked by `idx` along `dim`.
    pub fn gather(&self, dim: usize, idx: &IndexTensor) -> Result<Tensor> {
        gather(self, dim, idx)
    }
    /// [`scatter_add`]: this tensor plus `src` added where `idx` points along `dim`.
    pub fn scatter_add(&self, dim: usize, idx: &IndexTensor, src: &Tensor) -> Result<Tensor> {
        scatter_add(self, dim, idx, src)
    }
    /// [`scatter_add_`]: [`Tensor::scatter_add`] in place.
    pub fn scatter_add_(&mut self, dim: usize, idx: &IndexTensor, src: &Tensor) -> Result<()> {
        scatter_add_(self, dim, idx, src)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn collapse_merges_what_every_tensor_shares() {
        // gather of [4, 5, 6, 7] along 2 with an index [4, 5, 3, 7]: [20, 6 | 3, 7].
        assert_eq!(collapse(2, &[&[4, 5, 3, 7], &[4, 5, 6, 7]]), (1, vec![vec![20, 3, 7], vec![20, 6, 7]]));
        // An index smaller before dim keeps that dimension apart.
        assert_eq!(collapse(2, &[&[4, 2, 3, 7, 2], &[4, 5, 6, 7, 2]]), (2, vec![vec![4, 2, 3, 14], vec![4, 5, 6, 14]]));
        // dim 0, and dimensions of size 1 everywhere merged away.
        assert_eq!(collapse(0, &[&[3, 1, 1, 5], &[9, 1, 1, 5]]), (0, vec![vec![3, 5], vec![9, 5]]));
        assert_eq!(collapse(3, &[&[2, 3, 4, 1], &[2, 3, 4, 8]]), (1, vec![vec![24, 1], vec![24, 8]]));
        assert_eq!(collapse(0, &[&[7], &[0]]), (0, vec![vec![7], vec![0]]));
    }

    /// The collapsed geometry names the same elements as the full one: the flat offsets of
    /// every coordinate agree.
    #[test]
    fn collapsed_offsets_agree() {
        let (dim, is, xs) = (1usize, [3usize, 4, 2, 5], [3usize, 6, 2, 5]);
        let (cdim, c) = collapse(dim, &[&is, &xs]);
        let (ci, cx) = (&c[0], &c[1]);
        let (fst, cst) = (strides(&xs), strides(cx));
        let n: usize = is.iter().product();
        for p in 0..n {
            let unflat = |shape: &[usize]| -> Vec<usize> {
                strides(shape).iter().zip(shape).map(|(&s, &m)| (p / s) % m).collect()
            };
            let (full, col) = (unflat(&is), unflat(ci));
            let j = 3; // any index along dim
            let a: usize = (0..4).map(|d| if d == dim { j * fst[d] } else { full[d] * fst[d] }).sum();
            let b: usize = (0..ci.len()).map(|d| if d == cdim { j * cst[d] } else { col[d] * cst[d] }).sum();
            assert_eq!(a, b, "position {p}");
        }
    }

    /// A small generator for the emulations below.
    struct Rng(u64);
    impl Rng {
        fn below(&mut self, n: usize) -> usize {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            (self.0 % n as u64) as usize
        }
    }

    fn unflat(i: usize, shape: &[usize]) -> Vec<usize> {
        strides(shape).iter().zip(shape).map(|(&st, &n)| (i / st) % n.max(1)).collect()
    }

    fn flat(c: &[usize], shape: &[usize]) -> usize {
        c.iter().zip(strides(shape)).map(|(&x, s)| x * s).sum()
    }

    /// Shapes of one rank (1 to 8) and a dimension: an output (the gather's input), an index no
    /// larger in the other dimensions, a source no smaller than the index.
    fn shapes(rng: &mut Rng) -> (usize, Vec<usize>, Vec<usize>, Vec<usize>) {
        let rank = 1 + rng.below(8);
        let dim = rng.below(rank);
        let out: Vec<usize> = (0..rank).map(|_| 1 + rng.below(4)).collect();
        let idx: Vec<usize> = (0..rank)
            .map(|d| if d == dim { 1 + rng.below(4) } else { out[d] - rng.below(2).min(out[d] - 1) })
            .collect();
        let src = idx.iter().map(|&i| i + rng.below(2)).collect();
        (dim, out, idx, src)
    }

    /// The gather kernel's offsets, run on the CPU over the collapsed geometry, name the element
    /// the definition names.
    #[test]
    fn gather_geometry_finds_the_definitions_element() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        for _ in 0..300 {
            let (dim, x, idx, _) = shapes(&mut rng);
            let (g, dim_stride, dim_size) = gather_geom(dim, &idx, &x);
            assert_eq!(dim_size, x[dim] as u64);
            for p in 0..idx.iter().product::<usize>() {
                let r = rng.below(x[dim]);
                let got =
                    kernels_gpu::broadcast::offset(p as u64, g.rank, &g.shape, &g.strides) + r as u64 * dim_stride;
                let mut c = unflat(p, &idx);
                c[dim] = r;
                assert_eq!(got, flat(&c, &x) as u64, "x {x:?} dim {dim} idx {idx:?} position {p}");
            }
        }
    }

    /// The whole scatter on the CPU as the kernels run it (keys with their lines sorted, the
    /// lines' starts, each output element's search and sum), against the definition: every
    /// output element receives exactly the sources of the index positions that name it, in
    /// increasing position.
    #[test]
    fn scatter_geometry_and_keys_find_the_definitions_sources() {
        use kernels_gpu::embedding::{key, line_of, lower_bound};
        use kernels_gpu::index::{along, scatter_site};
        let mut rng = Rng(0x2545_f491_4f6c_dd1d);
        for _ in 0..300 {
            let (dim, out, idx_shape, src) = shapes(&mut rng);
            let n: usize = idx_shape.iter().product();
            let v = out[dim];
            let idx: Vec<i64> = (0..n).map(|_| rng.below(v) as i64).collect();
            let g = scatter_geom(dim, &out, &idx_shape, &src);
            assert_eq!(g.v, v as u64);
            let mut keys: Vec<u64> =
                (0..n as u64).map(|p| key(idx[p as usize], line_of(p, g.k, g.b) * g.v, p, g.v, -1)).collect();
            keys.sort_unstable();
            let lines = n as u64 / g.k;
            let starts: Vec<u64> =
                (0..=lines).map(|l| lower_bound(keys.len() as u64, (l * g.v) << 32, |o| keys[o as usize])).collect();
            let mut want: Vec<Vec<usize>> = vec![Vec::new(); out.iter().product()];
            for (p, &r) in idx.iter().enumerate() {
                let mut c = unflat(p, &idx_shape);
                let s = flat(&c, &src);
                c[dim] = r as usize;
                want[flat(&c, &out)].push(s);
            }
            for (q, w) in want.iter().enumerate() {
                let (inside, line, sbase, c) = scatter_site(q as u64, &g);
                let mut got = Vec::new();
                if inside {
                    let row = line * g.v + c;
                    let (l0, l1) = (starts[line as usize], starts[line as usize + 1]);
                    let mut p = l0 + lower_bound(l1 - l0, row << 32, |o| keys[(l0 + o) as usize]);
                    while p < l1 && keys[p as usize] >> 32 == row {
                        let j = along(keys[p as usize] & 0xffff_ffff, g.k, g.b);
                        got.push((sbase + j * g.src_dim_stride) as usize);
                        p += 1;
                    }
                } else {
                    assert!(w.is_empty());
                }
                assert_eq!(&got, w, "out {out:?} dim {dim} idx {idx_shape:?} src {src:?} element {q}");
            }
        }
    }

    #[test]
    fn shapes_and_errors() {
        assert_eq!(around(&[2, 3, 4, 5], 2), (6, 4, 5));
        assert_eq!(around(&[7], 0), (1, 7, 1));
        assert_eq!(with_dim(&[2, 3, 4], 1, 9), vec![2, 9, 4]);
        assert_eq!(strides(&[2, 3, 4]), vec![12, 4, 1]);
        assert!(matches!(check_dim("i", &[2, 3], 2), Err(Error::InvalidArgument { .. })));
        assert!(matches!(check_dim("i", &[], 0), Err(Error::InvalidArgument { .. })));
        assert!(check_dim("i", &[2, 3], 1).is_ok());
        assert!(matches!(check_rank("i", &[1; 9]), Err(Error::InvalidArgument { .. })));
        assert!(check_rank("i", &[1; 8]).is_ok());
    }
}
