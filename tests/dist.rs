//! GPU tests of the NCCL collectives (`kernels::dist`) on every GPU of the machine, in one
//! process (`Communicator::new_group`) and in one process per GPU (`Communicator::from_id`, the
//! binary starting itself once per rank): every collective, every dtype, odd element counts,
//! against the result computed on the host, on every rank.
//!
//! Needs NCCL (`KERNELS_NCCL_LIB` or `libnccl.so.2` on the loader's path), and 2 GPUs or more
//! for most tests: with fewer, those are reported as ignored (skipped), with the reason; the
//! overlap tests (`all_reduce_start`, `BucketedAllReduce`, data-parallel training against one
//! GPU) run on any number, a world of one included. With no GPU and `KERNELS_REQUIRE_GPU=1`,
//! every test fails. NVLink multicast stays off (`NCCL_NVLS_ENABLE=0`,
//! set here for this process and the ones it starts).
//!
//! Inputs: sums, means and products use small integers, which every dtype holds exactly and
//! whose sums NCCL's order of reduction cannot change, so the comparison is exact where the
//! world is a power of two (a mean over 3 ranks rounds once more: one ulp of the result then);
//! max and min use any finite values.

mod common;

use common::{Draw, TestRng, draw, round_to};
use kernels::dist::{self, CommGroup, Communicator, ReduceOp, UniqueId};
use kernels::ops::{self, BinaryOp};
use kernels::{DType, Device, Error, Tensor};
use libtest_mimic::{Arguments, Failed, Trial};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Element counts: one, small odd ones, and odd ones above NCCL's chunk sizes.
const COUNTS: [usize; 5] = [1, 7, 1001, 65_537, (1 << 20) + 3];

struct Ctx {
    devs: Vec<Device>,
    comms: CommGroup,
}

type TestFn = Box<dyn FnOnce(&Ctx) -> Result<(), String> + Send>;

/// Whether an error is the expected one.
type ErrorTest<'a> = &'a dyn Fn(&Error) -> bool;

fn e<E: std::fmt::Display>(err: E) -> String {
    err.to_string()
}

/// Per rank, `n` values of `dt`: small integers (exact sums) or any finite values.
fn values(dt: DType, n: usize, rank: usize, seed: u64, small_ints: bool) -> Vec<f32> {
    let mut rng = TestRng::new(seed * 1000 + rank as u64);
    if small_ints { (0..n).map(|_| rng.below(33) as f32 - 16.0).collect() } else { draw(&mut rng, n, dt, Draw::FINITE) }
}

fn inputs(ctx: &Ctx, dt: DType, n: usize, seed: u64, small_ints: bool) -> Result<(Vec<Vec<f32>>, Vec<Tensor>), String> {
    let vals: Vec<Vec<f32>> = (0..ctx.devs.len()).map(|r| values(dt, n, r, seed, small_ints)).collect();
    let ts = ctx
        .devs
        .iter()
        .zip(&vals)
        .map(|(d, v)| Tensor::from_f32(d, v, &[n], dt).map_err(e))
        .collect::<Result<_, _>>()?;
    Ok((vals, ts))
}

fn reduce_ref(dt: DType, vals: &[Vec<f32>], op: ReduceOp) -> Vec<f32> {
    let w = vals.len();
    (0..vals[0].len())
        .map(|i| {
            let xs = vals.iter().map(|v| v[i] as f64);
            let r = match op {
                ReduceOp::Sum => xs.sum::<f64>(),
                ReduceOp::Mean => xs.sum::<f64>() / w as f64,
                ReduceOp::Max => xs.fold(f64::NEG_INFINITY, f64::max),
                ReduceOp::Min => xs.fold(f64::INFINITY, f64::min),
                ReduceOp::Prod => xs.product::<f64>(),
            };
            round_to(dt, r as f32)
        })
        .collect()
}

/// One ulp of `dt` at `x`.
fn ulp(dt: DType, x: f32) -> f32 {
    let bits = match dt {
        DType::F32 => 23,
        DType::F16 => 10,
        DType::BF16 => 7,
    };
    let e = x.abs().max(f32::MIN_POSITIVE).log2().floor();
    (e - bits as f32).exp2()
}

fn compare(what: &str, dt: DType, got: &[f32], want: &[f32], one_ulp: bool) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!("{what}: {} elements, expected {}", got.len(), want.len()));
    }
    let bad: Vec<usize> = (0..got.len())
        .filter(|&i| {
            let ok = if one_ulp { (got[i] - want[i]).abs() <= ulp(dt, want[i]) } else { got[i] == want[i] };
            !ok
        })
        .collect();
    match bad.first() {
        None => Ok(()),
        Some(&i) => {
            Err(format!("{what}: {} of {} wrong, first [{i}] = {} expected {}", bad.len(), got.len(), got[i], want[i]))
        }
    }
}

fn all_reduce(ctx: &Ctx, dt: DType, op: ReduceOp) -> Result<(), String> {
    let w = ctx.devs.len();
    let one_ulp = op == ReduceOp::Mean && !w.is_power_of_two();
    for (k, &n) in COUNTS.iter().enumerate() {
        let small_ints = matches!(op, ReduceOp::Sum | ReduceOp::Mean);
        let (mut vals, mut xs) = inputs(ctx, dt, n, 10 + k as u64, small_ints)?;
        if op == ReduceOp::Prod {
            // Factors of magnitude 1 and 2: exact products whatever the world.
            for (v, x) in vals.iter_mut().zip(&mut xs) {
                v.iter_mut().for_each(|a| *a = [-2.0, -1.0, 1.0, 2.0][(a.abs() as usize) % 4]);
                *x = Tensor::from_f32(x.device(), v, &[n], dt).map_err(e)?;
            }
        }
        let want = reduce_ref(dt, &vals, op);
        // Out of place: the inputs stay.
        let outs =
            dist::group(|| ctx.comms.iter().zip(&xs).map(|(c, x)| c.all_reduce(x, op)).collect::<Result<Vec<_>, _>>())
                .map_err(e)?;
        for (r, (out, x)) in outs.iter().zip(&xs).enumerate() {
            compare(&format!("all_reduce n={n} rank {r}"), dt, &out.to_f32_vec().map_err(e)?, &want, one_ulp)?;
            compare(&format!("all_reduce input n={n} rank {r}"), dt, &x.to_f32_vec().map_err(e)?, &vals[r], false)?;
        }
        // In place.
        dist::group(|| ctx.comms.iter().zip(&mut xs).try_for_each(|(c, x)| c.all_reduce_(x, op))).map_err(e)?;
        for (r, x) in xs.iter().enumerate() {
            compare(&format!("all_reduce_ n={n} rank {r}"), dt, &x.to_f32_vec().map_err(e)?, &want, one_ulp)?;
        }
    }
    Ok(())
}

fn all_gather(ctx: &Ctx, dt: DType) -> Result<(), String> {
    let w = ctx.devs.len();
    for (k, &n) in COUNTS.iter().enumerate() {
        let (vals, xs) = inputs(ctx, dt, n, 20 + k as u64, false)?;
        let want: Vec<f32> = vals.concat();
        let outs =
            dist::group(|| ctx.comms.iter().zip(&xs).map(|(c, x)| c.all_gather(x)).collect::<Result<Vec<_>, _>>())
                .map_err(e)?;
        for (r, out) in outs.iter().enumerate() {
            if out.shape() != [w * n] {
                return Err(format!("all_gather shape {:?}, expected [{}]", out.shape(), w * n));
            }
            compare(&format!("all_gather n={n} rank {r}"), dt, &out.to_f32_vec().map_err(e)?, &want, false)?;
        }
    }
    // A 2-d tensor gathers along its first dimension.
    let (vals, xs) = inputs(ctx, dt, 3 * 5, 29, false)?;
    let xs = xs.into_iter().map(|x| x.reshape(&[3, 5]).map_err(e)).collect::<Result<Vec<_>, _>>()?;
    let outs = dist::group(|| ctx.comms.iter().zip(&xs).map(|(c, x)| c.all_gather(x)).collect::<Result<Vec<_>, _>>())
        .map_err(e)?;
    for out in &outs {
        if out.shape() != [3 * w, 5] {
            return Err(format!("all_gather of [3, 5]: shape {:?}", out.shape()));
        }
        compare("all_gather [3, 5]", dt, &out.to_f32_vec().map_err(e)?, &vals.concat(), false)?;
    }
    Ok(())
}

fn reduce_scatter(ctx: &Ctx, dt: DType, op: ReduceOp) -> Result<(), String> {
    let w = ctx.devs.len();
    for (k, &n) in COUNTS.iter().enumerate() {
        let (vals, xs) = inputs(ctx, dt, w * n, 30 + k as u64, true)?;
        let full = reduce_ref(dt, &vals, op);
        let outs = dist::group(|| {
            ctx.comms.iter().zip(&xs).map(|(c, x)| c.reduce_scatter(x, op)).collect::<Result<Vec<_>, _>>()
        })
        .map_err(e)?;
        for (r, out) in outs.iter().enumerate() {
            let want = &full[r * n..(r + 1) * n];
            compare(&format!("reduce_scatter n={n} rank {r}"), dt, &out.to_f32_vec().map_err(e)?, want, false)?;
        }
    }
    Ok(())
}

fn broadcast(ctx: &Ctx, dt: DType) -> Result<(), String> {
    let root = ctx.devs.len() - 1;
    for (k, &n) in COUNTS.iter().enumerate() {
        let (vals, mut xs) = inputs(ctx, dt, n, 40 + k as u64, false)?;
        let outs =
            dist::group(|| ctx.comms.iter().zip(&xs).map(|(c, x)| c.broadcast(x, root)).collect::<Result<Vec<_>, _>>())
                .map_err(e)?;
        for (r, out) in outs.iter().enumerate() {
            compare(&format!("broadcast n={n} rank {r}"), dt, &out.to_f32_vec().map_err(e)?, &vals[root], false)?;
        }
        dist::group(|| ctx.comms.iter().zip(&mut xs).try_for_each(|(c, x)| c.broadcast_(x, 0))).map_err(e)?;
        for (r, x) in xs.iter().enumerate() {
            compare(&format!("broadcast_ n={n} rank {r}"), dt, &x.to_f32_vec().map_err(e)?, &vals[0], false)?;
        }
    }
    Ok(())
}

/// A ring: every rank sends to the next and receives from the previous.
fn send_recv(ctx: &Ctx, dt: DType) -> Result<(), String> {
    let w = ctx.devs.len();
    for (k, &n) in COUNTS.iter().enumerate() {
        let (vals, xs) = inputs(ctx, dt, n, 50 + k as u64, false)?;
        let mut outs = ctx.devs.iter().map(|d| Tensor::zeros(d, &[n], dt).map_err(e)).collect::<Result<Vec<_>, _>>()?;
        dist::group(|| {
            for (r, c) in ctx.comms.iter().enumerate() {
                c.send(&xs[r], (r + 1) % w)?;
            }
            for (r, (c, out)) in ctx.comms.iter().zip(&mut outs).enumerate() {
                c.recv(out, (r + w - 1) % w)?;
            }
            Ok(())
        })
        .map_err(e)?;
        for (r, out) in outs.iter().enumerate() {
            compare(&format!("recv n={n} rank {r}"), dt, &out.to_f32_vec().map_err(e)?, &vals[(r + w - 1) % w], false)?;
        }
    }
    Ok(())
}

/// Kernels before and after a collective, with no host synchronisation between: the stream
/// orders them.
fn ordered_with_kernels(ctx: &Ctx) -> Result<(), String> {
    let w = ctx.devs.len() as f32;
    let n = (1 << 22) + 1;
    let xs =
        ctx.devs.iter().map(|d| Tensor::full(d, &[n], DType::F32, 1.5).map_err(e)).collect::<Result<Vec<_>, _>>()?;
    // 2x, summed over ranks, doubled again: 6 * world, where any reordering gives less.
    let mut twice = xs.iter().map(|x| ops::binary(x, x, BinaryOp::Add).map_err(e)).collect::<Result<Vec<_>, _>>()?;
    dist::group(|| ctx.comms.iter().zip(&mut twice).try_for_each(|(c, x)| c.all_reduce_(x, ReduceOp::Sum)))
        .map_err(e)?;
    let fours = twice.iter().map(|x| ops::binary(x, x, BinaryOp::Add).map_err(e)).collect::<Result<Vec<_>, _>>()?;
    for (r, y) in fours.iter().enumerate() {
        compare(&format!("ordering rank {r}"), DType::F32, &y.to_f32_vec().map_err(e)?, &vec![6.0 * w; n], false)?;
    }
    Ok(())
}

/// The local checks: errors before anything is enqueued, and the group goes on.
fn local_checks(ctx: &Ctx) -> Result<(), String> {
    let (c0, d0, d1) = (&ctx.comms[0], &ctx.devs[0], &ctx.devs[1]);
    let w = ctx.devs.len();
    let x = Tensor::zeros(d0, &[6], DType::F32).map_err(e)?;
    let expect = |r: Result<(), Error>, what: &str, ok: &dyn Fn(&Error) -> bool| match r {
        Err(err) if ok(&err) => Ok(()),
        other => Err(format!("{what}: {other:?}")),
    };
    let mut half = Tensor::zeros(d0, &[6], DType::F16).map_err(e)?;
    expect(c0.all_reduce_out(&x, &mut half, ReduceOp::Sum), "dtype", &|e| matches!(e, Error::DTypeMismatch { .. }))?;
    let mut short = Tensor::zeros(d0, &[5], DType::F32).map_err(e)?;
    expect(c0.all_reduce_out(&x, &mut short, ReduceOp::Sum), "shape", &|e| matches!(e, Error::ShapeMismatch { .. }))?;
    let odd = Tensor::zeros(d0, &[w * 3 + 1], DType::F32).map_err(e)?;
    expect(c0.reduce_scatter(&odd, ReduceOp::Sum).map(drop), "scatter", &|e| matches!(e, Error::ShapeMismatch { .. }))?;
    let mut gathered = Tensor::zeros(d0, &[6], DType::F32).map_err(e)?;
    expect(c0.all_gather_out(&x, &mut gathered), "gather out", &|e| matches!(e, Error::ShapeMismatch { .. }))?;
    let elsewhere = Tensor::zeros(d1, &[6], DType::F32).map_err(e)?;
    expect(c0.all_reduce(&elsewhere, ReduceOp::Max).map(drop), "device", &|e| {
        matches!(e, Error::DeviceMismatch { .. })
    })?;
    expect(c0.broadcast(&x, w).map(drop), "root", &|e| matches!(e, Error::InvalidArgument { .. }))?;
    expect(c0.send(&x, 0), "send to self", &|e| matches!(e, Error::InvalidArgument { .. }))?;
    expect(c0.send(&x, w), "peer", &|e| matches!(e, Error::InvalidArgument { .. }))?;
    expect(Communicator::new_group(&[d0.clone(), d0.clone()]).map(drop), "same device twice", &|e| {
        matches!(e, Error::InvalidArgument { .. })
    })?;
    let id = UniqueId::new().map_err(e)?;
    expect(Communicator::from_id(d0, &id, 2, 2).map(drop), "rank >= world", &|e| {
        matches!(e, Error::InvalidArgument { .. })
    })?;

    // A tensor written twice in one group: the second is refused, the first still runs (every
    // rank issued exactly one all-reduce, so nothing waits).
    let mut xs =
        ctx.devs.iter().map(|d| Tensor::full(d, &[9], DType::F32, 1.0).map_err(e)).collect::<Result<Vec<_>, _>>()?;
    let second = dist::group(|| {
        ctx.comms.iter().zip(&mut xs).try_for_each(|(c, x)| c.all_reduce_(x, ReduceOp::Sum))?;
        Ok(ctx.comms[0].all_reduce_(&mut xs[0], ReduceOp::Sum))
    })
    .map_err(e)?;
    expect(second, "written twice in a group", &|e| matches!(e, Error::InvalidArgument { .. }))?;
    for x in &xs {
        compare("after the refused write", DType::F32, &x.to_f32_vec().map_err(e)?, &[w as f32; 9], false)?;
    }
    for c in ctx.comms.iter() {
        c.async_error().map_err(e)?;
    }
    Ok(())
}

/// The cross-rank check (`set_cross_rank_checks`), one thread per rank: ranks that disagree
/// (shape, dtype, collective, root) or one whose own check fails all get an error and none
/// waits; afterwards the communicators still work. A hang fails the test after 60 s.
fn cross_rank_checks(ctx: &Ctx) -> Result<(), String> {
    let w = ctx.devs.len();
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watch = done.clone();
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(60));
        if !watch.load(std::sync::atomic::Ordering::SeqCst) {
            eprintln!("dist/cross_rank_checks: still waiting after 60 s (a hang): exiting");
            std::process::exit(1);
        }
    });
    for c in ctx.comms.iter() {
        c.set_cross_rank_checks(true);
    }
    let collective = |err: &Error| matches!(err, Error::Collective { .. });
    // Every rank's outcome of `f(rank, comm)`, run one thread per rank.
    let outcome = |what: &str, f: &(dyn Fn(usize, &Communicator) -> Result<(), Error> + Sync)| {
        let r = per_rank(ctx, |r, c| Ok(f(r, c)));
        r.map_err(|m| format!("{what}: {m}"))
    };
    let all_fail = |what: &str, rs: Vec<Result<(), Error>>, own: Option<(usize, ErrorTest)>| {
        for (r, res) in rs.into_iter().enumerate() {
            let ok = match (&res, own) {
                (Err(err), Some((bad, is_own))) if r == bad => is_own(err),
                (Err(err), _) => collective(err),
                (Ok(()), _) => false,
            };
            if !ok {
                return Err(format!("{what}: rank {r}: {res:?}"));
            }
        }
        Ok(())
    };
    let run = || -> Result<(), String> {
        let n = 1001;
        // Agreeing ranks: the result is the sum.
        let rs = outcome("agree", &|r, c| {
            let mut x = Tensor::full(&ctx.devs[r], &[n], DType::F32, 1.0)?;
            c.all_reduce_(&mut x, ReduceOp::Sum)?;
            let v = x.to_f32_vec()?;
            if v.iter().any(|&y| y != w as f32) {
                return Err(Error::InvalidArgument { op: "test", message: format!("sum {:?}", &v[..3]) });
            }
            Ok(())
        })?;
        if let Some((r, err)) = rs.iter().enumerate().find_map(|(r, x)| x.as_ref().err().map(|e| (r, e))) {
            return Err(format!("agreeing ranks: rank {r}: {err}"));
        }
        // Rank 0 reduces one element more.
        let rs = outcome("count", &|r, c| {
            let mut x = Tensor::zeros(&ctx.devs[r], &[n + usize::from(r == 0)], DType::F32)?;
            c.all_reduce_(&mut x, ReduceOp::Sum)
        })?;
        all_fail("count", rs, None)?;
        // Rank 0 in bf16.
        let rs = outcome("dtype", &|r, c| {
            let dt = if r == 0 { DType::BF16 } else { DType::F32 };
            let mut x = Tensor::zeros(&ctx.devs[r], &[n], dt)?;
            c.all_reduce_(&mut x, ReduceOp::Max)
        })?;
        all_fail("dtype", rs, None)?;
        // Rank 0 all-gathers while the others all-reduce.
        let rs = outcome("collective", &|r, c| {
            let mut x = Tensor::zeros(&ctx.devs[r], &[n], DType::F32)?;
            if r == 0 { c.all_gather(&x).map(drop) } else { c.all_reduce_(&mut x, ReduceOp::Sum) }
        })?;
        all_fail("collective", rs, None)?;
        // Different roots.
        let rs = outcome("root", &|r, c| {
            let x = Tensor::zeros(&ctx.devs[r], &[n], DType::F16)?;
            c.broadcast(&x, usize::from(r == 0)).map(drop)
        })?;
        all_fail("root", rs, None)?;
        // The last rank's own check fails (an output of the wrong shape): it gets that error,
        // the others learn of it.
        let last = w - 1;
        let rs = outcome("own check", &|r, c| {
            let x = Tensor::zeros(&ctx.devs[r], &[n], DType::F32)?;
            let mut out = Tensor::zeros(&ctx.devs[r], &[n - usize::from(r == last)], DType::F32)?;
            c.all_reduce_out(&x, &mut out, ReduceOp::Sum)
        })?;
        all_fail("own check", rs, Some((last, &|e| matches!(e, Error::ShapeMismatch { .. }))))?;
        // Its reduce-scatter input cannot be split: refused before the output is allocated.
        let rs = outcome("scatter", &|r, c| {
            let x = Tensor::zeros(&ctx.devs[r], &[w * 4 + usize::from(r == last)], DType::F32)?;
            c.reduce_scatter(&x, ReduceOp::Sum).map(drop)
        })?;
        all_fail("scatter", rs, Some((last, &|e| matches!(e, Error::ShapeMismatch { .. }))))?;
        // A tensor on another rank's device.
        let rs = outcome("device", &|r, c| {
            let d = if r == last { &ctx.devs[0] } else { &ctx.devs[r] };
            let x = Tensor::zeros(d, &[n], DType::F32)?;
            c.all_reduce(&x, ReduceOp::Sum).map(drop)
        })?;
        all_fail("device", rs, Some((last, &|e| matches!(e, Error::DeviceMismatch { .. }))))?;
        // And the communicators still work.
        let rs = outcome("after", &|r, c| {
            let mut x = Tensor::full(&ctx.devs[r], &[7], DType::BF16, 2.0)?;
            c.all_reduce_(&mut x, ReduceOp::Sum)?;
            let v = x.to_f32_vec()?;
            if v.iter().any(|&y| y != 2.0 * w as f32) {
                return Err(Error::InvalidArgument { op: "test", message: format!("sum {v:?}") });
            }
            c.async_error()
        })?;
        if let Some((r, err)) = rs.iter().enumerate().find_map(|(r, x)| x.as_ref().err().map(|e| (r, e))) {
            return Err(format!("after the errors: rank {r}: {err}"));
        }
        Ok(())
    };
    let result = run();
    for c in ctx.comms.iter() {
        c.set_cross_rank_checks(false);
    }
    done.store(true, std::sync::atomic::Ordering::SeqCst);
    result
}

// --- overlap: all_reduce_start and BucketedAllReduce ---------------------------------------------

/// Runs `f(rank, communicator)` on one thread per rank, as data-parallel training does.
fn per_rank<T: Send>(
    ctx: &Ctx,
    f: impl Fn(usize, &Communicator) -> Result<T, String> + Sync,
) -> Result<Vec<T>, String> {
    std::thread::scope(|s| {
        let f = &f;
        let handles: Vec<_> = ctx.comms.iter().enumerate().map(|(r, c)| s.spawn(move || f(r, c))).collect();
        handles.into_iter().map(|h| h.join().map_err(|_| "a rank's thread panicked".to_string())?).collect()
    })
}

/// Tensors of every dtype and odd sizes pushed as kernels produce them, in buckets small enough
/// that several reductions start before the last kernel: each comes back reduced, in order,
/// and a kernel issued after `finish` reads the reduced values.
fn bucketed_all_reduce(ctx: &Ctx) -> Result<(), String> {
    let sizes = [7usize, 1001, 65_537, 3, (1 << 20) + 3, 1];
    let dtype = |i: usize| DType::ALL[i % DType::ALL.len()];
    // Rank r's values: small integers, doubled by a kernel before the push; sums over up to 8
    // ranks of |v| <= 8, doubled again, stay within 256, exact in every dtype.
    let vals = |r: usize, i: usize| -> Vec<f32> {
        values(dtype(i), sizes[i], r, 70 + i as u64, true).iter().map(|v| (v / 4.0).trunc()).collect()
    };
    let results = per_rank(ctx, |r, c| {
        let dev = c.device();
        let mut reducer = dist::BucketedAllReduce::new(c, ReduceOp::Sum, 8 << 10);
        for (i, &n) in sizes.iter().enumerate() {
            let x = Tensor::from_f32(dev, &vals(r, i), &[n], dtype(i)).map_err(e)?;
            reducer.push(ops::binary(&x, &x, BinaryOp::Add).map_err(e)?).map_err(e)?;
        }
        let started = reducer.buckets_started();
        let reduced = reducer.finish().map_err(e)?;
        let doubled =
            reduced.iter().map(|g| ops::binary(g, g, BinaryOp::Add).map_err(e)).collect::<Result<Vec<_>, _>>()?;
        let host = doubled.iter().map(|t| t.to_f32_vec().map_err(e)).collect::<Result<Vec<_>, _>>()?;
        Ok((started, reduced.iter().map(|t| (t.shape().to_vec(), t.dtype())).collect::<Vec<_>>(), host))
    })?;
    for (r, (started, meta, host)) in results.iter().enumerate() {
        if *started < 2 {
            return Err(format!("rank {r}: {started} buckets started before finish, expected several"));
        }
        for (i, &n) in sizes.iter().enumerate() {
            if meta[i] != (vec![n], dtype(i)) {
                return Err(format!("rank {r}: tensor {i} came back as {:?}", meta[i]));
            }
            let all: Vec<Vec<f32>> = (0..ctx.devs.len()).map(|q| vals(q, i)).collect();
            let want: Vec<f32> = reduce_ref(dtype(i), &all, ReduceOp::Sum).iter().map(|v| 4.0 * v).collect();
            compare(
                &format!("bucketed rank {r} tensor {i} ({:?}, n={n})", dtype(i)),
                dtype(i),
                &host[i],
                &want,
                false,
            )?;
        }
    }
    // Refused inside a group, and for a tensor of another device; the communicator goes on.
    let c0 = &ctx.comms[0];
    let x = Tensor::zeros(&ctx.devs[0], &[5], DType::F32).map_err(e)?;
    let in_group = dist::group(|| Ok(c0.all_reduce_start(vec![x.try_clone()?], ReduceOp::Sum).map(drop))).map_err(e)?;
    if !matches!(in_group, Err(Error::InvalidArgument { .. })) {
        return Err(format!("all_reduce_start inside a group: {in_group:?}"));
    }
    if let Some(d1) = ctx.devs.get(1) {
        let other = Tensor::zeros(d1, &[5], DType::F32).map_err(e)?;
        let r = c0.all_reduce_start(vec![other], ReduceOp::Sum).map(drop);
        if !matches!(r, Err(Error::DeviceMismatch { .. })) {
            return Err(format!("a tensor of cuda:1 on rank 0: {r:?}"));
        }
    }
    per_rank(ctx, |_, c| {
        let t = Tensor::full(c.device(), &[3], DType::F32, 1.0).map_err(e)?;
        let p = c.all_reduce_start(vec![t], ReduceOp::Sum).map_err(e)?;
        let back = p.wait().map_err(e)?;
        let got = back[0].to_f32_vec().map_err(e)?;
        let w = ctx.devs.len() as f32;
        if got == vec![w; 3] { Ok(()) } else { Err(format!("after the refusals: {got:?}, expected {w}")) }
    })?;
    Ok(())
}

/// Data-parallel training's invariant: a two-layer MLP trained on `world` GPUs with `1/world`
/// of the batch each, its gradients averaged by `BucketedAllReduce`, computes the gradients and
/// losses of the same model trained on one GPU with the whole batch, to f32 rounding. Bounds:
/// each gradient element is a sum over the 1536 rows, computed in two orders, each within about
/// `sqrt(K) u` = 2.3e-6 of the sum of magnitudes for random signs: 1e-4 of the largest element
/// leaves room for cancellation; the losses (means of 1536 terms) within a relative 1e-5 at
/// step 0, 1e-4 over the next two AdamW steps (see examples/mlp.rs on why later steps are
/// compared by their loss).
fn data_parallel_matches_one_gpu(ctx: &Ctx) -> Result<(), String> {
    const ROWS: usize = 1536;
    const D: usize = 48;
    const H: usize = 96;
    const C: usize = 10;
    const STEPS: usize = 3;
    let w = ctx.devs.len();
    if !ROWS.is_multiple_of(w) {
        return Err(format!("{ROWS} rows do not split over {w} GPUs"));
    }
    let mut rng = TestRng::new(404);
    let x: Vec<f32> = (0..ROWS * D).map(|_| rng.normal() as f32).collect();
    let y: Vec<i64> = (0..ROWS).map(|_| rng.below(C) as i64).collect();
    let lin = |rng: &mut TestRng, n: usize, fan_in: usize| -> Vec<f32> {
        (0..n).map(|_| ((2.0 * rng.unit() - 1.0) / (fan_in as f64).sqrt()) as f32).collect()
    };
    let init = [lin(&mut rng, H * D, D), lin(&mut rng, H, D), lin(&mut rng, C * H, H), lin(&mut rng, C, H)];
    let shapes: [&[usize]; 4] = [&[H, D], &[H], &[C, H], &[C]];
    // Trains on `rows` of the data; returns each step's loss and step 0's gradients.
    let train = |dev: &Device,
                 comm: Option<&Communicator>,
                 rows: std::ops::Range<usize>|
     -> Result<(Vec<f32>, Vec<Vec<f32>>), String> {
        let xt = Tensor::from_f32(dev, &x[rows.start * D..rows.end * D], &[rows.len(), D], DType::F32).map_err(e)?;
        let yt = kernels::IndexTensor::from_slice(dev, &y[rows.clone()], &[rows.len()]).map_err(e)?;
        let one = Tensor::full(dev, &[], DType::F32, 1.0).map_err(e)?;
        let mut p: Vec<Tensor> = init
            .iter()
            .zip(shapes)
            .map(|(v, s)| Tensor::from_f32(dev, v, s, DType::F32).map_err(e))
            .collect::<Result<_, _>>()?;
        let mut st: Vec<ops::AdamWState> =
            p.iter().map(|t| ops::AdamWState::new(t).map_err(e)).collect::<Result<_, _>>()?;
        let cfg = ops::AdamW { lr: 1e-2, ..ops::AdamW::default() };
        let (mut losses, mut first) = (Vec::new(), Vec::new());
        for step in 0..STEPS {
            let (h, s1) = ops::linear_train(&xt, &p[0], Some(&p[1]), ops::Activation::Gelu).map_err(e)?;
            let (z, s2) = ops::linear_train(&h, &p[2], Some(&p[3]), ops::Activation::Identity).map_err(e)?;
            let (loss, ce) = ops::cross_entropy(&z, &yt, ops::CrossEntropyOpts::default()).map_err(e)?;
            let dz = ops::cross_entropy_backward(&z, &yt, &ce, &one).map_err(e)?;
            let g2 = ops::linear_backward(&h, &p[2], &z, &s2, &dz, Some(&p[3])).map_err(e)?;
            let g1 = ops::linear_backward(&xt, &p[0], &h, &s1, &g2.x, Some(&p[1])).map_err(e)?;
            let produced =
                [g2.weight, g2.bias.ok_or("no bias gradient")?, g1.weight, g1.bias.ok_or("no bias gradient")?];
            let grads = match comm {
                Some(c) => {
                    // A 1 KiB bucket: each of the four gradients its own reduction but the smallest.
                    let mut r = dist::BucketedAllReduce::new(c, ReduceOp::Mean, 1 << 10);
                    for g in produced {
                        r.push(g).map_err(e)?;
                    }
                    r.finish().map_err(e)?
                }
                None => produced.into(),
            };
            // grads: w2, b2, w1, b1.
            if step == 0 {
                first = grads.iter().map(|g| g.to_f32_vec().map_err(e)).collect::<Result<_, _>>()?;
            }
            for (k, g) in [2, 3, 0, 1].into_iter().zip(&grads) {
                st[k].update(&mut p[k], g, &cfg).map_err(e)?;
            }
            losses.push(loss.to_scalar::<f32>().map_err(e)?);
        }
        Ok((losses, first))
    };
    let (l1, g1) = train(&ctx.devs[0], None, 0..ROWS)?;
    let share = ROWS / w;
    let runs = per_rank(ctx, |r, c| train(c.device(), Some(c), r * share..(r + 1) * share))?;
    for (name, k) in [("w2", 0), ("b2", 1), ("w1", 2), ("b1", 3)] {
        let scale = g1[k].iter().fold(0.0f32, |a, &b| a.max(b.abs()));
        for (r, (_, gn)) in runs.iter().enumerate() {
            let worst = g1[k].iter().zip(&gn[k]).map(|(a, b)| (a - b).abs()).fold(0.0f32, nan_max);
            if worst.is_nan() || worst > 1e-4 * scale {
                return Err(format!("step 0 gradient {name} on rank {r}: max difference {worst:e}, largest {scale:e}"));
            }
        }
    }
    for s in 0..STEPS {
        let ln = runs.iter().map(|(l, _)| l[s]).sum::<f32>() / w as f32;
        let rel = ((ln - l1[s]) / l1[s]).abs();
        let tol = if s == 0 { 1e-5 } else { 1e-4 };
        if rel.is_nan() || rel > tol {
            return Err(format!("step {s}: loss {ln} on {w} GPUs, {} on one (relative {rel:e} > {tol:e})", l1[s]));
        }
    }
    Ok(())
}

// --- one process per rank ----------------------------------------------------------------------

const CHILD: &str = "KERNELS_DIST_TEST_RANK";

/// A rank started by `multi_process`: joins through the id in the environment, all-reduces and
/// all-gathers, checks, and exits 0 on success.
fn child(rank: usize) -> ExitCode {
    let run = || -> Result<(), String> {
        let world: usize = std::env::var("KERNELS_DIST_TEST_WORLD").map_err(e)?.parse().map_err(e)?;
        let id = UniqueId::from_hex(&std::env::var("KERNELS_DIST_TEST_ID").map_err(e)?).map_err(e)?;
        let dev = Device::cuda(rank).map_err(e)?;
        let comm = Communicator::from_id(&dev, &id, rank, world).map_err(e)?;
        let n = 1001;
        for dt in DType::ALL {
            let vals: Vec<Vec<f32>> = (0..world).map(|r| values(dt, n, r, 60, true)).collect();
            let mut x = Tensor::from_f32(&dev, &vals[rank], &[n], dt).map_err(e)?;
            let gathered = comm.all_gather(&x).map_err(e)?;
            comm.all_reduce_(&mut x, ReduceOp::Sum).map_err(e)?;
            compare(
                "multi-process all_reduce_",
                dt,
                &x.to_f32_vec().map_err(e)?,
                &reduce_ref(dt, &vals, ReduceOp::Sum),
                false,
            )?;
            compare("multi-process all_gather", dt, &gathered.to_f32_vec().map_err(e)?, &vals.concat(), false)?;
        }
        comm.async_error().map_err(e)
    };
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("rank {rank}: {err}");
            ExitCode::FAILURE
        }
    }
}

fn multi_process(ctx: &Ctx) -> Result<(), String> {
    let world = ctx.devs.len();
    let id = UniqueId::new().map_err(e)?;
    let exe = std::env::current_exe().map_err(e)?;
    let mut children = (0..world)
        .map(|r| {
            std::process::Command::new(&exe)
                .env(CHILD, r.to_string())
                .env("KERNELS_DIST_TEST_WORLD", world.to_string())
                .env("KERNELS_DIST_TEST_ID", id.to_hex())
                .env("NCCL_NVLS_ENABLE", "0")
                .spawn()
                .map_err(e)
        })
        .collect::<Result<Vec<_>, _>>()?;
    // A rank that never joins would leave the others waiting: give up after two minutes.
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut failed = Vec::new();
    for (r, ch) in children.iter_mut().enumerate() {
        loop {
            match ch.try_wait().map_err(e)? {
                Some(status) => {
                    if !status.success() {
                        failed.push(format!("rank {r}: {status}"));
                    }
                    break;
                }
                None if Instant::now() > deadline => {
                    let _ = ch.kill();
                    let _ = ch.wait();
                    failed.push(format!("rank {r}: still running after 120 s, killed"));
                    break;
                }
                None => std::thread::sleep(Duration::from_millis(50)),
            }
        }
    }
    if failed.is_empty() { Ok(()) } else { Err(failed.join("; ")) }
}

// --- harness -------------------------------------------------------------------------------------

/// The tests, each with the GPUs it needs at least.
fn tests() -> Vec<(String, usize, TestFn)> {
    let mut t: Vec<(String, TestFn)> = Vec::new();
    for dt in DType::ALL {
        for op in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::Min, ReduceOp::Prod] {
            t.push((format!("dist/all_reduce/{dt:?}/{op:?}"), Box::new(move |c: &Ctx| all_reduce(c, dt, op))));
        }
        t.push((format!("dist/all_gather/{dt:?}"), Box::new(move |c: &Ctx| all_gather(c, dt))));
        for op in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max] {
            t.push((format!("dist/reduce_scatter/{dt:?}/{op:?}"), Box::new(move |c: &Ctx| reduce_scatter(c, dt, op))));
        }
        t.push((format!("dist/broadcast/{dt:?}"), Box::new(move |c: &Ctx| broadcast(c, dt))));
        t.push((format!("dist/send_recv/{dt:?}"), Box::new(move |c: &Ctx| send_recv(c, dt))));
    }
    t.push(("dist/ordered_with_kernels".into(), Box::new(ordered_with_kernels)));
    t.push(("dist/local_checks".into(), Box::new(local_checks)));
    t.push(("dist/cross_rank_checks".into(), Box::new(cross_rank_checks)));
    t.push(("dist/multi_process".into(), Box::new(multi_process)));
    let mut t: Vec<(String, usize, TestFn)> = t.into_iter().map(|(n, f)| (n, 2, f)).collect();
    // The overlap's machinery and the training invariant hold for a world of one as well.
    t.push(("dist/bucketed_all_reduce".into(), 1, Box::new(bucketed_all_reduce)));
    t.push(("dist/data_parallel_matches_one_gpu".into(), 1, Box::new(data_parallel_matches_one_gpu)));
    t
}

fn main() -> ExitCode {
    // SAFETY: before any other thread exists; NCCL reads it when it initialises.
    unsafe { std::env::set_var("NCCL_NVLS_ENABLE", "0") };
    if let Some(rank) = std::env::var(CHILD).ok().and_then(|r| r.parse().ok()) {
        return child(rank);
    }
    let mut args = Arguments::from_args();
    // One test at a time: collectives of two tests interleaved on the same GPUs could wait on
    // each other.
    args.test_threads = Some(1);
    let require = std::env::var("KERNELS_REQUIRE_GPU").is_ok_and(|v| v == "1");
    // Skipped (Err with the reason) or failed (Ok(Err)) or ready.
    let ctx: Result<Result<Arc<Ctx>, String>, String> = match kernels::device_count() {
        Err(err) if !require => Err(format!("no GPU ({err})")),
        Err(err) => Ok(Err(format!("KERNELS_REQUIRE_GPU=1 and no GPU: {err}"))),
        Ok(0) => Err("no GPU".into()),
        Ok(n) => Ok((|| -> Result<Arc<Ctx>, String> {
            let devs = (0..n).map(|i| Device::cuda(i).map_err(e)).collect::<Result<Vec<_>, _>>()?;
            let comms = Communicator::new_group(&devs).map_err(e)?;
            Ok(Arc::new(Ctx { devs, comms }))
        })()),
    };
    match &ctx {
        Err(why) => eprintln!("{why}: the dist tests are reported as ignored (skipped)"),
        Ok(Err(why)) => eprintln!("the dist tests fail: {why}"),
        Ok(Ok(c)) => eprintln!("dist tests on {} GPUs, NCCL {:?}", c.devs.len(), dist::nccl_version().map_err(e)),
    }
    let gpus = kernels::device_count().unwrap_or(0);
    if gpus == 1 {
        eprintln!("1 GPU: the tests that need 2 or more are reported as ignored (skipped)");
    }
    let trials = tests()
        .into_iter()
        .map(|(name, min_gpus, f)| {
            let ctx = ctx.clone();
            let skip = ctx.is_err() || gpus < min_gpus;
            Trial::test(name, move || match ctx {
                Ok(Ok(c)) => f(&c).map_err(Failed::from),
                Ok(Err(why)) | Err(why) => Err(Failed::from(why)),
            })
            .with_ignored_flag(skip)
        })
        .collect();
    libtest_mimic::run(&args, trials).exit_code()
}

/// The larger of two differences, NaN if either is (`f32::max` would drop a NaN).
fn nan_max(m: f32, d: f32) -> f32 {
    if m.is_nan() || d.is_nan() { f32::NAN } else { m.max(d) }
}
