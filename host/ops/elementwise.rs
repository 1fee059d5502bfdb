//! Element-wise operations (host side of `kernels-gpu/src/elementwise.rs`): unary math and
//! activations, binary ops, ops against a row broadcast along the last dimension, and the fused
//! `act(x * scale + bias)`; each forward and backward, out-of-place, in place and into `out`.

use super::{
    ReduceOp, check_same_device, check_same_dtype, check_same_shape, reduce_leading_dims, row_matches, with_elem,
};
use crate::error::{Error, Result};
use crate::launch;
use crate::tensor::Tensor;
use kernels_gpu::elementwise::{
    BinaryBwdArgs, BinaryFwdArgs, CHUNK_BLOCK, ColsumFinishArgs, ElementwiseElem, RowBwdArgs, RowFwdArgs, UnaryBwdArgs,
    UnaryFwdArgs,
};
use kernels_gpu::kernel::{Kernel, KernelArgs};
use kernels_gpu::ops::{Activation as ActKernel, Binary, OutputGrad, PowForm, Unary};
use kernels_gpu::{DType, Elem};

/// One row of the op table ([`kernels_gpu::unary_table`]) as data: what the Python package
/// exports (`kernels_torch._native.UNARY_OPS`) and what tests, benches and tools iterate over.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct UnaryInfo {
    /// The op's name: its kernels', its `Tensor` method's and its Python function's.
    pub name: &'static str,
    /// Whether it is an [`Activation`] (else a [`UnaryOp`] of its own).
    pub activation: bool,
    /// Its parameters with PyTorch's defaults (activations) or the value the tests and benches
    /// use (the math ops), in order.
    pub params: &'static [(&'static str, f32)],
    /// How its gradient follows from its output: `"y"` a kernel of its own, `"yx"` the backward
    /// from `x` read at `y`, `"y1"` the gradient passes, `"-"` not at all.
    pub from_output: &'static str,
    /// Whether its tests and benches draw positive inputs only (its domain).
    pub positive: bool,
    /// PyTorch's version: a Python callable of `(x, *params)`.
    pub torch: &'static str,
    /// The `torch.nn` module it stands for (`""`: none).
    pub module: &'static str,
    /// One line of documentation.
    pub doc: &'static str,
}

/// The user's parameters as the kernel's two, 0 past the op's own.
fn pad(p: &[f32]) -> [f32; 2] {
    [p.first().copied().unwrap_or(0.0), p.get(1).copied().unwrap_or(0.0)]
}

/// How [`unary_backward_from_output`] computes an op's gradient from its output.
enum FromOutput {
    /// The derivative is 1: the gradient is the incoming one.
    Passes,
    /// A kernel of its own (`<op>_bwd_y_<dtype>`) reading `y`.
    Kernel(OutputGrad),
    /// The backward kernel from `x` gives the same result when it reads `y`: the derivative is a
    /// constant (neg, multiplication and division by a scalar), or depends only on the sign,
    /// which the op keeps (relu; leaky relu with a slope of at least 0).
    SameKernel,
}

/// The `y` column of a table row as a [`FromOutput`], for the op `$Ty` with parameters `$p`.
macro_rules! from_output {
    (y, $Ty:ident, $p:expr) => {
        Some(FromOutput::Kernel(OutputGrad::$Ty))
    };
    (yx, $Ty:ident, $p:expr) => {
        Unary::$Ty.bwd_reads_y($p).then_some(FromOutput::SameKernel)
    };
    (y1, $Ty:ident, $p:expr) => {
        Some(FromOutput::Passes)
    };
    (-, $Ty:ident, $p:expr) => {
        None
    };
}

/// Generates the public enums [`Activation`] and [`UnaryOp`], their kernels and parameters, the
/// `Tensor` methods and [`UNARY_OPS`] from the rows of [`kernels_gpu::unary_table`]. First each
/// row's parameters are normalised (`{}`, `(s = v)` or `{a = v, b = w}` into the variant's
/// fields, its pattern, its names and defaults), and the rows split into activations and math.
macro_rules! unary_api {
    ([] $($rows:tt)*) => { unary_api!(@norm [] [] $($rows)*); };
    (@norm [$($act:tt)*] [$($math:tt)*]) => { unary_api!(@gen [$($act)*] [$($math)*]); };
    (@norm $acts:tt $maths:tt $kind:ident $stem:ident $Ty:ident {} $($rest:tt)*) => {
        unary_api!(@row $acts $maths $kind $stem $Ty [] [] [] [] [] $($rest)*);
    };
    (@norm $acts:tt $maths:tt $kind:ident $stem:ident $Ty:ident ($p:ident = $v:expr) $($rest:tt)*) => {
        unary_api!(@row $acts $maths $kind $stem $Ty [(f32)] [($p)] [($v)] [$p] [$v] $($rest)*);
    };
    (@norm $acts:tt $maths:tt $kind:ident $stem:ident $Ty:ident {$($p:ident = $v:expr),+} $($rest:tt)*) => {
        unary_api!(@row $acts $maths $kind $stem $Ty [{ $(#[doc = concat!("`", stringify!($p), "`, PyTorch's parameter of that name.")] $p: f32),+ }] [{ $($p),+ }] [{ $($p: $v),+ }] [$($p)+] [$($v)+] $($rest)*);
    };
    (@row [$($act:tt)*] $maths:tt act $stem:ident $Ty:ident $decl:tt $pat:tt $ctor:tt $names:tt $defaults:tt
        $y:tt $dom:ident $torch:literal $module:literal $doc:literal; $($rest:tt)*) => {
        unary_api!(@norm [$($act)* { $stem $Ty $decl $pat $ctor $names $defaults $y $dom $torch $module $doc }] $maths $($rest)*);
    };
    (@row $acts:tt [$($math:tt)*] math $stem:ident $Ty:ident $decl:tt $pat:tt $ctor:tt $names:tt $defaults:tt
        $y:tt $dom:ident $torch:literal $module:literal $doc:literal; $($rest:tt)*) => {
        unary_api!(@norm $acts [$($math)* { $stem $Ty $decl $pat $ctor $names $defaults $y $dom $torch $module $doc }] $($rest)*);
    };
    (@gen
        [$({ $astem:ident $ATy:ident [$($adecl:tt)*] [$($apat:tt)*] [$($actor:tt)*] [$($ap:ident)*] [$($av:expr)*]
             $ay:tt $adom:ident $atorch:literal $amodule:literal $adoc:literal })*]
        [$({ $mstem:ident $MTy:ident [$($mdecl:tt)*] [$($mpat:tt)*] [$($mctor:tt)*] [$($mp:ident)*] [$($mv:expr)*]
             $my:tt $mdom:ident $mtorch:literal $mmodule:literal $mdoc:literal })*]
    ) => {
        /// An activation, usable alone ([`unary`]) or fused ([`scale_bias_act`], the linear
        /// layer's epilogue where the GEMM has it). Matches PyTorch's definitions and parameter
        /// names; [`Activation::ALL`] holds each with PyTorch's defaults.
        #[derive(Clone, Copy, Debug, PartialEq)]
        pub enum Activation {
            $( #[doc = $adoc] $ATy $($adecl)*, )*
        }

        /// A unary op: math, arithmetic with a scalar, or an activation.
        #[derive(Clone, Copy, Debug, PartialEq)]
        pub enum UnaryOp {
            $( #[doc = $mdoc] $MTy $($mdecl)*, )*
            /// An activation.
            Act(Activation),
        }

        impl Activation {
            /// Every activation, with PyTorch's default parameters, in the table's order.
            pub const ALL: &'static [Activation] = &[$(Activation::$ATy $($actor)*),*];

            /// The activation's name (its kernels', method's and Python function's).
            pub const fn name(self) -> &'static str {
                match self { $(Activation::$ATy { .. } => stringify!($astem)),* }
            }

            /// The activation called `name` with parameters `p` (in its row's order, extra ones
            /// ignored), or `None` for an unknown name.
            pub fn from_name(name: &str, p: [f32; 2]) -> Option<Activation> {
                match name {
                    $(stringify!($astem) => {
                        #[allow(unused_variables)]
                        let [$($ap,)* ..] = p;
                        Some(Activation::$ATy $($apat)*)
                    })*
                    _ => None,
                }
            }

            /// The user's parameters, in the row's order, 0 past them.
            pub fn params(self) -> [f32; 2] {
                match self { $(Activation::$ATy $($apat)* => pad(&[$($ap),*])),* }
            }

            /// The kernel-side op and its two scalar parameters ([`UnaryFn::params`]).
            ///
            /// [`UnaryFn::params`]: kernels_gpu::ops::UnaryFn::params
            pub fn kernel(self) -> (ActKernel, f32, f32) {
                let k = match self { $(Activation::$ATy { .. } => ActKernel::$ATy),* };
                let [a, b] = self.unary().params(self.params());
                (k, a, b)
            }

            /// The unary kernel of the activation (the same op, under the same name).
            fn unary(self) -> Unary {
                match self { $(Activation::$ATy { .. } => Unary::$ATy),* }
            }

            pub(crate) fn validate(self, op: &'static str) -> Result<()> {
                self.unary().check(self.params()).map_err(|m| Error::InvalidArgument { op, message: m.into() })
            }

            fn output_grad(self) -> Option<FromOutput> {
                match self { $(Activation::$ATy { .. } => from_output!($ay, $ATy, self.params())),* }
            }
        }

        impl UnaryOp {
            /// Every op: each math op with the value its tests and benches use, then every
            /// activation with PyTorch's defaults.
            pub fn all() -> Vec<UnaryOp> {
                let mut v = vec![$(UnaryOp::$MTy $($mctor)*),*];
                v.extend(Activation::ALL.iter().map(|&a| UnaryOp::Act(a)));
                v
            }

            /// The op called `name` (an activation's too) with parameters `p` (in its row's
            /// order, extra ones ignored), or `None` for an unknown name.
            pub fn from_name(name: &str, p: [f32; 2]) -> Option<UnaryOp> {
                match name {
                    $(stringify!($mstem) => {
                        #[allow(unused_variables)]
                        let [$($mp,)* ..] = p;
                        Some(UnaryOp::$MTy $($mpat)*)
                    })*
                    _ => Activation::from_name(name, p).map(UnaryOp::Act),
                }
            }

            /// The op's name (its kernels', method's and Python function's).
            pub const fn name(self) -> &'static str {
                match self {
                    $(UnaryOp::$MTy { .. } => stringify!($mstem),)*
                    UnaryOp::Act(a) => a.name(),
                }
            }

            /// The user's parameters, in the row's order, 0 past them.
            pub fn params(self) -> [f32; 2] {
                match self {
                    $(UnaryOp::$MTy $($mpat)* => pad(&[$($mp),*]),)*
                    UnaryOp::Act(a) => a.params(),
                }
            }

            /// The kernel-side op and its two scalar parameters ([`UnaryFn::params`]: e.g. the
            /// reciprocal of `DivScalar`'s divisor, rounded once here, as PyTorch divides).
            ///
            /// [`UnaryFn::params`]: kernels_gpu::ops::UnaryFn::params
            pub fn kernel(self) -> (Unary, f32, f32) {
                let k = match self {
                    $(UnaryOp::$MTy { .. } => Unary::$MTy,)*
                    UnaryOp::Act(a) => a.unary(),
                };
                let [a, b] = k.params(self.params());
                (k, a, b)
            }

            /// Whether the derivative is 1 everywhere, so that the gradient is the incoming one.
            pub fn passes_gradient(self) -> bool {
                matches!(self.output_grad(), Some(FromOutput::Passes))
            }

            fn validate(self, op: &'static str) -> Result<()> {
                let (k, ..) = self.kernel();
                k.check(self.params()).map_err(|m| Error::InvalidArgument { op, message: m.into() })
            }

            fn output_grad(self) -> Option<FromOutput> {
                match self {
                    $(UnaryOp::$MTy { .. } => from_output!($my, $MTy, self.params()),)*
                    UnaryOp::Act(a) => a.output_grad(),
                }
            }
        }

        /// The op table as data, in its order ([`UnaryInfo`]).
        pub const UNARY_OPS: &[UnaryInfo] = &[
            $(unary_api!(@info $mstem false [$($mp)*] [$($mv)*] $my $mdom $mtorch $mmodule $mdoc),)*
            $(unary_api!(@info $astem true [$($ap)*] [$($av)*] $ay $adom $atorch $amodule $adoc),)*
        ];

        /// Every unary op and activation as a method (`x.gelu()`, `x.leaky_relu(0.01)`,
        /// `x.clamp(min, max)`), each one kernel; parameters as in [`UnaryOp`] and [`Activation`].
        impl Tensor {
            $(
                #[doc = $mdoc]
                pub fn $mstem(&self, $($mp: f32),*) -> Result<Tensor> {
                    unary(self, UnaryOp::$MTy $($mpat)*)
                }
            )*
            $(
                #[doc = $adoc]
                pub fn $astem(&self, $($ap: f32),*) -> Result<Tensor> {
                    unary(self, Activation::$ATy $($apat)*)
                }
            )*
        }
    };
    (@info $stem:ident $act:literal [$($p:ident)*] [$($v:expr)*] $y:tt $dom:ident $torch:literal $module:literal $doc:literal) => {
        UnaryInfo {
            name: stringify!($stem),
            activation: $act,
            params: &[$((stringify!($p), $v)),*],
            from_output: stringify!($y),
            positive: unary_api!(@positive $dom),
            torch: $torch,
            module: $module,
            doc: $doc,
        }
    };
    (@positive positive) => { true };
    (@positive normal) => { false };
}

kernels_gpu::unary_table!(unary_api);

impl From<Activation> for UnaryOp {
    fn from(a: Activation) -> Self {
        UnaryOp::Act(a)
    }
}

impl UnaryOp {
    /// Whether (and how) `op'(x)` can be computed from `y = op(x)`; an error naming the op if not.
    fn grad_from_output(self, name: &'static str) -> Result<FromOutput> {
        self.validate(name)?;
        self.output_grad().ok_or_else(|| {
            let able: Vec<&str> = UNARY_OPS.iter().filter(|o| o.from_output != "-").map(|o| o.name).collect();
            Error::InvalidArgument {
                op: name,
                message: format!(
                    "the derivative of {self:?} is not a function of its output; use unary_backward with the input \
                     (from the output: {}; leaky_relu with a slope >= 0)",
                    able.join(", ")
                ),
            }
        })
    }
}

/// A binary op.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BinaryOp {
    /// `a + b`.
    Add,
    /// `a - b`.
    Sub,
    /// `a * b`.
    Mul,
    /// `a / b`.
    Div,
}

impl BinaryOp {
    /// The kernel-side op.
    pub fn kernel(self) -> Binary {
        match self {
            BinaryOp::Add => Binary::Add,
            BinaryOp::Sub => Binary::Sub,
            BinaryOp::Mul => Binary::Mul,
            BinaryOp::Div => Binary::Div,
        }
    }
}

/// Grid of a row-broadcast kernel over `x` (16-byte vectors); `unrolled` for the forward's loop
/// of whole rows, which is `grid_stride`'s (`row_fwd_grid`), not for the one vector per thread
/// per round of the other loops.
fn grid_1d(x: &Tensor, kernel: &str, unrolled: bool) -> Result<Option<crate::device::LaunchConfig>> {
    let dev = x.device();
    let vec = with_elem!(x.dtype(), |T| T::VEC as u64);
    let unroll = if unrolled { kernels_gpu::elementwise::unroll(x.dtype()) as u64 } else { 1 };
    Ok(launch::elementwise(x.numel() as u64, vec, unroll, dev.sm_count(), dev.blocks_per_sm_256(kernel)?))
}

/// A unary or binary op's two kernels for one launch ([`plan`]): its chunk kernel (`chunked`,
/// `per_thread` vectors a thread) and its small-launch entry (`small`).
struct Entries<A> {
    chunked: Kernel<A>,
    per_thread: u64,
    small: Kernel<A>,
}

/// The kernel and grid of a unary or binary launch over `x` for the call `name`: the op's
/// small-launch entry ([`launch::elementwise_small`]) where one half vector a thread fits in one
/// wave of the chunk kernel's resident blocks, else the chunk kernel on
/// [`launch::elementwise_chunks`]'s grid; `None` for an empty tensor.
fn plan<A: KernelArgs>(
    name: &'static str,
    x: &Tensor,
    e: Entries<A>,
) -> Result<Option<(Kernel<A>, crate::device::LaunchConfig)>> {
    let (dev, n) = (x.device(), x.numel() as u64);
    if n == 0 {
        return Ok(None);
    }
    let vec = with_elem!(x.dtype(), |T| T::VEC as u64);
    let b = CHUNK_BLOCK;
    let resident = dev.sm_count() as u64 * dev.blocks_per_sm(e.chunked.name(), b, 0)? as u64 * b as u64;
    if let Some(cfg) = launch::elementwise_small(n, x.dtype(), resident) {
        return Ok(Some((e.small, cfg)));
    }
    Ok(launch::elementwise_chunks(name, n, vec, e.per_thread)?.map(|cfg| (e.chunked, cfg)))
}

// --- unary --------------------------------------------------------------------------------------

/// The forward's kernels ([`plan`]) of the kernel-side op `k` with parameters `a`, `b`: pow's
/// forms by multiplication or division have small entries of their own ([`PowForm`], chosen here
/// from the exponent), the other ops one each; the chunk kernel's vectors a thread are those of
/// the op's form ([`Unary::chunk`]).
fn unary_fwd_kernels<T: ElementwiseElem>(k: Unary, a: f32, b: f32) -> Entries<UnaryFwdArgs<T>> {
    let ks = k.kernels::<T>();
    let small = match PowForm::of(a) {
        Some(f) if k == Unary::Pow => f.kernels::<T>().fwd_small,
        _ => ks.fwd_small,
    };
    Entries { chunked: ks.fwd, per_thread: k.chunk(k.fwd_form(a, b), T::DTYPE), small }
}

/// [`unary_fwd_kernels`] for the backward: pow's form there is that of `a - 1`.
fn unary_bwd_kernels<T: ElementwiseElem>(k: Unary, a: f32, b: f32) -> Entries<UnaryBwdArgs<T>> {
    let ks = k.kernels::<T>();
    let small = match PowForm::of(a - 1.0) {
        Some(f) if k == Unary::Pow => f.kernels::<T>().bwd_small,
        _ => ks.bwd_small,
    };
    Entries { chunked: ks.bwd, per_thread: k.chunk(k.bwd_form(a, b), T::DTYPE), small }
}

/// `op(x)`, element-wise.
pub fn unary(x: &Tensor, op: impl Into<UnaryOp>) -> Result<Tensor> {
    let mut out = x.alloc_like("unary")?;
    unary_out(x, op, &mut out)?;
    Ok(out)
}

/// `op(x)` into `out` (same shape and dtype).
pub fn unary_out(x: &Tensor, op: impl Into<UnaryOp>, out: &mut Tensor) -> Result<()> {
    let op = op.into();
    let name = "unary_out";
    op.validate(name)?;
    check_same_device(name, x, out)?;
    check_same_dtype(name, x, out)?;
    check_same_shape(name, x, out, "output")?;
    let (k, a, b) = op.kernel();
    let n = x.numel() as u64;
    with_elem!(x.dtype(), |T| {
        let Some((kernel, cfg)) = plan(name, x, unary_fwd_kernels::<T>(k, a, b))? else { return Ok(()) };
        let args: UnaryFwdArgs<T> = (x.dev_ptr(), out.dev_ptr_mut()?, n, a, b);
        // SAFETY: x and out hold n elements of T on this device (checked above).
        unsafe { x.device().launch(kernel, cfg, args) }
    })
}

/// `op(x)` in place.
pub fn unary_(x: &mut Tensor, op: impl Into<UnaryOp>) -> Result<()> {
    let op = op.into();
    op.validate("unary_")?;
    let (k, a, b) = op.kernel();
    let n = x.numel() as u64;
    with_elem!(x.dtype(), |T| {
        let Some((kernel, cfg)) = plan("unary_", x, unary_fwd_kernels::<T>(k, a, b))? else { return Ok(()) };
        let p = x.dev_ptr_mut::<T>()?;
        let args: UnaryFwdArgs<T> = (p as *const T, p, n, a, b);
        // SAFETY: x holds n elements; each is read before it is written, by the same thread.
        unsafe { x.device().launch(kernel, cfg, args) }
    })
}

/// Gradient of `op` at `x`: `op'(x) * grad` (the exact derivative, not an approximation).
///
/// Where the derivative is 1 everywhere (`AddScalar`, `SubScalar`, the identity activation) the
/// gradient is `grad` itself: a clone sharing its memory (copy-on-write, see [`Tensor`]), no
/// kernel, as PyTorch's autograd passes it on.
pub fn unary_backward(x: &Tensor, grad: &Tensor, op: impl Into<UnaryOp>) -> Result<Tensor> {
    let op = op.into();
    if op.passes_gradient() {
        check_unary_backward("unary_backward", x, grad, op)?;
        return Ok(grad.clone());
    }
    let mut gx = x.alloc_like("unary_backward")?;
    unary_backward_out(x, grad, op, &mut gx)?;
    Ok(gx)
}

fn check_unary_backward(name: &'static str, x: &Tensor, grad: &Tensor, op: UnaryOp) -> Result<()> {
    op.validate(name)?;
    check_same_device(name, x, grad)?;
    check_same_dtype(name, x, grad)?;
    check_same_shape(name, x, grad, "grad must have the input's shape")
}

/// [`unary_backward`] into `gx` (the input's shape and dtype). Always a kernel: `gx` is written
/// even where the gradient is `grad` itself.
pub fn unary_backward_out(x: &Tensor, grad: &Tensor, op: impl Into<UnaryOp>, gx: &mut Tensor) -> Result<()> {
    let op = op.into();
    let name = "unary_backward";
    check_unary_backward(name, x, grad, op)?;
    check_binary(name, x, gx)?;
    let (k, a, b) = op.kernel();
    with_elem!(x.dtype(), |T| launch_unary_bwd(name, unary_bwd_kernels::<T>(k, a, b), x, grad, gx, a, b))
}

/// Launches a unary backward kernel (`UnaryBwdArgs`; chunked and small-launch entries, as
/// [`plan`]) for the call `name` on checked operands: `x` (or the output, for the kernels from
/// it), `grad` and `gx` of one shape, dtype and device.
fn launch_unary_bwd<T: Elem>(
    name: &'static str,
    kernels: Entries<UnaryBwdArgs<T>>,
    x: &Tensor,
    grad: &Tensor,
    gx: &mut Tensor,
    a: f32,
    b: f32,
) -> Result<()> {
    let Some((kernel, cfg)) = plan(name, x, kernels)? else { return Ok(()) };
    let n = x.numel() as u64;
    let args: UnaryBwdArgs<T> = (x.dev_ptr(), grad.dev_ptr(), gx.dev_ptr_mut()?, n, a, b);
    // SAFETY: all three hold n elements of T, the tensors' dtype, on this device (the callers
    // check); gx is borrowed mutably, so it aliases neither input.
    unsafe { x.device().launch(kernel, cfg, args) }
}

/// Gradient of `op` from its output `y = op(x)` instead of its input: `op'(x) * grad` written
/// in `y`, as PyTorch's autograd computes the backward of exp (`grad * y`), sqrt, rsqrt,
/// sigmoid (`grad * (1 - y) * y`), tanh (`grad * (1 - y * y)`) and relu. A caller that keeps
/// `y` for the backward need not keep `x`, and for sigmoid and tanh the kernel does a few
/// multiplications where [`unary_backward`] computes the op again.
///
/// The result is the derivative at the `x` that `y` came from, up to `y`'s own rounding: where
/// `y` has lost what the derivative depends on, so has the result (sigmoid at x = 20 is 1 in
/// f32, and its gradient from there 0, not 2e-9 `grad`; the same as PyTorch's).
///
/// Ops whose derivative is not a function of the output (abs, log, clamp, GELU, ...) are an
/// [`Error::InvalidArgument`]. Where the derivative is 1 the gradient is `grad` itself, as in
/// [`unary_backward`].
pub fn unary_backward_from_output(y: &Tensor, grad: &Tensor, op: impl Into<UnaryOp>) -> Result<Tensor> {
    let op = op.into();
    let name = "unary_backward_from_output";
    if let FromOutput::Passes = op.grad_from_output(name)? {
        check_unary_backward(name, y, grad, op)?;
        return Ok(grad.clone());
    }
    let mut gx = y.alloc_like(name)?;
    unary_backward_from_output_out(y, grad, op, &mut gx)?;
    Ok(gx)
}

/// [`unary_backward_from_output`] into `gx` (the output's shape and dtype). Always a kernel.
pub fn unary_backward_from_output_out(
    y: &Tensor,
    grad: &Tensor,
    op: impl Into<UnaryOp>,
    gx: &mut Tensor,
) -> Result<()> {
    let op = op.into();
    let name = "unary_backward_from_output";
    let how = op.grad_from_output(name)?;
    check_unary_backward(name, y, grad, op)?;
    check_binary(name, y, gx)?;
    with_elem!(y.dtype(), |T| {
        let (kernels, a, b) = match how {
            FromOutput::Kernel(k) => {
                let ks = k.kernels::<T>();
                (Entries { chunked: ks.bwd_y, per_thread: 1, small: ks.bwd_y_small }, 0.0, 0.0)
            }
            FromOutput::Passes | FromOutput::SameKernel => {
                let (k, a, b) = op.kernel();
                (unary_bwd_kernels::<T>(k, a, b), a, b)
            }
        };
        launch_unary_bwd(name, kernels, y, grad, gx, a, b)
    })
}

// --- binary -------------------------------------------------------------------------------------

fn check_binary(name: &'static str, a: &Tensor, b: &Tensor) -> Result<()> {
    check_same_device(name, a, b)?;
    check_same_dtype(name, a, b)?;
    check_same_shape(name, a, b, "operands must have one shape")
}

/// The shape `a op b` broadcasts to, after the device and dtype checks.
fn check_broadcast(name: &'static str, a: &Tensor, b: &Tensor) -> Result<Vec<usize>> {
    check_same_device(name, a, b)?;
    check_same_dtype(name, a, b)?;
    super::broadcast_shape(a.shape(), b.shape()).ok_or_else(|| Error::ShapeMismatch {
        op: name,
        expected: a.shape().to_vec(),
        got: b.shape().to_vec(),
        detail: "operands broadcast (aligned at the last dimension, each pair equal or one of them 1)",
    })
}

/// `a op b`, element-wise, broadcast by NumPy's rules: same shapes in one kernel; otherwise the
/// operand that differs from the result's shape is first materialised at it
/// ([`broadcast_to`](super::broadcast_to); for a row along the last dimension,
/// [`binary_row`] does it in one kernel).
pub fn binary(a: &Tensor, b: &Tensor, op: BinaryOp) -> Result<Tensor> {
    let shape = check_broadcast("binary", a, b)?;
    let mut out = Tensor::alloc("binary", a.device(), &shape, a.dtype())?;
    binary_out(a, b, op, &mut out)?;
    Ok(out)
}

/// `a op b` into `out`, of the broadcast shape.
pub fn binary_out(a: &Tensor, b: &Tensor, op: BinaryOp, out: &mut Tensor) -> Result<()> {
    let name = "binary_out";
    let shape = check_broadcast(name, a, b)?;
    check_same_device(name, a, out)?;
    check_same_dtype(name, a, out)?;
    super::check::shapes_match(name, &shape, out.shape(), "out has the operands' broadcast shape")?;
    let (a, b) = (super::broadcast::expanded(a, &shape)?, super::broadcast::expanded(b, &shape)?);
    launch_binary(name, a.dev_ptr_u64(), &b, out.dev_ptr_mut::<u8>()? as u64, op)
}

/// `a = a op b`, `b` broadcast to `a`'s shape.
pub fn binary_(a: &mut Tensor, b: &Tensor, op: BinaryOp) -> Result<()> {
    let name = "binary_";
    let shape = check_broadcast(name, a, b)?;
    super::check::shapes_match(name, a.shape(), &shape, "b broadcasts to a's shape (a is written in place)")?;
    let b = super::broadcast::expanded(b, &shape)?;
    let p = a.dev_ptr_mut::<u8>()? as u64;
    launch_binary(name, p, &b, p, op)
}

fn launch_binary(name: &'static str, a: u64, b: &Tensor, out: u64, op: BinaryOp) -> Result<()> {
    let n = b.numel() as u64;
    with_elem!(b.dtype(), |T| {
        let k = op.kernel().kernels::<T>();
        let e = Entries { chunked: k.fwd, per_thread: 1, small: k.fwd_small };
        let Some((kernel, cfg)) = plan(name, b, e)? else { return Ok(()) };
        let args: BinaryFwdArgs<T> = (a as *const T, b.dev_ptr(), out as *mut T, n);
        // SAFETY: the callers checked that a and out have b's shape, dtype and device.
        unsafe { b.device().launch(kernel, cfg, args) }
    })
}

/// Gradients of `a op b` given the output gradient: `(grad_a, grad_b)`.
///
/// As in PyTorch's autograd, a gradient that equals `grad` is `grad` itself, a clone sharing its
/// memory (copy-on-write, see [`Tensor`]): both of `add`'s and `sub`'s `grad_a`; `sub`'s
/// `grad_b` is one `neg` kernel. `mul` and `div` run one kernel for both.
///
/// Operands of different shapes (broadcast): each gradient is summed down to its operand's shape
/// ([`sum_to`](super::sum_to)) from the gradients at the broadcast shape.
pub fn binary_backward(a: &Tensor, b: &Tensor, grad: &Tensor, op: BinaryOp) -> Result<(Tensor, Tensor)> {
    let name = "binary_backward";
    if a.shape() != b.shape() {
        let shape = check_broadcast(name, a, b)?;
        check_same_device(name, a, grad)?;
        check_same_dtype(name, a, grad)?;
        super::check::shapes_match(name, &shape, grad.shape(), "grad has the operands' broadcast shape")?;
        use super::broadcast::{expanded, reduced};
        let (ga, gb) = match op {
            // Neither operand takes part: no need to materialise them.
            BinaryOp::Add => (grad.clone(), grad.clone()),
            BinaryOp::Sub => (grad.clone(), unary(grad, UnaryOp::Neg)?),
            BinaryOp::Mul | BinaryOp::Div => binary_backward(&expanded(a, &shape)?, &expanded(b, &shape)?, grad, op)?,
        };
        return Ok((reduced(ga, a.shape())?, reduced(gb, b.shape())?));
    }
    check_binary(name, a, b)?;
    check_binary(name, a, grad)?;
    match op {
        BinaryOp::Add => return Ok((grad.clone(), grad.clone())),
        BinaryOp::Sub => return Ok((grad.clone(), unary(grad, UnaryOp::Neg)?)),
        BinaryOp::Mul | BinaryOp::Div => {}
    }
    let (mut ga, mut gb) = (a.alloc_like(name)?, a.alloc_like(name)?);
    let n = a.numel() as u64;
    with_elem!(a.dtype(), |T| {
        let k = op.kernel().kernels::<T>();
        if let Some((kernel, cfg)) = plan(name, a, Entries { chunked: k.bwd, per_thread: 1, small: k.bwd_small })? {
            let args: BinaryBwdArgs<T> =
                (a.dev_ptr(), b.dev_ptr(), grad.dev_ptr(), ga.dev_ptr_mut()?, gb.dev_ptr_mut()?, n);
            // SAFETY: all five hold n elements of T on this device.
            unsafe { a.device().launch(kernel, cfg, args) }?;
        }
        Ok::<(), Error>(())
    })?;
    Ok((ga, gb))
}

// --- against a row broadcast along the last dimension ------------------------------------------

fn check_row(name: &'static str, x: &Tensor, row: &Tensor, what: &'static str) -> Result<()> {
    check_same_device(name, x, row)?;
    check_same_dtype(name, x, row)?;
    row_matches(name, x.shape(), row.shape(), what)
}

/// `x op row`, with `row` (shape `[x.last_dim()]`) broadcast over the other dimensions: e.g.
/// adding a bias.
pub fn binary_row(x: &Tensor, row: &Tensor, op: BinaryOp) -> Result<Tensor> {
    let mut out = x.alloc_like("binary_row")?;
    binary_row_out(x, row, op, &mut out)?;
    Ok(out)
}

/// [`binary_row`] into `out` (`x`'s shape and dtype).
pub fn binary_row_out(x: &Tensor, row: &Tensor, op: BinaryOp, out: &mut Tensor) -> Result<()> {
    let name = "binary_row_out";
    check_row(name, x, row, "the row must match the last dimension")?;
    check_binary(name, x, out)?;
    let p = out.dev_ptr_mut::<u8>()? as u64;
    with_elem!(x.dtype(), |T| {
        launch_row_fwd::<T>(x, x.dev_ptr_u64(), row, None, p, op.kernel().kernels().row_fwd, 0.0, 0.0)
    })
}

/// `x = x op row`, in place.
pub fn binary_row_(x: &mut Tensor, row: &Tensor, op: BinaryOp) -> Result<()> {
    check_row("binary_row_", x, row, "the row must match the last dimension")?;
    let p = x.dev_ptr_mut::<u8>()? as u64;
    with_elem!(x.dtype(), |T| launch_row_fwd::<T>(x, p, row, None, p, op.kernel().kernels().row_fwd, 0.0, 0.0))
}

/// Gradients of `x op row`: `(grad_x, grad_row)`, `grad_row` summed over all rows
/// (deterministically: the same inputs give the same bits). For `add` and `sub`, `grad_x` is
/// `grad` itself (a clone sharing its memory, see [`Tensor`]) and `grad_row` one column sum.
pub fn binary_row_backward(x: &Tensor, row: &Tensor, grad: &Tensor, op: BinaryOp) -> Result<(Tensor, Tensor)> {
    let name = "binary_row_backward";
    check_row(name, x, row, "the row must match the last dimension")?;
    check_binary(name, x, grad)?;
    // add and sub: grad_x is grad itself (shared, as in PyTorch), grad_row its column sums.
    if !x.shape().is_empty() && matches!(op, BinaryOp::Add | BinaryOp::Sub) {
        let mut grow = reduce_leading_dims(grad, ReduceOp::Sum)?;
        if op == BinaryOp::Sub {
            unary_(&mut grow, UnaryOp::Neg)?;
        }
        return Ok((grad.clone(), grow));
    }
    let (gx, mut grads) = with_elem!(x.dtype(), |T| {
        launch_row_bwd::<T>(name, x, row, None, grad, op.kernel().kernels().row_bwd, 1, 0.0, 0.0)
    })?;
    Ok((gx, grads.remove(0)))
}

/// `act(x * scale + bias)` in one pass, with `scale` and `bias` of shape `[x.last_dim()]`
/// broadcast over the rows: what PyTorch runs as three kernels (`mul`, `add`, the activation).
pub fn scale_bias_act(x: &Tensor, scale: &Tensor, bias: &Tensor, act: Activation) -> Result<Tensor> {
    let name = "scale_bias_act";
    let mut out = x.alloc_like(name)?;
    let p = out.dev_ptr_mut::<u8>()? as u64;
    scale_bias_act_impl(name, x, x.dev_ptr_u64(), scale, bias, act, p)?;
    Ok(out)
}

/// [`scale_bias_act`] into `out` (the shape and dtype of `x`).
pub fn scale_bias_act_out(x: &Tensor, scale: &Tensor, bias: &Tensor, act: Activation, out: &mut Tensor) -> Result<()> {
    let name = "scale_bias_act_out";
    check_binary(name, x, out)?;
    let p = out.dev_ptr_mut::<u8>()? as u64;
    scale_bias_act_impl(name, x, x.dev_ptr_u64(), scale, bias, act, p)
}

/// `x = act(x * scale + bias)`, in place.
pub fn scale_bias_act_(x: &mut Tensor, scale: &Tensor, bias: &Tensor, act: Activation) -> Result<()> {
    let p = x.dev_ptr_mut::<u8>()? as u64;
    scale_bias_act_impl("scale_bias_act_", x, p, scale, bias, act, p)
}

fn scale_bias_act_impl(
    name: &'static str,
    x: &Tensor,
    xp: u64,
    scale: &Tensor,
    bias: &Tensor,
    act: Activation,
    out: u64,
) -> Result<()> {
    act.validate(name)?;
    check_row(name, x, scale, "scale must match the last dimension")?;
    check_row(name, x, bias, "bias must match the last dimension")?;
    let (k, a, b) = act.kernel();
    with_elem!(x.dtype(), |T| launch_row_fwd::<T>(x, xp, scale, Some(bias), out, k.kernels().fwd, a, b))
}

/// Gradients of `act(x * scale + bias)`.
pub struct ScaleBiasActGrads {
    /// Of `x`: its shape and dtype.
    pub x: Tensor,
    /// Of `scale`: shape `[last_dim]`, summed over the other dimensions.
    pub scale: Tensor,
    /// Of `bias`: shape `[last_dim]`, summed over the other dimensions.
    pub bias: Tensor,
}

/// Backward of [`scale_bias_act`] in one pass over `x` and `grad` (recomputing the
/// pre-activation), plus a small deterministic reduction for the scale and bias gradients.
pub fn scale_bias_act_backward(
    x: &Tensor,
    scale: &Tensor,
    bias: &Tensor,
    grad: &Tensor,
    act: Activation,
) -> Result<ScaleBiasActGrads> {
    let name = "scale_bias_act_backward";
    let mut g = ScaleBiasActGrads {
        x: x.alloc_like(name)?,
        scale: Tensor::alloc(name, x.device(), scale.shape(), x.dtype())?,
        bias: Tensor::alloc(name, x.device(), bias.shape(), x.dtype())?,
    };
    scale_bias_act_backward_out(x, scale, bias, grad, act, &mut g)?;
    Ok(g)
}

/// [`scale_bias_act_backward`] into `grads` (shaped as `x`, `scale` and `bias`).
pub fn scale_bias_act_backward_out(
    x: &Tensor,
    scale: &Tensor,
    bias: &Tensor,
    grad: &Tensor,
    act: Activation,
    grads: &mut ScaleBiasActGrads,
) -> Result<()> {
    let name = "scale_bias_act_backward";
    act.validate(name)?;
    check_row(name, x, scale, "scale must match the last dimension")?;
    check_row(name, x, bias, "bias must match the last dimension")?;
    check_binary(name, x, grad)?;
    check_binary(name, x, &grads.x)?;
    check_row(name, x, &grads.scale, "the scale's gradient must match the last dimension")?;
    check_row(name, x, &grads.bias, "the bias's gradient must match the last dimension")?;
    let (k, a, b) = act.kernel();
    let ScaleBiasActGrads { x: gx, scale: gs, bias: gb } = grads;
    with_elem!(x.dtype(), |T| {
        launch_row_bwd_into::<T>(name, x, scale, Some(bias), grad, k.kernels().bwd, a, b, gx, &mut [gs, gb])
    })
}

/// The grid of a row-broadcast forward. Where rows are whole vectors, `grid_1d`'s unrolled grid
/// grown to make the grid's stride a whole number of rows, if that costs at most an eighth
/// more blocks: each thread's vectors then share their columns, and the kernel loads their
/// parameters once (`row_fwd`). Otherwise one vector per thread, the parameters loaded with it.
fn row_fwd_grid(x: &Tensor, kernel: &str) -> Result<Option<crate::device::LaunchConfig>> {
    let cols = x.last_dim() as u64;
    let vec = with_elem!(x.dtype(), |T| T::VEC as u64);
    let Some(mut cfg) = grid_1d(x, kernel, true)? else { return Ok(None) };
    if cols > 0 && cols.is_multiple_of(vec) {
        let (q, block) = (cols / vec, cfg.block.0 as u64);
        // The stride, grid * block vectors, is a multiple of q when grid is one of q / gcd.
        let (mut a, mut b) = (q, block);
        while b != 0 {
            (a, b) = (b, a % b);
        }
        let grid = (cfg.grid.0 as u64).next_multiple_of(q / a);
        if grid <= (cfg.grid.0 as u64 * 9 / 8).max(cfg.grid.0 as u64 + 1) && grid <= i32::MAX as u64 {
            cfg.grid.0 = grid as u32;
            return Ok(Some(cfg));
        }
    }
    grid_1d(x, kernel, false)
}

/// Launches a row-broadcast forward `kernel` of `T`, `x`'s dtype.
#[allow(clippy::too_many_arguments)]
fn launch_row_fwd<T: Elem>(
    x: &Tensor,
    xp: u64,
    p0: &Tensor,
    p1: Option<&Tensor>,
    out: u64,
    kernel: Kernel<RowFwdArgs<T>>,
    a: f32,
    b: f32,
) -> Result<()> {
    let Some(cfg) = row_fwd_grid(x, kernel.name())? else { return Ok(()) };
    let (n, cols) = (x.numel() as u64, x.last_dim() as u64);
    let p1 = p1.map_or(0, |t| t.dev_ptr_u64());
    let args: RowFwdArgs<T> = (xp as *const T, p0.dev_ptr(), p1 as *const T, out as *mut T, n, cols, a, b);
    // SAFETY: x and out hold n elements of T, p0 and p1 (if used) `cols`, checked by callers.
    unsafe { x.device().launch(kernel, cfg, args) }
}

/// Runs a row-broadcast backward kernel of `T` (`x`'s dtype) and the finishing column sums.
/// Returns grad_x and the `n_acc` parameter gradients (each of shape `[cols]`).
#[allow(clippy::too_many_arguments)]
fn launch_row_bwd<T: ElementwiseElem>(
    name: &'static str,
    x: &Tensor,
    p0: &Tensor,
    p1: Option<&Tensor>,
    grad: &Tensor,
    kernel: Kernel<RowBwdArgs<T>>,
    n_acc: usize,
    a: f32,
    b: f32,
) -> Result<(Tensor, Vec<Tensor>)> {
    let cols = x.last_dim();
    let mut gx = x.alloc_like(name)?;
    let mut grads = Vec::with_capacity(n_acc);
    for _ in 0..n_acc {
        grads.push(Tensor::alloc(name, x.device(), &[cols], x.dtype())?);
    }
    let mut refs: Vec<&mut Tensor> = grads.iter_mut().collect();
    launch_row_bwd_into(name, x, p0, p1, grad, kernel, a, b, &mut gx, &mut refs)?;
    Ok((gx, grads))
}

/// [`launch_row_bwd`] into `gx` (x's shape) and the parameter gradients `grads` (each of shape
/// `[cols]`, dtype of x; the callers checked all shapes, dtypes and devices).
#[allow(clippy::too_many_arguments)]
fn launch_row_bwd_into<T: ElementwiseElem>(
    name: &'static str,
    x: &Tensor,
    p0: &Tensor,
    p1: Option<&Tensor>,
    grad: &Tensor,
    kernel: Kernel<RowBwdArgs<T>>,
    a: f32,
    b: f32,
    gx: &mut Tensor,
    grads: &mut [&mut Tensor],
) -> Result<()> {
    let dev = x.device();
    let n_acc = grads.len();
    let cols = x.last_dim() as u64;
    let rows = (x.numel() as u64).checked_div(cols).unwrap_or(0);
    let Some((cfg, chunks)) = launch::col_reduce(rows, cols, dev.sm_count(), dev.blocks_per_sm_256(kernel.name())?)
    else {
        // No rows: the parameter gradients are sums of nothing.
        for g in grads.iter_mut() {
            g.fill_(0.0)?;
        }
        return Ok(());
    };
    let mut partial = Tensor::alloc(name, dev, &[n_acc, chunks as usize, cols as usize], DType::F32)?;
    let p1 = p1.map_or(0, |t| t.dev_ptr_u64());
    let args: RowBwdArgs<T> = (
        x.dev_ptr(),
        p0.dev_ptr(),
        p1 as *const T,
        grad.dev_ptr(),
        gx.dev_ptr_mut()?,
        partial.dev_ptr_mut()?,
        rows,
        cols,
        a,
        b,
    );
    // SAFETY: x, grad and gx hold rows * cols elements of T, p0 and p1 (if used) cols, partial
    // n_acc * chunks * cols floats with chunks = grid.y.
    unsafe { dev.launch(kernel, cfg, args) }?;
    let fcfg = launch::one_per_thread(cols).expect("cols > 0");
    for (k, g) in grads.iter_mut().enumerate() {
        let part = partial.dev_ptr_u64() + (k as u64 * chunks as u64 * cols * 4);
        let args: ColsumFinishArgs<T> = (part as *const f32, g.dev_ptr_mut()?, chunks as u64, cols);
        // SAFETY: `part` is the k-th [chunks, cols] block of partial; g holds cols elements.
        unsafe { dev.launch(T::COLSUM_FINISH, fcfg, args) }?;
    }
    // `partial` is freed stream-ordered after the finishing kernels.
    drop(partial);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The public enums, the kernel-side ones and the table's data come from one table: the
    /// same ops in the same order, under the same names, with the table's parameters.
    #[test]
    fn the_op_table_is_one() {
        let ops = UnaryOp::all();
        assert_eq!(ops.len(), Unary::ALL.len());
        assert_eq!(ops.len(), UNARY_OPS.len());
        for ((op, k), info) in ops.iter().zip(Unary::ALL).zip(UNARY_OPS) {
            assert_eq!(op.kernel().0, *k);
            assert_eq!(op.name(), k.stem());
            assert_eq!(info.name, k.stem());
            assert_eq!(info.activation, matches!(op, UnaryOp::Act(_)));
            let p = op.params();
            for (i, &(_, v)) in info.params.iter().enumerate() {
                assert_eq!(p[i], v, "{}", info.name);
            }
            assert_eq!(op.passes_gradient(), info.from_output == "y1", "{}", info.name);
        }
        assert_eq!(Activation::ALL.len(), ActKernel::ALL.len());
        for (a, k) in Activation::ALL.iter().zip(ActKernel::ALL) {
            assert_eq!(a.kernel().0, *k);
            assert_eq!(a.name(), k.stem());
            assert_eq!(Activation::from_name(a.name(), a.params()), Some(*a));
        }
        assert_eq!(Activation::from_name("nope", [0.0; 2]), None);
        let ys: Vec<&str> = UNARY_OPS.iter().filter(|o| o.from_output == "y").map(|o| o.name).collect();
        assert_eq!(ys, OutputGrad::ALL.iter().map(|o| o.stem()).collect::<Vec<_>>());
    }

    /// Each op's handles, in every storage type, are its own kernels: `<stem>_<kind>_<dtype>`.
    #[test]
    fn ops_select_their_own_kernels() {
        fn names<T: ElementwiseElem>() -> Vec<(String, &'static str)> {
            let s = T::DTYPE.suffix();
            let mut v = Vec::new();
            for &o in Unary::ALL {
                let (k, p) = (o.kernels::<T>(), o.stem());
                v.push((format!("{p}_fwd_{s}"), k.fwd.name()));
                v.push((format!("{p}_bwd_{s}"), k.bwd.name()));
                v.push((format!("{p}_fwd_small_{s}"), k.fwd_small.name()));
                v.push((format!("{p}_bwd_small_{s}"), k.bwd_small.name()));
            }
            for &f in PowForm::ALL {
                let (k, p) = (f.kernels::<T>(), f.stem());
                v.push((format!("{p}_fwd_small_{s}"), k.fwd_small.name()));
                v.push((format!("{p}_bwd_small_{s}"), k.bwd_small.name()));
            }
            for &o in OutputGrad::ALL {
                let (k, p) = (o.kernels::<T>(), o.stem());
                v.push((format!("{p}_bwd_y_{s}"), k.bwd_y.name()));
                v.push((format!("{p}_bwd_y_small_{s}"), k.bwd_y_small.name()));
            }
            for &o in Binary::ALL {
                let (k, p) = (o.kernels::<T>(), o.stem());
                v.push((format!("{p}_fwd_{s}"), k.fwd.name()));
                v.push((format!("{p}_bwd_{s}"), k.bwd.name()));
                v.push((format!("{p}_fwd_small_{s}"), k.fwd_small.name()));
                v.push((format!("{p}_bwd_small_{s}"), k.bwd_small.name()));
                v.push((format!("{p}_row_fwd_{s}"), k.row_fwd.name()));
                v.push((format!("{p}_row_bwd_{s}"), k.row_bwd.name()));
            }
            for &a in ActKernel::ALL {
                let (k, p) = (a.kernels::<T>(), a.stem());
                v.push((format!("scale_bias_{p}_fwd_{s}"), k.fwd.name()));
                v.push((format!("scale_bias_{p}_bwd_{s}"), k.bwd.name()));
            }
            v.push((format!("colsum_finish_{s}"), T::COLSUM_FINISH.name()));
            v
        }
        let all = [names::<f32>(), names::<kernels_gpu::F16>(), names::<kernels_gpu::BF16>()].concat();
        for (want, got) in &all {
            assert_eq!(want, got);
        }
        let listed: Vec<&str> = kernels_gpu::elementwise::all_kernels().map(|k| k.name).collect();
        assert_eq!(listed.len(), all.len());
        assert!(all.iter().all(|(_, k)| listed.contains(k)));
    }

    #[test]
    fn derived_parameters_and_checks() {
        assert_eq!(UnaryOp::DivScalar(4.0).kernel(), (Unary::DivScalar, 4.0, 0.25));
        let (k, a, b) = UnaryOp::Act(Activation::Celu { alpha: 2.0 }).kernel();
        assert_eq!((k, a, b), (Unary::Celu, 2.0, 0.5));
        assert!(Activation::Celu { alpha: 0.0 }.validate("t").is_err());
        assert!(Activation::Softplus { beta: 0.0, threshold: 20.0 }.validate("t").is_err());
        assert!(Activation::Softplus { beta: 1.0, threshold: f32::NAN }.validate("t").is_err());
        assert!(Activation::Elu { alpha: -1.0 }.validate("t").is_ok());
        assert!(UnaryOp::Act(Activation::LeakyRelu { negative_slope: -0.5 }).output_grad().is_none());
        assert!(UnaryOp::Act(Activation::LeakyRelu { negative_slope: 0.5 }).output_grad().is_some());
        assert!(UnaryOp::Act(Activation::Gelu).grad_from_output("t").is_err());
    }
}
