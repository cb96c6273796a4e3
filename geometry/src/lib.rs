//! The window geometry the planner and the kernels share: Keras/TensorFlow padding, the
//! output-length and padding rule of a convolution or pooling window, and [`Window2d`], the
//! shape of one 2-D window op. The planner sizes tensors with these and the kernels index
//! with them, so both compute every output extent and offset by the one rule written here.
//! (A crate of its own because the planner must stay free of device code and the kernels free
//! of planning: this is what both may depend on.)
#![forbid(unsafe_code)]

/// Keras / TensorFlow padding of a convolution or pooling window.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Padding {
    /// Output `ceil(in / stride)`; the input is padded by `max((out − 1)·stride + k − in, 0)`,
    /// half before (rounded down) and the rest after, as TensorFlow does.
    Same,
    /// No padding: output `(in − kernel) / stride + 1`, `0` when the window does not fit.
    Valid,
}

impl Padding {
    /// Both paddings, in the order the DSL lists them.
    pub const ALL: [Padding; 2] = [Padding::Valid, Padding::Same];

    pub const fn name(self) -> &'static str {
        match self {
            Padding::Same => "same",
            Padding::Valid => "valid",
        }
    }
}

/// `(out, pad_before)` along one axis of a window of `kernel` taps moved by `stride`
/// (TensorFlow's rule, see [`Padding`]); `(0, 0)` when the window does not fit.
pub const fn window_axis(
    input: usize,
    kernel: usize,
    stride: usize,
    padding: Padding,
) -> (usize, usize) {
    let out = out_len(input, kernel, stride, padding);
    if out == 0 {
        return (0, 0);
    }
    let reach = (out - 1).saturating_mul(stride).saturating_add(kernel);
    (out, reach.saturating_sub(input) / 2)
}

/// Output length along one axis (TensorFlow's rule, see [`Padding`]; `0` if the window does
/// not fit or the stride is 0).
pub const fn out_len(input: usize, kernel: usize, stride: usize, padding: Padding) -> usize {
    if stride == 0 {
        return 0;
    }
    match padding {
        Padding::Same => input.div_ceil(stride),
        Padding::Valid => {
            if kernel > input {
                0
            } else {
                (input - kernel) / stride + 1
            }
        }
    }
}

/// Output length of a transposed convolution along one axis, Keras's rule: `in·stride` (same)
/// or `(in − 1)·stride + max(kernel, stride)` (valid), saturating at `usize::MAX`.
pub const fn transpose_out_len(
    input: usize,
    kernel: usize,
    stride: usize,
    padding: Padding,
) -> usize {
    match padding {
        Padding::Same => input.saturating_mul(stride),
        Padding::Valid => input
            .saturating_sub(1)
            .saturating_mul(stride)
            .saturating_add(if kernel > stride { kernel } else { stride }),
    }
}

/// Shape of one 2-D window op over NHWC tensors — a convolution
/// `x[n, h, w, c_in] ⋆ W[kh, kw, c_in, c_out] → y[n, out_h, out_w, c_out]`, or a pooling
/// (`c_in == c_out`) — with its strides and padding.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Window2d {
    pub n: usize,
    pub h: usize,
    pub w: usize,
    pub c_in: usize,
    pub c_out: usize,
    pub kh: usize,
    pub kw: usize,
    pub sh: usize,
    pub sw: usize,
    pub padding: Padding,
}

impl Window2d {
    /// Output rows (TensorFlow's rule).
    pub const fn out_h(&self) -> usize {
        out_len(self.h, self.kh, self.sh, self.padding)
    }
    /// Output columns.
    pub const fn out_w(&self) -> usize {
        out_len(self.w, self.kw, self.sw, self.padding)
    }
    /// Zero rows padded above the input.
    pub const fn pad_top(&self) -> usize {
        window_axis(self.h, self.kh, self.sh, self.padding).1
    }
    /// Zero columns padded left of the input.
    pub const fn pad_left(&self) -> usize {
        window_axis(self.w, self.kw, self.sw, self.padding).1
    }
    /// Output rows of the transposed convolution with this shape (Keras's rule).
    pub const fn transpose_out_h(&self) -> usize {
        transpose_out_len(self.h, self.kh, self.sh, self.padding)
    }
    /// Output columns of the transposed convolution.
    pub const fn transpose_out_w(&self) -> usize {
        transpose_out_len(self.w, self.kw, self.sw, self.padding)
    }
    /// A 1×1 window with stride 1: a convolution is then a plain GEMM over the pixels.
    pub const fn is_pointwise(&self) -> bool {
        self.kh == 1 && self.kw == 1 && self.sh == 1 && self.sw == 1
    }
    /// Elements of `x` (and `dx`): `n·h·w·c_in`.
    pub const fn x_len(&self) -> usize {
        self.n * self.h * self.w * self.c_in
    }
    /// Elements of `y` (and `dy`): `n·out_h·out_w·c_out`.
    pub const fn y_len(&self) -> usize {
        self.n * self.out_h() * self.out_w() * self.c_out
    }
    /// Elements of a convolution's weight (and its gradient): `kh·kw·c_in·c_out`.
    pub const fn w_len(&self) -> usize {
        self.kh * self.kw * self.c_in * self.c_out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_padding_puts_the_odd_pixel_after() {
        // 5 wide, 3 taps, stride 2: out 3, reach 7, pad 2 → 1 before, 1 after.
        assert_eq!(window_axis(5, 3, 2, Padding::Same), (3, 1));
        // 4 wide, 3 taps, stride 2: out 2, reach 5, pad 1 → 0 before, 1 after.
        assert_eq!(window_axis(4, 3, 2, Padding::Same), (2, 0));
        assert_eq!(window_axis(4, 5, 1, Padding::Valid), (0, 0));
        assert_eq!(window_axis(7, 3, 2, Padding::Valid), (3, 0));
    }

    #[test]
    fn transposed_lengths_follow_keras() {
        assert_eq!(transpose_out_len(7, 3, 2, Padding::Same), 14);
        assert_eq!(transpose_out_len(7, 3, 2, Padding::Valid), 15);
        assert_eq!(transpose_out_len(7, 1, 2, Padding::Valid), 14);
    }
}
