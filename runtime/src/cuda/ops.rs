//! The CUDA kernel of every op and phase: launches ([`KernelCall`]s through the backend) and
//! cuBLAS GEMMs ([`memwise_kernels::cublas_map`]) on the addresses of the tensors the step's
//! [`memwise_plan::io`] struct names, `arena + offset` and `persistent + offset`. Nothing is
//! allocated and nothing is copied to or from the host inside a step, so a step can be
//! captured as a graph.
//!
//! The RNG step of dropout and sampling is read from the device scalars, not from the
//! [`RngKey`](k::random::RngKey) (whose `seed` and `layer` are launch arguments), so a replayed
//! graph draws the next step's masks. Errors are device errors: the walk names the step.
//!
//! [`KernelCall`]: memwise_kernels::cuda::KernelCall

use std::borrow::Cow;

use memwise_kernels as k;
use memwise_kernels::cublas_map::{self as cm, Operand};
use memwise_kernels::cuda::flash;
use memwise_kernels::cuda::launch::{
    self as kl, name1, name2, name3, Float, KArg, LaunchCfg, MwDepthwise, MwGeom, MwPool,
    MwUpdateChunk,
};
use memwise_plan::io::*;
use memwise_plan::{Activation as Act, DType, Optimizer, PlanStep, Reduction, StaticPlan, NONE};

use super::{dev, p, u, Backend, CudaKernels};
use crate::collective::Collective;
use crate::cpu::Opt;
use crate::error::{Result, RuntimeError};
use crate::executor::Batch;
use crate::kernels::{
    gradient_ranges, pointwise, BceInput, Kernels, OpError, OpResult, StepFlags, StepScalars,
    UpdateStep,
};

/// The code and parameter the pointwise activation kernels take for `act`.
fn act_args(act: Act) -> std::result::Result<[KArg; 2], crate::kernels::OpError> {
    let a = pointwise(act)?;
    Ok([KArg::I32(kl::activation_code(a)), KArg::F32(a.param())])
}

/// The addresses of a linear op's GEMM operands (dense, conv, transposed conv), of storage
/// type `t`; the weight gradient is f32.
struct LinearAddrs {
    t: Float,
    x: u64,
    w: u64,
    /// The forward's output, or the backward's input gradient (0 when none is taken).
    y_or_dx: u64,
    dy: u64,
    dw: u64,
    /// The im2col / col2im columns (0 when the plan has none).
    col: u64,
}

impl LinearAddrs {
    fn buf(&self, o: Operand) -> Result<(u64, Float)> {
        Ok(match o {
            Operand::X => (self.x, self.t),
            Operand::W => (self.w, self.t),
            Operand::Dy => (self.dy, self.t),
            Operand::Dw => (self.dw, Float::F32),
            Operand::Col => (self.col, self.t),
            _ => (self.y_or_dx, self.t),
        })
    }
}

/// A column reduction's row parts and, when there are several, the address of their f64
/// partial sums (else 0, the kernels' "not split").
struct Split {
    parts: usize,
    partials: u64,
}

impl Split {
    /// The channel strips of the reduction: `⌈cols/32⌉ × ys` blocks, times the parts.
    fn strip(&self, cols: usize, ys: usize) -> LaunchCfg {
        LaunchCfg::strip_parts(cols as u64, ys as u32, self.parts as u32)
    }
}

impl<B: Backend> CudaKernels<B> {
    fn linear_forward(&self, io: &LinearForward) -> Result<LinearAddrs> {
        let t = self.ft(io.y)?;
        Ok(LinearAddrs {
            t,
            x: self.t(io.x)?,
            w: self.pw(io.weight, t)?,
            y_or_dx: self.t(io.y)?,
            dy: 0,
            dw: 0,
            col: self.t_or_null(io.ws)?,
        })
    }

    fn linear_backward(&self, io: &LinearBackward) -> Result<LinearAddrs> {
        let t = self.ft(io.x)?;
        Ok(LinearAddrs {
            t,
            x: self.t(io.x)?,
            w: self.pw(io.weight, t)?,
            y_or_dx: self.t_or_null(io.dx)?,
            dy: self.t(io.dy)?,
            dw: self.pg(io.weight)?,
            col: self.t_or_null(io.ws)?,
        })
    }

    /// `y += bias` over `rows` rows of `cols`, when the layer has a bias.
    fn bias_add(&self, t: Float, y: u64, rows: usize, cols: usize, bias: ParamId) -> Result<()> {
        if bias == NONE {
            return Ok(());
        }
        self.k(
            name1("mw_bias_add", t),
            LaunchCfg::pointwise((rows * cols) as u64),
            vec![p(y), p(self.pv(bias)), u(rows), u(cols)],
        )
    }

    /// The bias gradient, `dy`'s column sums, when the layer has a bias; split into row parts
    /// in the step's `scratch` when the plan says so.
    fn bias_grad(
        &self,
        t: Float,
        dy: u64,
        shape: [usize; 2],
        bias: ParamId,
        scratch: TensorId,
    ) -> Result<()> {
        if bias == NONE {
            return Ok(());
        }
        let [rows, cols] = shape;
        let (db, split) = (self.pg(bias)?, self.split(scratch, 0, [rows, cols, 1], 1)?);
        self.k(
            name1("mw_column_sums", t),
            split.strip(cols, 1),
            vec![p(dy), u(rows), u(cols), p(db), p(split.partials)],
        )?;
        self.add_parts(&split, 0, cols, cols, db)
    }

    /// How a column reduction over `[rows, cols]` (`ys` of them side by side) runs: in the row
    /// parts the planner chose ([`memwise_plan::column_parts`]), with `sums` f64 partial sums
    /// per part, y and column in the step's `scratch` from `at` f32 elements on, checked to fit.
    fn split(
        &self,
        scratch: TensorId,
        at: usize,
        [rows, cols, ys]: [usize; 3],
        sums: usize,
    ) -> Result<Split> {
        let parts = memwise_plan::column_parts(rows, cols, ys);
        let need = memwise_plan::column_parts_scratch_f32(rows, cols, ys, sums);
        let what = || format!("a column reduction over {rows}×{cols} (×{ys}) in {parts} parts");
        self.partials(scratch, at, parts, need, what)
    }

    /// How the value of a loss over `elems` elements (`units` rows or elements) is reduced:
    /// on the blocks [`memwise_plan::loss_value_parts`] gives, their results in the step's
    /// `scratch` when there are several.
    fn loss_split(&self, scratch: TensorId, elems: usize, units: usize) -> Result<Split> {
        let parts = memwise_plan::loss_value_parts(elems, units);
        let need = memwise_plan::op::loss_parts_scratch_f32(elems, units);
        self.partials(scratch, 0, parts, need, || {
            format!("a loss value over {elems} elements")
        })
    }

    /// A split of `parts` whose f64 partial sums take `need` f32 of the step's `scratch` from
    /// `at` on: checked to fit, 8-byte aligned. Not split (1 part), nothing is read.
    fn partials(
        &self,
        scratch: TensorId,
        at: usize,
        parts: usize,
        need: usize,
        what: impl Fn() -> String,
    ) -> Result<Split> {
        if parts == 1 {
            return Ok(Split { parts, partials: 0 });
        }
        let have = if scratch == NONE {
            0
        } else {
            self.elems(scratch)?
        };
        let partials = self.t_or_null(scratch)? + 4 * at as u64;
        if have < at + need || !partials.is_multiple_of(8) {
            return Err(dev(format!(
                "{} needs {} f32 of 8-byte-aligned scratch; the plan gives {have}",
                what(),
                at + need
            )));
        }
        Ok(Split { parts, partials })
    }

    /// A loss's value kernel `name` on `args` (the partial sums' address appended): one block,
    /// or the split's blocks and then `mw_loss_value_parts` adding their results in order into
    /// `loss` as `weight · sum / denom`.
    fn loss_value(
        &self,
        name: String,
        mut args: Vec<KArg>,
        s: &Split,
        [denom, weight]: [f64; 2],
        loss: u64,
    ) -> Result<()> {
        args.push(p(s.partials));
        self.k(name, LaunchCfg::single().with_blocks(s.parts as u32), args)?;
        if s.parts == 1 {
            return Ok(());
        }
        let finish = vec![
            p(s.partials),
            u(s.parts),
            KArg::F64(denom),
            KArg::F32(weight as f32),
            p(loss),
            self.sc(),
        ];
        self.k(
            "mw_loss_value_parts".into(),
            LaunchCfg::pointwise(1),
            finish,
        )
    }

    /// The second pass of a split reduction: `out[i] += Σ_p partials[p·stride + i]` for
    /// `i < n`, the partials from f64 value `first` on; nothing when it is not split.
    fn add_parts(&self, s: &Split, first: usize, stride: usize, n: usize, out: u64) -> Result<()> {
        if s.parts == 1 || out == 0 {
            return Ok(());
        }
        self.k(
            "mw_add_parts".into(),
            LaunchCfg::pointwise(n as u64),
            vec![
                p(s.partials + 8 * first as u64),
                u(s.parts),
                u(stride),
                u(n),
                p(out),
            ],
        )
    }

    /// `dgamma` and `dbeta` (0 when there is none) from the parts' sums `[Σ dy, Σ dy·x̂]` of
    /// `c` channels (`mw_channel_grad_parts`); nothing when not split.
    fn add_affine_parts(&self, s: &Split, c: usize, dgamma: u64, dbeta: u64) -> Result<()> {
        self.add_parts(s, 0, 2 * c, c, dbeta)?;
        self.add_parts(s, c, 2 * c, c, dgamma)
    }

    /// The flash kernels' launch settings (dims, scale, dropout stream); dims they do not take
    /// are an error (the planner lowers those to the materialising attention).
    fn flash_launch(
        &self,
        float: Float,
        d: &k::attention::AttentionDims,
        causal: bool,
        rate: f32,
        key: k::random::RngKey,
    ) -> Result<flash::FlashLaunch> {
        let fd = flash::FlashDims {
            batch: d.batch,
            seq: d.seq,
            heads: d.heads,
            head_dim: d.head_dim(),
            causal,
        };
        if !fd.supported() {
            return Err(dev(format!(
                "flash attention: the CUDA kernels do not take {fd:?}"
            )));
        }
        let dropout = if rate > 0.0 {
            flash::FlashDropout {
                rate,
                seed: key.seed,
                layer: key.layer,
                first_block: key.first_block,
                scalars: self.scalars,
            }
        } else {
            flash::FlashDropout::NONE
        };
        Ok(flash::FlashLaunch {
            float,
            dims: fd,
            scale: d.scale(),
            dropout,
        })
    }

    /// A random stream's kernel arguments: seed, layer and first block (the step is read
    /// from the scalars).
    fn key_args(&self, key: k::random::RngKey) -> [KArg; 3] {
        [
            KArg::U64(key.seed),
            KArg::U32(key.layer),
            KArg::U32(key.first_block),
        ]
    }

    /// The gradient a training loss writes (`None` in an inference plan).
    fn loss_grad(&self, id: TensorId, op: &str) -> Result<Option<u64>> {
        if !self.plan.training {
            return Ok(None);
        }
        if id == NONE {
            return Err(dev(format!(
                "loss `{op}`: its input depends on no parameter"
            )));
        }
        self.t(id).map(Some)
    }

    /// Without loss scaling, a non-finite loss must stop the update (as on the CPU): the
    /// flag makes the optimizer kernels skip, and the host reports it after the step.
    fn flag_nonfinite_loss(&self, loss: u64) -> Result<()> {
        if self.plan.training && !self.plan.loss_scaling {
            self.k(
                "mw_all_finite_f32".into(),
                LaunchCfg::pointwise(1),
                vec![p(loss), u(1), self.sc()],
            )?;
        }
        Ok(())
    }

    /// Binary cross-entropy (`kind`: the `kl::LOSS_*` code) or mean squared error.
    #[allow(clippy::too_many_arguments)]
    fn elem_loss(
        &self,
        io: &LossIo,
        op: &str,
        kind: i32,
        rows: usize,
        features: usize,
        red: Reduction,
        weight: f32,
    ) -> Result<()> {
        let n = rows * features;
        let denom = match red {
            Reduction::Mean => n as f64,
            Reduction::SumOverFeatures => rows as f64,
        };
        let loss = self.t(io.value)?;
        let (pt, yt) = (self.ft(io.prediction)?, self.ft(io.target)?);
        let (pr, tg) = (self.t(io.prediction)?, self.t(io.target)?);
        if let Some(g) = self.loss_grad(io.grad, op)? {
            if self.ft(io.grad)? != pt {
                return Err(dev(
                    "a loss gradient in another dtype than its prediction has no CUDA kernel"
                        .into(),
                ));
            }
            self.k(
                name2("mw_elem_loss", pt, yt),
                LaunchCfg::pointwise(n as u64),
                vec![
                    KArg::I32(kind),
                    p(pr),
                    p(tg),
                    p(g),
                    u(n),
                    KArg::F64(denom),
                    KArg::F32(weight),
                    self.sc(),
                ],
            )?;
        }
        let args = vec![
            KArg::I32(kind),
            p(pr),
            p(tg),
            u(n),
            KArg::F64(denom),
            KArg::F32(weight),
            p(loss),
        ];
        let split = self.loss_split(io.scratch, n, n)?;
        let name = name2("mw_elem_loss_value", pt, yt);
        self.loss_value(name, args, &split, [denom, weight as f64], loss)?;
        self.flag_nonfinite_loss(loss)
    }

    /// The multi-tensor optimizer kernel of update step `step`: every chunk of its parameters
    /// (`update_table`), their 16-bit copies rewritten with them, in one launch.
    fn optimizer_launch(&self, optimizer: Optimizer, step: u32) -> Result<()> {
        let Some(&(first, count)) = self.update_steps.get(&step) else {
            return Ok(()); // no parameter of the step is trained
        };
        let chunk = std::mem::size_of::<MwUpdateChunk>() as u64;
        let table = p(self.update_table + first as u64 * chunk);
        let cfg = LaunchCfg::per_chunk(count);
        let f = KArg::F32;
        // The kernels' optimizer structs, as the CPU runs them: one reading of the plan's
        // optimizer for both devices (plain SGD is momentum 0, not nesterov).
        let (name, hyper) = match Opt::from_plan(&optimizer) {
            Opt::Sgd(o) => (
                "mw_sgd",
                vec![
                    f(o.learning_rate),
                    f(o.momentum),
                    KArg::I32(o.nesterov as i32),
                ],
            ),
            Opt::RmsProp(o) => (
                "mw_rmsprop",
                vec![f(o.learning_rate), f(o.rho), f(o.momentum), f(o.epsilon)],
            ),
            Opt::Adam(o) => (
                "mw_adam",
                vec![f(o.beta_1), f(o.beta_2), f(o.epsilon), f(0.0)],
            ),
            Opt::AdamW(o) => {
                let decay = o.weight_decay * o.adam.learning_rate;
                let a = o.adam;
                (
                    "mw_adam",
                    vec![f(a.beta_1), f(a.beta_2), f(a.epsilon), f(decay)],
                )
            }
        };
        let mut args = vec![table];
        args.extend(hyper);
        args.push(self.sc());
        self.k(name.into(), cfg, args)
    }
}

impl<B: Backend> Kernels for CudaKernels<B> {
    fn device_name(&self) -> String {
        self.backend.name()
    }

    fn plan(&self) -> &StaticPlan {
        &self.plan
    }

    fn device_bytes_used(&self) -> Option<u64> {
        self.bytes_used()
    }

    fn device_lane_bytes(&self) -> Option<u64> {
        self.backend.lane_bytes()
    }

    fn another(&self, plan: StaticPlan, device: &crate::device::Device, seed: u64) -> Result<Self> {
        let backend = self.backend.open_another().map_err(dev)?;
        CudaKernels::new(plan, device, backend, seed)
    }

    fn take_turn(&self) -> crate::kernels::TurnHold {
        match self.backend.turn() {
            Some(t) => t.take(),
            None => crate::kernels::TurnHold::none(),
        }
    }

    fn load_inputs(&mut self, inputs: &[Batch<'_>]) -> Result<()> {
        self.upload_inputs(inputs)
    }

    fn begin_step(&mut self, scalars: &StepScalars) -> Result<()> {
        // The gradients are zeroed by the first command of the step itself (`run_steps`),
        // so that a captured graph zeroes them too.
        self.upload_scalars(scalars)
    }

    fn run_steps(&mut self, steps: &mut dyn FnMut(&Self) -> Result<()>) -> Result<()> {
        self.launch_step(steps)
    }

    fn end_step(&mut self) -> Result<StepFlags> {
        self.read_flags()
    }

    fn flagged_now(&self) -> Option<bool> {
        None
    }

    fn set_graphs(&mut self, on: bool) {
        self.set_graph(on);
    }

    fn read_param(&self, pid: u32, grad: bool) -> Result<Vec<f32>> {
        self.param_values(pid, grad)
    }

    fn write_param(&mut self, pid: u32, values: &[f32]) -> Result<()> {
        self.upload_param(pid, values)
    }

    fn read_tensor(&self, id: u32, out: &mut [f32]) -> Result<()> {
        self.tensor_values(id, out)
    }

    fn tensor_finite(&self, id: u32) -> Result<bool> {
        self.finite(id)
    }

    fn persistent_image(&self) -> Result<Cow<'_, [u8]>> {
        Ok(Cow::Owned(self.image()?))
    }

    fn write_persistent(&mut self, write: &mut dyn FnMut(&mut [u8]) -> Result<()>) -> Result<()> {
        self.rewrite_persistent(write)
    }

    fn poison(&self, ids: &[u32], padding: &[(u64, u64)]) -> Result<()> {
        // The padding is poisoned before every launch and GEMM from now on (`poison_padding`).
        let _ = self.padding.set(padding.to_vec());
        for &id in ids {
            let t = self.plan.tensor(id);
            // 0xFF bytes are NaN in every float type and -1 as an i32; u8 gets the CPU's 0xA5.
            let value = if t.dtype == DType::U8 { 0xA5 } else { 0xFF };
            let bytes = t.elems() * t.dtype.size() as usize;
            // SAFETY: a tensor's bytes inside the arena.
            unsafe {
                self.backend
                    .memset(self.arena + t.offset, bytes, value)
                    .map_err(dev)?
            };
        }
        Ok(())
    }

    // ---- forward ----

    fn input_cast(&self, io: &UnaryForward, scale: f32) -> OpResult {
        let n = self.elems(io.y)?;
        self.k(
            name1("mw_cast_u8", self.ft(io.y)?),
            LaunchCfg::pointwise(n as u64),
            vec![
                p(self.t(io.x)?),
                p(self.t(io.y)?),
                u(n),
                KArg::F32(scale),
                KArg::F32(0.0),
            ],
        )?;
        Ok(())
    }

    fn cast(&self, io: &UnaryForward) -> OpResult {
        let n = self.elems(io.y)?;
        self.k(
            name2("mw_cast", self.ft(io.x)?, self.ft(io.y)?),
            LaunchCfg::pointwise(n as u64),
            vec![p(self.t(io.x)?), p(self.t(io.y)?), u(n)],
        )?;
        Ok(())
    }

    fn dense(&self, io: &LinearForward, d: k::dense::DenseDims) -> OpResult {
        let a = self.linear_forward(io)?;
        self.gemm(&cm::dense_forward(d), &|o| a.buf(o))?;
        self.bias_add(a.t, a.y_or_dx, d.batch, d.out_features, io.bias)?;
        Ok(())
    }

    fn conv2d(&self, io: &LinearForward, d: k::conv::Conv2dDims, chunk: usize) -> OpResult {
        let a = self.linear_forward(io)?;
        let (t, g) = (a.t, MwGeom::conv2d(&d));
        if d.is_pointwise() {
            self.gemm(&cm::conv2d_forward_pointwise(&d), &|o| a.buf(o))?;
        } else {
            let p_ = d.out_h() * d.out_w();
            for (n0, cn) in cm::chunks(d.n, chunk) {
                self.k(
                    name1("mw_im2col", t),
                    LaunchCfg::pointwise((cn * p_ * g.k()) as u64),
                    vec![
                        p(a.x),
                        p(a.col),
                        KArg::Geom(g),
                        KArg::I32(n0 as i32),
                        KArg::I32(cn as i32),
                    ],
                )?;
                self.gemm(&cm::conv2d_forward_chunk(&d, n0, cn), &|o| a.buf(o))?;
            }
        }
        self.bias_add(t, a.y_or_dx, d.y_len() / d.c_out, d.c_out, io.bias)?;
        Ok(())
    }

    fn depthwise_conv2d(&self, io: &LinearForward, d: k::conv::DepthwiseConv2dDims) -> OpResult {
        let t = self.ft(io.y)?;
        self.k(
            name1("mw_dw_fwd", t),
            LaunchCfg::pointwise(d.y_len() as u64),
            vec![
                p(self.t(io.x)?),
                p(self.pw(io.weight, t)?),
                p(self.pv_or_null(io.bias)),
                p(self.t(io.y)?),
                KArg::Depthwise(MwDepthwise::from(&d)),
            ],
        )?;
        Ok(())
    }

    fn conv2d_transpose(
        &self,
        io: &LinearForward,
        d: k::conv::ConvTranspose2dDims,
        chunk: usize,
    ) -> OpResult {
        let a = self.linear_forward(io)?;
        let (t, g) = (a.t, MwGeom::conv2d_transpose(&d));
        if d.is_pointwise() {
            self.gemm(&cm::conv2d_transpose_forward_pointwise(&d), &|o| a.buf(o))?;
            self.bias_add(t, a.y_or_dx, d.y_len() / d.c_out, d.c_out, io.bias)?;
        } else {
            // col2im adds the bias.
            let (img, b) = (d.out_h() * d.out_w() * d.c_out, self.pv_or_null(io.bias));
            for (n0, cn) in cm::chunks(d.n, chunk) {
                self.gemm(&cm::conv2d_transpose_forward_chunk(&d, n0, cn), &|o| {
                    a.buf(o)
                })?;
                let yc = a.y_or_dx + (n0 * img * t.size()) as u64;
                self.k(
                    name1("mw_col2im", t),
                    LaunchCfg::pointwise((cn * img) as u64),
                    vec![p(a.col), p(yc), KArg::Geom(g), KArg::I32(cn as i32), p(b)],
                )?;
            }
        }
        Ok(())
    }

    fn max_pool2d(&self, io: &MaxPoolForward, d: &k::pool::Pool2d) -> OpResult {
        self.k(
            name1("mw_maxpool_fwd", self.ft(io.y)?),
            LaunchCfg::pointwise(d.out_len() as u64),
            vec![
                p(self.t(io.x)?),
                p(self.t(io.y)?),
                p(self.t(io.argmax)?),
                KArg::Pool(MwPool::from(d)),
            ],
        )?;
        Ok(())
    }

    fn avg_pool2d(&self, io: &UnaryForward, d: &k::pool::Pool2d) -> OpResult {
        self.k(
            name1("mw_avgpool_fwd", self.ft(io.y)?),
            LaunchCfg::pointwise(d.out_len() as u64),
            vec![
                p(self.t(io.x)?),
                p(self.t(io.y)?),
                KArg::Pool(MwPool::from(d)),
            ],
        )?;
        Ok(())
    }

    fn global_avg_pool(&self, io: &UnaryForward, n: usize, hw: usize, c: usize) -> OpResult {
        self.k(
            name1("mw_gap_fwd", self.ft(io.y)?),
            LaunchCfg::pointwise((n * c) as u64),
            vec![p(self.t(io.x)?), p(self.t(io.y)?), u(n), u(hw), u(c)],
        )?;
        Ok(())
    }

    fn batch_norm(
        &self,
        io: &BatchNormForward,
        d: k::norm::NormDims,
        cfg: k::norm::BatchNormConfig,
        move_running: bool,
    ) -> OpResult {
        // Recomputation must not move the running statistics a second time.
        let (rm, rv) = if move_running {
            (self.pv(io.running_mean), self.pv(io.running_var))
        } else {
            (0, 0)
        };
        let (t, x, c) = (self.ft(io.y)?, self.t(io.x)?, d.channels);
        // Split: the parts' Σx, then their Σ(x − mean)², then each part normalises its rows.
        let split = self.split(io.scratch, 0, [d.rows, c, 1], 2)?;
        if split.parts > 1 {
            let sums = vec![p(x), u(d.rows), u(c), p(0), p(split.partials)];
            self.k(name1("mw_column_sums", t), split.strip(c, 1), sums)?;
            let var = vec![p(x), u(d.rows), u(c), p(split.partials)];
            self.k(name1("mw_bn_var_parts", t), split.strip(c, 1), var)?;
        }
        self.k(
            name1("mw_bn_train_fwd", t),
            split.strip(c, 1),
            vec![
                p(x),
                p(self.t(io.y)?),
                p(self.t(io.x_hat)?),
                p(self.t(io.mean)?),
                p(self.t(io.inv_std)?),
                p(rm),
                p(rv),
                p(self.pv(io.gamma)),
                p(self.pv(io.beta)),
                u(d.rows),
                u(d.channels),
                KArg::F32(cfg.epsilon),
                KArg::F32(cfg.momentum),
                p(split.partials),
            ],
        )?;
        Ok(())
    }

    fn batch_norm_inference(
        &self,
        io: &BatchNormInferenceForward,
        d: k::norm::NormDims,
        epsilon: f32,
    ) -> OpResult {
        self.k(
            name1("mw_bn_infer", self.ft(io.y)?),
            LaunchCfg::pointwise((d.rows * d.channels) as u64),
            vec![
                p(self.t(io.x)?),
                p(self.t(io.y)?),
                p(self.pv(io.gamma)),
                p(self.pv(io.beta)),
                p(self.pv(io.running_mean)),
                p(self.pv(io.running_var)),
                u(d.rows),
                u(d.channels),
                KArg::F32(epsilon),
            ],
        )?;
        Ok(())
    }

    fn layer_norm(&self, io: &LayerNormForward, d: k::norm::NormDims, epsilon: f32) -> OpResult {
        self.k(
            name1("mw_ln_fwd", self.ft(io.y)?),
            LaunchCfg::rows(d.rows as u64),
            vec![
                p(self.t(io.x)?),
                p(self.t(io.y)?),
                p(self.t(io.x_hat)?),
                p(self.t(io.rstd)?),
                p(self.pv(io.gamma)),
                p(self.pv(io.beta)),
                u(d.rows),
                u(d.channels),
                KArg::F32(epsilon),
            ],
        )?;
        Ok(())
    }

    fn group_norm(
        &self,
        io: &GroupNormForward,
        d: k::norm::GroupNormDims,
        epsilon: f32,
    ) -> OpResult {
        self.k(
            name1("mw_gn_fwd", self.ft(io.y)?),
            LaunchCfg::rows(d.stats() as u64),
            vec![
                p(self.t(io.x)?),
                p(self.t(io.y)?),
                p(self.t(io.x_hat)?),
                p(self.t(io.rstd)?),
                p(self.pv(io.gamma)),
                p(self.pv_or_null(io.beta)),
                u(d.samples),
                u(d.spatial),
                u(d.channels),
                u(d.groups),
                KArg::I32(d.center as i32),
                KArg::F32(epsilon),
            ],
        )?;
        Ok(())
    }

    fn positional_embedding(
        &self,
        io: &PositionalEmbeddingForward,
        batch: usize,
        len: usize,
    ) -> OpResult {
        self.k(
            name1("mw_pos_embedding_fwd", self.ft(io.y)?),
            LaunchCfg::pointwise(batch.saturating_mul(len) as u64),
            vec![
                p(self.t(io.x)?),
                p(self.pv(io.table)),
                p(self.t(io.y)?),
                u(batch),
                u(len),
            ],
        )?;
        Ok(())
    }

    fn dropout(&self, io: &DropoutForward, rate: f32, key: k::random::RngKey) -> OpResult {
        let n = self.elems(io.y)?;
        let [seed, layer, first] = self.key_args(key);
        self.k(
            name1("mw_dropout_fwd", self.ft(io.y)?),
            LaunchCfg::pointwise(n.div_ceil(4) as u64),
            vec![
                p(self.t(io.x)?),
                p(self.t(io.y)?),
                p(self.t(io.mask)?),
                u(n),
                KArg::F32(rate),
                seed,
                layer,
                first,
                self.sc(),
            ],
        )?;
        Ok(())
    }

    fn activation(&self, io: &UnaryForward, act: Act, rows: usize, cols: usize) -> OpResult {
        if act == Act::Softmax {
            self.k(
                name2("mw_softmax", self.ft(io.x)?, self.ft(io.y)?),
                LaunchCfg::rows(rows as u64),
                vec![p(self.t(io.x)?), p(self.t(io.y)?), u(rows), u(cols)],
            )?;
            return Ok(());
        }
        let n = self.elems(io.y)?;
        let [code, param] = act_args(act)?;
        self.k(
            name1("mw_act_fwd", self.ft(io.y)?),
            LaunchCfg::pointwise(n as u64),
            vec![code, param, p(self.t(io.x)?), p(self.t(io.y)?), u(n)],
        )?;
        Ok(())
    }

    fn add(&self, io: &AddForward) -> OpResult {
        let xs = &io.xs;
        if xs.len() > 8 {
            return Err(dev("add of more than 8 inputs".into()).into());
        }
        let n = self.elems(io.y)?;
        let mut args = vec![p(self.t(io.y)?)];
        for j in 0..8 {
            args.push(if j < xs.len() {
                p(self.t(xs[j])?)
            } else {
                p(0)
            });
        }
        args.extend([KArg::I32(xs.len() as i32), u(n)]);
        self.k(
            name1("mw_add_n", self.ft(io.y)?),
            LaunchCfg::pointwise(n as u64),
            args,
        )?;
        Ok(())
    }

    fn concat(&self, io: &ConcatForward, rows: usize, a: usize, b: usize) -> OpResult {
        self.k(
            name1("mw_concat", self.ft(io.y)?),
            LaunchCfg::pointwise((rows * (a + b)) as u64),
            vec![
                p(self.t(io.a)?),
                p(self.t(io.b)?),
                p(self.t(io.y)?),
                u(rows),
                u(a),
                u(b),
            ],
        )?;
        Ok(())
    }

    fn embedding(&self, io: &EmbeddingForward, d: k::embedding::EmbeddingDims) -> OpResult {
        self.k(
            name1("mw_embedding_fwd", self.ft(io.y)?),
            LaunchCfg::pointwise((d.tokens * d.dim) as u64),
            vec![
                p(self.t(io.ids)?),
                p(self.pv(io.table)),
                p(self.t(io.y)?),
                u(d.tokens),
                u(d.vocab),
                u(d.dim),
                self.sc(),
            ],
        )?;
        Ok(())
    }

    fn attention(
        &self,
        io: &AttentionForward,
        d: k::attention::AttentionDims,
        causal: bool,
        dropout: f32,
        key: k::random::RngKey,
    ) -> OpResult {
        let t = self.ft(io.probs)?;
        let (scale, seq) = (d.scale(), d.seq);
        let (qkv, probs) = (self.t(io.qkv)?, self.t(io.probs)?);
        let (used, ctx) = if dropout > 0.0 {
            (self.t(io.probs_dropped)?, self.t(io.ctx)?)
        } else {
            (probs, self.t(io.ctx)?)
        };
        for g in cm::attention_scores(&d, scale) {
            self.gemm(&g, &|o| {
                Ok((if o == Operand::Qkv { qkv } else { probs }, t))
            })?;
        }
        let pairs = d.batch * d.heads;
        if causal {
            self.k(
                name1("mw_causal_mask", t),
                LaunchCfg::pointwise(d.scores_len() as u64),
                vec![p(probs), u(pairs), u(seq)],
            )?;
        }
        self.k(
            name2("mw_softmax", t, t),
            LaunchCfg::rows((pairs * seq) as u64),
            vec![p(probs), p(probs), u(pairs * seq), u(seq)],
        )?;
        if dropout > 0.0 {
            let n = d.scores_len();
            let [seed, layer, first] = self.key_args(key);
            self.k(
                name1("mw_dropout_fwd", t),
                LaunchCfg::pointwise(n.div_ceil(4) as u64),
                vec![
                    p(probs),
                    p(used),
                    p(self.t(io.mask)?),
                    u(n),
                    KArg::F32(dropout),
                    seed,
                    layer,
                    first,
                    self.sc(),
                ],
            )?;
        }
        for g in cm::attention_context(&d) {
            self.gemm(&g, &|o| {
                Ok((
                    match o {
                        Operand::Qkv => qkv,
                        Operand::Probs => used,
                        _ => ctx,
                    },
                    t,
                ))
            })?;
        }
        Ok(())
    }

    fn flash_attention(
        &self,
        io: &FlashAttentionForward,
        d: k::attention::AttentionDims,
        causal: bool,
        dropout: f32,
        key: k::random::RngKey,
    ) -> OpResult {
        let launch = self.flash_launch(self.ft(io.ctx)?, &d, causal, dropout, key)?;
        let (qkv, ctx, lse) = (self.t(io.qkv)?, self.t(io.ctx)?, self.t(io.lse)?);
        self.launch(&launch.forward(qkv, ctx, lse))?;
        Ok(())
    }

    fn sample_normal(&self, io: &SampleNormalForward, key: k::random::RngKey) -> OpResult {
        let n = self.elems(io.z)?;
        let [seed, layer, first] = self.key_args(key);
        self.k(
            name1("mw_sample_normal_fwd", self.ft(io.z)?),
            LaunchCfg::pointwise(n.div_ceil(4) as u64),
            vec![
                p(self.t(io.mean)?),
                p(self.t(io.log_var)?),
                p(self.t(io.z)?),
                u(n),
                seed,
                layer,
                first,
                self.sc(),
            ],
        )?;
        Ok(())
    }

    // ---- backward ----

    fn cast_backward(&self, io: &UnaryBackward) -> OpResult {
        let n = self.elems(io.dy)?;
        self.k(
            name2("mw_cast", self.ft(io.dy)?, self.ft(io.dx)?),
            LaunchCfg::pointwise(n as u64),
            vec![p(self.t(io.dy)?), p(self.t(io.dx)?), u(n)],
        )?;
        Ok(())
    }

    fn dense_backward(&self, io: &LinearBackward, d: k::dense::DenseDims) -> OpResult {
        let a = self.linear_backward(io)?;
        for g in cm::dense_backward(d, io.dx != NONE) {
            self.gemm(&g, &|o| a.buf(o))?;
        }
        self.bias_grad(a.t, a.dy, [d.batch, d.out_features], io.bias, io.scratch)?;
        Ok(())
    }

    fn conv2d_backward(
        &self,
        io: &LinearBackward,
        d: k::conv::Conv2dDims,
        chunk: usize,
    ) -> OpResult {
        let a = self.linear_backward(io)?;
        let (t, g, need_dx) = (a.t, MwGeom::conv2d(&d), io.dx != NONE);
        if d.is_pointwise() {
            for gm in cm::conv2d_backward_pointwise(&d, need_dx) {
                self.gemm(&gm, &|o| a.buf(o))?;
            }
        } else {
            let (p_, img) = (d.out_h() * d.out_w(), d.h * d.w * d.c_in);
            for (n0, cn) in cm::chunks(d.n, chunk) {
                self.k(
                    name1("mw_im2col", t),
                    LaunchCfg::pointwise((cn * p_ * g.k()) as u64),
                    vec![
                        p(a.x),
                        p(a.col),
                        KArg::Geom(g),
                        KArg::I32(n0 as i32),
                        KArg::I32(cn as i32),
                    ],
                )?;
                let (gw, gx) = cm::conv2d_backward_chunk(&d, n0, cn);
                self.gemm(&gw, &|o| a.buf(o))?;
                if need_dx {
                    self.gemm(&gx, &|o| a.buf(o))?;
                    let dxc = a.y_or_dx + (n0 * img * t.size()) as u64;
                    self.k(
                        name1("mw_col2im", t),
                        LaunchCfg::pointwise((cn * img) as u64),
                        vec![p(a.col), p(dxc), KArg::Geom(g), KArg::I32(cn as i32), p(0)],
                    )?;
                }
            }
        }
        self.bias_grad(t, a.dy, [d.y_len() / d.c_out, d.c_out], io.bias, io.scratch)?;
        Ok(())
    }

    fn depthwise_conv2d_backward(
        &self,
        io: &LinearBackward,
        d: k::conv::DepthwiseConv2dDims,
    ) -> OpResult {
        let t = self.ft(io.x)?;
        let md = KArg::Depthwise(MwDepthwise::from(&d));
        let (x, w, dy) = (self.t(io.x)?, self.pw(io.weight, t)?, self.t(io.dy)?);
        if io.dx != NONE {
            self.k(
                name1("mw_dw_bwd_dx", t),
                LaunchCfg::pointwise(d.x_len() as u64),
                vec![p(w), p(dy), p(self.t(io.dx)?), md],
            )?;
        }
        let (dw, taps, co) = (self.pg(io.weight)?, d.kh * d.kw, d.c_out());
        let split = self.split(io.scratch, 0, [d.y_len() / co, co, taps], 1)?;
        self.k(
            name1("mw_dw_bwd_dw", t),
            split.strip(co, taps),
            vec![p(x), p(dy), p(dw), md, p(split.partials)],
        )?;
        self.add_parts(&split, 0, taps * co, taps * co, dw)?;
        self.bias_grad(
            t,
            dy,
            [d.y_len() / d.c_out(), d.c_out()],
            io.bias,
            io.scratch,
        )?;
        Ok(())
    }

    fn conv2d_transpose_backward(
        &self,
        io: &LinearBackward,
        d: k::conv::ConvTranspose2dDims,
        chunk: usize,
    ) -> OpResult {
        let a = self.linear_backward(io)?;
        let (t, g, need_dx) = (a.t, MwGeom::conv2d_transpose(&d), io.dx != NONE);
        if d.is_pointwise() {
            for gm in cm::conv2d_transpose_backward_pointwise(&d, need_dx) {
                self.gemm(&gm, &|o| a.buf(o))?;
            }
        } else {
            let hw = d.h * d.w;
            for (n0, cn) in cm::chunks(d.n, chunk) {
                self.k(
                    name1("mw_im2col", t),
                    LaunchCfg::pointwise((cn * hw * g.k()) as u64),
                    vec![
                        p(a.dy),
                        p(a.col),
                        KArg::Geom(g),
                        KArg::I32(n0 as i32),
                        KArg::I32(cn as i32),
                    ],
                )?;
                for gm in cm::conv2d_transpose_backward_chunk(&d, n0, cn, need_dx) {
                    self.gemm(&gm, &|o| a.buf(o))?;
                }
            }
        }
        self.bias_grad(t, a.dy, [d.y_len() / d.c_out, d.c_out], io.bias, io.scratch)?;
        Ok(())
    }

    fn max_pool2d_backward(&self, io: &SavedBackward, d: &k::pool::Pool2d) -> OpResult {
        self.k(
            name1("mw_maxpool_bwd", self.ft(io.dy)?),
            LaunchCfg::pointwise(d.in_len() as u64),
            vec![
                p(self.t(io.saved)?),
                p(self.t(io.dy)?),
                p(self.t(io.dx)?),
                KArg::Pool(MwPool::from(d)),
            ],
        )?;
        Ok(())
    }

    fn avg_pool2d_backward(&self, io: &UnaryBackward, d: &k::pool::Pool2d) -> OpResult {
        self.k(
            name1("mw_avgpool_bwd", self.ft(io.dy)?),
            LaunchCfg::pointwise(d.in_len() as u64),
            vec![
                p(self.t(io.dy)?),
                p(self.t(io.dx)?),
                KArg::Pool(MwPool::from(d)),
            ],
        )?;
        Ok(())
    }

    fn global_avg_pool_backward(
        &self,
        io: &UnaryBackward,
        n: usize,
        hw: usize,
        c: usize,
    ) -> OpResult {
        self.k(
            name1("mw_gap_bwd", self.ft(io.dy)?),
            LaunchCfg::pointwise((n * hw * c) as u64),
            vec![p(self.t(io.dy)?), p(self.t(io.dx)?), u(n), u(hw), u(c)],
        )?;
        Ok(())
    }

    fn batch_norm_backward(&self, io: &NormBackward, d: k::norm::NormDims) -> OpResult {
        let (t, h, dy, c) = (
            self.ft(io.x_hat)?,
            self.t(io.x_hat)?,
            self.t(io.dy)?,
            d.channels,
        );
        // Split: the parts' Σ dy and Σ dy·x̂ first, then every part's dx from their totals.
        let split = self.split(io.scratch, 0, [d.rows, c, 1], 2)?;
        if split.parts > 1 {
            let sums = vec![p(h), p(dy), u(d.rows), u(c), p(split.partials)];
            self.k(name1("mw_bn_grad_parts", t), split.strip(c, 1), sums)?;
        }
        self.k(
            name1("mw_bn_bwd", t),
            split.strip(c, 1),
            vec![
                p(h),
                p(self.t(io.inv_std)?),
                p(self.pv(io.gamma)),
                p(dy),
                p(self.t(io.dx)?),
                p(self.pg(io.gamma)?),
                p(self.pg(io.beta)?),
                u(d.rows),
                u(c),
                p(split.partials),
            ],
        )?;
        Ok(())
    }

    fn batch_norm_backward_rebuild(
        &self,
        io: &BatchNormRebuildBackward,
        d: k::norm::NormDims,
    ) -> OpResult {
        let (t, x, c) = (self.ft(io.x)?, self.t(io.x)?, d.channels);
        let (mean, inv_std, dy) = (self.t(io.mean)?, self.t(io.inv_std)?, self.t(io.dy)?);
        let split = self.split(io.scratch, 0, [d.rows, c, 1], 2)?;
        if split.parts > 1 {
            let sums = vec![
                p(x),
                p(mean),
                p(inv_std),
                p(dy),
                u(d.rows),
                u(c),
                p(split.partials),
            ];
            self.k(
                name1("mw_bn_grad_parts_rebuild", t),
                split.strip(c, 1),
                sums,
            )?;
        }
        self.k(
            name1("mw_bn_bwd_rebuild", t),
            split.strip(c, 1),
            vec![
                p(x),
                p(mean),
                p(inv_std),
                p(self.pv(io.gamma)),
                p(dy),
                p(self.t(io.dx)?),
                p(self.pg(io.gamma)?),
                p(self.pg(io.beta)?),
                u(d.rows),
                u(c),
                p(split.partials),
            ],
        )?;
        Ok(())
    }

    fn layer_norm_backward(&self, io: &NormBackward, d: k::norm::NormDims) -> OpResult {
        let t = self.ft(io.x_hat)?;
        let (rows, features) = (d.rows, d.channels);
        let (h, rs, dy) = (self.t(io.x_hat)?, self.t(io.inv_std)?, self.t(io.dy)?);
        let (dgamma, dbeta) = (self.pg(io.gamma)?, self.pg(io.beta)?);
        let split = self.split(io.scratch, 0, [rows, features, 1], 2)?;
        self.k(
            name1("mw_ln_param_grads", t),
            split.strip(features, 1),
            vec![
                p(h),
                p(dy),
                p(dgamma),
                p(dbeta),
                u(rows),
                u(features),
                p(split.partials),
            ],
        )?;
        self.add_affine_parts(&split, features, dgamma, dbeta)?;
        self.k(
            name1("mw_ln_bwd", t),
            LaunchCfg::rows(rows as u64),
            vec![
                p(h),
                p(rs),
                p(self.pv(io.gamma)),
                p(dy),
                p(self.t(io.dx)?),
                u(rows),
                u(features),
            ],
        )?;
        Ok(())
    }

    fn layer_norm_backward_rebuild(
        &self,
        io: &LayerNormRebuildBackward,
        d: k::norm::NormDims,
    ) -> OpResult {
        let t = self.ft(io.x)?;
        let (rows, features) = (d.rows, d.channels);
        let (x, mean, rs, dy) = (
            self.t(io.x)?,
            self.t(io.scratch)?,
            self.t(io.rstd)?,
            self.t(io.dy)?,
        );
        self.k(
            name1("mw_ln_mean", t),
            LaunchCfg::rows(rows as u64),
            vec![p(x), p(mean), u(rows), u(features)],
        )?;
        // The row means fill the scratch's start; the partial sums follow, 8-byte aligned.
        let (dgamma, dbeta) = (self.pg(io.gamma)?, self.pg(io.beta)?);
        let split = self.split(io.scratch, rows.next_multiple_of(2), [rows, features, 1], 2)?;
        self.k(
            name1("mw_ln_param_grads_rebuild", t),
            split.strip(features, 1),
            vec![
                p(x),
                p(mean),
                p(rs),
                p(dy),
                p(dgamma),
                p(dbeta),
                u(rows),
                u(features),
                p(split.partials),
            ],
        )?;
        self.add_affine_parts(&split, features, dgamma, dbeta)?;
        self.k(
            name1("mw_ln_bwd_rebuild", t),
            LaunchCfg::rows(rows as u64),
            vec![
                p(x),
                p(mean),
                p(rs),
                p(self.pv(io.gamma)),
                p(dy),
                p(self.t(io.dx)?),
                u(rows),
                u(features),
            ],
        )?;
        Ok(())
    }

    fn group_norm_backward(&self, io: &GroupNormBackward, d: k::norm::GroupNormDims) -> OpResult {
        let t = self.ft(io.x_hat)?;
        let (h, dy) = (self.t(io.x_hat)?, self.t(io.dy)?);
        // RMS norm has no shift: the parameter-gradient kernel skips a null dbeta.
        let dbeta = match io.beta {
            NONE => 0,
            beta => self.pg(beta)?,
        };
        // The affine gradients are layer norm's per-channel sums over every (sample,
        // position) row, so its kernel serves.
        let (rows, dgamma) = (d.samples.saturating_mul(d.spatial), self.pg(io.gamma)?);
        let split = self.split(io.scratch, 0, [rows, d.channels, 1], 2)?;
        self.k(
            name1("mw_ln_param_grads", t),
            split.strip(d.channels, 1),
            vec![
                p(h),
                p(dy),
                p(dgamma),
                p(dbeta),
                u(rows),
                u(d.channels),
                p(split.partials),
            ],
        )?;
        self.add_affine_parts(&split, d.channels, dgamma, dbeta)?;
        self.k(
            name1("mw_gn_bwd", t),
            LaunchCfg::rows(d.stats() as u64),
            vec![
                p(h),
                p(self.t(io.rstd)?),
                p(self.pv(io.gamma)),
                p(dy),
                p(self.t(io.dx)?),
                u(d.samples),
                u(d.spatial),
                u(d.channels),
                u(d.groups),
                KArg::I32(d.center as i32),
            ],
        )?;
        Ok(())
    }

    fn positional_embedding_backward(
        &self,
        io: &PositionalEmbeddingBackward,
        batch: usize,
        len: usize,
    ) -> OpResult {
        let t = self.ft(io.dy)?;
        let dy = self.t(io.dy)?;
        // The table's gradient is dy's column sums, as a bias's.
        self.bias_grad(t, dy, [batch, len], io.table, io.scratch)?;
        // dx = dy: nothing to move when the plan put one over the other.
        if io.dx != NONE && self.t(io.dx)? != dy {
            let n = batch.saturating_mul(len);
            self.k(
                name2("mw_cast", t, t),
                LaunchCfg::pointwise(n as u64),
                vec![p(dy), p(self.t(io.dx)?), u(n)],
            )?;
        }
        Ok(())
    }

    fn dropout_backward(&self, io: &SavedBackward, rate: f32) -> OpResult {
        let n = self.elems(io.dy)?;
        self.k(
            name1("mw_dropout_bwd", self.ft(io.dy)?),
            LaunchCfg::pointwise(n as u64),
            vec![
                p(self.t(io.saved)?),
                p(self.t(io.dy)?),
                p(self.t(io.dx)?),
                u(n),
                KArg::F32(rate),
            ],
        )?;
        Ok(())
    }

    fn activation_backward(
        &self,
        io: &SavedBackward,
        act: Act,
        rows: usize,
        cols: usize,
    ) -> OpResult {
        if act == Act::Softmax {
            self.k(
                name3(
                    "mw_softmax_bwd",
                    self.ft(io.saved)?,
                    self.ft(io.dy)?,
                    self.ft(io.dx)?,
                ),
                LaunchCfg::rows(rows as u64),
                vec![
                    p(self.t(io.saved)?),
                    p(self.t(io.dy)?),
                    p(self.t(io.dx)?),
                    u(rows),
                    u(cols),
                ],
            )?;
            return Ok(());
        }
        let n = self.elems(io.dy)?;
        let [code, param] = act_args(act)?;
        self.k(
            name1("mw_act_bwd", self.ft(io.dy)?),
            LaunchCfg::pointwise(n as u64),
            vec![
                code,
                param,
                p(self.t(io.saved)?),
                p(self.t(io.dy)?),
                p(self.t(io.dx)?),
                u(n),
            ],
        )?;
        Ok(())
    }

    fn concat_backward(&self, io: &ConcatBackward, rows: usize, a: usize, b: usize) -> OpResult {
        self.k(
            name1("mw_concat_backward", self.ft(io.dy)?),
            LaunchCfg::pointwise((rows * (a + b)) as u64),
            vec![
                p(self.t(io.dy)?),
                p(self.t(io.da)?),
                p(self.t(io.db)?),
                u(rows),
                u(a),
                u(b),
            ],
        )?;
        Ok(())
    }

    fn embedding_backward(
        &self,
        io: &EmbeddingBackward,
        d: k::embedding::EmbeddingDims,
    ) -> OpResult {
        self.k(
            name1("mw_embedding_bwd", self.ft(io.dy)?),
            LaunchCfg::pointwise((d.tokens * d.dim) as u64),
            vec![
                p(self.t(io.ids)?),
                p(self.t(io.dy)?),
                p(self.pg(io.table)?),
                u(d.tokens),
                u(d.vocab),
                u(d.dim),
            ],
        )?;
        Ok(())
    }

    fn attention_backward(
        &self,
        io: &AttentionBackward,
        d: k::attention::AttentionDims,
        dropout: f32,
    ) -> OpResult {
        let t = self.ft(io.qkv)?;
        let scale = d.scale();
        let (qkv, probs) = (self.t(io.qkv)?, self.t(io.probs)?);
        let (used, dctx) = if dropout > 0.0 {
            (self.t(io.probs_dropped)?, self.t(io.dctx)?)
        } else {
            (probs, self.t(io.dctx)?)
        };
        let (dqkv, dp) = (self.t(io.dqkv)?, self.t(io.ws)?);
        let bufs = |o: Operand| -> Result<(u64, Float)> {
            Ok((
                match o {
                    Operand::Qkv => qkv,
                    Operand::Probs => used,
                    Operand::Dctx => dctx,
                    Operand::Dprobs => dp,
                    _ => dqkv,
                },
                t,
            ))
        };
        let (gdp, gdv) = cm::attention_context_backward(&d);
        for g in gdp.iter().chain(gdv.iter()) {
            self.gemm(g, &bufs)?;
        }
        let n = d.scores_len();
        if dropout > 0.0 {
            self.k(
                name1("mw_dropout_bwd", t),
                LaunchCfg::pointwise(n as u64),
                vec![p(self.t(io.mask)?), p(dp), p(dp), u(n), KArg::F32(dropout)],
            )?;
        }
        let rows = d.batch * d.heads * d.seq;
        self.k(
            name3("mw_softmax_bwd", t, t, t),
            LaunchCfg::rows(rows as u64),
            vec![p(probs), p(dp), p(dp), u(rows), u(d.seq)],
        )?;
        for g in cm::attention_scores_backward(&d, scale) {
            self.gemm(&g, &bufs)?;
        }
        Ok(())
    }

    fn flash_attention_backward(
        &self,
        io: &FlashAttentionBackward,
        d: k::attention::AttentionDims,
        causal: bool,
        dropout: f32,
        key: k::random::RngKey,
    ) -> OpResult {
        let launch = self.flash_launch(self.ft(io.qkv)?, &d, causal, dropout, key)?;
        let saved = [self.t(io.qkv)?, self.t(io.ctx)?, self.t(io.lse)?];
        let (dctx, scratch, dqkv) = (self.t(io.dctx)?, self.t(io.scratch)?, self.t(io.dqkv)?);
        let calls = launch.backward(saved, dctx, scratch, dqkv);
        for call in calls {
            self.launch(&call)?;
        }
        Ok(())
    }

    fn sample_normal_backward(
        &self,
        io: &SampleNormalBackward,
        key: k::random::RngKey,
    ) -> OpResult {
        let n = self.elems(io.dz)?;
        let [seed, layer, first] = self.key_args(key);
        self.k(
            name1("mw_sample_normal_bwd", self.ft(io.log_var)?),
            LaunchCfg::pointwise(n.div_ceil(4) as u64),
            vec![
                p(self.t(io.log_var)?),
                p(self.t(io.dz)?),
                p(self.t(io.dmean)?),
                p(self.t(io.dlog_var)?),
                u(n),
                seed,
                layer,
                first,
                self.sc(),
                KArg::I32(0),
            ],
        )?;
        Ok(())
    }

    fn accumulate(&self, io: &AccumulateIo) -> OpResult {
        let n = self.elems(io.g)?;
        let t = self.ft(io.g)?;
        let cfg = LaunchCfg::pointwise(n as u64);
        let g = self.t(io.g)?;
        let other = if self.same(io.a, io.g) {
            io.b
        } else if self.same(io.b, io.g) {
            io.a
        } else {
            self.k(
                name2("mw_cast", t, t),
                cfg,
                vec![p(self.t(io.a)?), p(g), u(n)],
            )?;
            io.b
        };
        self.k(
            name1("mw_accumulate", t),
            cfg,
            vec![p(g), p(self.t(other)?), u(n)],
        )?;
        Ok(())
    }

    // ---- losses ----

    fn sparse_categorical_crossentropy(
        &self,
        io: &LossIo,
        rows: usize,
        classes: usize,
        weight: f32,
        from_logits: bool,
    ) -> OpResult {
        let op = if from_logits {
            "softmax_cross_entropy_from_logits"
        } else {
            "softmax_cross_entropy"
        };
        let loss = self.t(io.value)?;
        // The probabilities: the fused softmax's output, or computed here from the logits.
        let (probs, pt) = if from_logits {
            let ws = self.t(io.ws)?;
            self.k(
                name2("mw_softmax", self.ft(io.prediction)?, Float::F32),
                LaunchCfg::rows(rows as u64),
                vec![p(self.t(io.prediction)?), p(ws), u(rows), u(classes)],
            )?;
            (ws, Float::F32)
        } else {
            (self.t(io.prediction)?, self.ft(io.prediction)?)
        };
        let labels = self.t(io.target)?;
        if let Some(g) = self.loss_grad(io.grad, op)? {
            self.k(
                name2("mw_scce", pt, self.ft(io.grad)?),
                LaunchCfg::rows(rows as u64),
                vec![
                    p(probs),
                    p(labels),
                    p(g),
                    u(rows),
                    u(classes),
                    KArg::F32(weight),
                    self.sc(),
                ],
            )?;
        }
        let args = vec![
            p(probs),
            p(labels),
            u(rows),
            u(classes),
            KArg::F32(weight),
            p(loss),
            self.sc(),
        ];
        let split = self.loss_split(io.scratch, rows * classes, rows)?;
        let name = name1("mw_scce_value", pt);
        self.loss_value(name, args, &split, [rows as f64, weight as f64], loss)?;
        self.flag_nonfinite_loss(loss)?;
        Ok(())
    }

    fn binary_crossentropy(
        &self,
        io: &LossIo,
        rows: usize,
        features: usize,
        reduction: Reduction,
        weight: f32,
        input: BceInput,
    ) -> OpResult {
        let (op, kind) = match input {
            BceInput::FusedSigmoid => ("sigmoid_binary_crossentropy", kl::LOSS_BCE_SIGMOID),
            BceInput::Logits => ("binary_crossentropy_from_logits", kl::LOSS_BCE_LOGITS),
            BceInput::Probabilities => ("binary_crossentropy", kl::LOSS_BCE),
        };
        self.elem_loss(io, op, kind, rows, features, reduction, weight)?;
        Ok(())
    }

    fn mean_squared_error(
        &self,
        io: &LossIo,
        rows: usize,
        features: usize,
        reduction: Reduction,
        weight: f32,
    ) -> OpResult {
        self.elem_loss(io, "mse", kl::LOSS_MSE, rows, features, reduction, weight)?;
        Ok(())
    }

    fn kl_normal(&self, io: &KlIo, rows: usize, features: usize, weight: f32) -> OpResult {
        let t = self.ft(io.mean)?;
        let n = rows * features;
        let loss = self.t(io.value)?;
        let (m, lv) = (self.t(io.mean)?, self.t(io.log_var)?);
        if let Some(gm) = self.loss_grad(io.dmean, "kl_normal")? {
            let gl = self.loss_grad(io.dlog_var, "kl_normal")?.unwrap_or(0);
            if self.ft(io.dmean)? != t {
                return Err(dev(
                    "a KL gradient in another dtype than its inputs has no CUDA kernel".into(),
                )
                .into());
            }
            self.k(
                name1("mw_kl", t),
                LaunchCfg::pointwise(n as u64),
                vec![
                    p(m),
                    p(lv),
                    p(gm),
                    p(gl),
                    u(n),
                    u(rows),
                    KArg::F32(weight),
                    self.sc(),
                ],
            )?;
        }
        let args = vec![p(m), p(lv), u(n), u(rows), KArg::F32(weight), p(loss)];
        let split = self.loss_split(io.scratch, n, n)?;
        let name = name1("mw_kl_value", t);
        self.loss_value(name, args, &split, [rows as f64, weight as f64], loss)?;
        self.flag_nonfinite_loss(loss)?;
        Ok(())
    }

    // ---- update ----

    fn check_finite(&self) -> OpResult {
        let (g0, g1) = self.grads_range;
        let n = ((g1 - g0) / 4) as usize;
        if n == 0 {
            return Ok(());
        }
        self.k(
            "mw_all_finite_f32".into(),
            LaunchCfg::pointwise(n as u64),
            vec![p(self.persistent + g0), u(n), self.sc()],
        )?;
        Ok(())
    }

    fn all_reduce_gradients(&self, params: &[u32], last: bool, c: &dyn Collective) -> OpResult {
        // The plan lays a bucket's gradients out contiguously: one sum per bucket. Eager
        // steps only: `launch_step` captures no data-parallel plan.
        let ranges = gradient_ranges(&self.plan, params);
        match self.device_collective(c)? {
            // On the device (NCCL), on the collective stream: the sum runs while the rest
            // of backward does; the last bucket's step makes the executor's stream wait for
            // them all before anything reads a gradient.
            Some((device, stream)) => {
                for (start, end) in ranges {
                    let n = ((end - start) / 4) as usize;
                    // SAFETY: the bucket's gradients lie inside the persistent region, and no
                    // launch touches them until the executor's stream joins the collectives.
                    unsafe { device.all_reduce_sum_f32(self.persistent + start, n, stream)? };
                }
                if last {
                    self.backend.join_collectives().map_err(dev)?;
                }
            }
            // Through the host (any backend, the emulated one included).
            None => {
                for (start, end) in ranges {
                    let at = self.persistent + start;
                    let mut g = self.download_f32(at, ((end - start) / 4) as usize)?;
                    c.all_reduce_sum_f32(&mut g)?;
                    let bytes: Vec<u8> = g.iter().flat_map(|x| x.to_le_bytes()).collect();
                    // SAFETY: the gradients lie inside the persistent region.
                    unsafe { self.backend.upload(&bytes, at).map_err(dev)? };
                }
            }
        }
        if last {
            self.sum_nonfinite_flag(c)?;
        }
        Ok(())
    }

    fn update(&self, step: &PlanStep, up: UpdateStep<'_>) -> OpResult {
        if up.rank != self.update_rank {
            return Err(OpError::Runtime(RuntimeError::Device(format!(
                "the optimizer's chunk table updates replica {}'s shards, the step is replica \
                 {}'s (set_replica was not called)",
                self.update_rank, up.rank
            ))));
        }
        self.optimizer_launch(up.optimizer, step.index)?;
        Ok(())
    }

    fn send_tensor(&self, io: &SendIo, to: usize, c: &dyn Collective) -> OpResult {
        let t = self.plan.tensor(io.x);
        if let Some((device, stream)) = self.device_collective(c)? {
            // Device to device, on the collective stream, which waits for the launches that
            // wrote the tensor; `transfer_run` groups it with the run's other transfers.
            let bytes = t.elems() * t.dtype.size() as usize;
            // SAFETY: the tensor's bytes lie inside the arena, and the plan keeps them until
            // its run of transfers ends (the send ends its unit).
            unsafe { device.send(to, self.arena + t.offset, bytes, stream)? };
            return Ok(());
        }
        // Through the host, as the data-parallel sums without NCCL: the download waits for
        // the launches before it on the stream.
        let bytes = self.tensor_bytes(io.x, t.elems())?;
        c.send(to, &bytes).map_err(OpError::Runtime)
    }

    fn transfer_run(&self, begin: bool, c: &dyn Collective) -> OpResult {
        let Some((device, _)) = self.device_collective(c)? else {
            return Ok(());
        };
        if begin {
            return Ok(device.begin_group()?);
        }
        device.end_group()?;
        // The next launches read what the run received.
        Ok(self.backend.join_collectives().map_err(dev)?)
    }

    fn recv_tensor(&self, io: &RecvIo, from: usize, c: &dyn Collective) -> OpResult {
        let t = self.plan.tensor(io.x);
        if let Some((device, stream)) = self.device_collective(c)? {
            let bytes = t.elems() * t.dtype.size() as usize;
            // SAFETY: the tensor's bytes lie inside the arena; the receive is their writer,
            // and the launches after the run wait for it (`transfer_run`).
            unsafe { device.recv(from, self.arena + t.offset, bytes, stream)? };
            return Ok(());
        }
        let mut bytes = vec![0u8; t.elems() * t.dtype.size() as usize];
        c.recv(from, &mut bytes).map_err(OpError::Runtime)?;
        // SAFETY: the tensor's bytes lie inside the arena.
        unsafe {
            self.backend
                .upload(&bytes, self.arena + t.offset)
                .map_err(dev)
        }?;
        Ok(())
    }

    fn all_gather_params(&self, params: &[u32], c: &dyn Collective) -> OpResult {
        // A step flagged non-finite updated nothing, so the gather copies equal values (the
        // flag stays on the device).
        if let Some((device, stream)) = self.device_collective(c)? {
            self.all_gather_on_device(params, device, stream)?;
            // The next launches read the gathered weights.
            return Ok(self.backend.join_collectives().map_err(dev)?);
        }
        for &pid in params {
            let prm = &self.plan.params[pid as usize];
            let mut raw = vec![0u8; prm.elems() * 4];
            // SAFETY: the parameter's f32 values lie inside the persistent region.
            unsafe {
                (self.backend)
                    .download(self.persistent + prm.offset, &mut raw)
                    .map_err(dev)?
            };
            c.all_gather_shards(&mut raw, 4)?;
            let values: Vec<f32> = raw
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            self.upload_param(pid, &values)?;
        }
        Ok(())
    }

    fn set_replica(&mut self, rank: usize) -> Result<()> {
        self.rebuild_update_table(rank)
    }
}
