//! Kernel signatures, declared once for both sides.
//!
//! Every kernel family names its parameter list as a tuple type, e.g.
//! `pub type UnaryArgs<T> = (*const T, *mut T, u64, f32, f32);`. On the device,
//! [`kernel!`](macro@crate::kernel) derives the `extern "ptx-kernel"` parameter list from that
//! tuple (position by position), so a kernel cannot take anything else. On the host, a launch
//! takes a value of the same tuple type ([`KernelArgs`]), so the host cannot pass anything else
//! either: changing the alias breaks whichever side was not updated, at compile time.
//!
//! Pointer parameters on the host are device addresses cast to `*const T` / `*mut T`; they are
//! never dereferenced there.
//!
//! The host names a kernel by a [`Kernel<A>`] handle, its name typed by its parameter tuple `A`,
//! which `kernel!` gives the host for every kernel it declares: a launch takes the handle and a
//! value of `A`, so passing a kernel arguments of another signature does not compile.

/// The element-wise projection of a parameter tuple: `P0` is the first parameter's type, etc.
pub trait Params {
    /// Number of parameters.
    const ARITY: usize;
    /// The type of parameter 0 ([`Unused`] past the arity, as for each `P<i>`).
    type P0;
    /// The type of parameter 1.
    type P1;
    /// The type of parameter 2.
    type P2;
    /// The type of parameter 3.
    type P3;
    /// The type of parameter 4.
    type P4;
    /// The type of parameter 5.
    type P5;
    /// The type of parameter 6.
    type P6;
    /// The type of parameter 7.
    type P7;
    /// The type of parameter 8.
    type P8;
    /// The type of parameter 9.
    type P9;
    /// The type of parameter 10.
    type P10;
    /// The type of parameter 11.
    type P11;
    /// The type of parameter 12.
    type P12;
    /// The type of parameter 13.
    type P13;
    /// The type of parameter 14.
    type P14;
    /// The type of parameter 15.
    type P15;
}

/// A parameter tuple the host can hand to `cuLaunchKernel`.
///
/// # Safety
/// `param_ptrs` must return one pointer per tuple field, in order, each pointing at that field.
pub unsafe trait KernelArgs: Params {
    /// Pointers to each field, as `cuLaunchKernel`'s `kernelParams` wants them. The pointers are
    /// valid while `self` is borrowed.
    fn param_ptrs(&self) -> [*mut core::ffi::c_void; MAX_PARAMS];
}

/// Parameter types: all plain `Copy` values whose layout matches the PTX `.param` of the same
/// size (pointers, `u64` and `i64` are 8 bytes, `u32`/`i32`/`f32` are 4 bytes).
pub trait Param: Copy {}
impl<T> Param for *const T {}
impl<T> Param for *mut T {}
impl Param for u64 {}
impl Param for u32 {}
impl Param for i32 {}
impl Param for i64 {}
impl Param for f32 {}

/// A kernel of the PTX: its entry name, typed by its parameter tuple `A`. Declared for the host
/// by [`kernel!`](macro@crate::kernel) beside the device function, or gathered in a family's
/// table of instances (e.g. [`crate::rows::RowKernels`]).
///
/// A launch takes the handle and a value of its tuple:
/// ```
/// use kernels_gpu::kernel::{Kernel, KernelArgs};
/// use kernels_gpu::softmax::{SOFTMAX_F32, SoftmaxFwdArgs};
/// fn launch<A: KernelArgs>(_: Kernel<A>, _: A) {}
/// let fwd = SOFTMAX_F32.softmax.fwd.reg(1).unwrap();
/// let args: SoftmaxFwdArgs<f32> = (core::ptr::null(), core::ptr::null_mut(), 1, 1);
/// launch(fwd, args);
/// ```
/// and one with the arguments of another signature does not compile:
/// ```compile_fail,E0308
/// use kernels_gpu::kernel::{Kernel, KernelArgs};
/// use kernels_gpu::softmax::{SOFTMAX_F32, SoftmaxBwdArgs};
/// fn launch<A: KernelArgs>(_: Kernel<A>, _: A) {}
/// let fwd = SOFTMAX_F32.softmax.fwd.reg(1).unwrap();
/// let args: SoftmaxBwdArgs<f32> = (core::ptr::null(), core::ptr::null(), core::ptr::null_mut(), 1, 1);
/// launch(fwd, args);
/// ```
pub struct Kernel<A> {
    name: &'static str,
    args: core::marker::PhantomData<fn(A)>,
}

impl<A> Clone for Kernel<A> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<A> Copy for Kernel<A> {}

impl<A> core::fmt::Debug for Kernel<A> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "Kernel({})", self.name)
    }
}

impl<A> PartialEq for Kernel<A> {
    fn eq(&self, other: &Self) -> bool {
        self.name == other.name
    }
}
impl<A> Eq for Kernel<A> {}

impl<A: Params> Kernel<A> {
    /// The handle of the entry `name`, whose parameters the caller asserts are `A`. The
    /// declarations (`kernel!`, the family tables) use it; the test of the PTX against the host's
    /// kernels checks the arity of every handle they list.
    pub const fn by_name(name: &'static str) -> Self {
        Kernel { name, args: core::marker::PhantomData }
    }
    /// The entry's name in the PTX.
    pub const fn name(&self) -> &'static str {
        self.name
    }
    /// Its number of parameters.
    pub const fn arity(&self) -> usize {
        A::ARITY
    }
    /// The name and arity, for lists of every kernel.
    pub const fn entry(&self) -> KernelEntry {
        KernelEntry { name: self.name, arity: A::ARITY }
    }
}

/// A kernel's name and number of parameters, untyped: what a family lists of its kernels, for the
/// test against the PTX's entries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelEntry {
    /// The entry's name.
    pub name: &'static str,
    /// Its number of parameters.
    pub arity: usize,
}

/// The most parameters a kernel takes.
pub const MAX_PARAMS: usize = 16;

/// Stands in for the unused positions of [`Params`].
pub enum Unused {}

macro_rules! impl_params {
    ($n:expr; $($T:ident $i:tt),*; $($U:ident),*) => {
        impl<$($T: Param),*> Params for ($($T,)*) {
            const ARITY: usize = $n;
            impl_params!(@assoc [$($T)*] [$($U)*] [P0 P1 P2 P3 P4 P5 P6 P7 P8 P9 P10 P11 P12 P13 P14 P15]);
        }
        unsafe impl<$($T: Param),*> KernelArgs for ($($T,)*) {
            #[allow(unused_mut)]
            fn param_ptrs(&self) -> [*mut core::ffi::c_void; MAX_PARAMS] {
                let mut p = [core::ptr::null_mut(); MAX_PARAMS];
                $( p[$i] = (&self.$i) as *const $T as *mut core::ffi::c_void; )*
                p
            }
        }
    };
    (@assoc [$T:ident $($Tr:ident)*] [$($U:ident)*] [$P:ident $($Pr:ident)*]) => {
        type $P = $T;
        impl_params!(@assoc [$($Tr)*] [$($U)*] [$($Pr)*]);
    };
    (@assoc [] [$($U:ident)*] [$P:ident $($Pr:ident)*]) => {
        type $P = Unused;
        impl_params!(@assoc [] [$($U)*] [$($Pr)*]);
    };
    (@assoc [] [$($U:ident)*] []) => {};
}

impl_params!(1; A 0; );
impl_params!(2; A 0, B 1; );
impl_params!(3; A 0, B 1, C 2; );
impl_params!(4; A 0, B 1, C 2, D 3; );
impl_params!(5; A 0, B 1, C 2, D 3, E 4; );
impl_params!(6; A 0, B 1, C 2, D 3, E 4, F 5; );
impl_params!(7; A 0, B 1, C 2, D 3, E 4, F 5, G 6; );
impl_params!(8; A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7; );
impl_params!(9; A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7, I 8; );
impl_params!(10; A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7, I 8, J 9; );
impl_params!(11; A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7, I 8, J 9, K 10; );
impl_params!(12; A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7, I 8, J 9, K 10, L 11; );
impl_params!(13; A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7, I 8, J 9, K 10, L 11, M 12; );
impl_params!(14; A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7, I 8, J 9, K 10, L 11, M 12, N 13; );
impl_params!(15; A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7, I 8, J 9, K 10, L 11, M 12, N 13, O 14; );
impl_params!(16; A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7, I 8, J 9, K 10, L 11, M 12, N 13, O 14, P 15; );

/// Defines a kernel whose parameter list is the tuple type `$args`.
///
/// ```ignore
/// kernel!(relu_fwd_f32: UnaryArgs<f32> = |x, y, n, a, b| unary_fwd::<f32, Relu>(x, y, n, a, b));
/// ```
/// On nvptx64 this is `#[no_mangle] pub unsafe extern "ptx-kernel" fn relu_fwd_f32(x: P0, ...)`;
/// on the host, `pub const relu_fwd_f32: Kernel<UnaryArgs<f32>>`, the kernel's typed handle.
/// Naming fewer or more parameters than the tuple has is a compile error.
#[macro_export]
macro_rules! kernel {
    ($name:ident : $args:ty = |$($p:ident),* $(,)?| $body:expr) => {
        $crate::kernel!(@zip $name; $args; $body; [];
            [$($p)*]; [P0 P1 P2 P3 P4 P5 P6 P7 P8 P9 P10 P11 P12 P13 P14 P15]);
        const _: () = assert!(
            <$args as $crate::kernel::Params>::ARITY == [$(stringify!($p)),*].len(),
            concat!("kernel `", stringify!($name), "` names a different number of parameters than its signature")
        );
    };
    (@zip $name:ident; $args:ty; $body:expr; [$($done:tt)*];
        [$p:ident $($pr:ident)*]; [$P:ident $($Pr:ident)*]) => {
        $crate::kernel!(@zip $name; $args; $body;
            [$($done)* $p: <$args as $crate::kernel::Params>::$P,]; [$($pr)*]; [$($Pr)*]);
    };
    (@zip $name:ident; $args:ty; $body:expr; [$($done:tt)*]; []; [$($Pr:ident)*]) => {
        #[cfg(not(target_arch = "nvptx64"))]
        #[doc = concat!("The kernel `", stringify!($name), "`.")]
        #[allow(non_upper_case_globals)]
        pub const $name: $crate::kernel::Kernel<$args> = $crate::kernel::Kernel::by_name(stringify!($name));
        #[cfg(target_arch = "nvptx64")]
        #[unsafe(no_mangle)]
        pub unsafe extern "ptx-kernel" fn $name($($done)*) {
            // SAFETY: the host launches this kernel only through `launch` with a value of
            // `$args`, whose pointers it has checked against the tensors' lengths.
            #[allow(unused_unsafe)]
            unsafe { $body }
        }
    };
}
