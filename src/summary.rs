//! The model summary: a Keras-like table of layers (type, output shape, parameters, dtype,
//! saved bytes, checkpointed) and the memory of one training step, from a static plan.
use crate::plan::advice::format_bytes;
use crate::plan::StaticPlan;

/// `407050` → `407,050`.
fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::with_capacity(s.len() + s.len() / 3);
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn shape(dims: &[usize]) -> String {
    let parts: Vec<String> = dims.iter().map(|d| d.to_string()).collect();
    if parts.len() == 1 {
        format!("({},)", parts[0])
    } else {
        format!("({})", parts.join(", "))
    }
}

/// The table `MyNet::summary()` returns.
pub fn table(plan: &StaticPlan) -> String {
    let header = [
        "Layer (type)",
        "Output shape",
        "Param #",
        "DType",
        "Saved",
        "Checkpointed",
    ];
    let rows: Vec<[String; 6]> = plan
        .memory
        .layers
        .iter()
        .map(|l| {
            [
                format!("{} ({})", l.name, l.kind),
                shape(&l.output_shape),
                thousands(l.params),
                l.dtype.name().to_string(),
                format_bytes(l.saved_bytes),
                if l.checkpointed {
                    format!("yes ({} recomputed)", format_bytes(l.recomputed_bytes))
                } else {
                    String::new()
                },
            ]
        })
        .collect();
    let mut width = header.map(str::len);
    for r in &rows {
        for (w, c) in width.iter_mut().zip(r) {
            *w = (*w).max(c.chars().count());
        }
    }
    let total_width = width.iter().sum::<usize>() + 2 * (width.len() - 1);
    let line = |fill: char| fill.to_string().repeat(total_width);
    let fmt_row = |cells: &[String]| {
        let mut s = String::new();
        for (i, (c, w)) in cells.iter().zip(width).enumerate() {
            // Numbers right-aligned, text left-aligned (Keras's layout).
            let cell = if i == 2 {
                format!("{c:>w$}")
            } else {
                format!("{c:<w$}")
            };
            s += &cell;
            if i + 1 < cells.len() {
                s += "  ";
            }
        }
        s.trim_end().to_string()
    };
    let m = &plan.memory;
    let mut out = format!(
        "Model: \"{}\"  (batch {}, {}, {})\n",
        plan.model,
        plan.batch,
        plan.precision.name(),
        plan.optimizer.name()
    );
    out += &line('━');
    out += "\n";
    out += &fmt_row(&header.map(String::from));
    out += "\n";
    out += &line('━');
    out += "\n";
    for r in &rows {
        out += &fmt_row(r);
        out += "\n";
    }
    out += &line('━');
    out += "\n";
    out += &format!(
        "Total params: {} ({})  Trainable: {}  Non-trainable: {}\n",
        thousands(plan.params_count),
        format_bytes(plan.params_count * 4),
        thousands(plan.trainable_count),
        thousands(plan.params_count - plan.trainable_count.min(plan.params_count)),
    );
    out += &format!(
        "One training step: params {} + grads {} + optimizer {} + activations {} + workspace {} + inputs {}\n",
        format_bytes(m.params),
        format_bytes(m.grads),
        format_bytes(m.optimizer),
        format_bytes(m.activations_peak),
        format_bytes(m.workspace_peak),
        format_bytes(m.inputs),
    );
    out += &format!(
        "Total: {}  (arena {}, live at peak {})\n",
        format_bytes(m.total),
        format_bytes(m.arena),
        format_bytes(m.lower_bound)
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_thousands() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(407050), "407,050");
        assert_eq!(thousands(1234567), "1,234,567");
        assert_eq!(shape(&[128, 512]), "(128, 512)");
        assert_eq!(shape(&[10]), "(10,)");
    }
}
