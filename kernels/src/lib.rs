//! CPU kernels (and CUDA sources) for every op the planner emits; they know nothing of plans.
