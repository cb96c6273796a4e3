//! Synthetic training steps for the packing tests and the packing benchmark: the buffer
//! lifetimes of forward, loss and backward over CNN, transformer and MLP layer stacks.
//!
//! Shared by `tests/packing.rs` and `examples/packing_bench.rs` through `#[path]`, so the
//! benchmark measures exactly what the tests check.
//!
//! Forward op `i` runs at step `i`, the loss at step `L`, and op `i`'s backward at step
//! `2L - i`. What each buffer's lifetime follows from:
//! - an op's output lives until its last forward reader, or until the backward of a reader
//!   that keeps its input (conv, dense, norm, matmul…), or its own backward when the op
//!   keeps its output (relu, softmax);
//! - extra saved state (norm statistics, dropout masks, pooling indices) lives from the op
//!   to its backward;
//! - the gradient of an output is made by the backward of its latest reader and read by the
//!   op's own backward: short, except across residual connections;
//! - workspaces live for one step.
#![allow(dead_code)]

use memwise_plan::arena::packing::BufferRequest;

/// Alignment the generator rounds every size to.
pub const ALIGN: u64 = 256;

/// Deterministic pseudo-random numbers (SplitMix64).
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }

    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64 <= p
    }
}

fn aligned(bytes: u64) -> u64 {
    bytes.max(1).div_ceil(ALIGN) * ALIGN
}

struct Op {
    inputs: Vec<usize>,
    bytes: u64,
    keeps_inputs: bool,
    keeps_output: bool,
    /// Extra state kept from forward to backward (0: none).
    saved: u64,
    fwd_workspace: u64,
    bwd_workspace: u64,
    /// Whether its backward produces gradients (the data input has none).
    trainable_path: bool,
}

/// A layer stack being built, op by op.
pub struct Net {
    ops: Vec<Op>,
    segments: Vec<(usize, usize)>,
    rng: Rng,
}

impl Net {
    pub fn new(seed: u64) -> Net {
        Net {
            ops: Vec::new(),
            segments: Vec::new(),
            rng: Rng(seed),
        }
    }

    fn push(&mut self, op: Op) -> usize {
        self.ops.push(op);
        self.ops.len() - 1
    }

    fn input(&mut self, bytes: u64) -> usize {
        self.push(Op {
            inputs: vec![],
            bytes: aligned(bytes),
            keeps_inputs: false,
            keeps_output: false,
            saved: 0,
            fwd_workspace: 0,
            bwd_workspace: 0,
            trainable_path: false,
        })
    }

    /// A weighted op (conv, dense, matmul): keeps its input; cuDNN-like workspaces that
    /// are sometimes absent and sometimes larger than the output.
    fn weighted(&mut self, x: usize, bytes: u64) -> usize {
        let bytes = aligned(bytes);
        let fwd = if self.rng.chance(0.5) {
            aligned(bytes * self.rng.range(1, 16) / 8)
        } else {
            0
        };
        let bwd = if self.rng.chance(0.6) {
            aligned(bytes * self.rng.range(1, 24) / 8)
        } else {
            0
        };
        self.push(Op {
            inputs: vec![x],
            bytes,
            keeps_inputs: true,
            keeps_output: false,
            saved: 0,
            fwd_workspace: fwd,
            bwd_workspace: bwd,
            trainable_path: true,
        })
    }

    /// Batch or layer norm: keeps its input and small statistics.
    fn norm(&mut self, x: usize, stats: u64) -> usize {
        let bytes = self.ops[x].bytes;
        self.push(Op {
            inputs: vec![x],
            bytes,
            keeps_inputs: true,
            keeps_output: false,
            saved: aligned(stats),
            fwd_workspace: 0,
            bwd_workspace: 0,
            trainable_path: true,
        })
    }

    /// Elementwise activation: relu keeps its output, gelu its input.
    fn activation(&mut self, x: usize, keeps_output: bool) -> usize {
        let bytes = self.ops[x].bytes;
        self.push(Op {
            inputs: vec![x],
            bytes,
            keeps_inputs: !keeps_output,
            keeps_output,
            saved: 0,
            fwd_workspace: 0,
            bwd_workspace: 0,
            trainable_path: true,
        })
    }

    fn add(&mut self, a: usize, b: usize) -> usize {
        let bytes = self.ops[a].bytes.max(self.ops[b].bytes);
        self.push(Op {
            inputs: vec![a, b],
            bytes,
            keeps_inputs: false,
            keeps_output: false,
            saved: 0,
            fwd_workspace: 0,
            bwd_workspace: 0,
            trainable_path: true,
        })
    }

    /// Max pooling (keeps indices) or dropout (keeps a byte mask): output and saved state.
    fn with_mask(&mut self, x: usize, bytes: u64, mask: u64) -> usize {
        self.push(Op {
            inputs: vec![x],
            bytes: aligned(bytes),
            keeps_inputs: false,
            keeps_output: false,
            saved: aligned(mask),
            fwd_workspace: 0,
            bwd_workspace: 0,
            trainable_path: true,
        })
    }

    /// An op that reads two tensors and keeps both (attention's matmuls).
    fn bilinear(&mut self, a: usize, b: usize, bytes: u64) -> usize {
        self.push(Op {
            inputs: vec![a, b],
            bytes: aligned(bytes),
            keeps_inputs: true,
            keeps_output: false,
            saved: 0,
            fwd_workspace: 0,
            bwd_workspace: 0,
            trainable_path: true,
        })
    }

    /// Concatenation (no state kept).
    fn concat(&mut self, parts: &[usize]) -> usize {
        let bytes = parts.iter().map(|&p| self.ops[p].bytes).sum();
        self.push(Op {
            inputs: parts.to_vec(),
            bytes,
            keeps_inputs: false,
            keeps_output: false,
            saved: 0,
            fwd_workspace: 0,
            bwd_workspace: 0,
            trainable_path: true,
        })
    }

    /// Gradient checkpointing: the outputs of ops `first..last` are dropped after forward
    /// and recomputed (in forward order) just before op `last`'s backward; op `last`'s
    /// output is kept. Segments must not overlap, and nothing outside a segment may read
    /// one of its dropped outputs.
    fn checkpoint(&mut self, first: usize, last: usize) {
        self.segments.push((first, last));
    }

    /// The buffers of one training step over this stack (forward, loss, recompute,
    /// backward).
    pub fn requests(&self) -> Vec<BufferRequest> {
        let n = self.ops.len();
        let mut dropped = vec![false; n];
        let mut recompute_before: Vec<Option<usize>> = vec![None; n];
        for &(a, b) in &self.segments {
            dropped[a..b].iter_mut().for_each(|d| *d = true);
            recompute_before[b] = Some(a);
        }
        // The schedule: forward op i at step i, the loss at n, then backward in reverse,
        // a segment's recomputation just before its last op's backward.
        let loss = n;
        let mut step = n + 1;
        let mut backward = vec![0usize; n];
        let mut recompute = vec![usize::MAX; n];
        for i in (0..n).rev() {
            if let Some(a) = recompute_before[i] {
                for r in recompute.iter_mut().take(i).skip(a) {
                    *r = step;
                    step += 1;
                }
            }
            backward[i] = step;
            step += 1;
        }
        let mut readers: Vec<Vec<usize>> = vec![Vec::new(); n];
        for (j, op) in self.ops.iter().enumerate() {
            for &i in &op.inputs {
                readers[i].push(j);
            }
        }
        let mut reqs = Vec::new();
        let mut buffer = |bytes: u64, first: usize, last: usize| {
            if bytes > 0 {
                reqs.push(BufferRequest { bytes, first, last });
            }
        };
        for (i, op) in self.ops.iter().enumerate() {
            // Forward version: its forward readers, and (unless dropped) whatever the
            // backward or a recomputation needs.
            let mut last = if readers[i].is_empty() { loss } else { i };
            // The recomputed version of a dropped output.
            let mut again = recompute[i];
            for &j in &readers[i] {
                last = last.max(j);
                let later = if dropped[i] { &mut again } else { &mut last };
                if dropped[j] {
                    *later = (*later).max(recompute[j]);
                }
                if self.ops[j].keeps_inputs {
                    *later = (*later).max(backward[j]);
                }
            }
            if op.keeps_output {
                let later = if dropped[i] { &mut again } else { &mut last };
                *later = (*later).max(backward[i]);
            }
            buffer(op.bytes, i, last);
            buffer(op.fwd_workspace, i, i);
            if dropped[i] {
                buffer(op.bytes, recompute[i], again);
                buffer(op.fwd_workspace, recompute[i], recompute[i]);
                buffer(op.saved, recompute[i], backward[i]);
            } else {
                buffer(op.saved, i, backward[i]);
            }
            if op.trainable_path {
                // The output's gradient: made by the latest reader's backward (or the
                // loss), read by this op's backward.
                let made = readers[i]
                    .iter()
                    .map(|&j| backward[j])
                    .min()
                    .unwrap_or(loss);
                buffer(op.bytes, made, backward[i]);
                buffer(op.bwd_workspace, backward[i], backward[i]);
            }
        }
        // The loss's own scratch (per-sample losses).
        buffer(aligned(4096), loss, loss);
        reqs
    }

    pub fn len(&self) -> usize {
        self.ops.len()
    }
}

/// A ResNet-like CNN: stem, then stages of basic residual blocks; each stage halves the
/// resolution and doubles the channels (activations halve). With `checkpoint_every = k > 0`
/// every k-th block is recomputed in backward instead of kept.
pub fn cnn(blocks: usize, checkpoint_every: usize, seed: u64) -> Vec<BufferRequest> {
    let mut net = Net::new(seed);
    let batch = net.rng.range(8, 64);
    let mut act = batch * 64 * 56 * 56 * 4; // bytes of one activation at stage 0
    let x = net.input(batch * 3 * 224 * 224 * 4);
    let mut h = net.weighted(x, act * 4);
    h = net.norm(h, 64 * 8);
    h = net.activation(h, true);
    h = net.with_mask(h, act, act / 4);
    let stages = 4;
    let mut channels = 64;
    for b in 0..blocks {
        let stage = b * stages / blocks.max(1);
        let downsample = b > 0 && stage != (b - 1) * stages / blocks.max(1);
        if downsample {
            act /= 2;
            channels *= 2;
        }
        let start = net.len();
        let skip = if downsample {
            let p = net.weighted(h, act);
            net.norm(p, channels * 8)
        } else {
            h
        };
        let mut y = net.weighted(h, act);
        y = net.norm(y, channels * 8);
        y = net.activation(y, true);
        y = net.weighted(y, act);
        y = net.norm(y, channels * 8);
        y = net.add(y, skip);
        h = net.activation(y, true);
        if checkpoint_every > 0 && b % checkpoint_every == 0 {
            net.checkpoint(start, h);
        }
    }
    let pooled = net.with_mask(h, batch * channels * 4, 0);
    net.weighted(pooled, batch * 1000 * 4);
    net.requests()
}

/// A U-Net: the encoder's outputs live across the whole bottleneck until the decoder
/// concatenates them, so lifetimes cross instead of nesting.
pub fn unet(depth: usize, seed: u64) -> Vec<BufferRequest> {
    let mut net = Net::new(seed);
    let batch = net.rng.range(2, 16);
    let mut act = batch * 32 * 256 * 256 * 4;
    let mut h = net.input(batch * 3 * 256 * 256 * 4);
    let mut skips = Vec::new();
    let double_conv = |net: &mut Net, mut h: usize, act: u64| {
        for _ in 0..2 {
            h = net.weighted(h, act);
            h = net.norm(h, 4096);
            h = net.activation(h, true);
        }
        h
    };
    for _ in 0..depth {
        h = double_conv(&mut net, h, act);
        skips.push((h, act));
        h = net.with_mask(h, act / 4, act / 16);
        act /= 2;
    }
    h = double_conv(&mut net, h, act);
    while let Some((skip, skip_act)) = skips.pop() {
        let up = net.weighted(h, skip_act);
        let cat = net.concat(&[up, skip]);
        h = double_conv(&mut net, cat, skip_act);
    }
    net.weighted(h, batch * 256 * 256 * 4);
    net.requests()
}

/// An Inception-like CNN: modules of parallel branches of different depths and widths,
/// scheduled one branch after another and concatenated; the first branches' outputs wait
/// for the last.
pub fn inception(modules: usize, seed: u64) -> Vec<BufferRequest> {
    let mut net = Net::new(seed);
    let batch = net.rng.range(8, 64);
    let mut act = batch * 192 * 28 * 28 * 4;
    let x = net.input(batch * 3 * 224 * 224 * 4);
    let mut h = net.weighted(x, act);
    for m in 0..modules {
        if m > 0 && m % (modules / 3).max(1) == 0 {
            act /= 2;
            h = net.with_mask(h, act, act / 8);
        }
        let width = net.rng.range(2, 4);
        let mut outs = Vec::new();
        for _ in 0..width {
            let depth = net.rng.range(1, 3);
            let share = net.rng.range(1, 4);
            let mut y = h;
            for _ in 0..depth {
                y = net.weighted(y, act * share / 8);
                y = net.norm(y, 2048);
                y = net.activation(y, true);
            }
            outs.push(y);
        }
        h = net.concat(&outs);
    }
    net.weighted(h, batch * 1000 * 4);
    net.requests()
}

/// A GPT-like transformer: pre-norm blocks of attention (the B×H×S×S scores and their
/// softmax kept for backward) and a 4× MLP with GELU and dropout. With
/// `checkpoint = true` every layer is recomputed in backward.
pub fn transformer(layers: usize, checkpoint: bool, seed: u64) -> Vec<BufferRequest> {
    let mut net = Net::new(seed);
    let batch = net.rng.range(2, 16);
    let seq = 128 << net.rng.range(0, 3);
    let heads = 4 << net.rng.range(0, 2);
    let dim = heads * 64;
    let tokens = batch * seq * dim * 4;
    let scores = batch * heads * seq * seq * 4;
    let ids = net.input(batch * seq * 4);
    let mut h = net.weighted(ids, tokens); // embedding
    for _ in 0..layers {
        let start = net.len();
        let n1 = net.norm(h, batch * seq * 8);
        let qkv = net.weighted(n1, 3 * tokens);
        let s = net.bilinear(qkv, qkv, scores);
        let p = net.activation(s, true); // softmax keeps its output
        let d = net.with_mask(p, scores, scores / 4);
        let a = net.bilinear(d, qkv, tokens);
        let o = net.weighted(a, tokens);
        let r = net.add(h, o);
        let n2 = net.norm(r, batch * seq * 8);
        let up = net.weighted(n2, 4 * tokens);
        let g = net.activation(up, false); // gelu keeps its input
        let down = net.weighted(g, tokens);
        h = net.add(r, down);
        if checkpoint {
            net.checkpoint(start, h);
        }
    }
    let n = net.norm(h, batch * seq * 8);
    let vocab = net.rng.range(1000, 8000);
    net.weighted(n, batch * seq * 4 * vocab);
    net.requests()
}

/// An MLP with random widths, dropout and batch norm here and there.
pub fn mlp(layers: usize, seed: u64) -> Vec<BufferRequest> {
    let mut net = Net::new(seed);
    let batch = net.rng.range(32, 512);
    let mut h = net.input(batch * 784);
    for _ in 0..layers {
        let width = 64 << net.rng.range(0, 5);
        h = net.weighted(h, batch * width * 4);
        if net.rng.chance(0.3) {
            h = net.norm(h, width * 8);
        }
        h = net.activation(h, true);
        if net.rng.chance(0.3) {
            let bytes = net.ops[h].bytes;
            h = net.with_mask(h, bytes, bytes / 4);
        }
    }
    net.weighted(h, batch * 10 * 4);
    net.requests()
}

/// Every family, named, scaled to about `buffers` buffers each.
pub fn families(buffers: usize, seed: u64) -> Vec<(&'static str, Vec<BufferRequest>)> {
    // Buffers per unit of depth, measured: a residual block ~20, a transformer layer ~30,
    // an MLP layer ~8, an inception module ~40, a U-Net level ~45.
    let b = |per: usize| (buffers / per).max(1);
    vec![
        ("cnn", cnn(b(20), 0, seed)),
        ("cnn-ckpt", cnn(b(22), 2, seed ^ 3)),
        ("transformer", transformer(b(30), false, seed ^ 1)),
        ("gpt-ckpt", transformer(b(40), true, seed ^ 4)),
        ("unet", unet(b(45).min(12), seed ^ 5)),
        ("inception", inception(b(40), seed ^ 6)),
        ("mlp", mlp(b(8), seed ^ 2)),
    ]
}
