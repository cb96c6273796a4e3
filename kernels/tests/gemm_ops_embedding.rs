//! `embedding` module: gather forward (f32 / half tables and outputs), scatter-add backward
//! against finite differences and a naive loop with repeated ids, id range errors.
mod gemm_ops_common;

use gemm_ops_common::*;
use half::{bf16, f16};
use memwise_kernels::embedding::*;
use memwise_kernels::Element;

fn fwd<W: Element, T: Element>(d: EmbeddingDims, ids: &[i32], w: &[f32]) -> Vec<f32> {
    let mut y = vec![T::from_f32(f32::NAN); d.tokens * d.dim];
    embedding_forward(d, ids, &to_t::<W>(w), &mut y).unwrap();
    to_f32(&y)
}

fn ids(rng: &mut Rng, d: EmbeddingDims) -> Vec<i32> {
    // a small vocab makes repeated ids certain
    (0..d.tokens).map(|_| rng.below(d.vocab) as i32).collect()
}

const SHAPES: &[(usize, usize, usize)] = &[(1, 1, 1), (13, 7, 5), (29, 3, 70), (200, 97, 3)];

fn dims(&(tokens, vocab, dim): &(usize, usize, usize)) -> EmbeddingDims {
    EmbeddingDims { tokens, vocab, dim }
}

#[test]
fn embedding_forward_gathers_rows_in_any_storage() {
    let mut rng = Rng::new(61);
    for sh in SHAPES {
        let d = dims(sh);
        let ids = ids(&mut rng, d);
        let w = rng.vec(d.vocab * d.dim);
        let want: Vec<f64> = ids
            .iter()
            .flat_map(|&i| {
                w[i as usize * d.dim..(i as usize + 1) * d.dim]
                    .iter()
                    .map(|&v| v as f64)
            })
            .collect();
        assert_close("f32", &fwd::<f32, f32>(d, &ids, &w), &want, 0.0, 0.0);
        let wr: Vec<f64> = want.iter().map(|&v| f16::from_f64(v).to_f64()).collect();
        assert_close(
            "f32 table → f16",
            &fwd::<f32, f16>(d, &ids, &w),
            &wr,
            0.0,
            0.0,
        );
        assert_close(
            "f16 table → f16",
            &fwd::<f16, f16>(d, &ids, &w),
            &wr,
            0.0,
            0.0,
        );
        let wb: Vec<f64> = want.iter().map(|&v| bf16::from_f64(v).to_f64()).collect();
        assert_close(
            "bf16 table → f32",
            &fwd::<bf16, f32>(d, &ids, &w),
            &wb,
            0.0,
            0.0,
        );
    }
}

#[test]
fn embedding_backward_scatter_adds_and_matches_finite_differences() {
    let mut rng = Rng::new(62);
    for sh in SHAPES {
        let d = dims(sh);
        let ids = ids(&mut rng, d);
        let (w, r) = (rng.vec(d.vocab * d.dim), rng.vec(d.tokens * d.dim));
        let dw0 = rng.vec(d.vocab * d.dim);
        let mut dw = dw0.clone();
        embedding_backward(d, &ids, &r, &mut dw).unwrap();
        // naive: in token order, onto the existing gradient
        let mut want: Vec<f64> = dw0.iter().map(|&v| v as f64).collect();
        for (t, &i) in ids.iter().enumerate() {
            for c in 0..d.dim {
                want[i as usize * d.dim + c] += r[t * d.dim + c] as f64;
            }
        }
        assert_close("scatter", &dw, &want, 1e-6, 1e-6);
        let g: Vec<f32> = dw.iter().zip(&dw0).map(|(a, b)| a - b).collect();
        check_grad("dw", &w, &g, &mut rng, 40, &mut |p| {
            dot(&fwd::<f32, f32>(d, &ids, p), &r)
        });
        // half dy accumulates into the f32 master gradient
        let mut dwh = vec![0f32; d.vocab * d.dim];
        embedding_backward(d, &ids, &to_t::<bf16>(&r), &mut dwh).unwrap();
        let mut dwr = vec![0f32; d.vocab * d.dim];
        embedding_backward(d, &ids, &rounded::<bf16>(&r), &mut dwr).unwrap();
        assert_eq!(dwh, dwr);
    }
}

#[test]
fn embedding_rejects_out_of_range_ids_without_writing() {
    let d = EmbeddingDims {
        tokens: 4,
        vocab: 10,
        dim: 3,
    };
    let w = vec![1f32; 30];
    let mut y = vec![0f32; 12];
    let err = embedding_forward(d, &[1, 2, 10, 3], &w, &mut y).unwrap_err();
    assert!(
        err.0.contains("id 10") && err.0.contains("vocab 10"),
        "{err}"
    );
    let err = embedding_forward(d, &[-1, 2, 0, 3], &w, &mut y).unwrap_err();
    assert!(err.0.contains("id -1"), "{err}");
    assert!(y.iter().all(|&v| v == 0.0));
    let mut dw = vec![0f32; 30];
    let err = embedding_backward(d, &[0, 0, 0, 11], &y, &mut dw).unwrap_err();
    assert!(
        err.0.contains("id 11") && err.0.contains("vocab 10"),
        "{err}"
    );
    assert!(dw.iter().all(|&v| v == 0.0));
    // short slices
    assert!(embedding_forward(d, &[0, 1, 2], &w, &mut y).is_err());
    assert!(embedding_forward(d, &[0, 1, 2, 3], &w[1..], &mut y).is_err());
    assert!(embedding_forward(d, &[0, 1, 2, 3], &w, &mut y[1..]).is_err());
    assert!(embedding_backward(d, &[0, 1, 2, 3], &y[1..], &mut dw).is_err());
    assert!(embedding_backward(d, &[0, 1, 2, 3], &y, &mut dw[1..]).is_err());
}

/// The positional embedding: `x + table` per sample (out of place, in place bit-identical, half
/// storage through f32), the table's gradient against central differences of `Σ y·r`
/// (accumulated onto what it held), the input's gradient `r` itself, and short slices refused.
#[test]
fn positional_embedding_adds_the_table_to_every_sample_and_sums_its_gradient() {
    let mut rng = Rng::new(71);
    for (batch, seq, dim) in [(1usize, 1usize, 1usize), (3, 5, 7), (4, 16, 64)] {
        let len = seq * dim;
        let what = format!("positional {batch}x{seq}x{dim}");
        let x = rng.vec(batch * len);
        let table = rng.vec(len);
        let mut y = vec![f32::NAN; batch * len];
        positional_embedding_forward(batch, len, &x, &table, &mut y).unwrap();
        let want: Vec<f64> = (0..batch * len)
            .map(|i| x[i] as f64 + table[i % len] as f64)
            .collect();
        assert_close(&what, &y, &want, 1e-6, 1e-6);
        let mut ip = x.clone();
        positional_embedding_forward_inplace(batch, len, &mut ip, &table).unwrap();
        assert_eq!(ip, y, "{what} in place");
        let mut yh = vec![f16::ZERO; batch * len];
        positional_embedding_forward(batch, len, &to_t::<f16>(&x), &table, &mut yh).unwrap();
        let want_h: Vec<f32> = to_t::<f16>(&x)
            .iter()
            .enumerate()
            .map(|(i, v)| f16::from_f32(v.to_f32() + table[i % len]).to_f32())
            .collect();
        assert_eq!(to_f32(&yh), want_h, "{what} f16");

        let r = rng.vec(batch * len);
        let start = rng.vec(len);
        let mut dtable = start.clone();
        positional_embedding_backward(batch, len, &r, &mut dtable).unwrap();
        let grad: Vec<f32> = dtable.iter().zip(&start).map(|(a, b)| a - b).collect();
        check_grad(
            &format!("{what} dtable"),
            &table,
            &grad,
            &mut rng,
            20,
            &mut |t| {
                let mut yp = vec![0f32; batch * len];
                positional_embedding_forward(batch, len, &x, t, &mut yp).unwrap();
                dot(&yp, &r)
            },
        );
        // dx = dy: the objective's gradient in x is r.
        check_grad(&format!("{what} dx"), &x, &r, &mut rng, 20, &mut |xp| {
            let mut yp = vec![0f32; batch * len];
            positional_embedding_forward(batch, len, xp, &table, &mut yp).unwrap();
            dot(&yp, &r)
        });
    }
    let mut y = vec![0f32; 6];
    let e = positional_embedding_forward(2, 3, &[0f32; 6], &[0f32; 2], &mut y).unwrap_err();
    assert!(e.to_string().contains("table"), "{e}");
    let mut dt = vec![0f32; 3];
    assert!(positional_embedding_backward(2, 3, &[0f32; 5], &mut dt).is_err());
}
