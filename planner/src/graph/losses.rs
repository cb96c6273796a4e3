//! The loss terms: which tensors each reads, whether it fuses the softmax or sigmoid before
//! it, and the shape and dtype checks of its inputs.

use super::builder::Builder;
use super::{prod, user_shape, GLoss, TensorId, Value};
use crate::dtype::DType;
use crate::error::PlanError;
use crate::op::Op;
use crate::spec::{Activation, LayerKind, LossKind, LossTerm};

/// One term's two inputs, resolved: `(prediction, target)` or `(mean, log_var)`.
struct TermInputs<'t> {
    kname: &'static str,
    names: &'t [String],
    a: Value,
    b: Value,
    /// How many terms read the prediction (a fused activation must feed one term only).
    readers: usize,
}

impl TermInputs<'_> {
    fn mismatch(&self, what: &str) -> PlanError {
        let (kname, names) = (self.kname, self.names);
        PlanError::model(format!(
            "`{kname}({}, {})`: {what}: `{}` is {} and `{}` is {}",
            names[0],
            names[1],
            names[0],
            user_shape(&self.a.shape),
            names[1],
            user_shape(&self.b.shape)
        ))
        .related(&[&names[0], &names[1]])
    }
}

/// A term reading `(prediction, target)` that takes the gradient of `grad_of`.
fn loss_of(op: Op, prediction: TensorId, target: TensorId, grad_of: TensorId) -> GLoss {
    GLoss {
        op,
        reads: vec![prediction, target],
        grad_of: vec![grad_of],
        prediction,
    }
}

fn is_softmax(op: &Op) -> bool {
    matches!(
        op,
        Op::Activation {
            act: Activation::Softmax,
            ..
        }
    )
}

fn is_sigmoid(op: &Op) -> bool {
    matches!(
        op,
        Op::Activation {
            act: Activation::Sigmoid,
            ..
        }
    )
}

impl Builder<'_> {
    /// The activation op `p` is when it turns logits into probabilities (sigmoid or
    /// softmax): the one rule by which every loss tells probabilities from logits.
    fn output_activation(&self, p: usize) -> Option<Activation> {
        match self.g.ops[p].op {
            Op::Activation {
                act: act @ (Activation::Sigmoid | Activation::Softmax),
                ..
            } => Some(act),
            _ => None,
        }
    }

    fn producer(&self, t: TensorId) -> Option<usize> {
        self.g.ops.iter().position(|o| o.outputs.contains(&t))
    }

    fn consumers(&self, t: TensorId) -> usize {
        self.g.ops.iter().filter(|o| o.inputs.contains(&t)).count()
    }

    fn resolve(&self, n: &str) -> Result<Value, PlanError> {
        match self.by_name.get(n) {
            Some(&j) => Ok(self.g.layers[j].output.clone()),
            None => Err(PlanError::model(format!(
                "the loss reads `{n}`, but the model has no field of that name"
            ))),
        }
    }

    /// Adds every loss term of the spec.
    pub(super) fn losses(&mut self) -> Result<(), PlanError> {
        let spec = self.spec;
        if spec.loss.is_empty() {
            return Err(PlanError::model(
                "the model has no loss: add `loss = …` to #[memwise::model]",
            ));
        }
        let last_layer = spec
            .layers
            .iter()
            .rposition(|l| !matches!(l.kind, LayerKind::Input { .. }))
            .ok_or_else(|| PlanError::model("the model has no layers besides its inputs"))?;
        // How many loss terms read each field (a fused activation must feed one term only).
        let default_pred = spec.layers[last_layer].name.as_str();
        let loss_readers = |n: &str| -> usize {
            spec.loss
                .iter()
                .filter(|t| {
                    if t.inputs.is_empty() {
                        n == default_pred
                    } else {
                        t.inputs.iter().any(|i| i == n)
                    }
                })
                .count()
        };
        for term in &spec.loss {
            let names = self.term_names(term, last_layer)?;
            let kname = term.kind.name();
            if names.len() != 2 {
                return Err(PlanError::model(format!(
                    "`{kname}` takes two inputs, got {}",
                    names.len()
                )));
            }
            let a = self.resolve(&names[0])?;
            let b = self.resolve(&names[1])?;
            for n in &names {
                if let Some(&j) = self.by_name.get(n.as_str()) {
                    self.consumed[j] = true;
                }
            }
            let t = TermInputs {
                kname,
                names: &names,
                a,
                b,
                readers: loss_readers(&names[0]),
            };
            let loss = match term.kind {
                LossKind::SparseCategoricalCrossentropy => self.categorical(term, &t)?,
                LossKind::BinaryCrossentropy | LossKind::MeanSquaredError => {
                    self.binary_or_mse(term, &t)?
                }
                LossKind::KlNormal => self.kl_normal(term, &t)?,
            };
            self.g.losses.push(loss);
        }
        // A loss may not fuse into a softmax/sigmoid twice.
        let mut fused_grads: Vec<TensorId> = Vec::new();
        for l in &self.g.losses {
            if matches!(
                l.op,
                Op::SoftmaxCrossEntropy { .. } | Op::SigmoidBinaryCrossentropy { .. }
            ) {
                if fused_grads.contains(&l.grad_of[0]) {
                    return Err(PlanError::model("two loss terms read the same softmax/sigmoid output; give each its own layer"));
                }
                fused_grads.push(l.grad_of[0]);
            }
        }
        Ok(())
    }

    /// The term's inputs as named, or by default the last layer and the one input no
    /// layer reads.
    fn term_names(&self, term: &LossTerm, last_layer: usize) -> Result<Vec<String>, PlanError> {
        if !term.inputs.is_empty() {
            return Ok(term.inputs.clone());
        }
        let spec = self.spec;
        let kname = term.kind.name();
        if term.kind == LossKind::KlNormal {
            return Err(PlanError::model(
                "`kl_normal` needs its inputs: kl_normal(mean, log_var)",
            ));
        }
        let unconsumed: Vec<usize> = (0..spec.layers.len())
            .filter(|&j| {
                matches!(spec.layers[j].kind, LayerKind::Input { .. }) && !self.consumed[j]
            })
            .collect();
        if unconsumed.is_empty() {
            let (decl, example) = match term.kind {
                LossKind::SparseCategoricalCrossentropy => {
                    ("#[input(shape = [], dtype = i32)] labels: Input", "labels")
                }
                _ => ("#[input(shape = [...])] target: Input", "target"),
            };
            return Err(PlanError::model(format!(
                "`{kname}` needs a target, and every input is read by a layer: declare one \
                 (`{decl}`), which the loss then reads (or name both: `{kname}({}, {example})`)",
                spec.layers[last_layer].name
            )));
        }
        if unconsumed.len() > 1 {
            let names: Vec<&str> = unconsumed
                .iter()
                .map(|&j| spec.layers[j].name.as_str())
                .collect();
            return Err(PlanError::model(format!(
                "`{kname}` needs a target, and no layer reads {}: name it, as in {kname}({}, {})",
                names
                    .iter()
                    .map(|n| format!("`{n}`"))
                    .collect::<Vec<_>>()
                    .join(" or "),
                spec.layers[last_layer].name,
                names[0]
            )));
        }
        Ok(vec![
            spec.layers[last_layer].name.clone(),
            spec.layers[unconsumed[0]].name.clone(),
        ])
    }

    /// Sparse categorical cross-entropy: the softmax fused when the prediction is one the
    /// loss alone reads, else from logits.
    fn categorical(&mut self, term: &LossTerm, t: &TermInputs) -> Result<GLoss, PlanError> {
        let (kname, names) = (t.kname, t.names);
        let (ta, tb) = (t.a.tensor, t.b.tensor);
        if self.g.tensors[tb].dtype != DType::I32 {
            return Err(PlanError::model(format!(
                "`{kname}` needs integer labels (an `#[input(dtype = i32)]`), but `{}` holds {} values",
                names[1],
                self.g.tensors[tb].dtype.name()
            )));
        }
        let classes = *t.a.shape.last().unwrap_or(&1);
        let rows = prod(&t.a.shape) / classes.max(1);
        if prod(&t.b.shape) != rows {
            return Err(t.mismatch("one label per prediction row is needed"));
        }
        let weight = term.weight;
        match self.producer(ta) {
            Some(p)
                if is_softmax(&self.g.ops[p].op) && self.consumers(ta) == 0 && t.readers == 1 =>
            {
                self.g.ops[p].fused_into_loss = true;
                let logits = self.g.ops[p].inputs[0];
                let op = Op::SoftmaxCrossEntropy {
                    rows,
                    classes,
                    weight,
                };
                Ok(loss_of(op, ta, tb, logits))
            }
            Some(p) if is_softmax(&self.g.ops[p].op) => Err(PlanError::at(
                &names[0],
                format!(
                    "`{kname}` reads `{}`, a softmax whose output is also read elsewhere; \
                     the loss folds the softmax into its gradient, so give the loss its own \
                     softmax (or read the logits: a layer without `activation = softmax`)",
                    names[0]
                ),
            )),
            Some(p) if self.output_activation(p) == Some(Activation::Sigmoid) => {
                Err(PlanError::at(
                    &names[0],
                    format!(
                        "`{kname}` reads `{}`, a sigmoid output: it needs probabilities over the \
                         classes (`activation = softmax`) or logits (no activation, the softmax is \
                         then fused into the loss)",
                        names[0]
                    ),
                ))
            }
            _ => {
                let op = Op::SoftmaxCrossEntropyFromLogits {
                    rows,
                    classes,
                    weight,
                };
                Ok(loss_of(op, ta, tb, ta))
            }
        }
    }

    /// Binary cross-entropy (the sigmoid fused when the loss alone reads it; from logits
    /// when the prediction is not probabilities) or mean squared error.
    fn binary_or_mse(&mut self, term: &LossTerm, t: &TermInputs) -> Result<GLoss, PlanError> {
        let (kname, names) = (t.kname, t.names);
        let (a, b) = (&t.a, &t.b);
        let (ta, tb) = (a.tensor, b.tensor);
        if a.shape != b.shape {
            return Err(t.mismatch("prediction and target must have one shape"));
        }
        if !self.g.tensors[tb].dtype.is_float() {
            return Err(PlanError::model(format!(
                "`{kname}` needs a floating-point target, but `{}` holds {} values",
                names[1],
                self.g.tensors[tb].dtype.name()
            )));
        }
        let features = prod(&a.shape[1..]);
        let rows = a.shape[0];
        let (weight, reduction) = (term.weight, term.reduction);
        let plain = |op: Op| loss_of(op, ta, tb, ta);
        if term.kind == LossKind::MeanSquaredError {
            return Ok(plain(Op::MeanSquaredError {
                rows,
                features,
                reduction,
                weight,
            }));
        }
        Ok(match self.producer(ta) {
            Some(p)
                if is_sigmoid(&self.g.ops[p].op) && self.consumers(ta) == 0 && t.readers == 1 =>
            {
                self.g.ops[p].fused_into_loss = true;
                let logits = self.g.ops[p].inputs[0];
                let op = Op::SigmoidBinaryCrossentropy {
                    rows,
                    features,
                    reduction,
                    weight,
                };
                loss_of(op, ta, tb, logits)
            }
            // Probabilities read elsewhere too, or a softmax's: plain BCE.
            Some(p) if self.output_activation(p).is_some() => plain(Op::BinaryCrossentropy {
                rows,
                features,
                reduction,
                weight,
            }),
            // Any other output is logits: the sigmoid is fused, stably.
            _ => plain(Op::BinaryCrossentropyFromLogits {
                rows,
                features,
                reduction,
                weight,
            }),
        })
    }

    /// The KL divergence of `N(mean, exp(log_var))` from `N(0, 1)`.
    fn kl_normal(&mut self, term: &LossTerm, t: &TermInputs) -> Result<GLoss, PlanError> {
        let (a, b) = (&t.a, &t.b);
        let (ta, tb) = (a.tensor, b.tensor);
        if a.shape != b.shape {
            return Err(t.mismatch("mean and log-variance must have one shape"));
        }
        let features = prod(&a.shape[1..]);
        // One kernel reads both: give the log-variance the mean's dtype.
        let (da, db) = (self.g.tensors[ta].dtype, self.g.tensors[tb].dtype);
        if !da.is_float() || !db.is_float() {
            return Err(t.mismatch("mean and log-variance must be floating-point"));
        }
        let tb = if da != db {
            let layer = self.g.tensors[tb].layer;
            self.cast_to(layer, b, da)?.tensor
        } else {
            tb
        };
        Ok(GLoss {
            op: Op::KlNormal {
                rows: a.shape[0],
                features,
                reduction: term.reduction,
                weight: term.weight,
            },
            reads: vec![ta, tb],
            grad_of: vec![ta, tb],
            prediction: ta,
        })
    }
}
