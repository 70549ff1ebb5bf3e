//! Errors of the engine, each mapping to one exit code class of the CLI.

use crate::diagnostic::Diagnostic;
use std::path::PathBuf;

/// What can go wrong in the engine.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// An input file holds a wrong or impossible value.
    #[error("{0}")]
    Config(Box<Diagnostic>),
    /// An input file cannot be read.
    #[error("cannot read {}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A command-line argument names nothing the workspace or the presets know.
    #[error("{what} `{name}` is not known: expected {expected}")]
    Unknown {
        /// Kind of thing (`target`, `model`, `cluster`).
        what: &'static str,
        /// The name given.
        name: String,
        /// What would have been accepted.
        expected: String,
    },
    /// A command-line value is malformed.
    #[error("{flag}: expected {expected}, found {found}")]
    Argument {
        /// The flag.
        flag: &'static str,
        /// What a valid value looks like.
        expected: String,
        /// The value given.
        found: String,
    },
    /// A layout given on the command line cannot run.
    #[error(transparent)]
    Layout(#[from] autopar_rules::plan::layout::LayoutError),
    /// A framework cannot express a plan (a dimension, sharding mode or split it lacks).
    #[error("{framework} cannot express this plan: {what}")]
    Inexpressible {
        /// The framework.
        framework: &'static str,
        /// What it lacks.
        what: String,
    },
    /// The problem has no solution (memory cap, devices); the message says which constraint.
    #[error("{0}")]
    Infeasible(String),
    /// A plan was asked for that was never built.
    #[error("no plan for target `{target}` at {}: run `autopar build {target}` first", path.display())]
    NoPlan {
        /// The target.
        target: String,
        /// Where the plan would be.
        path: PathBuf,
    },
    /// An output could not be encoded (a bug: every output is plain data).
    #[error("cannot encode {}: {reason}", path.display())]
    Encode {
        /// The file it was for.
        path: PathBuf,
        /// The encoder's error.
        reason: String,
    },
    /// A plan file exists but cannot be read back.
    #[error("plan file {} is unreadable: {reason}", path.display())]
    BadPlan {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// Writing an output failed.
    #[error(transparent)]
    Store(#[from] autopar_store::StoreError),
    /// A plan cannot be lowered or run by the executor.
    #[error(transparent)]
    Exec(#[from] crate::executor::ExecError),
    /// An error the incremental database keeps (the same workspace error, asked for again).
    #[error(transparent)]
    Shared(std::sync::Arc<EngineError>),
}

impl EngineError {
    /// An input error located by `d`.
    pub fn config(d: Diagnostic) -> Self {
        EngineError::Config(Box::new(d))
    }

    /// The error itself, seen through [`EngineError::Shared`].
    pub fn inner(&self) -> &EngineError {
        match self {
            EngineError::Shared(e) => e.inner(),
            other => other,
        }
    }

    /// Whether the error is the user's input (exit code 2) rather than a failed operation.
    pub fn is_input_error(&self) -> bool {
        matches!(
            self.inner(),
            EngineError::Config(_)
                | EngineError::Read { .. }
                | EngineError::Unknown { .. }
                | EngineError::Argument { .. }
                | EngineError::Layout(_)
                | EngineError::BadPlan { .. }
        ) || matches!(
            self.inner(),
            EngineError::Exec(
                crate::executor::ExecError::Unavailable(_)
                    | crate::executor::ExecError::Lower(_)
                    | crate::executor::ExecError::TooLarge(_)
            )
        )
    }
}
