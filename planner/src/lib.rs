//! The memory planner: from a model description to a validated static memory plan. Needs no device.
