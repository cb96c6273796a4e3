//! Activation functions and their gradients: relu, sigmoid, tanh, gelu (exact erf form), silu,
//! and softmax over the last axis.
//!
//! What each backward reads (the planner keeps exactly that tensor alive):
//!
//! | op      | backward reads | why                                             |
//! |---------|----------------|-------------------------------------------------|
//! | relu    | output `y`     | `y > 0 ⇔ x > 0`, and `y` is usually live anyway |
//! | sigmoid | output `y`     | `σ' = y(1 − y)`                                 |
//! | tanh    | output `y`     | `tanh' = 1 − y²`                                |
//! | gelu    | input `x`      | no closed form in terms of `y`                  |
//! | silu    | input `x`      | `x σ(x)` is not invertible                      |
//! | softmax | output `y`     | `dx = y ⊙ (dy − Σ dy·y)`                        |
//!
//! In place: every forward has a `*_inplace` variant (output over input). For relu, sigmoid,
//! tanh and softmax that is always safe for training because the backward reads `y`; for gelu
//! and silu it is only usable when `x` is not needed later (inference, or `x` recomputed).
//! Every backward has a `*_backward_inplace` variant that writes `dx` over `dy`.
//! Activation gradients are OVERWRITTEN (`dx = …`), never accumulated.
//!
//! Pointwise kernels require equal slice lengths (see [`crate::elementwise`]). Arithmetic is
//! f32; storage is any [`Element`].

use crate::elementwise::{
    map1_inplace_with, map1_with, map2_inplace_with, map2_with, need, rows, same_len, sum_in_lanes,
    wide_loop,
};
use crate::fastmath::{exp_with, gelu_grad_with as gelu_grad, gelu_with as gelu};
use crate::gemm::is_f32;
use crate::{check_len, Element, KResult};

/// Numerically stable logistic: never evaluates `exp` of a positive number.
#[inline(always)]
pub(crate) fn sigmoid_f32(x: f32) -> f32 {
    if x >= 0.0 {
        1.0 / (1.0 + (-x).exp())
    } else {
        let e = x.exp();
        e / (1.0 + e)
    }
}

#[inline(always)]
fn silu_grad_f32(x: f32) -> f32 {
    let s = sigmoid_f32(x);
    s * (1.0 + x * (1.0 - s))
}

/// Defines forward, forward-in-place, backward, backward-in-place functions for one pointwise
/// activation, running the element functions of its [`Activation`] variant `$v` (declared
/// once, in the activations list below). `$saved` names what the backward reads (`y` or `x`).
macro_rules! pointwise_activation {
    ($name:literal, $fwd:ident, $fwd_ip:ident, $bwd:ident, $bwd_ip:ident,
     $saved:ident, $v:ident) => {
        #[doc = concat!("Forward ", $name, ": `y = f(x)`.")]
        pub fn $fwd<T: Element>(x: &[T], y: &mut [T]) -> KResult {
            same_len(stringify!($fwd), "x", x.len(), "y", y.len())?;
            map1_with(x, y, element::$v {});
            Ok(())
        }

        #[doc = concat!("Forward ", $name, " in place: `x = f(x)`.")]
        pub fn $fwd_ip<T: Element>(x: &mut [T]) {
            map1_inplace_with(x, element::$v {});
        }

        #[doc = concat!("Backward ", $name, " from saved `", stringify!($saved), "`: dx = f'·dy.")]
        pub fn $bwd<T: Element>($saved: &[T], dy: &[T], dx: &mut [T]) -> KResult {
            same_len(
                stringify!($bwd),
                stringify!($saved),
                $saved.len(),
                "dy",
                dy.len(),
            )?;
            same_len(stringify!($bwd), "dy", dy.len(), "dx", dx.len())?;
            map2_with($saved, dy, dx, element::$v {});
            Ok(())
        }

        #[doc = concat!("Backward ", $name, " writing `dx` over `dy`.")]
        pub fn $bwd_ip<T: Element>($saved: &[T], dy_dx: &mut [T]) -> KResult {
            same_len(
                stringify!($bwd_ip),
                stringify!($saved),
                $saved.len(),
                "dy",
                dy_dx.len(),
            )?;
            map2_inplace_with($saved, dy_dx, element::$v {});
            Ok(())
        }
    };
}

#[inline(always)]
fn relu_f32(x: f32) -> f32 {
    if x > 0.0 {
        x
    } else {
        0.0
    }
}

#[inline(always)]
fn relu_grad(y: f32, dy: f32) -> f32 {
    if y > 0.0 {
        dy
    } else {
        0.0
    }
}

pointwise_activation!(
    "relu",
    relu_forward,
    relu_inplace,
    relu_backward,
    relu_backward_inplace,
    y,
    Relu
);

pointwise_activation!(
    "sigmoid",
    sigmoid_forward,
    sigmoid_inplace,
    sigmoid_backward,
    sigmoid_backward_inplace,
    y,
    Sigmoid
);

pointwise_activation!(
    "tanh",
    tanh_forward,
    tanh_inplace,
    tanh_backward,
    tanh_backward_inplace,
    y,
    Tanh
);

pointwise_activation!(
    "gelu (exact: x·Φ(x) with erf, Keras `approximate=False` / PyTorch default)",
    gelu_forward,
    gelu_inplace,
    gelu_backward,
    gelu_backward_inplace,
    x,
    Gelu
);

pointwise_activation!(
    "silu (swish): x·σ(x)",
    silu_forward,
    silu_inplace,
    silu_backward,
    silu_backward_inplace,
    x,
    Silu
);

/// Which tensor an activation's backward reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Saved {
    /// Nothing (linear: `dx = dy`).
    Nothing,
    /// The forward input `x`.
    Input,
    /// The forward output `y`.
    Output,
}

/// Declares the pointwise activations, one line each: the variant (and the parameter it
/// carries), its name — the planner's activation of the same name runs it, and its position
/// in this list is its CUDA code (`MW_ACT_*` in activation.cu) —, what its backward reads,
/// `f(x)` and `dx(saved, dy)`. Generates [`Activation`] and its dispatch, so the executors
/// name no activation.
macro_rules! pointwise_activations {
    ($($(#[$doc:meta])* $v:ident $({ $p:ident })? = $name:literal, saved $saved:ident,
       |$x:ident| $f:expr, |$s:tt, $dy:ident| $g:expr;)*) => {
        /// Each activation's element functions as a type of its own whose methods are
        /// `#[inline(always)]`, so that its loops run 8 lanes wide on AVX2
        /// ([`crate::elementwise::Unary::WIDE`]).
        mod element {
            use super::*;
            use crate::elementwise::{Binary, Unary};

            $(
                #[derive(Clone, Copy)]
                pub(super) struct $v { $(pub(super) $p: f32,)? }

                impl Unary for $v {
                    const WIDE: bool = true;
                    #[inline(always)]
                    fn apply<const FMA: bool>(&self, $x: f32) -> f32 {
                        let $v { $($p)? } = *self;
                        $f
                    }
                }

                impl Binary for $v {
                    const WIDE: bool = true;
                    #[inline(always)]
                    fn apply<const FMA: bool>(&self, $s: f32, $dy: f32) -> f32 {
                        let $v { $($p)? } = *self;
                        $g
                    }
                }
            )*
        }

        /// A pointwise activation chosen at run time (what a layer's `activation = …` names),
        /// so the executor can dispatch without matching on names. Softmax is not here: it
        /// needs the row length; call [`softmax_forward`] directly.
        #[derive(Debug, Clone, Copy, PartialEq)]
        pub enum Activation {
            $($(#[$doc])* $v $({ $p: f32 })?,)*
        }

        impl Activation {
            /// Every name, in CUDA-code order.
            pub const NAMES: &'static [&'static str] = &[$($name),*];

            /// The activation called `name`, with `param` as its parameter (ignored by those
            /// that take none); `None` for a name not listed.
            pub fn from_name(name: &str, param: f32) -> Option<Activation> {
                let _ = param; // read only by the activations that take a parameter
                match name {
                    $($name => Some(Activation::$v $({ $p: param })?),)*
                    _ => None,
                }
            }

            pub fn name(self) -> &'static str {
                match self {
                    $(Activation::$v { .. } => $name,)*
                }
            }

            /// Its parameter (0 when it takes none).
            pub fn param(self) -> f32 {
                match self {
                    $(Activation::$v $({ $p })? => 0.0 $(+ $p)?,)*
                }
            }

            /// What the backward reads; the planner keeps it alive until the backward step.
            pub fn saved(self) -> Saved {
                match self {
                    $(Activation::$v { .. } => Saved::$saved,)*
                }
            }

            fn forward_map<T: Element>(self, x: &[T], y: &mut [T]) {
                match self {
                    $(Activation::$v $({ $p })? => map1_with(x, y, element::$v { $($p)? }),)*
                }
            }

            fn forward_map_inplace<T: Element>(self, x: &mut [T]) {
                match self {
                    $(Activation::$v $({ $p })? => map1_inplace_with(x, element::$v { $($p)? }),)*
                }
            }

            fn backward_map<T: Element>(self, saved: &[T], dy: &[T], dx: &mut [T]) {
                match self {
                    $(Activation::$v $({ $p })? => map2_with(saved, dy, dx, element::$v { $($p)? }),)*
                }
            }

            fn backward_map_inplace<T: Element>(self, saved: &[T], dy_dx: &mut [T]) {
                match self {
                    $(Activation::$v $({ $p })? => map2_inplace_with(saved, dy_dx, element::$v { $($p)? }),)*
                }
            }
        }
    };
}

pointwise_activations! {
    /// `y = x` (its in-place forms do nothing).
    Linear = "linear", saved Nothing, |x| x, |_, dy| dy;
    Relu = "relu", saved Output, |x| relu_f32(x), |y, dy| relu_grad(y, dy);
    Sigmoid = "sigmoid", saved Output, |x| sigmoid_f32(x), |y, dy| dy * y * (1.0 - y);
    Tanh = "tanh", saved Output, |x| x.tanh(), |y, dy| dy * (1.0 - y * y);
    Gelu = "gelu", saved Input, |x| gelu::<FMA>(x), |x, dy| dy * gelu_grad::<FMA>(x);
    Silu = "silu", saved Input, |x| x * sigmoid_f32(x), |x, dy| dy * silu_grad_f32(x);
    /// `alpha·x` below 0. With `alpha ≥ 0` (the planner checks it) `y > 0` exactly when
    /// `x > 0`, so the backward reads `y` and the forward may run in place.
    LeakyRelu { alpha } = "leaky_relu", saved Output,
        |x| if x > 0.0 { x } else { alpha * x },
        |y, dy| if y > 0.0 { dy } else { alpha * dy };
    /// `alpha·(eˣ − 1)` below 0 (`exp_m1`: exact near 0), whose derivative there is
    /// `alpha·eˣ = y + alpha`, a function of `y`.
    Elu { alpha } = "elu", saved Output,
        |x| if x > 0.0 { x } else { alpha * x.exp_m1() },
        |y, dy| if y > 0.0 { dy } else { dy * (y + alpha) };
}

impl Activation {
    /// `true` when an in-place forward still leaves the backward what it reads.
    pub fn inplace_safe_for_training(self) -> bool {
        self.saved() != Saved::Input
    }

    /// The code the CUDA kernels take for it (`MW_ACT_*` in activation.cu): its position in
    /// [`Activation::NAMES`].
    pub fn code(self) -> i32 {
        Self::NAMES
            .iter()
            .position(|n| *n == self.name())
            .expect("every activation is named") as i32
    }

    /// Forward, out of place (linear copies).
    pub fn forward<T: Element>(self, x: &[T], y: &mut [T]) -> KResult {
        same_len("activation forward", "x", x.len(), "y", y.len())?;
        self.forward_map(x, y);
        Ok(())
    }

    /// Forward in place (linear does nothing).
    pub fn forward_inplace<T: Element>(self, x: &mut [T]) {
        if self != Activation::Linear {
            self.forward_map_inplace(x);
        }
    }

    /// Backward; `saved` is `y` or `x` per [`Activation::saved`] (ignored for linear).
    pub fn backward<T: Element>(self, saved: &[T], dy: &[T], dx: &mut [T]) -> KResult {
        same_len("activation backward", "dy", dy.len(), "dx", dx.len())?;
        if self == Activation::Linear {
            return crate::elementwise::cast(dy, dx);
        }
        same_len("activation backward", "saved", saved.len(), "dy", dy.len())?;
        self.backward_map(saved, dy, dx);
        Ok(())
    }

    /// Backward writing `dx` over `dy` (linear does nothing).
    pub fn backward_inplace<T: Element>(self, saved: &[T], dy_dx: &mut [T]) -> KResult {
        if self == Activation::Linear {
            return Ok(());
        }
        same_len(
            "activation backward",
            "saved",
            saved.len(),
            "dy",
            dy_dx.len(),
        )?;
        self.backward_map_inplace(saved, dy_dx);
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// softmax over the last axis
// ---------------------------------------------------------------------------------------------

fn softmax_dims(op: &str, a: (&str, usize), b: (&str, usize), rows: usize, cols: usize) -> KResult {
    let len = rows.saturating_mul(cols);
    need(op, a.0, a.1, len)?;
    need(op, b.0, b.1, len)
}

/// The shift for a stable softmax row: its max, or 0 when the max is not finite. A fully
/// masked row (all −inf) would give NaN from (−inf) − (−inf): shifting by 0 instead makes every
/// exp 0 and the row comes out as zeros. A NaN or +inf input still makes NaN (sum NaN, or
/// inf · 0), so the loss scaler's finite check sees it. The max is taken in eight lanes by
/// comparison, which skips NaN as `f32::max` does but vectorises.
#[inline(always)]
fn softmax_shift<I: Element>(x: &[I]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 8];
    let chunks = x.chunks_exact(8);
    let mut max = f32::NEG_INFINITY;
    for v in chunks.remainder() {
        let v = v.to_f32();
        max = if v > max { v } else { max };
    }
    for c in chunks {
        for (m, v) in lanes.iter_mut().zip(c) {
            let v = v.to_f32();
            *m = if v > *m { v } else { *m };
        }
    }
    for m in lanes {
        max = if m > max { m } else { max };
    }
    if max.is_finite() {
        max
    } else {
        0.0
    }
}

#[inline(always)]
fn inv_sum(sum: f32) -> f32 {
    if sum == 0.0 {
        0.0
    } else {
        1.0 / sum
    }
}

wide_loop! {
    /// One softmax row from `src` (or from `dst` itself when `None`), with the branch-free
    /// exponential ([`exp_with`]) so that its loops vectorise. An f32 output holds the
    /// exponentials exactly, so they are stored and then scaled (one `exp` per element); a
    /// half output would round them twice, so there the `exp` is recomputed instead. Both
    /// give the same value: `O::from_f32(exp(x − shift) · (1 / Σ))`. Half types run the
    /// baseline copy: their conversions are calls, which cost the wide copies more.
    fn softmax_row<I: Element, O: Element>(src: Option<&[I]>, dst: &mut [O])
    wide if is_f32::<I>() && is_f32::<O>(), fused FMA, {
        let n = dst.len();
        let src = src.map(|x| &x[..n]);
        let shift = match src {
            Some(x) => softmax_shift(x),
            None => softmax_shift(dst),
        };
        let exp = |v: f32| exp_with::<FMA>(v - shift);
        if std::mem::size_of::<O>() == 4 {
            match src {
                Some(x) => dst.iter_mut().zip(x).for_each(|(o, v)| *o = O::from_f32(exp(v.to_f32()))),
                None => dst.iter_mut().for_each(|o| *o = O::from_f32(exp(o.to_f32()))),
            }
            let inv = inv_sum(sum_in_lanes(dst, |e| e));
            dst.iter_mut().for_each(|o| *o = O::from_f32(o.to_f32() * inv));
        } else {
            let inv = match src {
                Some(x) => inv_sum(sum_in_lanes(x, exp)),
                None => inv_sum(sum_in_lanes(dst, exp)),
            };
            match src {
                Some(x) => dst.iter_mut().zip(x).for_each(|(o, v)| *o = O::from_f32(exp(v.to_f32()) * inv)),
                None => dst.iter_mut().for_each(|o| *o = O::from_f32(exp(o.to_f32()) * inv)),
            }
        }
    }
}

/// Softmax over the last axis of a `[rows, cols]` tensor: `y = exp(x − max) / Σ exp(x − max)`
/// (max-shifted, so no overflow). Input and output types may differ (f16 scores in, f32
/// probabilities out). A row of all −inf gives zeros; NaN or +inf inputs give NaN outputs.
pub fn softmax_forward<I: Element, O: Element>(
    x: &[I],
    y: &mut [O],
    rows_n: usize,
    cols: usize,
) -> KResult {
    softmax_dims(
        "softmax_forward",
        ("x", x.len()),
        ("y", y.len()),
        rows_n,
        cols,
    )?;
    rows(&mut y[..rows_n * cols], cols, 3 * cols, |r, yr| {
        softmax_row(Some(&x[r * cols..(r + 1) * cols]), yr);
    });
    Ok(())
}

/// Softmax over the last axis, in place (`x` becomes `y`).
pub fn softmax_inplace<T: Element>(x: &mut [T], rows_n: usize, cols: usize) -> KResult {
    check_len("softmax_inplace: x", x.len(), rows_n.saturating_mul(cols))?;
    rows(&mut x[..rows_n * cols], cols, 3 * cols, |_, xr| {
        softmax_row::<T, T>(None, xr);
    });
    Ok(())
}

/// Softmax backward from the output: `dx = y ⊙ (dy − Σ_j dy_j y_j)` per row (overwritten).
/// `y`, `dy` and `dx` may each have their own element type.
pub fn softmax_backward<Y: Element, G: Element, D: Element>(
    y: &[Y],
    dy: &[G],
    dx: &mut [D],
    rows_n: usize,
    cols: usize,
) -> KResult {
    softmax_dims(
        "softmax_backward",
        ("y", y.len()),
        ("dy", dy.len()),
        rows_n,
        cols,
    )?;
    check_len(
        "softmax_backward: dx",
        dx.len(),
        rows_n.saturating_mul(cols),
    )?;
    rows(&mut dx[..rows_n * cols], cols, 2 * cols, |r, dxr| {
        let yr = &y[r * cols..(r + 1) * cols];
        let gr = &dy[r * cols..(r + 1) * cols];
        let dot: f32 = yr
            .iter()
            .zip(gr)
            .map(|(a, b)| a.to_f32() * b.to_f32())
            .sum();
        for ((o, a), b) in dxr.iter_mut().zip(yr).zip(gr) {
            *o = D::from_f32(a.to_f32() * (b.to_f32() - dot));
        }
    });
    Ok(())
}

/// Softmax backward writing `dx` over `dy`.
pub fn softmax_backward_inplace<Y: Element, G: Element>(
    y: &[Y],
    dy_dx: &mut [G],
    rows_n: usize,
    cols: usize,
) -> KResult {
    softmax_dims(
        "softmax_backward_inplace",
        ("y", y.len()),
        ("dy", dy_dx.len()),
        rows_n,
        cols,
    )?;
    rows(&mut dy_dx[..rows_n * cols], cols, 2 * cols, |r, gr| {
        let yr = &y[r * cols..(r + 1) * cols];
        let dot: f32 = yr
            .iter()
            .zip(gr.iter())
            .map(|(a, b)| a.to_f32() * b.to_f32())
            .sum();
        for (g, a) in gr.iter_mut().zip(yr) {
            *g = G::from_f32(a.to_f32() * (g.to_f32() - dot));
        }
    });
    Ok(())
}
