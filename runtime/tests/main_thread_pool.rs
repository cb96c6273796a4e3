//! The warm-up on the process's main thread makes it rayon's worker 0
//! (`warm_up::main_thread_joins_pool`), and the pool still runs what it is handed: parallel
//! work from the main thread, and a job from another thread while the main thread waits for
//! that thread outside rayon. Runs without the test harness, on the main thread itself.

use memwise_runtime::device::Device;
use memwise_runtime::warm_up::warm_up;
use rayon::prelude::*;

fn main() {
    assert_eq!(std::thread::current().name(), Some("main"));
    let threads = std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    // The warm-up trains one step of its tiny models in every precision, after the pool is
    // built: the kernels run with the main thread as a worker.
    let w = warm_up(&Device::cpu());
    if threads < 2 {
        assert!(!w.main_thread_in_pool, "a pool of one must be left alone");
        assert_eq!(rayon::current_thread_index(), None);
        println!("main_thread_pool: skipped the pool checks: this process may use 1 thread");
        return;
    }
    assert!(
        w.main_thread_in_pool,
        "the main thread did not join the pool"
    );
    assert_eq!(rayon::current_thread_index(), Some(0));
    assert_eq!(rayon::current_num_threads(), threads);

    // Parallel work from the main thread runs on every worker, the main thread included.
    let seen: Vec<usize> = (0..threads * 64)
        .into_par_iter()
        .map(|_| {
            std::thread::sleep(std::time::Duration::from_micros(200));
            rayon::current_thread_index().expect("on a worker")
        })
        .collect();
    assert!(
        seen.contains(&0),
        "the main thread ran none of its own parallel work"
    );
    assert!(seen.iter().any(|&t| t > 0), "no other worker ran any of it");

    // A job another thread hands the pool finishes while the main thread waits outside rayon.
    let total = std::thread::spawn(|| (1..=1000u64).into_par_iter().sum::<u64>())
        .join()
        .expect("the other thread's parallel sum");
    assert_eq!(total, 500_500);
    println!("main_thread_pool: ok ({threads} threads, the main thread is worker 0)");
}
