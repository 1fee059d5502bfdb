//! Training: the learning-rate schedule, the AdamW state over the flat buffers, and a step in
//! two halves (the gradients enqueued; then read, clipped and applied), so that the host can
//! prepare the next batch between them while the GPU computes.

use crate::data::Micro;
use crate::model::{Grads, Keep, Model, Weights, sum_f32, sum_squares, view};
use kernels::ops::{self, AdamW, UnaryOp};
use kernels::{DType, Device, IndexTensor, Tensor};

/// The optimizer's and the schedule's settings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Hyper {
    pub lr: f64,
    pub min_lr_frac: f64,
    pub warmup: usize,
    pub steps: usize,
    pub weight_decay: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    /// The largest global gradient norm (0: no clipping).
    pub clip: f64,
}

impl Hyper {
    /// The learning rate of step `step` (from 0), llm.c's schedule: linear warm-up from
    /// `lr / warmup` to `lr` over `warmup` steps, then a cosine from `lr` down to `lr *
    /// min_lr_frac` at step `steps`.
    pub fn lr_at(&self, step: usize) -> f64 {
        let min = self.lr * self.min_lr_frac;
        if step < self.warmup {
            return self.lr * (step + 1) as f64 / self.warmup as f64;
        }
        if self.steps <= self.warmup {
            return self.lr;
        }
        let decay = ((step - self.warmup) as f64 / (self.steps - self.warmup) as f64).min(1.0);
        min + 0.5 * (1.0 + (std::f64::consts::PI * decay).cos()) * (self.lr - min)
    }

    /// AdamW at learning rate `lr` with weight decay `wd`.
    fn adamw(&self, lr: f64, wd: f64) -> AdamW {
        AdamW { lr, beta1: self.beta1, beta2: self.beta2, eps: self.eps, weight_decay: wd }
    }
}

/// A micro-batch on the device: the inputs `[B, T]` and the targets in the LM head's chunks.
pub struct DevMicro {
    pub idx: IndexTensor,
    pub targets: Vec<IndexTensor>,
}

/// Copies a micro-batch to the device (each copy waits for the device: done where the host
/// waits anyway, see [`State::apply`]).
pub fn upload(model: &Model, dev: &Device, m: &Micro, (b, t): (usize, usize)) -> kernels::Result<DevMicro> {
    let idx = IndexTensor::from_slice(dev, &m.inputs, &[b, t])?;
    let rows = model.head_chunk_rows(b * t);
    let targets =
        m.targets.chunks(rows).map(|c| IndexTensor::from_slice(dev, c, &[c.len()])).collect::<Result<_, _>>()?;
    Ok(DevMicro { idx, targets })
}

/// The f32 master weights, their bf16 copy the forward reads, AdamW's moments and the steps taken.
pub struct State {
    pub master: Tensor,
    pub bf16: Tensor,
    pub m: Tensor,
    pub v: Tensor,
    pub step: u64,
}

/// A step's gradients and sums, enqueued: what [`State::apply`] reads.
pub struct Pending {
    /// The f32 gradients of the mean loss over the step's tokens.
    pub grads: Tensor,
    loss_sum: Tensor,
    norm_sq: Tensor,
    tokens: usize,
}

/// What a step reports.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepStats {
    /// The mean loss over the step's tokens.
    pub loss: f64,
    /// The gradients' global norm before clipping.
    pub norm: f64,
    pub lr: f64,
}

impl State {
    /// Fresh moments for `master` (f32, laid out as the model's).
    pub fn new(master: Tensor) -> kernels::Result<State> {
        let n = master.numel();
        let zeros = || Tensor::zeros(master.device(), &[n], DType::F32);
        Ok(State { bf16: master.to_dtype(DType::BF16)?, m: zeros()?, v: zeros()?, master, step: 0 })
    }

    /// The bf16 weights as the model reads them.
    pub fn weights<'a>(&'a self, model: &'a Model) -> Weights<'a> {
        Weights { layout: &model.layout, flat: &self.bf16 }
    }

    /// Forward and backward of every micro-batch of a step, the gradients summed in f32 (the
    /// mean loss's: each row enters with `1 / (accum B T)`), then the loss and the squared
    /// gradient norm enqueued. Nothing waits for the device.
    pub fn compute(&self, model: &Model, batch: &[DevMicro], keep: Keep) -> kernels::Result<Pending> {
        let dev = self.master.device();
        let lay = &model.layout;
        let tokens: usize = batch.iter().map(|m| m.idx.numel()).sum();
        let grads = Tensor::zeros(dev, &[lay.total], DType::F32)?;
        let w = self.weights(model);
        let mut losses = Vec::new();
        for m in batch {
            let scratch = Tensor::zeros(dev, &[lay.total - lay.tail_start], DType::BF16)?;
            let g = Grads { layout: lay, flat: &grads, scratch: &scratch };
            losses.extend(model.train_micro(&w, &g, &m.idx, &m.targets, 1.0 / tokens as f32, keep)?);
            g.fold_scratch()?;
        }
        Ok(Pending { loss_sum: sum_f32(&losses)?, norm_sq: sum_squares(&grads)?, grads, tokens })
    }

    /// Reads the step's loss and norm (the one wait for the device a step), clips the gradients
    /// to the global norm `clip` as `torch.nn.utils.clip_grad_norm_` (times `clip / (norm +
    /// 1e-6)` where that is below 1), takes the AdamW step at step `self.step`'s learning rate
    /// (weight decay on the matrices only) and casts the weights to bf16.
    pub fn apply(&mut self, p: Pending, h: &Hyper, model: &Model) -> Result<StepStats, String> {
        let e = |e: kernels::Error| e.to_string();
        let both = Tensor::cat(&[&p.loss_sum.reshape(&[1]).map_err(e)?, &p.norm_sq.reshape(&[1]).map_err(e)?], 0)
            .and_then(|t| t.to_vec::<f32>())
            .map_err(e)?;
        let (loss, norm) = (both[0] as f64 / p.tokens as f64, (both[1] as f64).sqrt());
        let lr = h.lr_at(self.step as usize);
        if !loss.is_finite() || !norm.is_finite() {
            return Err(format!(
                "step {}: the loss is {loss} and the gradient norm {norm}: training diverged",
                self.step
            ));
        }
        let mut grads = p.grads;
        let coef = if h.clip > 0.0 { h.clip / (norm + 1e-6) } else { 1.0 };
        if coef < 1.0 {
            ops::unary_(&mut grads, UnaryOp::MulScalar(coef as f32)).map_err(e)?;
        }
        self.step += 1;
        let lay = &model.layout;
        for (range, wd) in [(0..lay.decay_end, h.weight_decay), (lay.decay_end..lay.total, 0.0)] {
            let n = [range.len()];
            let mut pm = view(&self.master, range.start, &n).map_err(e)?;
            let g = view(&grads, range.start, &n).map_err(e)?;
            let mut m = view(&self.m, range.start, &n).map_err(e)?;
            let mut v = view(&self.v, range.start, &n).map_err(e)?;
            ops::adamw_step(&mut pm, &g, &mut m, &mut v, &h.adamw(lr, wd), self.step).map_err(e)?;
        }
        self.bf16 = self.master.to_dtype(DType::BF16).map_err(e)?;
        Ok(StepStats { loss, norm, lr })
    }
}

/// The dense bf16 peak of a GPU, FLOP/s, from its name (`None` where unknown): the data sheets'
/// figures without sparsity.
pub fn peak_flops(name: &str) -> Option<f64> {
    let n = name.to_ascii_uppercase();
    let tflops = if n.contains("H100") && n.contains("PCIE") {
        756.0
    } else if n.contains("H100") || n.contains("H200") || n.contains("GH200") {
        989.4
    } else if n.contains("A100") {
        312.0
    } else if n.contains("L40S") {
        362.0
    } else if n.contains("4090") {
        165.2
    } else {
        return None;
    };
    Some(tflops * 1e12)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hyper(warmup: usize, steps: usize) -> Hyper {
        Hyper {
            lr: 6e-4,
            min_lr_frac: 0.1,
            warmup,
            steps,
            weight_decay: 0.1,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            clip: 1.0,
        }
    }

    #[test]
    fn warmup_then_cosine_to_the_floor() {
        let h = hyper(10, 110);
        assert!((h.lr_at(0) - 6e-5).abs() < 1e-15);
        assert!((h.lr_at(9) - 6e-4).abs() < 1e-15);
        // Rising during the warm-up, falling after, never below the floor.
        assert!((1..10).all(|s| h.lr_at(s) > h.lr_at(s - 1)));
        assert!((11..200).all(|s| h.lr_at(s) <= h.lr_at(s - 1)));
        assert!((h.lr_at(10) - 6e-4).abs() < 1e-15);
        assert!((h.lr_at(60) - (6e-5 + 0.5 * 5.4e-4)).abs() < 1e-15); // half-way: the mean
        assert!((h.lr_at(110) - 6e-5).abs() < 1e-15);
        assert_eq!(h.lr_at(500), h.lr_at(110));
        // Without decay steps, or without warm-up.
        assert_eq!(hyper(10, 5).lr_at(7), 6e-4 * 8.0 / 10.0);
        assert_eq!(hyper(10, 5).lr_at(20), 6e-4);
        assert!((hyper(0, 100).lr_at(0) - 6e-4).abs() < 1e-15);
    }

    #[test]
    fn peaks_by_name() {
        assert_eq!(peak_flops("NVIDIA H100 80GB HBM3"), Some(989.4e12));
        assert_eq!(peak_flops("NVIDIA H200"), Some(989.4e12));
        assert_eq!(peak_flops("NVIDIA H100 PCIe"), Some(756e12));
        assert_eq!(peak_flops("NVIDIA A100-SXM4-80GB"), Some(312e12));
        assert_eq!(peak_flops("Quadro"), None);
    }
}
