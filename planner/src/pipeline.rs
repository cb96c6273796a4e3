//! Pipeline schedules (model parallelism, issue 16): the order in which each stage of a model
//! split over devices runs the forwards and backwards of a batch's micro-batches — GPipe
//! (every forward, then every backward) and 1F1B (PipeDream-Flush: a few forwards, then one
//! forward and one backward in turn) — and what follows from that order alone: how many
//! micro-batches a stage holds at once (the copies of its activations its plan must keep),
//! and the pipeline's idle time (the bubble), from a replay of the schedule.
//!
//! Pure: no device, no plan. A stage's plan will hold [`in_flight`] micro-batches' saved
//! tensors, and its runtime walks [`stage_work`] in order.

/// How a pipeline orders its micro-batches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PipelineSchedule {
    /// GPipe (Huang et al. 2019): each stage runs every micro-batch's forward, then every
    /// backward. A stage holds every micro-batch at once.
    GPipe,
    /// 1F1B (PipeDream-Flush; Narayanan et al. 2021, Megatron-LM's default): stage `s` of `p`
    /// runs `p − s − 1` forwards first, then one forward and one backward in turn, then the
    /// remaining backwards. The same bubble as GPipe, and stage `s` holds at most `p − s`
    /// micro-batches.
    OneFOneB,
}

impl PipelineSchedule {
    /// The name the model attribute takes (`schedule = gpipe`, `schedule = one_f_one_b`).
    pub const fn name(self) -> &'static str {
        match self {
            PipelineSchedule::GPipe => "gpipe",
            PipelineSchedule::OneFOneB => "one_f_one_b",
        }
    }
}

/// One unit of a stage's work: a micro-batch's forward or backward through the stage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Work {
    Forward(usize),
    Backward(usize),
}

/// Stage `stage`'s work, in order, under `schedule` for `stages` stages and `micro_batches`
/// micro-batches (every micro-batch's forward and backward once each).
pub fn stage_work(
    schedule: PipelineSchedule,
    stage: usize,
    stages: usize,
    micro_batches: usize,
) -> Vec<Work> {
    let m = micro_batches;
    match schedule {
        PipelineSchedule::GPipe => (0..m)
            .map(Work::Forward)
            .chain((0..m).map(Work::Backward))
            .collect(),
        PipelineSchedule::OneFOneB => {
            let warm_up = stages.saturating_sub(stage + 1).min(m);
            let steady =
                (0..m - warm_up).flat_map(|i| [Work::Forward(warm_up + i), Work::Backward(i)]);
            (0..warm_up)
                .map(Work::Forward)
                .chain(steady)
                .chain((m - warm_up..m).map(Work::Backward))
                .collect()
        }
    }
}

/// The most micro-batches whose forward has run and whose backward has not, at any point of
/// `work`: how many copies of the stage's saved activations it holds at once.
pub fn in_flight(work: &[Work]) -> usize {
    let mut open = 0usize;
    let mut most = 0;
    for w in work {
        match w {
            Work::Forward(_) => {
                open += 1;
                most = most.max(open);
            }
            Work::Backward(_) => open = open.saturating_sub(1),
        }
    }
    most
}

/// A replay of a schedule, every stage starting each unit as soon as its stage is free and
/// what it receives has arrived (transfers take no time).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Timeline {
    /// Per stage, each unit of its work with its start time, in the stage's order.
    pub starts: Vec<Vec<(Work, u64)>>,
    /// When the last unit ends.
    pub makespan: u64,
    /// Per stage, the time it computes.
    pub busy: Vec<u64>,
}

impl Timeline {
    /// The share of the stages' time spent idle: `1 − Σ busy / (stages · makespan)`.
    pub fn bubble_fraction(&self) -> f64 {
        let capacity = self.busy.len() as u64 * self.makespan;
        if capacity == 0 {
            return 0.0;
        }
        1.0 - self.busy.iter().sum::<u64>() as f64 / capacity as f64
    }
}

/// Replays `schedule` for `stages` stages and `micro_batches` micro-batches, a forward taking
/// `forward` and a backward `backward` time units on every stage. A forward on stage `s > 0`
/// waits for the same micro-batch's forward on `s − 1` (its input), a backward on
/// `s < p − 1` for the same micro-batch's backward on `s + 1` (its output's gradient).
/// `Err` names the stage and unit that can never start (a schedule that deadlocks).
pub fn replay(
    schedule: PipelineSchedule,
    stages: usize,
    micro_batches: usize,
    forward: u64,
    backward: u64,
) -> Result<Timeline, String> {
    let works: Vec<Vec<Work>> = (0..stages)
        .map(|s| stage_work(schedule, s, stages, micro_batches))
        .collect();
    // Per stage and micro-batch: when its forward and its backward end.
    let mut forward_end = vec![vec![None; micro_batches]; stages];
    let mut backward_end = vec![vec![None; micro_batches]; stages];
    let mut next = vec![0usize; stages];
    let mut free = vec![0u64; stages];
    let mut starts: Vec<Vec<(Work, u64)>> = vec![Vec::new(); stages];
    loop {
        let mut progressed = false;
        for s in 0..stages {
            while let Some(&w) = works[s].get(next[s]) {
                let ready = match w {
                    Work::Forward(_) if s == 0 => Some(0),
                    Work::Forward(k) => forward_end[s - 1][k],
                    Work::Backward(k) if s + 1 == stages => forward_end[s][k],
                    Work::Backward(k) => backward_end[s + 1][k],
                };
                let Some(ready) = ready else { break };
                let start = ready.max(free[s]);
                let (end, slot) = match w {
                    Work::Forward(k) => (start + forward, &mut forward_end[s][k]),
                    Work::Backward(k) => (start + backward, &mut backward_end[s][k]),
                };
                *slot = Some(end);
                free[s] = end;
                starts[s].push((w, start));
                next[s] += 1;
                progressed = true;
            }
        }
        if (0..stages).all(|s| next[s] == works[s].len()) {
            break;
        }
        if !progressed {
            let s = (0..stages).find(|&s| next[s] < works[s].len()).unwrap_or(0);
            return Err(format!(
                "{} deadlocks: stage {s} can never start {:?}",
                schedule.name(),
                works[s][next[s]]
            ));
        }
    }
    let per_unit = micro_batches as u64 * (forward + backward);
    Ok(Timeline {
        starts,
        makespan: free.iter().copied().max().unwrap_or(0),
        busy: vec![per_unit; stages],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_f_one_b_warms_up_then_alternates() {
        use Work::{Backward as B, Forward as F};
        let order = stage_work(PipelineSchedule::OneFOneB, 0, 4, 6);
        assert_eq!(
            order,
            [
                F(0),
                F(1),
                F(2),
                F(3),
                B(0),
                F(4),
                B(1),
                F(5),
                B(2),
                B(3),
                B(4),
                B(5)
            ]
        );
        let last = stage_work(PipelineSchedule::OneFOneB, 3, 4, 6);
        assert_eq!(last[..4], [F(0), B(0), F(1), B(1)]);
        let gpipe = stage_work(PipelineSchedule::GPipe, 1, 4, 3);
        assert_eq!(gpipe, [F(0), F(1), F(2), B(0), B(1), B(2)]);
    }

    #[test]
    fn a_stage_of_one_is_one_device() {
        for schedule in [PipelineSchedule::GPipe, PipelineSchedule::OneFOneB] {
            let t = replay(schedule, 1, 4, 1, 2).unwrap();
            assert_eq!(t.makespan, 12);
            assert_eq!(t.bubble_fraction(), 0.0);
        }
    }
}
