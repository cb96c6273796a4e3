//! The roofline's inputs (`StaticPlan::cost`): FLOPs and bytes moved per step, checked by hand
//! on the MNIST MLP.
use memwise_plan::op::Op;
use memwise_plan::plan::Phase;
use memwise_plan::{plan, zoo};

#[test]
fn the_mlps_gemms_cost_one_product_per_gradient_they_write() {
    let p = plan(&zoo::mnist_mlp(128)).unwrap();
    let (hidden, logits) = (2 * 128 * 784 * 512u64, 2 * 128 * 512 * 10u64);
    let dense: u64 = p
        .steps
        .iter()
        .filter(|s| matches!(s.op, Op::Dense { .. }))
        .map(|s| p.step_cost(s).flops)
        .sum();
    // Forward both; backward: the hidden layer's weight gradient only (its input is the
    // pixels), the output layer's weight and input gradients.
    assert_eq!(dense, 2 * hidden + 3 * logits);
    assert!(p.cost().flops > dense, "the element-wise steps count too");
}

#[test]
fn a_step_moves_its_operands_results_and_weights_once() {
    let p = plan(&zoo::mnist_mlp(128)).unwrap();
    let fwd = p
        .steps
        .iter()
        .find(|s| {
            s.phase == Phase::Forward && &*s.layer == "hidden" && matches!(s.op, Op::Dense { .. })
        })
        .unwrap();
    let (x, y, w, b) = (128 * 784 * 4, 128 * 512 * 4, 784 * 512 * 4, 512 * 4);
    assert_eq!(p.step_cost(fwd).bytes, x + y + w + b);
    // RMSprop: the master and gradient, one slot read and written, per element: 5 × 4 bytes.
    let update: u64 = p
        .steps
        .iter()
        .filter(|s| s.phase == Phase::Update)
        .map(|s| p.step_cost(s).bytes)
        .sum();
    assert_eq!(update, 5 * 4 * p.params_count as u64);
    assert_eq!(
        p.cost(),
        p.steps
            .iter()
            .fold(Default::default(), |a, s| a + p.step_cost(s))
    );
}
