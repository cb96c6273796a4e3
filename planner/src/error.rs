//! `PlanError`: why a model cannot be planned, naming the layer at fault.
use std::fmt;

/// A model that cannot be planned. `layer` names the field at fault (the macro puts the
/// error on that field's span); `related` names other fields the message mentions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanError {
    pub layer: Option<String>,
    pub related: Vec<String>,
    pub message: String,
}

impl PlanError {
    pub fn at(layer: &str, message: impl Into<String>) -> Self {
        PlanError {
            layer: Some(layer.to_string()),
            related: Vec::new(),
            message: message.into(),
        }
    }

    pub fn model(message: impl Into<String>) -> Self {
        PlanError {
            layer: None,
            related: Vec::new(),
            message: message.into(),
        }
    }

    pub fn internal(message: impl Into<String>) -> Self {
        PlanError::model(format!(
            "internal planner error (please report): {}",
            message.into()
        ))
    }

    pub fn related(mut self, layers: &[&str]) -> Self {
        self.related = layers.iter().map(|s| s.to_string()).collect();
        self
    }
}

impl fmt::Display for PlanError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.layer {
            Some(l) => write!(f, "layer `{l}`: {}", self.message),
            None => f.write_str(&self.message),
        }
    }
}

impl std::error::Error for PlanError {}
