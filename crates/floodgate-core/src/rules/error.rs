//! Positioned configuration errors.

use std::fmt;
use std::path::PathBuf;

use super::Pos;

/// One problem in a rules file: where, which field, what is wrong and what to
/// write instead.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// The file.
    pub file: PathBuf,
    /// Line and column in it (0:0 when the problem is the whole file).
    pub pos: Pos,
    /// The field, as a path (`descriptors[0].rate_limit.unit`); empty for the
    /// file itself.
    pub field: String,
    /// What is wrong and what to write instead.
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.file.display())?;
        if self.pos.line > 0 {
            write!(f, ":{}", self.pos)?;
        }
        if !self.field.is_empty() {
            write!(f, ": {}", self.field)?;
        }
        write!(f, ": {}", self.message)
    }
}

impl std::error::Error for ConfigError {}

/// Every problem found in a rule set (never empty).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl ConfigErrors {
    /// The errors in file order, then by position.
    pub(crate) fn sorted(mut errors: Vec<ConfigError>) -> Self {
        errors.sort_by(|a, b| (&a.file, a.pos).cmp(&(&b.file, b.pos)));
        Self(errors)
    }
}

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigErrors {}
