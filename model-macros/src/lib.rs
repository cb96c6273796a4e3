//! `#[memwise::model]`: parses an annotated struct into a model spec and emits its static plan.
use proc_macro::TokenStream;

#[proc_macro_attribute]
pub fn model(_attr: TokenStream, item: TokenStream) -> TokenStream {
    item
}
