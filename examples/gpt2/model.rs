//! GPT-2 on the library's ops, forward and backward written out by hand (no autograd), as
//! llm.c's `train_gpt2.cu`: learned positions, pre-norm LayerNorm, GELU (tanh form) MLP,
//! causal attention, the LM head tied to the token embedding.
//!
//! Parameters live in one flat f32 buffer (the master weights), in the order of [`Layout`];
//! each step casts it to one bf16 buffer that the forward and backward read through views
//! (tensors over parts of another's memory, [`view`]). Gradients accumulate in one flat f32
//! buffer of the same layout: the GEMMs that make the weight gradients write f32 there directly
//! (`beta = 1` adds each micro-batch's product); the ops whose gradients come out in bf16 (the
//! biases' column sums, the norms' parameters, the embeddings) write a bf16 scratch of the tail
//! of the layout, which is widened and added once per micro-batch. One AdamW kernel then updates
//! the matrices (with weight decay) and one the rest.
//!
//! What the library lacked and is composed here: split q, k, v (three GEMMs into one buffer, so
//! the attention reads them in place), the QKV projection's input gradient (three GEMMs summing
//! into one bf16 output with `beta = 1`, two roundings more than one GEMM over `3C` would make),
//! the positional embedding (a row broadcast over `[B, T*C]`) and its gradient (a column sum),
//! the loss's f32 sum (the per-row bf16 losses widened and summed), the squared gradient norm
//! (squares and sums in chunks).

use kernels::ops::{
    self, Activation, AttentionOpts, BinaryOp, Causal, CrossEntropyOnePassOpts, CrossEntropyOpts, Epilogue, Gemm,
    Layout as AttnLayout, NormGrads, NormStats, ReduceOp, Reduction, UnaryOp,
};
use kernels::{DType, Device, Error, IndexTensor, Tensor};
use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};

/// The library's result.
pub type Res<T> = kernels::Result<T>;

/// LayerNorm's epsilon (PyTorch's default, GPT-2's).
pub const LN_EPS: f32 = 1e-5;
/// Parameters start on multiples of this many elements: 16-byte aligned views in bf16 and f32.
const ALIGN: usize = 8;
/// The most bytes of bf16 logits the LM head holds at once: rows are taken in chunks below it.
const LOGIT_CHUNK_BYTES: usize = 256 << 20;
/// The squared gradient norm is summed over chunks of this many elements (one f32 temporary).
const NORM_CHUNK: usize = 1 << 24;

/// The model's shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Config {
    /// Transformer blocks.
    pub layers: usize,
    /// Attention heads.
    pub heads: usize,
    /// Channels.
    pub width: usize,
    /// Learned positions: the longest sequence.
    pub context: usize,
    /// Vocabulary (rows of the token embedding), a multiple of 128.
    pub vocab: usize,
}

impl Config {
    /// Channels a head.
    pub fn head_dim(&self) -> usize {
        self.width / self.heads
    }

    /// Checks what the kernels need: a head dim that is a multiple of 8 up to 256 (the
    /// attention), a width that is a multiple of 8 (16-byte aligned rows), a vocabulary of
    /// whole GEMM tiles' worth of columns.
    pub fn validate(&self) -> Result<(), String> {
        let Config { layers, heads, width, context, vocab } = *self;
        if layers == 0 || heads == 0 || width == 0 || context == 0 {
            return Err(format!("layers, heads, width and context must be positive: {self:?}"));
        }
        if !width.is_multiple_of(heads) {
            return Err(format!("the width ({width}) must be a multiple of the heads ({heads})"));
        }
        let d = self.head_dim();
        if !d.is_multiple_of(8) || d > 256 {
            return Err(format!("the head dim width / heads = {d} must be a multiple of 8 up to 256"));
        }
        if vocab == 0 || !vocab.is_multiple_of(128) {
            return Err(format!("the vocabulary ({vocab}) must be a positive multiple of 128"));
        }
        Ok(())
    }

    /// Parameters that multiply activations in a GEMM: per block `3C^2 + C^2 + 4C^2 + 4C^2`, and
    /// the LM head's `V C`. Biases, norms and the positional table are not counted.
    pub fn gemm_params(&self) -> usize {
        12 * self.layers * self.width * self.width + self.vocab * self.width
    }

    /// FLOPs of one token's forward and backward at sequence length `seq`, counted as PaLM's
    /// appendix B (and llm.c) do: `6` a GEMM parameter (2 forward, 4 backward) and `12 L T C`
    /// for the attention's two products with the whole `T x T` score matrix, although the
    /// causal kernels skip the masked half.
    pub fn flops_per_token(&self, seq: usize) -> f64 {
        6.0 * self.gemm_params() as f64 + 12.0 * (self.layers * seq * self.width) as f64
    }
}

/// How a parameter starts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    /// Normal with mean 0 and this standard deviation.
    Normal(f32),
    /// All zeros (biases).
    Zeros,
    /// All ones (the norms' weights).
    Ones,
}

/// One parameter tensor in the flat buffers.
#[derive(Clone, Debug, PartialEq)]
pub struct Param {
    /// nanoGPT's `state_dict` name.
    pub name: String,
    pub shape: Vec<usize>,
    /// Its first element in the flat buffers.
    pub offset: usize,
    pub init: Init,
}

impl Param {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// A block's parameters, as indices into [`Layout::params`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockIds {
    pub ln1_w: usize,
    pub ln1_b: usize,
    pub qkv_w: usize,
    pub qkv_b: usize,
    pub proj_w: usize,
    pub proj_b: usize,
    pub ln2_w: usize,
    pub ln2_b: usize,
    pub fc_w: usize,
    pub fc_b: usize,
    pub fcp_w: usize,
    pub fcp_b: usize,
}

/// Where each parameter lies in the flat buffers: the blocks' matrices first (their gradients
/// come straight from f32 GEMMs), then the embeddings (also decayed), then every vector (no
/// weight decay). `[tail_start, total)` is what the bf16 scratch covers.
#[derive(Clone, Debug, PartialEq)]
pub struct Layout {
    pub params: Vec<Param>,
    pub blocks: Vec<BlockIds>,
    pub wte: usize,
    pub wpe: usize,
    pub lnf_w: usize,
    pub lnf_b: usize,
    /// The first element of the embeddings: the scratch's start.
    pub tail_start: usize,
    /// The first element without weight decay.
    pub decay_end: usize,
    /// Elements in all (the aligned end).
    pub total: usize,
}

impl Layout {
    pub fn new(cfg: &Config) -> Layout {
        let (c, nl) = (cfg.width, cfg.layers);
        // GPT-2's initialization, as nanoGPT's: the projections into the residual stream scaled
        // by 1 / sqrt(2 L) (two of them a block).
        let (std, resid) = (Init::Normal(0.02), Init::Normal(0.02 / (2.0 * nl as f32).sqrt()));
        let mut params = Vec::new();
        let mut off = 0;
        let mut add = |name: String, shape: Vec<usize>, init: Init| {
            let n: usize = shape.iter().product();
            params.push(Param { name, shape, offset: off, init });
            off = (off + n).next_multiple_of(ALIGN);
            params.len() - 1
        };
        let h = |l: usize, s: &str| format!("transformer.h.{l}.{s}");
        let mats: Vec<[usize; 4]> = (0..nl)
            .map(|l| {
                [
                    add(h(l, "attn.c_attn.weight"), vec![3 * c, c], std),
                    add(h(l, "attn.c_proj.weight"), vec![c, c], resid),
                    add(h(l, "mlp.c_fc.weight"), vec![4 * c, c], std),
                    add(h(l, "mlp.c_proj.weight"), vec![c, 4 * c], resid),
                ]
            })
            .collect();
        let wte = add("transformer.wte.weight".into(), vec![cfg.vocab, c], std);
        let wpe = add("transformer.wpe.weight".into(), vec![cfg.context, c], std);
        let blocks: Vec<BlockIds> = mats
            .iter()
            .enumerate()
            .map(|(l, &[qkv_w, proj_w, fc_w, fcp_w])| BlockIds {
                ln1_w: add(h(l, "ln_1.weight"), vec![c], Init::Ones),
                ln1_b: add(h(l, "ln_1.bias"), vec![c], Init::Zeros),
                qkv_w,
                qkv_b: add(h(l, "attn.c_attn.bias"), vec![3 * c], Init::Zeros),
                proj_w,
                proj_b: add(h(l, "attn.c_proj.bias"), vec![c], Init::Zeros),
                ln2_w: add(h(l, "ln_2.weight"), vec![c], Init::Ones),
                ln2_b: add(h(l, "ln_2.bias"), vec![c], Init::Zeros),
                fc_w,
                fc_b: add(h(l, "mlp.c_fc.bias"), vec![4 * c], Init::Zeros),
                fcp_w,
                fcp_b: add(h(l, "mlp.c_proj.bias"), vec![c], Init::Zeros),
            })
            .collect();
        let lnf_w = add("transformer.ln_f.weight".into(), vec![c], Init::Ones);
        let lnf_b = add("transformer.ln_f.bias".into(), vec![c], Init::Zeros);
        let tail_start = params[wte].offset;
        let decay_end = params[blocks.first().map_or(lnf_w, |b| b.ln1_w)].offset;
        Layout { params, blocks, wte, wpe, lnf_w, lnf_b, tail_start, decay_end, total: off }
    }

    /// Parameters, the padding between them not counted.
    pub fn count(&self) -> usize {
        self.params.iter().map(Param::numel).sum()
    }
}

/// A tensor over part of another's memory (see [`view`]); it cannot outlive that tensor.
pub struct View<'a> {
    t: Tensor,
    _of: PhantomData<&'a Tensor>,
}

impl Deref for View<'_> {
    type Target = Tensor;
    fn deref(&self) -> &Tensor {
        &self.t
    }
}

impl DerefMut for View<'_> {
    fn deref_mut(&mut self) -> &mut Tensor {
        &mut self.t
    }
}

impl View<'_> {
    /// The tensor itself, for an op's output struct; the caller keeps the owner alive while it is used.
    fn into_tensor(self) -> Tensor {
        self.t
    }
}

/// The `shape` elements of `t` from element `offset`, as a tensor over the same memory: writes
/// through it change `t`. The offset must keep 16-byte alignment (the layouts here do).
pub fn view<'a>(t: &'a Tensor, offset: usize, shape: &[usize]) -> Res<View<'a>> {
    let n: usize = shape.iter().product();
    if offset + n > t.numel() {
        return Err(Error::InvalidArgument {
            op: "gpt2::view",
            message: format!("{shape:?} from element {offset} of a tensor of {} elements", t.numel()),
        });
    }
    let at = t.device_ptr() + (offset * t.dtype().size()) as u64;
    // SAFETY: the range lies inside `t`'s memory on `t`'s device, which the borrow `'a` keeps
    // alive for as long as the view; work issued through it is ordered on the device's one
    // stream before any reuse of that memory. No tensor written through views here is shared
    // with a clone, and the views one op writes are disjoint parts (of one layout, or of rows).
    let t = unsafe { Tensor::from_device_ptr(t.device(), at, shape, t.dtype())? };
    Ok(View { t, _of: PhantomData })
}

/// The parameters a forward reads: the flat bf16 buffer, through `layout`.
pub struct Weights<'a> {
    pub layout: &'a Layout,
    pub flat: &'a Tensor,
}

impl<'a> Weights<'a> {
    /// Parameter `id`, in its shape.
    fn p(&self, id: usize) -> Res<View<'a>> {
        let p = &self.layout.params[id];
        view(self.flat, p.offset, &p.shape)
    }
    /// `len` elements of parameter `id` from element `at` of it.
    fn part(&self, id: usize, at: usize, shape: &[usize]) -> Res<View<'a>> {
        view(self.flat, self.layout.params[id].offset + at, shape)
    }
}

/// Where a backward writes: the f32 gradients (the GEMMs' weight gradients, accumulated) and the
/// bf16 scratch of the layout's tail (overwritten each micro-batch).
pub struct Grads<'a> {
    pub layout: &'a Layout,
    pub flat: &'a Tensor,
    pub scratch: &'a Tensor,
}

impl<'a> Grads<'a> {
    /// Parameter `id`'s f32 gradient.
    fn f32(&self, id: usize) -> Res<View<'a>> {
        let p = &self.layout.params[id];
        view(self.flat, p.offset, &p.shape)
    }
    /// `shape` elements of parameter `id`'s scratch (bf16) from element `at` of it; the
    /// parameter must lie in the tail.
    fn scratch_of(&self, id: usize, at: usize, shape: &[usize]) -> Res<View<'a>> {
        view(self.scratch, self.layout.params[id].offset - self.layout.tail_start + at, shape)
    }
    /// Adds the scratch, widened, to the tail of the f32 gradients.
    pub fn fold_scratch(&self) -> Res<()> {
        let wide = self.scratch.to_dtype(DType::F32)?;
        let mut tail = view(self.flat, self.layout.tail_start, &[self.layout.total - self.layout.tail_start])?;
        ops::binary_(&mut tail, &wide, BinaryOp::Add)
    }
}

/// What a training forward keeps of the GELU: its output, or only its input (recomputed in the
/// backward, one element-wise pass, `B T 4C` bf16 less memory a block).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Keep {
    Nothing,
    All,
    Recompute,
}

/// What a block's backward needs from its forward.
pub struct BlockActs {
    /// The block's input (the residual stream).
    x: Tensor,
    a1: Tensor,
    s1: NormStats,
    /// q, k and v, `[3, B*T, C]` (each `[B, T, H, D]`).
    qkv: Tensor,
    /// The attention's output `[B*T, C]` and log-sum-exp.
    y: Tensor,
    lse: Tensor,
    /// The residual stream after the attention.
    xm: Tensor,
    a2: Tensor,
    s2: NormStats,
    /// The MLP's pre-activation `[B*T, 4C]` and, unless recomputed, its GELU.
    z: Tensor,
    h: Option<Tensor>,
}

/// A key/value cache for sampling one sequence: per block, `[1, capacity, H, D]` keys and values.
pub struct KvCache {
    k: Vec<Tensor>,
    v: Vec<Tensor>,
    /// Positions filled.
    pub len: usize,
}

/// The model: its shape and where its parameters lie.
pub struct Model {
    pub cfg: Config,
    pub layout: Layout,
    dev: Device,
}

/// `x @ w^T (+ bias) (+ residual)`, `x` `[rows, in]`, `w` `[out, in]`: one GEMM, the bias and the
/// residual added in its store.
fn linear(x: &Tensor, w: &Tensor, bias: &Tensor, residual: Option<&Tensor>) -> Res<Tensor> {
    let mut y = Tensor::empty(x.device(), &[x.shape()[0], w.shape()[0]], x.dtype())?;
    let epi = Epilogue { bias: Some(bias), residual, ..Epilogue::default() };
    ops::gemm_fused(x, w, &mut y, Gemm::new(false, true), epi)?;
    Ok(y)
}

/// `C += A^T B` in f32: a weight gradient's accumulation.
const ACCUMULATE_AT_B: Gemm = Gemm { trans_a: true, trans_b: false, alpha: 1.0, beta: 1.0, precision: None };

/// The LM head's cross-entropy: a loss per row (bf16), and the logits' gradient of
/// `grad_scale` times their sum.
fn ce_opts(grad_scale: f32) -> CrossEntropyOnePassOpts {
    CrossEntropyOnePassOpts {
        ce: CrossEntropyOpts { reduction: Reduction::None, ..CrossEntropyOpts::default() },
        z_loss: 0.0,
        grad_scale,
    }
}

impl Model {
    pub fn new(dev: &Device, cfg: Config) -> Model {
        Model { cfg, layout: Layout::new(&cfg), dev: dev.clone() }
    }

    /// Rows of the LM head's chunks for `rows` rows: the targets must be uploaded in these.
    pub fn head_chunk_rows(&self, rows: usize) -> usize {
        let r = (LOGIT_CHUNK_BYTES / (2 * self.cfg.vocab)).max(8) / 8 * 8;
        r.min(rows)
    }

    /// The f32 master weights as GPT-2 starts them, from `seed` (Philox on the device: the same
    /// seed gives the same weights on any GPU).
    pub fn init(&self, seed: u64) -> Res<Tensor> {
        let flat = Tensor::zeros(&self.dev, &[self.layout.total], DType::F32)?;
        for (i, p) in self.layout.params.iter().enumerate() {
            let mut dst = view(&flat, p.offset, &[p.numel()])?;
            match p.init {
                Init::Normal(std) => {
                    let s = seed ^ (i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                    let r = Tensor::rand_normal(&self.dev, &[p.numel()], DType::F32, 0.0, std, s)?;
                    ops::unary_out(&r, Activation::Identity, &mut dst)?;
                }
                Init::Ones => dst.fill_(1.0)?,
                Init::Zeros => {}
            }
        }
        Ok(flat)
    }

    /// Each parameter of `flat` (f32 masters or a gradient) as a view, with its name.
    pub fn named<'a>(&self, flat: &'a Tensor) -> Res<Vec<(&str, View<'a>)>> {
        self.layout.params.iter().map(|p| Ok((p.name.as_str(), view(flat, p.offset, &p.shape)?))).collect()
    }

    /// Copies the named tensors (f32, f16 or bf16) into the f32 masters `flat`: every parameter
    /// must be there, in its shape.
    pub fn load_named(&self, flat: &Tensor, tensors: &[(String, Tensor)]) -> Result<(), String> {
        for p in &self.layout.params {
            let Some((_, t)) = tensors.iter().find(|(n, _)| *n == p.name) else {
                return Err(format!("the checkpoint has no {}", p.name));
            };
            if t.shape() != p.shape.as_slice() {
                return Err(format!("{} is {:?} in the checkpoint, {:?} in the model", p.name, t.shape(), p.shape));
            }
            let wide = t.to_dtype(DType::F32).map_err(|e| e.to_string())?;
            let mut dst = view(flat, p.offset, &p.shape).map_err(|e| e.to_string())?;
            ops::unary_out(&wide, Activation::Identity, &mut dst).map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    /// Token and position embeddings of `idx` (`[B, T]`, positions from `t0`): `[B*T, C]`.
    fn embed(&self, w: &Weights, idx: &IndexTensor, t0: usize) -> Res<Tensor> {
        let (b, t, c) = (idx.shape()[0], idx.shape()[1], self.cfg.width);
        let mut x = ops::embedding(&*w.p(self.layout.wte)?, idx, None)?.reshape(&[b, t * c])?;
        // The positions' rows, one row of T*C broadcast over the batch.
        ops::binary_row_(&mut x, &*w.part(self.layout.wpe, t0 * c, &[t * c])?, BinaryOp::Add)?;
        x.reshape(&[b * t, c])
    }

    /// One block on `x` (`[B*T, C]`: `b` sequences of `t` tokens). With `cache` (this block's
    /// keys and values, and the position of x's first token; `b = 1`), k and v are written into
    /// the cache and the attention reads every position up to the last, causal from the bottom
    /// right. Returns the block's output, and what its backward needs unless `keep` is nothing.
    fn block(
        &self,
        w: &Weights,
        l: usize,
        x: &Tensor,
        (b, t): (usize, usize),
        cache: Option<(&Tensor, &Tensor, usize)>,
        keep: Keep,
    ) -> Res<(Tensor, Option<BlockActs>)> {
        let ids = self.layout.blocks[l];
        let (c, nh, d, bt) = (self.cfg.width, self.cfg.heads, self.cfg.head_dim(), b * t);
        let (a1, s1) = ops::layer_norm(x, Some(&*w.p(ids.ln1_w)?), Some(&*w.p(ids.ln1_b)?), LN_EPS)?;
        // q, k, v: three GEMMs with the bias in the store, each into its own part of one buffer,
        // so that each is a contiguous `[B, T, H, D]` the attention reads in place.
        let project = |i: usize, out: &mut Tensor| -> Res<()> {
            let wi = w.part(ids.qkv_w, i * c * c, &[c, c])?;
            let bi = w.part(ids.qkv_b, i * c, &[c])?;
            ops::gemm_ex(&a1, &wi, out, Gemm::new(false, true), Some(&bi), Activation::Identity)
        };
        let qkv = Tensor::empty(&self.dev, &[if cache.is_some() { 1 } else { 3 }, bt, c], DType::BF16)?;
        project(0, &mut *view(&qkv, 0, &[bt, c])?)?;
        let (y, lse) = match cache {
            None => {
                project(1, &mut *view(&qkv, bt * c, &[bt, c])?)?;
                project(2, &mut *view(&qkv, 2 * bt * c, &[bt, c])?)?;
                let part = |i: usize| view(&qkv, i * bt * c, &[b, t, nh, d]);
                let opts = AttentionOpts { causal: Causal::TopLeft, layout: AttnLayout::Bshd, ..Default::default() };
                ops::attention(&*part(0)?, &*part(1)?, &*part(2)?, &opts)?
            }
            Some((kc, vc, t0)) => {
                project(1, &mut *view(kc, t0 * c, &[bt, c])?)?;
                project(2, &mut *view(vc, t0 * c, &[bt, c])?)?;
                let all = [1, t0 + t, nh, d];
                let opts =
                    AttentionOpts { causal: Causal::BottomRight, layout: AttnLayout::Bshd, ..Default::default() };
                ops::attention(&*view(&qkv, 0, &[1, t, nh, d])?, &*view(kc, 0, &all)?, &*view(vc, 0, &all)?, &opts)?
            }
        };
        let y = y.reshape(&[bt, c])?;
        // The attention's projection, its bias and the residual in one GEMM.
        let xm = linear(&y, &*w.p(ids.proj_w)?, &*w.p(ids.proj_b)?, Some(x))?;
        let (a2, s2) = ops::layer_norm(&xm, Some(&*w.p(ids.ln2_w)?), Some(&*w.p(ids.ln2_b)?), LN_EPS)?;
        let z = linear(&a2, &*w.p(ids.fc_w)?, &*w.p(ids.fc_b)?, None)?;
        let h = ops::unary(&z, Activation::GeluTanh)?;
        let out = linear(&h, &*w.p(ids.fcp_w)?, &*w.p(ids.fcp_b)?, Some(&xm))?;
        let acts = match keep {
            Keep::Nothing => None,
            Keep::All | Keep::Recompute => Some(BlockActs {
                x: x.clone(),
                a1,
                s1,
                qkv,
                y,
                lse,
                xm,
                a2,
                s2,
                z,
                h: (keep == Keep::All).then_some(h),
            }),
        };
        Ok((out, acts))
    }

    /// The final norm of `x` (`[rows, C]`) and the LM head's logits `[rows, V]` (bf16).
    fn logits_of(&self, w: &Weights, x: &Tensor) -> Res<Tensor> {
        let (af, _) = ops::layer_norm(x, Some(&*w.p(self.layout.lnf_w)?), Some(&*w.p(self.layout.lnf_b)?), LN_EPS)?;
        let mut lg = Tensor::empty(&self.dev, &[x.shape()[0], self.cfg.vocab], DType::BF16)?;
        ops::gemm(&af, &*w.p(self.layout.wte)?, &mut lg, Gemm::new(false, true))?;
        Ok(lg)
    }

    /// LayerNorm's backward into the scratch (weight and bias); returns the input's gradient.
    fn norm_backward(
        &self,
        (w, g): (&Weights, &Grads),
        (wid, bid): (usize, usize),
        x: &Tensor,
        stats: &NormStats,
        dy: &Tensor,
    ) -> Res<Tensor> {
        let c = self.cfg.width;
        let mut out = NormGrads {
            x: Tensor::empty(&self.dev, x.shape(), DType::BF16)?,
            weight: Some(g.scratch_of(wid, 0, &[c])?.into_tensor()),
            bias: Some(g.scratch_of(bid, 0, &[c])?.into_tensor()),
        };
        ops::layer_norm_backward_out(x, Some(&*w.p(wid)?), stats, dy, &mut out)?;
        Ok(out.x)
    }

    /// The backward of `y = x @ W^T + b` given `dy`: `dW += dy^T x` (f32), `db` (the column sums,
    /// bf16) into the scratch; returns `dx = dy W`.
    fn linear_backward(
        &self,
        (w, g): (&Weights, &Grads),
        (wid, bid): (usize, usize),
        x: &Tensor,
        dy: &Tensor,
    ) -> Res<Tensor> {
        let wt = w.p(wid)?;
        let mut dx = Tensor::empty(&self.dev, &[dy.shape()[0], wt.shape()[1]], DType::BF16)?;
        ops::gemm(dy, &wt, &mut dx, Gemm::default())?;
        ops::gemm(dy, x, &mut *g.f32(wid)?, ACCUMULATE_AT_B)?;
        let n = self.layout.params[bid].numel();
        ops::reduce_leading_dims_out(dy, ReduceOp::Sum, &mut *g.scratch_of(bid, 0, &[n])?)?;
        Ok(dx)
    }

    /// One block's backward from `dout` (the gradient of its output); returns its input's.
    fn block_backward(
        &self,
        wg: (&Weights, &Grads),
        l: usize,
        a: BlockActs,
        dout: &Tensor,
        (b, t): (usize, usize),
    ) -> Res<Tensor> {
        let (w, g) = wg;
        let ids = self.layout.blocks[l];
        let (c, nh, d, bt) = (self.cfg.width, self.cfg.heads, self.cfg.head_dim(), b * t);
        // out = xm + gelu(z) @ Wp^T + bp.
        let h = match a.h {
            Some(h) => h,
            None => ops::unary(&a.z, Activation::GeluTanh)?,
        };
        let dh = self.linear_backward(wg, (ids.fcp_w, ids.fcp_b), &h, dout)?;
        drop(h);
        let dz = ops::unary_backward(&a.z, &dh, Activation::GeluTanh)?;
        drop(dh);
        // z = a2 @ Wfc^T + bfc; a2 = ln2(xm).
        let da2 = self.linear_backward(wg, (ids.fc_w, ids.fc_b), &a.a2, &dz)?;
        drop(dz);
        let mut dxm = self.norm_backward(wg, (ids.ln2_w, ids.ln2_b), &a.xm, &a.s2, &da2)?;
        ops::binary_(&mut dxm, dout, BinaryOp::Add)?;
        // xm = x + y @ Wo^T + bo.
        let dy = self.linear_backward(wg, (ids.proj_w, ids.proj_b), &a.y, &dxm)?;
        // y = attention(q, k, v): dq, dk, dv into one buffer, as the forward's q, k, v.
        let dqkv = Tensor::empty(&self.dev, &[3, bt, c], DType::BF16)?;
        {
            let (hs, n) = ([b, t, nh, d], bt * c);
            let opts = AttentionOpts { causal: Causal::TopLeft, layout: AttnLayout::Bshd, ..Default::default() };
            let (mut dq, mut dk, mut dv) = (view(&dqkv, 0, &hs)?, view(&dqkv, n, &hs)?, view(&dqkv, 2 * n, &hs)?);
            ops::attention_backward_out(
                &*view(&a.qkv, 0, &hs)?,
                &*view(&a.qkv, n, &hs)?,
                &*view(&a.qkv, 2 * n, &hs)?,
                &*view(&a.y, 0, &hs)?,
                &a.lse,
                &*view(&dy, 0, &hs)?,
                &opts,
                (&mut dq, &mut dk, &mut dv),
            )?;
        }
        drop(dy);
        // q|k|v = a1 @ W_i^T + b_i: da1 sums three products (bf16, beta = 1); each weight
        // gradient is its own GEMM, so that each may split K across the SMs.
        let mut da1 = Tensor::empty(&self.dev, &[bt, c], DType::BF16)?;
        for i in 0..3 {
            let di = view(&dqkv, i * bt * c, &[bt, c])?;
            let beta = if i == 0 { 0.0 } else { 1.0 };
            ops::gemm(&di, &*w.part(ids.qkv_w, i * c * c, &[c, c])?, &mut da1, Gemm { beta, ..Gemm::default() })?;
            let mut dwi = view(g.flat, self.layout.params[ids.qkv_w].offset + i * c * c, &[c, c])?;
            ops::gemm(&di, &a.a1, &mut dwi, ACCUMULATE_AT_B)?;
            ops::reduce_leading_dims_out(&di, ReduceOp::Sum, &mut *g.scratch_of(ids.qkv_b, i * c, &[c])?)?;
        }
        drop(dqkv);
        let mut dx = self.norm_backward(wg, (ids.ln1_w, ids.ln1_b), &a.x, &a.s1, &da1)?;
        ops::binary_(&mut dx, &dxm, BinaryOp::Add)?;
        Ok(dx)
    }

    /// One micro-batch's forward and backward: `idx` `[B, T]`, `targets` its next tokens in
    /// chunks of [`Model::head_chunk_rows`] rows, `grad_scale` the gradient of the loss that each
    /// row's loss enters with (`1 / (B T accum)` for the mean over a step). The weight gradients
    /// are added to `g.flat`; the scratch holds this micro-batch's others ([`Grads::fold_scratch`]
    /// adds them). Returns the rows' losses (bf16), chunk by chunk.
    pub fn train_micro(
        &self,
        w: &Weights,
        g: &Grads,
        idx: &IndexTensor,
        targets: &[IndexTensor],
        grad_scale: f32,
        keep: Keep,
    ) -> Res<Vec<Tensor>> {
        let (b, t, c, v) = (idx.shape()[0], idx.shape()[1], self.cfg.width, self.cfg.vocab);
        let (bt, keep) = (b * t, if keep == Keep::Nothing { Keep::All } else { keep });
        let mut x = self.embed(w, idx, 0)?;
        let mut acts = Vec::with_capacity(self.cfg.layers);
        for l in 0..self.cfg.layers {
            let (y, a) = self.block(w, l, &x, (b, t), None, keep)?;
            acts.extend(a);
            x = y;
        }
        // The head, in chunks of rows: logits, the loss and its gradient in place (one pass), the
        // input's gradient, the tied embedding's gradient added in f32.
        let (lnf_w, lnf_b) = (w.p(self.layout.lnf_w)?, w.p(self.layout.lnf_b)?);
        let (af, sf) = ops::layer_norm(&x, Some(&lnf_w), Some(&lnf_b), LN_EPS)?;
        let rows = self.head_chunk_rows(bt);
        let logits = Tensor::empty(&self.dev, &[rows, v], DType::BF16)?;
        let daf = Tensor::empty(&self.dev, &[bt, c], DType::BF16)?;
        let wte = w.p(self.layout.wte)?;
        let mut dwte = g.f32(self.layout.wte)?;
        let mut losses = Vec::with_capacity(targets.len());
        let mut r0 = 0;
        for tg in targets {
            let r = tg.numel();
            let hv = view(&af, r0 * c, &[r, c])?;
            let mut lg = view(&logits, 0, &[r, v])?;
            ops::gemm(&hv, &wte, &mut lg, Gemm::new(false, true))?;
            losses.push(ops::cross_entropy_one_pass_(&mut lg, tg, ce_opts(grad_scale), None)?);
            ops::gemm(&lg, &wte, &mut *view(&daf, r0 * c, &[r, c])?, Gemm::default())?;
            ops::gemm(&lg, &hv, &mut dwte, ACCUMULATE_AT_B)?;
            r0 += r;
        }
        if r0 != bt {
            return Err(Error::InvalidArgument {
                op: "gpt2::train_micro",
                message: format!("the targets' chunks hold {r0} rows, the batch {bt}"),
            });
        }
        drop((af, logits, wte, dwte));
        let mut dx = self.norm_backward((w, g), (self.layout.lnf_w, self.layout.lnf_b), &x, &sf, &daf)?;
        drop((x, daf));
        for (l, a) in acts.into_iter().enumerate().rev() {
            dx = self.block_backward((w, g), l, a, &dx, (b, t))?;
        }
        // The positions' gradient: the column sums over the batch of [B, T*C].
        let dx = dx.reshape(&[b, t * c])?;
        ops::reduce_leading_dims_out(&dx, ReduceOp::Sum, &mut *g.scratch_of(self.layout.wpe, 0, &[t * c])?)?;
        let dx = dx.reshape(&[b, t, c])?;
        ops::embedding_backward_out(&dx, idx, None, &mut *g.scratch_of(self.layout.wte, 0, &[v, c])?)?;
        Ok(losses)
    }

    /// The rows' losses (bf16) of a forward without gradients, `targets` in chunks as for
    /// [`Model::train_micro`].
    pub fn eval_micro(&self, w: &Weights, idx: &IndexTensor, targets: &[IndexTensor]) -> Res<Vec<Tensor>> {
        let (b, t, c) = (idx.shape()[0], idx.shape()[1], self.cfg.width);
        let mut x = self.embed(w, idx, 0)?;
        for l in 0..self.cfg.layers {
            x = self.block(w, l, &x, (b, t), None, Keep::Nothing)?.0;
        }
        let mut losses = Vec::with_capacity(targets.len());
        let mut r0 = 0;
        for tg in targets {
            let r = tg.numel();
            let lg = self.logits_of(w, &*view(&x, r0 * c, &[r, c])?)?;
            let opts = CrossEntropyOpts { reduction: Reduction::None, ..CrossEntropyOpts::default() };
            losses.push(ops::cross_entropy(&lg, tg, opts)?.0);
            r0 += r;
        }
        Ok(losses)
    }

    /// Logits (`[T, V]`, f32 on the host) of every position of one sequence, without a cache.
    pub fn logits(&self, w: &Weights, tokens: &[i64]) -> Res<Vec<f32>> {
        let t = tokens.len();
        let idx = IndexTensor::from_slice(&self.dev, tokens, &[1, t])?;
        let mut x = self.embed(w, &idx, 0)?;
        for l in 0..self.cfg.layers {
            x = self.block(w, l, &x, (1, t), None, Keep::Nothing)?.0;
        }
        self.logits_of(w, &x)?.to_f32_vec()
    }

    /// An empty cache for `capacity` positions (at most the context).
    pub fn new_cache(&self, capacity: usize) -> Res<KvCache> {
        let shape = [1, capacity.min(self.cfg.context), self.cfg.heads, self.cfg.head_dim()];
        let mut k = Vec::new();
        let mut v = Vec::new();
        for _ in 0..self.cfg.layers {
            k.push(Tensor::empty(&self.dev, &shape, DType::BF16)?);
            v.push(Tensor::empty(&self.dev, &shape, DType::BF16)?);
        }
        Ok(KvCache { k, v, len: 0 })
    }

    /// Runs `tokens` at the cache's next positions (a prompt at once, then one token at a
    /// time), adding their keys and values to it; returns the logits (f32) of the last one.
    pub fn decode(&self, w: &Weights, cache: &mut KvCache, tokens: &[i64]) -> Res<Vec<f32>> {
        let (n, t0, c) = (tokens.len(), cache.len, self.cfg.width);
        let cap = cache.k.first().map_or(0, |k| k.shape()[1]);
        if n == 0 || t0 + n > cap {
            return Err(Error::InvalidArgument {
                op: "gpt2::decode",
                message: format!("{n} tokens after {t0} in a cache of {cap} positions"),
            });
        }
        let idx = IndexTensor::from_slice(&self.dev, tokens, &[1, n])?;
        let mut x = self.embed(w, &idx, t0)?;
        for l in 0..self.cfg.layers {
            x = self.block(w, l, &x, (1, n), Some((&cache.k[l], &cache.v[l], t0)), Keep::Nothing)?.0;
        }
        cache.len += n;
        self.logits_of(w, &*view(&x, (n - 1) * c, &[1, c])?)?.to_f32_vec()
    }
}

/// The sum in f32 of bf16 pieces (the rows' losses): one `[]` f32 tensor.
pub fn sum_f32(parts: &[Tensor]) -> Res<Tensor> {
    let all = Tensor::cat(&parts.iter().collect::<Vec<_>>(), 0)?;
    ops::reduce(&all.to_dtype(DType::F32)?, ReduceOp::Sum)
}

/// `sum x^2` over an f32 tensor of any size, in chunks of [`NORM_CHUNK`]: one `[]` f32 tensor.
pub fn sum_squares(x: &Tensor) -> Res<Tensor> {
    let n = x.numel();
    let tmp = Tensor::empty(x.device(), &[NORM_CHUNK.min(n).max(1)], DType::F32)?;
    let mut parts = Vec::new();
    for off in (0..n).step_by(NORM_CHUNK) {
        let len = NORM_CHUNK.min(n - off);
        let mut sq = view(&tmp, 0, &[len])?;
        ops::unary_out(&*view(x, off, &[len])?, UnaryOp::Pow(2.0), &mut sq)?;
        parts.push(ops::reduce(&sq, ReduceOp::Sum)?.reshape(&[1])?);
    }
    ops::reduce(&Tensor::cat(&parts.iter().collect::<Vec<_>>(), 0)?, ReduceOp::Sum)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpt2() -> Config {
        Config { layers: 12, heads: 12, width: 768, context: 1024, vocab: 50304 }
    }

    #[test]
    fn the_layout_of_gpt2_124m() {
        let lay = Layout::new(&gpt2());
        // GPT-2 small with the padded vocabulary: 124,475,904 parameters (nanoGPT counts
        // 124.48M with the tied head once).
        assert_eq!(lay.count(), 124_475_904);
        // Every parameter aligned, disjoint, in order, inside the total.
        let mut end = 0;
        for p in &lay.params {
            assert_eq!(p.offset % ALIGN, 0, "{}", p.name);
            assert!(p.offset >= end, "{} overlaps", p.name);
            end = p.offset + p.numel();
        }
        assert!(end <= lay.total);
        // The matrices before the tail, the embeddings first in it, the vectors after decay_end.
        for p in &lay.params {
            let decayed = p.shape.len() == 2;
            assert_eq!(p.offset < lay.decay_end, decayed, "{}", p.name);
            let gemm_grad = decayed && !p.name.contains("wte") && !p.name.contains("wpe");
            assert_eq!(p.offset < lay.tail_start, gemm_grad, "{}", p.name);
        }
        assert_eq!(lay.params[lay.wte].offset, lay.tail_start);
        let names: std::collections::HashSet<&str> = lay.params.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(names.len(), lay.params.len());
        assert!(names.contains("transformer.h.11.mlp.c_proj.bias") && names.contains("transformer.ln_f.weight"));
    }

    #[test]
    fn initialization_follows_gpt2() {
        let lay = Layout::new(&Config { layers: 2, heads: 2, width: 16, context: 8, vocab: 128 });
        let by = |n: &str| lay.params.iter().find(|p| p.name == n).unwrap().init;
        assert_eq!(by("transformer.wte.weight"), Init::Normal(0.02));
        assert_eq!(by("transformer.h.1.attn.c_proj.weight"), Init::Normal(0.01)); // 0.02 / sqrt(2 * 2)
        assert_eq!(by("transformer.h.0.mlp.c_proj.weight"), Init::Normal(0.01));
        assert_eq!(by("transformer.h.0.mlp.c_fc.weight"), Init::Normal(0.02));
        assert_eq!(by("transformer.h.0.ln_2.weight"), Init::Ones);
        assert_eq!(by("transformer.h.0.attn.c_attn.bias"), Init::Zeros);
    }

    #[test]
    fn configs_the_kernels_cannot_run_are_refused() {
        assert!(gpt2().validate().is_ok());
        let bad = |f: fn(&mut Config)| {
            let mut c = gpt2();
            f(&mut c);
            c.validate().is_err()
        };
        assert!(bad(|c| c.heads = 7)); // 768 / 7
        assert!(bad(|c| c.heads = 128)); // head dim 6
        assert!(bad(|c| c.heads = 2)); // head dim 384
        assert!(bad(|c| c.vocab = 50257));
        assert!(bad(|c| c.layers = 0));
    }

    #[test]
    fn flops_count_six_per_gemm_parameter_and_the_attention() {
        let c = gpt2();
        assert_eq!(c.gemm_params(), 12 * 12 * 768 * 768 + 50304 * 768);
        let f = c.flops_per_token(1024);
        assert_eq!(f, 6.0 * c.gemm_params() as f64 + 12.0 * 12.0 * 1024.0 * 768.0);
        // 0.855 GFLOP a token at this size: 0.741 in the GEMMs, 0.113 in the attention.
        assert!((f / 1e9 - 0.855).abs() < 0.001, "{f}");
    }
}
