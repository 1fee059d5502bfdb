//! The data: a corpus of Rust sources tokenized byte by byte, the token file that carries it to
//! a machine without Rust, the train/validation split, and the loader thread that prepares the
//! next batches on the host while the GPU computes.
//!
//! Token files, told apart by their first bytes:
//! - this example's (`--prepare-data`): the 8 bytes `KTOKENS1`, the token width in bytes (u32
//!   little-endian, 1 or 2), the token count (u64), then the tokens (little-endian) compressed
//!   with zlib: the corpus is text, which compresses about fivefold;
//! - llm.c's `.bin`: a header of 256 i32 (magic 20240520, version 1, token count), then u16
//!   tokens (GPT-2's BPE);
//! - anything else: a plain file whose bytes are the tokens.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};

/// The first bytes of this example's token files.
pub const MAGIC: &[u8; 8] = b"KTOKENS1";
/// llm.c's token files' magic number.
const LLMC_MAGIC: i32 = 20240520;
/// Folders of the toolchain's `library/` left out of the default corpus: `stdarch` (machine-
/// generated intrinsic bindings) and `vendor` (third-party crates).
pub const SKIPPED: &[&str] = &["stdarch", "vendor"];

/// Byte-level tokenization: each byte of the text is a token (vocabulary 256).
pub fn encode(text: &[u8]) -> Vec<u16> {
    text.iter().map(|&b| b as u16).collect()
}

/// Tokens back to text: bytes above 255 (another vocabulary) show as `?`; byte sequences that
/// are not UTF-8 (a sample may stop inside a character) show as U+FFFD.
pub fn decode(tokens: &[u16]) -> String {
    let bytes: Vec<u8> = tokens.iter().map(|&t| u8::try_from(t).unwrap_or(b'?')).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// The toolchain's standard-library sources (the `rust-src` component), if `rustc` is on the
/// path and the component installed.
pub fn default_corpus_dir() -> Option<PathBuf> {
    let out = std::process::Command::new("rustc").args(["--print", "sysroot"]).output().ok()?;
    let sysroot = String::from_utf8(out.stdout).ok()?;
    let dir = Path::new(sysroot.trim()).join("lib/rustlib/src/rust/library");
    dir.is_dir().then_some(dir)
}

/// Every `*.rs` file under `dir`, sorted by path (the corpus is the same on every machine),
/// outside the folders named in `skip`.
pub fn rust_files(dir: &Path, skip: &[&str]) -> std::io::Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d)? {
            let p = e?.path();
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or_default();
            if p.is_dir() {
                if !skip.contains(&name) {
                    stack.push(p);
                }
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    out.sort();
    Ok(out)
}

/// The files' contents joined, each after a line naming it (relative to `root`), stopping
/// before the first file that would pass `max_bytes`.
pub fn join_files(root: &Path, files: &[PathBuf], max_bytes: usize) -> std::io::Result<Vec<u8>> {
    let mut text = Vec::new();
    for f in files {
        let body = std::fs::read(f)?;
        let rel = f.strip_prefix(root).unwrap_or(f).display().to_string();
        let head = format!("// ---- {rel} ----\n");
        if text.len() + head.len() + body.len() > max_bytes {
            break;
        }
        text.extend_from_slice(head.as_bytes());
        text.extend_from_slice(&body);
        if !body.ends_with(b"\n") {
            text.push(b'\n');
        }
    }
    Ok(text)
}

/// The token file of `tokens` (this example's format).
pub fn write_tokens(tokens: &[u16]) -> Vec<u8> {
    let wide = tokens.iter().any(|&t| t > 255);
    let raw: Vec<u8> = if wide {
        tokens.iter().flat_map(|t| t.to_le_bytes()).collect()
    } else {
        tokens.iter().map(|&t| t as u8).collect()
    };
    let mut out = MAGIC.to_vec();
    out.extend_from_slice(&(if wide { 2u32 } else { 1 }).to_le_bytes());
    out.extend_from_slice(&(tokens.len() as u64).to_le_bytes());
    out.extend_from_slice(&miniz_oxide::deflate::compress_to_vec_zlib(&raw, 6));
    out
}

/// The tokens of a token file in any of the three formats (see the module's documentation).
pub fn read_tokens(bytes: &[u8]) -> Result<Vec<u16>, String> {
    if let Some(rest) = bytes.strip_prefix(MAGIC) {
        if rest.len() < 12 {
            return Err("the token file's header is cut short".into());
        }
        let width = u32::from_le_bytes(rest[..4].try_into().expect("4 bytes"));
        let count = u64::from_le_bytes(rest[4..12].try_into().expect("8 bytes")) as usize;
        if width != 1 && width != 2 {
            return Err(format!("the token file says {width} bytes a token (1 or 2)"));
        }
        let raw = miniz_oxide::inflate::decompress_to_vec_zlib_with_limit(&rest[12..], count * width as usize + 1)
            .map_err(|e| format!("the token file's data does not decompress: {e:?}"))?;
        if raw.len() != count * width as usize {
            return Err(format!("the token file holds {} bytes of tokens, its header says {count} tokens", raw.len()));
        }
        return Ok(if width == 1 {
            raw.iter().map(|&b| b as u16).collect()
        } else {
            raw.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect()
        });
    }
    if bytes.len() >= 1024 && i32::from_le_bytes(bytes[..4].try_into().expect("4 bytes")) == LLMC_MAGIC {
        let count = i32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
        let data = &bytes[1024..];
        if count < 0 || data.len() != 2 * count as usize {
            return Err(format!("llm.c token file: header says {count} tokens, {} bytes follow", data.len()));
        }
        return Ok(data.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect());
    }
    Ok(encode(bytes))
}

/// Splits `tokens` into training and validation tokens: the last `val_frac` of them (at least
/// `min_each`) for validation. An error if either part would hold fewer than `min_each`.
pub fn split(tokens: &[u16], val_frac: f64, min_each: usize) -> Result<(Vec<u16>, Vec<u16>), String> {
    if !(0.0..1.0).contains(&val_frac) {
        return Err(format!("--val-frac must be in [0, 1), got {val_frac}"));
    }
    let n = tokens.len();
    let val = ((n as f64 * val_frac) as usize).max(min_each);
    if n < val + min_each {
        return Err(format!(
            "{n} tokens are too few: a batch needs {min_each} consecutive tokens, for training and for validation"
        ));
    }
    Ok((tokens[..n - val].to_vec(), tokens[n - val..].to_vec()))
}

/// One micro-batch: `rows` sequences of `seq` input tokens and their targets (the next token of
/// each), row-major, as i64 for the device's index tensors.
#[derive(Clone, Debug, PartialEq)]
pub struct Micro {
    pub inputs: Vec<i64>,
    pub targets: Vec<i64>,
}

/// The windows a loader takes, in order, as llm.c's: a micro-batch is the `rows * seq + 1`
/// tokens from the cursor (row `r` the `seq + 1` from `r * seq`), then the cursor moves on by
/// `rows * seq`, back to the start when the next one would pass the end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cursor {
    pub pos: usize,
    pub rows: usize,
    pub seq: usize,
    pub len: usize,
}

impl Cursor {
    /// A cursor at the start of `len` tokens.
    pub fn new(len: usize, rows: usize, seq: usize) -> Cursor {
        Cursor { pos: 0, rows, seq, len }
    }

    /// The start of the next micro-batch, and the cursor moved past it.
    pub fn next_start(&mut self) -> usize {
        let span = self.rows * self.seq;
        if self.pos + span + 1 > self.len {
            self.pos = 0;
        }
        let start = self.pos;
        self.pos += span;
        start
    }

    /// The micro-batch at `start` of `tokens`.
    pub fn micro(&self, tokens: &[u16], start: usize) -> Micro {
        let span = self.rows * self.seq;
        let w = &tokens[start..start + span + 1];
        Micro {
            inputs: w[..span].iter().map(|&t| t as i64).collect(),
            targets: w[1..].iter().map(|&t| t as i64).collect(),
        }
    }
}

/// The loader thread: sends each step's `accum` micro-batches of the training tokens, two steps
/// ahead, until the receiving end is dropped.
pub struct Loader {
    rx: Receiver<Vec<Micro>>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl Loader {
    /// Starts the thread at the cursor's position after `skip` micro-batches (a resumed run).
    pub fn spawn(tokens: Arc<Vec<u16>>, rows: usize, seq: usize, accum: usize, skip: u64) -> Loader {
        let (tx, rx): (SyncSender<Vec<Micro>>, _) = sync_channel(2);
        let handle = std::thread::spawn(move || {
            let mut cur = Cursor::new(tokens.len(), rows, seq);
            for _ in 0..skip {
                cur.next_start();
            }
            loop {
                let step = (0..accum)
                    .map(|_| {
                        let at = cur.next_start();
                        cur.micro(&tokens, at)
                    })
                    .collect();
                if tx.send(step).is_err() {
                    return;
                }
            }
        });
        Loader { rx, handle: Some(handle) }
    }

    /// The next step's micro-batches (waits for the thread only if it fell behind).
    pub fn next(&self) -> Result<Vec<Micro>, String> {
        self.rx.recv().map_err(|_| "the data loader thread stopped".to_string())
    }
}

impl Drop for Loader {
    fn drop(&mut self) {
        // Closing the channel ends the thread at its next send; wait for it.
        let (_, dead) = sync_channel(0);
        drop(std::mem::replace(&mut self.rx, dead));
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_are_the_tokens() {
        let text = "fn main() { println!(\"héllo\"); }\n".as_bytes();
        let t = encode(text);
        assert_eq!(t.len(), text.len());
        assert!(t.iter().all(|&x| x < 256));
        assert_eq!(decode(&t), "fn main() { println!(\"héllo\"); }\n");
        // A sample cut inside a two-byte character, and a token outside the bytes.
        assert_eq!(decode(&t[..24]), "fn main() { println!(\"h\u{fffd}");
        assert_eq!(decode(&[b'a' as u16, 300]), "a?");
    }

    #[test]
    fn token_files_round_trip_in_every_format() {
        let text: Vec<u8> = (0..5000u32).map(|i| b"let x = 1;\n"[(i % 11) as usize]).collect();
        let toks = encode(&text);
        let file = write_tokens(&toks);
        assert!(file.starts_with(MAGIC));
        assert!(file.len() < text.len() / 4, "text compresses: {} bytes", file.len());
        assert_eq!(read_tokens(&file).unwrap(), toks);
        // Two-byte tokens.
        let wide: Vec<u16> = (0..3000u32).map(|i| (i * 37 % 50257) as u16).collect();
        assert_eq!(read_tokens(&write_tokens(&wide)).unwrap(), wide);
        // llm.c's layout.
        let mut llmc = vec![0u8; 1024];
        llmc[..4].copy_from_slice(&LLMC_MAGIC.to_le_bytes());
        llmc[4..8].copy_from_slice(&1i32.to_le_bytes());
        llmc[8..12].copy_from_slice(&(wide.len() as i32).to_le_bytes());
        llmc.extend(wide.iter().flat_map(|t| t.to_le_bytes()));
        assert_eq!(read_tokens(&llmc).unwrap(), wide);
        // Plain text.
        assert_eq!(read_tokens(b"abc").unwrap(), vec![97, 98, 99]);
        // Damage is an error, not a panic.
        assert!(read_tokens(&file[..file.len() - 5]).is_err());
        assert!(read_tokens(&file[..14]).is_err());
        let mut lie = file.clone();
        lie[12] ^= 1; // the count
        assert!(read_tokens(&lie).is_err());
        llmc.pop();
        assert!(read_tokens(&llmc).is_err());
    }

    #[test]
    fn corpus_walk_is_sorted_and_skips_folders() {
        let dir = std::env::temp_dir().join(format!("gpt2-corpus-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for (p, body) in [("b.rs", "b\n"), ("a/x.rs", "x"), ("vendor/v.rs", "v\n"), ("a/y.txt", "no\n")] {
            let f = dir.join(p);
            std::fs::create_dir_all(f.parent().unwrap()).unwrap();
            std::fs::write(f, body).unwrap();
        }
        let files = rust_files(&dir, SKIPPED).unwrap();
        let names: Vec<String> = files.iter().map(|f| f.strip_prefix(&dir).unwrap().display().to_string()).collect();
        assert_eq!(names, ["a/x.rs", "b.rs"]);
        let text = join_files(&dir, &files, 1 << 20).unwrap();
        assert_eq!(String::from_utf8(text).unwrap(), "// ---- a/x.rs ----\nx\n// ---- b.rs ----\nb\n");
        // The limit stops before the file that would pass it.
        assert_eq!(join_files(&dir, &files, 25).unwrap().len(), 22);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn split_keeps_the_tail_for_validation() {
        let t: Vec<u16> = (0..1000).collect();
        let (tr, va) = split(&t, 0.1, 65).unwrap();
        assert_eq!((tr.len(), va.len()), (900, 100));
        assert_eq!(va[0], 900);
        let (tr, va) = split(&t, 0.01, 65).unwrap();
        assert_eq!((tr.len(), va.len()), (935, 65));
        assert!(split(&t, 0.1, 600).is_err());
        assert!(split(&t, 1.0, 1).is_err());
    }

    #[test]
    fn batches_are_shifted_windows_in_order() {
        let t: Vec<u16> = (0..100).collect();
        let mut c = Cursor::new(t.len(), 3, 10);
        let s = c.next_start();
        let m = c.micro(&t, s);
        assert_eq!(m.inputs.len(), 30);
        assert_eq!(m.inputs[..3], [0, 1, 2]);
        assert_eq!(m.inputs[10], 10); // row 1 starts where row 0 ends
        assert!(m.inputs.iter().zip(&m.targets).all(|(i, t)| t - i == 1));
        // 31 tokens a micro-batch, 30 further each time: 0, 30, 60; then 90 + 31 > 100 wraps.
        assert_eq!([c.next_start(), c.next_start(), c.next_start()], [30, 60, 0]);
    }

    #[test]
    fn the_loader_thread_follows_the_cursor_and_resumes() {
        let t: Arc<Vec<u16>> = Arc::new((0..500).map(|i| (i % 256) as u16).collect());
        let mut c = Cursor::new(t.len(), 2, 8);
        let expected: Vec<Micro> = (0..10)
            .map(|_| {
                let at = c.next_start();
                c.micro(&t, at)
            })
            .collect();
        let l = Loader::spawn(t.clone(), 2, 8, 2, 0);
        let got: Vec<Micro> = (0..5).flat_map(|_| l.next().unwrap()).collect();
        assert_eq!(got, expected);
        drop(l); // ends the thread (the test would hang otherwise)
        let l = Loader::spawn(t, 2, 8, 2, 6);
        assert_eq!(l.next().unwrap(), expected[6..8]);
    }
}
