//! Data-parallel model states per replica (`memwise_plan::data_parallel`) against the ZeRO
//! paper's and Megatron's published formulas, term by term, and against the plans' own
//! persistent layout.

use memwise_plan::data_parallel::{plan_params, replica_states, ElementBytes, Sharding};
use memwise_plan::{plan, zoo, Optimizer, Precision};

const REPLICAS: [u64; 3] = [8, 64, 512];

/// Rajbhandari et al. 2020 (ZeRO), section 3 and figure 1: mixed-precision Adam keeps fp16
/// parameters (2Ψ) and gradients (2Ψ) and K = 12 bytes of fp32 states per parameter (master,
/// momentum, variance): 16Ψ; stage 1 (P_os) 4Ψ + 12Ψ/N; stage 2 (P_os+g) 2Ψ + 14Ψ/N.
#[test]
fn zero_papers_model_states_term_by_term() {
    let zero = ElementBytes {
        compute_copy: 2,
        master: 4,
        grad: 2,
        optimizer_slots: 2,
    };
    // Divisible by every replica count, so that no shard is padded.
    let psi = 512 * 15_000_000u64;
    let params = [(psi, zero)];
    assert_eq!(
        replica_states(&params, 8, Sharding::Replicated, 1).total(),
        16 * psi
    );
    for n in REPLICAS {
        let os = replica_states(&params, n, Sharding::OptimizerState, 1);
        assert_eq!(os.compute_copies, 2 * psi);
        assert_eq!(os.grads, 2 * psi);
        assert_eq!(os.masters + os.optimizer, 12 * psi / n);
        assert_eq!(os.total(), 4 * psi + 12 * psi / n);
        let osg = replica_states(&params, n, Sharding::Gradients, 1);
        assert_eq!(osg.compute_copies, 2 * psi);
        assert_eq!(osg.grads + osg.masters + osg.optimizer, 14 * psi / n);
        // What the formula leaves out: one whole gradient before its reduce-scatter (here
        // the model is one tensor, so the whole gradient).
        assert_eq!(osg.gradient_bucket, 2 * psi);
        assert_eq!(osg.total() - osg.gradient_bucket, 2 * psi + 14 * psi / n);
    }
    // Figure 1: Ψ = 7.5B on 64 GPUs, 120 GB, 31.4 GB, 16.6 GB.
    let params = [(7_500_000_000u64, zero)];
    let gb = |b: u64| b as f64 / 1e9;
    assert_eq!(
        gb(replica_states(&params, 64, Sharding::Replicated, 1).total()),
        120.0
    );
    assert_eq!(
        gb(replica_states(&params, 64, Sharding::OptimizerState, 1).total()),
        31.40625
    );
    let osg = replica_states(&params, 64, Sharding::Gradients, 1);
    assert_eq!(gb(osg.total() - osg.gradient_bucket), 16.640625);
}

/// Megatron-LM's distributed optimizer (docs, "Distributed Optimizer"): bf16 parameters, fp32
/// gradients, fp32 main parameters and Adam's two moments: 18 bytes per parameter
/// replicated, 6 + 12/d with the optimizer state and main parameters sharded over d.
#[test]
fn megatrons_distributed_optimizer_table() {
    let megatron = ElementBytes {
        compute_copy: 2,
        master: 4,
        grad: 4,
        optimizer_slots: 2,
    };
    let psi = 512 * 1000u64;
    let params = [(psi, megatron)];
    assert_eq!(
        replica_states(&params, 8, Sharding::Replicated, 1).total(),
        18 * psi
    );
    for d in REPLICAS {
        let s = replica_states(&params, d, Sharding::OptimizerState, 1);
        assert_eq!((s.compute_copies, s.grads), (2 * psi, 4 * psi));
        assert_eq!(s.masters + s.optimizer, 12 * psi / d);
        assert_eq!(s.total(), 6 * psi + 12 * psi / d);
        assert_eq!(s.shard_padding, 0);
    }
}

/// memwise's own plans of GPT-2 small and ResNet-50 under mixed bfloat16 and Adam: every
/// weight a GEMM reads has Megatron's layout (a bf16 copy, an f32 master, an f32 gradient,
/// two f32 moments); biases and norm parameters are read in f32 and keep no copy. Per
/// replica, term by term, and the replicated total equals the plan's persistent region.
#[test]
fn the_zoos_plans_per_replica() {
    let models = [
        ("GPT-2 small", zoo::gpt2_stack(1, 12)),
        ("ResNet-50", zoo::resnet50(1)),
    ];
    for (name, mut spec) in models {
        spec.precision = Precision::MixedBFloat16;
        spec.optimizer = Optimizer::ADAM;
        let p = plan(&spec).unwrap();
        let params = plan_params(&p);
        let replicated = replica_states(&params, 1, Sharding::Replicated, p.alignment);
        assert_eq!(replicated.total(), p.memory.persistent(), "{name}");
        let megatron = ElementBytes {
            compute_copy: 2,
            master: 4,
            grad: 4,
            optimizer_slots: 2,
        };
        let (mut with_copy, mut f32_trained, mut frozen) = (0u64, 0u64, 0u64);
        for &(e, b) in &params {
            match (b.compute_copy, b.grad) {
                (2, _) => {
                    assert_eq!(b, megatron, "{name}");
                    with_copy += e
                }
                (0, 4) => f32_trained += e,
                (0, 0) => frozen += e,
                other => panic!("{name}: unexpected layout {other:?}"),
            }
        }
        assert!(
            with_copy > 9 * (f32_trained + frozen),
            "{name}: most are GEMM weights"
        );
        let mut line = format!(
            "{name}: {} parameters ({with_copy} with a bf16 copy), replicated {:.1} MiB",
            with_copy + f32_trained + frozen,
            replicated.total() as f64 / 1048576.0
        );
        for d in REPLICAS {
            let shard = |e: u64| e.div_ceil(d);
            let sum = |k: u64| -> u64 {
                params
                    .iter()
                    .filter(|(_, b)| b.compute_copy == k)
                    .map(|&(e, _)| shard(e))
                    .sum()
            };
            let s = replica_states(&params, d, Sharding::OptimizerState, 1);
            // Megatron's 6 + 12/d for the weights with a copy; the rest keep their f32
            // value whole (the forward reads it) and shard their two moments.
            let expected = 6 * with_copy
                + 12 * sum(2)
                + 4 * (f32_trained + frozen)
                + 4 * f32_trained
                + 8 * params
                    .iter()
                    .filter(|(_, b)| b.compute_copy == 0 && b.grad > 0)
                    .map(|&(e, _)| shard(e))
                    .sum::<u64>();
            assert_eq!(s.total(), expected, "{name} at {d} replicas");
            let g = replica_states(&params, d, Sharding::Gradients, p.alignment);
            let o = replica_states(&params, d, Sharding::OptimizerState, p.alignment);
            assert!(
                g.total() < o.total() && o.total() < replicated.total(),
                "{name}"
            );
            line += &format!(
                "; {d}: {:.1} MiB (stage 2: {:.1} MiB)",
                o.total() as f64 / 1048576.0,
                g.total() as f64 / 1048576.0
            );
        }
        eprintln!("{line}");
    }
}

/// The gradients are laid out in the order the sums take them (DDP's bucket views): each
/// `AllReduceGradients` step covers one contiguous range of the persistent region, the
/// buckets one after the other from the start of the gradients.
#[test]
fn each_gradient_bucket_is_one_contiguous_range() {
    use memwise_plan::liveness::align_up;
    use memwise_plan::Op;
    for (spec, replicas) in [(zoo::gpt2_stack(8, 12), 8), (zoo::resnet50(64), 8)] {
        let p = plan(&spec.with_replicas(replicas)).unwrap();
        let (mut at, _) = p.grads_range();
        let mut buckets = 0;
        for s in p.steps.iter() {
            if let Op::AllReduceGradients { bytes, .. } = s.op {
                let mut covered = 0;
                for &pid in s.params.iter() {
                    let prm = &p.params[pid as usize];
                    assert_eq!(prm.grad_offset, at, "{}: {}", spec.name, prm.name);
                    at += align_up(prm.elems() as u64 * 4, p.alignment);
                    covered += prm.elems() as u64 * 4;
                }
                assert_eq!(covered, bytes);
                buckets += 1;
            }
        }
        assert_eq!(
            at,
            p.grads_range().1,
            "{}: every gradient in a bucket",
            spec.name
        );
        assert!(buckets > 1, "{}: {buckets} bucket", spec.name);
        eprintln!(
            "{} on {replicas} replicas: {buckets} contiguous buckets",
            spec.name
        );
    }
}

/// The largest global batch under a budget counts each replica's shard of the optimizer
/// state, not the whole of it: exact (the batch fits, the next whole share does not), and
/// larger than without sharding when the state is a large part of the budget.
#[test]
fn the_largest_batch_under_a_budget_counts_the_sharded_state() {
    use memwise_plan::advice::total;
    use memwise_plan::checkpoint::{max_batch_with, Policy};
    let mut spec = zoo::mnist_mlp(64).with_replicas(4);
    spec.optimizer = Optimizer::ADAM;
    let budget = 24 << 20;
    let sharded = spec.with_sharding(Sharding::OptimizerState);
    let plain = max_batch_with(&spec, budget, Policy::Plain).unwrap();
    let zero = max_batch_with(&sharded, budget, Policy::Plain).unwrap();
    eprintln!("MLP with Adam on 4 replicas under 24 MiB: batch {plain} unsharded, {zero} with ZeRO stage 1");
    assert!(zero > plain);
    assert!(total(&sharded.with_batch(zero)).unwrap() <= budget);
    assert!(total(&sharded.with_batch(zero + 4)).unwrap() > budget);
}
