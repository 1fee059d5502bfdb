//! GPT-2 (124M) trained and sampled from Rust on the library's kernels: the forward and the
//! backward written out by hand as llm.c's, bf16 compute with f32 master weights, the fused
//! AdamW, gradient accumulation, global-norm clipping, warm-up and cosine learning rate,
//! checkpoints (safetensors), validation, and sampling with a KV cache.
//!
//! ```text
//! cargo run --release --example gpt2                      # the self-check on a tiny model
//! cargo run --release --example gpt2 -- --prepare-data gpt2-data/rust-std.tok
//! cargo run --release --example gpt2 -- --data gpt2-data/rust-std.tok --steps 5000 --sample 256
//! cargo run --release --example gpt2 -- --layers 2 --heads 4 --width 128 --seq 128 --steps 50
//! ```
//!
//! The data: the Rust standard library's sources as the toolchain ships them (`rust-src`),
//! tokenized byte by byte (vocabulary 256, a multiple of 128 already). Without `--data` the
//! example reads them from `rustc --print sysroot`; `--prepare-data FILE` writes them, compressed,
//! to a token file for a machine without Rust (`--data FILE` there). llm.c's `.bin` token files
//! (GPT-2's BPE) work too, with `--vocab 50304`.
//!
//! Each step: a loader thread has the step's micro-batches ready on the host; every micro-batch
//! runs forward and backward (the weight gradients summed in f32); the loss and the squared
//! gradient norm are reduced on the GPU; while the GPU finishes, the host copies the next batch
//! over, then reads the two numbers (the step's only wait), clips, and enqueues AdamW and the
//! bf16 cast. The progress line shows the loss, the learning rate, the gradient norm, the step's
//! time, tokens a second, the MFU (FLOPs as [`model::Config::flops_per_token`] counts them,
//! against the GPU's dense bf16 peak) and the peak memory held by tensors
//! (`Device::memory_stats`, PyTorch's `max_memory_allocated`).
//!
//! `--dump DIR` writes what `python/examples/gpt2_parity.py` compares against PyTorch: the
//! initial weights, the first 20 steps' batches, the gradients of the first step, and each step's
//! loss, gradient norm and learning rate. `--json FILE` writes the run's throughput and memory
//! for the same script's side-by-side table.
//!
//! Without arguments: the self-check on a tiny model (2 blocks, width 128) trained on this
//! example's own source: the first loss near `ln 256`, the loss falling, a resumed checkpoint
//! stepping bit for bit as the run it came from, the GELU recomputation giving the same
//! gradients, the KV cache's logits matching the full forward's, and a sample. Exits 0 with a
//! message when there is no GPU (as the other examples); training without a GPU is an error.

mod args;
mod data;
mod model;
mod train;

use args::Args;
use data::{Cursor, Loader, Micro};
use kernels::{DType, Device, Tensor};
use model::{Config, Keep, Model, sum_f32};
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;
use train::{DevMicro, Hyper, State, StepStats, upload};

type AnyResult<T> = Result<T, Box<dyn std::error::Error>>;

/// Steps whose batches and losses `--dump` records.
const DUMP_STEPS: usize = 20;

fn main() {
    let args = match Args::parse(std::env::args().skip(1)) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("error: {e}\n\n{}", args::usage());
            std::process::exit(2);
        }
    };
    if args.has("help") {
        print!("{}", args::usage());
        return;
    }
    match run(&args) {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}

fn run(args: &Args) -> AnyResult<i32> {
    if let Some(out) = args.path("prepare-data") {
        prepare_data(args, &out)?;
        return Ok(0);
    }
    let check = args.is_empty() || args.has("self-check");
    let dev = match Device::cuda(0) {
        Ok(d) => d,
        Err(e) if check => {
            println!("no GPU ({e}): nothing to check");
            return Ok(0);
        }
        Err(e) => {
            return Err(format!("no GPU ({e}): training needs an NVIDIA GPU of compute capability 8.0 or newer").into());
        }
    };
    if check {
        return Ok(if self_check(&dev)? { 0 } else { 1 });
    }
    train_run(&dev, args)?;
    Ok(0)
}

/// `--prepare-data FILE`: the corpus (`--corpus DIR` or the toolchain's library sources, up to
/// `--max-bytes`) tokenized and written to FILE.
fn prepare_data(args: &Args, out: &Path) -> AnyResult<()> {
    let dir = match args.path("corpus") {
        Some(d) => d,
        None => data::default_corpus_dir().ok_or(
            "no --corpus and no rust-src: `rustup component add rust-src`, or name a folder of .rs files with --corpus",
        )?,
    };
    let files = data::rust_files(&dir, data::SKIPPED)?;
    let text = data::join_files(&dir, &files, args.value("max-bytes")?)?;
    if text.is_empty() {
        return Err(format!("no .rs files under {}", dir.display()).into());
    }
    let file = data::write_tokens(&data::encode(&text));
    if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)?;
    }
    std::fs::write(out, &file)?;
    println!(
        "{}: {} tokens (bytes) from {} files of {}, {:.2} MB compressed",
        out.display(),
        text.len(),
        files.len(),
        dir.display(),
        file.len() as f64 / 1e6
    );
    Ok(())
}

/// The run's settings from the flags.
struct Settings {
    cfg: Config,
    hyper: Hyper,
    batch: usize,
    seq: usize,
    accum: usize,
    seed: u64,
    keep: Keep,
}

fn settings(args: &Args) -> AnyResult<Settings> {
    let cfg = Config {
        layers: args.value("layers")?,
        heads: args.value("heads")?,
        width: args.value("width")?,
        context: args.value("context")?,
        vocab: args.value::<usize>("vocab")?.next_multiple_of(128),
    };
    let hyper = Hyper {
        lr: args.value("lr")?,
        min_lr_frac: args.value("min-lr-frac")?,
        warmup: args.value("warmup")?,
        steps: args.value("steps")?,
        weight_decay: args.value("weight-decay")?,
        beta1: args.value("beta1")?,
        beta2: args.value("beta2")?,
        eps: args.value("eps")?,
        clip: args.value("clip")?,
    };
    let s = Settings {
        cfg,
        hyper,
        batch: args.value("batch")?,
        seq: args.value("seq")?,
        accum: args.value("accum")?,
        seed: args.value("seed")?,
        keep: if args.has("recompute") { Keep::Recompute } else { Keep::All },
    };
    s.check()?;
    Ok(s)
}

impl Settings {
    fn check(&self) -> Result<(), String> {
        self.cfg.validate()?;
        if self.batch == 0 || self.seq == 0 || self.accum == 0 {
            return Err("--batch, --seq and --accum must be positive".into());
        }
        if self.seq > self.cfg.context {
            return Err(format!("--seq {} is longer than the context ({})", self.seq, self.cfg.context));
        }
        Ok(())
    }

    fn tokens_per_step(&self) -> usize {
        self.batch * self.seq * self.accum
    }
}

/// Uploads a step's micro-batches.
fn upload_step(model: &Model, dev: &Device, step: &[Micro], s: &Settings) -> kernels::Result<Vec<DevMicro>> {
    step.iter().map(|m| upload(model, dev, m, (s.batch, s.seq))).collect()
}

/// The mean loss over up to `batches` micro-batches of `tokens` (the validation split), taken in
/// order from its start.
fn validate(model: &Model, st: &State, tokens: &[u16], s: &Settings, batches: usize) -> AnyResult<f64> {
    let dev = st.master.device();
    let mut cur = Cursor::new(tokens.len(), s.batch, s.seq);
    let fit = (tokens.len() - 1) / (s.batch * s.seq);
    let n = batches.min(fit).max(1);
    let mut losses = Vec::new();
    for _ in 0..n {
        let at = cur.next_start();
        let m = upload(model, dev, &cur.micro(tokens, at), (s.batch, s.seq))?;
        losses.extend(model.eval_micro(&st.weights(model), &m.idx, &m.targets)?);
    }
    Ok(sum_f32(&losses)?.to_scalar::<f32>()? as f64 / (n * s.batch * s.seq) as f64)
}

/// SplitMix64: the sampling's random numbers.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform on [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// A token drawn from `logits[..limit]` at `temperature` (0: the likeliest), among the `top_k`
/// likeliest (0: all).
fn pick(logits: &[f32], limit: usize, temperature: f64, top_k: usize, rng: &mut Rng) -> usize {
    let l = &logits[..limit.min(logits.len())];
    let mut order: Vec<usize> = (0..l.len()).collect();
    order.sort_by(|&a, &b| l[b].total_cmp(&l[a]));
    if temperature <= 0.0 {
        return order[0];
    }
    if top_k > 0 {
        order.truncate(top_k);
    }
    let top = l[order[0]] as f64;
    let w: Vec<f64> = order.iter().map(|&i| ((l[i] as f64 - top) / temperature).exp()).collect();
    let mut r = rng.unit() * w.iter().sum::<f64>();
    for (&i, &wi) in order.iter().zip(&w) {
        if r < wi {
            return i;
        }
        r -= wi;
    }
    order[order.len() - 1]
}

/// `n` tokens after `prompt`, one at a time through the KV cache (stopping at the context).
fn sample(
    model: &Model,
    st: &State,
    prompt: &[u16],
    n: usize,
    limit: usize,
    args: &Args,
    rng: &mut Rng,
) -> AnyResult<Vec<u16>> {
    let (temperature, top_k): (f64, usize) = (args.value("temperature")?, args.value("top-k")?);
    let prompt: Vec<i64> =
        if prompt.is_empty() { vec![b'\n' as i64] } else { prompt.iter().map(|&t| t as i64).collect() };
    let cap = (prompt.len() + n).min(model.cfg.context);
    if prompt.len() >= cap {
        return Err(format!("the prompt ({} tokens) fills the context ({})", prompt.len(), model.cfg.context).into());
    }
    let w = st.weights(model);
    let mut cache = model.new_cache(cap)?;
    let mut logits = model.decode(&w, &mut cache, &prompt)?;
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        let tok = pick(&logits, limit, temperature, top_k, rng);
        out.push(tok as u16);
        if cache.len == cap {
            break;
        }
        logits = model.decode(&w, &mut cache, &[tok as i64])?;
    }
    Ok(out)
}

/// Writes the model's parameters (and, with `opt`, AdamW's moments) to `path` with the run's
/// metadata.
fn save_checkpoint(path: &Path, model: &Model, st: &State, opt: bool, meta: &[(&str, String)]) -> AnyResult<()> {
    let named = model.named(&st.master)?;
    let mut list: Vec<(&str, &Tensor)> = named.iter().map(|(n, v)| (*n, &**v)).collect();
    if opt {
        list.push(("optimizer.exp_avg", &st.m));
        list.push(("optimizer.exp_avg_sq", &st.v));
    }
    let c = model.cfg;
    let mut m: Vec<(&str, String)> = vec![
        ("format", "kernels-gpt2".into()),
        ("layers", c.layers.to_string()),
        ("heads", c.heads.to_string()),
        ("width", c.width.to_string()),
        ("context", c.context.to_string()),
        ("vocab", c.vocab.to_string()),
        ("step", st.step.to_string()),
    ];
    m.extend(meta.iter().cloned());
    let m: Vec<(&str, &str)> = m.iter().map(|(k, v)| (*k, v.as_str())).collect();
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)?;
    }
    kernels::safetensors::save(path, &list, &m)?;
    Ok(())
}

/// A checkpoint's metadata as a map.
fn checkpoint_meta(path: &Path) -> AnyResult<std::collections::BTreeMap<String, String>> {
    Ok(kernels::safetensors::metadata(path)?.into_iter().collect())
}

/// The model's shape as a checkpoint records it.
fn checkpoint_config(meta: &std::collections::BTreeMap<String, String>) -> AnyResult<Config> {
    let get = |k: &str| -> AnyResult<usize> {
        Ok(meta.get(k).ok_or_else(|| format!("the checkpoint's metadata has no {k:?}"))?.parse()?)
    };
    Ok(Config {
        layers: get("layers")?,
        heads: get("heads")?,
        width: get("width")?,
        context: get("context")?,
        vocab: get("vocab")?,
    })
}

/// The state in a checkpoint written by [`save_checkpoint`] (the moments, if it has them, and
/// its step).
fn load_checkpoint(path: &Path, model: &Model, dev: &Device) -> AnyResult<State> {
    let meta = checkpoint_meta(path)?;
    let tensors = kernels::safetensors::load(dev, path)?;
    let master = Tensor::zeros(dev, &[model.layout.total], DType::F32)?;
    model.load_named(&master, &tensors)?;
    let mut st = State::new(master)?;
    for (name, dst) in [("optimizer.exp_avg", &mut st.m), ("optimizer.exp_avg_sq", &mut st.v)] {
        if let Some((_, t)) = tensors.iter().find(|(n, _)| n == name) {
            if t.shape() != dst.shape() || t.dtype() != DType::F32 {
                return Err(format!(
                    "{name} in {} is {:?} {:?}, not f32 {:?}",
                    path.display(),
                    t.dtype(),
                    t.shape(),
                    dst.shape()
                )
                .into());
            }
            *dst = t.clone();
        }
    }
    st.step = meta.get("step").map_or(Ok(0), |s| s.parse())?;
    Ok(st)
}

/// The training tokens' file, or the toolchain's library sources tokenized here.
fn load_tokens(args: &Args) -> AnyResult<(Vec<u16>, String)> {
    if let Some(p) = args.path("data") {
        let bytes = std::fs::read(&p).map_err(|e| format!("cannot read --data {}: {e}", p.display()))?;
        return Ok((data::read_tokens(&bytes)?, p.display().to_string()));
    }
    let dir = match args.path("corpus") {
        Some(d) => d,
        None => data::default_corpus_dir().ok_or(
            "no --data, and no Rust standard library sources here (`rustc --print sysroot`, the rust-src \
             component): run `--prepare-data FILE` where Rust is and pass --data FILE",
        )?,
    };
    let text = data::join_files(&dir, &data::rust_files(&dir, data::SKIPPED)?, args.value("max-bytes")?)?;
    Ok((data::encode(&text), dir.display().to_string()))
}

/// Human-readable bytes.
fn gib(bytes: usize) -> String {
    format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
}

/// The kernels of a trace, by total time: the top `n`, with their share.
fn trace_summary(t: &kernels::Trace, n: usize) -> String {
    let mut by: std::collections::BTreeMap<&str, (usize, f64)> = Default::default();
    for k in &t.kernels {
        let e = by.entry(k.name.as_str()).or_default();
        e.0 += 1;
        e.1 += k.dur_us;
    }
    let total: f64 = by.values().map(|v| v.1).sum();
    let mut v: Vec<_> = by.into_iter().collect();
    v.sort_by(|a, b| b.1.1.total_cmp(&a.1.1));
    let mut s = format!("{} kernels, {:.2} ms of kernel time; by total time:\n", t.kernels.len(), total / 1e3);
    for (name, (count, us)) in v.into_iter().take(n) {
        s += &format!("  {:>6.2} ms {:>5.1}%  x{count:<4} {name}\n", us / 1e3, 100.0 * us / total.max(1e-9));
    }
    s
}

/// What `--dump` collects over the first steps.
struct Dump {
    dir: std::path::PathBuf,
    batches: Vec<serde_json::Value>,
    steps: Vec<serde_json::Value>,
}

impl Dump {
    fn finish(&self) -> AnyResult<()> {
        std::fs::write(self.dir.join("batches.json"), serde_json::to_string(&self.batches)?)?;
        std::fs::write(self.dir.join("losses.json"), serde_json::to_string_pretty(&self.steps)?)?;
        println!("dump: {} steps written to {}", self.steps.len(), self.dir.display());
        Ok(())
    }
}

fn train_run(dev: &Device, args: &Args) -> AnyResult<()> {
    let mut s = settings(args)?;
    let load = args.path("load");
    if load.is_some() && args.has("dump") {
        // The parity script starts PyTorch's AdamW from zero moments at step 0.
        return Err("--dump records a run from its initialization: not with --load".into());
    }
    let meta = load.as_deref().map(checkpoint_meta).transpose()?;
    if let Some(meta) = &meta {
        let c = checkpoint_config(meta)?;
        for (flag, mine, theirs) in [
            ("layers", s.cfg.layers, c.layers),
            ("heads", s.cfg.heads, c.heads),
            ("width", s.cfg.width, c.width),
            ("context", s.cfg.context, c.context),
            ("vocab", s.cfg.vocab, c.vocab),
        ] {
            if args.has(flag) && mine != theirs {
                return Err(format!("--{flag} {mine}, but the checkpoint's model has {theirs}").into());
            }
        }
        s.cfg = c;
        s.check()?;
    }
    let (tokens, source) = load_tokens(args)?;
    let top = tokens.iter().copied().max().unwrap_or(0) as usize;
    if top >= s.cfg.vocab {
        return Err(format!("the data has token {top}: --vocab must be at least {}", top + 1).into());
    }
    let limit = if top < 256 { 256 } else { top + 1 };
    let (train_tokens, val_tokens) = data::split(&tokens, args.value("val-frac")?, s.batch * s.seq + 1)?;
    let model = Model::new(dev, s.cfg);
    let mut st = match &load {
        Some(p) => load_checkpoint(p, &model, dev)?,
        None => State::new(model.init(s.seed)?)?,
    };
    let start = st.step as usize;
    let h = s.hyper;
    let peak = match args.get("peak-tflops") {
        Some(t) => Some(t.parse::<f64>().map_err(|_| format!("--peak-tflops: cannot read {t:?}"))? * 1e12),
        None => train::peak_flops(dev.name()),
    };
    let flops_per_token = s.cfg.flops_per_token(s.seq);
    println!(
        "GPT-2: {} layers, {} heads, width {}, context {}, vocabulary {}: {:.2}M parameters ({:.1}M in GEMMs)",
        s.cfg.layers,
        s.cfg.heads,
        s.cfg.width,
        s.cfg.context,
        s.cfg.vocab,
        model.layout.count() as f64 / 1e6,
        s.cfg.gemm_params() as f64 / 1e6
    );
    println!(
        "data: {source}: {} training and {} validation tokens; batch {} x {} x {} accumulated = {} tokens a step",
        train_tokens.len(),
        val_tokens.len(),
        s.batch,
        s.seq,
        s.accum,
        s.tokens_per_step()
    );
    println!(
        "device: {} ({}); {:.3} GFLOP a token (6 a GEMM parameter + 12 L T C), peak {}",
        dev.name(),
        dev.ptx_arch(),
        flops_per_token / 1e9,
        peak.map_or("unknown (--peak-tflops)".into(), |p| format!("{:.1} TFLOP/s bf16", p / 1e12))
    );
    if start > 0 {
        println!(
            "resuming at step {start} from {}",
            load.as_deref().map(|p| p.display().to_string()).unwrap_or_default()
        );
    }
    let micro_done = (start * s.accum) as u64;
    let loader = Loader::spawn(Arc::new(train_tokens), s.batch, s.seq, s.accum, micro_done);

    let mut dump = match args.path("dump") {
        Some(dir) => {
            std::fs::create_dir_all(&dir)?;
            save_checkpoint(&dir.join("init.safetensors"), &model, &st, false, &[])?;
            let config = serde_json::json!({
                "layers": s.cfg.layers, "heads": s.cfg.heads, "width": s.cfg.width, "context": s.cfg.context,
                "vocab": s.cfg.vocab, "batch": s.batch, "seq": s.seq, "accum": s.accum, "steps": h.steps,
                "lr": h.lr, "min_lr_frac": h.min_lr_frac, "warmup": h.warmup, "weight_decay": h.weight_decay,
                "beta1": h.beta1, "beta2": h.beta2, "eps": h.eps, "clip": h.clip, "seed": s.seed,
                "ln_eps": model::LN_EPS, "start_step": start,
            });
            std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&config)?)?;
            Some(Dump { dir, batches: Vec::new(), steps: Vec::new() })
        }
        None => None,
    };
    let trace_path = args.path("trace");
    let trace_step = (start + 3).min(h.steps.saturating_sub(1));
    let (log_every, val_every, val_batches): (usize, usize, usize) =
        (args.value("log-every")?, args.value("val-every")?, args.value("val-batches")?);
    let (n_sample, save_every): (usize, usize) = (args.value("sample")?, args.value("save-every")?);
    let prompt = data::encode(args.get("prompt").unwrap_or("//! ").as_bytes());
    let mut rng = Rng(s.seed);
    let save = args.path("save");
    let save_meta = |st: &State| {
        vec![
            ("batch", s.batch.to_string()),
            ("seq", s.seq.to_string()),
            ("accum", s.accum.to_string()),
            ("step_done", st.step.to_string()),
        ]
    };

    let mut host = loader.next()?;
    let mut batch = upload_step(&model, dev, &host, &s)?;
    let mut records: Vec<(usize, StepStats, f64)> = Vec::new();
    let mut val_losses: Vec<(usize, f64)> = Vec::new();
    let mut last = Instant::now();
    for step in start..h.steps {
        if trace_path.is_some() && step == trace_step {
            dev.start_trace()?;
        }
        let pending = st.compute(&model, &batch, s.keep)?;
        if let Some(d) = dump.as_mut().filter(|_| step == start) {
            let named = model.named(&pending.grads)?;
            let list: Vec<(&str, &Tensor)> = named.iter().map(|(n, v)| (*n, &**v)).collect();
            kernels::safetensors::save(d.dir.join("grads0.safetensors"), &list, &[])?;
        }
        let next_host = if step + 1 < h.steps { Some(loader.next()?) } else { None };
        let next = next_host.as_ref().map(|m| upload_step(&model, dev, m, &s)).transpose()?;
        let stats = st.apply(pending, &h, &model)?;
        let now = Instant::now();
        let secs = now.duration_since(last).as_secs_f64();
        last = now;
        if let Some(path) = trace_path.as_ref().filter(|_| step == trace_step) {
            let t = dev.stop_trace()?;
            t.write_chrome_json(path)?;
            print!("trace of step {step} written to {}: {}", path.display(), trace_summary(&t, 15));
        }
        let tok_s = s.tokens_per_step() as f64 / secs;
        records.push((step, stats, secs));
        if let Some(d) = dump.as_mut().filter(|d| d.steps.len() < DUMP_STEPS) {
            d.batches.push(serde_json::json!(
                host.iter().map(|m| serde_json::json!({"inputs": m.inputs, "targets": m.targets})).collect::<Vec<_>>()
            ));
            d.steps.push(serde_json::json!({"step": step, "loss": stats.loss, "norm": stats.norm, "lr": stats.lr}));
            if d.steps.len() == DUMP_STEPS || step + 1 == h.steps {
                d.finish()?;
            }
        }
        if step == start || (step + 1) % log_every.max(1) == 0 || step + 1 == h.steps {
            let mfu = peak.map_or("n/a".into(), |p| format!("{:.1}%", 100.0 * flops_per_token * tok_s / p));
            println!(
                "step {:>5}/{} | loss {:.4} | lr {:.2e} | norm {:.3} | {:.1} ms | {:.1}k tok/s | MFU {mfu} | peak {}",
                step + 1,
                h.steps,
                stats.loss,
                stats.lr,
                stats.norm,
                secs * 1e3,
                tok_s / 1e3,
                gib(dev.memory_stats().peak_allocated_bytes)
            );
        }
        let last_step = step + 1 == h.steps;
        if (val_every > 0 && (step + 1) % val_every == 0) || last_step {
            let vl = validate(&model, &st, &val_tokens, &s, val_batches)?;
            val_losses.push((step + 1, vl));
            println!("step {:>5}: validation loss {vl:.4}", step + 1);
            if n_sample > 0 {
                let out = sample(&model, &st, &prompt, n_sample, limit, args, &mut rng)?;
                println!("---- sample ----\n{}{}\n----------------", data::decode(&prompt), data::decode(&out));
            }
        }
        if let Some(p) = save.as_ref().filter(|_| last_step || (save_every > 0 && (step + 1) % save_every == 0)) {
            save_checkpoint(p, &model, &st, true, &save_meta(&st))?;
            println!("checkpoint of step {} written to {}", st.step, p.display());
        }
        if last_step || val_every > 0 && (step + 1) % val_every == 0 {
            // Validation, sampling and saving are not the step's time.
            last = Instant::now();
        }
        host = next_host.unwrap_or_default();
        if let Some(n) = next {
            batch = n;
        }
    }
    summary(dev, args, &s, &records, &val_losses, peak, flops_per_token)
}

/// The end of a run: throughput over the steady steps (after the first three, which load the
/// kernels), memory, and `--json`.
fn summary(
    dev: &Device,
    args: &Args,
    s: &Settings,
    records: &[(usize, StepStats, f64)],
    val_losses: &[(usize, f64)],
    peak: Option<f64>,
    flops_per_token: f64,
) -> AnyResult<()> {
    let steady = if records.len() > 3 { &records[3..] } else { records };
    let secs: f64 = steady.iter().map(|r| r.2).sum();
    let tok_s = (steady.len() * s.tokens_per_step()) as f64 / secs.max(1e-12);
    let mut per: Vec<f64> = steady.iter().map(|r| s.tokens_per_step() as f64 / r.2).collect();
    per.sort_by(f64::total_cmp);
    let median = per.get(per.len() / 2).copied().unwrap_or(0.0);
    let mem = dev.memory_stats();
    let mfu = peak.map(|p| flops_per_token * tok_s / p);
    println!(
        "{} steps: {:.1}k tokens/s (median step {:.1}k), {:.1} ms a step, MFU {}; peak memory {} held by tensors, {} reserved",
        records.len(),
        tok_s / 1e3,
        median / 1e3,
        1e3 * secs / steady.len().max(1) as f64,
        mfu.map_or("n/a".into(), |m| format!("{:.1}%", 100.0 * m)),
        gib(mem.peak_allocated_bytes),
        gib(mem.peak_reserved_bytes)
    );
    // Whether the products' tensor maps came from the device's cache (sm_90a only).
    let maps = dev.tensor_map_cache_stats();
    println!(
        "tensor maps: {} calls from the cache, {} cached, {} new, {} not cached",
        maps.hits,
        maps.misses,
        maps.first_seen,
        maps.bypassed - maps.first_seen
    );
    if let Some(path) = args.path("json") {
        let j = serde_json::json!({
            "example": "gpt2",
            "device": dev.name(),
            "config": {"layers": s.cfg.layers, "heads": s.cfg.heads, "width": s.cfg.width, "context": s.cfg.context,
                       "vocab": s.cfg.vocab, "batch": s.batch, "seq": s.seq, "accum": s.accum,
                       "recompute": s.keep == Keep::Recompute},
            "steps": records.len(),
            "steady_steps": steady.len(),
            "tokens_per_s": tok_s,
            "tokens_per_s_median": median,
            "ms_per_step": 1e3 * secs / steady.len().max(1) as f64,
            "flops_per_token": flops_per_token,
            "mfu": mfu,
            "peak_allocated_bytes": mem.peak_allocated_bytes,
            "peak_reserved_bytes": mem.peak_reserved_bytes,
            "losses": records.iter().map(|r| r.1.loss).collect::<Vec<_>>(),
            "val_losses": val_losses,
        });
        std::fs::write(&path, serde_json::to_string_pretty(&j)?)?;
        println!("summary written to {}", path.display());
    }
    Ok(())
}

/// The self-check: a tiny GPT-2 trained on this example's own source for a few seconds.
fn self_check(dev: &Device) -> AnyResult<bool> {
    let s = Settings {
        cfg: Config { layers: 2, heads: 4, width: 128, context: 128, vocab: 256 },
        hyper: Hyper {
            lr: 2e-3,
            min_lr_frac: 0.1,
            warmup: 15,
            steps: 150,
            weight_decay: 0.1,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            clip: 1.0,
        },
        batch: 8,
        seq: 64,
        accum: 2,
        seed: 1337,
        keep: Keep::All,
    };
    s.check()?;
    let text = [
        include_str!("main.rs"),
        include_str!("model.rs"),
        include_str!("train.rs"),
        include_str!("data.rs"),
        include_str!("args.rs"),
    ]
    .concat();
    let (train_tokens, val_tokens) = data::split(&data::encode(text.as_bytes()), 0.1, s.batch * s.seq + 1)?;
    let model = Model::new(dev, s.cfg);
    let mut st = State::new(model.init(s.seed)?)?;
    let loader = Loader::spawn(Arc::new(train_tokens), s.batch, s.seq, s.accum, 0);
    println!(
        "self-check: {} layers, width {}, {} parameters; {} tokens a step of this example's source; {}",
        s.cfg.layers,
        s.cfg.width,
        model.layout.count(),
        s.tokens_per_step(),
        dev.name()
    );
    let mut ok = true;
    let mut check = |good: bool, what: String| {
        println!("  {} {what}", if good { "ok  " } else { "FAIL" });
        ok &= good;
    };
    let t0 = Instant::now();
    let mut losses = Vec::new();
    let mut batch = upload_step(&model, dev, &loader.next()?, &s)?;
    for step in 0..s.hyper.steps {
        let pending = st.compute(&model, &batch, s.keep)?;
        let next = upload_step(&model, dev, &loader.next()?, &s)?;
        let stats = st.apply(pending, &s.hyper, &model)?;
        losses.push(stats.loss);
        if step % 25 == 0 || step + 1 == s.hyper.steps {
            println!("  step {:>3}: loss {:.4}, norm {:.3}, lr {:.2e}", step + 1, stats.loss, stats.norm, stats.lr);
        }
        batch = next;
    }
    println!("  {} steps in {:.2} s", s.hyper.steps, t0.elapsed().as_secs_f64());
    // At initialization the logits are near 0 (weights of std 0.02 over 128 normalized
    // channels: std 0.23), so the loss is near ln 256 + 0.23^2 / 2.
    let ln_v = (s.cfg.vocab as f64).ln();
    check((losses[0] - ln_v).abs() < 0.25, format!("first loss {:.4} within 0.25 of ln 256 = {ln_v:.4}", losses[0]));
    let tail = losses[losses.len() - 10..].iter().sum::<f64>() / 10.0;
    check(tail < 0.6 * ln_v, format!("the last 10 steps' mean loss {tail:.4} below 0.6 ln 256 = {:.4}", 0.6 * ln_v));
    let vl = validate(&model, &st, &val_tokens, &s, 4)?;
    check(vl.is_finite() && vl < ln_v, format!("validation loss {vl:.4} finite and below ln 256"));

    // The GELU recomputed in the backward gives the same gradients, bit for bit (the same
    // kernel on the same input).
    let kept = st.compute(&model, &batch, Keep::All)?.grads.to_vec::<f32>()?;
    let recomputed = st.compute(&model, &batch, Keep::Recompute)?.grads.to_vec::<f32>()?;
    check(kept == recomputed, "gradients with the GELU recomputed equal those with it kept".into());

    // A checkpoint resumes bit for bit: one step from the saved state, twice.
    let path = std::env::temp_dir().join(format!("gpt2-self-check-{}.safetensors", std::process::id()));
    save_checkpoint(&path, &model, &st, true, &[])?;
    let a = st.compute(&model, &batch, s.keep)?;
    let a = st.apply(a, &s.hyper, &model)?;
    let wa = st.master.to_vec::<f32>()?;
    let mut resumed = load_checkpoint(&path, &model, dev)?;
    std::fs::remove_file(&path)?;
    let b = resumed.compute(&model, &batch, s.keep)?;
    let b = resumed.apply(b, &s.hyper, &model)?;
    let wb = resumed.master.to_vec::<f32>()?;
    check(
        a == b && wa == wb && resumed.step == st.step,
        format!(
            "the resumed step equals the original (loss {:.6} and {:.6}, weights equal: {})",
            a.loss,
            b.loss,
            wa == wb
        ),
    );

    // The KV cache: a prompt of 16 tokens at once, then 31 one at a time, against one forward of
    // the 48. The two paths differ only in the GEMMs' shapes (one row against 48), whose f32
    // sums may round to a neighbouring bf16 value; each block's output then moves by about
    // 2^-8 of itself, so the logits are held to (L + 1) 2^-7 of their largest magnitude.
    let seq: Vec<i64> = val_tokens[..48].iter().map(|&t| t as i64).collect();
    let w = st.weights(&model);
    let full = model.logits(&w, &seq)?;
    let v = s.cfg.vocab;
    let mut cache = model.new_cache(48)?;
    let mut worst = 0.0f32;
    let mut scale = 0.0f32;
    let mut compare = |pos: usize, got: &[f32]| {
        for (g, r) in got.iter().zip(&full[pos * v..(pos + 1) * v]) {
            worst = worst.max((g - r).abs());
            scale = scale.max(r.abs());
        }
    };
    compare(15, &model.decode(&w, &mut cache, &seq[..16])?);
    for p in 16..48 {
        compare(p, &model.decode(&w, &mut cache, &seq[p..p + 1])?);
    }
    let tol = (s.cfg.layers + 1) as f32 * scale / 128.0;
    check(
        worst <= tol,
        format!(
            "KV-cache logits within {tol:.4} of the full forward's (largest difference {worst:.4}, largest logit {scale:.2})"
        ),
    );
    let args = Args::default();
    let out = sample(&model, &st, &data::encode(b"fn "), 96, 256, &args, &mut Rng(7))?;
    check(out.len() == 96, format!("sampled 96 bytes: {:?}", data::decode(&out)));
    let mem = dev.memory_stats();
    println!("  peak memory held by tensors: {}", gib(mem.peak_allocated_bytes));
    println!("{}", if ok { "all checks passed" } else { "CHECKS FAILED" });
    Ok(ok)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picking_tokens() {
        let logits = [0.0f32, 3.0, 1.0, 2.9, -1.0];
        let mut rng = Rng(1);
        // Temperature 0: the likeliest, whatever the random numbers.
        assert_eq!(pick(&logits, 5, 0.0, 0, &mut rng), 1);
        // The limit hides the tokens past it.
        assert_eq!(pick(&logits, 1, 0.0, 0, &mut rng), 0);
        // Top 2: only 1 and 3 are drawn, about equally often.
        let mut counts = [0usize; 5];
        for _ in 0..4000 {
            counts[pick(&logits, 5, 1.0, 2, &mut rng)] += 1;
        }
        assert_eq!(counts[0] + counts[2] + counts[4], 0);
        assert!((1800..2400).contains(&counts[1]) && (1600..2200).contains(&counts[3]), "{counts:?}");
        // All of them, in proportion to exp(logit): token 4 about 0.2% of the time.
        let mut counts = [0usize; 5];
        for _ in 0..20000 {
            counts[pick(&logits, 5, 1.0, 0, &mut rng)] += 1;
        }
        let z: f64 = logits.iter().map(|&l| (l as f64).exp()).sum();
        for (i, &c) in counts.iter().enumerate() {
            let p = (logits[i] as f64).exp() / z;
            let sd = (20000.0 * p * (1.0 - p)).sqrt();
            assert!((c as f64 - 20000.0 * p).abs() < 5.0 * sd + 1.0, "token {i}: {c} of 20000, p = {p}");
        }
    }

    #[test]
    fn settings_are_checked() {
        let s = |a: &[&str]| settings(&Args::parse(a.iter().map(|x| x.to_string())).unwrap());
        let d = s(&[]).unwrap();
        assert_eq!((d.cfg.layers, d.cfg.heads, d.cfg.width, d.cfg.context, d.cfg.vocab), (12, 12, 768, 1024, 256));
        assert_eq!(d.tokens_per_step(), 16 * 1024);
        assert_eq!(s(&["--vocab", "50257"]).unwrap().cfg.vocab, 50304);
        assert!(s(&["--seq", "2048"]).is_err());
        assert!(s(&["--heads", "5"]).is_err());
        assert!(s(&["--accum", "0"]).is_err());
        assert_eq!(s(&["--recompute"]).unwrap().keep, Keep::Recompute);
    }

    #[test]
    fn trace_summaries_and_sizes_read_well() {
        assert_eq!(gib(3 << 29), "1.50 GiB");
        let t = kernels::Trace::default();
        assert!(trace_summary(&t, 5).starts_with("0 kernels"));
    }
}
