//! Pictures of a plan: the memory timeline and the model graph, as SVG (and DOT).
//!
//! Everything here is a pure function of a [`StaticPlan`](memwise_plan::StaticPlan) (and,
//! for the graph, its [`ModelSpec`](memwise_plan::ModelSpec)): no device, no fonts, no
//! Graphviz. The SVG is written by hand with the few elements every renderer agrees on
//! (`rect`, `path`, `line`, `circle`, `text`, `pattern`, `marker`), so browsers, `resvg` and
//! documentation sites draw the same picture.
//!
//! - [`timeline`]: each tensor a band at its arena offset over its lifetime, the phases, the
//!   lower bound / arena / budget lines and the peak with what is alive there; and the same
//!   step axis stacked by role.
//! - [`graph`]: the `plot_model` picture: layers, their output shapes and dtypes, skip edges,
//!   checkpoint segments; and the same graph as Graphviz DOT.

pub mod graph;
pub mod timeline;

use std::fmt::Write as _;

/// The font stack every picture asks for. DejaVu Sans comes first because it is what
/// `resvg` finds on a bare Linux machine; text widths below are estimated for it.
pub(crate) const FONT: &str = "DejaVu Sans, Helvetica, Arial, sans-serif";

/// Bytes with a binary unit, labelled as such: `512 B`, `3.06 KiB`, `41.0 MiB`, `2.40 GiB`.
/// Three significant digits, so two labels that differ in the picture differ in the text.
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [(&str, f64); 4] = [
        ("TiB", 1024.0 * 1024.0 * 1024.0 * 1024.0),
        ("GiB", 1024.0 * 1024.0 * 1024.0),
        ("MiB", 1024.0 * 1024.0),
        ("KiB", 1024.0),
    ];
    let b = bytes as f64;
    for (unit, size) in UNITS {
        if b >= size {
            let v = b / size;
            // Rounding may carry into the next decade (99.96 → "100.0"): decide on the
            // rounded value.
            return if (v * 100.0).round() / 100.0 < 10.0 {
                format!("{v:.2} {unit}")
            } else if (v * 10.0).round() / 10.0 < 100.0 {
                format!("{v:.1} {unit}")
            } else {
                format!("{v:.0} {unit}")
            };
        }
    }
    format!("{bytes} B")
}

/// Escapes text for SVG/XML content and attribute values.
pub(crate) fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// Estimated width of `s` at `size` px in DejaVu Sans (its average advance is about 0.6 em;
/// bold a little wider). Layout only needs this to keep labels from colliding.
pub(crate) fn text_width(s: &str, size: f64, bold: bool) -> f64 {
    let per = if bold { 0.66 } else { 0.6 };
    s.chars().count() as f64 * size * per
}

/// The colour of the `i`-th layer of a model (its index in `plan.memory.layers`). Hues step
/// by the golden angle so that neighbouring layers, which sit next to each other in the
/// timeline, never get similar colours; three lightness levels separate hues that do come
/// round again in deep models. The same index gives the same colour in every picture.
pub fn layer_colour(i: usize) -> String {
    let hue = (i as f64 * 137.507_764 + 210.0) % 360.0;
    let light = [0.50, 0.64, 0.40][i % 3];
    let sat = [0.62, 0.70, 0.55][(i / 3) % 3];
    hsl_hex(hue, sat, light)
}

/// The colour of tensors that belong to no declared layer (the loss terms' values).
pub(crate) const NO_LAYER_COLOUR: &str = "#8c8c8c";

fn hsl_hex(h: f64, s: f64, l: f64) -> String {
    let c = (1.0 - (2.0 * l - 1.0).abs()) * s;
    let hp = h / 60.0;
    let x = c * (1.0 - (hp % 2.0 - 1.0).abs());
    let (r, g, b) = match hp as u32 {
        0 => (c, x, 0.0),
        1 => (x, c, 0.0),
        2 => (0.0, c, x),
        3 => (0.0, x, c),
        4 => (x, 0.0, c),
        _ => (c, 0.0, x),
    };
    let m = l - c / 2.0;
    let to = |v: f64| ((v + m).clamp(0.0, 1.0) * 255.0).round() as u8;
    format!("#{:02x}{:02x}{:02x}", to(r), to(g), to(b))
}

/// A tiny SVG writer: the body is collected first and the root element written last, so a
/// picture can grow downwards (legends) before its height is known.
pub(crate) struct Svg {
    body: String,
    defs: String,
}

/// Horizontal text anchoring.
#[derive(Clone, Copy)]
pub(crate) enum Anchor {
    Start,
    Middle,
    End,
}

impl Anchor {
    fn name(self) -> &'static str {
        match self {
            Anchor::Start => "start",
            Anchor::Middle => "middle",
            Anchor::End => "end",
        }
    }
}

/// How a piece of text looks.
#[derive(Clone, Copy)]
pub(crate) struct Font<'a> {
    pub size: f64,
    pub bold: bool,
    pub fill: &'a str,
    pub anchor: Anchor,
}

impl<'a> Font<'a> {
    pub const fn new(size: f64) -> Self {
        Font {
            size,
            bold: false,
            fill: "#222",
            anchor: Anchor::Start,
        }
    }
    pub const fn bold(mut self) -> Self {
        self.bold = true;
        self
    }
    pub const fn fill(mut self, fill: &'a str) -> Self {
        self.fill = fill;
        self
    }
    pub const fn anchor(mut self, anchor: Anchor) -> Self {
        self.anchor = anchor;
        self
    }
}

impl Svg {
    pub fn new() -> Self {
        Svg {
            body: String::with_capacity(64 * 1024),
            defs: String::new(),
        }
    }

    /// Raw markup (already escaped).
    pub fn raw(&mut self, s: &str) {
        self.body.push_str(s);
    }

    /// Raw markup for `<defs>`.
    pub fn def(&mut self, s: &str) {
        self.defs.push_str(s);
    }

    /// A rectangle; `attrs` is extra raw attributes (`fill="…"` …).
    pub fn rect(&mut self, x: f64, y: f64, w: f64, h: f64, attrs: &str) {
        let _ = write!(
            self.body,
            r#"<rect x="{x:.2}" y="{y:.2}" width="{:.2}" height="{:.2}" {attrs}/>"#,
            w.max(0.0),
            h.max(0.0)
        );
    }

    pub fn line(&mut self, x1: f64, y1: f64, x2: f64, y2: f64, attrs: &str) {
        let _ = write!(
            self.body,
            r#"<line x1="{x1:.2}" y1="{y1:.2}" x2="{x2:.2}" y2="{y2:.2}" {attrs}/>"#
        );
    }

    pub fn text(&mut self, x: f64, y: f64, font: Font<'_>, s: &str) {
        self.text_attrs(x, y, font, "", s);
    }

    /// Text with extra raw attributes (an `id`, a `class`, data attributes for tests).
    pub fn text_attrs(&mut self, x: f64, y: f64, font: Font<'_>, attrs: &str, s: &str) {
        let _ = write!(
            self.body,
            r#"<text x="{x:.2}" y="{y:.2}" font-size="{}" fill="{}"{}{}{}{}>{}</text>"#,
            font.size,
            font.fill,
            if font.bold {
                r#" font-weight="bold""#
            } else {
                ""
            },
            match font.anchor {
                Anchor::Start => String::new(),
                a => format!(r#" text-anchor="{}""#, a.name()),
            },
            if attrs.is_empty() { "" } else { " " },
            attrs,
            esc(s)
        );
    }

    /// The finished document, `width` × `height` px, white background.
    pub fn finish(self, width: f64, height: f64, title: &str) -> String {
        let mut out = String::with_capacity(self.body.len() + self.defs.len() + 512);
        let _ = write!(
            out,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0}" height="{height:.0}" viewBox="0 0 {width:.0} {height:.0}" font-family="{FONT}">"#
        );
        let _ = write!(out, "<title>{}</title>", esc(title));
        if !self.defs.is_empty() {
            let _ = write!(out, "<defs>{}</defs>", self.defs);
        }
        let _ = write!(
            out,
            r##"<rect x="0" y="0" width="{width:.0}" height="{height:.0}" fill="#ffffff"/>"##
        );
        out.push_str(&self.body);
        out.push_str("</svg>\n");
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_are_binary_and_labelled() {
        assert_eq!(format_bytes(0), "0 B");
        assert_eq!(format_bytes(1023), "1023 B");
        assert_eq!(format_bytes(1024), "1.00 KiB");
        assert_eq!(format_bytes(42_963_456), "41.0 MiB");
        assert_eq!(format_bytes(8 * 1024 * 1024), "8.00 MiB");
        assert_eq!(format_bytes(2_582_224_896), "2.40 GiB");
        assert_eq!(format_bytes(1024 * 1024 * 1024 - 1), "1024 MiB");
    }

    #[test]
    fn neighbouring_layers_get_different_colours() {
        let c: Vec<String> = (0..200).map(layer_colour).collect();
        for w in c.windows(2) {
            assert_ne!(w[0], w[1]);
        }
        assert_eq!(layer_colour(7), layer_colour(7));
        assert_eq!(esc("a<b & \"c\""), "a&lt;b &amp; &quot;c&quot;");
    }
}
