//! The MPI check (`scripts/ci-mpi.sh` runs it; built with `--features mpi`): run under
//! `mpirun -n 2` (any number of ranks works), each rank checks `collective::Mpi` against the
//! others and prints `mpi_check: rank R of N ok`, or why not and exits 1:
//!
//! 1. the job's size is the one `mpirun` launched (the binary uses the launcher's MPI), and a
//!    second `Mpi::init` is an error;
//! 2. `all_reduce_sum_f32` of rank-dependent values that add exactly (small multiples of
//!    1/4) equals the expected sum bit for bit, and so does a sum that rounds, longer than
//!    `Mpi::CHUNK` (on two ranks `a + b`, whatever the order; on any number, rank 0's bits);
//! 3. the same in f64;
//! 4. `broadcast` from rank 1 (rank 0 in a job of one) leaves the root's bytes everywhere, and
//!    a root that is not a rank is an error on every rank;
//! 5. barriers;
//! 6. point to point round a ring (two or more ranks): each rank sends a long message (past
//!    Open MPI's eager limit, so a rendezvous) and a short one to the next rank, and receives
//!    the previous rank's, in order; a wrong peer is an error.
//!
//! The fault test: with `--die-at-step K` (or `MEMWISE_MPI_DIE_AT_STEP=K`), every rank loops
//! over a barrier and a small sum, 10 ms apart, and rank 1 calls `std::process::exit(3)` after
//! its K-th barrier while rank 0 goes on calling collectives: `mpirun` must end the job with a
//! non-zero status (the script requires it within 60 s).

use std::process::ExitCode;
use std::time::Duration;

use memwise_runtime::collective::{Collective, Mpi};

/// Long enough to take more than one `MPI_Allreduce` (`Mpi::CHUNK` elements each).
const LONG: usize = 2 * Mpi::CHUNK + 3;

fn main() -> ExitCode {
    let die_at = match die_at_step() {
        Ok(k) => k,
        Err(why) => {
            eprintln!("mpi_check: {why}");
            return ExitCode::from(2);
        }
    };
    let mpi = match Mpi::init() {
        Ok(mpi) => mpi,
        Err(e) => {
            eprintln!("mpi_check: {e}");
            return ExitCode::FAILURE;
        }
    };
    let (rank, size) = (mpi.rank(), mpi.size());
    if let Some(k) = die_at {
        fault(&mpi, k);
    }
    let failures = match check(&mpi) {
        Ok(failures) => failures,
        Err(e) => vec![format!("a collective failed: {e}")],
    };
    // Finalise before exiting, whatever the outcome: a rank that exits without
    // MPI_Finalize is a dead rank to mpirun, which would hide the reason printed here.
    drop(mpi);
    if failures.is_empty() {
        println!("mpi_check: rank {rank} of {size} ok");
        ExitCode::SUCCESS
    } else {
        for why in &failures {
            println!("mpi_check: rank {rank} of {size} FAILED: {why}");
        }
        ExitCode::FAILURE
    }
}

/// `--die-at-step K`, else `MEMWISE_MPI_DIE_AT_STEP`, else none.
fn die_at_step() -> Result<Option<u64>, String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let given = match args.as_slice() {
        [] => std::env::var("MEMWISE_MPI_DIE_AT_STEP").ok(),
        [flag, k] if flag == "--die-at-step" => Some(k.clone()),
        _ => return Err(format!("usage: mpi_check [--die-at-step K]; got {args:?}")),
    };
    given
        .map(|k| {
            k.trim()
                .parse()
                .map_err(|_| format!("--die-at-step: `{k}` is not a count"))
        })
        .transpose()
}

/// Every check, in the same order on every rank (so the collectives always match); the
/// mismatches found, for this rank.
fn check(mpi: &Mpi) -> memwise_runtime::error::Result<Vec<String>> {
    let (rank, size) = (mpi.rank(), mpi.size());
    let mut failures = Vec::new();

    // 1. The job is the one mpirun launched.
    if let Some(launched) = Mpi::world_size_from_env() {
        if launched != size {
            failures.push(format!(
                "mpirun launched {launched} ranks but this job has {size}: the binary is \
                 linked with another MPI than the launcher's"
            ));
        }
    }
    // There is one MPI per process: a second `Mpi` is an error, and leaves the first working.
    if Mpi::init().is_ok() {
        failures.push("a second Mpi::init in the same process was not an error".into());
    }
    mpi.barrier()?;

    // 2. f32 sums. Exact: small multiples of 1/4 add without rounding in any order.
    let exact_f32 = |r: usize, i: usize| ((r + 1) * (i % 7 + 1)) as f32 * 0.25;
    let mut values: Vec<f32> = (0..1000).map(|i| exact_f32(rank, i)).collect();
    mpi.all_reduce_sum_f32(&mut values)?;
    for (i, got) in values.iter().enumerate() {
        let want = (0..size).map(|r| exact_f32(r, i)).sum::<f32>();
        if got.to_bits() != want.to_bits() {
            failures.push(format!("f32 exact sum [{i}]: got {got:e}, want {want:e}"));
            break;
        }
    }
    // Rounding, and longer than one MPI_Allreduce.
    let rounding_f32 = |r: usize, i: usize| 0.1 * (r + 1) as f32 + (i as f32) * 1e-3;
    let mut values: Vec<f32> = (0..LONG).map(|i| rounding_f32(rank, i)).collect();
    mpi.all_reduce_sum_f32(&mut values)?;
    if size == 2 {
        // a + b == b + a in IEEE arithmetic: the one possible answer.
        if let Some(i) = (0..LONG)
            .find(|&i| values[i].to_bits() != (rounding_f32(0, i) + rounding_f32(1, i)).to_bits())
        {
            failures.push(format!(
                "f32 rounding sum [{i}] of {LONG}: got {:e}, want {:e}",
                values[i],
                rounding_f32(0, i) + rounding_f32(1, i)
            ));
        }
    }
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    failures.extend(same_as_rank_0(mpi, "f32 rounding sum", bytes)?);

    // 3. f64 sums, likewise.
    let exact_f64 = |r: usize, i: usize| ((r + 1) * (i % 5 + 1)) as f64 * 0.125;
    let mut values: Vec<f64> = (0..1000).map(|i| exact_f64(rank, i)).collect();
    mpi.all_reduce_sum_f64(&mut values)?;
    for (i, got) in values.iter().enumerate() {
        let want = (0..size).map(|r| exact_f64(r, i)).sum::<f64>();
        if got.to_bits() != want.to_bits() {
            failures.push(format!("f64 exact sum [{i}]: got {got:e}, want {want:e}"));
            break;
        }
    }
    let rounding_f64 = |r: usize, i: usize| 0.1 * (r + 1) as f64 + (i as f64) * 1e-7;
    let mut values: Vec<f64> = (0..LONG).map(|i| rounding_f64(rank, i)).collect();
    mpi.all_reduce_sum_f64(&mut values)?;
    if size == 2 {
        if let Some(i) = (0..LONG)
            .find(|&i| values[i].to_bits() != (rounding_f64(0, i) + rounding_f64(1, i)).to_bits())
        {
            failures.push(format!(
                "f64 rounding sum [{i}] of {LONG}: got {:e}, want {:e}",
                values[i],
                rounding_f64(0, i) + rounding_f64(1, i)
            ));
        }
    }
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    failures.extend(same_as_rank_0(mpi, "f64 rounding sum", bytes)?);

    // 4. Broadcast from rank 1.
    let root = 1 % size;
    let pattern = |i: usize| (i * 31 + 7) as u8;
    let mut bytes: Vec<u8> = if rank == root {
        (0..4099).map(pattern).collect()
    } else {
        vec![0; 4099]
    };
    mpi.broadcast(root, &mut bytes)?;
    if let Some(i) = (0..bytes.len()).find(|&i| bytes[i] != pattern(i)) {
        failures.push(format!(
            "broadcast from rank {root}: byte {i} is {}, want {}",
            bytes[i],
            pattern(i)
        ));
    }
    if mpi.broadcast(size, &mut bytes).is_ok() {
        failures.push(format!(
            "broadcast from rank {size} of {size} was not an error"
        ));
    }

    // 5. Barriers.
    for _ in 0..3 {
        mpi.barrier()?;
    }
    ring(mpi, &mut failures)?;
    Ok(failures)
}

/// Check 6, point to point: rank r sends to r + 1 and receives from r − 1 (mod N), even
/// ranks sending first and odd ones receiving first, so no two ranks wait in a rendezvous
/// send for each other.
fn ring(mpi: &Mpi, failures: &mut Vec<String>) -> memwise_runtime::error::Result<()> {
    let (rank, size) = (mpi.rank(), mpi.size());
    if mpi.send(size, &[0]).is_ok() {
        failures.push(format!("a send to rank {size} of {size} was not an error"));
    }
    if size < 2 {
        return Ok(());
    }
    let (next, prev) = ((rank + 1) % size, (rank + size - 1) % size);
    let long = |from: usize| -> Vec<u8> { (0..300_000).map(|i| (i * 7 + from) as u8).collect() };
    let send = || -> memwise_runtime::error::Result<()> {
        mpi.send(next, &long(rank))?;
        mpi.send(next, &[rank as u8, 1, 2])
    };
    let mut got_long = vec![0u8; 300_000];
    let mut got_short = [0u8; 3];
    let mut receive = || -> memwise_runtime::error::Result<()> {
        mpi.recv(prev, &mut got_long)?;
        mpi.recv(prev, &mut got_short)
    };
    if rank % 2 == 0 {
        send()?;
        receive()?;
    } else {
        receive()?;
        send()?;
    }
    if got_long != long(prev) || got_short != [prev as u8, 1, 2] {
        failures.push(format!(
            "point to point: rank {rank} did not receive rank {prev}'s two messages in order"
        ));
    }
    Ok(())
}

/// Broadcasts rank 0's `bytes` and compares them with this rank's: every rank must end a
/// sum with the same bits.
fn same_as_rank_0(
    mpi: &Mpi,
    what: &str,
    mine: Vec<u8>,
) -> memwise_runtime::error::Result<Option<String>> {
    let mut rank_0 = mine.clone();
    mpi.broadcast(0, &mut rank_0)?;
    Ok((rank_0 != mine).then(|| {
        let at = (0..mine.len()).find(|&i| mine[i] != rank_0[i]).unwrap_or(0);
        format!(
            "{what}: rank {} differs from rank 0 at byte {at}",
            mpi.rank()
        )
    }))
}

/// The fault test: never returns. Rank 1 exits (status 3, without finalising MPI) after
/// `die_at` barriers; the others go on until `mpirun` ends them, or give up after a minute.
fn fault(mpi: &Mpi, die_at: u64) -> ! {
    let rank = mpi.rank();
    if mpi.size() < 2 {
        eprintln!("mpi_check: the fault test needs 2 ranks or more (mpirun -n 2)");
        std::process::exit(2);
    }
    let mut values = vec![1.0f32; 64];
    for step in 1..=die_at + 6000 {
        if let Err(e) = mpi.barrier() {
            eprintln!("mpi_check: rank {rank}: barrier {step} failed: {e}");
            std::process::exit(1);
        }
        if rank == 1 && step == die_at {
            eprintln!("mpi_check: rank 1 exits with status 3 after {step} barriers");
            std::process::exit(3);
        }
        if let Err(e) = mpi.all_reduce_sum_f32(&mut values) {
            eprintln!("mpi_check: rank {rank}: sum {step} failed: {e}");
            std::process::exit(1);
        }
        values.fill(1.0);
        std::thread::sleep(Duration::from_millis(10));
    }
    eprintln!(
        "mpi_check: rank {rank} ran {} steps past rank 1's exit and mpirun did not end the job",
        6000
    );
    std::process::exit(1);
}
