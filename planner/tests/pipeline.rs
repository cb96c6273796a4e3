//! Pipeline schedules (`memwise_plan::pipeline`) against the published figures: how many
//! micro-batches each stage holds (GPipe: all of them; 1F1B: `min(p − s, m)`, so the first
//! stage holds `p`, Megatron-LM's "p micro-batches in flight", or `m` when there are fewer),
//! and the bubble, `(p − 1) / (m + p − 1)` of the step for both (Narayanan et al. 2021), from
//! a replay of every schedule up to 8 stages and 16 micro-batches, none deadlocking.

use memwise_plan::pipeline::{in_flight, replay, stage_work, PipelineSchedule, Work};

const SCHEDULES: [PipelineSchedule; 2] = [PipelineSchedule::GPipe, PipelineSchedule::OneFOneB];

#[test]
fn every_stage_runs_each_micro_batch_forward_before_backward_once() {
    for schedule in SCHEDULES {
        for p in 1..=8 {
            for m in 1..=16 {
                for s in 0..p {
                    let work = stage_work(schedule, s, p, m);
                    assert_eq!(work.len(), 2 * m, "{schedule:?} p={p} m={m} s={s}");
                    for k in 0..m {
                        let f = work.iter().position(|&w| w == Work::Forward(k));
                        let b = work.iter().position(|&w| w == Work::Backward(k));
                        assert!(f.unwrap() < b.unwrap(), "{schedule:?} p={p} m={m} s={s}");
                    }
                }
            }
        }
    }
}

#[test]
fn micro_batches_in_flight_per_stage() {
    for p in 1..=8 {
        for m in 1..=16 {
            for s in 0..p {
                let gpipe = in_flight(&stage_work(PipelineSchedule::GPipe, s, p, m));
                assert_eq!(gpipe, m, "GPipe p={p} m={m} s={s}");
                let one = in_flight(&stage_work(PipelineSchedule::OneFOneB, s, p, m));
                assert_eq!(one, (p - s).min(m), "1F1B p={p} m={m} s={s}");
            }
            // Megatron-LM: under 1F1B the first stage holds p micro-batches whatever m ≥ p
            // is, a fraction m/p of that when m < p.
            let first = in_flight(&stage_work(PipelineSchedule::OneFOneB, 0, p, m));
            assert_eq!(first, if m >= p { p } else { m });
        }
    }
}

#[test]
fn the_bubble_is_p_minus_one_over_m_plus_p_minus_one() {
    // A backward costs two forwards, as a layer's backward does two GEMMs per forward GEMM.
    let (tf, tb) = (1u64, 2u64);
    for schedule in SCHEDULES {
        for p in 1..=8u64 {
            for m in 1..=16u64 {
                let t = replay(schedule, p as usize, m as usize, tf, tb).unwrap();
                assert_eq!(
                    t.makespan,
                    (m + p - 1) * (tf + tb),
                    "{schedule:?} p={p} m={m}"
                );
                let expected = (p - 1) as f64 / (m + p - 1) as f64;
                assert!(
                    (t.bubble_fraction() - expected).abs() < 1e-12,
                    "{schedule:?} p={p} m={m}: {} against {expected}",
                    t.bubble_fraction()
                );
            }
        }
    }
}
