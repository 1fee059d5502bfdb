//! GPU tests of the memory statistics (`Device::memory_stats`, `reset_peak_memory_stats`,
//! `empty_cache`) and of out-of-memory: an allocation far beyond the card is an
//! `Error::OutOfMemory` that says what was asked for, allocated and cached, and the device works
//! after it.
//!
//! The counters are the device's, shared by every thread: each test holds `SERIAL` so that the
//! differences it checks are its own (the harness runs tests on several threads).

mod common;

use common::*;
use kernels::ops::{self, BinaryOp};
use kernels::{DType, Device, Error, MemoryStats, Tensor};
use std::process::ExitCode;
use std::sync::Mutex;

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// The invariants every snapshot keeps.
fn consistent(s: &MemoryStats, when: &str) -> Result<(), String> {
    let ok = s.reserved_bytes == s.allocated_bytes + s.cached_bytes
        && s.allocated_bytes >= s.requested_bytes
        && s.peak_allocated_bytes >= s.allocated_bytes
        && s.peak_requested_bytes >= s.requested_bytes
        && s.peak_reserved_bytes >= s.reserved_bytes
        && s.num_allocs >= s.num_frees;
    if ok { Ok(()) } else { Err(format!("{when}: inconsistent {s:?}")) }
}

fn check(cond: bool, what: impl FnOnce() -> String) -> Result<(), String> {
    if cond { Ok(()) } else { Err(what()) }
}

/// Allocations, frees, reuse from the cache, peaks and `empty_cache`, counted exactly.
fn accounting(dev: &Device) -> Result<(), String> {
    let _g = serial();
    dev.synchronize().map_err(e)?;
    dev.empty_cache().map_err(e)?;
    let s0 = dev.memory_stats();
    consistent(&s0, "start")?;
    check(s0.cached_bytes == 0, || format!("cache not empty after empty_cache: {s0:?}"))?;

    // 4000 bytes take a 4096-byte block, from the driver (the cache is empty).
    let t = Tensor::empty(dev, &[1000], DType::F32).map_err(e)?;
    let s1 = dev.memory_stats();
    consistent(&s1, "after one allocation")?;
    check(s1.allocated_bytes == s0.allocated_bytes + 4096, || format!("allocated {s0:?} -> {s1:?}"))?;
    check(s1.requested_bytes == s0.requested_bytes + 4000, || format!("requested {s0:?} -> {s1:?}"))?;
    check(s1.reserved_bytes == s0.reserved_bytes + 4096, || format!("reserved {s0:?} -> {s1:?}"))?;
    check(s1.num_allocs == s0.num_allocs + 1 && s1.num_frees == s0.num_frees, || format!("counts {s1:?}"))?;
    check(s1.num_device_allocs == s0.num_device_allocs + 1, || format!("driver allocations {s1:?}"))?;
    check(s1.peak_allocated_bytes >= s1.allocated_bytes, || format!("peak {s1:?}"))?;

    // Dropped, the block goes to the cache: still reserved, no longer allocated.
    drop(t);
    let s2 = dev.memory_stats();
    consistent(&s2, "after the free")?;
    check(s2.allocated_bytes == s0.allocated_bytes && s2.requested_bytes == s0.requested_bytes, || {
        format!("not freed: {s2:?}")
    })?;
    check(s2.cached_bytes == 4096 && s2.reserved_bytes == s1.reserved_bytes, || format!("not cached: {s2:?}"))?;
    check(s2.num_frees == s0.num_frees + 1, || format!("frees {s2:?}"))?;

    // 3900 bytes fit the same 4096-byte block: reused without the driver.
    let t = Tensor::empty(dev, &[975], DType::F32).map_err(e)?;
    let s3 = dev.memory_stats();
    consistent(&s3, "after reuse")?;
    check(s3.num_device_allocs == s1.num_device_allocs && s3.cached_bytes == 0, || format!("no reuse: {s3:?}"))?;
    check(s3.requested_bytes == s0.requested_bytes + 3900, || format!("requested on reuse {s3:?}"))?;
    drop(t);

    // A peak, then reset: the peak starts again from what is allocated now.
    let big = Tensor::empty(dev, &[3 << 20], DType::F16).map_err(e)?; // 6 MiB
    let s4 = dev.memory_stats();
    check(s4.peak_allocated_bytes >= s0.allocated_bytes + (6 << 20), || format!("peak below 6 MiB: {s4:?}"))?;
    drop(big);
    dev.reset_peak_memory_stats();
    let s5 = dev.memory_stats();
    consistent(&s5, "after reset")?;
    check(
        s5.peak_allocated_bytes == s5.allocated_bytes
            && s5.peak_requested_bytes == s5.requested_bytes
            && s5.peak_reserved_bytes == s5.reserved_bytes,
        || format!("reset_peak_memory_stats left {s5:?}"),
    )?;
    // An op's output is one more allocation; its peak is measured from the reset.
    let a = Tensor::from_f32(dev, &[1.0; 300], &[300], DType::F32).map_err(e)?;
    let b = ops::binary(&a, &a, BinaryOp::Add).map_err(e)?;
    let s6 = dev.memory_stats();
    consistent(&s6, "after an op")?;
    check(s6.allocated_bytes == s5.allocated_bytes + 2 * 1536, || format!("two 1536-byte blocks: {s5:?} -> {s6:?}"))?;
    check(s6.peak_allocated_bytes == s6.allocated_bytes, || format!("peak after reset {s6:?}"))?;
    check(b.to_f32_vec().map_err(e)? == vec![2.0; 300], || "1 + 1 != 2".into())?;
    drop((a, b));

    // empty_cache gives every free block back to the driver.
    let s7 = dev.memory_stats();
    let cached_blocks = s7.cached_bytes;
    dev.empty_cache().map_err(e)?;
    let s8 = dev.memory_stats();
    consistent(&s8, "after empty_cache")?;
    check(s8.cached_bytes == 0 && s8.reserved_bytes == s7.reserved_bytes - cached_blocks, || {
        format!("empty_cache: {s7:?} -> {s8:?}")
    })?;
    check(s8.num_device_frees > s7.num_device_frees, || format!("no driver frees: {s8:?}"))?;
    check(s8.allocated_bytes == s0.allocated_bytes, || format!("leak: {s0:?} -> {s8:?}"))?;

    let (free, total) = dev.mem_get_info().map_err(e)?;
    check(total > 0 && free <= total, || format!("mem_get_info: {free} free of {total}"))
}

/// Far more than the card has: an error with the request and the allocator's state, counted,
/// and the device goes on working (allocations and kernels).
fn out_of_memory(dev: &Device) -> Result<(), String> {
    let _g = serial();
    let (_, total) = dev.mem_get_info().map_err(e)?;
    // Something allocated and something cached, to see them in the error.
    let live = Tensor::from_f32(dev, &[3.0; 1000], &[1000], DType::F32).map_err(e)?;
    drop(Tensor::empty(dev, &[1 << 20], DType::F32).map_err(e)?);
    let before = dev.memory_stats();
    check(before.cached_bytes >= 4 << 20, || format!("nothing cached before: {before:?}"))?;

    let elems = total / 2; // f32: twice the card's memory
    let err = match Tensor::empty(dev, &[elems], DType::F32) {
        Ok(_) => return Err(format!("allocating {} bytes on a {total}-byte card succeeded", elems * 4)),
        Err(err) => err,
    };
    let Error::OutOfMemory { op, bytes, allocated, cached, device_free, device_total } = err.clone() else {
        return Err(format!("expected OutOfMemory, got {err:?}"));
    };
    check(op == "Tensor::empty" && bytes == elems * 4, || format!("op/bytes: {err:?}"))?;
    check(allocated == before.allocated_bytes, || format!("allocated {allocated}, stats {before:?}"))?;
    // The cache was emptied before the second try: nothing of it was left to give back.
    check(cached == 0, || format!("cached {cached} after the retry emptied the cache"))?;
    check(device_total == total && device_free <= total, || format!("device memory in {err:?}"))?;
    let msg = err.to_string();
    check(msg.contains("Tensor::empty: out of device memory") && msg.contains("MiB"), || msg.clone())?;

    let after = dev.memory_stats();
    consistent(&after, "after the failure")?;
    check(after.num_ooms == before.num_ooms + 1, || format!("num_ooms {before:?} -> {after:?}"))?;
    check(after.num_alloc_retries == before.num_alloc_retries + 1, || format!("retries {after:?}"))?;
    check(after.num_allocs == before.num_allocs, || format!("a failed allocation counted: {after:?}"))?;
    check(after.allocated_bytes == before.allocated_bytes && after.cached_bytes == 0, || format!("{after:?}"))?;

    // Usable: a large allocation, a kernel, and the tensor from before intact.
    let big = Tensor::zeros(dev, &[256 << 20], DType::F32).map_err(e)?; // 1 GiB
    let sum = ops::binary(&live, &live, BinaryOp::Add).map_err(e)?;
    check(sum.to_f32_vec().map_err(e)? == vec![6.0; 1000], || "3 + 3 != 6 after the out-of-memory".into())?;
    let ones = Tensor::from_f32(dev, &[1.0; 7], &[7], DType::F32).map_err(e)?;
    drop(big);
    check(ones.to_f32_vec().map_err(e)? == vec![1.0; 7], || "copy after out-of-memory".into())?;
    dev.synchronize().map_err(e)
}

fn main() -> ExitCode {
    run(vec![test("memory/accounting", accounting), test("memory/out_of_memory", out_of_memory)])
}
