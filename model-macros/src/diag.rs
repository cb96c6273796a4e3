//! Diagnostics: an error list that keeps going after the first mistake, and "did you mean".
use proc_macro2::TokenStream;
use quote::ToTokens;

/// Errors collected while reading a model, reported together (rustc shows each at its span).
#[derive(Default)]
pub struct Errors {
    list: Vec<syn::Error>,
}

impl Errors {
    pub fn push(&mut self, e: syn::Error) {
        // A block used twelve times would report the same mistake twelve times.
        let text = e.to_string();
        if !self.list.iter().any(|x| x.to_string() == text) {
            self.list.push(e);
        }
    }

    pub fn at(&mut self, tokens: impl ToTokens, message: impl std::fmt::Display) {
        self.push(syn::Error::new_spanned(tokens, message));
    }

    /// Records the error of `r` and returns its value, if any.
    pub fn ok<T>(&mut self, r: syn::Result<T>) -> Option<T> {
        match r {
            Ok(v) => Some(v),
            Err(e) => {
                for one in e {
                    self.push(one);
                }
                None
            }
        }
    }

    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    pub fn to_compile_errors(&self) -> TokenStream {
        self.list.iter().map(syn::Error::to_compile_error).collect()
    }
}

/// Edit distance with adjacent transpositions (optimal string alignment), for suggestions:
/// `rleu` is one edit from `relu`.
pub fn edit_distance(a: &str, b: &str) -> usize {
    let (a, b): (Vec<char>, Vec<char>) = (a.chars().collect(), b.chars().collect());
    let mut d = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for (i, row) in d.iter_mut().enumerate() {
        row[0] = i;
    }
    for (j, cell) in d[0].iter_mut().enumerate() {
        *cell = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            d[i][j] = (d[i - 1][j] + 1)
                .min(d[i][j - 1] + 1)
                .min(d[i - 1][j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                d[i][j] = d[i][j].min(d[i - 2][j - 2] + 1);
            }
        }
    }
    d[a.len()][b.len()]
}

/// The closest candidate within a third of the word's length (at least 1, at most 3 edits).
pub fn closest<'a>(word: &str, candidates: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    let word_l = word.to_ascii_lowercase();
    let limit = (word.len() / 3).clamp(1, 3);
    let mut best: Option<(usize, &str)> = None;
    for c in candidates {
        let d = edit_distance(&word_l, c);
        if d <= limit && best.is_none_or(|(bd, _)| d < bd) {
            best = Some((d, c));
        }
    }
    best.map(|(_, c)| c)
}

/// `; did you mean `x`?` or nothing.
pub fn did_you_mean<'a>(word: &str, candidates: impl IntoIterator<Item = &'a str>) -> String {
    match closest(word, candidates) {
        Some(c) => format!("; did you mean `{c}`?"),
        None => String::new(),
    }
}

/// `a`, `b` and `c`
pub fn list_names<'a>(names: impl IntoIterator<Item = &'a str>) -> String {
    let names: Vec<String> = names.into_iter().map(|n| format!("`{n}`")).collect();
    match names.len() {
        0 => String::new(),
        1 => names[0].clone(),
        n => format!("{} and {}", names[..n - 1].join(", "), names[n - 1]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suggests_close_names() {
        assert_eq!(edit_distance("dens", "dense"), 1);
        assert_eq!(edit_distance("rleu", "relu"), 1);
        assert_eq!(closest("adma", ["adam", "sgd"]), Some("adam"));
        assert_eq!(closest("dens", ["dense", "conv2d"]), Some("dense"));
        assert_eq!(closest("conv2", ["dense", "conv2d"]), Some("conv2d"));
        assert_eq!(closest("Dense", ["dense"]), Some("dense"));
        assert_eq!(closest("transformer", ["dense", "conv2d"]), None);
        assert_eq!(list_names(["a", "b", "c"]), "`a`, `b` and `c`");
    }
}
