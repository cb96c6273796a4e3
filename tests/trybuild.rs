//! The DSL's compile-time behaviour: `tests/ui/*.rs` must fail with exactly the `.stderr`
//! beside them, `tests/pass/*.rs` must compile and run.
#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/*.rs");
    t.pass("tests/pass/*.rs");
}
