//! The command line: `--flag value` or `--flag=value` pairs and bare switches, parsed by hand
//! from `std::env::args` (the project has no argument-parsing dependency).

use std::collections::BTreeMap;

/// Every flag: its name, whether it takes a value, its default (shown in the usage), and what
/// it does.
pub const FLAGS: &[(&str, bool, &str, &str)] = &[
    ("steps", true, "1000", "optimizer steps"),
    ("batch", true, "16", "sequences a micro-batch"),
    ("seq", true, "1024", "tokens a sequence (at most --context)"),
    ("accum", true, "1", "micro-batches a step (gradient accumulation)"),
    ("lr", true, "6e-4", "peak learning rate"),
    ("min-lr-frac", true, "0.1", "the cosine decay ends at lr * this"),
    ("warmup", true, "100", "steps of linear warm-up"),
    ("weight-decay", true, "0.1", "AdamW's decoupled weight decay (matrices only)"),
    ("beta1", true, "0.9", "AdamW's first-moment decay"),
    ("beta2", true, "0.95", "AdamW's second-moment decay"),
    ("eps", true, "1e-8", "AdamW's epsilon"),
    ("clip", true, "1.0", "global gradient-norm clipping (0: none)"),
    ("layers", true, "12", "transformer blocks"),
    ("heads", true, "12", "attention heads"),
    ("width", true, "768", "model width (channels)"),
    ("context", true, "1024", "learned positions"),
    ("vocab", true, "256", "vocabulary, rounded up to a multiple of 128 for the GEMMs"),
    ("seed", true, "1337", "initial weights and sampling"),
    ("data", true, "", "token file (--prepare-data's, llm.c's .bin, or plain text)"),
    ("corpus", true, "", "folder of .rs files (default: the toolchain's rust-src library)"),
    ("prepare-data", true, "", "write the tokenized corpus to this file and exit"),
    ("max-bytes", true, "24000000", "--prepare-data: the most corpus bytes taken"),
    ("val-frac", true, "0.05", "fraction of the tokens held out for validation"),
    ("val-every", true, "250", "steps between validations (0: only at the end)"),
    ("val-batches", true, "20", "micro-batches a validation"),
    ("save", true, "", "checkpoint (safetensors) written at the end"),
    ("save-every", true, "0", "also write --save every this many steps"),
    ("load", true, "", "checkpoint to start from (weights, AdamW state, step)"),
    ("sample", true, "0", "bytes sampled (with a KV cache) at each validation"),
    ("prompt", true, "//! ", "the samples' prompt"),
    ("temperature", true, "1.0", "sampling temperature"),
    ("top-k", true, "0", "sample among the k likeliest tokens (0: all)"),
    ("log-every", true, "10", "steps between progress lines"),
    ("dump", true, "", "folder for the parity script: initial weights, the first 20 batches, the losses"),
    ("json", true, "", "write the run's summary (throughput, memory, losses) as JSON"),
    ("trace", true, "", "record one step's kernels as Chrome trace JSON"),
    ("peak-tflops", true, "", "the GPU's dense bf16 peak for the MFU (default: from its name)"),
    ("recompute", false, "", "recompute GELU in the backward instead of keeping its output"),
    ("self-check", false, "", "the tiny-model checks (what no arguments run)"),
    ("help", false, "", "this text"),
];

/// The parsed flags: name to value (`""` for a switch).
#[derive(Debug, Default)]
pub struct Args {
    values: BTreeMap<String, String>,
}

/// The usage text, from [`FLAGS`].
pub fn usage() -> String {
    let mut s = String::from(
        "usage: gpt2 [FLAGS]\n\
         \x20 no flags: the self-check on a tiny model; otherwise trains GPT-2 (124M by default)\n\n",
    );
    for (name, value, default, help) in FLAGS {
        let flag = if *value { format!("--{name} X") } else { format!("--{name}") };
        let default = if default.is_empty() { String::new() } else { format!(" [{default}]") };
        s += &format!("  {flag:<20} {help}{default}\n");
    }
    s
}

impl Args {
    /// Parses `args` (without the program's name). Errors name the flag.
    pub fn parse(args: impl IntoIterator<Item = String>) -> Result<Args, String> {
        let mut values = BTreeMap::new();
        let mut it = args.into_iter();
        while let Some(a) = it.next() {
            let Some(body) = a.strip_prefix("--") else {
                return Err(format!("unexpected argument {a:?} (flags start with --)"));
            };
            let (name, inline) = match body.split_once('=') {
                Some((n, v)) => (n, Some(v.to_string())),
                None => (body, None),
            };
            let Some(&(_, takes, _, _)) = FLAGS.iter().find(|f| f.0 == name) else {
                return Err(format!("unknown flag --{name}"));
            };
            let value = match (takes, inline) {
                (true, Some(v)) => v,
                (true, None) => it.next().ok_or_else(|| format!("--{name} needs a value"))?,
                (false, None) => String::new(),
                (false, Some(_)) => return Err(format!("--{name} takes no value")),
            };
            if values.insert(name.to_string(), value).is_some() {
                return Err(format!("--{name} is given twice"));
            }
        }
        Ok(Args { values })
    }

    /// Whether no flag was given.
    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// Whether the flag was given.
    pub fn has(&self, name: &str) -> bool {
        self.values.contains_key(name)
    }

    /// The flag's value as given, if it was.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.values.get(name).map(String::as_str)
    }

    /// The flag's value, or its default from [`FLAGS`], parsed as `T`.
    pub fn value<T: std::str::FromStr>(&self, name: &str) -> Result<T, String> {
        let default = FLAGS.iter().find(|f| f.0 == name).map(|f| f.2).unwrap_or_default();
        let text = self.get(name).unwrap_or(default);
        text.parse().map_err(|_| format!("--{name}: cannot read {text:?} as a {}", std::any::type_name::<T>()))
    }

    /// A non-empty string value, if the flag was given.
    pub fn path(&self, name: &str) -> Option<std::path::PathBuf> {
        self.get(name).filter(|s| !s.is_empty()).map(std::path::PathBuf::from)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &[&str]) -> Result<Args, String> {
        Args::parse(s.iter().map(|x| x.to_string()))
    }

    #[test]
    fn values_switches_and_defaults() {
        let a = parse(&["--steps", "20", "--lr=3e-4", "--recompute", "--data", "x.tok"]).unwrap();
        assert_eq!(a.value::<usize>("steps").unwrap(), 20);
        assert_eq!(a.value::<f64>("lr").unwrap(), 3e-4);
        assert!(a.has("recompute") && !a.has("self-check"));
        assert_eq!(a.path("data").unwrap(), std::path::PathBuf::from("x.tok"));
        // Not given: the table's default.
        assert_eq!(a.value::<usize>("batch").unwrap(), 16);
        assert_eq!(a.value::<f64>("beta2").unwrap(), 0.95);
        assert!(a.path("save").is_none());
        assert!(parse(&[]).unwrap().is_empty());
    }

    #[test]
    fn mistakes_are_errors_naming_the_flag() {
        assert!(parse(&["--stepz", "3"]).unwrap_err().contains("--stepz"));
        assert!(parse(&["--steps"]).unwrap_err().contains("needs a value"));
        assert!(parse(&["--recompute=1"]).unwrap_err().contains("takes no value"));
        assert!(parse(&["--seed", "1", "--seed", "2"]).unwrap_err().contains("twice"));
        assert!(parse(&["steps"]).unwrap_err().contains("unexpected"));
        let a = parse(&["--batch", "many"]).unwrap();
        assert!(a.value::<usize>("batch").unwrap_err().contains("--batch"));
    }

    #[test]
    fn every_default_parses() {
        let a = Args::default();
        for (name, takes, default, _) in FLAGS {
            if *takes && !default.is_empty() && !matches!(*name, "prompt") {
                assert!(a.value::<f64>(name).is_ok(), "--{name} default {default:?}");
            }
        }
        assert!(usage().contains("--prepare-data X"));
    }
}
