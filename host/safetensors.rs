//! Saving and loading tensors in the safetensors format (Hugging Face's: an 8-byte
//! little-endian header length, a JSON header naming each tensor's dtype, shape and byte range,
//! then the raw little-endian data), the format PyTorch, JAX and candle checkpoints share.
//!
//! ```no_run
//! # fn main() -> kernels::Result<()> {
//! use kernels::{DType, Device, Tensor, safetensors};
//! let dev = Device::cuda(0)?;
//! let w = Tensor::rand_normal(&dev, &[768, 3072], DType::BF16, 0.0, 0.02, 1)?;
//! safetensors::save("model.safetensors", &[("mlp.fc.weight", &w)], &[("step", "1000")])?;
//! let loaded = safetensors::load(&dev, "model.safetensors")?;   // [("mlp.fc.weight", tensor)]
//! # let _ = loaded; Ok(()) }
//! ```
//!
//! The library's dtypes are `F32`, `F16` and `BF16`; a file holding another (`I64`, `F64`, ...)
//! is refused with its name and dtype rather than converted. Every range is checked against
//! the file and the shape before anything is copied to the device.

use crate::error::{Error, Result};
use crate::{DType, Device, Tensor};
use std::path::Path;

fn invalid(op: &'static str, message: String) -> Error {
    Error::InvalidArgument { op, message }
}

fn dtype_name(dt: DType) -> &'static str {
    match dt {
        DType::F32 => "F32",
        DType::F16 => "F16",
        DType::BF16 => "BF16",
    }
}

/// Writes `tensors` (names unique) and the string pairs of `metadata` (the header's
/// `__metadata__`) to `path`, the data in the order given.
pub fn save(path: impl AsRef<Path>, tensors: &[(&str, &Tensor)], metadata: &[(&str, &str)]) -> Result<()> {
    let op = "safetensors::save";
    let path = path.as_ref();
    let mut header = serde_json::Map::new();
    if !metadata.is_empty() {
        let m = metadata.iter().map(|(k, v)| (k.to_string(), serde_json::Value::from(*v))).collect();
        header.insert("__metadata__".into(), serde_json::Value::Object(m));
    }
    let mut offset = 0usize;
    for (name, t) in tensors {
        if *name == "__metadata__" || header.contains_key(*name) {
            return Err(invalid(op, format!("the name {name:?} is used twice or reserved")));
        }
        let end = offset + t.size_bytes();
        header.insert(
            name.to_string(),
            serde_json::json!({ "dtype": dtype_name(t.dtype()), "shape": t.shape(), "data_offsets": [offset, end] }),
        );
        offset = end;
    }
    let mut json = serde_json::to_vec(&serde_json::Value::Object(header))
        .map_err(|e| invalid(op, format!("cannot encode the header: {e}")))?;
    // Padded with spaces so that the data starts 8-byte aligned, as the format recommends.
    json.resize(json.len().next_multiple_of(8), b' ');
    let mut file = Vec::with_capacity(8 + json.len() + offset);
    file.extend_from_slice(&(json.len() as u64).to_le_bytes());
    file.extend_from_slice(&json);
    for (_, t) in tensors {
        file.extend_from_slice(&t.to_bytes()?);
    }
    std::fs::write(path, file).map_err(|e| invalid(op, format!("cannot write {}: {e}", path.display())))
}

/// Reads every tensor of `path` onto `dev`, in the order of their data in the file.
pub fn load(dev: &Device, path: impl AsRef<Path>) -> Result<Vec<(String, Tensor)>> {
    let op = "safetensors::load";
    let path = path.as_ref();
    let bytes = std::fs::read(path).map_err(|e| invalid(op, format!("cannot read {}: {e}", path.display())))?;
    let (entries, data) = parse(&bytes).map_err(|m| invalid(op, format!("{}: {m}", path.display())))?;
    entries.into_iter().map(|e| Ok((e.name, Tensor::from_bytes(op, dev, &data[e.range], &e.shape, e.dtype)?))).collect()
}

/// Reads the metadata (`__metadata__`) of `path`'s header, without its tensors.
pub fn metadata(path: impl AsRef<Path>) -> Result<Vec<(String, String)>> {
    let op = "safetensors::metadata";
    let path = path.as_ref();
    let bytes = std::fs::read(path).map_err(|e| invalid(op, format!("cannot read {}: {e}", path.display())))?;
    let header = header(&bytes).map_err(|m| invalid(op, format!("{}: {m}", path.display())))?.0;
    let Some(meta) = header.get("__metadata__") else { return Ok(Vec::new()) };
    let meta = meta.as_object().ok_or_else(|| invalid(op, "__metadata__ is not an object".into()))?;
    meta.iter()
        .map(|(k, v)| match v.as_str() {
            Some(s) => Ok((k.clone(), s.to_string())),
            None => Err(invalid(op, format!("__metadata__[{k:?}] is not a string"))),
        })
        .collect()
}

/// One tensor of a file: its name, dtype, shape and byte range in the data.
#[derive(Debug, PartialEq)]
struct Entry {
    name: String,
    dtype: DType,
    shape: Vec<usize>,
    range: std::ops::Range<usize>,
}

/// The header's JSON object and the data that follows it.
fn header(bytes: &[u8]) -> std::result::Result<(serde_json::Map<String, serde_json::Value>, &[u8]), String> {
    let len = bytes.get(..8).ok_or("shorter than the 8-byte header length")?;
    let len = u64::from_le_bytes(len.try_into().map_err(|_| "header length")?);
    let end = usize::try_from(len).ok().and_then(|l| l.checked_add(8)).filter(|&e| e <= bytes.len());
    let end = end.ok_or_else(|| format!("a header of {len} bytes in a file of {}", bytes.len()))?;
    let value: serde_json::Value =
        serde_json::from_slice(&bytes[8..end]).map_err(|e| format!("the header is not JSON: {e}"))?;
    match value {
        serde_json::Value::Object(m) => Ok((m, &bytes[end..])),
        _ => Err("the header is not a JSON object".into()),
    }
}

fn parse(bytes: &[u8]) -> std::result::Result<(Vec<Entry>, &[u8]), String> {
    let (header, data) = header(bytes)?;
    let mut entries = Vec::new();
    for (name, v) in &header {
        if name == "__metadata__" {
            continue;
        }
        let field = |f: &str| v.get(f).ok_or_else(|| format!("{name:?} has no {f:?}"));
        let dtype = match field("dtype")?.as_str() {
            Some("F32") => DType::F32,
            Some("F16") => DType::F16,
            Some("BF16") => DType::BF16,
            Some(other) => return Err(format!("{name:?} is {other}; only F32, F16 and BF16 load")),
            None => return Err(format!("{name:?}: dtype is not a string")),
        };
        let ints = |f: &str| -> std::result::Result<Vec<usize>, String> {
            field(f)?
                .as_array()
                .ok_or_else(|| format!("{name:?}: {f} is not an array"))?
                .iter()
                .map(|x| x.as_u64().and_then(|x| usize::try_from(x).ok()).ok_or_else(|| format!("{name:?}: {f} {x}")))
                .collect()
        };
        let shape = ints("shape")?;
        let offsets = ints("data_offsets")?;
        let [begin, end] = offsets[..] else { return Err(format!("{name:?}: data_offsets {offsets:?}")) };
        let need = shape.iter().try_fold(dtype.size(), |a, &d| a.checked_mul(d));
        if begin > end || end > data.len() || need != Some(end - begin) {
            return Err(format!(
                "{name:?}: bytes {begin}..{end} of {} for {shape:?} {dtype:?} (which needs {need:?})",
                data.len()
            ));
        }
        entries.push(Entry { name: name.clone(), dtype, shape, range: begin..end });
    }
    entries.sort_by_key(|e| (e.range.start, e.range.end));
    for w in entries.windows(2) {
        if w[1].range.start < w[0].range.end {
            return Err(format!("{:?} and {:?} overlap", w[0].name, w[1].name));
        }
    }
    Ok((entries, data))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(header: &str, data: &[u8]) -> Vec<u8> {
        let mut f = (header.len() as u64).to_le_bytes().to_vec();
        f.extend_from_slice(header.as_bytes());
        f.extend_from_slice(data);
        f
    }

    #[test]
    fn parses_a_file_as_the_reference_writes_it() {
        // Two tensors, data out of name order, metadata, a padded header.
        let h = r#"{"__metadata__":{"format":"pt"},"b":{"dtype":"BF16","shape":[2],"data_offsets":[8,12]},"a":{"dtype":"F32","shape":[1,2],"data_offsets":[0,8]}}  "#;
        let f = file(h, &[0u8; 12]);
        let (e, data) = parse(&f).unwrap();
        assert_eq!(data.len(), 12);
        assert_eq!(e[0], Entry { name: "a".into(), dtype: DType::F32, shape: vec![1, 2], range: 0..8 });
        assert_eq!(e[1], Entry { name: "b".into(), dtype: DType::BF16, shape: vec![2], range: 8..12 });
        // A scalar: shape [], one element.
        let (e, _) = parse(&file(r#"{"s":{"dtype":"F16","shape":[],"data_offsets":[0,2]}}"#, &[0, 0])).unwrap();
        assert_eq!(e[0].shape, Vec::<usize>::new());
    }

    #[test]
    fn refuses_what_does_not_fit() {
        let bad = |h: &str, n: usize, what: &str| {
            let err = parse(&file(h, &vec![0u8; n])).unwrap_err();
            assert!(err.contains(what), "{h}: {err}");
        };
        bad(r#"{"x":{"dtype":"I64","shape":[1],"data_offsets":[0,8]}}"#, 8, "I64");
        bad(r#"{"x":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#, 8, "needs");
        bad(r#"{"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#, 4, "bytes 0..8 of 4");
        bad(r#"{"x":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}}"#, 8, "bytes 8..0");
        bad(r#"{"x":{"dtype":"F32","shape":[2]}}"#, 8, "data_offsets");
        bad(r#"{"x":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}}"#, 8, "shape");
        bad(
            r#"{"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"y":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#,
            8,
            "overlap",
        );
        bad(r#"[1, 2]"#, 0, "not a JSON object");
        bad(r#"{"x": "#, 0, "not JSON");
        assert!(parse(&[1, 0, 0]).unwrap_err().contains("8-byte"));
        let mut huge = u64::MAX.to_le_bytes().to_vec();
        huge.extend_from_slice(b"{}");
        assert!(parse(&huge).unwrap_err().contains("header of"));
    }
}
