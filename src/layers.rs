//! Layer handles: the field types of a `#[memwise::model]` struct, one per layer of the
//! planner's catalogue (`memwise::plan::layers`). Each holds its layer's name in the plan
//! and the ids and names of its parameters, so a model struct is an ordinary value
//! (`MyNet::layers()`) that the runtime uses to find weights.

/// One parameter of a layer: its id in `StaticPlan::params` and its name (`hidden.weight`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Param {
    pub id: u32,
    pub name: &'static str,
}

impl Param {
    #[doc(hidden)]
    pub const fn new(id: u32, name: &'static str) -> Self {
        Param { id, name }
    }
}

/// What every layer handle offers.
pub trait Layer: Copy {
    /// The DSL attribute of this layer (`dense`, `conv2d` …).
    const KIND: &'static str;
    /// The layer's name in the plan: the field name, `field.3` in an array, `field.inner`
    /// inside a block.
    fn name(&self) -> &'static str;
    /// Its parameters (weights, biases, statistics), possibly none.
    fn params(&self) -> &'static [Param];
}

macro_rules! handles {
    ($($(#[$doc:meta])* $ty:ident = $kind:literal;)*) => {$(
        $(#[$doc])*
        #[doc = concat!("\n\nThe field type for `#[", $kind, "(…)]`.")]
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub struct $ty {
            name: &'static str,
            params: &'static [Param],
        }

        impl $ty {
            #[doc(hidden)]
            pub const fn __new(name: &'static str, params: &'static [Param]) -> Self {
                $ty { name, params }
            }

            /// The layer's name in the plan.
            pub const fn name(&self) -> &'static str {
                self.name
            }

            /// Its parameters.
            pub const fn params(&self) -> &'static [Param] {
                self.params
            }
        }

        impl Layer for $ty {
            const KIND: &'static str = $kind;
            fn name(&self) -> &'static str {
                self.name
            }
            fn params(&self) -> &'static [Param] {
                self.params
            }
        }
    )*};
}

// One handle type per layer of the planner's catalogue (`memwise::plan::layers`), with its
// doc line from there.
memwise_macros::__layer_handles!(handles);
