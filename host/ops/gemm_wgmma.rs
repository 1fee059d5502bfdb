//! The Hopper path of the bf16/f16 GEMM (host side of `kernels-gpu/src/gemm_wgmma.rs`): which
//! products it takes, the copy engine's tensor maps, and the persistent launch.
//!
//! The kernels read A and B through TMA tensor maps (`cuTensorMapEncodeTiled`), which need
//! 16-byte aligned rows; the maps go to the device written by a kernel that takes them as its
//! parameter, stream-ordered ([`upload_maps`]; the kernel fences them:
//! `prim::fence_tensormap`). A set asked for a second time is written once more, into a slot of
//! the device's cache of tensor maps (`host/device/map_cache.rs`): a model that runs the same
//! products on the same buffers every step launches no writes after its second step.

use crate::device::{Device, DeviceBuffer, LaunchConfig};
use crate::error::{Error, Result, driver};
use cudarc::driver::sys;
use kernels_gpu::DType;
use kernels_gpu::gemm_epilogue::Epilogue;
use kernels_gpu::gemm_wgmma::{
    A_BATCHED, B_BATCHED, BK, BM, BN, CLUSTER, MAP_WORDS, MapsArgs, PAIR_K, SMEM_BYTES, SPLIT_K, THREADS, TensorMaps,
    WgmmaArgs, store_tensor_maps, wgmma_kernel,
};

/// One input operand as stored: device address, elements between rows (`ld`) and between the
/// matrices of a batch (`stride`, 0: shared by the batch), and whether the product reads its
/// transpose.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Operand {
    pub(crate) ptr: u64,
    pub(crate) ld: u64,
    pub(crate) stride: u64,
    pub(crate) trans: bool,
}

/// Whether the wgmma kernels run a product of `input` operands (both bf16 or both f16) into
/// `out` on `dev`: an sm_90a device (H100, H200), output f32/bf16/f16, and operands the copy
/// engine can read (16-byte aligned addresses, rows and batch strides).
pub(crate) fn supports(dev: &Device, input: DType, out: DType, a: &Operand, b: &Operand) -> bool {
    let aligned = |o: &Operand| o.ptr.is_multiple_of(16) && o.ld.is_multiple_of(8) && o.stride.is_multiple_of(8);
    dev.ptx_arch() == "sm_90a"
        && matches!(input, DType::BF16 | DType::F16)
        && matches!(out, DType::F32 | DType::BF16 | DType::F16)
        && dev.max_shared_bytes() >= SMEM_BYTES
        && aligned(a)
        && aligned(b)
}

/// A 3-D tensor map of a stored operand: `inner` contiguous elements a row, `outer` rows
/// `ld` apart, `batch` matrices `stride` apart (1 when shared), read in boxes of `bx x by`,
/// 128-byte swizzled; out-of-range elements read as zeros.
fn tensor_map(
    op: &'static str,
    input: DType,
    ptr: u64,
    (inner, outer, batch): (u64, u64, u64),
    (ld, stride): (u64, u64),
    (bx, by): (u32, u32),
) -> Result<[u64; 16]> {
    // A shared operand is a batch of one; its (unused) batch stride still has to be valid.
    let stride = if stride == 0 { (ld * outer).max(8) } else { stride };
    tiled_map(op, input, ptr, &[inner, outer, batch], &[ld, stride], &[bx, by, 1])
}

/// A tensor map (`cuTensorMapEncodeTiled`) of 16-bit `input` values at `ptr`: `dims` innermost
/// first, the first contiguous, `strides` (in elements) between consecutive indices of the
/// others, read in boxes of `boxes` elements, 128-byte swizzled; out-of-range elements read as
/// zeros. The driver's errors (a stride not a multiple of 16 bytes, a box too large) come back
/// as [`Error`]s.
pub(crate) fn tiled_map(
    op: &'static str,
    input: DType,
    ptr: u64,
    dims: &[u64],
    strides: &[u64],
    boxes: &[u32],
) -> Result<[u64; 16]> {
    if dims.len() != boxes.len() || strides.len() + 1 != dims.len() || dims.len() > 5 {
        return Err(Error::InvalidArgument { op, message: format!("internal: a tensor map of rank {}", dims.len()) });
    }
    let dtype = match input {
        DType::BF16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        _ => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
    };
    let bytes: Vec<u64> = strides.iter().map(|s| s * 2).collect();
    let ones = [1u32; 5];
    let mut map = sys::CUtensorMap { opaque: [0; 16] };
    // SAFETY: `dims` and `boxes` have the rank's entries, `bytes` one fewer (checked); the map
    // is written, not read.
    unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut map,
            dtype,
            dims.len() as u32,
            ptr as *mut std::ffi::c_void,
            dims.as_ptr(),
            bytes.as_ptr(),
            boxes.as_ptr(),
            ones.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
        .result()
        .map_err(|e| driver(op, e))?;
    }
    Ok(map.opaque)
}

/// The tensor maps of one launch on the device: a slot of the device's cache
/// (`Device::cached_tensor_maps`), or a buffer of this call's own when the cache cannot take them.
pub(crate) struct Maps {
    ptr: u64,
    /// The buffer of this call, freed stream-ordered after the kernels that read it; `None`
    /// for a cached slot, which lives as long as the device.
    _own: Option<DeviceBuffer>,
}

impl Maps {
    /// The device address of the maps ([`MAP_WORDS`] words, 64-byte aligned).
    pub(crate) fn ptr(&self) -> u64 {
        self.ptr
    }
}

/// `maps` (at most four) in order in [`MAP_WORDS`] words on the device, for the kernels launched
/// after this on the calling thread's stream. A set of maps asked for a second time is written
/// into a slot of the device's cache, keyed by its words (never stale: a map is a pure function
/// of address, shape, strides, box, dtype and swizzle), so later calls launch nothing; the first
/// time, or when the cache cannot take them (full, or the stream capturing a graph), into a
/// buffer of this call's own.
///
/// Either way the words are written by a one-thread kernel whose parameter carries them
/// (`store_tensor_maps`), stream-ordered. Not a copy from host memory: a CUDA graph that records
/// the work keeps a kernel's parameters by value, but of a host-to-device copy only the host
/// address, of a vector freed when this returns.
pub(crate) fn upload_maps(op: &'static str, dev: &Device, maps: &[[u64; 16]]) -> Result<Maps> {
    if maps.len() * 16 > MAP_WORDS {
        return Err(Error::InvalidArgument {
            op,
            message: format!("internal: {} tensor maps in one buffer", maps.len()),
        });
    }
    let mut words = TensorMaps { words: [0; MAP_WORDS] };
    for (dst, map) in words.words.chunks_exact_mut(16).zip(maps) {
        dst.copy_from_slice(map);
    }
    let store = |dst: u64| {
        let cfg = LaunchConfig { grid: (1, 1, 1), block: (1, 1, 1), shared_bytes: 0 };
        let args: MapsArgs = (dst as *mut u64, words);
        // SAFETY: `dst` holds MAP_WORDS words, 64-byte aligned (a cache slot, or a buffer whose
        // allocation is aligned far beyond that), which nothing reads before this kernel ends.
        unsafe { dev.launch(store_tensor_maps, cfg, args) }
    };
    if let Some(ptr) = dev.cached_tensor_maps(op, &words.words, store)? {
        return Ok(Maps { ptr, _own: None });
    }
    let buf = dev.alloc(op, 8 * MAP_WORDS)?;
    store(buf.ptr())?;
    Ok(Maps { ptr: buf.ptr(), _own: Some(buf) })
}

/// How [`launch`] splits one product along K: slices of `chunk` elements (a multiple of 64),
/// slice `s`'s partial product into D's batch `s`; `paired`: the two blocks of a cluster take
/// the same tile and two slices (`PAIR_K`, for at most `BM` rows), so D has `2 * batch` batches.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Split {
    pub(crate) chunk: u64,
    pub(crate) paired: bool,
}

/// Runs `batch` products `op(A) @ op(B)` (`m x k` by `k x n`) through the epilogue `epi` (whose
/// `m`, `n` must be these) with the wgmma kernels; or, with `split`, one product (A and B not
/// batched) split along K as [`Split`] says. The caller checked [`supports`], the shapes against
/// the tensors, and `epi` against D.
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch(
    op: &'static str,
    dev: &Device,
    (input, out): (DType, DType),
    (batch, m, n, k): (u64, u64, u64, u64),
    a: &Operand,
    b: &Operand,
    epi: Epilogue,
    split: Option<Split>,
) -> Result<()> {
    let Some(kernel) = wgmma_kernel(a.trans, b.trans, input == DType::BF16, out) else {
        return Err(Error::InvalidArgument { op, message: format!("no wgmma kernel for {input:?} into {out:?}") });
    };
    let paired = split.is_some_and(|s| s.paired);
    if paired && m > BM as u64 {
        return Err(Error::InvalidArgument { op, message: format!("paired K slices of {m} > {BM} rows") });
    }
    // Tiles of a cluster: CLUSTER blocks of BM rows by BN columns (paired: one tile).
    let rows = if paired { BM } else { BM * CLUSTER } as u64;
    let tiles = m.div_ceil(rows) * n.div_ceil(BN as u64) * batch;
    if tiles == 0 {
        return Ok(());
    }
    if tiles > u32::MAX as u64 || m > i32::MAX as u64 || n > i32::MAX as u64 || k > i32::MAX as u64 {
        return Err(Error::InvalidArgument {
            op,
            message: format!("{batch} x {m} x {n} x {k} is beyond the kernel's range"),
        });
    }
    if split.is_some() && (a.stride != 0 || b.stride != 0) {
        return Err(Error::InvalidArgument { op, message: "split-K of a batched product".into() });
    }
    let bmul = |o: &Operand| if o.stride == 0 { 1 } else { batch };
    // A: K-major boxes of 64 K x 128 rows, or M-major boxes of 64 rows x 64 K (two a stage).
    let map_a = if a.trans {
        tensor_map(op, input, a.ptr, (m, k, bmul(a)), (a.ld, a.stride), (64, BK))?
    } else {
        tensor_map(op, input, a.ptr, (k, m, bmul(a)), (a.ld, a.stride), (BK, BM))?
    };
    // B: K-major (stored n x k, `trans`) boxes of 64 K x 128 columns (the half of a stage that
    // each block of a cluster loads for both), or N-major boxes of 64 columns x 64 K (four a
    // stage, two from each block).
    let map_b = if b.trans {
        tensor_map(op, input, b.ptr, (k, n, bmul(b)), (b.ld, b.stride), (BK, BN / 2))?
    } else {
        tensor_map(op, input, b.ptr, (n, k, bmul(b)), (b.ld, b.stride), (64, BK))?
    };
    let maps = upload_maps(op, dev, &[map_a, map_b])?;
    let flags = if a.stride != 0 { A_BATCHED } else { 0 }
        | if b.stride != 0 { B_BATCHED } else { 0 }
        | if split.is_some() { SPLIT_K } else { 0 }
        | if paired { PAIR_K } else { 0 };
    // Persistent: as many clusters as fit at once (66 on a 132-SM H100), or one per tile.
    let resident = dev.max_active_clusters(kernel.name(), CLUSTER, THREADS, SMEM_BYTES)?.max(1);
    let cfg = LaunchConfig {
        grid: ((tiles as u32).min(resident) * CLUSTER, 1, 1),
        block: (THREADS, 1, 1),
        shared_bytes: SMEM_BYTES,
    };
    let k_chunk = split.map_or(k, |s| s.chunk);
    if k_chunk > u32::MAX as u64 / (2 * batch).max(1) {
        return Err(Error::InvalidArgument {
            op,
            message: format!("{batch} K slices of {k_chunk}: beyond the kernel's range"),
        });
    }
    let args: WgmmaArgs = (maps.ptr() as *const u64, epi, k as u32, batch as u32, flags, k_chunk as u32);
    // SAFETY: the maps describe A and B as the caller checked them (the copy engine reads
    // nothing outside them); `epi` describes D; the buffer of maps lives until the kernel has
    // read it (a cache slot is never rewritten; a buffer of this call's own is freed
    // stream-ordered after the kernel).
    unsafe { dev.launch(kernel, cfg, args) }
}
