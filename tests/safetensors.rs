//! GPU tests of `kernels::safetensors`: tensors of every dtype and of awkward shapes (a scalar,
//! an empty one, odd sizes) saved and loaded back bit for bit with their names and metadata;
//! a truncated file is an error, not a panic. The header's parsing is tested on the host in the
//! library's own unit tests.

mod common;

use common::*;
use kernels::{DType, Device, Error, Tensor, safetensors};
use std::process::ExitCode;

fn round_trip(dev: &Device) -> Result<(), String> {
    let mut rng = TestRng::new(5);
    let shapes: [&[usize]; 5] = [&[], &[0, 3], &[7], &[3, 5, 2], &[1, 1000]];
    let mut originals = Vec::new();
    for (i, s) in shapes.iter().enumerate() {
        let dt = DType::ALL[i % 3];
        let v = draw(&mut rng, s.iter().product(), dt, Draw::FINITE);
        originals.push((format!("layer.{i}.weight"), Tensor::from_f32(dev, &v, s, dt).map_err(e)?));
    }
    let dir = std::env::temp_dir().join(format!("kernels-safetensors-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(e)?;
    let path = dir.join("t.safetensors");
    let named: Vec<(&str, &Tensor)> = originals.iter().map(|(n, t)| (n.as_str(), t)).collect();
    safetensors::save(&path, &named, &[("format", "pt"), ("step", "12")]).map_err(e)?;
    let loaded = safetensors::load(dev, &path).map_err(e)?;
    if loaded.len() != originals.len() {
        return Err(format!("{} tensors loaded of {}", loaded.len(), originals.len()));
    }
    for ((n0, t0), (n1, t1)) in originals.iter().zip(&loaded) {
        if n0 != n1 || t0.shape() != t1.shape() || t0.dtype() != t1.dtype() {
            return Err(format!(
                "{n0} {:?} {:?} came back as {n1} {:?} {:?}",
                t0.shape(),
                t0.dtype(),
                t1.shape(),
                t1.dtype()
            ));
        }
        let (a, b) = (t0.to_f32_vec().map_err(e)?, t1.to_f32_vec().map_err(e)?);
        if a.iter().zip(&b).any(|(x, y)| x.to_bits() != y.to_bits()) {
            return Err(format!("{n0}: values differ"));
        }
    }
    let meta = safetensors::metadata(&path).map_err(e)?;
    if meta != [("format".to_string(), "pt".to_string()), ("step".to_string(), "12".to_string())] {
        return Err(format!("metadata {meta:?}"));
    }
    // Truncated: the last tensor's bytes run past the end.
    let bytes = std::fs::read(&path).map_err(e)?;
    std::fs::write(&path, &bytes[..bytes.len() - 1]).map_err(e)?;
    let r = safetensors::load(dev, &path);
    let _ = std::fs::remove_dir_all(&dir);
    match r {
        Err(Error::InvalidArgument { op: "safetensors::load", .. }) => {}
        other => return Err(format!("a truncated file: {:?}", other.map(|v| v.len()))),
    }
    let dup = safetensors::save(dir.join("never"), &[("a", &originals[0].1), ("a", &originals[1].1)], &[]);
    if !matches!(dup, Err(Error::InvalidArgument { .. })) {
        return Err(format!("a name twice: {dup:?}"));
    }
    Ok(())
}

fn main() -> ExitCode {
    run(vec![test("safetensors/round_trip", round_trip)])
}
