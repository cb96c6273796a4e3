//! How the planner splits long GPU reductions (issue 14): which reductions get row parts, how
//! many, and the f64 partial sums it reserves for them in the op's scratch, so that the
//! estimate counts what the CUDA kernels will write.

use memwise_plan::op::{loss_parts_scratch_f32, COLUMN_PART_BLOCKS, MIN_PART_ROWS, PART_MIN_ELEMS};
use memwise_plan::{
    column_parts, column_parts_scratch_f32, loss_value_parts, plan, DType, Op, Window2d,
};

#[test]
fn a_narrow_long_reduction_fills_twice_the_sms_and_a_short_one_stays_whole() {
    // The convnet's first batch norms: 50,176 rows of 32 channels were one block.
    assert_eq!(column_parts(50_176, 32, 1), COLUMN_PART_BLOCKS);
    // 64 channels (2 strips) over 12,544 rows: 132 parts make 264 blocks.
    assert_eq!(column_parts(12_544, 64, 1), 132);
    // The MNIST MLP's hidden bias: 128 rows × 512 = 16 strips of 4,096 elements each.
    assert_eq!(column_parts(128, 512, 1), 1);
    // A depthwise weight gradient: 9 taps × 1 strip, 50,176 positions.
    assert_eq!(column_parts(50_176, 32, 9), COLUMN_PART_BLOCKS.div_ceil(9));
    // Enough strips already: never split.
    assert_eq!(column_parts(1 << 20, 32 * COLUMN_PART_BLOCKS, 1), 1);
    // At most one part per MIN_PART_ROWS rows (2,048 rows of one strip: 32 parts).
    let rows = 2 * PART_MIN_ELEMS / 32;
    assert_eq!(column_parts(rows, 32, 1), rows / MIN_PART_ROWS);
    // Exactly at the threshold a strip sums alone.
    assert_eq!(column_parts(PART_MIN_ELEMS, 1, 1), 1);
    assert!(column_parts(PART_MIN_ELEMS + MIN_PART_ROWS, 1, 1) > 1);
    // Degenerate shapes do not divide by zero.
    assert_eq!(column_parts(0, 0, 0), 1);
}

#[test]
fn partial_sums_are_f64_per_part_y_column_and_sum() {
    let parts = column_parts(50_176, 32, 1);
    assert_eq!(
        column_parts_scratch_f32(50_176, 32, 1, 2),
        2 * parts * 32 * 2
    );
    assert_eq!(column_parts_scratch_f32(128, 512, 1, 1), 0);
    let bn = Op::BatchNorm {
        rows: 50_176,
        channels: 32,
        momentum: 0.99,
        epsilon: 1e-3,
        rebuild_x_hat: false,
    };
    assert_eq!(bn.scratch_f32_elems(DType::F32), 2 * 264 * 32 * 2);
    assert_eq!(bn.scratch_f32_elems(DType::F16), 2 * 264 * 32 * 2);
    // A rebuilding layer norm keeps its row means first, then the partial sums 8-byte aligned.
    let ln = |rows, rebuild_x_hat| Op::LayerNorm {
        rows,
        features: 16,
        epsilon: 1e-3,
        rebuild_x_hat,
    };
    let parts = column_parts_scratch_f32(36_865, 16, 1, 2);
    assert!(parts > 0);
    assert_eq!(ln(36_865, false).scratch_f32_elems(DType::F32), parts);
    assert_eq!(
        ln(36_865, true).scratch_f32_elems(DType::F32),
        36_866 + parts
    );
    assert_eq!(ln(100, true).scratch_f32_elems(DType::F32), 100);
    // A depthwise op reserves the larger of its weight's and its bias's partial sums.
    let d = Window2d {
        n: 64,
        h: 28,
        w: 28,
        c_in: 32,
        c_out: 32,
        kh: 3,
        kw: 3,
        sh: 1,
        sw: 1,
        padding: memwise_plan::Padding::Same,
    };
    let dw = Op::DepthwiseConv2d {
        dims: d,
        bias: true,
    };
    let weight = column_parts_scratch_f32(50_176, 32, 9, 1);
    let bias = column_parts_scratch_f32(50_176, 32, 1, 1);
    assert_eq!(dw.scratch_f32_elems(DType::F32), weight.max(bias));
}

#[test]
fn a_large_loss_value_is_split_one_block_per_4096_elements() {
    // The GPT's next-byte loss: 2,048 rows × 256 classes.
    assert_eq!(loss_value_parts(2048 * 256, 2048), 128);
    // The VAE's reconstruction: 128 × 784 elements, capped at twice the SMs.
    assert_eq!(
        loss_value_parts(128 * 784 * 16, 128 * 784 * 16),
        COLUMN_PART_BLOCKS
    );
    // The MNIST MLP's loss: one block as before, no scratch.
    assert_eq!(loss_value_parts(128 * 10, 128), 1);
    assert_eq!(loss_parts_scratch_f32(128 * 10, 128), 0);
    // No more blocks than rows.
    assert_eq!(loss_value_parts(8 * 100_000, 8), 8);
    assert_eq!(loss_parts_scratch_f32(2048 * 256, 2048), 2 * 3 * 128);
}

/// Every step of a plan gets the scratch its op asks for: the partial sums are in the plan,
/// hence in the estimate.
#[test]
fn the_plan_reserves_the_partial_sums_in_each_steps_scratch() {
    let spec = memwise_plan::zoo::conv_vae(64);
    let p = plan(&spec).unwrap();
    let mut split = 0;
    for s in p.steps.iter() {
        let want = s.op.column_reduction_scratch_f32();
        if want == 0 || s.writes.len() < 2 {
            continue;
        }
        split += 1;
        let scratch = s.writes[s.writes.len() - 1];
        let t = &p.tensors[scratch as usize];
        assert!(
            t.elems() >= want,
            "step {} ({}) has {} f32 of scratch for {want} of partial sums",
            s.index,
            s.op.name(),
            t.elems()
        );
    }
    assert!(
        split > 0,
        "no step of the VAE at batch 64 splits a reduction"
    );
}
