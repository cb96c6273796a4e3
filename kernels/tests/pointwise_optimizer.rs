//! Optimizers against hand-computed Keras 3 `update_step` values (3 steps, f64 reference
//! computed from the formulas quoted in `optimizer.rs`; tolerance 1e-7 absolute + 2e-6
//! relative, i.e. a few f32 ulps), argument checks, loss scaler state machine, and the
//! skip-on-overflow protocol leaving params and state bit-identical.
mod pointwise_util;

use memwise_kernels::elementwise::all_finite;
use memwise_kernels::optimizer::*;
use pointwise_util::*;

const P0: [f32; 5] = [0.5, -1.0, 2.0, 0.0, 3e-3];
const GRADS: [[f32; 5]; 3] = [
    [0.1, -0.2, 0.3, 0.0, 1e-3],
    [-0.05, -0.4, 0.3, 0.2, 1e-3],
    [0.2, 0.1, -0.6, 0.0, -2e-3],
];

// Generated from the Keras formulas in f64 (initial params P0, gradients GRADS):
const SGD: [[f64; 5]; 3] = [
    [0.499, -0.998, 1.997, 0.0, 0.00299],
    [0.4995, -0.994, 1.9940000000000002, -0.002, 0.00298],
    [0.4975, -0.995, 2.0, -0.002, 0.003],
];
const SGD_MOMENTUM: [[f64; 5]; 3] = [
    [0.499, -0.998, 1.997, 0.0, 0.00299],
    [0.4986, -0.9922, 1.9913, -0.002, 0.002971],
    [
        0.49624,
        -0.98798,
        1.99217,
        -0.0038000000000000004,
        0.0029739000000000002,
    ],
];
const SGD_NESTEROV: [[f64; 5]; 3] = [
    [0.4981, -0.9962, 1.9943, 0.0, 0.002981],
    [
        0.49823999999999996,
        -0.98698,
        1.98617,
        -0.0038000000000000004,
        0.0029539,
    ],
    [
        0.49411599999999994,
        -0.984182,
        1.992953,
        -0.00542,
        0.0029765100000000004,
    ],
];
const RMSPROP: [[f64; 5]; 3] = [
    [
        0.49683788044185706,
        -0.9968377618675612,
        1.9968377399078945,
        0.0,
        0.0007639320225002102,
    ],
    [
        0.49831223590238816,
        -0.9939806262990202,
        1.9945435892772219,
        -0.003162238132438771,
        -0.0010930213592703086,
    ],
    [
        0.4954936845910039,
        -0.9947130727534422,
        1.9971903307283143,
        -0.003162238132438771,
        0.001348546141924612,
    ],
];
const RMSPROP_MOMENTUM_CENTERED: [[f64; 5]; 3] = [
    [
        0.4966668518364212,
        -0.9966667129619985,
        1.9966666872426078,
        0.0,
        0.0007058426612943825,
    ],
    [
        0.49515173770412446,
        -0.9905275535662045,
        1.9911176512529638,
        -0.003333287038001521,
        -0.0033434791227205276,
    ],
    [
        0.49079944297687256,
        -0.9857724697323322,
        1.9887722115980282,
        -0.0063332453722028895,
        -0.004544769714118089,
    ],
];
const ADAM: [[f64; 5]; 3] = [
    [
        0.49900003162177664,
        -0.9990000158111383,
        1.9990000105408143,
        0.0,
        0.00200315230918326,
    ],
    [
        0.49873370211806717,
        -0.9980348406108184,
        1.9980000179961828,
        -0.0007441250579167468,
        0.0010053839450499906,
    ],
    [
        0.4980755996024364,
        -0.9974462379421563,
        1.9980756670013167,
        -0.0013193358798420389,
        0.0010809357145064806,
    ],
];
const ADAMW: [[f64; 5]; 3] = [
    [
        0.49899803162177664,
        -0.9989960158111383,
        1.9989920105408143,
        0.0,
        0.00200314030918326,
    ],
    [
        0.4987297061259407,
        -0.9980268446267552,
        1.9979840220281406,
        -0.0007441250579167468,
        0.001005363932488754,
    ],
    [
        0.4980696086914854,
        -0.9974342498507145,
        1.9980516790971865,
        -0.0013193329033418073,
        0.0010809116804895139,
    ],
];

/// Runs 3 updates and checks each step against the reference rows.
fn run(name: &str, opt: &dyn Optimizer, want: &[[f64; 5]; 3]) {
    let mut p = P0.to_vec();
    let mut state: Vec<Vec<f32>> = (0..opt.state_slots()).map(|_| vec![0.0; 5]).collect();
    for (t, g) in GRADS.iter().enumerate() {
        let mut views: Vec<&mut [f32]> = state.iter_mut().map(|s| s.as_mut_slice()).collect();
        opt.update(t as u64 + 1, &mut p, g, &mut views, 1.0)
            .unwrap();
        assert_close(&format!("{name} step {}", t + 1), &p, &want[t], 1e-7, 2e-6);
    }
}

#[test]
fn sgd_matches_keras() {
    let sgd = Sgd::default();
    assert_eq!(
        (sgd.learning_rate, sgd.momentum, sgd.nesterov),
        (0.01, 0.0, false)
    );
    assert_eq!(sgd.state_slots(), 0);
    run("sgd", &sgd, &SGD);
    let m = Sgd::with_momentum(false);
    assert_eq!(
        (m.learning_rate, m.momentum, m.state_slots()),
        (0.01, 0.9, 1)
    );
    run("sgd momentum", &m, &SGD_MOMENTUM);
    run("sgd nesterov", &Sgd::with_momentum(true), &SGD_NESTEROV);
}

#[test]
fn rmsprop_matches_keras() {
    let r = RmsProp::default();
    assert_eq!(
        (r.learning_rate, r.rho, r.momentum, r.epsilon, r.centered),
        (1e-3, 0.9, 0.0, 1e-7, false)
    );
    assert_eq!(r.state_slots(), 1);
    run("rmsprop", &r, &RMSPROP);
    let rc = RmsProp {
        momentum: 0.9,
        centered: true,
        ..RmsProp::KERAS
    };
    assert_eq!(rc.state_slots(), 3);
    run("rmsprop momentum centered", &rc, &RMSPROP_MOMENTUM_CENTERED);
}

#[test]
fn adam_and_adamw_match_keras() {
    let a = Adam::default();
    assert_eq!(
        (a.learning_rate, a.beta_1, a.beta_2, a.epsilon),
        (1e-3, 0.9, 0.999, 1e-7)
    );
    assert_eq!(a.state_slots(), 2);
    run("adam", &a, &ADAM);
    let w = AdamW::default();
    assert_eq!(w.weight_decay, 0.004);
    assert_eq!(w.adam, Adam::KERAS);
    run("adamw", &w, &ADAMW);
}

#[test]
fn grad_unscale_equals_unscaled_gradients() {
    // Gradients scaled by 2^15 and unscaled by 2^-15 give bit-identical updates.
    let opts: Vec<Box<dyn Optimizer>> = vec![
        Box::new(Sgd::with_momentum(true)),
        Box::new(RmsProp {
            momentum: 0.5,
            centered: true,
            ..RmsProp::KERAS
        }),
        Box::new(Adam::KERAS),
        Box::new(AdamW::KERAS),
    ];
    for opt in &opts {
        let (mut p1, mut p2) = (P0.to_vec(), P0.to_vec());
        let mut s1: Vec<Vec<f32>> = (0..opt.state_slots()).map(|_| vec![0.0; 5]).collect();
        let mut s2 = s1.clone();
        for (t, g) in GRADS.iter().enumerate() {
            let scaled: Vec<f32> = g.iter().map(|v| v * 32768.0).collect();
            let mut v1: Vec<&mut [f32]> = s1.iter_mut().map(|s| s.as_mut_slice()).collect();
            let mut v2: Vec<&mut [f32]> = s2.iter_mut().map(|s| s.as_mut_slice()).collect();
            opt.update(t as u64 + 1, &mut p1, g, &mut v1, 1.0).unwrap();
            opt.update(t as u64 + 1, &mut p2, &scaled, &mut v2, 1.0 / 32768.0)
                .unwrap();
        }
        assert_eq!(bits(&p1), bits(&p2));
    }
}

#[test]
fn large_tensors_take_the_parallel_path_identically() {
    let mut rng = Rng::new(60);
    let n = 100_003;
    let p0 = rng.vec(n, -1.0, 1.0);
    let g = rng.vec(n, -1.0, 1.0);
    let opt = RmsProp {
        momentum: 0.9,
        centered: true,
        ..RmsProp::KERAS
    };
    let mut p = p0.clone();
    let mut st: Vec<Vec<f32>> = (0..3).map(|_| vec![0.0; n]).collect();
    let mut views: Vec<&mut [f32]> = st.iter_mut().map(|s| s.as_mut_slice()).collect();
    opt.update(1, &mut p, &g, &mut views, 1.0).unwrap();
    // Same element through the small (serial) path.
    for i in (0..n).step_by(977) {
        let mut q = [p0[i]];
        let mut s: Vec<Vec<f32>> = (0..3).map(|_| vec![0.0; 1]).collect();
        let mut v: Vec<&mut [f32]> = s.iter_mut().map(|x| x.as_mut_slice()).collect();
        opt.update(1, &mut q, &[g[i]], &mut v, 1.0).unwrap();
        assert_eq!(q[0].to_bits(), p[i].to_bits());
        assert_eq!(s[2][0].to_bits(), st[2][i].to_bits());
    }
}

#[test]
fn bad_arguments_are_errors() {
    let mut p = P0.to_vec();
    let mut a = [0f32; 5];
    let mut b = [0f32; 4];
    let adam = Adam::KERAS;
    assert!(adam
        .update(1, &mut p, &GRADS[0], &mut [&mut a[..]], 1.0)
        .is_err());
    let e = adam
        .update(1, &mut p, &GRADS[0], &mut [&mut a[..], &mut b[..]], 1.0)
        .unwrap_err();
    assert!(e.to_string().contains("state slot 1"), "{e}");
    let mut b5 = [0f32; 5];
    let e = adam
        .update(0, &mut p, &GRADS[0], &mut [&mut a[..], &mut b5[..]], 1.0)
        .unwrap_err();
    assert!(e.to_string().contains("1-based"), "{e}");
    assert!(Sgd::default()
        .update(1, &mut p, &GRADS[0][..4], &mut [], 1.0)
        .is_err());
    assert!(Sgd::default()
        .update(1, &mut p, &GRADS[0], &mut [&mut a[..]], 1.0)
        .is_err());
    // Nothing was written by the failed calls.
    assert_eq!(p, P0.to_vec());
    assert!(a.iter().all(|&v| v == 0.0));
}

#[test]
fn loss_scaler_follows_keras_schedule() {
    let mut s = LossScaler::default();
    assert_eq!(
        (
            s.scale,
            s.growth_interval,
            s.growth,
            s.backoff,
            s.good_steps
        ),
        (32768.0, 2000, 2.0, 0.5, 0)
    );
    // 1999 good steps: no growth yet; each reports 1/scale of the step's own scale.
    for _ in 0..1999 {
        assert_eq!(
            s.update(false),
            StepDecision::Apply {
                grad_unscale: 1.0 / 32768.0
            }
        );
    }
    assert_eq!(s.scale, 32768.0);
    // The 2000th good step still unscales by the old scale, then the scale doubles.
    assert_eq!(
        s.update(false),
        StepDecision::Apply {
            grad_unscale: 1.0 / 32768.0
        }
    );
    assert_eq!((s.scale, s.good_steps), (65536.0, 0));
    // Overflow: skip, halve, restart the count.
    for _ in 0..5 {
        s.update(false);
    }
    assert_eq!(s.update(true), StepDecision::Skip);
    assert_eq!((s.scale, s.good_steps, s.skipped_in_a_row), (32768.0, 0, 1));
    assert_eq!(s.update(true), StepDecision::Skip);
    assert_eq!((s.scale, s.skipped_in_a_row), (16384.0, 2));
    assert_eq!(
        s.update(false),
        StepDecision::Apply {
            grad_unscale: 1.0 / 16384.0
        }
    );
    assert_eq!(s.skipped_in_a_row, 0);
    // Never reaches 0 or inf.
    let mut t = LossScaler::new();
    for _ in 0..400 {
        t.update(true);
    }
    assert!(t.scale > 0.0);
    let mut u = LossScaler {
        scale: f32::MAX / 1.5,
        growth_interval: 1,
        ..LossScaler::new()
    };
    u.update(false);
    assert!(u.scale.is_finite());
    // Disabled scaler: scale 1 forever, still reports Skip on overflow.
    let mut d = LossScaler::disabled();
    for _ in 0..5000 {
        assert_eq!(d.update(false), StepDecision::Apply { grad_unscale: 1.0 });
    }
    assert_eq!(d.update(true), StepDecision::Skip);
    assert_eq!(d.scale(), 1.0);
}

#[test]
fn overflowing_step_leaves_params_and_state_bit_identical() {
    // The runtime protocol: check every gradient, ask the scaler, update only on Apply.
    let opt = Adam::KERAS;
    let mut scaler = LossScaler::new();
    let mut params = [P0.to_vec(), vec![0.25f32; 3]];
    let mut state: Vec<[Vec<f32>; 2]> = params
        .iter()
        .map(|p| [vec![0.0; p.len()], vec![0.0; p.len()]])
        .collect();
    let mut step = 0u64; // applied updates so far
    let mut apply = |grads: &[Vec<f32>],
                     params: &mut [Vec<f32>; 2],
                     state: &mut Vec<[Vec<f32>; 2]>,
                     scaler: &mut LossScaler| {
        let found_inf = !grads.iter().all(|g| all_finite(g));
        if let StepDecision::Apply { grad_unscale } = scaler.update(found_inf) {
            step += 1;
            for ((p, g), s) in params.iter_mut().zip(grads).zip(state.iter_mut()) {
                let [a, b] = s;
                opt.update(step, p, g, &mut [a, b], grad_unscale).unwrap();
            }
        }
    };
    let good: Vec<Vec<f32>> = vec![
        GRADS[0].iter().map(|g| g * 32768.0).collect(),
        vec![100.0; 3],
    ];
    apply(&good, &mut params, &mut state, &mut scaler);
    let snapshot: Vec<Vec<u32>> = params
        .iter()
        .map(|p| bits(p))
        .chain(state.iter().flat_map(|s| s.iter().map(|v| bits(v))))
        .collect();
    // Second tensor overflowed (f16 grads cast up would carry the inf): the whole step skips.
    let bad: Vec<Vec<f32>> = vec![GRADS[1].to_vec(), vec![1.0, f32::INFINITY, f32::NAN]];
    apply(&bad, &mut params, &mut state, &mut scaler);
    let after: Vec<Vec<u32>> = params
        .iter()
        .map(|p| bits(p))
        .chain(state.iter().flat_map(|s| s.iter().map(|v| bits(v))))
        .collect();
    assert_eq!(snapshot, after);
    assert_eq!(scaler.scale, 16384.0);
}
