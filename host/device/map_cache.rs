//! The per-device cache of TMA tensor maps on the device: the Hopper GEMM and attention read
//! their operands through tensor maps in global memory, and a training step launches the same
//! products on the same buffers every time, so each distinct set of maps is written once into a
//! slot of a device-resident pool and reused.
//!
//! Keyed by the maps' words ([`MAP_WORDS`], the whole buffer the kernels read), which are a pure
//! function of (address, dims, strides, box, dtype, swizzle): an entry is never stale, even when
//! the buffer it describes was freed and another one allocated at the same address and shape.
//!
//! Invariants:
//! - A slot is written once, before its entry is inserted, and never again: no eviction, since
//!   a captured CUDA graph may hold a slot's address and read it on every replay. When the cache
//!   is full the caller writes a buffer of its own per call (the path before the cache).
//! - An entry is inserted only after the write is complete on the device (the stream that wrote
//!   it was synchronised), so a hit needs no ordering with any stream: work on a foreign stream
//!   (`Device::with_stream`), another thread's, or a graph replayed later reads finished words.
//! - A set of maps is cached the second time it is asked for: the first call writes a buffer of
//!   its own (no synchronisation), so that maps seen once (attention decoding with a KV cache,
//!   whose key length grows each call; products of one-off shapes) cost no stall and no slot,
//!   while a training step's products are cached from their second step on.
//! - Nothing is written while this thread's stream captures a graph (a write captured into the
//!   graph would run only on replay, and a synchronisation is not allowed then): a miss then is
//!   not cached, and the caller's own buffer is captured as before. Hits are fine under capture.

use super::*;
use crate::error::{Result, driver};
use cudarc::driver::result;
use kernels_gpu::gemm_wgmma::MAP_WORDS;
use std::collections::HashSet;
use std::hash::{Hash, Hasher};

/// The most entries a device caches (a slot of 512 bytes each: 2 MiB of device memory and as
/// much of host memory at most); enough for every GEMM and attention call of a model's step.
pub(crate) const MAP_CACHE_SLOTS: usize = 4096;
/// Slots allocated from the driver at once.
const CHUNK_SLOTS: usize = 64;
/// Bytes of a slot: a multiple of 64, the alignment of a tensor map.
const SLOT_BYTES: usize = 8 * MAP_WORDS;

/// The cache's state (in `Inner::map_cache`, behind a mutex).
#[derive(Default)]
pub(super) struct MapCache {
    /// Slot address by the words it holds.
    slots: HashMap<[u64; MAP_WORDS], u64>,
    /// Device addresses of the chunks of `CHUNK_SLOTS` slots (`cuMemAlloc`), freed when the
    /// device is dropped.
    pub(super) chunks: Vec<u64>,
    /// Slots handed out, in chunk order.
    used: usize,
    /// Hashes of the sets of maps asked for once and not cached yet; cleared when it holds
    /// [`MAP_CACHE_SLOTS`] (a collision only caches a set early).
    seen: HashSet<u64>,
    stats: TensorMapCacheStats,
}

/// Counters of a device's tensor map cache ([`Device::tensor_map_cache_stats`]), for tests and
/// profiling.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TensorMapCacheStats {
    /// Calls served from a slot, without a launch.
    pub hits: u64,
    /// Calls that wrote a new slot (a `store_tensor_maps` launch and a synchronisation).
    pub misses: u64,
    /// Calls not cached: the set of maps was new (cached the next time), the stream was
    /// capturing a graph, or the cache was full.
    pub bypassed: u64,
    /// Of `bypassed`, the calls whose set of maps was new.
    pub first_seen: u64,
    /// Slots in use.
    pub entries: usize,
}

impl Device {
    /// The device address of a slot holding `words`, 64-byte aligned, written once and never
    /// again, from the second call with the same `words` on. On a miss `store(dst)` is called to write `words` to the [`MAP_WORDS`] words at
    /// `dst`, stream-ordered on this thread's stream, and the stream is synchronised before the
    /// slot is remembered (module notes). `None`: not cached (a capturing stream, or the cache
    /// is full, or `words` asked for the first time); the caller writes the words into a buffer
    /// of its own.
    pub(crate) fn cached_tensor_maps(
        &self,
        op: &'static str,
        words: &[u64; MAP_WORDS],
        store: impl FnOnce(u64) -> Result<()>,
    ) -> Result<Option<u64>> {
        // Held across the write and the synchronisation: another thread's call on this device
        // waits rather than seeing a slot not yet written.
        let mut c = self.0.map_cache.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(&dst) = c.slots.get(words) {
            c.stats.hits += 1;
            return Ok(Some(dst));
        }
        if c.used == MAP_CACHE_SLOTS || self.is_capturing()? {
            c.stats.bypassed += 1;
            return Ok(None);
        }
        let hash = {
            let mut h = std::hash::DefaultHasher::new();
            words.hash(&mut h);
            h.finish()
        };
        if !c.seen.remove(&hash) {
            if c.seen.len() >= MAP_CACHE_SLOTS {
                c.seen.clear();
            }
            c.seen.insert(hash);
            c.stats.bypassed += 1;
            c.stats.first_seen += 1;
            return Ok(None);
        }
        if c.used == c.chunks.len() * CHUNK_SLOTS {
            self.bind()?;
            // SAFETY: the device's context is bound; the chunk is freed only when the device is
            // dropped (`Inner`'s drop), after its stream has finished.
            let p = unsafe { result::malloc_sync(CHUNK_SLOTS * SLOT_BYTES) }.map_err(|e| driver(op, e))?;
            c.chunks.push(p);
        }
        let dst = c.chunks[c.used / CHUNK_SLOTS] + ((c.used % CHUNK_SLOTS) * SLOT_BYTES) as u64;
        store(dst)?;
        // The slot is final once this returns: any stream, graph or thread may read it.
        self.synchronize()?;
        c.used += 1;
        c.stats.misses += 1;
        c.slots.insert(*words, dst);
        Ok(Some(dst))
    }

    /// The counters of this device's tensor map cache (module notes of `map_cache`).
    #[doc(hidden)]
    pub fn tensor_map_cache_stats(&self) -> TensorMapCacheStats {
        let c = self.0.map_cache.lock().unwrap_or_else(|p| p.into_inner());
        TensorMapCacheStats { entries: c.used, ..c.stats }
    }
}
