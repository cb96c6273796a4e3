//! The runtime: devices, the arena, the executor that walks a static plan.
pub mod data;
