//! Optimizer steps (host side of `kernels-gpu/src/optim.rs`): AdamW as one fused kernel.
//!
//! [`adamw_step`] updates a parameter tensor and its two moment tensors in place from a gradient,
//! with `torch.optim.AdamW`'s semantics (non-amsgrad, `maximize=False`); [`AdamWState`] owns the
//! moments and the step counter of one parameter tensor. Parameters and gradients are f32, f16 or
//! bf16; the moments are always f32 (PyTorch keeps them in the parameters' dtype: the device
//! file says why f32 is the better choice for f16/bf16 training).

use super::check::{check_same_device, check_same_dtype, check_same_shape, with_elem};
use crate::error::{Error, Result};
use crate::launch;
use crate::tensor::Tensor;
use kernels_gpu::optim::{AdamWArgs, AdamWElem, AdamWScalars, unroll};
use kernels_gpu::{DType, Elem};

/// AdamW's hyper-parameters, as `torch.optim.AdamW(lr, betas=(beta1, beta2), eps,
/// weight_decay)`. [`Default`] is PyTorch's: `lr = 1e-3`, betas `(0.9, 0.999)`, `eps = 1e-8`,
/// `weight_decay = 1e-2`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamW {
    /// The learning rate.
    pub lr: f64,
    /// The first moment's decay.
    pub beta1: f64,
    /// The second moment's decay.
    pub beta2: f64,
    /// Added to the second moment's square root.
    pub eps: f64,
    /// Decoupled weight decay: each step multiplies the parameter by `1 - lr * weight_decay`.
    pub weight_decay: f64,
}

impl Default for AdamW {
    fn default() -> Self {
        AdamW { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 1e-2 }
    }
}

impl AdamW {
    /// Checks the hyper-parameters: `lr` and `weight_decay` finite and `>= 0`, both betas in
    /// `[0, 1)`, `eps` finite and `> 0` (PyTorch also accepts `eps = 0`, which divides by zero
    /// wherever a gradient has been zero since the first step).
    pub fn validate(&self, op: &'static str) -> Result<()> {
        let bad = |message: String| Err(Error::InvalidArgument { op, message });
        let AdamW { lr, beta1, beta2, eps, weight_decay } = *self;
        if !(lr.is_finite() && lr >= 0.0) {
            return bad(format!("lr must be finite and >= 0, got {lr}"));
        }
        for (name, b) in [("beta1", beta1), ("beta2", beta2)] {
            if !(0.0..1.0).contains(&b) {
                return bad(format!("{name} must be in [0, 1), got {b}"));
            }
        }
        if !(eps.is_finite() && eps > 0.0) {
            return bad(format!("eps must be finite and > 0, got {eps}"));
        }
        if !(weight_decay.is_finite() && weight_decay >= 0.0) {
            return bad(format!("weight_decay must be finite and >= 0, got {weight_decay}"));
        }
        Ok(())
    }

    /// The f32 constants the kernel gets for step `step` (1-based), folded in f64 and rounded
    /// once each (see [`AdamWScalars`]). An error for an invalid configuration, step 0, or
    /// constants that do not fit in f32 (a learning rate near f32's range).
    pub fn scalars(&self, step: u64) -> Result<AdamWScalars> {
        let op = "adamw_step";
        self.validate(op)?;
        if step == 0 {
            return Err(Error::InvalidArgument { op, message: "step counts from 1 (as PyTorch's), got 0".into() });
        }
        // `powf` with the exact step: `powi` takes an i32, and steps beyond 2^31 are possible.
        let bc1 = 1.0 - self.beta1.powf(step as f64);
        let bc2_sqrt = (1.0 - self.beta2.powf(step as f64)).sqrt();
        let s = AdamWScalars {
            lr_wd: (self.lr * self.weight_decay) as f32,
            beta1: self.beta1 as f32,
            one_minus_beta1: (1.0 - self.beta1) as f32,
            beta2: self.beta2 as f32,
            one_minus_beta2: (1.0 - self.beta2) as f32,
            step_size: (self.lr * bc2_sqrt / bc1) as f32,
            eps: (self.eps * bc2_sqrt) as f32,
        };
        let all = [s.lr_wd, s.beta1, s.one_minus_beta1, s.beta2, s.one_minus_beta2, s.step_size, s.eps];
        if all.iter().any(|x| !x.is_finite()) || s.eps == 0.0 {
            return Err(Error::InvalidArgument {
                op,
                message: format!("{self:?} at step {step} gives constants outside f32's range: {s:?}"),
            });
        }
        Ok(s)
    }
}

/// Checks that `t` is an f32 moment tensor of `param`'s shape on its device.
fn check_moment(op: &'static str, param: &Tensor, t: &Tensor, what: &'static str) -> Result<()> {
    check_same_device(op, param, t)?;
    if t.dtype() != DType::F32 {
        return Err(Error::InvalidArgument {
            op,
            message: format!(
                "{what} must be f32 (moments are kept in f32 whatever the parameters' dtype), got {:?}",
                t.dtype()
            ),
        });
    }
    check_same_shape(op, param, t, what)
}

/// One AdamW step, in place: `param`, and its moments `m` (first, `exp_avg`) and `v` (second,
/// `exp_avg_sq`), from `grad`, at step `step` (1 for the first step; it sets the bias
/// corrections). `param` and `grad` share one dtype and shape; `m` and `v` are f32 of that
/// shape (zeros before the first step). One kernel: each element of the four tensors is read
/// once and `param`, `m`, `v` written once.
pub fn adamw_step(
    param: &mut Tensor,
    grad: &Tensor,
    m: &mut Tensor,
    v: &mut Tensor,
    cfg: &AdamW,
    step: u64,
) -> Result<()> {
    let op = "adamw_step";
    let s = cfg.scalars(step)?;
    check_same_device(op, param, grad)?;
    check_same_dtype(op, param, grad)?;
    check_same_shape(op, param, grad, "the gradient must have the parameter's shape")?;
    check_moment(op, param, m, "m (the first moment) must have the parameter's shape")?;
    check_moment(op, param, v, "v (the second moment) must have the parameter's shape")?;
    // A handle of its own: `param` is borrowed mutably for the launch.
    let (dev, dt, n) = (param.device().clone(), param.dtype(), param.numel() as u64);
    let kernel = with_elem!(dt, |T| T::ADAMW.name());
    let vec = with_elem!(dt, |T| T::VEC as u64);
    let Some(cfg) = launch::elementwise(n, vec, unroll(dt) as u64, dev.sm_count(), dev.blocks_per_sm_256(kernel)?)
    else {
        return Ok(());
    };
    with_elem!(dt, |T| {
        let args: AdamWArgs<T> = (
            param.dev_ptr_mut()?,
            grad.dev_ptr(),
            m.dev_ptr_mut()?,
            v.dev_ptr_mut()?,
            n,
            s.lr_wd,
            s.beta1,
            s.one_minus_beta1,
            s.beta2,
            s.one_minus_beta2,
            s.step_size,
            s.eps,
        );
        // SAFETY: param and grad hold n elements of T, m and v n floats, all on this device
        // (checked above); the four are distinct allocations (`&mut` borrows of param, m and v
        // exclude aliasing), which the kernel's `.nc` loads of grad rely on.
        unsafe { dev.launch(T::ADAMW, cfg, args) }
    })
}

/// The AdamW state of one parameter tensor: its moments (f32 zeros at first) and the number of
/// steps taken.
///
/// ```no_run
/// # use kernels::{Device, DType, Tensor, ops::{AdamW, AdamWState}};
/// # fn main() -> kernels::Result<()> {
/// # let dev = Device::cuda(0)?;
/// let mut w = Tensor::rand_normal(&dev, &[1024, 1024], DType::BF16, 0.0, 0.02, 1)?;
/// let mut state = AdamWState::new(&w)?;
/// let cfg = AdamW { lr: 3e-4, ..AdamW::default() };
/// # let grad = Tensor::zeros(&dev, &[1024, 1024], DType::BF16)?;
/// state.update(&mut w, &grad, &cfg)?; // step 1
/// # Ok(()) }
/// ```
pub struct AdamWState {
    m: Tensor,
    v: Tensor,
    step: u64,
}

impl AdamWState {
    /// Zero moments for `param` (f32, its shape, on its device), no step taken yet.
    pub fn new(param: &Tensor) -> Result<AdamWState> {
        let zeros = || Tensor::zeros(param.device(), param.shape(), DType::F32);
        Ok(AdamWState { m: zeros()?, v: zeros()?, step: 0 })
    }

    /// Takes the next step: [`adamw_step`] at step `self.step() + 1`. On an error nothing
    /// changes, the step counter included.
    pub fn update(&mut self, param: &mut Tensor, grad: &Tensor, cfg: &AdamW) -> Result<()> {
        adamw_step(param, grad, &mut self.m, &mut self.v, cfg, self.step + 1)?;
        self.step += 1;
        Ok(())
    }

    /// Steps taken so far.
    pub fn step(&self) -> u64 {
        self.step
    }
    /// The first moment (`exp_avg`), f32.
    pub fn m(&self) -> &Tensor {
        &self.m
    }
    /// The second moment (`exp_avg_sq`), f32.
    pub fn v(&self) -> &Tensor {
        &self.v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn invalid(cfg: AdamW, step: u64, needle: &str) {
        match cfg.scalars(step) {
            Err(Error::InvalidArgument { op, message }) => {
                assert_eq!(op, "adamw_step");
                assert!(message.contains(needle), "{message:?} does not mention {needle:?}");
            }
            other => panic!("{cfg:?} at step {step}: {other:?}, want InvalidArgument"),
        }
    }

    #[test]
    fn configurations_are_validated() {
        let d = AdamW::default();
        assert!(d.scalars(1).is_ok());
        assert!(AdamW { lr: 0.0, weight_decay: 0.0, beta1: 0.0, beta2: 0.0, ..d }.scalars(1).is_ok());
        for lr in [f64::NAN, f64::INFINITY, -1e-3] {
            invalid(AdamW { lr, ..d }, 1, "lr");
        }
        for b in [1.0, -0.1, f64::NAN, 1.5] {
            invalid(AdamW { beta1: b, ..d }, 1, "beta1");
            invalid(AdamW { beta2: b, ..d }, 1, "beta2");
        }
        for eps in [0.0, -1e-8, f64::NAN, f64::INFINITY] {
            invalid(AdamW { eps, ..d }, 1, "eps");
        }
        for wd in [-0.01, f64::NAN, f64::INFINITY] {
            invalid(AdamW { weight_decay: wd, ..d }, 1, "weight_decay");
        }
        invalid(d, 0, "step");
        // Constants beyond f32: a learning rate of 1e300, an eps that rounds to 0.
        invalid(AdamW { lr: 1e300, ..d }, 1, "f32");
        invalid(AdamW { eps: 1e-60, ..d }, 1, "f32");
    }

    #[test]
    fn scalars_fold_the_bias_corrections() {
        let d = AdamW::default();
        let s = d.scalars(1).unwrap();
        // Step 1: bc1 = 1 - b1 = 0.1, bc2_sqrt = sqrt(0.001).
        let bc2s = 0.001f64.sqrt();
        assert_eq!(s.step_size, (1e-3 * bc2s / 0.1) as f32);
        assert_eq!(s.eps, (1e-8 * bc2s) as f32);
        assert_eq!(s.lr_wd, 1e-5f32);
        assert_eq!((s.beta1, s.one_minus_beta1), (0.9f32, 0.1f32));
        // 1 - b2 from f64: 0.001 to f32 precision, not 1 - f32(0.999) (off by 1.3e-5 relative).
        assert_eq!((s.beta2, s.one_minus_beta2), (0.999f32, 0.001f32));
        assert!(((1.0 - 0.999f32) as f64 / 0.001 - 1.0).abs() > 1e-5);
        // Late steps: the corrections vanish; steps beyond 2^31 work.
        let s = d.scalars(1 << 40).unwrap();
        assert_eq!((s.step_size, s.eps), (1e-3, 1e-8));
        // beta = 0: no averaging (m = g, v = g^2) and no bias correction.
        let s = AdamW { beta1: 0.0, beta2: 0.0, ..d }.scalars(7).unwrap();
        assert_eq!((s.beta1, s.one_minus_beta1, s.beta2, s.one_minus_beta2), (0.0, 1.0, 0.0, 1.0));
        assert_eq!((s.step_size, s.eps), (1e-3, 1e-8));
    }

    #[test]
    fn kernels_are_listed_for_every_dtype() {
        let k: Vec<_> = kernels_gpu::optim::all_kernels().collect();
        assert_eq!(k.len(), 3);
        assert!(k.iter().all(|k| k.name.starts_with("adamw_step_") && k.arity == 12));
    }
}
